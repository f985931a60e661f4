// Desynchronised collectives as real processes (issue 21, NOTE [collective check]): ranks whose
// control flow runs a model's units in different orders. With FSDPStrategy::debug_collectives
// every rank fails at once, naming the first rank and unit that differ; without it the run
// finishes with exit status 0 and wrong numbers. fsdp-train --debug-collectives trains exactly as
// without it.
#include <gtest/gtest.h>

#include <chrono>
#include <regex>

#include "testing.h"

using namespace fsdp::testing;
using namespace std::chrono_literals;

namespace {

const std::string kRun = tool_dir() + "/fsdp-run";
const std::string kWorker = binary_dir() + "/fsdp_desync_worker";

ProcessResult desync(const std::string& mode) {
  // --output-hold 0: each rank's line as it printed it (no merging), so both can be counted.
  return run({kRun, "--nproc-per-node", "2", "--output-hold", "0", kWorker, mode}, {}, 90s);
}

TEST(DebugCollectives, UnitsInDifferentOrdersFailOnEveryRankNamingRankAndUnit) {
  const auto start = std::chrono::steady_clock::now();
  auto r = desync("on");
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 60s) << "must fail, not wait for a timeout";
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  // The first collective of the shard group is the first block's all-gather: rank 0 gathers
  // block0, rank 1 (reversed) block2. Both are 560 floats (LayerNorm 32 + 272 + 256).
  const std::string expected =
      "error: collective #1 on the shard group [0, 1]: rank 1 issued all_gather of unit "
      "'block2' (560 Float elements) while rank 0 issued all_gather of unit 'block0' (560 Float "
      "elements); the ranks' control flow differs";
  for (int rank : {0, 1}) {
    EXPECT_NE(r.output.find("fsdp_desync_worker[" + std::to_string(rank) + "]: " + expected),
              std::string::npos)
        << "rank " << rank << ":\n" << r.output;
  }
}

// What happens without the check (the behaviour the check exists for): equal-sized units
// exchange each other's shards over the ring, the forward computes with a mix of two units'
// parameters, and the job exits 0.
TEST(DebugCollectives, WithoutItTheDesyncGoesUnnoticedAndTheOutputIsWrong) {
  auto r = desync("off");
  ASSERT_FALSE(r.timed_out) << r.output;
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  const std::regex line("rank ([01]): max \\|sharded - unsharded\\| = ([0-9.e+-]+)");
  int seen = 0;
  for (std::sregex_iterator it(r.output.begin(), r.output.end(), line), end; it != end; ++it) {
    ++seen;
    EXPECT_GT(std::stod((*it)[2]), 1e-3) << "rank " << (*it)[1] << " computed right:\n" << r.output;
  }
  EXPECT_EQ(seen, 2) << r.output;
}

// The check itself changes nothing: a HYBRID_SHARD (2, 2) run with clipping and a checkpoint
// (collectives on the shard, replicate and world groups) has bit-identical losses with and
// without it.
TEST(DebugCollectives, FsdpTrainWithTheCheckTrainsExactlyAsWithout) {
  TempDir tmp;
  std::map<int64_t, double> losses[2];
  for (int debug : {0, 1}) {
    const std::string metrics = tmp / ("m" + std::to_string(debug) + ".jsonl");
    std::vector<std::string> argv{kTrain, "--devices=4", "--strategy=hybrid_shard", "--mesh=2,2",
                                  "--model=tiny", "--global-batch=8", "--seq-len=32", "--steps=3",
                                  "--quiet", "--metrics=" + metrics,
                                  "--checkpoint-dir=" + tmp / ("ck" + std::to_string(debug))};
    if (debug) argv.push_back("--debug-collectives");
    auto r = run(argv, {}, 120s);
    ASSERT_EQ(r.exit_code(), 0) << r.output;
    losses[debug] = metrics_losses(metrics);
  }
  ASSERT_EQ(losses[0].size(), 3u);
  EXPECT_EQ(losses[0], losses[1]);
}

}  // namespace
