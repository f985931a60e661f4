// compat.h: every difference between the libtorch versions we support (1.13 and 2.x) lives here.
//
// NOTE [libtorch versions]
// - 1.13: c10d backends derive from ProcessGroup; Gloo lacks _allgather_base and
//   _reduce_scatter_base (../shared/NOTES.md), so collectives.cpp falls back to bandwidth-optimal
//   compositions of the calls it does have.
// - 2.x: backends derive from c10d::Backend; Gloo has both flat collectives; TCPStore defaults to a
//   libuv server that Debian's build lacks, so we ask for the classic one.
// Nothing outside this file tests TORCH_VERSION_*.
#pragma once

#include <torch/version.h>

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

inline c10d::TCPStoreOptions tcp_store_options() {
  c10d::TCPStoreOptions opts;
#if TORCH_VERSION_MAJOR >= 2
  opts.useLibUV = false;
#endif
  return opts;
}

}  // namespace fsdp::compat
