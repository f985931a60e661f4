// backend_internal.h (internal): the backend and GPU rules of Runtime::init as pure functions
// (defined in backend.cpp), so that a machine without a GPU tests them.
#pragma once

#include <cstdint>
#include <string>

#include "fsdp/backend.h"

namespace fsdp::detail {

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

}  // namespace fsdp::detail
