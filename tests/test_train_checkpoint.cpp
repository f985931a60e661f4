// fsdp-train's checkpoint flags end to end, as real processes: a resumed run's losses are
// bit-identical to an uninterrupted one; a run resumes on another world size and strategy; a rank
// SIGKILLed in the middle of a save leaves the previous checkpoint, which --resume then uses;
// --sample is deterministic and works straight from a checkpoint; --export-full writes files
// Python reads.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "fsdp/checkpoint.h"
#include "testing.h"

using namespace fsdp::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> args(const std::vector<std::string>& extra) {
  return train_args({"--steps=6", "--quiet"}, extra);
}

ProcessResult train(const std::vector<std::string>& extra) {
  return run(args(extra), {}, 180s);
}

// The uninterrupted reference: 6 steps on (2, 1) HYBRID_SHARD.
const std::map<int64_t, double>& reference() {
  static TempDir tmp;
  static const std::map<int64_t, double> ref = [] {
    auto r = train({"--devices=2", "--strategy=hybrid_shard", "--mesh=2,1", "--metrics=" + tmp / "ref.jsonl"});
    EXPECT_EQ(r.exit_code(), 0) << r.output;
    return metrics_losses(tmp / "ref.jsonl");
  }();
  return ref;
}

TEST(TrainCheckpoint, ResumeIsBitIdenticalAndReshards) {
  ASSERT_EQ(reference().size(), 6u);
  TempDir tmp;
  const std::string dir = tmp / "ck";
  auto r = train({"--devices=2", "--strategy=hybrid_shard", "--mesh=2,1", "--checkpoint-dir=" + dir,
                  "--checkpoint-every=3", "--keep-last=2"});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find("checkpoints            2 saved in " + dir), std::string::npos) << r.output;
  ASSERT_TRUE(fs::exists(dir + "/step-00000003/meta.json"));
  ASSERT_TRUE(fs::exists(dir + "/step-00000006/meta.json"));
  fs::remove_all(dir + "/step-00000006");  // as if the job had died after step 3

  // Same mesh: steps 4..6 bit-identical.
  r = train({"--devices=2", "--strategy=hybrid_shard", "--mesh=2,1", "--checkpoint-dir=" + dir,
             "--resume", "--metrics=" + tmp / "resumed.jsonl"});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find("resumed from " + dir + "/step-00000003 at step 3"), std::string::npos) << r.output;
  auto got = metrics_losses(tmp / "resumed.jsonl");
  ASSERT_EQ(got.size(), 3u);
  for (const auto& [step, loss] : got) EXPECT_EQ(loss, reference().at(step)) << "step " << step;

  // Another world size and strategy: 4-way FULL_SHARD continues within fp32 tolerance.
  fs::remove_all(dir + "/step-00000006");
  r = train({"--devices=4", "--strategy=full_shard", "--checkpoint-dir=" + dir, "--resume",
             "--metrics=" + tmp / "resharded.jsonl"});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  got = metrics_losses(tmp / "resharded.jsonl");
  ASSERT_EQ(got.size(), 3u);
  for (const auto& [step, loss] : got) {
    EXPECT_NEAR(loss, reference().at(step), 1e-5 * reference().at(step)) << "step " << step;
  }
}

bool wait_for(const std::function<bool()>& cond, std::chrono::seconds within) {
  const auto end = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return cond();
}

// The environment that preloads the slow-disk shim: fsync and fdatasync sleep `ms` first. A
// sanitizer build's runtime must still come first in the library list, so ASan is told not to
// insist.
std::map<std::string, std::string> slow_disk(int ms) {
  const char* asan = std::getenv("ASAN_OPTIONS");
  return {{"LD_PRELOAD", FSDP_SLOW_FSYNC_LIB},
          {"FSDP_FAULT_FSYNC_DELAY_MS", std::to_string(ms)},
          {"ASAN_OPTIONS", std::string(asan ? asan : "") + (asan ? ":" : "") +
                               "verify_asan_link_order=0"}};
}

// Trains 6 steps on (2, 1) HYBRID_SHARD saving every `every` steps (plus `extra` flags) on a slow
// disk, injected from outside (tests/faults/slow_fsync.cpp: every fsync takes `fsync_ms`), and
// SIGKILLs rank 1 once the save of step 2 * `every` has written its shard file but is not
// committed. The save of step `every` is then the latest, and --resume continues from it
// bit-identically.
void expect_kill_during_save_leaves_previous(int64_t every, int fsync_ms,
                                             const std::vector<std::string>& extra) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const std::string kept = fsdp::checkpoint_path(dir, every);
  const std::string killed = fsdp::checkpoint_path(dir, 2 * every);
  {
    std::vector<std::string> flags{"--devices=2", "--strategy=hybrid_shard", "--mesh=2,1",
                                   "--checkpoint-dir=" + dir,
                                   "--checkpoint-every=" + std::to_string(every)};
    flags.insert(flags.end(), extra.begin(), extra.end());
    Process p(args(flags), slow_disk(fsync_ms));
    const auto ranks = children_of(p.pid(), 2);
    ASSERT_EQ(ranks.size(), 2u);
    ASSERT_TRUE(wait_for([&] { return fs::exists(killed + ".partial/shard-0.bin"); }, 120s));
    ::kill(ranks[1], SIGKILL);
    auto r = p.wait(120s);
    EXPECT_FALSE(r.timed_out);
    EXPECT_NE(r.exit_code(), 0) << r.output;
  }
  EXPECT_TRUE(fs::exists(kept + "/meta.json"));
  EXPECT_FALSE(fs::exists(killed));
  auto r = train({"--devices=2", "--strategy=hybrid_shard", "--mesh=2,1", "--checkpoint-dir=" + dir,
                  "--resume", "--metrics=" + tmp / "after.jsonl"});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find(kept + " at step " + std::to_string(every)), std::string::npos)
      << r.output;
  auto got = metrics_losses(tmp / "after.jsonl");
  ASSERT_EQ(static_cast<int64_t>(got.size()), 6 - every);
  for (const auto& [step, loss] : got) EXPECT_EQ(loss, reference().at(step)) << "step " << step;
  if (2 * every == 6) {  // the resumed run's final save is the killed one: it replaces the leftover
    EXPECT_FALSE(fs::exists(killed + ".partial"));
  }
}

// Step 3's save completes; step 6's (the final one) is killed in flight.
TEST(TrainCheckpoint, RankKilledDuringSaveLeavesThePreviousCheckpoint) {
  expect_kill_during_save_leaves_previous(3, 1500, {});
}

// --checkpoint-async: the periodic saves at steps 2 and 4 are written in the background and the
// summary says how long training was blocked; resuming from step 2 is bit-identical.
TEST(TrainCheckpoint, AsyncSavesResumeBitIdentically) {
  ASSERT_EQ(reference().size(), 6u);
  TempDir tmp;
  const std::string dir = tmp / "ck";
  auto r = train({"--devices=2", "--strategy=hybrid_shard", "--mesh=2,1", "--checkpoint-dir=" + dir,
                  "--checkpoint-every=2", "--checkpoint-async"});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find("checkpoints            3 saved in " + dir), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("async checkpoints      2 written in the background; training blocked"),
            std::string::npos) << r.output;
  // Both background writes were committed and timed; the last (synchronous) save's too.
  EXPECT_TRUE(std::regex_search(r.output, std::regex("background write [0-9]+\\.[0-9]{3} s per save "
                                                     "\\(slowest rank, fsync included\\)")))
      << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("its files written in [0-9]+\\.[0-9]{3} s")))
      << r.output;
  for (const char* step : {"2", "4", "6"}) {
    EXPECT_TRUE(fs::exists(dir + "/step-0000000" + step + "/meta.json")) << step;
  }
  fs::remove_all(dir + "/step-00000006");
  fs::remove_all(dir + "/step-00000004");
  r = train({"--devices=2", "--strategy=hybrid_shard", "--mesh=2,1", "--checkpoint-dir=" + dir,
             "--resume", "--metrics=" + tmp / "resumed.jsonl"});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find("step-00000002 at step 2"), std::string::npos) << r.output;
  auto got = metrics_losses(tmp / "resumed.jsonl");
  ASSERT_EQ(got.size(), 4u);
  for (const auto& [step, loss] : got) EXPECT_EQ(loss, reference().at(step)) << "step " << step;
  r = train({"--checkpoint-dir=" + dir, "--checkpoint-async"});
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_NE(r.output.find("--checkpoint-async applies to the --checkpoint-every saves"),
            std::string::npos) << r.output;
}

// A file system that refuses O_DIRECT (ramfs, mounted in a private mount namespace, which needs
// root): background saves still complete, through the page cache, and fsdp-train says so once
// and in its summary. (Where O_DIRECT works, test_async_checkpoint checks that nothing goes
// through the cache.)
TEST(TrainCheckpoint, AsyncSavesSayWhenTheFileSystemRefusesDirectWrites) {
  TempDir tmp;
  const std::string mnt = tmp / "ramfs";
  fs::create_directories(mnt);
  const std::string unshare = "/usr/bin/unshare";
  if (run({unshare, "-m", "mount", "-t", "ramfs", "none", mnt}, {}, 30s).exit_code() != 0) {
    GTEST_SKIP() << "cannot mount a ramfs in a private mount namespace (needs root and unshare)";
  }
  std::string command = "mount -t ramfs none " + mnt + " && exec";
  for (const auto& a : args({"--devices=2", "--checkpoint-dir=" + mnt + "/ck",
                             "--checkpoint-every=2", "--checkpoint-async"})) {
    command += " '" + a + "'";
  }
  const auto r = run({unshare, "-m", "/bin/sh", "-c", command}, {}, 180s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find("refuses O_DIRECT: background saves go through the page cache"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("async checkpoints      2 written in the background"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("4 file(s) through the page cache: no O_DIRECT there"),
            std::string::npos) << r.output;
}

// A rank SIGKILLed while step 4's save is written in the background: step 2's checkpoint,
// committed before step 4's save began, is the latest, and --resume continues from it.
TEST(TrainCheckpoint, RankKilledDuringAsyncSaveLeavesThePreviousCheckpoint) {
  expect_kill_during_save_leaves_previous(2, 1000, {"--checkpoint-async"});
}

// --keep-last 1 with background saves on a slow disk: watched every few milliseconds from the
// first commit on, the directory always holds at least one complete checkpoint, and one at the end.
TEST(TrainCheckpoint, AsyncKeepLastNeverLeavesNoCompleteCheckpoint) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  Process p(args({"--devices=2", "--strategy=full_shard", "--checkpoint-dir=" + dir,
                  "--checkpoint-every=1", "--checkpoint-async", "--keep-last=1"}),
            slow_disk(150));
  auto complete = [&] {
    int64_t n = 0;
    for (const auto& e : fsdp::list_checkpoints(dir)) n += e.status == fsdp::CheckpointStatus::kComplete;
    return n;
  };
  std::atomic<bool> done{false}, seen{false};
  std::atomic<int64_t> fewest{1 << 20}, observations{0};
  std::thread watcher([&] {
    while (!done) {
      const int64_t n = complete();
      if (n > 0) seen = true;
      if (seen) {
        fewest = std::min(fewest.load(), n);
        ++observations;
      }
      std::this_thread::sleep_for(3ms);
    }
  });
  auto r = p.wait(180s);
  done = true;
  watcher.join();
  EXPECT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(seen);
  EXPECT_GT(observations, 10);
  EXPECT_GE(fewest, 1);
  EXPECT_EQ(complete(), 1);
  EXPECT_TRUE(fs::exists(dir + "/step-00000006/meta.json"));
}

std::string sample_of(const std::string& output) {
  const auto at = output.find("fsdp-train: sample (");
  EXPECT_NE(at, std::string::npos) << output;
  return at == std::string::npos ? "" : output.substr(at);
}

TEST(TrainCheckpoint, SampleIsDeterministicAndWorksFromACheckpoint) {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  auto a = train({"--devices=2", "--checkpoint-dir=" + dir, "--sample=40", "--prompt=The "});
  ASSERT_EQ(a.exit_code(), 0) << a.output;
  // From the final checkpoint, on one process: nothing left to train, the same text.
  auto b = train({"--checkpoint-dir=" + dir, "--resume", "--sample=40", "--prompt=The "});
  ASSERT_EQ(b.exit_code(), 0) << b.output;
  EXPECT_NE(b.output.find("no steps to train"), std::string::npos) << b.output;
  const std::string sa = sample_of(a.output), sb = sample_of(b.output);
  EXPECT_EQ(sa, sb);
  EXPECT_GE(sa.size(), std::string("fsdp-train: sample (40 bytes, temperature 0.8, seed 7):\nThe ").size() + 40);
  auto c = train({"--checkpoint-dir=" + dir, "--resume", "--sample=40", "--prompt=The ", "--seed=8",
                  "--temperature=0"});
  ASSERT_EQ(c.exit_code(), 0) << c.output;
  EXPECT_NE(c.output.find("note: the checkpoint was written with other settings"), std::string::npos)
      << c.output;
}

TEST(TrainCheckpoint, ResumeWithoutCheckpointStartsFresh) {
  TempDir tmp;
  auto r = train({"--steps=2", "--checkpoint-dir=" + tmp / "empty", "--resume"});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find("no checkpoint in " + tmp / "empty" + " yet; starting fresh"),
            std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(tmp / "empty/step-00000002/meta.json"));
}

TEST(TrainCheckpoint, ExportFullIsReadByPython) {
  TempDir tmp;
  auto r = train({"--devices=2", "--steps=2", "--export-full=" + tmp / "gpt.safetensors"});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  r = train({"--devices=2", "--steps=2", "--export-full=" + tmp / "gpt.pt"});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  auto py = run({"/usr/bin/python3", "-c",
                 "import json, struct, sys\n"
                 "b = open(sys.argv[1], 'rb').read()\n"
                 "n = struct.unpack('<Q', b[:8])[0]\n"
                 "h = json.loads(b[8:8 + n])\n"
                 "print(sorted(k for k in h if k != '__metadata__'))\n",
                 tmp / "gpt.safetensors"});
  ASSERT_EQ(py.exit_code(), 0) << py.output;
  EXPECT_NE(py.output.find("'block0.q.weight'"), std::string::npos) << py.output;
  EXPECT_NE(py.output.find("'head.weight'"), std::string::npos) << py.output;
  if (run({"/usr/bin/python3", "-c", "import torch"}).exit_code() != 0) {
    GTEST_SKIP() << "/usr/bin/python3 has no torch module (apt-get install python3-torch)";
  }
  py = run({"/usr/bin/python3", "-c",
            "import sys, torch\n"
            "d = torch.load(sys.argv[1])\n"
            "print(len(d), tuple(d['head.weight'].shape))\n",
            tmp / "gpt.pt"});
  ASSERT_EQ(py.exit_code(), 0) << py.output;
  EXPECT_NE(py.output.find("(256, 64)"), std::string::npos) << py.output;
}

TEST(TrainCheckpoint, BadFlagsFailBeforeStarting) {
  TempDir tmp;
  const std::string file = tmp / "a-file";
  std::ofstream(file) << "x";
  for (const auto& [flags, expected] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--resume"}, "--resume needs --checkpoint-dir DIR"},
           {{"--checkpoint-every=2"}, "--checkpoint-every needs --checkpoint-dir DIR"},
           {{"--checkpoint-dir=" + file}, "is not a directory"},
           {{"--checkpoint-dir=" + file + "/b/c"},
            "--checkpoint-dir '" + file + "/b/c' does not exist and cannot be created ('" + file +
                "' is not a directory); choose another place"},
           {{"--metrics=" + file + "/m.jsonl"},
            "--metrics '" + file + "/m.jsonl': directory '" + file + "' cannot be created ('" +
                file + "' is not a directory)"},
           {{"--export-full=" + file + "/x/model.pt"}, "' is not a directory)"},
           {{"--export-full=" + tmp / "x.txt"}, "must end in .pt"},
           {{"--checkpoint-dir=" + tmp / "d", "--keep-last=-1"}, "--keep-last -1 is invalid"},
           {{"--sample=-3"}, "--sample -3 is invalid"},
           {{"--sample=5", "--temperature=-1"}, "--temperature -1 is invalid"},
       }) {
    auto r = train(flags);
    EXPECT_EQ(r.exit_code(), 2) << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("fsdp-train summary"), std::string::npos) << r.output;
  }
}

// Issue 38: the missing parents of every output path are created before the ranks start, as
// PyTorch's distributed checkpoint writer and Lightning do.
TEST(TrainCheckpoint, MissingParentsOfOutputsAreCreated) {
  TempDir tmp;
  const std::string ck = tmp / "runs/exp1/ckpt", metrics = tmp / "out/m/metrics.jsonl",
                    full = tmp / "exp/x/model.safetensors";
  auto r = run(train_args({"--steps=2", "--quiet", "--devices=2"},
                          {"--checkpoint-dir=" + ck, "--metrics=" + metrics, "--export-full=" + full}),
               {}, 180s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(fs::exists(ck + "/step-00000002/meta.json")) << r.output;
  EXPECT_EQ(metrics_losses(metrics).size(), 2u);
  EXPECT_TRUE(fs::is_regular_file(full));
}

}  // namespace
