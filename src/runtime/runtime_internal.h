// runtime_internal.h (internal): building a Runtime on a store the caller already has (tests run
// several ranks as threads of one process over a shared c10d::HashStore), and the agreements an
// asynchronous save runs off the caller's thread. Includes
// process_setup.h (QuietGlog), which Runtime::init uses around its store connection.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <cstdint>
#include <string>

#include "base/trace_sink.h"
#include "fsdp/runtime.h"
#include "runtime/process_setup.h"

namespace fsdp::detail {

std::shared_ptr<Runtime> make_runtime(c10::intrusive_ptr<c10d::Store> store, const ClusterEnv& env,
                                      const RuntimeOptions& options);

// The runtime's trace slot (base/trace_sink.h; never null): fsdp::Trace turns it on, the
// runtime's groups, the engine and the checkpoint code record into it.
TraceSlot* trace_slot(const Runtime& rt);
// The rendezvous store (fsdp::Trace's clock exchange and merge). A world of one has one too.
c10::intrusive_ptr<c10d::Store> runtime_store(Runtime& rt);

// Runtime::check_all_ok in two halves (Rendezvous::check_all_ok_reserved): reserve on the
// caller's thread, in the same order on every rank as the other agreements; run later, on any
// thread (an asynchronous save's writer), until *cancel turns true.
int64_t reserve_agreement(Runtime& rt);
void check_all_ok_reserved(Runtime& rt, int64_t id, const std::string& what,
                           const std::string& local_error, const std::atomic<bool>* cancel);

}  // namespace fsdp::detail
