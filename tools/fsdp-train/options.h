// fsdp-train's command line: TrainOptions (every flag and its default), add_flags() (the one
// table that declares them to CLI11, so --help is generated from it), the model presets, the
// default corpus, and check_options(), which validates every flag before any process starts.
// No libtorch compute here: the supervisor validates, then launches the ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/launcher.h"
#include "fsdp/runtime.h"
#include "fsdp/strategy.h"

namespace CLI {
class App;
}

namespace fsdp_train {

// A GPT shape. Parameters: about 12 d^2 per block plus (256 + context) d embeddings and a 256 x d
// head.
struct ModelPreset {
  std::string name;
  int64_t d_model = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t context = 0;  // position embeddings: the longest --seq-len
  double dropout = 0;   // --dropout: probability on each block's attention and MLP outputs
};
// tiny (~0.1 M parameters, for tests), small (~3.4 M, the demo), medium (~25 M, benchmarks).
const std::vector<ModelPreset>& model_presets();

// Byte-level vocabulary: every byte value is a token.
constexpr int64_t kVocab = 256;

// fsdp-train's launch defaults: LaunchOptions' own, with messages naming fsdp-train's flags.
inline fsdp::LaunchOptions default_launch_options() {
  fsdp::LaunchOptions l;
  l.name = "fsdp-train";
  l.devices_flag = "--devices";
  return l;
}

struct TrainOptions {
  // Launch: --devices, --num-nodes, --node-rank, --master-addr, --master-port and --threads
  // (see fsdp/launcher.h).
  fsdp::LaunchOptions launch = default_launch_options();
  // Sharding.
  std::string strategy = "full_shard";
  std::string mesh;  // empty: the strategy's default mesh
  std::string precision = "fp32";
  std::string grad_sync = "every";
  std::string prefetch = "on";
  bool activation_checkpointing = false;  // every block recomputes its forward in backward
  // Model and data.
  std::string model = "small";
  // Explicit shape, overriding the preset's (0 = the preset's): any size can be asked for.
  int64_t layers = 0, d_model = 0, heads = 0;
  std::string data;  // empty: the default corpus
  double dropout = 0;
  std::vector<std::string> freeze;  // globs of parameter names trained frozen (requires_grad false)
  std::string init = "deferred";  // deferred: blocks shard as they are built | eager
  std::string init_from;          // weights to start from: .safetensors/.pt file or checkpoint dir
  // Optimisation.
  int64_t steps = 100;
  int64_t global_batch = 8;
  int64_t seq_len = 64;
  int64_t grad_accum = 1;
  double lr = 1e-3;
  int64_t warmup_steps = 10;
  double clip_grad = 1.0;
  int64_t seed = 1234;
  // Runtime (threads: launch.threads).
  double timeout = 300;
  std::string heap = "retain";  // fsdp::HeapPolicy: retain | unchanged
  // Checkpoints (fsdp/checkpoint.h).
  std::string checkpoint_dir;   // empty: no checkpoints
  int64_t checkpoint_every = 0; // steps between sharded checkpoints; 0 = only at the end
  bool resume = false;          // continue from the latest complete checkpoint in checkpoint_dir
  int64_t keep_last = 0;        // sharded checkpoints kept in checkpoint_dir; 0 = all
  std::string export_full;      // FILE.pt or FILE.safetensors written at the end
  // Sampling from the trained model.
  int64_t sample = 0;           // bytes to sample at the end; 0 = none
  std::string prompt = "The ";
  double temperature = 0.8;
  // Output.
  std::string metrics;
  std::string plot;
  bool dry_run = false;
  bool plan = false;  // --plan: the planner's table for this model on this machine (fsdp-plan)
  bool json = false;
  bool quiet = false;
};

// Declares every flag of `o` on `app`, with its current value as the default shown by --help.
void add_flags(CLI::App& app, TrainOptions& o);

// Where the training text comes from.
struct DataSource {
  std::vector<std::string> files;  // concatenated in this order
  int64_t bytes = 0;
  std::string label;  // for people: the --data path, or "default corpus (...)"
};

// The default corpus: license texts every Debian system has (package base-files, Essential),
// chosen among those that are byte-identical in Debian 12 and 13 and concatenated in a fixed
// order, so every machine trains on the same bytes.
extern const char* const kCorpusDir;
const std::vector<std::string>& default_corpus_files();

// The flags, validated and resolved for a world of `world_size` ranks with `local_world_size`
// per node.
struct TrainPlan {
  ModelPreset preset;
  fsdp::FSDPStrategy strategy;  // sharding strategy, mesh, precision, prefetch, grad_sync, timeout
  fsdp::ShardingPlan sharding;  // strategy resolved against the world
  int64_t world_size = 1;
  int64_t local_world_size = 1;
  int64_t per_rank_batch = 1;  // sequences per rank per optimizer step: global_batch / world
  int64_t micro_batch = 1;     // sequences per rank per micro-step: per_rank_batch / grad_accum
  bool bf16 = false;
  fsdp::HeapPolicy heap = fsdp::HeapPolicy::kRetain;
  bool deferred_init = true;  // --init deferred
  DataSource data;
};

// Throws fsdp::Error with one line naming the flag, its value, the rule and a fix, for the first
// invalid flag. Reads only file metadata; starts nothing.
TrainPlan check_options(const TrainOptions& o, int64_t world_size, int64_t local_world_size);

// The concatenated bytes of `data`. Throws fsdp::Error if a file cannot be read.
std::string read_corpus(const DataSource& data);

}  // namespace fsdp_train
