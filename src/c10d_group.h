// c10d_group.h (internal): a Group on a c10d backend (ProcessGroupGloo or ProcessGroupNCCL).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "compat.h"
#include "fsdp/collectives.h"

namespace fsdp::detail {

// `has_flat_collectives`: the backend implements _allgather_base and _reduce_scatter_base;
// `is_nccl` picks the native algorithms for kAuto.
// Collectives run on one worker thread per group (NOTE [collective contract]): composite
// fallbacks such as the ring reduce-scatter need several c10d calls, and one issuing thread keeps
// every member's c10d call order identical.
std::shared_ptr<Group> make_c10d_group(c10::intrusive_ptr<compat::C10dBackend> backend,
                                       std::vector<int64_t> ranks, int64_t rank, std::string kind,
                                       bool has_flat_collectives, bool is_nccl,
                                       CollectiveAlgorithm algorithm);

}  // namespace fsdp::detail
