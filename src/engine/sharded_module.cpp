// fsdp::ShardedModuleBase's methods, forwarding to the engine (see fsdp/sharded.h).
#include "engine/engine.h"
#include "runtime/strategy_internal.h"

#include "fsdp/error.h"

namespace fsdp {

ShardedModuleBase::ShardedModuleBase(std::shared_ptr<torch::nn::Module> module,
                                     const FSDPStrategy& strategy,
                                     std::shared_ptr<Runtime> runtime) {
  engine_ = std::make_shared<detail::Engine>(std::move(module), strategy,
                                             detail::runtime_for(strategy, std::move(runtime)));
  engine_->build();
}

const std::shared_ptr<detail::Engine>& detail::engine_of(const ShardedModuleBase& model) {
  return model.engine_;
}

std::vector<at::Tensor> ShardedModuleBase::parameters() const { return engine_->parameters(); }
void ShardedModuleBase::check_optimizer(const torch::optim::Optimizer& optimizer) const {
  engine_->check_optimizer(optimizer);
}
int64_t ShardedModuleBase::trainable_numel() const { return engine_->trainable_numel(); }
int64_t ShardedModuleBase::total_numel() const { return engine_->total_numel(); }
torch::OrderedDict<std::string, at::Tensor> ShardedModuleBase::named_parameters() const {
  return engine_->named_parameters();
}

ShardedModuleBase::NoSyncGuard::NoSyncGuard(std::shared_ptr<detail::Engine> engine, bool enabled)
    : engine_(enabled ? std::move(engine) : nullptr) {
  if (engine_) engine_->set_sync(false);
}
ShardedModuleBase::NoSyncGuard::~NoSyncGuard() {
  if (engine_) engine_->set_sync(true);
}
ShardedModuleBase::NoSyncGuard ShardedModuleBase::no_sync(bool enabled) {
  return NoSyncGuard(engine_, enabled);
}

double ShardedModuleBase::clip_grad_norm(double max_norm) {
  return engine_->clip_grad_norm(max_norm);
}
torch::OrderedDict<std::string, at::Tensor> ShardedModuleBase::state_dict() {
  return engine_->state_dict();
}
void ShardedModuleBase::load_state_dict(const torch::OrderedDict<std::string, at::Tensor>& d) {
  engine_->load_state_dict(d);
}

ShardedModuleBase::SummonGuard::SummonGuard(std::shared_ptr<detail::Engine> engine)
    : engine_(std::move(engine)) {
  engine_->summon(true);
}
ShardedModuleBase::SummonGuard::~SummonGuard() {
  if (engine_) engine_->summon(false);
}
ShardedModuleBase::SummonGuard ShardedModuleBase::summon_full_params() {
  return SummonGuard(engine_);
}

MemoryStats ShardedModuleBase::memory_stats(const torch::optim::Optimizer* optimizer) const {
  return engine_->memory_stats(optimizer);
}
void ShardedModuleBase::reset_peak_memory() { engine_->reset_peak_memory(); }
std::vector<std::pair<std::string, CommCounters>> ShardedModuleBase::comm_counters() const {
  return engine_->comm_counters();
}
const ShardingPlan& ShardedModuleBase::plan() const { return engine_->plan(); }
const std::vector<UnitInfo>& ShardedModuleBase::units() const { return engine_->units(); }
std::shared_ptr<Runtime> ShardedModuleBase::runtime() const { return engine_->runtime(); }
std::shared_ptr<DeviceMesh> ShardedModuleBase::mesh() const { return engine_->mesh(); }
c10::ScalarType ShardedModuleBase::param_dtype() const { return engine_->param_dtype(); }

}  // namespace fsdp
