// fsdp/runtime.h: this process's membership in the job: rendezvous, process groups, threads.
//
// Runtime::init() reads the launcher's environment (cluster.h), sets this rank's intra-op threads
// and heap policy (configure_process), meets the other ranks through a c10d TCPStore hosted by
// rank 0 and creates the world group (Gloo on CPU, NCCL on CUDA). Several runtimes can coexist
// (tests run ranks as threads): a runtime's store, groups and counters are its own. What init
// changes in the whole process is exactly what fsdp/process.h lists (NOTE [process-global
// state]): the intra-op thread pools' size, glibc malloc's heap policy, and glog's level while
// the rank connects to the store; with NCCL it also makes the rank's GPU the calling thread's
// current CUDA device.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/cluster.h"
#include "fsdp/collectives.h"
#include "fsdp/process.h"
#include "fsdp/runtime_options.h"

namespace fsdp {

class Runtime {
 public:
  // Joins the job described by the environment (detect_cluster). Throws fsdp::Error on a bad
  // environment, an unreachable or busy rendezvous address, or ranks missing past the timeout.
  static std::shared_ptr<Runtime> init(const RuntimeOptions& options = {});
  static std::shared_ptr<Runtime> init(const ClusterEnv& env, const RuntimeOptions& options);

  // Waits (up to the timeout) until every rank reached shutdown before rank 0 closes the store.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const ClusterEnv& env() const;
  int64_t rank() const;
  int64_t world_size() const;
  Backend backend() const;           // resolved: never kAuto
  // Why backend() is what it is, e.g. "auto picked gloo: this libtorch has CUDA but sees no GPU
  // (CUDA_VISIBLE_DEVICES='')". The library prints nothing: a tool shows it where it reports
  // its setup.
  const std::string& backend_reason() const;
  // Whether options().heap took effect (set_heap_policy's result).
  bool heap_applied() const;
  c10::Device device() const;        // cpu, or cuda:<local rank> with NCCL
  const RuntimeOptions& options() const;
  int64_t threads() const;           // intra-op threads this rank uses

  // The group of all ranks.
  std::shared_ptr<Group> world() const;

  // Creates the group of the global `ranks` (in group-rank order). Every rank must call it with
  // the same arguments in the same order, members or not (each call takes the next store
  // prefix); non-members get nullptr. `kind` labels the group's metrics ("shard", "replicate").
  // `algorithm` overrides the runtime's choice for this group (benchmarks).
  std::shared_ptr<Group> new_group(const std::vector<int64_t>& ranks, const std::string& kind,
                                   CollectiveAlgorithm algorithm = CollectiveAlgorithm::kAuto);

  // Throws fsdp::Error on every rank, naming both values, unless every rank passed the same
  // `value` for `what`. Uses only the store, so it is safe before the first collective and
  // cannot hang on mismatched collectives.
  void check_agreement(const std::string& what, const std::string& value);

  // Makes a local failure everyone's: each rank passes "" if its part of `what` succeeded, else
  // its error message. Returns on every rank if all succeeded; otherwise throws fsdp::Error on
  // every rank: a failed rank its own ("<what> failed: ..."), the others the lowest failed
  // rank's ("<what> failed on rank k: ..."), so
  // no rank goes on into a collective its peers will never join. Store only; call on every rank
  // in the same order.
  void check_all_ok(const std::string& what, const std::string& local_error);

  struct Impl;  // defined in runtime.cpp; tests build runtimes on an in-process store through it

 private:
  explicit Runtime(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend struct RuntimeFactory;
};

}  // namespace fsdp
