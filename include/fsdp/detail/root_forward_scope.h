// fsdp/detail/root_forward_scope.h (internal): RootForwardScope, the root unit's pre- and
// post-forward around ShardedModule<M>::forward, undone if M::forward throws. Include
// fsdp/sharded.h instead.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "fsdp/detail/engine_calls.h"

namespace fsdp::detail {

// Runs the root's pre-forward; unless finish() is reached, undoes it (M::forward threw).
class RootForwardScope {
 public:
  explicit RootForwardScope(Engine* engine) : engine_(engine) { root_pre_forward(engine_); }
  ~RootForwardScope() {
    if (engine_) root_abort_forward(engine_);
  }
  RootForwardScope(const RootForwardScope&) = delete;
  RootForwardScope& operator=(const RootForwardScope&) = delete;
  void finish(const std::vector<at::Tensor>& outputs) {
    Engine* e = engine_;
    engine_ = nullptr;
    root_post_forward(e, outputs);
  }

 private:
  Engine* engine_;
};

}  // namespace fsdp::detail
