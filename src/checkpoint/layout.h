// checkpoint/layout.h (internal): where every parameter and optimizer state of a sharded model
// goes in a checkpoint's files (saving), and how a loaded model's shards are rebuilt from the
// saved chunks by name and element range (full checkpoints; sharded ones: chunk_reader.h).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/common.h"
#include "checkpoint/optimizer_state.h"
#include "engine/engine.h"

namespace fsdp::detail {

// The layout of a sharded checkpoint for the saving engine (identical on every rank).

struct Layout {
  std::vector<TensorEntry> entries;
  std::vector<Chunk> chunks;
  std::vector<int64_t> file_bytes;  // per shard index
  std::vector<FlatView> flats;      // the saving engine's flats (Chunk::flat indexes them)
};

// Which optimizer state fields exist (defined) for the shard of `u`, per kind.fields index.
std::vector<bool> fields_present(const OptimizerKind* kind, const torch::optim::Optimizer* o,
                                 const FlatView& u);

// The layout of `e`'s checkpoint with optimizer `o` of `kind` (both may be null).
Layout make_layout(const Engine& e, const torch::optim::Optimizer* o, const OptimizerKind* kind);

// "shard-<s>.bin".
std::string shard_file_name(int64_t s);

// The size of chunk `c` in its file.
int64_t chunk_bytes(const Chunk& c, const Layout& L);

// The bytes of chunk `c` on its writer (a view where the data is already contiguous on CPU).
at::Tensor chunk_data(const Chunk& c, const Layout& L, const Engine& e,
                      const torch::optim::Optimizer* o, const OptimizerKind* kind);

// The values a loader needs: (name, element range) -> tensor. Implemented per format.
using SliceSource = std::function<at::Tensor(const std::string& name, int64_t lo, int64_t hi)>;

// This rank's new fp32 shard of flat `u` of `e`, from `source` (zeros where no parameter lies).
at::Tensor build_flat(const Engine& e, const FlatView& u, const SliceSource& source);

// New fp32 shards for every unit of `e`, from `source` (parameters only).
std::vector<at::Tensor> build_shards(const Engine& e, const SliceSource& source);

// Names and shapes of what the model has against what a file has; every mismatch, in one line.
void check_names(const std::map<std::string, std::vector<int64_t>>& want,
                 const std::map<std::string, std::vector<int64_t>>& have, const std::string& what);

// Every parameter's and buffer's shape, by name.
std::map<std::string, std::vector<int64_t>> model_shapes(torch::nn::Module& m);

}  // namespace fsdp::detail
