// fsdp-train's end-of-run summary: what every rank contributes to each step's metrics, what the
// checkpoint flags did, and the summary rank 0 prints (see train.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "build_model.h"
#include "fsdp/checkpoint.h"
#include "fsdp/report.h"
#include "fsdp/trace.h"
#include "memory_account.h"
#include "options.h"

namespace fsdp_train {

// --val-data results: (step, loss), step 0 being before any update.
using ValLosses = std::vector<std::pair<int64_t, double>>;

// What every rank contributes to the per-step metrics, gathered on rank 0's side by all_gather.
enum Stat : int64_t {
  kLoss,           // this rank's mean loss over its slice of the global batch
  kStepTime,       // seconds
  kShardedState,   // parameter + gradient shards + optimizer state, bytes
  kGatheredPeak,   // gathered parameters and unsharded gradients at peak, bytes
  kPeakRss,        // the whole process's peak resident size, bytes: VmHWM, or construction's
                   // peak where that is larger (VmHWM restarts when construction ends)
  kPeakRssAfter,   // VmHWM since construction ended (0: not measured separately), bytes
  kCommShard,      // payload issued this step on the shard group, bytes
  kCommReplicate,  // ... on the replicate group
  kCommWorld,      // ... on the world group (not counting these metrics)
  kSignal,         // a --save-on-signal signal this rank received, 0 if none (NOTE [preemption])
  kMinorFaults,    // minor page faults of the whole process during the step (getrusage)
  kNumStats,
};

struct StepRecord {
  double loss = 0, lr = 0, step_time_s = 0, tokens_per_s = 0;
  double max[kNumStats] = {};  // largest over ranks
};

// What the checkpoint flags did, for the summary.
struct CheckpointLog {
  int64_t saves = 0;
  fsdp::CheckpointInfo last_save;
  int64_t async_saves = 0;    // of `saves`, written in the background
  double async_blocked_s = 0; // training time they took, all together
  int64_t async_committed = 0;   // of `async_saves`, committed
  double async_write_s = 0;      // their background writes (slowest rank each), all together
  int64_t staging_bytes = 0;
  int64_t page_cache_writes = 0;  // async files written through the page cache (no O_DIRECT)
  std::optional<fsdp::CheckpointInfo> loaded;
  int64_t resumed_step = 0;
  std::string exported;
  double export_s = 0;
  std::string exported_llmc;
};

// "(R, S)" of a sharding plan.
std::string mesh_string(const fsdp::ShardingPlan& s);

// The checkpoint lines of the summary (resumed from, saves, async saves, exports).
void print_checkpoints(const TrainOptions& o, const CheckpointLog& c);

// Rank 0's end-of-run summary: loss, throughput, memory per rank and where rank 0's goes,
// communication per group against the plan, checkpoints.
void print_summary(const TrainOptions& o, const TrainPlan& p, const std::vector<StepRecord>& steps,
                   const ValLosses& val, const fsdp::TopologyReport& report, double total_s,
                   const CheckpointLog& ckpt, const std::string& backend, const std::string& heap,
                   const Construction& construction, const MemoryAccount& account,
                   const std::optional<fsdp::TraceSummary>& trace);

}  // namespace fsdp_train
