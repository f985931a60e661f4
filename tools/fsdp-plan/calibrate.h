// fsdp-plan --calibrate: measures this machine and writes its cluster file (fsdp/planner.h).
//   collectives: bench_collectives' ring all-gather and reduce-scatter bus bandwidth per message
//                size (the project's own collectives, as the engine runs them) -> the bands
//   compute:     one-process fsdp-train steps of the small GPT, one thread -> FLOP/s of a core
//   memory:      the node's physical memory, shared by the ranks; cores: online CPUs
//   contention:  one FULL_SHARD run at --devices ranks -> how many times their benchmarked time
//                the collectives take inside a training step (ClusterSpec::comm_contention)
#pragma once

#include <cstdint>
#include <string>

namespace CLI {
class App;
}

namespace fsdp_plan {

struct CalibrateOptions {
  int64_t devices = 4;     // ranks bench_collectives runs
  std::string sizes = "1,4,16,64";  // MiB of the buffers it times
  int64_t steps = 4;       // fsdp-train steps timed for the compute rate (median of the last half)
  std::string output;      // empty: fsdp::calibrated_cluster_path()
};

void add_calibrate_flags(CLI::App& app, CalibrateOptions& o, bool& enabled);

// Runs the measurements with the tools next to `self` (bench_collectives, fsdp-train), writes the
// cluster file and prints it. Throws fsdp::Error naming what failed.
int calibrate(const CalibrateOptions& o, const std::string& self);

}  // namespace fsdp_plan
