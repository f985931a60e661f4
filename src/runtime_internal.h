// runtime_internal.h (internal): building a Runtime on a store the caller already has. Tests use
// it to run several ranks as threads of one process over a shared c10d::HashStore.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "fsdp/runtime.h"

namespace fsdp::detail {

std::shared_ptr<Runtime> make_runtime(c10::intrusive_ptr<c10d::Store> store, const ClusterEnv& env,
                                      const RuntimeOptions& options);

}  // namespace fsdp::detail
