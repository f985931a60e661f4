// fsdp/detail/unit_impl.h (internal): UnitImpl<M>, the module behind fsdp::Unit<M>, and its base
// UnitHooks: how a unit's forward is intercepted (NOTE [intercepting forward] in fsdp/sharded.h).
// Include fsdp/sharded.h instead; use fsdp::Unit<M>, not these types.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/activation_checkpoint.h"
#include "fsdp/detail/collect_tensors.h"
#include "fsdp/detail/engine_calls.h"

namespace fsdp {

// Base of every interceptable unit. Holds the link the engine sets while the model is sharded.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  bool fsdp_sharded() const { return fsdp_unit_ != nullptr; }

 protected:
  // Runs body(args...) between the unit's pre- and post-forward, checkpointed if the policy says
  // (`Rvalues`: body accepts its stored arguments as rvalues, which recomputation needs).
  template <class R, bool Rvalues, class F, class... A>
  R fsdp_run(F&& body, A&&... args) {
    detail::UnitState* u = fsdp_unit_;
    if (!u) {
      if (fsdp_deferred_) detail::deferred_unit_not_sharded();
      return body(std::forward<A>(args)...);
    }
    detail::unit_pre_forward(u);
    if (detail::unit_tracks_inputs(u)) {
      std::vector<at::Tensor> inputs;
      (detail::collect_input_tensors(inputs, args), ...);
      detail::unit_track_inputs(u, inputs);
    }
    R out = [&]() -> R {
      if constexpr (Rvalues && detail::checkpointable_v<R, F, A...>) {
        if (auto opts = detail::unit_checkpoint(u)) {
          return detail::checkpoint_as<R>(*opts, body, std::forward<A>(args)...);
        }
      } else {
        detail::unit_not_checkpointable(u);
      }
      return body(std::forward<A>(args)...);
    }();
    std::vector<at::Tensor> tensors;
    detail::collect_tensors(tensors, out);
    detail::unit_post_forward(u, tensors);
    return out;
  }

 private:
  friend class detail::Engine;
  friend bool detail::deferred_unit_built(torch::nn::Module&, UnitHooks&);
  friend struct detail::DeferredAccess;
  detail::UnitState* fsdp_unit_ = nullptr;
  // This rank's shards while built under DeferredInit and not yet adopted by fsdp::shard().
  std::shared_ptr<detail::DeferredUnit> fsdp_deferred_;
};

// UnitImpl<M>: M with its forward intercepted. The forward signature is M's, so Sequential and
// AnyModule accept it.
template <class M, class Sig = decltype(&M::forward)>
class UnitImpl;

template <class M, class R, class... Args>
class UnitImpl<M, R (M::*)(Args...)> : public M, public UnitHooks {
 public:
  using M::M;
  R forward(Args... args) {
    constexpr bool rvalues = std::is_invocable_v<R (M::*)(Args...), M*, std::decay_t<Args>&&...>;
    return fsdp_run<R, rvalues>(
        [this](auto&&... a) -> R { return M::forward(std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
  }

 private:
  // Initialised after M's constructor returned (inheriting constructors still run member
  // initialisers): NOTE [deferred init].
  bool fsdp_deferred_built_ = detail::deferred_unit_built(*this, *this);
};

template <class M, class R, class... Args>
class UnitImpl<M, R (M::*)(Args...) const> : public M, public UnitHooks {
 public:
  using M::M;
  R forward(Args... args) {
    constexpr bool rvalues = std::is_invocable_v<R (M::*)(Args...) const, M*, std::decay_t<Args>&&...>;
    return fsdp_run<R, rvalues>(
        [this](auto&&... a) -> R { return M::forward(std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
  }

 private:
  // Initialised after M's constructor returned (inheriting constructors still run member
  // initialisers): NOTE [deferred init].
  bool fsdp_deferred_built_ = detail::deferred_unit_built(*this, *this);
};

}  // namespace fsdp
