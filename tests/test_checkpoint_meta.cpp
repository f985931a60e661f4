// A checkpoint directory seen from outside a run (issue 21): meta.json refused for every damage
// before any byte of tensor data is read (parse_meta takes the file sizes, never the files),
// list_checkpoints saying what each entry is and why, prune_checkpoints keeping the only copy of
// a step, and verify_checkpoint reading every byte.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoint/meta.h"
#include "checkpoint/optimizer_state.h"
#include "fsdp/checkpoint.h"
#include "fsdp/error.h"
#include "models.h"
#include "testing.h"

using namespace fsdp;
using namespace fsdp::testing;
namespace fs = std::filesystem;

namespace {

// One real checkpoint (2 ranks, FULL_SHARD, AdamW, one step), made once.
const std::string& good() {
  static TempDir tmp;
  static const std::string path = [] {
    const std::string p = checkpoint_path(tmp.path(), 1);
    run_ranks(2, [&](Runtime& rt) {
      torch::manual_seed(7);
      auto model = shard(std::make_shared<NetImpl>(), FSDPStrategy(),
                         std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
      torch::optim::AdamW opt(model.parameters(), 1e-2);
      auto loss = loss_of(model(torch::randint(17, {4, 5})), torch::randint(7, {4, 5}));
      loss.backward();
      opt.step();
      TrainingState ts;
      ts.step = 1;
      save_checkpoint(p, model, &opt, ts);
    });
    return p;
  }();
  return path;
}

std::string text_of(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// parse_meta of the good meta.json edited by `fn`, with the good files' sizes and no files at
// all: the checkpoint path given does not exist, so nothing can be read.
void parse_edited(const std::function<void(nlohmann::json&)>& fn) {
  auto j = nlohmann::json::parse(text_of(good() + "/meta.json"));
  std::map<std::string, int64_t> sizes;
  for (const auto& f : j["files"]) sizes[f["name"]] = f["bytes"];
  fn(j);
  fsdp::detail::parse_meta(j.dump(), "/nonexistent/step-00000001", [&](const std::string& name) {
    auto it = sizes.find(name);
    return it == sizes.end() ? int64_t(-1) : it->second;
  });
}

void expect_refused(const std::function<void(nlohmann::json&)>& fn, const std::string& expected) {
  try {
    parse_edited(fn);
    ADD_FAILURE() << "accepted; expected: " << expected;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
}

TEST(CheckpointMeta, EveryDamageIsRefusedBeforeAnyByteIsRead) {
  parse_edited([](nlohmann::json&) {});  // the untouched meta.json is accepted
  const int64_t big = int64_t(1) << 40;
  expect_refused([](auto& j) { j["format_version"] = 999; },
                 "was written by format 999; this fsdp.cpp reads up to 2");
  expect_refused([](auto& j) { j["format_version"] = 0; }, "has an invalid format version 0");
  expect_refused([](auto& j) { j["files"][0]["name"] = "../../../etc/passwd"; },
                 "lists an invalid file '../../../etc/passwd'");
  expect_refused([](auto& j) { j["files"][0]["name"] = "/etc/passwd"; },
                 "lists an invalid file '/etc/passwd'");
  expect_refused([](auto& j) { j["files"][0]["name"] = ".."; }, "lists an invalid file '..'");
  expect_refused([](auto& j) { j["files"][1]["name"] = j["files"][0]["name"]; },
                 "(negative size or listed twice)");
  expect_refused([&](auto& j) { j["tensors"][0]["chunks"][0]["offset"] = big; },
                 "has a chunk outside its tensor or file 'shard-0.bin'");
  expect_refused([](auto& j) { j["tensors"][0]["chunks"][0]["offset"] = -8; },
                 "has a chunk outside its tensor or file");
  expect_refused([](auto& j) { j["tensors"][0]["chunks"][0]["end"] = int64_t(1) << 50; },
                 "has a chunk outside its tensor or file");
  expect_refused([](auto& j) { j["tensors"][0]["shape"] = {-1, 33}; }, "has an invalid shape");
  expect_refused([&](auto& j) { j["tensors"][0]["shape"] = {big, big}; }, "has an invalid shape");
  expect_refused([](auto& j) { j["tensors"][0]["shape"] = {1e300}; }, "has an invalid 'shape'");
  expect_refused([](auto& j) { j["tensors"][0]["chunks"][0]["crc32c"] = -1; },
                 "has an invalid 'crc32c'");
  expect_refused([](auto& j) { j["files"][0]["bytes"] = 7; },
                 "'shard-0.bin' has ");  // the recorded size against the real one
  expect_refused([](auto& j) { j["files"][0]["name"] = "shard-9.bin"; },
                 "is missing 'shard-9.bin'");
  expect_refused([](auto& j) { j["rng"]["world_size"] = int64_t(1) << 62; },
                 "rng holds the states of 4611686018427387904 ranks but the checkpoint was "
                 "written by 2");
  expect_refused([](auto& j) { j["rng"]["bytes_per_rank"] = 3; }, "rng sizes are inconsistent");
  expect_refused([](auto& j) { j["tensors"] = 5; }, "has no list 'tensors'");
  expect_refused([](auto& j) { j = nlohmann::json::array(); }, "is not valid JSON");
  try {
    fsdp::detail::parse_meta("", "/nonexistent/step-00000001", [](const std::string&) { return 0; });
    ADD_FAILURE() << "an empty meta.json was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("meta.json is not valid JSON (it is empty)"),
              std::string::npos) << e.what();
  }
}

// The index in the good meta.json's tensors of (kind, name[, field]).
size_t entry_index(const nlohmann::json& j, const std::string& kind, const std::string& name,
                   const std::string& field = "") {
  for (size_t i = 0; i < j["tensors"].size(); ++i) {
    const auto& t = j["tensors"][i];
    if (t["kind"] == kind && t["name"] == name && (field.empty() || t["field"] == field)) return i;
  }
  throw std::runtime_error("no " + kind + " " + name + " " + field + " in the good meta.json");
}

// Issue 38: entries that are each fine but together are not the whole state.
TEST(CheckpointMeta, AnIncompleteOrDoubledManifestIsRefused) {
  const std::string w = "checkpoint '/nonexistent/step-00000001': meta.json";
  const auto erase = [](const std::string& kind, const std::string& name, const std::string& field) {
    return [=](nlohmann::json& j) {
      j["tensors"].erase(j["tensors"].begin() +
                         static_cast<std::ptrdiff_t>(entry_index(j, kind, name, field)));
    };
  };
  expect_refused(erase("optim", "head.weight", "exp_avg"),
                 w + " has no 'exp_avg' of 'head.weight' (every parameter with adamw state has one);"
                     " the checkpoint is incomplete: use an earlier one");
  expect_refused(erase("optim", "head.weight", "exp_avg_sq"), " has no 'exp_avg_sq' of 'head.weight'");
  expect_refused(erase("param", "head.weight", ""),
                 " has optimizer state 'exp_avg' of 'head.weight' but no parameter 'head.weight'");
  expect_refused([](nlohmann::json& j) {
                   const auto i = entry_index(j, "optim", "head.weight", "exp_avg");
                   j["tensors"].push_back(j["tensors"][i]);
                 },
                 w + " lists optim/exp_avg/head.weight twice; the checkpoint is inconsistent");
  expect_refused([](nlohmann::json& j) {
                   j["tensors"].push_back(j["tensors"][entry_index(j, "param", "head.weight")]);
                 },
                 " lists param/head.weight twice");
  expect_refused([](nlohmann::json& j) {
                   j["tensors"][entry_index(j, "param", "head.weight")]["optim_step"] = nullptr;
                 },
                 " has no optimizer step of 'head.weight' (adamw state has one)");
  expect_refused([](nlohmann::json& j) {
                   j["tensors"][entry_index(j, "param", "head.weight")]["optim_state"] = false;
                 },
                 " has optimizer state 'exp_avg' of 'head.weight', whose parameter entry says it "
                 "has none");
  expect_refused([](nlohmann::json& j) {
                   j["tensors"][entry_index(j, "optim", "head.weight", "exp_avg")]["field"] = "sum";
                 },
                 " has optimizer state 'sum' of 'head.weight', a field adamw does not store");
  expect_refused([](nlohmann::json& j) {  // same element count, another shape
                   auto& t = j["tensors"][entry_index(j, "optim", "head.weight", "exp_avg")];
                   auto shape = t["shape"].get<std::vector<int64_t>>();
                   t["shape"] = std::vector<int64_t>(shape.rbegin(), shape.rend());
                 },
                 "but the parameter's shape is");
  expect_refused([](nlohmann::json& j) { j["optimizer"] = nullptr; }, "but no optimizer");
  expect_refused([](nlohmann::json& j) { j["optimizer"]["type"] = "lion"; },
                 "holds state of optimizer 'lion', which this fsdp.cpp does not know");
  expect_refused([](nlohmann::json& j) { j["rng"]["world_size"] = 1; },
                 w + " rng holds the states of 1 ranks but the checkpoint was written by 2");
  expect_refused([](nlohmann::json& j) {  // a chunk moved onto its neighbour's bytes
                   j["tensors"][1]["chunks"][0]["offset"] =
                       j["tensors"][1]["chunks"][0]["offset"].get<int64_t>() - 4;
                 },
                 "of 'shard-0.bin', inside the chunk before it");
  expect_refused([](nlohmann::json& j) {  // and off its start: the bytes it left are nobody's
                   j["tensors"][0]["chunks"][0]["offset"] =
                       j["tensors"][0]["chunks"][0]["offset"].get<int64_t>() + 4;
                 },
                 ": bytes 0-4 of 'shard-0.bin' belong to no tensor");
  // A whole tensor gone with its state: its file bytes belong to nobody.
  expect_refused([](nlohmann::json& j) {
                   for (const char* f : {"exp_avg_sq", "exp_avg", ""}) {
                     const std::string kind = *f ? "optim" : "param";
                     j["tensors"].erase(j["tensors"].begin() + static_cast<std::ptrdiff_t>(
                                                                   entry_index(j, kind, "head.weight", f)));
                   }
                 },
                 "belong to no tensor (an entry or chunk is missing)");
  // "rng": null is a checkpoint that says it holds no RNG: complete without rng.bin.
  parse_edited([](nlohmann::json& j) {
    j["rng"] = nullptr;
    for (size_t k = 0; k < j["files"].size(); ++k) {
      if (j["files"][k]["name"] == "rng.bin") j["files"].erase(j["files"].begin() + static_cast<std::ptrdiff_t>(k));
    }
  });
}

// The fields manifest.cpp requires of each optimizer type are the ones optimizer_state.cpp saves.
TEST(CheckpointMeta, SavedFieldsAreTheOptimizersFields) {
  auto p = torch::zeros({2}, torch::requires_grad());
  std::vector<std::unique_ptr<torch::optim::Optimizer>> opts;
  opts.push_back(std::make_unique<torch::optim::AdamW>(std::vector<at::Tensor>{p}));
  opts.push_back(std::make_unique<torch::optim::Adam>(std::vector<at::Tensor>{p}));
  opts.push_back(std::make_unique<torch::optim::RMSprop>(std::vector<at::Tensor>{p}));
  opts.push_back(std::make_unique<torch::optim::Adagrad>(std::vector<at::Tensor>{p}));
  opts.push_back(std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{p},
                                                     torch::optim::SGDOptions(0.1)));
  ASSERT_EQ(opts.size(), fsdp::detail::saved_optimizers().size());
  for (const auto& o : opts) {
    const auto kind = fsdp::detail::optimizer_kind(*o);
    const fsdp::detail::SavedOptimizer* saved = nullptr;
    for (const auto& s : fsdp::detail::saved_optimizers()) {
      if (s.type == kind.name) saved = &s;
    }
    ASSERT_NE(saved, nullptr) << kind.name;
    std::set<std::string> fields, table(saved->required.begin(), saved->required.end());
    table.insert(saved->optional.begin(), saved->optional.end());
    for (const auto& f : kind.fields) fields.insert(f.name);
    EXPECT_EQ(fields, table) << kind.name;
    EXPECT_EQ(saved->step, static_cast<bool>(kind.get_step)) << kind.name;
  }
}

TEST(CheckpointMeta, ListSaysWhatEachEntryIsAndWhy) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  fs::create_directories(dir);
  fs::copy(good(), checkpoint_path(dir, 1), fs::copy_options::recursive);
  fs::copy(good(), checkpoint_path(dir, 2), fs::copy_options::recursive);
  fs::remove(checkpoint_path(dir, 2) + "/shard-1.bin");
  fs::create_directories(checkpoint_path(dir, 3) + ".partial");
  fs::create_directories(dir + "/not-a-checkpoint");
  auto list = list_checkpoints(dir);
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].status, CheckpointStatus::kComplete);
  EXPECT_EQ(list[0].path, checkpoint_path(dir, 1));
  EXPECT_EQ(list[1].status, CheckpointStatus::kInvalid);
  EXPECT_EQ(list[1].step, 2);
  EXPECT_NE(list[1].reason.find("is missing 'shard-1.bin'"), std::string::npos) << list[1].reason;
  EXPECT_EQ(list[2].status, CheckpointStatus::kPartial);
  EXPECT_STREQ(to_string(list[2].status), "partial");
  EXPECT_EQ(latest_checkpoint(dir), checkpoint_path(dir, 1));
  // A re-save of step 4 that died between its two renames left only step-4.old: the newest.
  fs::copy(good(), checkpoint_path(dir, 4) + ".old", fs::copy_options::recursive);
  EXPECT_EQ(latest_checkpoint(dir), checkpoint_path(dir, 4) + ".old");
  EXPECT_TRUE(list_checkpoints(tmp / "missing").empty());
}

TEST(CheckpointMeta, PruneKeepsTheOnlyCopyAndTheEvidence) {
  TempDir tmp;
  const std::string dir = tmp.path();
  for (int s : {1, 2}) fs::copy(good(), checkpoint_path(dir, s), fs::copy_options::recursive);
  fs::copy(good(), checkpoint_path(dir, 2) + ".old", fs::copy_options::recursive);  // a leftover
  fs::copy(good(), checkpoint_path(dir, 3) + ".old", fs::copy_options::recursive);  // the only copy
  fs::copy(good(), checkpoint_path(dir, 5), fs::copy_options::recursive);
  fs::remove(checkpoint_path(dir, 5) + "/meta.json");  // invalid: kept as evidence
  fs::create_directories(checkpoint_path(dir, 6) + ".partial");
  prune_checkpoints(dir, 2);
  EXPECT_FALSE(fs::exists(checkpoint_path(dir, 1)));
  EXPECT_TRUE(fs::exists(checkpoint_path(dir, 2)));
  EXPECT_FALSE(fs::exists(checkpoint_path(dir, 2) + ".old"));
  EXPECT_TRUE(fs::exists(checkpoint_path(dir, 3) + ".old")) << "deleted the only copy of step 3";
  EXPECT_TRUE(fs::exists(checkpoint_path(dir, 5)));
  EXPECT_FALSE(fs::exists(checkpoint_path(dir, 6) + ".partial"));
}

TEST(CheckpointMeta, VerifyReadsEveryByte) {
  const CheckpointSummary s = verify_checkpoint(good());
  EXPECT_EQ(s.step, 1);
  EXPECT_EQ(s.strategy, "FULL_SHARD");
  EXPECT_EQ(s.mesh, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(s.world_size, 2);
  EXPECT_EQ(s.optimizer, "adamw");
  EXPECT_TRUE(s.rng);
  EXPECT_EQ(s.files, 4);
  int64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(good())) bytes += static_cast<int64_t>(e.file_size());
  EXPECT_EQ(s.bytes, bytes);
  TempDir tmp;
  for (const std::string file : {"shard-1.bin", "rng.bin"}) {
    const std::string copy = tmp / file;
    fs::copy(good(), copy, fs::copy_options::recursive);
    {
      std::fstream f(copy + "/" + file, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(3);
      f.put('\x7f');
    }
    EXPECT_EQ(list_checkpoints(tmp.path()).size(), 0u);  // not named step-N: no entry
    try {
      verify_checkpoint(copy);
      ADD_FAILURE() << "a flipped byte in " << file << " was not found";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + file + "' is corrupted"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
