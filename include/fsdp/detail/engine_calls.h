// fsdp/detail/engine_calls.h (internal): the engine's entry points that the inline forward code
// of fsdp::Unit<M> and fsdp::ShardedModule<M> calls. Include fsdp/sharded.h instead; nothing here
// is API, and the functions are defined in src/ (engine, deferred_init).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <vector>

#include "fsdp/activation_checkpoint.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

class ShardedModuleBase;
class UnitHooks;

namespace detail {
class Engine;
struct UnitState;
// The engine behind a sharded module (checkpoint.cpp reads its layout).
const std::shared_ptr<Engine>& engine_of(const ShardedModuleBase& model);

// Called by UnitImpl::forward around M::forward.
void unit_pre_forward(UnitState* unit);
void unit_post_forward(UnitState* unit, const std::vector<at::Tensor>& outputs);
// How to checkpoint the unit's forward now; nullopt unless the activation checkpointing policy
// selects it and autograd is recording.
std::optional<ActivationCheckpointOptions> unit_checkpoint(UnitState* unit);
// Throws if the policy selects the unit: its forward's argument or result types cannot be stored.
void unit_not_checkpointable(UnitState* unit);
// Whether the unit needs its arguments' gradients tracked (it has frozen parameters and autograd
// is recording), and the tracking itself (NOTE [frozen parameters] in fsdp/sharded.h).
bool unit_tracks_inputs(UnitState* unit);
void unit_track_inputs(UnitState* unit, const std::vector<at::Tensor>& inputs);

// Called by ShardedModule<M>::forward around M::forward (through RootForwardScope).
void root_pre_forward(Engine* engine);
void root_abort_forward(Engine* engine);
void root_post_forward(Engine* engine, const std::vector<at::Tensor>& outputs);
at::Tensor cast_input(Engine* engine, const at::Tensor& t);

// NOTE [deferred init] (fsdp/deferred_init.h): called when a Unit<M>'s constructor returned;
// under an active DeferredInit on this thread it keeps only this rank's shard. Returns whether
// it did.
struct DeferredUnit;
struct DeferredAccess;  // reads and clears UnitHooks' shards (deferred_init.cpp)
bool deferred_unit_built(torch::nn::Module& module, UnitHooks& hooks);
// Throws: a unit built under DeferredInit ran its forward without fsdp::shard().
[[noreturn]] void deferred_unit_not_sharded();
}  // namespace detail

}  // namespace fsdp
