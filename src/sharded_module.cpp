// fsdp::FullyShardedModule's methods, forwarding to the engine, and the runtime a strategy gets
// (see fsdp/sharded.h).
#include "engine.h"

#include "fsdp/error.h"

namespace fsdp {

std::shared_ptr<Runtime> detail::runtime_for(const FSDPStrategy& strategy,
                                             std::shared_ptr<Runtime> runtime) {
  if (!runtime) return Runtime::init(strategy.runtime());
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
