// checkpoint/load_phases.h (internal): a sharded load in three phases, as a save has them
// (save_phases.h): check_load reads meta.json and checks it against the model and optimizer,
// stage_load reads this rank's part of every saved tensor into new memory, commit_load puts what
// was staged into the model and the optimizer. The first two change nothing: a load that fails in
// them (on any rank: load_checkpoint agrees on it after each) leaves training as it was.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/layout.h"

namespace fsdp::detail {

// A sharded load between its phases. Local to one rank.
struct PendingLoad {
  std::string path;
  Engine* engine = nullptr;
  std::vector<FlatView> flats;  // the loading engine's flats
  Meta meta;
  std::optional<OptimizerKind> kind;        // set when an optimizer is loaded
  std::map<std::string, int64_t> entry_of;  // TensorEntry::key() -> entry, aliases included

  // Staged by stage_load, per flat: the parameters' shard, the optimizer state (null where the
  // checkpoint holds none for the flat), and the whole buffers and this rank's RNG record.
  std::vector<at::Tensor> shards;
  std::vector<std::unique_ptr<ParamState>> states;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  at::Tensor rng;
  int64_t bytes = 0;  // read from the checkpoint's files
};

// 1. Reads meta.json at `path` and checks it against the model (every parameter and buffer by
// name and shape) and `optimizer` (its type and parameter groups; may be null). Local; throws
// fsdp::Error.
PendingLoad check_load(const std::string& path, Engine& e,
                       const torch::optim::Optimizer* optimizer);

// 2. Reads what this rank's shards, optimizer state, buffers and (with options.rng) RNG record
// need into new tensors, one pass over the files (NOTE [one-pass load]), every chunk's checksum
// verified. Local; throws fsdp::Error; the model is untouched.
void stage_load(PendingLoad& p, const CheckpointOptions& options);

// 3. Puts the staged state into the model, `optimizer` (may be null) and `state` (may be null);
// restores the RNG when it was staged. Collective only through the RNG check (check_all_ok).
void commit_load(PendingLoad& p, torch::optim::Optimizer* optimizer, TrainingState* state,
                 CheckpointInfo& info);

}  // namespace fsdp::detail
