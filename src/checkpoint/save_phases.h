// checkpoint/save_phases.h (internal): a sharded save in three phases, shared by save_checkpoint
// and AsyncCheckpointer (NOTE [async checkpoint] in fsdp/async_checkpoint.h): prepare_save
// (collective; AsyncCheckpointer runs its agreement on the writer thread), write_shard_file
// (local, any thread), commit_save (collective).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/layout.h"

namespace fsdp::detail {

// A sharded save between its phases.
struct PendingSave {
  std::string path, partial, what;
  std::string error;  // this rank's validation error (plan_save); then nothing else is set
  Runtime* rt = nullptr;
  std::shared_ptr<Engine> engine;  // keeps the flats' shards alive
  Layout layout;
  std::optional<OptimizerKind> kind;
  std::vector<double> lrs;
  std::string meta_state;
  int64_t s_index = 0;
  bool writer = false;
  at::Tensor crcs;  // per chunk its CRC, then per file its CRC (summed over ranks at commit)
  bool page_cache_write = false;  // write_shard_image's file went through the page cache
  double write_s = 0;             // this rank's file: open to fsync (0 for a rank that writes none)
  at::Tensor rng;   // this rank's generator states at the save (checkpoint/common.h rng_state)
  int64_t rng_cuda_bytes = 0;  // of which the CUDA generator's (its last bytes)
  std::chrono::steady_clock::time_point t0;
};

// 1a. Validates this rank's arguments (an error goes to `error`, and nothing else is set), then
// the layout, this rank's role and its RNG state. Local.
PendingSave plan_save(const std::string& path, ShardedModuleBase& model,
                      const torch::optim::Optimizer* optimizer, const TrainingState& state,
                      const CheckpointOptions& options);

// 1b. Rank 0 creates "<path>.partial" (removing a leftover first); the others do nothing.
// Returns "" or the error message.
std::string make_partial_dir(const PendingSave& p);

// 1. plan_save, make_partial_dir, then every rank learns whether all succeeded (throws
// fsdp::Error on every rank otherwise). Collective (store only).
PendingSave prepare_save(const std::string& path, ShardedModuleBase& model,
                         const torch::optim::Optimizer* optimizer, const TrainingState& state,
                         const CheckpointOptions& options);

// The chunks of the file this rank writes (none unless it is its shard index's writer), in
// file order.
std::vector<int64_t> my_chunks(const PendingSave& p);

// 2. The writer of each shard index writes its file from `bytes(chunk)` (the chunk's data,
// chunk_bytes long) and fsyncs it, recording the CRCs. Local: no collective, no model access
// unless `bytes` reads the model. Returns "" or the error message.
std::string write_shard_file(PendingSave& p,
                             const std::function<const void*(int64_t chunk)>& bytes);

// 2, from an image of the file (AsyncCheckpointer's staging buffer: every chunk at its offset,
// aligned to kDirectAlign and readable for direct_bytes(the file's size)): the
// CRCs come from the image and the file is written without the page cache where the file
// system allows (File::write_direct). Returns "" or the error message.
std::string write_shard_image(PendingSave& p, const uint8_t* image);

// 3 and 4. Every rank reports how its write went (a failure anywhere stops the save on every
// rank); the CRCs and every rank's RNG state are collected; rank 0 writes rng.bin and meta.json
// and renames the directory into place. Collective.
CheckpointInfo commit_save(PendingSave& p, const std::string& write_error);

// Sums a small CPU tensor over the world on the runtime's device (ProcessGroupNCCL takes device
// tensors only); the result is on the CPU.
at::Tensor world_sum(Runtime& rt, const at::Tensor& t);

}  // namespace fsdp::detail
