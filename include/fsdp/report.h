// fsdp/report.h: what a sharding plan means for a model, before (or while) training: the mesh as
// a grid, every rank's coordinate and node, the ranks of every group, the communication per
// optimizer step and the memory per rank against one unsharded replica.
// `fsdp-train --dry-run [--json]` prints it; programs can log it the same way.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/strategy.h"
#include "fsdp/unit_info.h"

namespace fsdp {

struct ReportOptions {
  int64_t grad_accum = 1;               // micro-steps per optimizer step
  GradSync grad_sync = GradSync::kEveryMicroStep;  // how no_sync() micro-steps communicate
  bool clip = false;                    // clip_grad_norm every step (one 8-byte all-reduce)
  int64_t optimizer_states = 2;         // fp32 state tensors per parameter: AdamW 2, SGD+momentum 1
  c10::ScalarType param_dtype = c10::kFloat;   // gathered parameter dtype
  c10::ScalarType reduce_dtype = c10::kFloat;  // gradient reduction dtype
  bool prefetch = true;

  // grad_sync, prefetch and dtypes as `strategy` sets them; the rest stays at the defaults.
  static ReportOptions for_strategy(const FSDPStrategy& strategy);
};

struct RankPlacement {
  int64_t rank = 0, replicate = 0, shard = 0, node = 0, local_rank = 0;
};

// Payload bytes one rank issues per optimizer step, in CommCounters' terms (collectives.h).
struct StepComm {
  int64_t shard_all_gather = 0;      // shard group: gathering parameters (forward and backward)
  int64_t frozen_all_gather = 0;     // ... of which frozen parameters (NOTE [frozen parameters])
  int64_t shard_reduce_scatter = 0;  // shard group: reducing gradients
  int64_t shard_all_reduce = 0;      // shard group: gradient-norm for clipping
  int64_t replicate_all_reduce = 0;  // replicate group: gradient shards across replicas
};

struct RankMemory {
  int64_t params = 0, grads = 0, optimizer = 0;  // params: trainable and frozen
  int64_t total() const { return params + grads + optimizer; }
};

struct TopologyReport {
  int64_t world_size = 1, num_nodes = 1, local_world_size = 1;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int64_t replicate_size = 1, shard_size = 1;
  std::vector<RankPlacement> ranks;
  std::vector<std::vector<int64_t>> shard_groups, replicate_groups;
  std::vector<UnitInfo> units;
  int64_t total_params = 0;
  int64_t trainable_params = 0;         // requires_grad; gradients and optimizer state cover these
  StepComm comm;
  RankMemory sharded;                   // this plan, per rank (largest shard)
  RankMemory replica;                   // one unsharded replica, for comparison
  int64_t peak_unsharded_param_bytes = 0;  // gathered parameters at once (estimate)
  std::vector<std::string> warnings;

  std::string to_text() const;  // the grid picture and tables, for people
  std::string to_json() const;  // one JSON object, for programs
};

TopologyReport make_topology_report(const ShardingPlan& plan, int64_t local_world_size,
                                    const std::vector<UnitInfo>& units,
                                    const ReportOptions& options = {});

// Human-readable bytes: "1.50 MiB".
std::string format_bytes(double bytes);
// Human-readable counts: "3.41 M", "12.5 k", "640".
std::string format_count(double n);
// A count as people write one: "124475904", "70e9", "6.7B", "124M", "350k", "1.5T" (k/K, M, B/G,
// T; a whole number of units after scaling). Throws fsdp::Error naming `what` and the text.
int64_t parse_count(const std::string& text, const char* what);

}  // namespace fsdp
