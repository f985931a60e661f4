// fsdp-train --resume against damaged checkpoint directories, as real processes (issue 21): the
// newest checkpoint is used or refused, never skipped or replaced by a fresh start in silence.
// Every way of damaging it fails on every rank with the entry, the file and the reason, exits
// non-zero, trains nothing and deletes nothing; --resume-fallback names what it skips;
// --check-checkpoint verifies a checkpoint without a cluster.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include <signal.h>

#include "fsdp/checkpoint.h"
#include "testing.h"

using namespace fsdp::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> args(const std::vector<std::string>& extra) {
  return train_args({"--quiet", "--devices=2"}, extra);
}

// Two checkpoints, steps 2 and 4, made once: every test damages its own copy.
const std::string& source() {
  static TempDir tmp;
  static const std::string dir = [] {
    const std::string d = tmp / "ck";
    auto r = run(args({"--steps=4", "--checkpoint-every=2", "--checkpoint-dir=" + d}), {}, 180s);
    EXPECT_EQ(r.exit_code(), 0) << r.output;
    return d;
  }();
  return dir;
}

// A copy of the source with only the steps given.
std::string copy_of(const TempDir& tmp, const std::string& name, std::vector<int> steps) {
  const std::string dst = tmp / name;
  fs::create_directories(dst);
  for (int s : steps) {
    char entry[32];
    std::snprintf(entry, sizeof(entry), "step-%08d", s);
    fs::copy(source() + "/" + entry, dst + "/" + entry, fs::copy_options::recursive);
  }
  return dst;
}

// Every file under `dir` with its size and contents' hash: "nothing changed" is equality.
std::map<std::string, std::string> tree(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    std::string key = fs::relative(e.path(), dir).string();
    if (!e.is_regular_file()) {
      out[key] = "dir";
      continue;
    }
    std::ifstream in(e.path(), std::ios::binary);
    std::ostringstream os;
    os << in.rdbuf();
    out[key] = std::to_string(std::hash<std::string>{}(os.str()));
  }
  return out;
}

void edit_meta(const std::string& ckpt, const std::function<void(nlohmann::json&)>& fn) {
  std::ifstream in(ckpt + "/meta.json");
  auto j = nlohmann::json::parse(in);
  fn(j);
  std::ofstream(ckpt + "/meta.json") << j.dump();
}

// Flips one bit of byte `at` of `file`: same size, another checksum.
void flip_byte(const std::string& file, int64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(at);
  const char c = static_cast<char>(f.get());
  f.seekp(at);
  f.put(static_cast<char>(c ^ 1));
}

struct Row {
  std::string what;
  std::vector<int> steps;                       // checkpoints in the directory
  std::function<void(const std::string&)> damage;  // given the newest checkpoint
  std::string expected;                         // in every rank's error
};

// One damage per row of issue 21's table; every other damage meta.json can carry is refused by
// the same code, tested without processes in test_checkpoint_meta.
TEST(TrainResume, EveryDamageOfTheNewestCheckpointFailsOnEveryRank) {
  const std::vector<Row> rows = {
      {"a shard file truncated", {2}, [](const std::string& c) {
         fs::resize_file(c + "/shard-0.bin", fs::file_size(c + "/shard-0.bin") - 8);
       }, "'shard-0.bin' has "},
      {"meta.json garbage", {2}, [](const std::string& c) { std::ofstream(c + "/meta.json") << "{\"fo"; },
       "meta.json is not valid JSON"},
      {"a newer format version", {2},
       [](const std::string& c) { edit_meta(c, [](nlohmann::json& j) { j["format_version"] = 999; }); },
       "was written by format 999; this fsdp.cpp reads up to 2"},
      {"a file outside the directory", {2},
       [](const std::string& c) {
         edit_meta(c, [](nlohmann::json& j) { j["files"][0]["name"] = "../../../etc/passwd"; });
       },
       "lists an invalid file '../../../etc/passwd' (not a plain name inside the checkpoint"},
      {"one byte flipped", {2},
       [](const std::string& c) {
         std::fstream f(c + "/shard-1.bin", std::ios::in | std::ios::out | std::ios::binary);
         f.seekp(100);
         f.put('\x55');
       },
       "is corrupted (CRC-32C mismatch"},
      {"step 4 missing a file, step 2 complete", {2, 4},
       [](const std::string& c) { fs::remove(c + "/shard-1.bin"); },
       "the newest checkpoint in "},
  };
  TempDir tmp;
  // The rows run four at a time: each is two short-lived ranks.
  std::vector<std::future<void>> running;
  std::mutex mu;
  auto check = [&](const Row& row, size_t i) {
    const std::string dir = copy_of(tmp, "row" + std::to_string(i), row.steps);
    char newest[32];
    std::snprintf(newest, sizeof(newest), "step-%08d", row.steps.back());
    row.damage(dir + "/" + newest);
    const auto before = tree(dir);
    auto r = run(args({"--steps=6", "--checkpoint-dir=" + dir, "--resume", "--keep-last=1",
                       "--checkpoint-every=1"}),
                 {}, 180s);
    std::lock_guard<std::mutex> lock(mu);
    SCOPED_TRACE(row.what);
    EXPECT_NE(r.exit_code(), 0) << r.output;
    EXPECT_EQ(ranks_saying(r.output, row.expected), (std::set<int>{0, 1})) << r.output;
    if (row.expected != "is corrupted (CRC-32C mismatch") {  // found by reading, not by meta.json
      EXPECT_EQ(ranks_saying(r.output, std::string("the newest checkpoint in ") + dir + ", " + newest +
                                           ", cannot be loaded"),
                (std::set<int>{0, 1}))
          << r.output;
      EXPECT_NE(r.output.find("or add --resume-fallback"), std::string::npos) << r.output;
    }
    if (row.steps.size() == 2) {
      EXPECT_NE(r.output.find("resume from the newest valid one (step-00000002)"), std::string::npos)
          << r.output;
    }
    EXPECT_EQ(r.output.find("starting fresh"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("fsdp-train summary"), std::string::npos) << "it trained: " << r.output;
    EXPECT_EQ(tree(dir), before) << "the directory changed (something was pruned or saved)";
  };
  for (size_t i = 0; i < rows.size(); ++i) {
    running.push_back(std::async(std::launch::async, check, rows[i], i));
    if (running.size() == 4) {
      for (auto& f : running) f.get();
      running.clear();
    }
  }
  for (auto& f : running) f.get();
}

TEST(TrainResume, FallbackNamesWhatItSkipsAndResumesTheNewestValid) {
  TempDir tmp;
  const std::string dir = copy_of(tmp, "ck", {2, 4});
  fs::remove(dir + "/step-00000004/shard-1.bin");
  fs::create_directory(dir + "/step-00000006.partial");  // a crash mid-save: ignored, as ever
  auto r = run(args({"--steps=4", "--checkpoint-dir=" + dir, "--resume", "--resume-fallback",
                     "--metrics=" + tmp / "m.jsonl"}),
               {}, 180s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find("fsdp-train: --resume-fallback: skipping " + dir +
                          "/step-00000004: checkpoint '" + dir +
                          "/step-00000004' is missing 'shard-1.bin'"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("step-00000006.partial"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("resumed from " + dir + "/step-00000002 at step 2"), std::string::npos)
      << r.output;
  std::ifstream in(tmp / "m.jsonl");
  int lines = 0;
  for (std::string line; std::getline(in, line);) ++lines;
  EXPECT_EQ(lines, 2) << "steps 3 and 4 trained again";
}

// Issue 38: a flipped byte is found only by reading (rank 0's shard file: rank 1 sees nothing
// wrong), and --resume-fallback steps over it as over structural damage: every rank moves on to
// step 2, whose losses equal a resume from step 2 alone; pruning keeps the damaged entry as
// evidence and does not count it among --keep-last.
TEST(TrainResume, FallbackSkipsAChecksumMismatchLikeADirectResumeFromTheOlderEntry) {
  TempDir tmp;
  const std::string dir = copy_of(tmp, "ck", {2, 4});
  flip_byte(dir + "/step-00000004/shard-0.bin", 40);
  const std::string direct = copy_of(tmp, "direct", {2});
  auto a = run(args({"--steps=3", "--checkpoint-dir=" + dir, "--resume", "--resume-fallback",
                     "--checkpoint-every=1", "--keep-last=1", "--metrics=" + tmp / "a.jsonl"}),
               {}, 180s);
  ASSERT_EQ(a.exit_code(), 0) << a.output;
  EXPECT_NE(a.output.find("fsdp-train: --resume-fallback: skipping " + dir + "/step-00000004: "),
            std::string::npos) << a.output;
  EXPECT_NE(a.output.find("'shard-0.bin' is corrupted (CRC-32C mismatch"), std::string::npos)
      << a.output;
  EXPECT_NE(a.output.find("resumed from " + dir + "/step-00000002 at step 2"), std::string::npos)
      << a.output;
  EXPECT_TRUE(fs::exists(dir + "/step-00000004")) << "the evidence was pruned";
  EXPECT_TRUE(fs::exists(dir + "/step-00000003")) << "the new checkpoint was pruned";
  EXPECT_FALSE(fs::exists(dir + "/step-00000002")) << "--keep-last 1 counted the damaged entry";
  auto b = run(args({"--steps=3", "--checkpoint-dir=" + direct, "--resume",
                     "--metrics=" + tmp / "b.jsonl"}),
               {}, 180s);
  ASSERT_EQ(b.exit_code(), 0) << b.output;
  const auto la = metrics_losses(tmp / "a.jsonl"), lb = metrics_losses(tmp / "b.jsonl");
  ASSERT_EQ(la.size(), 1u);
  EXPECT_EQ(la, lb) << "the fallback's resume differs from a direct resume from step 2";
  // Without the flag: as before, every rank fails on the checksum and nothing trains.
  const std::string plain = copy_of(tmp, "plain", {2, 4});
  fs::copy_file(dir + "/step-00000004/shard-0.bin", plain + "/step-00000004/shard-0.bin",
                fs::copy_options::overwrite_existing);
  auto c = run(args({"--steps=6", "--checkpoint-dir=" + plain, "--resume"}), {}, 180s);
  EXPECT_NE(c.exit_code(), 0) << c.output;
  EXPECT_EQ(ranks_saying(c.output, "is corrupted (CRC-32C mismatch"), (std::set<int>{0, 1}))
      << c.output;
  EXPECT_EQ(c.output.find("fsdp-train summary"), std::string::npos) << c.output;
}

TEST(TrainResume, StartsFreshOnlyWithoutAnyCheckpoint) {
  TempDir tmp;
  fs::create_directories(tmp / "ck/step-00000002.partial");  // a crash during the first save
  auto r = run(args({"--steps=1", "--checkpoint-dir=" + tmp / "ck", "--resume"}), {}, 180s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find("fsdp-train: --resume: no checkpoint in " + tmp / "ck" +
                          " yet; starting fresh"),
            std::string::npos)
      << r.output;
}

TEST(TrainResume, CheckCheckpointVerifiesWithoutACluster) {
  TempDir tmp;
  const std::string dir = copy_of(tmp, "ck", {2, 4});
  auto r = run({kTrain, "--check-checkpoint", dir + "/step-00000004"});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find(dir + "/step-00000004: valid (meta.json complete, every file's size and CRC-32C checked)"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 4, format 2, FULL_SHARD on mesh (1, 2), world 2, optimizer adamw, "
                          "RNG saved"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("111 tensors (137.0 k parameters), 4 files, "), std::string::npos)
      << r.output;
  // A flipped byte: meta.json and the sizes are fine, so only reading every byte finds it.
  flip_byte(dir + "/step-00000004/shard-0.bin", 40);
  r = run({kTrain, "--check-checkpoint", dir});
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_NE(r.output.find(dir + "/step-00000002: valid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(dir + "/step-00000004: INVALID: checkpoint '" + dir +
                          "/step-00000004': 'shard-0.bin' is corrupted (CRC-32C mismatch at byte 0, "),
            std::string::npos)
      << r.output;
  r = run({kTrain, "--check-checkpoint", tmp / "nothing"});
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_NE(r.output.find("is not a directory"), std::string::npos) << r.output;
}

TEST(TrainResume, FallbackWithoutResumeIsAUsageError) {
  auto r = run(args({"--resume-fallback"}));
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_NE(r.output.find("--resume-fallback only applies to --resume"), std::string::npos)
      << r.output;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Preemption (NOTE [preemption] in tools/fsdp-train/preempt.h): a signal to one rank, or SIGUSR1
// to the supervisor, makes every rank finish its step, save it and exit 128 + signal; --resume
// then continues bit-identically to a run that was never interrupted.
namespace {

std::vector<std::string> four(std::vector<std::string> extra) {
  std::vector<std::string> argv{kTrain,     "--model=tiny",     "--global-batch=8", "--seq-len=32",
                                "--lr=3e-3", "--warmup-steps=2", "--seed=7",         "--quiet",
                                "--devices=4", "--steps=40"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

size_t lines_of(const std::string& file) {
  std::ifstream in(file);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

// Runs 40 steps with checkpoints in tmp/ck; after 3 steps, `interrupt(supervisor, ranks)`.
// Returns the result and the step the run says it saved.
std::pair<ProcessResult, int64_t> interrupted(const TempDir& tmp,
                                              const std::function<void(int, std::vector<int>)>& interrupt) {
  Process p(four({"--checkpoint-dir=" + tmp / "ck", "--metrics=" + tmp / "a.jsonl"}));
  const auto ranks = children_of(p.pid(), 4);
  EXPECT_EQ(ranks.size(), 4u);
  for (int i = 0; i < 1200 && lines_of(tmp / "a.jsonl") < 3; ++i) std::this_thread::sleep_for(50ms);
  interrupt(p.pid(), ranks);
  auto r = p.wait(120s);
  EXPECT_FALSE(r.timed_out);
  int64_t saved = -1;
  const auto at = r.output.find(": saved step ");
  if (at != std::string::npos) saved = std::stoll(r.output.substr(at + 13));
  return {r, saved};
}

TEST(TrainPreempt, SignalToOneRankSavesTheStepAndResumesBitIdentically) {
  TempDir tmp;
  auto ref = std::async(std::launch::async, [&] {
    return run(four({"--metrics=" + tmp / "ref.jsonl"}), {}, 180s);
  });
  auto [r, saved] = interrupted(tmp, [](int, std::vector<int> ranks) { ::kill(ranks[2], SIGTERM); });
  EXPECT_EQ(r.exit_code(), 143) << r.output;
  ASSERT_GT(saved, 0) << r.output;
  ASSERT_LT(saved, 40) << r.output;
  EXPECT_NE(r.output.find("fsdp-train: SIGTERM: saved step " + std::to_string(saved) + " to " +
                          tmp / "ck/step-"),
            std::string::npos) << r.output;
  EXPECT_EQ(lines_of(tmp / "a.jsonl"), static_cast<size_t>(saved)) << "the checkpoint is of the step the run got to";
  const auto list = fsdp::list_checkpoints(tmp / "ck");
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].step, saved);
  EXPECT_EQ(list[0].status, fsdp::CheckpointStatus::kComplete);
  auto done = ref.get();
  ASSERT_EQ(done.exit_code(), 0) << done.output;
  const auto want = metrics_losses(tmp / "ref.jsonl");
  r = run(four({"--checkpoint-dir=" + tmp / "ck", "--resume", "--metrics=" + tmp / "b.jsonl"}), {}, 180s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  const auto got = metrics_losses(tmp / "b.jsonl");
  EXPECT_EQ(got.size(), static_cast<size_t>(40 - saved));
  for (const auto& [step, loss] : got) EXPECT_EQ(loss, want.at(step)) << "step " << step;
}

TEST(TrainPreempt, Usr1ToTheLauncherSavesOnEveryRank) {
  TempDir tmp;
  auto [r, saved] = interrupted(tmp, [](int supervisor, std::vector<int>) { ::kill(supervisor, SIGUSR1); });
  EXPECT_EQ(r.exit_code(), 138) << r.output;
  ASSERT_GT(saved, 0) << r.output;
  EXPECT_NE(r.output.find("fsdp-train: SIGUSR1: saved step "), std::string::npos) << r.output;
  EXPECT_EQ(fsdp::latest_checkpoint(tmp / "ck"), fsdp::checkpoint_path(tmp / "ck", saved));
  EXPECT_EQ(fsdp::verify_checkpoint(fsdp::checkpoint_path(tmp / "ck", saved)).step, saved);
}

// Whether `pid` has a handler for `sig` (SigCgt in /proc/PID/status).
bool catches(int pid, int sig) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("SigCgt:", 0) != 0) continue;
    return (std::stoull(line.substr(7), nullptr, 16) >> (sig - 1)) & 1;
  }
  return false;
}

// Ctrl-C twice on a terminal (SIGINT to the whole process group): the first asks for a save after
// the step, the second stops every rank at once (SIGINT's default action), before the step ends.
// Nothing is saved; the supervisor exits 130, saying it was interrupted.
TEST(TrainPreempt, SecondSigintStopsAtOnceWithoutSaving) {
  TempDir tmp;
  // Steps of about a second on 2 ranks, so the step is still running at the second SIGINT.
  Process p({kTrain, "--devices=2", "--model=small", "--global-batch=16", "--seq-len=256",
             "--steps=30", "--quiet", "--checkpoint-dir=" + tmp / "ck",
             "--metrics=" + tmp / "m.jsonl"});
  const auto ranks = children_of(p.pid(), 2);
  ASSERT_EQ(ranks.size(), 2u);
  for (int i = 0; i < 1200 && lines_of(tmp / "m.jsonl") < 1; ++i) std::this_thread::sleep_for(50ms);
  ASSERT_TRUE(catches(ranks[0], SIGINT) && catches(ranks[1], SIGINT));
  ::kill(-p.pid(), SIGINT);
  // The first SIGINT's handler restores SIGINT's default action: once both ranks ran it, the
  // second cannot merge with the first.
  for (int i = 0; i < 30000 && (catches(ranks[0], SIGINT) || catches(ranks[1], SIGINT)); ++i) {
    std::this_thread::sleep_for(1ms);
  }
  const auto second = std::chrono::steady_clock::now();
  ::kill(-p.pid(), SIGINT);
  auto r = p.wait(60s);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - second, 10s) << r.output;
  EXPECT_EQ(r.exit_code(), 130) << r.output;
  EXPECT_NE(r.output.find("fsdp-train: interrupted by SIGINT; stopped all 2 ranks"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("saved step"), std::string::npos) << r.output;
  EXPECT_TRUE(!fs::exists(tmp / "ck") || fs::is_empty(tmp / "ck")) << "a save started";
  EXPECT_LT(lines_of(tmp / "m.jsonl"), 3u) << "the step went on after the second SIGINT";
}

// --signal-save-timeout bounds what follows the signal: here a requeue that hangs (a stand-in
// scontrol that sleeps, as scontrol does while slurmctld does not answer). Rank 0 exits with the
// signal's status after 1 s, saying what did not finish; the checkpoint is saved.
TEST(TrainPreempt, SignalSaveTimeoutBoundsAHungRequeue) {
  TempDir tmp;
  fs::create_directories(tmp / "bin");
  {
    std::ofstream f(tmp / "bin/scontrol");
    f << "#!/bin/sh\nexec >/dev/null 2>&1\nexec sleep 60\n";
  }
  fs::permissions(tmp / "bin/scontrol", fs::perms::owner_all);
  Process p(args({"--steps=400", "--checkpoint-dir=" + tmp / "ck", "--requeue",
                  "--signal-save-timeout=1", "--metrics=" + tmp / "m.jsonl"}),
            {{"PATH", tmp / "bin:" + std::string(std::getenv("PATH"))}, {"SLURM_JOB_ID", "4242"}});
  for (int i = 0; i < 1200 && lines_of(tmp / "m.jsonl") < 2; ++i) std::this_thread::sleep_for(50ms);
  const auto start = std::chrono::steady_clock::now();
  ::kill(p.pid(), SIGUSR1);  // the supervisor relays it to both ranks
  auto r = p.wait(60s);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s) << r.output;
  EXPECT_EQ(r.exit_code(), 138) << r.output;
  const auto at = r.output.find("fsdp-train: SIGUSR1: saved step ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const int64_t saved = std::stoll(r.output.substr(at + 32));
  EXPECT_NE(r.output.find("fsdp-train: error: 'scontrol requeue 4242' did not finish within "
                          "--signal-save-timeout 1 s; exiting without requeueing (step " +
                          std::to_string(saved) + " is saved"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("requeued SLURM job"), std::string::npos) << r.output;
  EXPECT_EQ(fsdp::verify_checkpoint(fsdp::checkpoint_path(tmp / "ck", saved)).step, saved);
}

TEST(TrainPreempt, BadPreemptionFlagsFailBeforeStarting) {
  for (const auto& [flags, expected] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--save-on-signal=TERM,KILL"}, "'KILL' is not a signal fsdp-train can save on"},
           {{"--requeue"}, "--requeue requeues after a save on a signal, which needs --checkpoint-dir"},
           {{"--signal-save-timeout=0"}, "--signal-save-timeout 0 is invalid"},
       }) {
    auto r = run(args(flags));
    EXPECT_EQ(r.exit_code(), 2) << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
  }
}

}  // namespace
