// fsdp/unit_info.h: one FSDP unit as planned (its parameter counts and how they shard), shared by
// the engine (sharded.h), the topology report (report.h) and the planner (planner.h). No libtorch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

// One unit as planned: its module path ("" for the root) and parameter counts. Trainable and
// frozen parameters are separate flats (NOTE [frozen parameters] in sharded.h).
struct UnitInfo {
  std::string name;
  int64_t numel = 0;         // trainable parameters P (requires_grad)
  int64_t padded_numel = 0;  // S * ceil(P / S)
  int64_t shard_numel = 0;   // ceil(P / S): elements this rank stores
  std::vector<std::string> params;  // the trainable parameters' names, in flat order
  int64_t frozen_numel = 0;         // frozen parameters F (requires_grad false)
  int64_t frozen_padded_numel = 0;  // S * ceil(F / S)
  int64_t frozen_shard_numel = 0;   // ceil(F / S)
  std::vector<std::string> frozen_params;
  // Set by fsdp::shard for a model built under DeferredInit (NOTE [deferred init] in
  // sharded.h): "deferred" for a unit that sharded itself as it was built, "built whole" for one
  // built with its parent (the root; Sequential children), which held all its parameters once.
  // Empty otherwise.
  std::string construction;
  int64_t total_numel() const { return numel + frozen_numel; }

  // Fills the shard and padded counts for a shard group of `shard_size` ranks: every rank
  // stores ceil(P / S) elements, the last one padded.
  void set_shard_size(int64_t shard_size) {
    shard_numel = (numel + shard_size - 1) / shard_size;
    padded_numel = shard_numel * shard_size;
    frozen_shard_numel = (frozen_numel + shard_size - 1) / shard_size;
    frozen_padded_numel = frozen_shard_numel * shard_size;
  }
};

}  // namespace fsdp
