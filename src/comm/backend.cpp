// The collective backend: its names, and the rules that resolve kAuto and refuse NCCL where it
// cannot run (fsdp/backend.h, comm/backend_internal.h).
#include "fsdp/backend.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

#include "fsdp/error.h"
#include "fsdp/parse_enum.h"
#include "comm/backend_internal.h"

namespace fsdp {

const char* to_string(Backend b) {
  switch (b) {
    case Backend::kAuto: return "auto";
    case Backend::kGloo: return "gloo";
    case Backend::kNccl: return "nccl";
  }
  return "?";
}

Backend parse_backend(const std::string& text) {
  return parse_enum(text, {Backend::kAuto, Backend::kGloo, Backend::kNccl}, "backend");
}

namespace {

std::string cuda_visible_devices() {
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  return v ? detail::cat("CUDA_VISIBLE_DEVICES='", v, "'") : "CUDA_VISIBLE_DEVICES unset";
}

}  // namespace

namespace detail {

BackendChoice choose_backend(Backend requested, bool cuda_built, int64_t visible_gpus) {
  switch (requested) {
    case Backend::kGloo: return {Backend::kGloo, "gloo, as requested"};
    case Backend::kNccl:
      FSDP_CHECK(cuda_built, "backend nccl needs CUDA, but this libtorch is a CPU-only build; use "
                 "--backend gloo (or auto), or build against a CUDA libtorch");
      FSDP_CHECK(visible_gpus > 0, "backend nccl needs a GPU, but this CUDA libtorch sees none (",
                 cuda_visible_devices(), "); use --backend gloo (or auto), or run where a GPU is "
                 "visible");
      return {Backend::kNccl, "nccl, as requested"};
    case Backend::kAuto: break;
  }
  if (!cuda_built) return {Backend::kGloo, "auto picked gloo: this libtorch is a CPU-only build"};
  if (visible_gpus == 0) {
    return {Backend::kGloo, detail::cat("auto picked gloo: this libtorch has CUDA but sees no GPU (",
                                        cuda_visible_devices(), ")")};
  }
  return {Backend::kNccl, detail::cat("auto picked nccl: this libtorch has CUDA and sees ",
                                      visible_gpus, visible_gpus == 1 ? " GPU" : " GPUs")};
}

void check_one_gpu_per_rank(int64_t local_rank, int64_t local_world_size, int64_t visible_gpus) {
  FSDP_CHECK(local_world_size <= visible_gpus && local_rank < visible_gpus, local_world_size,
             " ranks run on this node but it has only ", visible_gpus,
             visible_gpus == 1 ? " visible GPU (" : " visible GPUs (", cuda_visible_devices(),
             "), and NCCL needs one GPU per rank; start at most ", visible_gpus,
             " ranks per node (--devices ", visible_gpus, "), or use --backend gloo");
}

}  // namespace detail

}  // namespace fsdp
