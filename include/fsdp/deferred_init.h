// fsdp/deferred_init.h: building a model larger than one rank's memory.
//
//   fsdp::DeferredInit init(strategy);               // joins the job, plans the mesh
//   torch::manual_seed(0);                           // the same seed on every rank
//   auto net = std::make_shared<NetImpl>(cfg);       // each fsdp::Unit keeps only its shard
//   auto model = fsdp::shard(net, init);             // adopts the shards, shards the root
//
// NOTE [deferred init]
// libtorch cannot build torch::nn modules without memory (no meta-device construction in C++:
// factories take no default device and Module::to(kMeta) throws), and a rank cannot draw only
// its own slice of a parameter's random values (CPU normal_ depends on the tensor's size). So
// every rank runs every constructor, with the same seed, exactly as an eager build does, and
// each fsdp::Unit<M> keeps only this rank's shard of its flat parameters the moment its own
// constructor returns. Every rank draws the same numbers in the same order, so the shards are
// bit-identical to sharding an eagerly built model, on any mesh.
//   - Peak while building: the parameters outside any unit (the root's), one whole unit, and
//     the shards built so far. A unit's parameters then point into a zero-filled placeholder of
//     their own size that holds no memory until written (an anonymous mapping), so code that
//     reads their shapes still works.
//   - Checked by fsdp::shard(net, init), on every rank, before any collective: a unit whose
//     parameter was written after the unit was built (a parent constructor re-initialising it,
//     in place, through .data() or by set_data/.to()), replaced (tied to another module's
//     weight), or whose requires_grad changed, is an error naming the parameter (the change
//     would otherwise be lost); so is a unit the wrap policy does not select. Then every rank
//     compares a checksum of each unit's values: ranks that built different values (a
//     rank-dependent seed, nondeterministic initialisation) are refused, naming the unit. This
//     comparison replaces sync_module_states' broadcast for the units (no rank holds the whole
//     model to broadcast); the root's parameters and every buffer are still broadcast.
//   - Units only: fsdp::Unit<M> modules shard themselves. Sequential children the wrap policy
//     selects are built whole as part of their parent and sharded by fsdp::shard() as in an
//     eager build; put large layers in fsdp::Unit<M> to build them deferred.
//   - Initialise each unit's parameters inside its own constructor (reset_parameters, init::
//     functions). Freeze (requires_grad false) there too, or after fsdp::shard() never.
// Deferred init lives on this thread: units built on other threads while it is active are
// built eagerly (each rank thread of a test has its own DeferredInit).
#pragma once

#include <cstdint>
#include <memory>

#include "fsdp/runtime.h"
#include "fsdp/sharded.h"
#include "fsdp/strategy.h"

namespace fsdp {

class DeferredInit {
 public:
  // Creates the Runtime from the environment (as fsdp::shard does) unless one is given, and
  // validates `strategy` against the world (plan_sharding) so each unit knows its shard. From
  // here until finish() (fsdp::shard(net, init) calls it) every fsdp::Unit<M> built on this
  // thread shards itself. One DeferredInit per thread at a time; throws fsdp::Error otherwise.
  explicit DeferredInit(FSDPStrategy strategy, std::shared_ptr<Runtime> runtime = nullptr);
  ~DeferredInit();
  DeferredInit(const DeferredInit&) = delete;
  DeferredInit& operator=(const DeferredInit&) = delete;

  // Stops sharding new units. Idempotent.
  void finish();
  bool active() const;

  const FSDPStrategy& strategy() const;
  const std::shared_ptr<Runtime>& runtime() const;
  const ShardingPlan& plan() const;
  int64_t shard_rank() const;  // this rank's index in its shard group

  // What construction did on this rank, for logs and tests.
  struct Stats {
    int64_t units = 0;               // units built and sharded
    int64_t unit_bytes = 0;          // their fp32 parameters, whole (what eager keeps)
    int64_t largest_unit_bytes = 0;  // the most one unit held at once
    int64_t shard_bytes = 0;         // the shards kept
    double slice_seconds = 0;        // time spent slicing, checksumming and freeing
  };
  const Stats& stats() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// fsdp::shard for a model built under `init`: ends the deferred scope, adopts every unit's
// shard, then shards the rest as fsdp::shard(module, init.strategy(), init.runtime()) does.
template <class M>
ShardedModule<M> shard(std::shared_ptr<M> module, DeferredInit& init) {
  init.finish();
  return ShardedModule<M>(std::move(module), init.strategy(), init.runtime());
}
template <class M>
ShardedModule<M> shard(const torch::nn::ModuleHolder<M>& holder, DeferredInit& init) {
  return shard(holder.ptr(), init);
}

}  // namespace fsdp
