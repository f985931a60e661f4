// fsdp/runtime_options.h: the settings of a Runtime (backend, timeout, threads, collective
// algorithm, heap policy), each with its default: the one definition of them. Runtime::init
// takes them, and FSDPStrategy holds them for the runtime fsdp::shard() creates
// (FSDPStrategy::runtime).
#pragma once

#include <chrono>
#include <cstdint>

#include "fsdp/backend.h"
#include "fsdp/collectives.h"
#include "fsdp/process.h"

namespace fsdp {

struct RuntimeOptions {
  // Collective backend. Default kAuto.
  Backend backend = Backend::kAuto;
  // Rendezvous and collective timeout: a rank that waits longer for its peers fails with an
  // error naming what it waited for, instead of hanging. Default 5 minutes.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Intra-op threads of this rank. 0 (default): OMP_NUM_THREADS if set (the launcher sets it),
  // else max(1, cores / local world size).
  int64_t threads = 0;
  // How all-gather and reduce-scatter run (see collectives.h). Default kAuto.
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::kAuto;
  // Applied by init() to the whole process (configure_process). Default kRetain.
  HeapPolicy heap = HeapPolicy::kRetain;
};

}  // namespace fsdp
