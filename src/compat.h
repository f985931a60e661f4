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
//   the master address ourselves (kStoreBindsMasterAddr, README "Security").
// Nothing outside this file tests TORCH_VERSION_*.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_utils.h>
#include <torch/version.h>

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

}  // namespace fsdp::compat
