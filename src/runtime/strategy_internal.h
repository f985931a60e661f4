// strategy_internal.h (internal): the runtime a strategy gets (fsdp::shard and DeferredInit).
#pragma once

#include <memory>

#include "fsdp/runtime.h"
#include "fsdp/strategy.h"

namespace fsdp::detail {

// The runtime fsdp::shard and DeferredInit use: `runtime`, checked against the strategy's
// backend, or a new one from the environment (Runtime::init) with the strategy's runtime
// options (FSDPStrategy::runtime).
std::shared_ptr<Runtime> runtime_for(const FSDPStrategy& strategy, std::shared_ptr<Runtime> runtime);

}  // namespace fsdp::detail
