// The mutation test of a checkpoint's manifest (issue 38, tests/manifest_mutations.h): for a real
// fsdp-train checkpoint, W = 2 FULL_SHARD and HYBRID_SHARD on the (2, 2) mesh, every edit of one
// meta.json entry that keeps the JSON valid (remove it, duplicate it, change its shape, shift a
// chunk's begin, end or offset, point a chunk at another file, drop a rank from the RNG) is
// refused — the whole set through parse_meta, the check that list_checkpoints (--resume),
// verify_checkpoint (--check-checkpoint) and load_checkpoint share, and a sample of it through
// fsdp-train itself: --check-checkpoint and --resume refuse it with the same reason. The fuzz
// target fuzz_checkpoint_meta runs the whole set on every valid meta.json it reaches.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "checkpoint/meta.h"
#include "fsdp/checkpoint.h"
#include "manifest_mutations.h"
#include "testing.h"

using namespace fsdp::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

struct Source {
  std::string what;
  std::vector<std::string> flags;
  std::string step;  // the checkpoint: <dir>/step-00000001
};

// One step of the tests' tiny run, saved; made once per source.
const std::string& made(const Source& s) {
  static TempDir tmp;
  static std::map<std::string, std::string> done;
  auto it = done.find(s.what);
  if (it != done.end()) return it->second;
  const std::string dir = tmp / ("ck-" + std::to_string(done.size()));
  std::vector<std::string> extra = s.flags;
  extra.insert(extra.end(), {"--steps=1", "--checkpoint-every=1", "--checkpoint-dir=" + dir});
  auto r = run(train_args({"--quiet"}, extra), {}, 180s);
  EXPECT_EQ(r.exit_code(), 0) << r.output;
  return done[s.what] = fsdp::checkpoint_path(dir, 1);
}

const Source kFullShard{"W = 2 FULL_SHARD", {"--devices=2"}, ""};
const Source kHybrid{"HYBRID_SHARD (2, 2)", {"--devices=4", "--strategy=hybrid_shard", "--mesh=2,2"}, ""};

std::string text_of(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// parse_meta's verdict on `text` as the meta.json of `ckpt` (its real files' sizes): "" if
// accepted, else the one-line reason.
std::string verdict(const std::string& text, const std::string& ckpt) {
  try {
    fsdp::detail::parse_meta(text, ckpt, [&](const std::string& name) {
      std::error_code ec;
      const auto n = fs::file_size(ckpt + "/" + name, ec);
      return ec ? int64_t(-1) : static_cast<int64_t>(n);
    });
    return "";
  } catch (const fsdp::Error& e) {
    return e.what();
  }
}

void expect_every_mutation_refused(const Source& s) {
  const std::string ckpt = made(s);
  const json meta = json::parse(text_of(ckpt + "/meta.json"));
  ASSERT_EQ(verdict(meta.dump(), ckpt), "") << "the unmutated meta.json of " << s.what;
  const auto all = manifest_mutations(meta);
  std::map<std::string, int> kinds;
  for (const auto& m : all) {
    ++kinds[m.kind];
    const std::string why = verdict(m.meta.dump(), ckpt);
    EXPECT_NE(why, "") << s.what << ": accepted: " << m.what;
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  }
  // Every kind of mutation was made, and the set is the whole manifest's.
  for (const char* k : {"remove", "duplicate", "shape", "begin", "end", "offset", "file", "rng"}) {
    EXPECT_GT(kinds[k], 0) << s.what << ": no '" << k << "' mutation";
  }
  EXPECT_GT(all.size(), 3 * meta["tensors"].size()) << s.what;
  std::printf("%s: %zu mutations of %zu tensor entries, every one refused\n", s.what.c_str(),
              all.size(), meta["tensors"].size());
}

TEST(TrainManifest, EveryMutationIsRefusedFullShard) { expect_every_mutation_refused(kFullShard); }

TEST(TrainManifest, EveryMutationIsRefusedHybrid) { expect_every_mutation_refused(kHybrid); }

// One mutation applied to a copy of the checkpoint: --check-checkpoint says INVALID with the
// listing's reason, --resume fails on both ranks with it, trains nothing and changes nothing.
void expect_both_refuse(const std::string& ckpt, const ManifestMutation& m, const std::string& dir) {
  SCOPED_TRACE(m.what);
  const std::string copy = fsdp::checkpoint_path(dir, 1);
  fs::create_directories(dir);
  fs::copy(ckpt, copy, fs::copy_options::recursive);
  std::ofstream(copy + "/meta.json", std::ios::trunc) << m.meta.dump(1);
  const auto listed = fsdp::list_checkpoints(dir);
  ASSERT_EQ(listed.size(), 1u);
  ASSERT_EQ(listed[0].status, fsdp::CheckpointStatus::kInvalid) << "listed as complete";
  const std::string& reason = listed[0].reason;
  auto check = run({kTrain, "--check-checkpoint", copy});
  EXPECT_EQ(check.exit_code(), 1) << check.output;
  EXPECT_NE(check.output.find(copy + ": INVALID: " + reason), std::string::npos)
      << "expected: " << reason << "\n" << check.output;
  const std::string before = text_of(copy + "/meta.json");
  auto resume = run(train_args({"--quiet", "--devices=2"},
                               {"--steps=2", "--checkpoint-dir=" + dir, "--resume"}),
                    {}, 180s);
  EXPECT_NE(resume.exit_code(), 0) << resume.output;
  EXPECT_EQ(ranks_saying(resume.output, reason), (std::set<int>{0, 1}))
      << "expected on both ranks: " << reason << "\n" << resume.output;
  EXPECT_EQ(resume.output.find("fsdp-train summary"), std::string::npos) << resume.output;
  EXPECT_EQ(text_of(copy + "/meta.json"), before);
  EXPECT_EQ(fsdp::list_checkpoints(dir).size(), 1u) << "something was saved";
}

// A sample of the set (one mutation of each of `kinds`, drawn with a fixed seed, and the ones
// named), through the real program: four at a time, each is one process and two ranks. The
// sample keeps the test under a minute on the CI machine's 2 cores.
void expect_sample_refused(const Source& s, const std::vector<std::string>& extra_whats,
                           const std::set<std::string>& kinds) {
  const std::string ckpt = made(s);
  const auto all = manifest_mutations(json::parse(text_of(ckpt + "/meta.json")));
  std::map<std::string, std::vector<size_t>> by_kind;
  for (size_t i = 0; i < all.size(); ++i) by_kind[all[i].kind].push_back(i);
  std::mt19937 rng(38);
  std::vector<size_t> sample;
  for (auto& [kind, idx] : by_kind) {
    std::shuffle(idx.begin(), idx.end(), rng);
    if (kinds.count(kind)) sample.push_back(idx[0]);
  }
  for (const auto& w : extra_whats) {
    bool found = false;
    for (size_t i = 0; i < all.size(); ++i) {
      if (all[i].what == w) {
        sample.push_back(i);
        found = true;
      }
    }
    EXPECT_TRUE(found) << "no mutation '" << w << "'";
  }
  TempDir tmp;
  std::vector<std::future<void>> running;
  for (size_t n = 0; n < sample.size(); ++n) {
    running.push_back(std::async(std::launch::async, [&, n] {
      expect_both_refuse(ckpt, all[sample[n]], tmp / ("m" + std::to_string(n)));
    }));
    if (running.size() == 4) {
      for (auto& f : running) f.get();
      running.clear();
    }
  }
  for (auto& f : running) f.get();
}

TEST(TrainManifest, CheckCheckpointAndResumeRefuseASampleWithTheSameReasonFullShard) {
  // Issue 38's two: tok_emb.weight's exp_avg removed (its AdamW state was reset in silence), and
  // doubled.
  const std::string ckpt = made(kFullShard);
  const json meta = json::parse(text_of(ckpt + "/meta.json"));
  std::vector<std::string> issue;
  for (size_t i = 0; i < meta["tensors"].size(); ++i) {
    const auto& t = meta["tensors"][i];
    if (t["name"] == "tok_emb.weight" && t["kind"] == "optim" && t["field"] == "exp_avg") {
      const std::string at = "tensors[" + std::to_string(i) + "] (optim exp_avg tok_emb.weight)";
      issue = {"remove " + at, "duplicate " + at};
    }
  }
  ASSERT_EQ(issue.size(), 2u) << "no exp_avg of tok_emb.weight in " << ckpt;
  expect_sample_refused(kFullShard, issue, {"shape", "offset", "file", "rng"});
}

TEST(TrainManifest, CheckCheckpointAndResumeRefuseASampleWithTheSameReasonHybrid) {
  expect_sample_refused(kHybrid, {}, {"duplicate", "offset"});
}

}  // namespace
