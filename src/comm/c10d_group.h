// c10d_group.h (internal): a Group on a c10d backend (ProcessGroupGloo or ProcessGroupNCCL).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "base/compat.h"
#include "base/trace_sink.h"
#include "fsdp/collectives.h"

namespace fsdp::detail {

// `has_flat_collectives`: the backend implements _allgather_base and _reduce_scatter_base.
// Gloo (`is_nccl` false): collectives run on one worker thread per group (NOTE [collective
// contract]): composite fallbacks such as the ring reduce-scatter need several c10d calls, and one
// issuing thread keeps every member's c10d call order identical; kAuto means kRing.
// NCCL: NCCL's own flat collectives issued on the calling thread (NOTE [NCCL groups] in
// c10d_group.cpp); `algorithm` must be kAuto or kNative.
// `check_store`: the group's own keys in the rendezvous store for NOTE [collective check]
// (Group::set_debug_collectives), waited on up to `timeout`; none: the group ignores
// set_debug_collectives.
std::shared_ptr<Group> make_c10d_group(c10::intrusive_ptr<compat::C10dBackend> backend,
                                       std::vector<int64_t> ranks, int64_t rank, std::string kind,
                                       bool has_flat_collectives, bool is_nccl,
                                       CollectiveAlgorithm algorithm,
                                       c10::intrusive_ptr<c10d::Store> check_store = {},
                                       std::chrono::milliseconds timeout = {},
                                       std::shared_ptr<TraceSlot> trace = nullptr);

}  // namespace fsdp::detail
