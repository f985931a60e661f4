// runtime_internal.h (internal): building a Runtime on a store the caller already has (tests run
// several ranks as threads of one process over a shared c10d::HashStore), and the backend and GPU
// rules of Runtime::init as pure functions, so that a machine without a GPU tests them. Includes
// process_setup.h (QuietGlog), which Runtime::init uses around its store connection.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <cstdint>
#include <string>

#include "fsdp/runtime.h"
#include "process_setup.h"

namespace fsdp::detail {

std::shared_ptr<Runtime> make_runtime(c10::intrusive_ptr<c10d::Store> store, const ClusterEnv& env,
                                      const RuntimeOptions& options);

// The backend `requested` resolves to in a process whose libtorch was built with CUDA or not and
// sees `visible_gpus` GPUs, and why (Runtime::backend_reason). kAuto: nccl where a GPU is
// visible, else gloo. Throws fsdp::Error for nccl without CUDA or without a GPU.
struct BackendChoice {
  Backend backend;
  std::string reason;
};
BackendChoice choose_backend(Backend requested, bool cuda_built, int64_t visible_gpus);

// NCCL needs one GPU per rank (two ranks on one GPU: "Duplicate GPU detected"): throws
// fsdp::Error unless this node's `local_world_size` ranks fit on its `visible_gpus`. With one GPU
// per local rank no mesh can put two ranks on one GPU.
void check_one_gpu_per_rank(int64_t local_rank, int64_t local_world_size, int64_t visible_gpus);

// Runtime::check_all_ok in two halves (Rendezvous::check_all_ok_reserved): reserve on the
// caller's thread, in the same order on every rank as the other agreements; run later, on any
// thread (an asynchronous save's writer), until *cancel turns true.
int64_t reserve_agreement(Runtime& rt);
void check_all_ok_reserved(Runtime& rt, int64_t id, const std::string& what,
                           const std::string& local_error, const std::atomic<bool>* cancel);

}  // namespace fsdp::detail
