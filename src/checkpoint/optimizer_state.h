// checkpoint/optimizer_state.h (internal): the optimizer state a checkpoint holds, per torch::optim
// type: which per-element tensors (moments, momentum...) and whether a step count.
#pragma once

#include <torch/optim.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace fsdp::detail {

// Optimizer state, per type. Element-wise state tensors have the shape of the flat shard; the
// step count is one number per shard.

using ParamState = torch::optim::OptimizerParamState;

struct StateField {
  std::string name;
  std::function<at::Tensor(const ParamState&)> get;
  std::function<void(ParamState&, const at::Tensor&)> set;
};

struct OptimizerKind {
  std::string name;
  std::vector<StateField> fields;
  std::function<std::unique_ptr<ParamState>()> make;
  std::function<int64_t(const ParamState&)> get_step;  // null: no step count
  std::function<void(ParamState&, int64_t)> set_step;
};

// The kind of `o` (Adam, AdamW, SGD, RMSprop, Adagrad); fsdp::Error for any other optimizer.
OptimizerKind optimizer_kind(const torch::optim::Optimizer& o);

// `o`'s state of parameter `p`, or nullptr.
const ParamState* find_state(const torch::optim::Optimizer& o, const at::Tensor& p);

// Every optimizer parameter must be one of the model's trainable shards.
void check_optimizer_params(const torch::optim::Optimizer& o, const Engine& e);

}  // namespace fsdp::detail
