// fsdp/backend.h: which collective backend a runtime uses (Gloo on CPU tensors, NCCL on CUDA
// tensors), and its names for flags and settings lines. Runtime::init resolves kAuto
// (Runtime::backend_reason says why it picked what it did).
#pragma once

#include <string>

namespace fsdp {

enum class Backend {
  kAuto,  // nccl when this libtorch has CUDA and a GPU is visible, else gloo
  kGloo,  // CPU tensors
  kNccl,  // CUDA tensors, one GPU per local rank (cuda:<LOCAL_RANK>); more local ranks than
          // visible GPUs is an error
};
const char* to_string(Backend b);
Backend parse_backend(const std::string& text);  // "auto" | "gloo" | "nccl", any case

}  // namespace fsdp
