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
#include "token_data.h"

namespace CLI {
class App;
}

namespace fsdp_train {

// A GPT shape. Parameters: about 12 d^2 per block plus (vocab + context) d embeddings, and for
// the byte models a vocab x d head (GPT-2 ties it to the token embedding).
struct ModelPreset {
  std::string name;
  int64_t d_model = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t context = 0;  // position embeddings: the longest --seq-len
  double dropout = 0;   // --dropout: probability on each block's attention and MLP outputs
  int64_t vocab = 256;         // token ids 0 .. vocab-1 (logits and loss cover these)
  int64_t padded_vocab = 256;  // rows of the token embedding (GPT-2: 50304, rows >= vocab zero)
  bool gpt2 = false;           // GPT-2's architecture (gpt2.h) rather than the byte GPT (gpt.h)
};
// tiny (~0.1 M parameters, for tests), small (~3.4 M, the demo), medium (~25 M, benchmarks):
// byte GPTs; gpt2: GPT-2 124M exactly as GPT-2 and llm.c build it.
const std::vector<ModelPreset>& model_presets();

// Byte-level vocabulary: every byte value is a token.
constexpr int64_t kVocab = 256;
// GPT-2's vocabulary, and llm.c's padding of it to a multiple of 128.
constexpr int64_t kGpt2Vocab = 50257, kGpt2PaddedVocab = 50304;

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
  bool debug_collectives = false;  // FSDPStrategy::debug_collectives (NOTE [collective check])
  // Model and data.
  std::string model = "small";
  // Explicit shape, overriding the preset's or an llm.c --init-from file's (0 = theirs): any
  // size can be asked for. context: position embeddings, the longest --seq-len.
  int64_t layers = 0, d_model = 0, heads = 0, context = 0;
  std::string data;  // file or glob; empty: the default corpus
  std::string data_format = "auto";  // auto | bytes | nanogpt | llmc (token_data.h)
  std::string data_order = "random";  // random | sequential (llm.c's loader): batches.h
  std::string val_data;              // file or glob; empty: no validation
  int64_t eval_every = 0;            // steps between validations (also step 0 and the end)
  int64_t eval_batches = 5;          // K windows of global-batch x seq-len + 1 tokens
  double dropout = 0;
  std::vector<std::string> freeze;  // globs of parameter names trained frozen (requires_grad false)
  std::string init = "deferred";  // deferred: blocks shard as they are built | eager
  std::string init_from;  // weights to start from: llm.c model.bin, .safetensors/.pt, checkpoint dir,
                          // PyTorch distributed checkpoint (DCP) directory
  bool init_from_optimizer = false;    // DCP --init-from: AdamW's state too; the step continues
  std::vector<std::string> dcp_rename;  // REGEX=REPLACEMENT rules for DCP names (fsdp/dcp.h)
  std::string dcp_names = "auto";      // auto | nanogpt | none: built-in DCP names (dcp.h here)
  // Optimisation.
  int64_t steps = 100;
  int64_t global_batch = 8;
  int64_t seq_len = 64;
  int64_t grad_accum = 1;
  double lr = 1e-3;
  int64_t warmup_steps = 10;
  double clip_grad = 1.0;
  std::string lr_schedule = "cosine";  // cosine | constant (after warm-up)
  double beta1 = 0.9, beta2 = 0.95, adam_eps = 1e-8, weight_decay = 0.01;  // AdamW
  int64_t seed = 1234;
  // Runtime (threads: launch.threads).
  double timeout = 300;
  std::string heap = "retain";  // fsdp::HeapPolicy: retain | unchanged
  // Checkpoints (fsdp/checkpoint.h).
  std::string checkpoint_dir;   // empty: no checkpoints
  int64_t checkpoint_every = 0; // steps between sharded checkpoints; 0 = only at the end
  bool resume = false;          // continue from the newest checkpoint in checkpoint_dir
  bool resume_fallback = false; // --resume skips invalid newest entries (naming each) instead of failing
  std::string check_checkpoint; // verify this checkpoint (or directory of them) and exit
  // Preemption (NOTE [preemption] in preempt.h): with checkpoint_dir, these signals make every
  // rank finish its step, save and exit 128 + signal; "none" keeps their default action.
  std::string save_on_signal = "TERM,INT,USR1";
  bool requeue = false;             // after that save, rank 0 runs scontrol requeue $SLURM_JOB_ID
  double signal_save_timeout = 120; // seconds the save may take before the rank exits anyway
  int64_t keep_last = 0;        // sharded checkpoints kept in checkpoint_dir; 0 = all
  bool checkpoint_async = false; // periodic saves written in the background (fsdp::AsyncCheckpointer)
  std::string export_full;      // FILE.pt or FILE.safetensors written at the end
  std::string export_llmc;      // llm.c model.bin written at the end (--model gpt2)
  std::string export_dcp;       // DIR: a PyTorch distributed checkpoint written at the end
  std::string export_logits;    // FILE.npy: the logits of the first window at the end
  // Sampling from the trained model.
  int64_t sample = 0;           // bytes to sample at the end; 0 = none
  std::string prompt = "The ";
  double temperature = 0.8;
  // Output.
  std::string metrics;
  std::string plot;
  std::string trace;               // --trace FILE.json: the timeline of --trace-steps (fsdp/trace.h)
  std::string trace_steps = "3:5"; // first:last, 1-based and inclusive (TrainPlan: parsed)
  bool dry_run = false;
  bool plan = false;  // --plan: the planner's table for this model on this machine (fsdp-plan)
  bool json = false;
  bool quiet = false;
};

// Declares every flag of `o` on `app`, with its current value as the default shown by --help.
void add_flags(CLI::App& app, TrainOptions& o);

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
  int64_t trace_first = 3, trace_last = 5;  // --trace-steps
  fsdp::HeapPolicy heap = fsdp::HeapPolicy::kRetain;
  bool deferred_init = true;  // --init deferred
  DataSource data;
  DataSource val;  // empty files: no --val-data
  std::vector<int> save_signals;  // --save-on-signal, resolved; empty without --checkpoint-dir
};

// --init-from: whether `path` is read as an llm.c model file (anything but a directory, a
// .safetensors or a .pt file, which are fsdp checkpoints).
bool init_from_llmc_file(const std::string& path);

// Creates the missing directories the output flags need (--checkpoint-dir, and the directories
// of --metrics, --plot, --export-full, --export-llmc), which check_options found creatable. Call
// after check_options, before any rank starts. Throws fsdp::Error naming the flag.
void create_output_dirs(const TrainOptions& o);

// Throws fsdp::Error with one line naming the flag, its value, the rule and a fix, for the first
// invalid flag. Reads only file metadata; creates and starts nothing.
TrainPlan check_options(const TrainOptions& o, int64_t world_size, int64_t local_world_size);

}  // namespace fsdp_train
