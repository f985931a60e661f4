// fsdp-train's flag table: every flag with its help text and default (add_flags, see options.h;
// check_options in options.cpp validates what the user gave).
#include <CLI/CLI.hpp>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "fsdp/error.h"
#include "fsdp/report.h"
#include "llmc.h"
#include "options.h"
#include "plot.h"
#include "preempt.h"

namespace fsdp_train {

using fsdp::cat;

namespace {

std::string preset_help() {
  std::string s = "model preset: ";
  const auto& p = model_presets();
  for (size_t i = 0; i < p.size(); ++i) {
    s += cat(i ? "; " : "", p[i].name, " (d ", p[i].d_model, ", ", p[i].n_layers, " blocks, ",
             p[i].n_heads, " heads, context ", p[i].context,
             p[i].gpt2 ? cat(", GPT-2: vocabulary ", p[i].vocab, " padded to ", p[i].padded_vocab,
                             ", tied head")
                       : std::string(", bytes"),
             ")");
  }
  return s;
}

// CLI11 2.1 converts integers with strtoll, which clamps what does not fit to INT64_MAX
// silently, and reads "010" as octal and "0x10" as hex: integer flags take decimals that fit,
// or fail echoing what was typed.
const CLI::Validator& decimal_int64() {
  static const CLI::Validator v(
      [](std::string& text) -> std::string {
        size_t i = text.size() > 0 && (text[0] == '-' || text[0] == '+') ? 1 : 0;
        bool digits = i < text.size();
        for (size_t k = i; k < text.size(); ++k) {
          digits = digits && std::isdigit(static_cast<unsigned char>(text[k]));
        }
        if (!digits) return cat("'", text, "' is not a whole number");
        errno = 0;
        (void)std::strtoll(text.c_str(), nullptr, 10);
        if (errno == ERANGE) {
          return cat(text, " is out of range; use a value in ",
                     std::numeric_limits<int64_t>::min(), "..",
                     std::numeric_limits<int64_t>::max());
        }
        // CLI11 reads a leading 0 as octal: pass the digits on without it.
        const size_t first = text.find_first_not_of('0', i);
        text = text.substr(0, i) + (first == std::string::npos ? "0" : text.substr(first));
        return std::string();
      },
      "", "decimal integer");
  return v;
}

// --help's "Launch" group: where the ranks run and how the job is started.
void add_launch_flags(CLI::App& app, TrainOptions& o) {
  const char* launch = "Launch";
  app.add_option("--devices", o.launch.nproc_per_node, "ranks (processes) to start on this node")->group(launch);
  app.add_option("--num-nodes", o.launch.num_nodes, "nodes in the job; world size = devices x num-nodes")
      ->group(launch);
  app.add_option("--node-rank", o.launch.node_rank, "this node's index, 0 .. num-nodes-1")->group(launch);
  app.add_option("--master-addr", o.launch.master_addr, "host of rank 0's rendezvous store (node 0)")
      ->group(launch);
  app.add_option("--master-port", o.launch.master_port,
                 "port of rank 0's rendezvous store; 0 = pick a free one (single node only)")
      ->group(launch);
  app.add_option("--max-restarts", o.launch.max_restarts,
                 "with --devices: when a rank fails, restart every rank up to N times")
      ->group(launch);
}

// --help's "Sharding" group: strategy, mesh, precision and the engine's switches.
void add_sharding_flags(CLI::App& app, TrainOptions& o) {
  const char* sharding = "Sharding";
  app.add_option("--strategy", o.strategy,
                 "full_shard | shard_grad_op | no_shard | hybrid_shard | hybrid_shard_zero2 "
                 "(any case)")
      ->group(sharding);
  app.add_option("--mesh", o.mesh,
                 "device mesh (replicate R, shard S), e.g. 2,4 or -1,4; empty = the strategy's "
                 "default (hybrid: shard inside each node, replicate across nodes)")
      ->type_name("R,S")
      ->group(sharding);
  app.add_option("--precision", o.precision,
                 "fp32 | bf16-mixed (bf16 compute and gradient reduction, fp32 master weights "
                 "and optimizer state)")
      ->group(sharding);
  app.add_option("--grad-sync", o.grad_sync,
                 "gradient communication on micro-steps 1..K-1 of --grad-accum K: every | local "
                 "(none until the last) | replicate_on_last (hybrid: skip the replica all-reduce)")
      ->group(sharding);
  app.add_option("--prefetch", o.prefetch,
                 "on | off: all-gather the next unit's parameters while this one computes")
      ->group(sharding);
  app.add_flag("--activation-checkpointing", o.activation_checkpointing,
               "every block keeps only its input in forward and recomputes its forward in "
               "backward: less activation memory for one more forward per step")
      ->group(sharding);
  app.add_flag("--debug-collectives", o.debug_collectives,
               "before each collective, compare (number, operation, unit, size) across the group "
               "through the rendezvous store; ranks that differ fail naming the first rank and "
               "unit that differ, instead of hanging or exchanging the wrong data (slower)")
      ->group(sharding);
}

// --help's "Model and data" group: the GPT's shape and initialisation, the training and
// validation data.
void add_model_data_flags(CLI::App& app, TrainOptions& o) {
  const char* model = "Model and data";
  app.add_option("--model", o.model, preset_help())->group(model);
  app.add_option("--layers", o.layers, "blocks, overriding the preset's; 0 = the preset's")
      ->group(model);
  app.add_option("--d-model", o.d_model, "model width, overriding the preset's; 0 = the preset's")
      ->group(model);
  app.add_option("--heads", o.heads,
                 "attention heads (must divide the width), overriding the preset's; 0 = the "
                 "preset's")
      ->group(model);
  app.add_option("--context", o.context,
                 "position embeddings, the longest --seq-len, overriding the preset's; 0 = the "
                 "preset's (with an llm.c --init-from file every 0 here and in --layers, "
                 "--d-model, --heads takes the file's value; one that differs is an error)")
      ->group(model);
  app.add_option("--dropout", o.dropout,
                 "dropout probability on each block's attention and MLP outputs; 0 = none")
      ->group(model);
  app.add_option("--freeze", o.freeze,
                 "freeze the parameters whose names match this glob (e.g. 'tok_emb.*', "
                 "'block*.q.*'; repeatable): no gradient, reduction or optimizer state for them")
      ->type_name("GLOB")
      ->group(model);
  app.add_option("--init", o.init,
                 "deferred: each block keeps only this rank's shard as it is built, so no rank "
                 "holds the whole model (fsdp::DeferredInit) | eager: build it whole, then shard; "
                 "both give the same values")
      ->group(model);
  app.add_option("--init-from", o.init_from,
                 "start from these weights (optimizer fresh): an llm.c model file (--model "
                 "gpt2, whose shape it gives), a full checkpoint (.safetensors read as this rank's byte "
                 "ranges, or .pt), a sharded checkpoint directory, or a PyTorch distributed "
                 "checkpoint (DCP) directory (one with a .metadata; docs/dcp.md), from any mesh; "
                 "--resume wins when it finds a checkpoint")
      ->type_name("PATH")
      ->group(model);
  app.add_flag("--init-from-optimizer", o.init_from_optimizer,
               "with a DCP --init-from: AdamW's state too (exp_avg, exp_avg_sq, step; betas, "
               "eps and weight decay must equal this run's); training continues at the "
               "checkpoint's step (data position and schedule), --steps counts the total")
      ->group(model);
  app.add_option("--dcp-rename", o.dcp_rename,
                 "a rule 'REGEX=REPLACEMENT' for DCP names (repeatable, applied in order): "
                 "checkpoint -> model names for --init-from, model -> checkpoint names for "
                 "--export-dcp; a name mapped to nothing is skipped")
      ->type_name("RULE")
      ->group(model);
  app.add_option("--dcp-names", o.dcp_names,
                 "built-in DCP names: auto (--model gpt2: nanoGPT's, transformer.h.N.attn.c_attn "
                 "and a tied lm_head.weight; others: the model's own), nanogpt, none")
      ->type_name("NAMES")
      ->group(model);
  app.add_option("--data", o.data,
                 cat("training data: a file or a glob of shards (quote it), llm.c or nanoGPT "
                     "uint16 token files or text read as bytes (--data-format); empty = the "
                     "default corpus, license texts from ",
                     kCorpusDir))
      ->type_name("FILE")
      ->group(model);
  app.add_option("--data-format", o.data_format,
                 "auto (llm.c token files by their header, other files as bytes; a .bin without "
                 "the header is refused) | llmc | nanogpt (raw uint16 tokens) | bytes (text)")
      ->group(model);
  app.add_option("--data-order", o.data_order,
                 "random (every step draws global-batch windows at random offsets, from --seed) | "
                 "sequential (llm.c's loader: step s reads the s-th run of global-batch x seq-len "
                 "+ 1 tokens, wrapping around)")
      ->group(model);
  app.add_option("--val-data", o.val_data,
                 "validation tokens, same format as --data: the mean loss over the first "
                 "--eval-batches windows of global-batch x seq-len + 1 tokens (llm.c's "
                 "convention) at step 0, every --eval-every steps and at the end")
      ->type_name("FILE")
      ->group(model);
  app.add_option("--eval-every", o.eval_every,
                 "with --val-data: steps between validations; 0 = only at step 0 and the end")
      ->group(model);
  app.add_option("--eval-batches", o.eval_batches,
                 "with --val-data: windows of global-batch x seq-len + 1 tokens per validation")
      ->group(model);
}

// --help's "Optimisation" group: steps, batch, learning rate and AdamW.
void add_optimisation_flags(CLI::App& app, TrainOptions& o) {
  const char* optim = "Optimisation";
  app.add_option("--steps", o.steps, "optimizer steps")->group(optim);
  app.add_option("--global-batch", o.global_batch,
                 "sequences per optimizer step over all ranks; the world size must divide it")
      ->group(optim);
  app.add_option("--seq-len", o.seq_len, "tokens (bytes) per sequence; at most the model's context")
      ->group(optim);
  app.add_option("--grad-accum", o.grad_accum,
                 "micro-steps per optimizer step (K); must divide the sequences per rank")
      ->group(optim);
  app.add_option("--lr", o.lr,
                 "peak learning rate of AdamW: linear warm-up, then cosine decay to 10% of it")
      ->group(optim);
  app.add_option("--warmup-steps", o.warmup_steps, "steps of linear learning-rate warm-up")
      ->group(optim);
  app.add_option("--clip-grad", o.clip_grad, "clip the global gradient L2 norm to this; 0 = off")
      ->group(optim);
  app.add_option("--lr-schedule", o.lr_schedule,
                 "cosine (decay to 10% of --lr at the last step) | constant (llm.c's), both after "
                 "--warmup-steps")
      ->group(optim);
  app.add_option("--beta1", o.beta1, "AdamW's beta1")->group(optim);
  app.add_option("--beta2", o.beta2, "AdamW's beta2 (llm.c: 0.999)")->group(optim);
  app.add_option("--adam-eps", o.adam_eps, "AdamW's epsilon")->group(optim);
  app.add_option("--weight-decay", o.weight_decay, "AdamW's decoupled weight decay (llm.c: 0)")
      ->group(optim);
  app.add_option("--seed", o.seed,
                 "seeds model init and batch sampling: the same seed gives the same batches and "
                 "loss curve on any mesh and strategy")
      ->group(optim);
}

// --help's "Runtime" group: threads, timeouts and the heap.
void add_runtime_flags(CLI::App& app, TrainOptions& o) {
  const char* runtime = "Runtime";
  app.add_option("--threads", o.launch.threads,
                 "intra-op threads per rank; 0 = OMP_NUM_THREADS if set, else cores / devices")
      ->group(runtime);
  app.add_option("--timeout", o.timeout,
                 "seconds a rank waits for its peers (rendezvous, collectives) before failing")
      ->group(runtime);
  app.add_option("--heap", o.heap,
                 "retain: glibc keeps freed memory for the next step (fastest; more peak RSS) | "
                 "lean: glibc returns freed memory (least peak RSS; page faults each step) | "
                 "unchanged: leave malloc's settings alone (docs/performance.md, \"The CPU heap\")")
      ->group(runtime);
}

// --help's "Checkpoints and sampling" group: saving, resuming, preemption, exports and --sample.
void add_checkpoint_flags(CLI::App& app, TrainOptions& o) {
  const char* ckpt = "Checkpoints and sampling";
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "write sharded checkpoints (model, AdamW state, step, data position, RNG) into "
                 "DIR/step-NNNNNNNN, each rank its own shard, atomically; empty = none")
      ->type_name("DIR")
      ->group(ckpt);
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "steps between checkpoints (and one at the end); 0 = only at the end")
      ->group(ckpt);
  app.add_flag("--resume", o.resume,
               "continue from the newest checkpoint in --checkpoint-dir (on any mesh, strategy "
               "or world size); fails on every rank, naming the file and the reason, if that "
               "checkpoint is damaged; starts fresh, saying so, only if there is none")
      ->group(ckpt);
  app.add_flag("--resume-fallback", o.resume_fallback,
               "with --resume: skip damaged newest checkpoints, printing each one and why, and "
               "resume from the newest valid one")
      ->group(ckpt);
  app.add_option("--check-checkpoint", o.check_checkpoint,
                 "verify a checkpoint (DIR/step-NNNNNNNN: meta.json, every file's size, every "
                 "checksum), print its step, strategy, mesh, tensors and bytes, and exit (1 if "
                 "invalid); given a --checkpoint-dir, every entry; starts no ranks")
      ->type_name("PATH")
      ->group(ckpt);
  app.add_flag("--checkpoint-async", o.checkpoint_async,
               "write the --checkpoint-every saves in the background: training stops only while "
               "each rank copies its part into a staging buffer (fsdp/async_checkpoint.h); the "
               "save at the end and on a signal stay synchronous")
      ->group(ckpt);
  app.add_option("--keep-last", o.keep_last,
                 "keep only the newest K checkpoints in --checkpoint-dir; 0 = keep all")
      ->group(ckpt);
  app.add_option("--save-on-signal", o.save_on_signal,
                 "with --checkpoint-dir: on the first of these signals every rank finishes its "
                 "step, saves a checkpoint and exits with 128 + the signal (143 TERM, 130 INT, "
                 "138 USR1); a second SIGINT stops at once; none = default actions")
      ->type_name("LIST")
      ->group(ckpt);
  app.add_flag("--requeue", o.requeue,
               "after a --save-on-signal save, rank 0 runs 'scontrol requeue $SLURM_JOB_ID'")
      ->group(ckpt);
  app.add_option("--signal-save-timeout", o.signal_save_timeout,
                 "seconds a --save-on-signal save may take, and then --requeue's scontrol; past "
                 "it the rank exits anyway, saying so")
      ->group(ckpt);
  app.add_option("--export-full", o.export_full,
                 "at the end, write the full (unsharded) weights to FILE.pt (torch.load reads "
                 "it) or FILE.safetensors, streamed one unit at a time")
      ->type_name("FILE")
      ->group(ckpt);
  app.add_option("--export-llmc", o.export_llmc,
                 "at the end, write the weights as an llm.c model file (fp32, version 3; --model "
                 "gpt2), which llm.c and --init-from read")
      ->type_name("FILE")
      ->group(ckpt);
  app.add_option("--export-dcp", o.export_dcp,
                 "at the end, write the model and AdamW's state as a PyTorch distributed "
                 "checkpoint in DIR (torch.distributed.checkpoint.load reads it on any mesh)")
      ->type_name("DIR")
      ->group(ckpt);
  app.add_option("--export-logits", o.export_logits,
                 "at the end, write the logits of the data's first window (--global-batch "
                 "sequences of --seq-len tokens at offsets b * seq-len) to FILE.npy, float32 "
                 "[batch, seq-len, vocab], to compare with another implementation")
      ->type_name("FILE")
      ->group(ckpt);
  app.add_option("--sample", o.sample,
                 "at the end, print N bytes sampled from the model (deterministic for --seed); "
                 "0 = none")
      ->type_name("N")
      ->group(ckpt);
  app.add_option("--prompt", o.prompt, "with --sample: the text the sample continues")->group(ckpt);
  app.add_option("--temperature", o.temperature,
                 "with --sample: softmax temperature; 0 = always the most likely byte")
      ->group(ckpt);
}

// --help's "Output" group: metrics, plots and the reports that start nothing.
void add_output_flags(CLI::App& app, TrainOptions& o) {
  const char* output = "Output";
  app.add_option("--metrics", o.metrics,
                 "write JSON Lines from rank 0, one object per optimizer step: step, loss (mean "
                 "over the global batch), lr, step_time_s (slowest rank), tokens_per_s (global "
                 "batch / step_time_s), and the largest over ranks of sharded_state_bytes, "
                 "peak_rss_bytes, minor_faults (page faults of the step: first touches of "
                 "fresh memory) and comm_bytes {shard, replicate, world} (payload one rank "
                 "issued in the step)")
      ->type_name("FILE")
      ->group(output);
  app.add_option("--plot", o.plot, "draw the loss curve into this PNG at the end (needs gnuplot)")
      ->type_name("FILE.png")
      ->group(output);
  app.add_option("--trace", o.trace,
                 "write a timeline of --trace-steps in Chrome's trace event format (Perfetto, "
                 "chrome://tracing, fsdp-plot --trace): every rank on rank 0's clock, each unit's "
                 "forward and backward, each collective, the waits on them (exposed "
                 "communication), optimizer, data, eval and checkpoints; rank 0 merges it at the "
                 "end (a failing run writes what each rank has)")
      ->type_name("FILE.json")
      ->group(output);
  app.add_option("--trace-steps", o.trace_steps,
                 "the steps --trace records, first:last (1-based, inclusive); the first steps "
                 "allocate, so the default skips them")
      ->type_name("A:B")
      ->capture_default_str()
      ->group(output);
  app.add_flag("--dry-run", o.dry_run,
               "print the topology report (mesh, groups, communication, memory per rank) and "
               "exit; starts no processes")
      ->group(output);
  app.add_flag("--plan", o.plan,
               "print fsdp-plan's predicted memory and step time of every strategy and mesh for "
               "this model on this machine, this run's choice marked, and exit")
      ->group(output);
  app.add_flag("--json", o.json, "with --dry-run or --plan: print one JSON object")
      ->group(output);
  app.add_flag("--quiet", o.quiet, "no progress output (banner and summary stay)")->group(output);
}

// Every option shows its default in --help, taken from TrainOptions; integer options take
// decimals only (decimal_int64).
void finish_flags(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_expected_min() > 0) opt->capture_default_str();
    // Integer options: CLI11's "INT", or "N" where a flag names its count.
    const std::string type = opt->get_type_name();
    if (type == "INT" || type == "N") opt->transform(decimal_int64());
  }
}

}  // namespace

void add_flags(CLI::App& app, TrainOptions& o) {
  // A flag given twice takes its last value, so a script can append overrides.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // The groups in --help's order: a group is listed where its first flag is declared.
  add_launch_flags(app, o);
  add_sharding_flags(app, o);
  add_model_data_flags(app, o);
  add_optimisation_flags(app, o);
  add_runtime_flags(app, o);
  add_checkpoint_flags(app, o);
  add_output_flags(app, o);
  finish_flags(app);
}

}  // namespace fsdp_train
