// The optimizer state of checkpoints, per torch::optim type (see checkpoint/optimizer_state.h).
#include "checkpoint/optimizer_state.h"

#include "base/compat.h"
#include "fsdp/error.h"

namespace fsdp::detail {

namespace {

#define FSDP_FIELD(State, f)                                                  \
  StateField {                                                                \
    #f, [](const ParamState& s) { return static_cast<const State&>(s).f(); }, \
        [](ParamState& s, const at::Tensor& v) { static_cast<State&>(s).f(v); } \
  }

template <class State>
OptimizerKind kind_with_step(std::string name, std::vector<StateField> fields) {
  OptimizerKind k;
  k.name = std::move(name);
  k.fields = std::move(fields);
  k.make = [] { return std::make_unique<State>(); };
  k.get_step = [](const ParamState& s) { return static_cast<const State&>(s).step(); };
  k.set_step = [](ParamState& s, int64_t v) { static_cast<State&>(s).step(v); };
  return k;
}

}  // namespace

OptimizerKind optimizer_kind(const torch::optim::Optimizer& o) {
  namespace optim = torch::optim;
  if (dynamic_cast<const optim::AdamW*>(&o)) {
    return kind_with_step<optim::AdamWParamState>(
        "adamw", {FSDP_FIELD(optim::AdamWParamState, exp_avg),
                  FSDP_FIELD(optim::AdamWParamState, exp_avg_sq),
                  FSDP_FIELD(optim::AdamWParamState, max_exp_avg_sq)});
  }
  if (dynamic_cast<const optim::Adam*>(&o)) {
    return kind_with_step<optim::AdamParamState>(
        "adam", {FSDP_FIELD(optim::AdamParamState, exp_avg),
                 FSDP_FIELD(optim::AdamParamState, exp_avg_sq),
                 FSDP_FIELD(optim::AdamParamState, max_exp_avg_sq)});
  }
  if (dynamic_cast<const optim::RMSprop*>(&o)) {
    return kind_with_step<optim::RMSpropParamState>(
        "rmsprop", {FSDP_FIELD(optim::RMSpropParamState, square_avg),
                    FSDP_FIELD(optim::RMSpropParamState, momentum_buffer),
                    FSDP_FIELD(optim::RMSpropParamState, grad_avg)});
  }
  if (dynamic_cast<const optim::Adagrad*>(&o)) {
    return kind_with_step<optim::AdagradParamState>(
        "adagrad", {FSDP_FIELD(optim::AdagradParamState, sum)});
  }
  if (dynamic_cast<const optim::SGD*>(&o)) {
    OptimizerKind k;
    k.name = "sgd";
    k.fields = {FSDP_FIELD(optim::SGDParamState, momentum_buffer)};
    k.make = [] { return std::make_unique<optim::SGDParamState>(); };
    return k;
  }
  throw Error("checkpoints support the torch::optim optimizers Adam, AdamW, SGD, RMSprop and "
              "Adagrad; this optimizer is none of them (LBFGS keeps history that is not per "
              "element); pass nullptr to save the model alone");
}
#undef FSDP_FIELD

const ParamState* find_state(const torch::optim::Optimizer& o, const at::Tensor& p) {
  auto it = o.state().find(compat::optimizer_state_key(p));
  return it == o.state().end() ? nullptr : it->second.get();
}

void check_optimizer_params(const torch::optim::Optimizer& o, const Engine& e) {
  e.check_optimizer(o);
}

}  // namespace fsdp::detail
