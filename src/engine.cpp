// The sharding engine (see engine.h and fsdp/sharded.h).
#include "engine.h"

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

#include "deferred_init_internal.h"
#include "fsdp/error.h"

namespace fsdp {
namespace detail {

void MemoryTracker::add(int64_t bytes) {
  int64_t now = now_ += bytes;
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

void MemoryTracker::sub(int64_t bytes) { now_ -= bytes; }

namespace {

int64_t bytes_of(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

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

std::string display(const std::string& unit_name) {
  return unit_name.empty() ? "(root)" : unit_name;
}

// ---------------------------------------------------------------------------------------------
// Forward / backward entry points used by the public templates.

void unit_pre_forward(UnitState* u) { u->engine->pre_forward(*u); }
void unit_post_forward(UnitState* u, const std::vector<at::Tensor>& outputs) {
  u->engine->post_forward(*u, outputs);
}
std::optional<ActivationCheckpointOptions> unit_checkpoint(UnitState* u) {
  return u->engine->checkpoint_options(*u);
}
bool unit_tracks_inputs(UnitState* u) { return u->engine->tracks_inputs(*u); }
void unit_track_inputs(UnitState* u, const std::vector<at::Tensor>& inputs) {
  u->engine->track_inputs(*u, inputs);
}
void unit_not_checkpointable(UnitState* u) {
  FSDP_CHECK(!u->checkpointed, "activation checkpointing policy selects unit '", u->name, "' but "
             "the argument or result types of its forward cannot be stored for recomputation "
             "(supported: tensors, std::vector<Tensor>, c10::optional<Tensor>, numbers, enums and "
             "strings, taken by value or const reference); leave it out of the policy");
}
void root_pre_forward(Engine* e) { e->root_pre_forward(); }
void root_abort_forward(Engine* e) { e->root_abort_forward(); }
void root_post_forward(Engine* e, const std::vector<at::Tensor>& outputs) {
  e->root_post_forward(outputs);
}
at::Tensor cast_input(Engine* e, const at::Tensor& t) { return e->cast_input(t); }

// ---------------------------------------------------------------------------------------------
// Construction

Engine::Engine(std::shared_ptr<torch::nn::Module> root, FSDPStrategy strategy,
               std::shared_ptr<Runtime> runtime)
    : root_(std::move(root)), strategy_(std::move(strategy)), runtime_(std::move(runtime)) {}

void Engine::build() {
  FSDP_CHECK(root_, "fsdp::shard: the module is null");
  const auto& env = runtime_->env();
  streams_ = DeviceStreams(runtime_->device());
  pooled_ = runtime_->device().is_cpu();
  // 1. Everything that can be wrong is checked before the first collective, identically on
  //    every rank (plan_sharding and plan_units are pure), and the ranks compare their settings
  //    through the store so a mismatch is an error instead of a hang.
  plan_ = plan_sharding(strategy_, runtime_->world_size(), env.local_world_size);
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
  // 2. Groups.
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

  // 3. Units: root first, then the policy's picks in module order.
  auto modules = root_->named_modules("", /*include_self=*/true);
  ModuleMap by_path;
  for (const auto& m : modules) by_path[m.key()] = m.value();
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
  // 4. Flatten, optionally broadcast rank 0's values, shard; units built under DeferredInit
  //    hold their shards already (checked on every rank first, store only). Buffers (norm
  //    statistics...) move to the runtime's device like the parameters (NCCL broadcasts only
  //    device tensors).
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
  // 5. Hooks.
  for (auto& u : units_) install_hooks(*u, by_path);
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
    u.shard = flat.narrow(0, shard_rank_ * u.shard_numel, u.shard_numel).clone();
  }
  u.shard.set_requires_grad(u.trainable);
  u.aliased = S_ == 1 && param_dtype_ == c10::kFloat;
  if (u.aliased) {
    u.full = u.shard.detach();
    u.phase = Phase::kUnsharded;
  } else {
    u.full = at::empty({u.padded}, f32.dtype(param_dtype_));
  }
  // Views first: narrow() checks the storage bounds, so it must run while `full` has memory.
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

// ---------------------------------------------------------------------------------------------
// Storage

void Engine::alloc_storage(at::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  const int64_t want = bytes_of(t);
  if (static_cast<int64_t>(impl->nbytes()) == want) return;
  impl->set_data_ptr_noswap(pooled_ ? pool_.allocate(want) : impl->allocator()->allocate(want));
  impl->set_nbytes(want);
  tracker_.add(want);
}

at::Tensor Engine::empty_buffer(int64_t numel, c10::ScalarType dtype) {
  if (pooled_) return pool_.empty(numel, dtype);
  return at::empty({numel}, at::TensorOptions().dtype(dtype).device(runtime_->device()));
}

void Engine::free_storage(at::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  const int64_t have = static_cast<int64_t>(impl->nbytes());
  if (have == 0) return;
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
  tracker_.sub(have);
}

void Engine::unshard(UnitState& u) {
  if (u.frozen) unshard(*u.frozen);
  if (u.phase != Phase::kSharded || u.padded == 0) return;
  if (S_ == 1) {  // mixed precision without sharding: a cast, on the compute stream
    alloc_storage(u.full);
    u.full.copy_(u.shard.detach());
    u.phase = Phase::kUnsharded;
    return;
  }
  // NOTE [CUDA streams]: buffer, cast and all-gather on the gather stream (CPU: no streams).
  [[maybe_unused]] auto on_gather_stream = streams_.gather_scope();
  alloc_storage(u.full);
  at::Tensor src = u.shard.detach();
  if (param_dtype_ != c10::kFloat) src = src.to(param_dtype_);
  u.gather_src = src;
  u.gather = shard_group_->all_gather(u.full, src, collective_label(u));
  u.phase = Phase::kGathering;
}

void Engine::wait_unshard(UnitState& u) {
  if (u.frozen) wait_unshard(*u.frozen);
  if (u.phase != Phase::kGathering) return;
  WorkHandle gather = std::move(u.gather);
  u.gather_src.reset();
  // Settled even if the gather failed (the buffer then holds garbage): a failed Work rethrows on
  // every wait, so waiting on it again from cleanup code would throw a second time.
  u.phase = Phase::kUnsharded;
  gather->wait();  // on CUDA: the current stream waits, the host does not
  streams_.used_on_current_stream(u.full);
}

// Frees one flat (a unit's frozen flat is freed by its own call).
void Engine::reshard(UnitState& u) {
  if (u.aliased || u.phase == Phase::kSharded || summoned_ > 0) return;
  wait_unshard(u);
  free_storage(u.full);
  u.phase = Phase::kSharded;
}

// ---------------------------------------------------------------------------------------------
// Forward

at::Tensor Engine::cast_input(const at::Tensor& t) const {
  if (param_dtype_ == c10::kFloat || !t.defined() || !t.is_floating_point() ||
      t.scalar_type() == param_dtype_) {
    return t;
  }
  return t.to(param_dtype_);
}

UnitState* Engine::unit_after_in_forward(int64_t position) const {
  if (position < 0 || position >= static_cast<int64_t>(prev_order_.size())) return nullptr;
  return units_[prev_order_[position]].get();
}

UnitState* Engine::unit_before_in_forward(const UnitState& u) const {
  if (u.index == 0) return prev_order_.empty() ? nullptr : units_[prev_order_.back()].get();
  for (size_t i = 1; i < prev_order_.size(); ++i) {
    if (prev_order_[i] == u.index) return units_[prev_order_[i - 1]].get();
  }
  return nullptr;
}

void Engine::root_abort_forward() {
  // M::forward threw: free whatever it gathered so the next forward starts clean.
  in_forward_ = false;
  for (auto& u : units_) {
    // Called from a destructor while M::forward's error propagates: nothing may escape, or the
    // rank dies by std::terminate. Each failed try settles one gather, and a unit has at most two
    // pending (its frozen flat's and its own, when prefetched): the third try only frees.
    for (int attempt = 0; attempt < 3; ++attempt) {
      try {
        reshard(*u);
        break;
      } catch (const std::exception&) {
      }
    }
  }
}

void Engine::root_pre_forward() {
  FSDP_CHECK(!in_forward_, "ShardedModule::forward re-entered: a unit's forward called the "
             "sharded model again");
  if (!callback_queued_) {
    // A previous forward that had no backward can leave units gathered with values from before
    // the optimizer step: start from shards.
    for (auto& u : units_) {
      reshard(*u);
      u->pre_backward_done = u->post_backward_done = false;
      u->inputs_pending = 0;
    }
  }
  check_requires_grad();
  order_.clear();
  in_forward_ = true;
  UnitState& root = *units_[0];
  unshard(root);
  if (strategy_.forward_prefetch()) {
    if (UnitState* next = unit_after_in_forward(0)) unshard(*next);
  }
  wait_unshard(root);
}

void Engine::root_post_forward(const std::vector<at::Tensor>& outputs) {
  in_forward_ = false;
  prev_order_ = order_;
  bool armed = false;
  if (torch::GradMode::is_enabled()) {
    std::weak_ptr<Engine> weak = weak_from_this();
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      t.register_hook([weak](const at::Tensor&) {
        if (auto e = weak.lock()) e->pre_backward(*e->units_[0]);
      });
      armed = true;
    }
  }
  if (!armed) {
    for (auto& u : units_) reshard(*u);  // no backward will come
  }
}

void Engine::pre_forward(UnitState& u) {
  FSDP_CHECK(in_forward_, "fsdp unit '", display(u.name), "' ran outside the sharded model's "
             "forward; call the ShardedModule returned by fsdp::shard, not the inner module");
  order_.push_back(u.index);
  unshard(u);
  if (strategy_.forward_prefetch()) {
    // Issue the next unit's all-gather before waiting for ours: both overlap this compute.
    if (UnitState* next = unit_after_in_forward(static_cast<int64_t>(order_.size()))) {
      if (next != &u) unshard(*next);
    }
  }
  wait_unshard(u);
}

void Engine::post_forward(UnitState& u, const std::vector<at::Tensor>& outputs) {
  const bool grad = torch::GradMode::is_enabled();
  bool armed = false;
  if (grad) {
    std::weak_ptr<Engine> weak = weak_from_this();
    UnitState* unit = &u;
    for (const auto& t : outputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      t.register_hook([weak, unit](const at::Tensor&) {
        if (auto e = weak.lock()) e->pre_backward(*unit);
      });
      armed = true;
    }
    FSDP_CHECK(armed || !u.trainable, "fsdp unit '", display(u.name), "' returned no tensor that "
               "requires grad, so fsdp cannot gather its parameters again before its backward; "
               "return the unit's output tensors from its forward");
  }
  if (plan_.reshard_after_forward || !grad) {
    reshard(u);
    if (u.frozen) reshard(*u.frozen);
  }
}

void Engine::check_requires_grad() const {
  for (const auto& u : units_) {
    const bool trainable = u->owner == nullptr;
    for (const auto& s : u->params) {
      FSDP_CHECK(s.param.requires_grad() == trainable, "parameter '", s.name, "' has "
                 "requires_grad ", s.param.requires_grad() ? "true" : "false", " but was ",
                 trainable ? "trainable" : "frozen", " when fsdp::shard() planned its unit; fsdp "
                 "reads requires_grad once, at shard(): set it before fsdp::shard() (shard a new "
                 "model to change which parameters train)");
    }
  }
}

bool Engine::tracks_inputs(const UnitState& u) const {
  return u.frozen != nullptr && torch::GradMode::is_enabled();
}

void Engine::track_inputs(UnitState& u, const std::vector<at::Tensor>& inputs) {
  std::weak_ptr<Engine> weak = weak_from_this();
  UnitState* unit = &u;
  for (const auto& t : inputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    if (t.is_leaf()) {
      // A leaf keeps its hooks across steps, so counting them would go wrong: keep the frozen
      // flat until the end of backward instead.
      u.inputs_pending = std::numeric_limits<int64_t>::max() / 2;
      continue;
    }
    ++u.inputs_pending;
    t.register_hook([weak, unit](const at::Tensor&) {
      if (auto e = weak.lock()) e->on_input_grad_ready(*unit);
    });
  }
}

void Engine::on_input_grad_ready(UnitState& u) {
  if (u.inputs_pending > 0) --u.inputs_pending;
  release_frozen(u);
}

// NOTE [frozen parameters]: autograd reads a frozen flat only in nodes between the unit's
// outputs and its tensor arguments or trainable parameters; once all their gradients exist, no
// node that reads it is left. The root's frozen flat stays until the end of backward (its
// arguments are the model's inputs, which fsdp does not see).
void Engine::release_frozen(UnitState& u) {
  if (!u.frozen || u.index == 0 || u.inputs_pending > 0) return;
  if (u.trainable && !u.post_backward_done) return;
  if (!u.pre_backward_done) return;
  reshard(*u.frozen);
}

// ---------------------------------------------------------------------------------------------
// Backward

void Engine::pre_backward(UnitState& u) {
  if (!callback_queued_) {
    std::weak_ptr<Engine> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto e = weak.lock()) e->finalize_backward();
    });
    callback_queued_ = true;
  }
  if (u.pre_backward_done) return;
  u.pre_backward_done = true;
  settle_finished_reduces();
  unshard(u);
  if (strategy_.backward_prefetch()) {
    UnitState* next = unit_before_in_forward(u);
    if (next && !next->pre_backward_done) unshard(*next);
  }
  wait_unshard(u);
  prepare_grads(u);
}

void Engine::prepare_grads(UnitState& u) {
  if (!u.trainable || u.padded == 0) return;
  if (!u.flat_grad.defined()) {
    u.flat_grad = empty_buffer(u.padded, u.full.scalar_type()).zero_();
    tracker_.add(bytes_of(u.flat_grad));
  }
  u.grads_pending = static_cast<int64_t>(u.params.size());
  for (auto& s : u.params) {
    s.param.mutable_grad() = u.flat_grad.narrow(0, s.offset, s.numel).view(s.shape);
  }
}

void Engine::on_grad_ready(UnitState& u, ParamSlot& slot) {
  if (u.post_backward_done) return;
  at::Tensor g = slot.param.grad();
  if (!u.pre_backward_done) {
    // The gradient arrived without passing the unit's outputs (its parameters were used
    // outside its forward). Take it anyway so nothing is lost.
    u.pre_backward_done = true;
    prepare_grads(u);
  }
  at::Tensor view = u.flat_grad.narrow(0, slot.offset, slot.numel).view(slot.shape);
  if (g.defined() && g.data_ptr() != view.data_ptr()) {
    view.add_(g);
    slot.param.mutable_grad() = view;
  }
  if (--u.grads_pending == 0) post_backward(u);
}

void Engine::post_backward(UnitState& u) {
  u.post_backward_done = true;
  for (auto& s : u.params) s.param.mutable_grad().reset();
  reshard(u);
  release_frozen(u);
  if (u.trainable && u.flat_grad.defined()) reduce_grad(u);
  settle_finished_reduces();
}

void Engine::reduce_grad(UnitState& u) {
  const auto mode = strategy_.grad_sync();
  if (!sync_ && mode == GradSync::kLocal) return;  // keep accumulating in flat_grad
  PendingReduce p;
  at::Tensor g = std::move(u.flat_grad);
  u.flat_grad = at::Tensor();
  const int64_t g_bytes = bytes_of(g);
  if (g.scalar_type() != reduce_dtype_) {
    g = g.to(reduce_dtype_);
    tracker_.add(bytes_of(g) - g_bytes);  // the cast replaces the original, freed below
  }
  if (pre_divide_ != 1.0) g.div_(pre_divide_);
  if (S_ > 1) {
    // Not pooled: it becomes the shard's .grad, state that outlives the step.
    p.output = at::empty({u.shard_numel}, g.options());
    p.rs = shard_group_->reduce_scatter(p.output, g, collective_label(u));
    p.input = g;
    p.input_bytes = bytes_of(g);
  } else {
    p.output = g;  // the gradient is its own shard; count it as such from here
    tracker_.sub(bytes_of(g));
  }
  const bool deferred = R_ > 1 && !sync_ && mode == GradSync::kReplicateOnLast;
  p.replicate_deferred = deferred;
  if (R_ > 1 && !deferred) {
    if (u.partial.defined()) {
      // Last micro-step of replicate_on_last: fold the earlier reduce-scatter sums in first.
      if (p.rs) p.rs->wait();
      p.output.add_(u.partial);
      u.partial = at::Tensor();
    }
    p.ar = replicate_group_->all_reduce(p.output, p.rs, collective_label(u));
  }
  u.pending = std::move(p);
}

void Engine::settle_finished_reduces() {
  // A finished reduce is settled now, not at finalize_backward: its output is folded into the
  // shard's .grad and freed, so a backward holds the reduce outputs in flight, not one per unit
  // (with .grad kept between steps, as libtorch 1.13's zero_grad() does, that was a second copy
  // of every gradient shard at the end of backward: measured with heaptrack, issue 20). Order
  // does not matter: each unit's gradient is its own.
  for (auto& u : units_) {
    if (!u->pending) continue;
    PendingReduce& p = *u->pending;
    if (p.rs && !p.rs->completed()) continue;
    if (p.ar && !p.ar->completed()) {
      release_reduce_input(p);
      continue;
    }
    complete_reduce(*u);
  }
}

void Engine::release_reduce_input(PendingReduce& p) {
  if (!p.input.defined()) return;
  p.input = at::Tensor();
  tracker_.sub(p.input_bytes);
}

void Engine::complete_reduce(UnitState& u) {
  PendingReduce& p = *u.pending;
  if (p.rs) p.rs->wait();
  if (p.ar) p.ar->wait();
  release_reduce_input(p);
  if (p.replicate_deferred) {
    u.partial = u.partial.defined() ? u.partial.add_(p.output) : p.output;
  } else {
    // One pass over the gradient: scale into a fresh .grad, or accumulate scaled.
    torch::NoGradGuard no_grad;
    at::Tensor& grad = u.shard.mutable_grad();
    if (grad.defined()) {
      grad.add_(p.output, 1.0 / post_divide_);
    } else if (p.output.scalar_type() == at::kFloat) {
      grad = p.output.div_(post_divide_);  // the reduced buffer is ours alone now
    } else {
      grad = p.output.to(at::kFloat).div_(post_divide_);
    }
  }
  u.pending.reset();
}

void Engine::finalize_backward() {
  callback_queued_ = false;
  // Units whose backward began but whose gradients did not all arrive (unused parameters):
  // reduce what they have, in unit order, which every rank shares.
  for (auto& u : units_) {
    if (u->pre_backward_done && !u->post_backward_done) post_backward(*u);
  }
  for (auto& u : units_) {
    if (u->pending) complete_reduce(*u);
  }
  for (auto& u : units_) {
    reshard(*u);
    u->pre_backward_done = u->post_backward_done = false;
    u->inputs_pending = 0;
  }
  pool_.trim();  // buffers no step used since the last trim go back to the system
}

// ---------------------------------------------------------------------------------------------
// Optimizer-facing API

namespace {
// "<unit>.flat_param" for a unit's trainable flat, "<unit>.frozen_flat_param" for its frozen one.
std::string flat_key(const UnitState& u) {
  const char* leaf = u.owner ? "frozen_flat_param" : "flat_param";
  return u.name.empty() ? leaf : u.name + "." + leaf;
}
}  // namespace

std::vector<at::Tensor> Engine::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& kv : named_parameters()) out.push_back(kv.value());
  return out;
}

torch::OrderedDict<std::string, at::Tensor> Engine::named_parameters() const {
  torch::OrderedDict<std::string, at::Tensor> out;
  for (const auto& u : units_) {
    if (u->padded > 0 && u->trainable) out.insert(flat_key(*u), u->shard);
  }
  return out;
}

int64_t Engine::trainable_numel() const {
  int64_t n = 0;
  for (const auto& u : infos_) n += u.numel;
  return n;
}

int64_t Engine::total_numel() const {
  int64_t n = 0;
  for (const auto& u : infos_) n += u.total_numel();
  return n;
}

void Engine::check_optimizer(const torch::optim::Optimizer& optimizer) const {
  std::map<const c10::TensorImpl*, const UnitState*> flat_of;
  for (const auto& u : units_) flat_of[u->shard.unsafeGetTensorImpl()] = u.get();
  std::map<const c10::TensorImpl*, std::string> module_param;
  for (const auto& p : root_->named_parameters()) module_param[p.value().unsafeGetTensorImpl()] = p.key();
  for (const auto& g : optimizer.param_groups()) {
    for (const auto& p : g.params()) {
      const auto* impl = p.unsafeGetTensorImpl();
      auto flat = flat_of.find(impl);
      if (flat != flat_of.end()) {
        FSDP_CHECK(flat->second->trainable, "the optimizer holds the frozen parameters of unit '",
                   display(flat->second->name), "' (requires_grad false at fsdp::shard()); build "
                   "it from model.parameters(), which holds the trainable shards only");
        continue;
      }
      auto inner = module_param.find(impl);
      FSDP_CHECK(inner == module_param.end(), "the optimizer holds the inner module's parameter '",
                 inner->second, "', which holds no memory while sharded; build it from the "
                 "sharded model's parameters()");
      throw Error(detail::cat("the optimizer holds a tensor of shape ", p.sizes(), " that is not "
                              "one of model.parameters(); build the optimizer from the sharded "
                              "model's parameters()"));
    }
  }
}

double Engine::clip_grad_norm(double max_norm) {
  FSDP_CHECK(max_norm > 0, "clip_grad_norm: max_norm ", max_norm, " must be positive");
  // Per-unit norms in fp32 (one pass each, as torch::nn::utils::clip_grad_norm_ computes them),
  // combined in double.
  at::Tensor sumsq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(runtime_->device()));
  for (const auto& u : units_) {
    if (u->shard.grad().defined()) sumsq += u->shard.grad().norm().to(at::kDouble).pow(2);
  }
  // Replicas hold identical shards after the replicate all-reduce: sum over the shard group only.
  if (S_ > 1) shard_group_->all_reduce(sumsq, nullptr, "the gradient norm")->wait();
  const double total = std::sqrt(sumsq.item<double>());
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    torch::NoGradGuard no_grad;
    for (const auto& u : units_) {
      if (u->shard.grad().defined()) u->shard.mutable_grad().mul_(coef);
    }
  }
  return total;
}

torch::OrderedDict<std::string, at::Tensor> Engine::state_dict() {
  torch::NoGradGuard no_grad;
  torch::OrderedDict<std::string, at::Tensor> out;
  if (strategy_.state_dict_type() == StateDictType::kSharded) {
    for (const auto& u : units_) {
      if (u->padded > 0) out.insert(flat_key(*u), u->shard.detach().clone());
    }
    return out;
  }
  std::map<std::string, at::Tensor> values;
  for (auto& u : units_) {
    if (u->padded == 0) continue;
    at::Tensor full = at::empty({u->padded}, u->shard.options().requires_grad(false));
    shard_group_->all_gather(full, u->shard.detach(), collective_label(*u))->wait();
    for (const auto& s : u->params) {
      at::Tensor v = full.narrow(0, s.offset, s.numel).view(s.shape).to(s.original_dtype).clone();
      values[s.name] = v;
      for (const auto& a : s.aliases) values[a] = v;
    }
  }
  for (const auto& p : root_->named_parameters()) out.insert(p.key(), values.at(p.key()));
  for (const auto& b : root_->named_buffers()) out.insert(b.key(), b.value().detach().clone());
  return out;
}

void Engine::load_state_dict(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  torch::NoGradGuard no_grad;
  if (strategy_.state_dict_type() == StateDictType::kSharded) {
    for (const auto& u : units_) {
      if (u->padded == 0) continue;
      const std::string key = flat_key(*u);
      const at::Tensor* v = dict.find(key);
      FSDP_CHECK(v, "sharded state dict has no entry '", key, "'; it was saved from a "
                 "different model, wrap policy or set of frozen parameters");
      FSDP_CHECK(v->numel() == u->shard.numel(), "sharded state dict entry '", key, "' has ",
                 v->numel(), " elements but this rank's shard has ", u->shard.numel(),
                 "; sharded checkpoints load only on the same mesh (use a full state dict)");
      u->shard.detach().copy_(*v);
      reshard(*u);  // gathered copies are stale now
    }
    return;
  }
  for (auto& u : units_) {
    if (u->padded == 0) continue;
    const int64_t begin = shard_rank_ * u->shard_numel, end = begin + u->shard_numel;
    at::Tensor shard = u->shard.detach();
    shard.zero_();
    for (const auto& s : u->params) {
      const at::Tensor* v = dict.find(s.name);
      FSDP_CHECK(v, "state dict has no entry '", s.name, "'");
      FSDP_CHECK(v->sizes().vec() == s.shape, "state dict entry '", s.name, "' has shape ",
                 v->sizes(), " but the model's parameter has ", c10::IntArrayRef(s.shape));
      // The part of [s.offset, s.offset + numel) inside this rank's [begin, end).
      const int64_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + s.numel);
      if (lo >= hi) continue;
      shard.narrow(0, lo - begin, hi - lo)
          .copy_(v->reshape({-1}).narrow(0, lo - s.offset, hi - lo).to(shard.options()));
    }
    if (u->aliased) continue;
    reshard(*u);  // gathered copies are stale now
  }
  for (auto& b : root_->named_buffers()) {
    if (const at::Tensor* v = dict.find(b.key())) b.value().copy_(*v);
  }
}

void Engine::summon(bool on) {
  if (on) {
    for (auto& u : units_) unshard(*u);
    for (auto& u : units_) wait_unshard(*u);
    ++summoned_;
    return;
  }
  if (--summoned_ == 0 && !callback_queued_ && !in_forward_) {
    for (auto& u : units_) reshard(*u);
  }
}

MemoryStats Engine::memory_stats(const torch::optim::Optimizer* optimizer) const {
  if (optimizer) check_optimizer(*optimizer);
  MemoryStats m;
  for (const auto& u : units_) {
    m.param_shard_bytes += bytes_of(u->shard);
    if (u->shard.grad().defined()) m.grad_shard_bytes += bytes_of(u->shard.grad());
    if (u->flat_grad.defined() && !callback_queued_) m.accumulation_bytes += bytes_of(u->flat_grad);
    if (u->partial.defined()) m.accumulation_bytes += bytes_of(u->partial);
    m.replica_param_bytes += u->numel * 4;
  }
  if (optimizer) m.optimizer_state_bytes = optimizer_state_bytes(*optimizer);
  m.unsharded_now_bytes = tracker_.now();
  m.unsharded_peak_bytes = tracker_.peak();
  const auto pool = pool_.stats();
  m.pool_mapped_bytes = pool.mapped_bytes;
  m.pool_peak_bytes = pool.peak_mapped_bytes;
  return m;
}

std::vector<std::pair<std::string, CommCounters>> Engine::comm_counters() const {
  std::vector<std::pair<std::string, CommCounters>> out;
  out.emplace_back("shard", shard_group_->counters());
  out.emplace_back("replicate", replicate_group_->counters());
  out.emplace_back("world", runtime_->world()->counters());
  return out;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Public API

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t total = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) total += t.numel() * static_cast<int64_t>(t.element_size());
  };
  for (const auto& kv : optimizer.state()) {
    const auto* state = kv.second.get();
    if (auto* s = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
      add(s->exp_avg()); add(s->exp_avg_sq()); add(s->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
      add(s->exp_avg()); add(s->exp_avg_sq()); add(s->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
      add(s->momentum_buffer());
    } else if (auto* s = dynamic_cast<const torch::optim::RMSpropParamState*>(state)) {
      add(s->square_avg()); add(s->momentum_buffer()); add(s->grad_avg());
    } else if (auto* s = dynamic_cast<const torch::optim::AdagradParamState*>(state)) {
      add(s->sum());
    }
  }
  return total;
}

std::shared_ptr<Runtime> detail::runtime_for(const FSDPStrategy& strategy,
                                             std::shared_ptr<Runtime> runtime) {
  if (!runtime) {
    RuntimeOptions opts;
    opts.backend = strategy.backend();
    opts.timeout = strategy.timeout();
    return Runtime::init(opts);
  }
  FSDP_CHECK(strategy.backend() == Backend::kAuto || strategy.backend() == runtime->backend(),
             "strategy backend ", to_string(strategy.backend()), " differs from the runtime's ",
             to_string(runtime->backend()), "; set one of them");
  return runtime;
}

FullyShardedModule::FullyShardedModule(std::shared_ptr<torch::nn::Module> module,
                                       const FSDPStrategy& strategy,
                                       std::shared_ptr<Runtime> runtime) {
  engine_ = std::make_shared<detail::Engine>(std::move(module), strategy,
                                             detail::runtime_for(strategy, std::move(runtime)));
  engine_->build();
}

const std::shared_ptr<detail::Engine>& detail::engine_of(const FullyShardedModule& model) {
  return model.engine_;
}

std::vector<at::Tensor> FullyShardedModule::parameters() const { return engine_->parameters(); }
void FullyShardedModule::check_optimizer(const torch::optim::Optimizer& optimizer) const {
  engine_->check_optimizer(optimizer);
}
int64_t FullyShardedModule::trainable_numel() const { return engine_->trainable_numel(); }
int64_t FullyShardedModule::total_numel() const { return engine_->total_numel(); }
torch::OrderedDict<std::string, at::Tensor> FullyShardedModule::named_parameters() const {
  return engine_->named_parameters();
}

FullyShardedModule::NoSyncGuard::NoSyncGuard(std::shared_ptr<detail::Engine> engine, bool enabled)
    : engine_(enabled ? std::move(engine) : nullptr) {
  if (engine_) engine_->set_sync(false);
}
FullyShardedModule::NoSyncGuard::~NoSyncGuard() {
  if (engine_) engine_->set_sync(true);
}
FullyShardedModule::NoSyncGuard FullyShardedModule::no_sync(bool enabled) {
  return NoSyncGuard(engine_, enabled);
}

double FullyShardedModule::clip_grad_norm(double max_norm) {
  return engine_->clip_grad_norm(max_norm);
}
torch::OrderedDict<std::string, at::Tensor> FullyShardedModule::state_dict() {
  return engine_->state_dict();
}
void FullyShardedModule::load_state_dict(const torch::OrderedDict<std::string, at::Tensor>& d) {
  engine_->load_state_dict(d);
}

FullyShardedModule::SummonGuard::SummonGuard(std::shared_ptr<detail::Engine> engine)
    : engine_(std::move(engine)) {
  engine_->summon(true);
}
FullyShardedModule::SummonGuard::~SummonGuard() {
  if (engine_) engine_->summon(false);
}
FullyShardedModule::SummonGuard FullyShardedModule::summon_full_params() {
  return SummonGuard(engine_);
}

MemoryStats FullyShardedModule::memory_stats(const torch::optim::Optimizer* optimizer) const {
  return engine_->memory_stats(optimizer);
}
void FullyShardedModule::reset_peak_memory() { engine_->reset_peak_memory(); }
std::vector<std::pair<std::string, CommCounters>> FullyShardedModule::comm_counters() const {
  return engine_->comm_counters();
}
const ShardingPlan& FullyShardedModule::plan() const { return engine_->plan(); }
const std::vector<UnitInfo>& FullyShardedModule::units() const { return engine_->units(); }
std::shared_ptr<Runtime> FullyShardedModule::runtime() const { return engine_->runtime(); }
std::shared_ptr<DeviceMesh> FullyShardedModule::mesh() const { return engine_->mesh(); }
c10::ScalarType FullyShardedModule::param_dtype() const { return engine_->param_dtype(); }

}  // namespace fsdp
