// flat_view.h (internal): what code outside the engine — checkpoints and exports — sees of one
// flat parameter: its layout (which parameter lies where in the flat buffer) and this rank's
// shard, read only. Engine::flat_views() makes them; Engine::replace_shards() is the one way to
// overwrite shards from outside (NOTE [flat view] in engine.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {

// One parameter's place in its flat buffer.
struct FlatParamView {
  std::string name;                  // first name in the model
  std::vector<std::string> aliases;  // further names of the same tensor (tied weights)
  int64_t offset = 0;                // elements into the flat buffer
  int64_t numel = 0;
  std::vector<int64_t> shape;
};

// One flat: a unit's trainable parameters, or its frozen ones (`frozen`).
struct FlatView {
  std::string unit;          // module path, "" for the root
  bool frozen = false;       // the frozen-parameter flat of `unit`
  bool trainable = true;
  int64_t padded = 0;        // the flat buffer's length: shard size * shard_numel
  int64_t shard_numel = 0;   // elements per rank
  std::vector<FlatParamView> params;  // in flat order
  // This rank's shard, fp32 [shard_numel], on the training device: the optimizer's parameter.
  // Read it and key optimizer state by it; never write it (Engine::replace_shards does).
  at::Tensor param;
};

}  // namespace fsdp::detail
