// fsdp/sharded.h: sharding a libtorch module. The entry point is fsdp::shard():
//
//   struct BlockImpl : torch::nn::Module { ... torch::Tensor forward(torch::Tensor x); };
//   struct NetImpl : torch::nn::Module {
//     std::vector<fsdp::Unit<BlockImpl>> blocks;   // was std::vector<Block>: the one-word opt-in
//     ...
//   };
//   auto model = fsdp::shard(std::make_shared<NetImpl>(),
//                            fsdp::FSDPStrategy().sharding_strategy("hybrid_shard")
//                                                .device_mesh({2, 4}));
//   torch::optim::AdamW opt(model.parameters(), 1e-3);   // this rank's shards only
//   auto loss = torch::cross_entropy_loss(model(x), y);
//   opt.zero_grad(); loss.backward(); model.clip_grad_norm(1.0); opt.step();
//
// NOTE [intercepting forward]
// libtorch modules have no forward hooks and Module::forward is not virtual, so fsdp needs to run
// code around the forward of each unit. It can for two kinds of modules:
//   - fsdp::Unit<M> (a ModuleHolder of UnitImpl<M>, which derives from M): a drop-in for a
//     TORCH_MODULE holder whose forward gathers the unit's parameters, runs M::forward, then
//     frees them (FULL_SHARD) and arms the pre-backward hook. Without fsdp it is plain M. Parameter
//     names do not change.
//   - children of a torch::nn::Sequential whose forward maps a Tensor to a Tensor: fsdp swaps the
//     Sequential's entry for a wrapper; the child module itself stays registered.
// The wrap policy (strategy.h) picks among these candidates; the root unit holds every parameter
// not in a unit and is gathered by ShardedModule::forward for the whole forward and backward.
// Call the ShardedModule, never the inner module's forward directly: its parameters hold no
// memory while sharded (see summon_full_params() to read them).
//
// NOTE [gradient averaging]
// After backward each rank's gradient shard equals the gradient of the mean loss over the global
// batch, as if one process had run every rank's micro-batch: gradients are summed by
// reduce-scatter (shard group) and all-reduce (replicate group), then divided once by the number
// of data-parallel ranks R*S, in fp32, on the reduced shard (fp16 reductions divide by a power of
// two before reducing too, to stay in range). Averaging over gradient-accumulation micro-steps is
// the caller's job, as in PyTorch: scale each micro-step's loss by 1/K.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/activation_checkpoint.h"
#include "fsdp/detail/collect_tensors.h"
#include "fsdp/detail/engine_calls.h"
#include "fsdp/detail/root_forward_scope.h"
#include "fsdp/detail/unit_impl.h"
#include "fsdp/runtime.h"
#include "fsdp/strategy.h"
#include "fsdp/unit_info.h"

namespace torch::optim {
class Optimizer;
}

namespace fsdp {

// fsdp::Unit<BlockImpl> replaces the holder Block (TORCH_MODULE(Block)) in a model. UnitImpl<M>
// (M with its forward intercepted) is in fsdp/detail/unit_impl.h.
template <class M>
using Unit = torch::nn::ModuleHolder<UnitImpl<M>>;

// UnitInfo (one unit as planned) is in fsdp/unit_info.h.
// NOTE [frozen parameters]
// A unit's parameters form two flat tensors, each sharded the same way over the shard group:
// the trainable ones (requires_grad) and the frozen ones. Both are gathered before the unit's
// forward and backward; only the trainable flat gets a gradient buffer, a reduce-scatter and an
// all-reduce, an optimizer shard (parameters()) and optimizer state. A frozen flat is freed in
// backward once the gradients of the unit's tensor arguments and of its trainable parameters
// are complete (the last moment autograd can read it), like FSDP2's post-backward on inputs.
// requires_grad is read at fsdp::shard(); changing it later is an error at the next forward.

// Finds the units `policy` makes of `model`, without sharding anything: what the engine and the
// topology report (report.h) both use. Throws fsdp::Error if a by_type policy selects a module
// whose forward cannot be intercepted, or a parameter is shared between units.
std::vector<UnitInfo> plan_units(torch::nn::Module& model, const WrapPolicy& policy,
                                 int64_t shard_size);

// This rank's memory, in bytes.
struct MemoryStats {
  int64_t param_shard_bytes = 0;      // fp32 parameter shards (what the optimizer updates)
  int64_t grad_shard_bytes = 0;       // fp32 gradient shards
  int64_t optimizer_state_bytes = 0;  // state of the optimizer passed in (Adam: 2 per element)
  int64_t unsharded_now_bytes = 0;    // gathered parameters and unsharded gradients held now
  int64_t unsharded_peak_bytes = 0;   // ... and their peak since the last reset_peak()
  int64_t accumulation_bytes = 0;     // gradients kept between micro-steps (grad_sync modes)
  int64_t replica_param_bytes = 0;    // one unsharded fp32 replica of the parameters, for scale
  // The engine's large CPU buffers (gathered flats, unsharded gradients, and the reduced
  // gradients that become the shards' .grad) live in mappings of their own, reused step to
  // step, outside malloc (NOTE [buffer pool] in src/engine/buffer_pool.h): mapped now (in use
  // or kept for the next step), and the peak since reset_peak() of the gathered/unsharded ones.
  // 0 on CUDA.
  int64_t pool_mapped_bytes = 0;
  int64_t pool_peak_bytes = 0;
  // Of grad_shard_bytes, those in those mappings (so also in pool_mapped_bytes): the .grad the
  // reduce-scatter wrote (NOTE [gradient pool] in src/engine/engine.h), or under NO_SHARD the
  // unsharded gradient itself.
  int64_t pooled_grad_bytes = 0;
  // Of sharded_state_bytes, those outside malloc's heap: the pooled gradients above and, on
  // CPU, the parameter shards (each in a mapping of its own: NOTE [mapped shards] in
  // src/base/mapped_tensor.h). The rest (optimizer state) is malloc's.
  int64_t mapped_state_bytes = 0;
  int64_t sharded_state_bytes() const {
    return param_shard_bytes + grad_shard_bytes + optimizer_state_bytes;
  }
};

// Bytes of optimizer state (Adam/AdamW moments, SGD momentum, RMSprop/Adagrad buffers).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

// The non-template base of every ShardedModule<M>, whatever the sharding strategy (FULL_SHARD,
// NO_SHARD, HYBRID_SHARD, ...): everything but the forward. Take a ShardedModuleBase& to accept
// any sharded model (save_checkpoint does); see shard().
class ShardedModuleBase {
 public:
  // Virtual: a ShardedModule<M> held through a ShardedModuleBase pointer releases its M too.
  virtual ~ShardedModuleBase() = default;
  ShardedModuleBase(const ShardedModuleBase&) = default;
  ShardedModuleBase(ShardedModuleBase&&) = default;
  ShardedModuleBase& operator=(const ShardedModuleBase&) = default;
  ShardedModuleBase& operator=(ShardedModuleBase&&) = default;

  // This rank's trainable parameter shards, one flat fp32 tensor per unit that has trainable
  // parameters: give these to the optimizer. Frozen parameters (NOTE [frozen parameters]) are
  // not among them. (fsdp::shard() refuses a model with no trainable parameter.)
  std::vector<at::Tensor> parameters() const;
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;  // "<unit>.flat_param"
  // Throws fsdp::Error unless every tensor `optimizer` holds is one of parameters() (a frozen
  // shard, an inner module's parameter or a foreign tensor is named). No communication;
  // save_checkpoint and memory_stats call it too.
  void check_optimizer(const torch::optim::Optimizer& optimizer) const;
  // Parameter counts: trainable (requires_grad at shard()) and all, over the whole model.
  int64_t trainable_numel() const;
  int64_t total_numel() const;

  // Inside no_sync(), backward skips the communication the strategy's grad_sync mode allows
  // (GradSync::kLocal: all of it; kReplicateOnLast: the replicate all-reduce; kEveryMicroStep:
  // none). Leave it for the last micro-step, whose backward then reduces everything accumulated:
  //   auto guard = model.no_sync(/*enabled=*/k + 1 < K);
  class NoSyncGuard {
   public:
    NoSyncGuard(std::shared_ptr<detail::Engine> engine, bool enabled);
    ~NoSyncGuard();
    NoSyncGuard(NoSyncGuard&&) = default;
   private:
    std::shared_ptr<detail::Engine> engine_;
  };
  NoSyncGuard no_sync(bool enabled = true);

  // Scales gradient shards so their global L2 norm is at most `max_norm`; returns the norm
  // before clipping. Collective on the shard group: call on every rank.
  double clip_grad_norm(double max_norm);

  // Parameters (and buffers) under the model's names, per the strategy's state_dict_type.
  // kFull gathers: collective, every rank gets the same dict.
  torch::OrderedDict<std::string, at::Tensor> state_dict();
  // Loads a dict from state_dict(): kFull from any mesh, kSharded from the same mesh. No
  // communication. Throws fsdp::Error naming a missing or mis-shaped entry.
  void load_state_dict(const torch::OrderedDict<std::string, at::Tensor>& dict);

  // Gathers every unit into the inner module until the guard dies, so its parameters can be
  // read (collective on entry). Forward inside the guard does not free them.
  class SummonGuard {
   public:
    explicit SummonGuard(std::shared_ptr<detail::Engine> engine);
    ~SummonGuard();
    SummonGuard(SummonGuard&&) = default;
   private:
    std::shared_ptr<detail::Engine> engine_;
  };
  SummonGuard summon_full_params();

  MemoryStats memory_stats(const torch::optim::Optimizer* optimizer = nullptr) const;
  void reset_peak_memory();
  // Payload bytes issued per group kind ("shard", "replicate", "world") since the groups were
  // created. "world" is runtime()->world(): it also counts the caller's own collectives on it.
  std::vector<std::pair<std::string, CommCounters>> comm_counters() const;

  const ShardingPlan& plan() const;
  const std::vector<UnitInfo>& units() const;
  std::shared_ptr<Runtime> runtime() const;
  std::shared_ptr<DeviceMesh> mesh() const;
  c10::ScalarType param_dtype() const;

 protected:
  ShardedModuleBase(std::shared_ptr<torch::nn::Module> module, const FSDPStrategy& strategy,
                    std::shared_ptr<Runtime> runtime);
  friend const std::shared_ptr<detail::Engine>& detail::engine_of(const ShardedModuleBase&);
  std::shared_ptr<detail::Engine> engine_;
};

// The old name of ShardedModuleBase, from when it ran FULL_SHARD only.
using FullyShardedModule [[deprecated("renamed ShardedModuleBase")]] = ShardedModuleBase;

// A sharded M: call it like M.
template <class M>
class ShardedModule : public ShardedModuleBase {
 public:
  ShardedModule(std::shared_ptr<M> module, const FSDPStrategy& strategy,
                std::shared_ptr<Runtime> runtime)
      : ShardedModuleBase(module, strategy, std::move(runtime)), module_(std::move(module)) {}

  // Gathers the root unit, runs M::forward (units gather and free themselves), arms backward.
  // With mixed precision, floating-point tensor arguments are cast to the compute dtype.
  template <class... Args>
  auto forward(Args&&... args) {
    detail::RootForwardScope scope(engine_.get());
    auto out = module_->forward(cast(std::forward<Args>(args))...);
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(tensors, out);
    scope.finish(tensors);
    return out;
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // The wrapped module (its parameters are views of gathered buffers; see summon_full_params).
  const std::shared_ptr<M>& module() const { return module_; }

 private:
  template <class T>
  decltype(auto) cast(T&& value) {
    if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
      return detail::cast_input(engine_.get(), value);
    } else {
      return std::forward<T>(value);
    }
  }
  std::shared_ptr<M> module_;
};

// Shards `module` with `strategy`. Creates the Runtime from the environment (launcher, torchrun,
// SLURM, mpirun) unless one is given. Validates everything on every rank before the first
// collective; throws fsdp::Error with one line naming the problem and the fix.
template <class M>
ShardedModule<M> shard(std::shared_ptr<M> module, const FSDPStrategy& strategy = {},
                       std::shared_ptr<Runtime> runtime = nullptr) {
  return ShardedModule<M>(std::move(module), strategy, std::move(runtime));
}
template <class M>
ShardedModule<M> shard(const torch::nn::ModuleHolder<M>& holder, const FSDPStrategy& strategy = {},
                       std::shared_ptr<Runtime> runtime = nullptr) {
  return ShardedModule<M>(holder.ptr(), strategy, std::move(runtime));
}

}  // namespace fsdp
