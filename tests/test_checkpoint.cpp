// Checkpoints (fsdp/checkpoint.h), ranks as threads over Gloo: round trips for every strategy,
// bit-identical resume, resharding to other meshes with optimizer state, dedup under hybrid
// sharding, full checkpoints read by Python's torch.load and as safetensors, and every bad input
// failing on every rank.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <zlib.h>

#include "checkpoint/crc32c.h"
#include "base/compat.h"
#include "fsdp/checkpoint.h"
#include "fsdp/error.h"
#include "models.h"
#include "testing.h"

using namespace fsdp;
using namespace fsdp::testing;
namespace fs = std::filesystem;

namespace {

// 24 sequences per step split over any world of 1, 2, 3, 4, 6 or 8 ranks.
constexpr int64_t kGlobal = 24, kSeq = 5, kVocab = 17, kClasses = 7, kSteps = 7, kSaveAt = 2;

struct Data {
  torch::Tensor tokens, targets;  // [kSteps, kGlobal, kSeq]
};

const Data& data() {
  static const Data d = [] {
    torch::Generator gen = at::detail::createCPUGenerator(99);
    Data d;
    d.tokens = torch::randint(kVocab, {kSteps, kGlobal, kSeq}, gen);
    d.targets = torch::randint(kClasses, {kSteps, kGlobal, kSeq}, gen);
    return d;
  }();
  return d;
}

std::shared_ptr<NetImpl> make_net() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(7);
  return std::make_shared<NetImpl>();
}

std::shared_ptr<Runtime> borrow(Runtime& rt) { return std::shared_ptr<Runtime>(&rt, [](Runtime*) {}); }


// One optimizer step on this rank's slice of step `step`; returns the global mean loss.
double train_step(ShardedModule<NetImpl>& model, torch::optim::Optimizer& opt, Runtime& rt,
                  int64_t step) {
  const int64_t W = rt.world_size(), B = kGlobal / W, r = rt.rank();
  opt.zero_grad();
  auto loss = loss_of(model(data().tokens[step].narrow(0, r * B, B)),
                      data().targets[step].narrow(0, r * B, B));
  loss.backward();
  opt.step();
  auto l = loss.detach().reshape({1}).clone();
  if (W > 1) rt.world()->all_reduce(l)->wait();
  return l.item<double>() / double(W);
}

torch::optim::AdamW make_adamw(ShardedModule<NetImpl>& model) {
  return torch::optim::AdamW(model.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

FSDPStrategy strategy(ShardingStrategy s, std::vector<int64_t> mesh) {
  return FSDPStrategy().sharding_strategy(s).device_mesh(std::move(mesh));
}

int64_t world_of(const std::vector<int64_t>& mesh) {
  int64_t w = 1;
  for (auto v : mesh) w *= v;
  return w;
}

using State = std::map<std::string, torch::Tensor>;
State to_state(const torch::OrderedDict<std::string, torch::Tensor>& d) {
  State s;
  for (const auto& kv : d) s[kv.key()] = kv.value().clone();
  return s;
}

// Trains kSaveAt steps on `mesh`, saves to `dir`, trains to kSteps: the losses of every step and
// the final full state (an uninterrupted run with a save in the middle).
struct TrainRun {
  std::vector<double> losses;
  State final_state;
  std::vector<int64_t> bytes_read;  // resume: CheckpointInfo::bytes per rank
};

TrainRun train_and_save(const FSDPStrategy& st, int64_t W, const std::string& dir) {
  TrainRun run;
  std::mutex mu;
  run_ranks(W, [&](Runtime& rt) {
    auto model = shard(make_net(), st, borrow(rt));
    auto opt = make_adamw(model);
    std::vector<double> losses;
    for (int64_t step = 0; step < kSteps; ++step) {
      losses.push_back(train_step(model, opt, rt, step));
      if (step + 1 == kSaveAt) {
        TrainingState ts;
        ts.step = kSaveAt;
        ts.values["note"] = "saved after step 2";
        save_checkpoint(dir, model, &opt, ts);
      }
    }
    auto sd = model.state_dict();
    std::lock_guard<std::mutex> lock(mu);
    if (rt.rank() == 0) {
      run.losses = losses;
      run.final_state = to_state(sd);
    }
  });
  return run;
}

// Loads `dir` on `mesh` into a fresh model and optimizer and trains from kSaveAt to kSteps.
TrainRun resume(const FSDPStrategy& st, int64_t W, const std::string& dir) {
  TrainRun run;
  std::mutex mu;
  run_ranks(W, [&](Runtime& rt) {
    torch::manual_seed(1000 + rt.rank());  // different init: the checkpoint must overwrite it
    auto model = shard(std::make_shared<NetImpl>(), st, borrow(rt));
    auto opt = make_adamw(model);
    TrainingState ts;
    const CheckpointInfo info = load_checkpoint(dir, model, &opt, &ts);
    {
      std::lock_guard<std::mutex> lock(mu);
      run.bytes_read.resize(static_cast<size_t>(W));
      run.bytes_read[static_cast<size_t>(rt.rank())] = info.bytes;
    }
    EXPECT_EQ(ts.step, kSaveAt);
    EXPECT_EQ(ts.values.at("note"), "saved after step 2");
    std::vector<double> losses;
    for (int64_t step = ts.step; step < kSteps; ++step) losses.push_back(train_step(model, opt, rt, step));
    auto sd = model.state_dict();
    std::lock_guard<std::mutex> lock(mu);
    if (rt.rank() == 0) {
      run.losses = losses;
      run.final_state = to_state(sd);
    }
  });
  return run;
}

void expect_close(const State& got, const State& want, double atol, double rtol, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (const auto& [name, b] : want) {
    const torch::Tensor& a = got.at(name);
    auto diff = (a - b).abs();
    if ((diff > atol + rtol * b.abs()).any().item<bool>()) {
      ADD_FAILURE() << where << ": " << name << " differs: max abs " << diff.max().item<double>()
                    << " (bound " << atol << " + " << rtol << "|b|)";
    }
  }
}

// ---------------------------------------------------------------------------------------------

struct Case {
  ShardingStrategy strategy;
  std::vector<int64_t> mesh;
};

class RoundTrip : public ::testing::TestWithParam<Case> {};

// Stopping after step 2 and resuming on the same mesh gives bit-identical losses and weights.
TEST_P(RoundTrip, ResumeIsBitIdentical) {
  const Case c = GetParam();
  const int64_t W = world_of(c.mesh);
  TempDir tmp;
  const std::string dir = tmp / "step-00000002";
  const TrainRun full = train_and_save(strategy(c.strategy, c.mesh), W, dir);
  const TrainRun resumed = resume(strategy(c.strategy, c.mesh), W, dir);
  ASSERT_EQ(resumed.losses.size(), size_t(kSteps - kSaveAt));
  for (size_t i = 0; i < resumed.losses.size(); ++i) {
    EXPECT_EQ(resumed.losses[i], full.losses[kSaveAt + i]) << "step " << kSaveAt + i + 1;
  }
  expect_close(resumed.final_state, full.final_state, 0, 0, "final weights");
  // One pass (NOTE [one-pass load]): on the same mesh each rank reads the file its shard index
  // wrote (rank r has shard index r % S; one replica writes S files), each byte once, nothing
  // else.
  int64_t files = 0;
  while (std::filesystem::exists(dir + "/shard-" + std::to_string(files) + ".bin")) ++files;
  ASSERT_GT(files, 0);
  ASSERT_EQ(resumed.bytes_read.size(), size_t(W));
  for (int64_t r = 0; r < W; ++r) {
    const auto own = std::filesystem::file_size(dir + "/shard-" + std::to_string(r % files) + ".bin");
    EXPECT_EQ(resumed.bytes_read[static_cast<size_t>(r)], static_cast<int64_t>(own)) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllStrategies, RoundTrip,
    ::testing::Values(Case{ShardingStrategy::kFullShard, {4}},
                      Case{ShardingStrategy::kShardGradOp, {4}},
                      Case{ShardingStrategy::kNoShard, {4}},
                      Case{ShardingStrategy::kHybridShard, {2, 2}},
                      Case{ShardingStrategy::kHybridShardZero2, {2, 2}}),
    [](const auto& info) { return std::string(to_string(info.param.strategy)); });

// A checkpoint saved on (2, 2) HYBRID_SHARD continues on other meshes, strategies and world
// sizes with the same losses (fp32 relative 1e-5) as the uninterrupted run.
class Reshard : public ::testing::TestWithParam<Case> {};

TEST_P(Reshard, ContinuesWithTheSameLosses) {
  static TempDir tmp;
  static const std::string dir = tmp / "step-00000002";
  static const TrainRun full = train_and_save(strategy(ShardingStrategy::kHybridShard, {2, 2}), 4, dir);
  const Case c = GetParam();
  const TrainRun resumed = resume(strategy(c.strategy, c.mesh), world_of(c.mesh), dir);
  ASSERT_EQ(resumed.losses.size(), size_t(kSteps - kSaveAt));
  for (size_t i = 0; i < resumed.losses.size(); ++i) {
    const double want = full.losses[kSaveAt + i];
    EXPECT_LE(std::abs(resumed.losses[i] - want), 1e-5 * std::abs(want)) << "step " << kSaveAt + i + 1;
  }
  // AdamW amplifies last-bit differences of the reduction order (see test_engine's tolerance).
  expect_close(resumed.final_state, full.final_state, 2e-5, 1e-5, "final weights");
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, Reshard,
    ::testing::Values(Case{ShardingStrategy::kFullShard, {1, 4}},
                      Case{ShardingStrategy::kNoShard, {1}},
                      Case{ShardingStrategy::kHybridShard, {4, 2}},
                      Case{ShardingStrategy::kFullShard, {1, 3}},
                      Case{ShardingStrategy::kShardGradOp, {6}},
                      Case{ShardingStrategy::kHybridShardZero2, {2, 1}}),
    [](const auto& info) {
      std::string s = to_string(info.param.strategy);
      for (auto v : info.param.mesh) s += "_" + std::to_string(v);
      return s;
    });

// Another wrap policy (blocks inside the root unit) loads the same checkpoint.
TEST(Checkpoint, LoadsIntoAnotherWrapPolicy) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const TrainRun full = train_and_save(strategy(ShardingStrategy::kFullShard, {2}), 2, dir);
  const TrainRun resumed = resume(strategy(ShardingStrategy::kFullShard, {2}).auto_wrap_policy(WrapPolicy::min_params(int64_t(1) << 40)),
                             2, dir);
  for (size_t i = 0; i < resumed.losses.size(); ++i) {
    EXPECT_NEAR(resumed.losses[i], full.losses[kSaveAt + i], 1e-5 * full.losses[kSaveAt + i]);
  }
}

// With R replicas of S shards only one replica writes: the shard files hold exactly one copy of
// the parameters and AdamW's two moments, whatever R.
TEST(Checkpoint, HybridWritesOneCopyWhateverTheReplicas) {
  int64_t params = 0;
  for (const auto& p : make_net()->parameters()) params += p.numel();
  std::vector<int64_t> shard_bytes;
  for (int64_t R : {1, 2, 4}) {
    TempDir tmp;
    const std::string dir = tmp / "ck";
    run_ranks(2 * R, [&](Runtime& rt) {
      auto model = shard(make_net(), strategy(ShardingStrategy::kHybridShard, {R, 2}), borrow(rt));
      auto opt = make_adamw(model);
      train_step(model, opt, rt, 0);
      save_checkpoint(dir, model, &opt);
    });
    int64_t bytes = 0, files = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().filename().string().rfind("shard-", 0) == 0) {
        bytes += static_cast<int64_t>(fs::file_size(e.path()));
        ++files;
      }
    }
    EXPECT_EQ(files, 2) << "R=" << R;
    EXPECT_EQ(bytes, params * 4 * 3) << "R=" << R << ": parameters + exp_avg + exp_avg_sq, fp32";
    shard_bytes.push_back(bytes);
  }
  EXPECT_EQ(shard_bytes[0], shard_bytes[1]);
  EXPECT_EQ(shard_bytes[0], shard_bytes[2]);
}

// SGD momentum, RNG state and the latest/prune helpers.
TEST(Checkpoint, SgdMomentumRngLatestAndPrune) {
  TempDir tmp;
  run_ranks(2, [&](Runtime& rt) {
    auto model = shard(make_net(), strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int64_t step = 0; step < 3; ++step) {
      train_step(model, opt, rt, step);
      TrainingState ts;
      ts.step = step + 1;
      save_checkpoint(checkpoint_path(tmp.path(), step + 1), model, &opt, ts);
    }
    // Ranks are threads sharing one generator: only rank 0 touches it, between barriers.
    double expected = 0;
    rt.world()->barrier();
    if (rt.rank() == 0) {
      torch::manual_seed(42);
      expected = torch::rand({1}).item<double>();
      torch::manual_seed(42);
    }
    rt.world()->barrier();
    save_checkpoint(checkpoint_path(tmp.path(), 3), model, &opt, {3, {}});  // re-save
    if (rt.rank() == 0) torch::manual_seed(5);
    rt.world()->barrier();
    // A fresh optimizer gets the momentum back: one more step equals the original's.
    torch::optim::SGD opt2(model.parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
    auto info = load_checkpoint(*latest_checkpoint(tmp.path()), model, &opt2, nullptr);
    EXPECT_TRUE(info.rng_restored);
    EXPECT_EQ(opt2.param_groups()[0].options().get_lr(), 0.1);  // the saved learning rate
    if (rt.rank() == 0) EXPECT_EQ(torch::rand({1}).item<double>(), expected);
    for (const auto& p : model.parameters()) {
      auto* a = static_cast<torch::optim::SGDParamState*>(
          opt.state().at(compat::optimizer_state_key(p)).get());
      auto* b = static_cast<torch::optim::SGDParamState*>(opt2.state().at(compat::optimizer_state_key(p)).get());
      EXPECT_TRUE(torch::equal(a->momentum_buffer(), b->momentum_buffer()));
    }
  });
  EXPECT_EQ(latest_checkpoint(tmp.path()), checkpoint_path(tmp.path(), 3));
  fs::create_directory(tmp / "step-00000009.partial");  // a crashed save is never "latest"
  fs::create_directory(tmp / "step-00000010");          // nor a directory without meta.json
  EXPECT_EQ(latest_checkpoint(tmp.path()), checkpoint_path(tmp.path(), 3));
  prune_checkpoints(tmp.path(), 1);
  EXPECT_FALSE(fs::exists(checkpoint_path(tmp.path(), 1)));
  EXPECT_FALSE(fs::exists(checkpoint_path(tmp.path(), 2)));
  EXPECT_FALSE(fs::exists(tmp / "step-00000009.partial"));
  EXPECT_TRUE(fs::exists(checkpoint_path(tmp.path(), 3)));
  EXPECT_EQ(read_checkpoint_state(checkpoint_path(tmp.path(), 3)).step, 3);
  EXPECT_FALSE(latest_checkpoint(tmp / "nothing-here").has_value());
}

// ---------------------------------------------------------------------------------------------
// Bad input: one clear error, on every rank, nothing changed.

class BadCheckpoint : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    tmp_ = new TempDir();
    run_ranks(2, [&](Runtime& rt) {
      auto model = shard(make_net(), strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
      auto opt = make_adamw(model);
      train_step(model, opt, rt, 0);
      save_checkpoint(*tmp_ / "good", model, &opt);
    });
  }
  static void TearDownTestSuite() { delete tmp_; }
  // A copy of the good checkpoint to damage.
  std::string copy() {
    const std::string dst = *tmp_ / ("bad" + std::to_string(counter_++));
    fs::copy(*tmp_ / "good", dst, fs::copy_options::recursive);
    return dst;
  }
  static void load_on_two(const std::string& dir, const std::string& expected) {
    expect_every_rank_fails(2, [&](Runtime& rt) {
      auto model = shard(make_net(), strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
      auto opt = make_adamw(model);
      load_checkpoint(dir, model, &opt);
    }, expected);
  }
  static void edit_meta(const std::string& dir, const std::function<void(nlohmann::json&)>& fn) {
    std::ifstream in(dir + "/meta.json");
    auto j = nlohmann::json::parse(in);
    fn(j);
    std::ofstream(dir + "/meta.json") << j.dump();
  }
  static TempDir* tmp_;
  static int counter_;
};
TempDir* BadCheckpoint::tmp_ = nullptr;
int BadCheckpoint::counter_ = 0;

TEST_F(BadCheckpoint, OtherModelListsEveryMismatch) {
  expect_every_rank_fails(2, [&](Runtime& rt) {
    auto model = shard(std::make_shared<NetImpl>(17, 33, 2, 9),  // 2 blocks, 9 classes
                       strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
    load_checkpoint(*tmp_ / "good", model, nullptr);
  }, "does not match the model (6 problems): 'head.weight' has shape [7, 33] but the model's is "
     "[9, 33]; unexpected 'block2.fc1.bias'");
}

// A checkpoint of format 1 (zlib's CRC-32 under the key "crc32"), made from the good format-2
// one by recomputing every checksum the way format 1 did (tests/ owns this converter, so it does
// not share the library's code): it verifies, loads into the same state as the format-2 original,
// and a damaged byte is named as a CRC-32 mismatch.
TEST_F(BadCheckpoint, FormatOneStillLoads) {
  const std::string v1 = copy();
  auto file_bytes = [&](const std::string& name) {
    std::ifstream in(v1 + "/" + name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  auto crc32 = [](const std::string& data, int64_t offset, int64_t n) {
    return static_cast<uint32_t>(::crc32(0, reinterpret_cast<const Bytef*>(data.data() + offset),
                                         static_cast<uInt>(n)));
  };
  edit_meta(v1, [&](nlohmann::json& j) {
    ASSERT_EQ(j["format_version"], 2);
    j["format_version"] = 1;
    for (auto& f : j["files"]) {
      const std::string data = file_bytes(f["name"]);
      f.erase("crc32c");
      f["crc32"] = crc32(data, 0, static_cast<int64_t>(data.size()));
    }
    for (auto& t : j["tensors"]) {
      const int64_t elem = t["dtype"] == "F32" ? 4 : t["dtype"] == "I64" ? 8 : 0;
      ASSERT_GT(elem, 0) << t.dump();
      for (auto& c : t["chunks"]) {
        const std::string data = file_bytes(c["file"]);
        const int64_t n = (c["end"].get<int64_t>() - c["begin"].get<int64_t>()) * elem;
        c.erase("crc32c");
        c["crc32"] = crc32(data, c["offset"].get<int64_t>(), n);
      }
    }
  });
  EXPECT_EQ(verify_checkpoint(v1).format_version, 1);
  std::mutex mu;
  std::map<std::string, std::string> loaded;  // version -> state dict text
  for (const std::string& dir : {v1, *tmp_ / "good"}) {
    run_ranks(2, [&](Runtime& rt) {
      auto model = shard(make_net(), strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
      auto opt = make_adamw(model);
      load_checkpoint(dir, model, &opt);
      std::ostringstream os;
      for (const auto& kv : model.state_dict()) os << kv.key() << kv.value() << "\n";
      std::lock_guard<std::mutex> lock(mu);
      if (rt.rank() == 0) loaded[dir] = os.str();
    });
  }
  EXPECT_EQ(loaded.at(v1), loaded.at(*tmp_ / "good"));
  {
    std::fstream f(v1 + "/shard-1.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x55');
  }
  load_on_two(v1, "is corrupted (CRC-32 mismatch");
}

TEST_F(BadCheckpoint, CorruptedByte) {
  const std::string dir = copy();
  {
    std::fstream f(dir + "/shard-1.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x55');
  }
  load_on_two(dir, "is corrupted (CRC-32C mismatch");
}

TEST_F(BadCheckpoint, TruncatedFile) {
  const std::string dir = copy();
  fs::resize_file(dir + "/shard-0.bin", fs::file_size(dir + "/shard-0.bin") - 8);
  load_on_two(dir, "(truncated or replaced); use an earlier checkpoint");
}

TEST_F(BadCheckpoint, MissingShardFile) {
  const std::string dir = copy();
  fs::remove(dir + "/shard-1.bin");
  load_on_two(dir, "is missing 'shard-1.bin'");
}

TEST_F(BadCheckpoint, FutureFormatVersion) {
  const std::string dir = copy();
  edit_meta(dir, [](nlohmann::json& j) { j["format_version"] = 99; });
  load_on_two(dir, "was written by format 99; this fsdp.cpp reads up to 2");
}

TEST_F(BadCheckpoint, NotACheckpoint) {
  load_on_two(tmp_->path(), "is not an fsdp checkpoint: it has no meta.json");
  load_on_two(*tmp_ / "does-not-exist", "does not exist");
}

TEST_F(BadCheckpoint, ElementCountsDoNotMatch) {
  const std::string dir = copy();
  edit_meta(dir, [](nlohmann::json& j) { j["tensors"][0]["chunks"][0]["end"] = 1; });
  load_on_two(dir, "do not cover its");
}

TEST_F(BadCheckpoint, OffsetsBeyondTheFileAreRejected) {
  const std::string dir = copy();
  edit_meta(dir, [](nlohmann::json& j) { j["tensors"][0]["chunks"][0]["offset"] = int64_t(1) << 60; });
  load_on_two(dir, "has a chunk outside its tensor or file");
  const std::string dir2 = copy();
  edit_meta(dir2, [](nlohmann::json& j) { j["files"][0]["name"] = "../../etc/passwd"; });
  load_on_two(dir2, "lists an invalid file");
}

// A checkpoint saved on GPUs holds each rank's CUDA generator after its CPU one in rng.bin
// (cuda_bytes_per_rank). Made here from the good one by appending 16 bytes to each record: on
// CPU it restores the CPU generator exactly as the original does and reports the CUDA one not
// restored; a CUDA part as large as the record is refused.
TEST_F(BadCheckpoint, GpuGeneratorStatesLoadOnCpu) {
  const std::string gpu = copy();
  int64_t cpu_bytes = 0, world = 0;
  edit_meta(gpu, [&](nlohmann::json& j) {
    cpu_bytes = j["rng"]["bytes_per_rank"].get<int64_t>();
    world = j["rng"]["world_size"].get<int64_t>();
    EXPECT_EQ(j["rng"]["cuda_bytes_per_rank"], 0);
  });
  std::string records;
  {
    std::ifstream in(gpu + "/rng.bin", std::ios::binary);
    const std::string all(std::istreambuf_iterator<char>(in), {});
    ASSERT_EQ(static_cast<int64_t>(all.size()), cpu_bytes * world);
    for (int64_t r = 0; r < world; ++r) {
      records += all.substr(static_cast<size_t>(r * cpu_bytes), static_cast<size_t>(cpu_bytes));
      records += std::string(16, static_cast<char>(0x40 + r));  // a CUDA generator's 16 bytes
    }
    std::ofstream(gpu + "/rng.bin", std::ios::binary | std::ios::trunc) << records;
  }
  edit_meta(gpu, [&](nlohmann::json& j) {
    j["rng"]["bytes_per_rank"] = cpu_bytes + 16;
    j["rng"]["cuda_bytes_per_rank"] = 16;
    for (auto& f : j["files"]) {
      if (f["name"] != "rng.bin") continue;
      f["bytes"] = records.size();
      f["crc32c"] = fsdp::detail::crc32c(records.data(), static_cast<int64_t>(records.size()));
    }
  });
  std::map<std::string, double> drawn;  // checkpoint -> rank 0's first draw after the load
  for (const std::string& dir : {*tmp_ / "good", gpu}) {
    run_ranks(2, [&](Runtime& rt) {
      auto model = shard(make_net(), strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
      auto opt = make_adamw(model);
      if (rt.rank() == 0) torch::manual_seed(99);  // somewhere else first
      rt.world()->barrier();
      const auto info = load_checkpoint(dir, model, &opt);
      EXPECT_TRUE(info.rng_restored);
      EXPECT_FALSE(info.cuda_rng_restored);
      rt.world()->barrier();  // ranks are threads sharing one CPU generator: rank 0 draws
      if (rt.rank() == 0) drawn[dir] = torch::rand({1}).item<double>();
    });
  }
  EXPECT_EQ(drawn.at(gpu), drawn.at(*tmp_ / "good"));
  edit_meta(gpu, [&](nlohmann::json& j) { j["rng"]["cuda_bytes_per_rank"] = cpu_bytes + 16; });
  load_on_two(gpu, "rng sizes are inconsistent");
}

TEST_F(BadCheckpoint, InvalidJson) {
  const std::string dir = copy();
  std::ofstream(dir + "/meta.json") << "{\"format\": ";
  load_on_two(dir, "meta.json is not valid JSON");
}

TEST_F(BadCheckpoint, WrongOptimizer) {
  expect_every_rank_fails(2, [&](Runtime& rt) {
    auto model = shard(make_net(), strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
    torch::optim::SGD opt(model.parameters(), 0.1);
    load_checkpoint(*tmp_ / "good", model, &opt);
  }, "holds adamw state but the optimizer is sgd");
}

TEST_F(BadCheckpoint, UnwritableDirectoryFailsOnEveryRank) {
  const std::string file = *tmp_ / "a-file";
  std::ofstream(file) << "x";
  expect_every_rank_fails(2, [&](Runtime& rt) {
    auto model = shard(make_net(), strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
    save_checkpoint(file + "/ck", model, nullptr);
  }, "saving checkpoint");
}

// ---------------------------------------------------------------------------------------------
// Full checkpoints.

const char* kPython = "/usr/bin/python3";

bool python_has_torch() {
  return run({kPython, "-c", "import torch"}, {}, std::chrono::seconds(60)).exit_code() == 0;
}

// name -> (shape, sum) of a state dict.
std::string summary(const State& s) {
  nlohmann::json j;
  for (const auto& [name, t] : s) {
    j[name] = {t.sizes().vec(), t.to(torch::kDouble).sum().item<double>()};
  }
  return j.dump();
}

void expect_same_summary(const std::string& python_output, const State& want) {
  auto got = nlohmann::json::parse(python_output.substr(python_output.find('{')));
  ASSERT_EQ(got.size(), want.size()) << python_output;
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.contains(name)) << name;
    EXPECT_EQ(got[name][0].get<std::vector<int64_t>>(), t.sizes().vec()) << name;
    const double sum = t.to(torch::kDouble).sum().item<double>();
    EXPECT_NEAR(got[name][1].get<double>(), sum, 1e-5 * (1 + std::abs(sum))) << name;
  }
}

class FullCheckpoint : public ::testing::Test {
 protected:
  // Exports a (2, 2) HYBRID model after one step to .pt and .safetensors; `want` is its state.
  void SetUp() override {
    std::mutex mu;
    run_ranks(4, [&](Runtime& rt) {
      auto model = shard(make_net(), strategy(ShardingStrategy::kHybridShard, {2, 2}), borrow(rt));
      auto opt = make_adamw(model);
      train_step(model, opt, rt, 0);
      export_full_checkpoint(model, tmp_ / "model.pt");
      export_full_checkpoint(model, tmp_ / "model.safetensors");
      auto sd = model.state_dict();
      std::lock_guard<std::mutex> lock(mu);
      if (rt.rank() == 0) want_ = to_state(sd);
    });
  }
  TempDir tmp_;
  State want_;
};

TEST_F(FullCheckpoint, LoadsIntoPlainModuleAndAnyMesh) {
  for (const std::string file : {"model.pt", "model.safetensors"}) {
    auto plain = std::make_shared<NetImpl>();
    load_full_checkpoint(*plain, tmp_ / file);
    State got;
    for (const auto& p : plain->named_parameters()) got[p.key()] = p.value().detach().clone();
    expect_close(got, want_, 0, 0, file + " into a plain module");
    run_ranks(3, [&](Runtime& rt) {
      auto model = shard(std::make_shared<NetImpl>(), strategy(ShardingStrategy::kFullShard, {3}), borrow(rt));
      import_full_checkpoint(model, tmp_ / file);
      expect_close(to_state(model.state_dict()), want_, 0, 0, file + " into (3)");
    });
    // And a plain module saves the same file back.
    save_full_checkpoint(*plain, tmp_ / ("again-" + file));
    auto again = std::make_shared<NetImpl>(17, 33, 3, 7);
    load_full_checkpoint(*again, tmp_ / ("again-" + file));
    State got2;
    for (const auto& p : again->named_parameters()) got2[p.key()] = p.value().detach().clone();
    expect_close(got2, want_, 0, 0, "plain round trip " + file);
  }
  auto other = std::make_shared<NetImpl>(17, 33, 2, 7);
  try {
    load_full_checkpoint(*other, tmp_ / "model.pt");
    ADD_FAILURE() << "a model with fewer blocks loaded";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unexpected 'block2.fc1.weight'"), std::string::npos) << e.what();
  }
}

TEST_F(FullCheckpoint, PythonTorchLoadReadsThePtFile) {
  if (!python_has_torch()) GTEST_SKIP() << kPython << " has no torch module (apt-get install python3-torch)";
  auto r = run({kPython, "-c",
                "import json, sys, torch\n"
                "d = torch.load(sys.argv[1])\n"
                "assert isinstance(d, dict), type(d)\n"
                "print(json.dumps({k: [list(v.shape), float(v.double().sum())] for k, v in d.items()}))\n",
                tmp_ / "model.pt"},
               {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  expect_same_summary(r.output, want_);
}

TEST_F(FullCheckpoint, SafetensorsHeaderAndDataReadWithPlainPython) {
  // json + struct only: the format is what the safetensors specification says.
  auto r = run({kPython, "-c",
                "import json, struct, sys\n"
                "b = open(sys.argv[1], 'rb').read()\n"
                "n = struct.unpack('<Q', b[:8])[0]\n"
                "h = json.loads(b[8:8 + n])\n"
                "data = b[8 + n:]\n"
                "out = {}\n"
                "for k, v in h.items():\n"
                "    if k == '__metadata__': continue\n"
                "    assert v['dtype'] == 'F32', v\n"
                "    s, e = v['data_offsets']\n"
                "    vals = struct.unpack('<%df' % ((e - s) // 4), data[s:e])\n"
                "    out[k] = [v['shape'], sum(vals)]\n"
                "assert (8 + n) % 8 == 0\n"
                "print(json.dumps(out))\n",
                tmp_ / "model.safetensors"},
               {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  expect_same_summary(r.output, want_);
}

TEST_F(FullCheckpoint, ImportsWhatPythonTorchSaveWrote) {
  if (!python_has_torch()) GTEST_SKIP() << kPython << " has no torch module (apt-get install python3-torch)";
  // Python scales every tensor by 2 and saves a plain state dict with torch.save.
  auto r = run({kPython, "-c",
                "import sys, torch\n"
                "d = torch.load(sys.argv[1])\n"
                "torch.save({k: v * 2 for k, v in d.items()}, sys.argv[2])\n",
                tmp_ / "model.pt", tmp_ / "from-python.pt"},
               {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  State doubled;
  for (const auto& [k, v] : want_) doubled[k] = v * 2;
  run_ranks(2, [&](Runtime& rt) {
    auto model = shard(std::make_shared<NetImpl>(), strategy(ShardingStrategy::kHybridShard, {2, 1}), borrow(rt));
    import_full_checkpoint(model, tmp_ / "from-python.pt");
    expect_close(to_state(model.state_dict()), doubled, 0, 0, "torch.save file on (2, 1)");
  });
}

TEST_F(FullCheckpoint, BadFilesFailOnEveryRank) {
  std::ofstream(tmp_ / "junk.safetensors") << "\xff\xff\xff\xff\xff\xff\xff\x7f{}";
  std::ofstream(tmp_ / "junk.pt") << "not a zip";
  for (const auto& [file, expected] : std::vector<std::pair<std::string, std::string>>{
           {"junk.safetensors", "beyond the file"},
           {"junk.pt", "is not a readable PyTorch file"},
           {"missing.pt", "cannot be read"},
           {"model.bin", "must end in .pt"}}) {
    const fs::path path = tmp_ / file;  // C++17 lambdas cannot capture bindings
    expect_every_rank_fails(2, [&](Runtime& rt) {
      auto model = shard(make_net(), strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
      import_full_checkpoint(model, path);
    }, expected);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// A disk that fills up during a .pt export (issue 21): the zip writer's destructor used to write
// the end of the archive through the same failing file, throwing inside a noexcept destructor
// (std::terminate). The first error is reported, once, and nothing is left behind.
namespace {

TEST(FullCheckpointFailure, DiskFullDuringPtExportIsAnError) {
  TempDir tmp;
  const std::string file = tmp / "model.pt";
  fs::create_symlink("/dev/full", file + ".partial");  // every write: ENOSPC
  torch::nn::Linear plain(8, 8);
  try {
    save_full_checkpoint(*plain, file);
    ADD_FAILURE() << "a full disk went unnoticed";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(file));
  fs::create_symlink("/dev/full", file + ".partial");
  expect_every_rank_fails(2, [&](Runtime& rt) {
    auto model = shard(make_net(), strategy(ShardingStrategy::kFullShard, {2}), borrow(rt));
    export_full_checkpoint(model, file);
  }, "No space left on device");
  EXPECT_FALSE(fs::exists(file));
}

}  // namespace
