// Activation checkpointing: the autograd function behind fsdp::checkpoint (see
// fsdp/activation_checkpoint.h).
//
// NOTE [checkpoint backward]
// The node's backward is reentrant: it runs the recorded recomputation's backward with
// torch::autograd::backward from inside the outer backward (autograd supports this on the same
// thread). That inner pass accumulates into every leaf it reaches: the detached inputs (whose
// .grad we hand on) and the parameters fn used, whose AccumulateGrad nodes and post-hooks (the
// sharding engine's gradient accounting) run exactly as they would in a plain backward. When no
// input requires grad, a zero-element leaf that does is added as an input so the outputs still
// require grad and the node runs at all (parameters reached only inside fn would otherwise get
// no gradient).
#include "fsdp/activation_checkpoint.h"

#include <ATen/Context.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/core/ivalue.h>

#include <algorithm>

#include "base/trace_sink.h"
#include "fsdp/error.h"

namespace fsdp::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The default generators whose state the recomputation replays: the CPU one, and the CUDA one of
// every device an input lives on.
struct RngState {
  std::vector<std::pair<c10::Device, at::Tensor>> states;

  static std::vector<c10::Device> devices_of(const std::vector<at::Tensor>& inputs) {
    std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
    for (const auto& t : inputs) {
      if (t.defined() && t.is_cuda() &&
          std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
        devices.push_back(t.device());
      }
    }
    return devices;
  }
  static RngState capture(const std::vector<c10::Device>& devices) {
    RngState s;
    for (const auto& d : devices) {
      at::Generator gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.states.emplace_back(d, gen.get_state());
    }
    return s;
  }
  void restore() const {
    for (const auto& [d, state] : states) {
      at::Generator gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
  std::vector<c10::Device> devices() const {
    std::vector<c10::Device> out;
    for (const auto& s : states) out.push_back(s.first);
    return out;
  }
};

// Sets the generators to the forward's state for the recomputation; puts back the state the
// backward found when it ends (even by an exception), so checkpointing leaves the caller's random
// stream as a plain backward would.
class RngFork {
 public:
  explicit RngFork(const RngState* replay) {
    if (!replay) return;
    current_ = RngState::capture(replay->devices());
    replay->restore();
    active_ = true;
  }
  ~RngFork() {
    if (active_) current_.restore();
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngState current_;
  bool active_ = false;
};

struct CheckpointState : torch::CustomClassHolder {
  RecomputeFn fn;
  ActivationCheckpointOptions opts;
  size_t num_inputs = 0;  // the caller's inputs
  bool has_dummy = false;  // a zero-element leaf follows them (NOTE [checkpoint backward])
  std::optional<RngState> rng;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<CheckpointState> state,
                               at::TensorList inputs_and_dummy, void* result) {
    std::vector<at::Tensor> inputs(inputs_and_dummy.begin(),
                                   inputs_and_dummy.begin() + state->num_inputs);
    if (state->opts.preserve_rng_state) state->rng = RngState::capture(RngState::devices_of(inputs));
    std::vector<at::Tensor> outputs;
    if (state->opts.check_outputs_require_grad) {
      // Record once to see whether anything would reach backward; drop the graph at once.
      at::AutoGradMode grad(true);
      outputs = state->fn(inputs, result);
      const bool any = std::any_of(outputs.begin(), outputs.end(), [](const at::Tensor& t) {
        return t.defined() && t.requires_grad();
      });
      FSDP_CHECK(any, state->opts.name, " returned no tensor that requires grad, so activation "
                 "checkpointing has nothing to recompute for backward; leave it out of the "
                 "activation checkpointing policy, or return the tensors its parameters produce");
      for (auto& t : outputs) {
        if (t.defined()) t = t.detach();
      }
    } else {
      outputs = state->fn(inputs, result);
    }
    variable_list non_differentiable;
    for (const auto& t : outputs) {
      if (t.defined() && !t.is_floating_point() && !t.is_complex()) non_differentiable.push_back(t);
    }
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    ctx->save_for_backward(inputs);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    ctx->set_materialize_grads(false);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data["state"].toCapsule());
    const std::string& name = state->opts.name;
    FSDP_CHECK(!at::GradMode::is_enabled(), name, ": double backward (create_graph=true) "
               "through an activation checkpoint is not supported; run this backward without "
               "create_graph or turn checkpointing off");
    // Unpacking checks the version counters: an input modified in place since forward is an error.
    variable_list saved = ctx->get_saved_variables();
    std::vector<at::Tensor> detached;
    detached.reserve(saved.size());
    for (const auto& t : saved) {
      if (!t.defined()) {
        detached.push_back(t);
        continue;
      }
      at::Tensor d = t.detach();
      d.requires_grad_(t.requires_grad());
      detached.push_back(d);
    }
    std::vector<at::Tensor> outputs;
    {
      TraceSpan span(thread_trace_slot(), "compute", "recompute", name);
      RngFork fork(state->rng ? &*state->rng : nullptr);
      at::AutoGradMode grad(true);
      outputs = state->fn(detached, nullptr);
    }
    FSDP_CHECK(outputs.size() == grad_outputs.size(), name, ": the recomputation returned ",
               outputs.size(), " tensors but the forward returned ", grad_outputs.size(),
               "; its forward must return the same structure every time");
    variable_list roots, grads;
    bool any_requires_grad = false;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].defined() || !outputs[i].requires_grad()) continue;
      any_requires_grad = true;
      if (!grad_outputs[i].defined()) continue;
      roots.push_back(outputs[i]);
      grads.push_back(grad_outputs[i]);
    }
    FSDP_CHECK(any_requires_grad, name, ": the recomputed forward returned no tensor that requires "
               "grad, so no gradient can flow through it; leave it out of activation "
               "checkpointing, or return the tensors its parameters produce");
    if (!roots.empty()) {
      torch::autograd::backward(roots, grads, /*retain_graph=*/false, /*create_graph=*/false);
    }
    variable_list result;
    result.reserve(detached.size() + 3);
    result.emplace_back();  // state
    for (const auto& d : detached) result.push_back(d.defined() && d.requires_grad() ? d.grad() : at::Tensor());
    if (state->has_dummy) result.emplace_back();
    result.emplace_back();  // result pointer
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint_tensors(RecomputeFn fn, const std::vector<at::Tensor>& inputs,
                                           void* result, const ActivationCheckpointOptions& opts) {
  auto state = c10::make_intrusive<CheckpointState>();
  state->fn = std::move(fn);
  state->opts = opts;
  state->num_inputs = inputs.size();
  variable_list all(inputs.begin(), inputs.end());
  if (at::GradMode::is_enabled()) {
    const bool any = std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) {
      return t.defined() && t.requires_grad();
    });
    if (!any) {
      all.push_back(at::empty({0}).requires_grad_(true));
      state->has_dummy = true;
    }
  }
  // As a TensorList: autograd takes a std::vector argument for a non-tensor one.
  return CheckpointFunction::apply(state, at::TensorList(all), result);
}

}  // namespace fsdp::detail
