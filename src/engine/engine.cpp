// The sharding engine: storage, the forward and backward hooks, gathering and reducing (see
// engine.h and fsdp/sharded.h). Construction is in engine_build.cpp, the optimizer- and
// state-facing calls in engine_state.cpp.
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
#include <utility>

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
// Trace events (NOTE [unit events])

void Engine::trace_begin(int64_t& start, int64_t& faults) const {
  start = trace_ && trace_->on() ? trace_->now() : -1;
  if (start >= 0) faults = thread_minor_faults();
}

void Engine::trace_end(const char* what, UnitState& u, int64_t& start, int64_t faults) {
  if (start < 0) return;
  TraceEvent e;
  e.category = "compute";
  e.set_name(what, display(u.name));
  e.start_ns = start;
  e.duration_ns = trace_->now() - start;
  e.add("unit", display(u.name));
  e.add("minor_faults", double(thread_minor_faults() - faults));
  start = -1;
  trace_->record(e);
  trace_counter(trace_, "memory", {{"rss_bytes", double(resident_bytes())},
                                   {"engine_buffer_bytes", double(tracker_.now())}});
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
  make_grad_shells();
  order_.clear();
  in_forward_ = true;
  UnitState& root = *units_[0];
  trace_begin(root.forward_start_ns, root.forward_faults);
  unshard(root);
  if (strategy_.forward_prefetch()) {
    if (UnitState* next = unit_after_in_forward(0)) unshard(*next);
  }
  wait_unshard(root);
}

void Engine::root_post_forward(const std::vector<at::Tensor>& outputs) {
  in_forward_ = false;
  UnitState& root = *units_[0];
  trace_end("forward", root, root.forward_start_ns, root.forward_faults);
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
  trace_begin(u.forward_start_ns, u.forward_faults);
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
  trace_end("forward", u, u.forward_start_ns, u.forward_faults);
}

void Engine::make_grad_shells() {
  if (!pooled_ || S_ == 1 || !torch::GradMode::is_enabled()) return;
  for (auto& u : units_) {
    if (u->trainable && !u->grad_shell.defined()) u->grad_shell = BufferPool::shell(at::kFloat);
  }
}

at::Tensor Engine::take_grad_shell(UnitState& u) {
  at::Tensor grad = std::exchange(u.grad_shell, at::Tensor());
  grad_pool_.fill(grad, u.shard_numel);
  return grad;
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
  if (u.index != 0) {
    if (UnitState* open = open_backward_) {
      trace_end("backward", *open, open->backward_start_ns, open->backward_faults);
    }
    open_backward_ = &u;
  }
  trace_begin(u.backward_start_ns, u.backward_faults);
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
  if (open_backward_ == &u) {
    trace_end("backward", u, u.backward_start_ns, u.backward_faults);
    open_backward_ = nullptr;
  }
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
    // It becomes the shard's .grad, state that outlives the step: from a pool of its own
    // (NOTE [gradient pool]).
    if (!pooled_) {
      p.output = at::empty({u.shard_numel}, g.options());
    } else if (g.scalar_type() == at::kFloat && u.grad_shell.defined()) {
      p.output = take_grad_shell(u);
    } else {
      p.output = grad_pool_.empty(u.shard_numel, g.scalar_type());
    }
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
    } else if (pooled_ && u.grad_shell.defined()) {  // a bf16/fp16 reduce: fp32 .grad
      grad = take_grad_shell(u).copy_(p.output).div_(post_divide_);
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
  grad_pool_.trim();
  if (UnitState* open = open_backward_) {
    trace_end("backward", *open, open->backward_start_ns, open->backward_faults);
  }
  open_backward_ = nullptr;
  UnitState& root = *units_[0];
  trace_end("backward", root, root.backward_start_ns, root.backward_faults);
}


}  // namespace detail
}  // namespace fsdp
