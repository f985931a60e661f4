// The sharding engine's construction: planning the units, flattening and sharding their
// parameters (or building them straight into shards), installing the hooks (see engine.h).
#include "engine/engine.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>

#include "base/mapped_tensor.h"
#include "engine/deferred_init_internal.h"
#include "runtime/runtime_internal.h"
#include "fsdp/error.h"
#include "fsdp/memory.h"

namespace fsdp {
namespace detail {

namespace {

// Fires after a parameter's AccumulateGrad node ran: its gradient for this backward is complete.
class GradReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradReadyHook(std::weak_ptr<Engine> engine, UnitState* unit, ParamSlot* slot)
      : engine_(std::move(engine)), unit_(unit), slot_(slot) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto e = engine_.lock()) e->on_grad_ready(*unit_, *slot_);
    return outputs;
  }

 private:
  std::weak_ptr<Engine> engine_;
  UnitState* unit_;
  ParamSlot* slot_;
};

// Stands in for a Sequential child so fsdp runs around its forward (NOTE [intercepting forward]).
class SequentialUnitImpl : public torch::nn::Module {
 public:
  SequentialUnitImpl(torch::nn::AnyModule inner, UnitState* unit, std::string path)
      : torch::nn::Module("fsdp::SequentialUnit"), inner_(std::move(inner)), unit_(unit),
        path_(std::move(path)) {}
  at::Tensor forward(at::Tensor x) {
    unit_pre_forward(unit_);
    if (unit_tracks_inputs(unit_)) unit_track_inputs(unit_, {x});
    at::Tensor out;
    try {
      if (auto opts = unit_checkpoint(unit_)) {
        out = fsdp::checkpoint(*opts, [this](at::Tensor t) { return inner_.forward(std::move(t)); },
                         std::move(x));
      } else {
        out = inner_.forward(std::move(x));
      }
    } catch (const c10::Error& e) {
      throw Error(detail::cat("Sequential child '", path_, "' is an fsdp unit but its forward is "
                              "not Tensor -> Tensor (", error_message(e), "); leave it out of the "
                              "wrap policy or declare it as fsdp::Unit<M>"));
    }
    unit_post_forward(unit_, {out});
    return out;
  }

 private:
  torch::nn::AnyModule inner_;
  UnitState* unit_;
  std::string path_;
};


}  // namespace

// ---------------------------------------------------------------------------------------------
// Construction

Engine::Engine(std::shared_ptr<torch::nn::Module> root, FSDPStrategy strategy,
               std::shared_ptr<Runtime> runtime)
    : root_(std::move(root)), strategy_(std::move(strategy)), runtime_(std::move(runtime)) {}

void Engine::build() {
  FSDP_CHECK(root_, "fsdp::shard: the module is null");
  streams_ = DeviceStreams(runtime_->device());
  pooled_ = runtime_->device().is_cpu();
  trace_ = trace_slot(*runtime_);
  const int64_t deferred_units = check_and_agree();
  make_groups();
  const ModuleMap by_path = make_units();
  shard_units(by_path, deferred_units);
  // 5. Hooks.
  for (auto& u : units_) install_hooks(*u, by_path);
  // NOTE [construction's heap]: building the model left freed whole values in malloc's heap,
  // between blocks that stay (with deferred construction, the shards sliced from each unit as
  // it was built): memory the process keeps but training cannot use in one piece. Its pages go
  // back now; training faults in what it reuses (measured with NOTE [deferred heap] and NOTE
  // [mapped shards]: docs/performance.md, "Construction's heap").
  if (pooled_) release_free_heap();
}

// 1. Everything that can be wrong is checked before the first collective, identically on every
//    rank (plan_sharding and plan_units are pure), and the ranks compare their settings through
//    the store so a mismatch is an error instead of a hang. Returns the number of units built
//    under DeferredInit.
int64_t Engine::check_and_agree() {
  plan_ = plan_sharding(strategy_, runtime_->world_size(), runtime_->env().local_world_size);
  R_ = plan_.replicate_size();
  S_ = plan_.shard_size();
  const auto& mp = strategy_.mixed_precision();
  param_dtype_ = mp.param_dtype.value_or(c10::kFloat);
  reduce_dtype_ = mp.reduce_dtype.value_or(param_dtype_);
  if (param_dtype_ != c10::kFloat) {
    // libtorch 1.13's CPU kernels have no fp16 matmul: fail here, in one clear line on every
    // rank, rather than in the first forward.
    try {
      auto probe = at::ones({2, 2}, at::TensorOptions().dtype(param_dtype_).device(runtime_->device()));
      (void)at::matmul(probe, probe);
    } catch (const std::exception& e) {
      throw Error(detail::cat("mixed precision ", c10::toString(param_dtype_), " is not supported by "
                              "this libtorch's ", runtime_->device().str(), " kernels (",
                              error_message(e), "); use MixedPrecision::bf16() on CPU"));
    }
  }
  infos_ = plan_units(*root_, strategy_.auto_wrap_policy(), S_);
  FSDP_CHECK(trainable_numel() > 0 || total_numel() == 0, "the model has no trainable parameter: "
             "all ", total_numel(), " have requires_grad false, so there is nothing to train; "
             "unfreeze some (parameter.requires_grad_(true)) before fsdp::shard()");
  std::ostringstream signature;
  for (const auto& p : root_->named_parameters()) signature << p.key() << p.value().sizes() << ";";
  const int64_t deferred_units = DeferredShards::count(*root_);  // NOTE [deferred init]
  runtime_->check_agreement(
      "FSDP configuration",
      strategy_.describe() + " model=" + std::to_string(std::hash<std::string>{}(signature.str())) +
          " deferred_units=" + std::to_string(deferred_units));
  if (runtime_->rank() == 0) {
    for (const auto& w : plan_.warnings) std::cerr << "fsdp: warning: " << w << std::endl;
  }
  return deferred_units;
}

// 2. Groups: the strategy's mesh or one made from the plan; the gradient divisors.
void Engine::make_groups() {
  if (auto given = strategy_.device_mesh_object()) {
    mesh_ = given;
  } else {
    mesh_ = std::make_shared<DeviceMesh>(runtime_, plan_.layout);
  }
  if (mesh_->ndim() == 1) {
    shard_group_ = mesh_->group(0);
    replicate_group_ = make_single_process_group(runtime_->rank(), "replicate");
    if (plan_.strategy == ShardingStrategy::kNoShard) std::swap(shard_group_, replicate_group_);
  } else {
    replicate_group_ = mesh_->group(0);
    shard_group_ = mesh_->group(1);
  }
  TORCH_INTERNAL_ASSERT(shard_group_->size() == S_ && replicate_group_->size() == R_);
  for (const auto& g : {shard_group_, replicate_group_, runtime_->world()}) {
    if (strategy_.debug_collectives()) g->set_debug_collectives(true);  // NOTE [collective check]
  }
  shard_rank_ = shard_group_->rank();
  // Sum-then-divide (NOTE [gradient averaging]); fp16 also pre-divides to stay in range.
  const double dp = static_cast<double>(R_ * S_);
  if (reduce_dtype_ == c10::kHalf) {
    while (pre_divide_ * 2 <= std::sqrt(dp)) pre_divide_ *= 2;
  }
  post_divide_ = dp / pre_divide_;
}

// 3. Units: root first, then the policy's picks in module order; each unit's frozen flat after
//    all trainable ones. Returns the modules by path.
Engine::ModuleMap Engine::make_units() {
  ModuleMap by_path;
  for (const auto& m : root_->named_modules("", /*include_self=*/true)) by_path[m.key()] = m.value();
  std::map<std::string, at::Tensor> params_by_name;
  for (const auto& p : root_->named_parameters()) params_by_name[p.key()] = p.value();
  for (const auto& info : infos_) units_.push_back(make_flat(info, true, by_path, params_by_name));
  for (size_t i = 0; i < infos_.size(); ++i) {
    if (infos_[i].frozen_numel == 0) continue;
    auto f = make_flat(infos_[i], false, by_path, params_by_name);
    f->owner = units_[i].get();
    units_[i]->frozen = f.get();
    units_.push_back(std::move(f));
  }
  select_checkpointed_units(by_path);
  return by_path;
}

// 4. Flatten, optionally broadcast rank 0's values, shard; units built under DeferredInit hold
//    their shards already (checked on every rank first, store only). Buffers (norm
//    statistics...) move to the runtime's device like the parameters (NCCL broadcasts only
//    device tensors).
void Engine::shard_units(const ModuleMap& by_path, int64_t deferred_units) {
  std::optional<DeferredShards> deferred;
  if (deferred_units > 0) {
    deferred.emplace(*root_, infos_, strategy_.auto_wrap_policy().name(), S_, shard_rank_,
                     *runtime_);
  }
  for (auto& u : units_) {
    at::Tensor shard = deferred ? deferred->shard(u->module, u->owner == nullptr) : at::Tensor();
    flatten_and_shard(*u, strategy_.sync_module_states(), shard);
  }
  if (deferred) {
    for (auto& info : infos_) {
      const auto* m = by_path.at(info.name).get();
      info.construction = deferred->shard(m, true).defined() || deferred->shard(m, false).defined()
                              ? "deferred"
                              : "built whole";
    }
    deferred->release();
  }
  built_deferred_ = deferred_units > 0;
  for (auto& b : root_->named_buffers()) {
    if (b.value().device() != runtime_->device()) b.value().set_data(b.value().to(runtime_->device()));
  }
  if (strategy_.sync_module_states() && runtime_->world_size() > 1) {
    for (auto& b : root_->named_buffers()) {
      at::Tensor buf = b.value();
      at::Tensor bytes = buf.contiguous().view({-1}).view(at::kByte).clone();
      runtime_->world()->broadcast(bytes, 0, "buffer '" + b.key() + "'")->wait();
      torch::NoGradGuard no_grad;
      buf.copy_(bytes.view(buf.scalar_type()).view(buf.sizes()));
    }
  }
}

// One flat of unit `info`: its trainable parameters, or (trainable false) its frozen ones.
std::unique_ptr<UnitState> Engine::make_flat(const UnitInfo& info, bool trainable,
                                             const ModuleMap& modules,
                                             const std::map<std::string, at::Tensor>& params_by_name) {
  auto u = std::make_unique<UnitState>();
  u->engine = this;
  u->index = static_cast<int64_t>(units_.size());
  u->name = info.name;
  u->module = modules.at(u->name).get();
  u->hooks = u->index == 0 || !trainable ? nullptr : dynamic_cast<UnitHooks*>(u->module);
  u->numel = trainable ? info.numel : info.frozen_numel;
  u->padded = trainable ? info.padded_numel : info.frozen_padded_numel;
  u->shard_numel = trainable ? info.shard_numel : info.frozen_shard_numel;
  u->trainable = trainable && u->numel > 0;
  // Tied parameters appear under several names but are one tensor: one slot, many names.
  std::map<c10::TensorImpl*, size_t> slot_of;
  int64_t offset = 0;
  for (const auto& name : trainable ? info.params : info.frozen_params) {
    const at::Tensor& p = params_by_name.at(name);
    auto it = slot_of.find(p.unsafeGetTensorImpl());
    if (it != slot_of.end()) {
      u->params[it->second].aliases.push_back(name);
      continue;
    }
    ParamSlot slot;
    slot.name = name;
    slot.param = p;
    slot.offset = offset;
    slot.numel = p.numel();
    slot.shape = p.sizes().vec();
    slot.original_dtype = p.scalar_type();
    FSDP_CHECK(p.scalar_type() == at::kFloat, "parameter '", name, "' has dtype ",
               p.scalar_type(), " but fsdp keeps fp32 master shards; build the model in fp32 "
               "(model->to(torch::kFloat)) and use mixed_precision for bf16/fp16 compute");
    TORCH_INTERNAL_ASSERT(p.requires_grad() == trainable, "parameter ", name, " in the wrong flat");
    offset += slot.numel;
    slot_of[p.unsafeGetTensorImpl()] = u->params.size();
    u->params.push_back(std::move(slot));
  }
  TORCH_INTERNAL_ASSERT(offset == u->numel, "unit ", u->name, " numel mismatch");
  return u;
}

void Engine::flatten_and_shard(UnitState& u, bool broadcast, const at::Tensor& presharded) {
  torch::NoGradGuard no_grad;
  const auto device = runtime_->device();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  if (presharded.defined()) {
    TORCH_INTERNAL_ASSERT(presharded.numel() == u.shard_numel, "deferred shard of ", u.name);
    u.shard = presharded;
  } else {
    at::Tensor flat = at::zeros({u.padded}, f32);
    for (auto& s : u.params) {
      flat.narrow(0, s.offset, s.numel).copy_(s.param.detach().reshape({-1}));
    }
    if (broadcast && runtime_->world_size() > 1 && u.padded > 0) {
      runtime_->world()->broadcast(flat, 0, collective_label(u))->wait();
    }
    at::Tensor mine = flat.narrow(0, shard_rank_ * u.shard_numel, u.shard_numel);
    if (device.is_cpu()) {  // NOTE [mapped shards]
      u.shard = mapped_zeros(u.shard_numel, at::kFloat);
      u.shard.copy_(mine);
    } else {
      u.shard = mine.clone();
    }
  }
  u.shard.set_requires_grad(u.trainable);
  u.aliased = S_ == 1 && param_dtype_ == c10::kFloat;
  if (u.aliased) {
    u.full = u.shard.detach();
    u.phase = Phase::kUnsharded;
  } else {
    // `full` gets its memory when the unit is gathered (alloc_storage). The views below need
    // only its size: its storage claims the bytes without holding any. (It was a malloc of the
    // whole unit, freed at once; after the first of them glibc kept the rest in the heap, where
    // the small objects made in between left 108-136 MiB of the heap in pieces, W = 8, 16
    // blocks of d 768, deferred construction.)
    u.full = at::empty({0}, f32.dtype(param_dtype_));
    u.full.storage().unsafeGetStorageImpl()->set_nbytes(static_cast<size_t>(u.padded) *
                                                        u.full.element_size());
    u.full.unsafeGetTensorImpl()->set_sizes_contiguous({u.padded});
  }
  // Views first: narrow() checks the storage bounds, so it must run while `full` claims them.
  for (auto& s : u.params) {
    s.param.set_data(u.full.detach().narrow(0, s.offset, s.numel).view(s.shape));
  }
  if (!u.aliased) {
    // Not tracked: freed right away; alloc_storage/free_storage account from here on.
    auto* impl = u.full.storage().unsafeGetStorageImpl();
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, u.full.device()));
    impl->set_nbytes(0);
    u.phase = Phase::kSharded;
  }
}

void Engine::install_hooks(UnitState& u, const ModuleMap& modules) {
  std::weak_ptr<Engine> weak = weak_from_this();
  for (auto& s : u.params) {
    if (!s.param.requires_grad()) continue;
    // After set_data: a dtype change resets the accumulator, so take it now and keep it.
    s.grad_acc = torch::autograd::impl::grad_accumulator(s.param);
    TORCH_INTERNAL_ASSERT(s.grad_acc, "no grad accumulator for ", s.name);
    s.grad_acc->add_post_hook(std::make_unique<GradReadyHook>(weak, &u, &s));
  }
  if (u.index == 0 || u.owner) return;
  if (u.hooks) {
    u.hooks->fsdp_unit_ = &u;
  } else {
    wrap_sequential_child(u, modules);
  }
}

void Engine::wrap_sequential_child(UnitState& u, const ModuleMap& modules) {
  const std::string& path = u.name;
  auto dot = path.rfind('.');
  auto parent = modules.find(dot == std::string::npos ? "" : path.substr(0, dot));
  auto* seq = parent == modules.end()
                  ? nullptr
                  : dynamic_cast<torch::nn::SequentialImpl*>(parent->second.get());
  TORCH_INTERNAL_ASSERT(seq, "unit ", path, " is neither a Unit<M> nor a Sequential child");
  size_t index = 0;
  for (auto it = seq->begin(); it != seq->end(); ++it, ++index) {
    if (it->ptr().get() != u.module) continue;
    swaps_.push_back({seq, index, *it});
    *it = torch::nn::AnyModule(std::make_shared<SequentialUnitImpl>(*it, &u, path));
    return;
  }
  TORCH_INTERNAL_ASSERT(false, "unit ", path, " not found in its Sequential");
}

void Engine::select_checkpointed_units(const ModuleMap& modules) {
  const CheckpointPolicy& policy = strategy_.activation_checkpointing();
  if (!policy.enabled()) return;
  std::map<const torch::nn::Module*, UnitState*> unit_of;
  for (auto& u : units_) {
    if (u->index > 0) unit_of[u->module] = u.get();
  }
  for (const auto& [path, module] : modules) {
    const auto it = unit_of.find(module.get());
    if (policy.all_units_selected()) {
      if (it != unit_of.end()) it->second->checkpointed = true;
      continue;
    }
    if (!policy.matches(*module)) continue;
    FSDP_CHECK(it != unit_of.end(), "activation checkpointing policy ", policy.name(), " selects '",
               display(path), "' (", module->name(), ") but it is not an fsdp unit, and only units "
               "can recompute their forward; make it one (fsdp::Unit<", module->name(), "> in the "
               "model, or a torch::nn::Sequential child) that the wrap policy ",
               strategy_.auto_wrap_policy().name(), " selects");
    it->second->checkpointed = true;
  }
  // A recomputation runs the unit's own forward only: units nested inside it would run outside
  // the model's forward.
  for (const auto& u : units_) {
    if (!u->checkpointed) continue;
    for (const auto& v : units_) {
      FSDP_CHECK(v->index == 0 || v->name.rfind(u->name + ".", 0) != 0, "activation "
                 "checkpointing policy ", policy.name(), " selects unit '", u->name, "', which "
                 "contains unit '", v->name, "' that its recomputation would run outside the "
                 "model's forward; checkpoint the inner units instead (CheckpointPolicy::by_type)");
    }
  }
}

std::optional<ActivationCheckpointOptions> Engine::checkpoint_options(UnitState& u) {
  if (!u.checkpointed || !torch::GradMode::is_enabled()) return std::nullopt;
  ActivationCheckpointOptions o;
  o.name = "activation-checkpointed unit '" + u.name + "'";
  // The first recorded forward runs once with autograd on, so a unit whose outputs cannot carry
  // gradients fails here with its name rather than silently losing them in backward.
  o.check_outputs_require_grad = u.trainable && !u.checkpoint_checked;
  u.checkpoint_checked = true;
  return o;
}

Engine::~Engine() {
  for (auto& s : swaps_) *(s.seq->begin() + s.index) = s.original;
  for (auto& u : units_) {
    if (u->hooks) u->hooks->fsdp_unit_ = nullptr;
    if (u->aliased || !u->full.defined()) continue;
    // The gathered buffers die with us: leave empty parameters, not dangling views.
    torch::NoGradGuard no_grad;
    for (auto& s : u->params) s.param.set_data(at::empty({0}, u->full.options()));
  }
}


}  // namespace detail
}  // namespace fsdp
