// The sharding engine's optimizer- and state-facing calls: parameters, state dicts, gradient
// clipping, summoning full parameters, memory and communication statistics (see engine.h).
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
#include "fsdp/error.h"
#include "base/shard_slice.h"

namespace fsdp {
namespace detail {


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

std::vector<FlatView> Engine::flat_views() const {
  std::vector<FlatView> views;
  views.reserve(units_.size());
  for (const auto& u : units_) {
    FlatView v;
    v.unit = u->owner ? u->owner->name : u->name;
    v.frozen = u->owner != nullptr;
    v.trainable = u->trainable;
    v.padded = u->padded;
    v.shard_numel = u->shard_numel;
    v.param = u->shard;
    for (const auto& s : u->params) v.params.push_back({s.name, s.aliases, s.offset, s.numel, s.shape});
    views.push_back(std::move(v));
  }
  return views;
}

void Engine::replace_shards(const std::vector<at::Tensor>& shards) {
  TORCH_INTERNAL_ASSERT(shards.size() == units_.size());
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < units_.size(); ++i) {
    units_[i]->shard.detach().copy_(shards[i].to(units_[i]->shard.device()));
  }
  drop_gathered();
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
    const int64_t begin = shard_rank_ * u->shard_numel;
    at::Tensor shard = u->shard.detach();
    shard.zero_();
    for (const auto& s : u->params) {
      const at::Tensor* v = dict.find(s.name);
      FSDP_CHECK(v, "state dict has no entry '", s.name, "'");
      FSDP_CHECK(v->sizes().vec() == s.shape, "state dict entry '", s.name, "' has shape ",
                 v->sizes(), " but the model's parameter has ", c10::IntArrayRef(s.shape));
      const auto sl = shard_slice(begin, u->shard_numel, s.offset, s.numel);
      if (sl.empty()) continue;
      shard.narrow(0, sl.in_shard(), sl.numel())
          .copy_(v->reshape({-1}).narrow(0, sl.in_param(), sl.numel()).to(shard.options()));
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
    if (is_mapped(u->shard)) m.mapped_state_bytes += bytes_of(u->shard);
    const at::Tensor& grad = u->shard.grad();
    if (grad.defined()) {
      m.grad_shard_bytes += bytes_of(grad);
      if (BufferPool::pooled(grad)) {
        m.pooled_grad_bytes += bytes_of(grad);
        m.mapped_state_bytes += bytes_of(grad);
      }
    }
    if (u->flat_grad.defined() && !callback_queued_) m.accumulation_bytes += bytes_of(u->flat_grad);
    if (u->partial.defined()) m.accumulation_bytes += bytes_of(u->partial);
    m.replica_param_bytes += u->numel * 4;
  }
  if (optimizer) m.optimizer_state_bytes = optimizer_state_bytes(*optimizer);
  m.unsharded_now_bytes = tracker_.now();
  m.unsharded_peak_bytes = tracker_.peak();
  const auto pool = pool_.stats();
  m.pool_mapped_bytes = pool.mapped_bytes + grad_pool_.stats().mapped_bytes;
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

}  // namespace fsdp
