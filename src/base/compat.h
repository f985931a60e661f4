// compat.h: every difference between the libtorch versions we support (1.13 and 2.x) lives here.
//
// NOTE [libtorch versions]
// - 1.13: c10d backends derive from ProcessGroup; Gloo lacks _allgather_base and
//   _reduce_scatter_base (docs/platform.md), so collectives.cpp falls back to bandwidth-optimal
//   compositions of the calls it does have.
// - 2.x: backends derive from c10d::Backend; Gloo has both flat collectives; TCPStore defaults to a
//   libuv server that Debian's build lacks, so we ask for the classic one.
// - torch::optim keys its per-parameter state by the TensorImpl's address printed as a string in
//   1.13, by the address itself in 2.x (optimizer_state_key).
// - The rendezvous store's server listens on every interface in 1.13 (TCPStoreOptions has no
//   address and no way to pass a socket); since 2.2 `masterListenFd` hands it a socket we bound to
//   the master address ourselves (kStoreBindsMasterAddr, docs/security.md).
// - CUDA (FSDP_WITH_CUDA, set where the libtorch found has CUDA): the NCCL header needs
//   USE_C10D_NCCL; the caching allocator's DeviceStats type moved to c10::CachingDeviceAllocator
//   in 2.x (cuda_allocated_bytes reads both). Only CUDA builds compile these.
// - c10::Allocator's allocate() lost its const and gained a pure virtual copy_data in 2.3
//   (FSDP_ALLOCATE_CONST, FSDP_ALLOCATOR_COPY_DATA).
// Nothing outside this file tests TORCH_VERSION_*.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_utils.h>
#include <torch/version.h>

#include <cstring>
#include <type_traits>
#include <utility>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if defined(FSDP_WITH_CUDA)
// ProcessGroupNCCL.hpp is empty unless USE_C10D_NCCL is defined; CUDA builds of libtorch export
// it, but not every packaging does.
#if !defined(USE_C10D_NCCL)
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

// c10::Allocator: allocate() is const until 2.2 and not from 2.3 on, which also adds the pure
// virtual copy_data (engine/deferred_heap.cpp implements one).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define FSDP_ALLOCATE_CONST
#define FSDP_ALLOCATOR_COPY_DATA                                                   \
  void copy_data(void* dest, const void* src, std::size_t count) const override { \
    std::memcpy(dest, src, count);                                                 \
  }
#else
#define FSDP_ALLOCATE_CONST const
#define FSDP_ALLOCATOR_COPY_DATA
#endif

namespace fsdp::compat {

#if TORCH_VERSION_MAJOR >= 2
constexpr bool kGlooHasFlatCollectives = true;
using C10dBackend = c10d::Backend;
#else
constexpr bool kGlooHasFlatCollectives = false;
using C10dBackend = c10d::ProcessGroup;
#endif

// The key of `param`'s entry in torch::optim::Optimizer::state().
inline auto optimizer_state_key(const at::Tensor& param) {
#if TORCH_VERSION_MAJOR >= 2
  return static_cast<void*>(param.unsafeGetTensorImpl());
#else
  return c10::guts::to_string(param.unsafeGetTensorImpl());
#endif
}

template <typename Options, typename = void>
struct HasMasterListenFd : std::false_type {};
template <typename Options>
struct HasMasterListenFd<Options, std::void_t<decltype(std::declval<Options&>().masterListenFd)>>
    : std::true_type {};
// Whether the store's server can listen on a socket we bound (to the master address only).
constexpr bool kStoreBindsMasterAddr = HasMasterListenFd<c10d::TCPStoreOptions>::value;

// Hands `fd` (bound and listening on opts.port) to the server, which then owns it. Only where
// kStoreBindsMasterAddr.
template <typename Options>
void set_store_listen_fd(Options& opts, int fd) {
  if constexpr (HasMasterListenFd<Options>::value) opts.masterListenFd = fd;
}

inline c10d::TCPStoreOptions tcp_store_options() {
  c10d::TCPStoreOptions opts;
#if TORCH_VERSION_MAJOR >= 2
  opts.useLibUV = false;
#endif
  return opts;
}

#if defined(FSDP_WITH_CUDA)
// Makes `index` the current CUDA device of the calling thread.
inline void set_cuda_device(c10::DeviceIndex index) { c10::cuda::set_device(index); }
inline int64_t current_cuda_device() { return c10::cuda::current_device(); }

// Bytes the CUDA caching allocator has handed out on `index`: now, and the peak since the last
// reset_cuda_peak (both counted in the allocator's rounded block sizes).
struct CudaAllocated {
  int64_t current = 0;
  int64_t peak = 0;
};
inline CudaAllocated cuda_allocated_bytes(c10::DeviceIndex index) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
  const auto& all = stats.allocated_bytes[0];  // StatType::AGGREGATE in both versions
  return {all.current, all.peak};
}
inline void reset_cuda_peak(c10::DeviceIndex index) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(index);
}
#else
inline void set_cuda_device(c10::DeviceIndex) {
  TORCH_INTERNAL_ASSERT(false, "set_cuda_device without CUDA support");
}
inline int64_t current_cuda_device() {
  TORCH_INTERNAL_ASSERT(false, "current_cuda_device without CUDA support");
  return -1;
}
#endif

}  // namespace fsdp::compat
