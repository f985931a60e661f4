// fsdp/activation_checkpoint.h: activation checkpointing (recompute in backward instead of
// storing), usable with or without sharding. libtorch's C++ frontend has no
// torch.utils.checkpoint; this is its reentrant form:
//
//   auto y = fsdp::checkpoint([&](const torch::Tensor& x) { return block->forward(x); }, x);
//   auto [a, b] = fsdp::checkpoint(fn, x, mask, 0.5);   // several inputs, tuple outputs
//
// Forward runs fn(inputs...) without recording a graph and keeps only the input tensors (and the
// RNG state). Backward restores the RNG state, runs fn again with the graph recorded on detached
// copies of the inputs, back-propagates the incoming gradients through that graph (parameters fn
// uses receive their gradients there, as with a plain forward), and hands the inputs' gradients
// on. Cost: one extra forward of fn per backward; saves every activation fn would have kept
// except its inputs. Sharded models get this per unit from FSDPStrategy::activation_checkpointing
// (strategy.h), which reuses the gather that backward does anyway.
//
// Contract: fn must compute the same thing when run again: its randomness must come from the
// default CPU generator (or the default CUDA generator of the inputs' devices), whose state is
// restored for the recomputation (preserve_rng_state). Another thread drawing from the same
// global generator between the two runs changes the draws (the same holds in PyTorch).
// Arguments: tensors, std::vector<Tensor>, c10::optional<Tensor>, numbers, enums and strings
// (stored until backward); capture anything else in fn. Results: a tensor, a std::vector of
// them, or tuples/pairs of those and of numbers. Gradients flow to the input tensors that require
// grad and to the parameters fn uses; outputs with integer dtypes carry no gradient. Not
// supported: double backward (create_graph) through a checkpoint.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {

struct ActivationCheckpointOptions {
  // Save the default generators' state in forward and replay it in the recomputation, so
  // dropout draws the same mask twice. Default on; off saves copying the state (~5 KB on CPU).
  bool preserve_rng_state = true;
  // Names the call in error messages.
  std::string name = "fsdp::checkpoint";
  // Run this forward with autograd recording (then drop the graph) to check that some output
  // requires grad: a one-time check, costing that forward's activations once. Default off.
  bool check_outputs_require_grad = false;
};

namespace detail {

// Runs the function on the given input tensors (in flattened order). On the first run `result`
// points at a std::optional<R> that receives the whole result; on recomputation it is null.
using RecomputeFn =
    std::function<std::vector<at::Tensor>(std::vector<at::Tensor> inputs, void* result)>;

// The autograd function behind checkpoint(): returns fn's output tensors, attached to a node
// whose backward recomputes (activation_checkpoint.cpp).
std::vector<at::Tensor> checkpoint_tensors(RecomputeFn fn, const std::vector<at::Tensor>& inputs,
                                           void* result, const ActivationCheckpointOptions& opts);

// Visits every tensor inside a supported argument or result type, in a fixed order.
template <class T>
struct CheckpointTraits {
  // Numbers, enums and strings: stored by value, carry no tensor.
  static constexpr bool supported = std::is_arithmetic_v<T> || std::is_enum_v<T> ||
                                    std::is_same_v<T, std::string>;
  template <class V, class F>
  static void visit(V&, F&) {}
};
template <>
struct CheckpointTraits<at::Tensor> {
  static constexpr bool supported = true;
  template <class V, class F>
  static void visit(V& t, F& f) { f(t); }
};
template <>
struct CheckpointTraits<std::vector<at::Tensor>> {
  static constexpr bool supported = true;
  template <class V, class F>
  static void visit(V& v, F& f) {
    for (auto& t : v) f(t);
  }
};
template <>
struct CheckpointTraits<c10::optional<at::Tensor>> {
  static constexpr bool supported = true;
  template <class V, class F>
  static void visit(V& o, F& f) {
    if (o.has_value()) f(*o);
  }
};
template <class... T>
struct CheckpointTraits<std::tuple<T...>> {
  static constexpr bool supported = (CheckpointTraits<T>::supported && ...);
  template <class V, class F>
  static void visit(V& t, F& f) {
    std::apply([&](auto&... e) { (CheckpointTraits<std::decay_t<decltype(e)>>::visit(e, f), ...); },
               t);
  }
};
template <class A, class B>
struct CheckpointTraits<std::pair<A, B>> {
  static constexpr bool supported = CheckpointTraits<A>::supported && CheckpointTraits<B>::supported;
  template <class V, class F>
  static void visit(V& p, F& f) {
    CheckpointTraits<A>::visit(p.first, f);
    CheckpointTraits<B>::visit(p.second, f);
  }
};

// Whether fn(Args...) -> R can be checkpointed: every argument and the result are supported
// types and fn accepts the stored arguments as rvalues.
template <class R, class F, class... Args>
constexpr bool checkpointable_v =
    (CheckpointTraits<std::decay_t<Args>>::supported && ...) &&
    CheckpointTraits<std::decay_t<R>>::supported && !std::is_void_v<R> &&
    std::is_invocable_v<F&, std::decay_t<Args>&&...>;

template <class R, class F, class... Args>
R checkpoint_as(const ActivationCheckpointOptions& opts, F fn, Args&&... args) {
  using Stored = std::tuple<std::decay_t<Args>...>;
  static_assert(checkpointable_v<R, F, Args...>,
                "fsdp::checkpoint: an argument or the result has an unsupported type; pass "
                "tensors, std::vector<Tensor>, c10::optional<Tensor>, numbers, enums or strings, "
                "return tensors, vectors or tuples of them, and capture anything else in fn");
  Stored stored(std::forward<Args>(args)...);
  std::vector<at::Tensor> inputs;
  auto collect = [&](const at::Tensor& t) { inputs.push_back(t); };
  CheckpointTraits<Stored>::visit(stored, collect);
  // The function keeps the arguments with their tensors detached (the saved inputs carry the
  // graph); each run substitutes the tensors it is given.
  auto detach = [](at::Tensor& t) {
    if (t.defined()) t = t.detach();
  };
  CheckpointTraits<Stored>::visit(stored, detach);
  RecomputeFn run = [fn = std::move(fn), stored = std::move(stored)](
                        std::vector<at::Tensor> tensors, void* result) mutable {
    Stored call_args = stored;
    size_t next = 0;
    auto substitute = [&](at::Tensor& t) { t = std::move(tensors.at(next++)); };
    CheckpointTraits<Stored>::visit(call_args, substitute);
    std::optional<R> out(std::apply(fn, std::move(call_args)));
    std::vector<at::Tensor> outputs;
    auto gather = [&](const at::Tensor& t) { outputs.push_back(t); };
    CheckpointTraits<R>::visit(*out, gather);
    if (result) *static_cast<std::optional<R>*>(result) = std::move(out);
    return outputs;
  };
  std::optional<R> first;
  std::vector<at::Tensor> outputs = checkpoint_tensors(std::move(run), inputs, &first, opts);
  size_t next = 0;
  auto attach = [&](at::Tensor& t) { t = outputs.at(next++); };
  CheckpointTraits<R>::visit(*first, attach);
  return std::move(*first);
}

}  // namespace detail

// Runs fn(args...) keeping only the input tensors; recomputes fn in backward (see the top of this
// file). Returns what fn returns.
template <class F, class... Args,
          std::enable_if_t<!std::is_same_v<std::decay_t<F>, ActivationCheckpointOptions>, int> = 0>
auto checkpoint(F&& fn, Args&&... args) {
  using R = std::decay_t<std::invoke_result_t<F&, std::decay_t<Args>&&...>>;
  return detail::checkpoint_as<R>(ActivationCheckpointOptions{}, std::forward<F>(fn),
                                  std::forward<Args>(args)...);
}
template <class F, class... Args>
auto checkpoint(const ActivationCheckpointOptions& opts, F&& fn, Args&&... args) {
  using R = std::decay_t<std::invoke_result_t<F&, std::decay_t<Args>&&...>>;
  return detail::checkpoint_as<R>(opts, std::forward<F>(fn), std::forward<Args>(args)...);
}

}  // namespace fsdp
