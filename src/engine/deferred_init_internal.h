// deferred_init_internal.h: what the engine uses of deferred construction (NOTE [deferred init]
// in fsdp/deferred_init.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/runtime.h"
#include "fsdp/sharded.h"

namespace fsdp::detail {

// The shards of the units of a model built under DeferredInit, checked and adopted by
// fsdp::shard(). Not thread-safe; lives inside Engine::build.
class DeferredShards {
 public:
  // How many modules of `root` hold shards from DeferredInit (0: an eager build). Local.
  static int64_t count(torch::nn::Module& root);

  // Checks every such unit against the plan (`infos`, made with shard group size `shard_size`)
  // on every rank: an error on any rank (a parameter written, replaced or refrozen after its
  // unit was built, a unit the policy `policy_name` does not select, another mesh) becomes every
  // rank's fsdp::Error (check_all_ok). Then the ranks compare each unit's checksum
  // (check_agreement) and refuse values that differ, naming the first such unit. Store only: no
  // collective runs, so nothing hangs.
  DeferredShards(torch::nn::Module& root, const std::vector<UnitInfo>& infos,
                 const std::string& policy_name, int64_t shard_size, int64_t shard_rank,
                 Runtime& runtime);

  // This rank's fp32 shard of `module`'s trainable (or frozen) flat, laid out as the engine
  // flattens it; undefined if `module` was not built deferred.
  at::Tensor shard(const torch::nn::Module* module, bool trainable) const;

  // Detaches the shards from their units once the engine holds them (frees the placeholders
  // with the last parameter that pointed into them).
  void release();

 private:
  struct Adopted {
    std::string path;
    UnitHooks* hooks;
    std::shared_ptr<DeferredUnit> unit;
  };
  std::vector<Adopted> adopted_;
  std::map<const torch::nn::Module*, size_t> index_;
};

}  // namespace fsdp::detail
