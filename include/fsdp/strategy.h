// fsdp/strategy.h: how a model is sharded. FSDPStrategy is the one object a user fills in;
// plan_sharding() validates it against the world, identically on every rank and before any
// collective, and resolves it to a 2-D (replicate, shard) layout the engine runs on.
//
// NOTE [strategies as meshes]
// Every strategy is a (replicate R, shard S) layout of the W ranks:
//   FULL_SHARD, SHARD_GRAD_OP     (1, W)  shard over all ranks
//   NO_SHARD                      (W, 1)  replicate over all ranks: DDP
//   HYBRID_SHARD, HYBRID_SHARD_ZERO2  (R, S) as given by device_mesh; default (W / ranks per node,
//                                  ranks per node): shard inside a node, replicate across nodes
// Parameters are sharded over the shard group, gradients reduce-scattered there, then the
// gradient shard all-reduced over the replicate group. FULL_SHARD and HYBRID_SHARD free the
// unsharded parameters after forward (ZeRO-3); SHARD_GRAD_OP and HYBRID_SHARD_ZERO2 keep them
// until after backward (ZeRO-2).
#pragma once

#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/mesh.h"
#include "fsdp/runtime_options.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

enum class ShardingStrategy { kFullShard, kShardGradOp, kNoShard, kHybridShard, kHybridShardZero2 };
const char* to_string(ShardingStrategy s);  // "FULL_SHARD", ...
// Case-insensitive; '-' and '_' are interchangeable ("hybrid-shard" works).
ShardingStrategy parse_sharding_strategy(const std::string& text);
bool is_hybrid(ShardingStrategy s);
bool reshards_after_forward(ShardingStrategy s);

// When gradients are communicated during gradient accumulation (see ShardedModule::no_sync).
enum class GradSync {
  kEveryMicroStep,   // reduce-scatter (and all-reduce) every backward: least memory
  kLocal,            // no communication inside no_sync(); the unsharded gradients accumulate
                     // locally until the last micro-step (costs one unsharded gradient per unit)
  kReplicateOnLast,  // hybrid strategies: reduce-scatter every micro-step, all-reduce across
                     // replicas only on the last one (costs one gradient shard)
};
const char* to_string(GradSync g);  // "every", "local", "replicate_on_last"
GradSync parse_grad_sync(const std::string& text);

enum class StateDictType {
  kFull,     // every parameter unsharded, under the model's own names (same on every rank)
  kSharded,  // this rank's flat shards (names "<unit>.flat_param"), for same-mesh resume
};
const char* to_string(StateDictType t);

// Compute dtypes. Unset fields mean fp32. Master shards and optimizer state stay fp32.
struct MixedPrecision {
  // dtype of the gathered parameters, hence of forward and backward compute.
  std::optional<c10::ScalarType> param_dtype;
  // dtype gradients are reduced in; defaults to param_dtype.
  std::optional<c10::ScalarType> reduce_dtype;
  static MixedPrecision bf16() { return {c10::kBFloat16, c10::kBFloat16}; }
  static MixedPrecision fp16() { return {c10::kHalf, c10::kHalf}; }
  std::string describe() const;
};

// Picks which modules become FSDP units (each unit is gathered, freed and reduced as one flat
// buffer). Candidates are modules whose forward fsdp can intercept: fsdp::Unit<M> members and
// children of a torch::nn::Sequential (see sharded.h). Everything not in a unit belongs to the
// root unit.
class WrapPolicy {
 public:
  // Every fsdp::Unit<M> in the model (the default).
  static WrapPolicy units();
  // Candidates whose module is an M (e.g. every transformer block). Selecting a module fsdp cannot
  // intercept is an error naming it, not a silent skip.
  template <class... M>
  static WrapPolicy by_type() {
    WrapPolicy p;
    p.name_ = "by_type(" + type_names<M...>() + ")";
    p.match_ = [](const torch::nn::Module& m) { return (is_a<M>(m) || ...); };
    p.strict_types_ = true;
    return p;
  }
  // Candidates holding at least `n` parameters (counting their whole subtree).
  static WrapPolicy min_params(int64_t n);

  // Whether `module` (with `numel` parameters in its subtree) should become a unit.
  bool selects(const torch::nn::Module& module, int64_t numel) const;
  // by_type policies: selecting a module that is not a candidate is an error.
  bool strict_types() const { return strict_types_; }
  // Whether a Sequential's children are candidates (not for units(), which only takes Unit<M>).
  bool wraps_sequential_children() const { return sequential_; }
  const std::string& name() const { return name_; }

 private:
  friend class CheckpointPolicy;
  template <class M>
  static bool is_a(const torch::nn::Module& m) {
    return dynamic_cast<const M*>(&m) != nullptr;
  }
  template <class... M>
  static std::string type_names() {
    std::string s;
    ((s += (s.empty() ? "" : ", ") + demangle(typeid(M).name())), ...);
    return s;
  }
  static std::string demangle(const char* name);
  std::string name_ = "units";
  std::function<bool(const torch::nn::Module&)> match_;
  int64_t min_params_ = 0;
  bool strict_types_ = false;
  bool sequential_ = true;
};

// Picks which units recompute their forward in backward instead of keeping its activations
// (activation checkpointing, see fsdp/activation_checkpoint.h). A checkpointed unit keeps only
// its input tensors from forward; its backward gathers the parameters once (the gather backward
// does anyway), recomputes the forward, back-propagates through it and frees them again.
// Only units can be checkpointed (the wrap policy makes them); the root unit never is.
class CheckpointPolicy {
 public:
  // No checkpointing (the default).
  static CheckpointPolicy none();
  // Every unit except the root.
  static CheckpointPolicy all_units();
  // Units whose module is an M (e.g. the transformer block). Selecting a module that is not a
  // unit (one fsdp cannot intercept, or one the wrap policy left out) is an error naming it.
  template <class... M>
  static CheckpointPolicy by_type() {
    CheckpointPolicy p;
    p.name_ = "by_type(" + WrapPolicy::type_names<M...>() + ")";
    p.match_ = [](const torch::nn::Module& m) { return (WrapPolicy::is_a<M>(m) || ...); };
    return p;
  }
  bool enabled() const { return all_ || match_ != nullptr; }
  bool all_units_selected() const { return all_; }
  // by_type: whether `module` is one of the types.
  bool matches(const torch::nn::Module& module) const { return match_ && match_(module); }
  const std::string& name() const { return name_; }

 private:
  std::string name_ = "none";
  std::function<bool(const torch::nn::Module&)> match_;
  bool all_ = false;
};

// Every option of fsdp::shard(), as chainable setters with in-class defaults:
//   fsdp::FSDPStrategy().sharding_strategy("hybrid_shard").forward_prefetch(false)
// Each FSDP_OPTION(T, name, default) line below declares exactly these members (the macro only
// saves writing them out for every option):
//   public:  FSDPStrategy& name(T value);   // sets the option; returns *this for chaining
//   public:  const T& name() const;         // reads it
//   private: T name_ = default;
// e.g. FSDP_OPTION(bool, forward_prefetch, true) gives forward_prefetch(bool) and
// forward_prefetch() const, true until set.
class FSDPStrategy {
#define FSDP_OPTION(T, name, ...)                                  \
 public:                                                           \
  FSDPStrategy& name(T value) {                                    \
    name##_ = std::move(value);                                    \
    return *this;                                                  \
  }                                                                \
  const T& name() const { return name##_; }                        \
                                                                   \
 private:                                                          \
  T name##_ = __VA_ARGS__;

  // The options. Each line declares the setter FSDPStrategy& name(T) and the getter
  // const T& name() const (see above the class).

  // FULL_SHARD (default), SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2.
  FSDP_OPTION(ShardingStrategy, sharding_strategy, ShardingStrategy::kFullShard)
  // The options of the Runtime fsdp::shard() (and DeferredInit) create when given none: backend,
  // timeout, threads, collective algorithm, heap policy, each with the default RuntimeOptions
  // gives it (fsdp/runtime_options.h: the one definition of them). Given a runtime, shard()
  // uses it as it is, except that a backend other than kAuto must be the runtime's.
  FSDP_OPTION(RuntimeOptions, runtime, RuntimeOptions{})
  // Compute in bf16/fp16 with fp32 master shards. Default: fp32 throughout.
  FSDP_OPTION(MixedPrecision, mixed_precision, MixedPrecision{})
  // Which modules become units. Default WrapPolicy::units().
  FSDP_OPTION(WrapPolicy, auto_wrap_policy, WrapPolicy::units())
  // Issue the next unit's all-gather while the current unit computes, in forward and in
  // backward. Default on; off serialises communication (for measuring the overlap).
  FSDP_OPTION(bool, forward_prefetch, true)
  FSDP_OPTION(bool, backward_prefetch, true)
  // Gradient communication inside no_sync(). Default kEveryMicroStep.
  FSDP_OPTION(GradSync, grad_sync, GradSync::kEveryMicroStep)
  // What state_dict() returns. Default kFull.
  FSDP_OPTION(StateDictType, state_dict_type, StateDictType::kFull)
  // Broadcast rank 0's parameters and buffers when sharding, so every rank starts equal even if
  // their initialisations differ. Default on.
  FSDP_OPTION(bool, sync_module_states, true)
  // Which units recompute their forward in backward (CheckpointPolicy above). Default none.
  FSDP_OPTION(CheckpointPolicy, activation_checkpointing, CheckpointPolicy::none())
  // Before each collective on the model's groups (and the world group), compare (sequence
  // number, operation, unit, size) across the group through the rendezvous store, and fail on
  // every rank naming the first rank and unit that differ, instead of hanging or, for equal-sized
  // units, exchanging the wrong data (NOTE [collective check] in fsdp/collectives.h). Default
  // off: it costs a few store round trips per collective (docs/concepts.md, "Desynchronised
  // ranks").
  FSDP_OPTION(bool, debug_collectives, false)
#undef FSDP_OPTION

 public:
  FSDPStrategy() = default;
  // Shorthands for runtime().backend and runtime().timeout (RuntimeOptions says what they do;
  // default kAuto and 5 minutes): setting one changes only that field of runtime().
  FSDPStrategy& backend(Backend backend) {
    runtime_.backend = backend;
    return *this;
  }
  Backend backend() const { return runtime_.backend; }
  FSDPStrategy& timeout(std::chrono::milliseconds timeout) {
    runtime_.timeout = timeout;
    return *this;
  }
  std::chrono::milliseconds timeout() const { return runtime_.timeout; }
  // Accepts "full_shard", "HYBRID-SHARD", ...; throws fsdp::Error listing the choices.
  FSDPStrategy& sharding_strategy(const std::string& name);
  FSDPStrategy& sharding_strategy(const char* name) { return sharding_strategy(std::string(name)); }
  // The mesh as a shape, e.g. {2, 4} (one dim may be -1), or as a ready DeviceMesh.
  FSDPStrategy& device_mesh(std::vector<int64_t> shape);
  FSDPStrategy& device_mesh(std::shared_ptr<DeviceMesh> mesh);
  const std::vector<int64_t>& device_mesh() const { return mesh_shape_; }  // empty: default
  const std::shared_ptr<DeviceMesh>& device_mesh_object() const { return mesh_; }

  // One canonical line with every setting; ranks compare it before communicating.
  std::string describe() const;

 private:
  std::vector<int64_t> mesh_shape_;
  std::shared_ptr<DeviceMesh> mesh_;
};

// Parses "2,4", "(2, 4)", "-1,4" or "8". Throws fsdp::Error with the expected form.
std::vector<int64_t> parse_mesh_shape(const std::string& text);

// A strategy validated against a world: what the engine runs.
struct ShardingPlan {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  MeshLayout layout;  // always 2-D: dim 0 replicate (size R), dim 1 shard (size S)
  bool reshard_after_forward = true;
  std::vector<std::string> warnings;  // e.g. a shard group that spans nodes
  int64_t replicate_size() const { return layout.size(0); }
  int64_t shard_size() const { return layout.size(1); }
};

// Validates `strategy` for `world_size` ranks with `local_world_size` ranks per node. Pure and
// deterministic: every rank gets the same plan or the same fsdp::Error (product of the mesh !=
// world, a bad -1, more than two dims, a 2-D mesh with a non-hybrid strategy, a hybrid strategy
// with a 1-D mesh, replicate_on_last without a hybrid strategy, a non-float mixed precision).
ShardingPlan plan_sharding(const FSDPStrategy& strategy, int64_t world_size,
                           int64_t local_world_size);

}  // namespace fsdp
