// fsdp-train's flag table and validation (see options.h).
#include "options.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <fstream>
#include <sstream>

#include "fsdp/error.h"
#include "fsdp/report.h"
#include "llmc.h"
#include "plot.h"
#include "preempt.h"

namespace fsdp_train {

using fsdp::detail::cat;

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = {
      {"tiny", 64, 2, 4, 64},
      {"small", 256, 4, 4, 256},
      {"medium", 512, 8, 8, 512},
      {"gpt2", 768, 12, 12, 1024, 0, kGpt2Vocab, kGpt2PaddedVocab, true},
  };
  return presets;
}

const char* const kCorpusDir = "/usr/share/common-licenses";

namespace {
// More intra-op threads than this per rank is a typo, not a machine.
constexpr int64_t kMaxThreads = 4096;
}  // namespace

const std::vector<std::string>& default_corpus_files() {
  // Checked byte-identical in Debian 12 (bookworm) and 13 (trixie); GPL-2, LGPL-2.1 and others
  // changed between them (the FSF's address), so they are left out. About 125 KiB in all.
  static const std::vector<std::string> files = {
      "Apache-2.0", "BSD", "CC0-1.0", "GFDL-1.3", "GPL-3", "LGPL-3", "MPL-1.1", "MPL-2.0",
  };
  return files;
}

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

std::string preset_names() {
  std::string s;
  const auto& p = model_presets();
  for (size_t i = 0; i < p.size(); ++i) {
    s += (i == 0 ? "" : i + 1 == p.size() ? " or " : ", ") + p[i].name;
  }
  return s;
}

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

// The directory part of `path` ("." for a bare name).
std::string parent_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// An output file must be creatable: its directory exists and is writable, and it is no directory.
void check_output_path(const char* flag, const std::string& path) {
  FSDP_CHECK(!path.empty(), flag, " is empty; give a file name");
  struct stat st {};
  FSDP_CHECK(!(::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)), flag, " '", path,
             "' is a directory; give a file name");
  const std::string dir = parent_of(path);
  FSDP_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), flag, " '", path,
             "': directory '", dir, "' does not exist; create it first");
  FSDP_CHECK(::access(dir.c_str(), W_OK) == 0, flag, " '", path, "': directory '", dir,
             "' is not writable; choose another place");
  // access() says yes to root everywhere (even in /proc): open the file for writing as the run
  // will, without truncating one that exists, and remove it again if this check created it.
  // Ranks of one node check the same path at once, hence EEXIST/ENOENT retries.
  int err = 0;
  for (int attempt = 0; attempt < 5; ++attempt) {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::close(fd);
      ::unlink(path.c_str());
      return;
    }
    err = errno;
    if (err != EEXIST) break;
    fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
      ::close(fd);
      return;
    }
    err = errno;
    if (err != ENOENT) break;
  }
  throw fsdp::Error(cat(flag, " '", path, "' cannot be written (", std::strerror(err),
                        "); choose another place"));
}

// The checkpoint directory exists and is writable, or can be created (its parent is writable).
void check_checkpoint_dir(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0) {
    FSDP_CHECK(S_ISDIR(st.st_mode), "--checkpoint-dir '", dir,
               "' is not a directory; give a directory (it is created if missing)");
    FSDP_CHECK(::access(dir.c_str(), W_OK | X_OK) == 0, "--checkpoint-dir '", dir,
               "' is not writable; choose another place");
    return;
  }
  const std::string parent = parent_of(dir);
  FSDP_CHECK(::stat(parent.c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
                 ::access(parent.c_str(), W_OK | X_OK) == 0,
             "--checkpoint-dir '", dir, "' does not exist and cannot be created in '", parent,
             "'; create it first");
}

}  // namespace

bool init_from_llmc_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return false;
  auto ends = [&](const std::string& ext) {
    return path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
  };
  return !ends(".safetensors") && !ends(".pt");
}

namespace {

// --init-from: a readable .safetensors / .pt file, or a sharded checkpoint directory (one with a
// meta.json). What is inside is checked when it loads, on every rank.
void check_init_from(const std::string& path) {
  struct stat st {};
  FSDP_CHECK(::stat(path.c_str(), &st) == 0, "--init-from '", path, "' cannot be read (",
             std::strerror(errno), "); give a .safetensors or .pt file or a checkpoint directory");
  if (S_ISDIR(st.st_mode)) {
    const std::string meta = path + "/meta.json";
    FSDP_CHECK(::access(meta.c_str(), R_OK) == 0, "--init-from '", path, "' is a directory "
               "without a readable meta.json, so not a sharded checkpoint; give a checkpoint "
               "directory (e.g. DIR/step-00000100) or a .safetensors/.pt file");
    return;
  }
  auto ends = [&](const std::string& ext) {
    return path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
  };
  FSDP_CHECK(S_ISREG(st.st_mode) && (ends(".safetensors") || ends(".pt")), "--init-from '", path,
             "' is neither a .safetensors nor a .pt file nor a checkpoint directory; export one "
             "with --export-full");
  FSDP_CHECK(::access(path.c_str(), R_OK) == 0, "--init-from '", path, "' cannot be read (",
             std::strerror(errno), "); check its permissions");
}

// --data (or the default corpus) and --val-data, inspected and checked against the model: every
// file read once here, before anything starts (NOTE [token files] in token_data.h).
void resolve_data(const TrainOptions& o, TrainPlan& p) {
  const DataFormat format = parse_data_format("--data-format", o.data_format);
  const int64_t need = o.seq_len + 1;  // one sequence and its shifted targets
  const std::string one_window = cat("tokens one sequence needs (--seq-len ", o.seq_len, " + 1)");
  if (!o.data.empty()) {
    p.data = inspect_data("--data", o.data, format);
  } else {
    FSDP_CHECK(format == DataFormat::kAuto || format == DataFormat::kBytes, "--data-format ",
               o.data_format, " needs --data FILE; the default corpus is text (bytes)");
    std::vector<std::string> paths;
    for (const auto& name : default_corpus_files()) {
      const std::string path = cat(kCorpusDir, "/", name);
      struct stat st {};
      FSDP_CHECK(::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode),
                 "the default corpus needs ", path,
                 " (Debian package base-files), which is missing on this machine; pass --data "
                 "FILE with any text file");
      paths.push_back(path);
    }
    p.data = inspect_text_files(
        paths, cat("default corpus, ", paths.size(), " license texts in ", kCorpusDir));
  }
  if (o.data_order == "sequential") {
    check_data_fits("--data", p.data, o.global_batch * o.seq_len + 1,
                    cat("tokens one window of --data-order sequential needs (--global-batch ",
                        o.global_batch, " x --seq-len ", o.seq_len, " + 1)"),
                    p.preset.vocab, p.preset.name);
  } else {
    check_data_fits("--data", p.data, need, one_window, p.preset.vocab, p.preset.name);
  }
  if (!o.val_data.empty()) {
    p.val = inspect_data("--val-data", o.val_data, format);
    const int64_t window = o.global_batch * o.seq_len;
    check_data_fits("--val-data", p.val, o.eval_batches * window + 1,
                    cat("tokens --eval-batches ", o.eval_batches, " windows of --global-batch ",
                        o.global_batch, " x --seq-len ", o.seq_len, " (+1) need"),
                    p.preset.vocab, p.preset.name);
  }
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

// A batch that cannot fit would allocate until the machine swaps or the allocator gives up, in
// the ranks, long after starting: bound it here by a lower estimate of what one micro-step
// needs per rank against this node's memory shared by its ranks.
void check_batch_fits(const TrainOptions& o, const TrainPlan& p) {
  const double page = double(::sysconf(_SC_PAGESIZE)), pages = double(::sysconf(_SC_PHYS_PAGES));
  if (page <= 0 || pages <= 0) return;  // unknown: nothing to compare against
  const double per_rank = page * pages / double(p.local_world_size);
  const double tokens = double(p.micro_batch) * double(o.seq_len);
  const double T = double(o.seq_len), d = double(p.preset.d_model);
  // fp32 activations autograd keeps, at least: ~8 d per token and the attention probabilities
  // per block, logits and their gradient; plus every rank's int64 batch offsets (the sampler
  // draws the whole global batch).
  const double need = 4 * tokens * (8 * d) * double(p.preset.n_layers) +
                      4 * double(p.micro_batch) * double(p.preset.n_heads) * T * T *
                          double(p.preset.n_layers) +
                      4 * tokens * double(p.preset.vocab) * 2 + 8 * double(o.global_batch);
  FSDP_CHECK(need <= per_rank, "--global-batch ", o.global_batch, " needs at least ",
             fsdp::format_bytes(need), " per rank (", p.micro_batch, " sequences of ", o.seq_len,
             " bytes per micro-step, model ", p.preset.name, "), more than this node's ",
             fsdp::format_bytes(page * pages), " of memory shared by ", p.local_world_size,
             p.local_world_size == 1 ? " rank" : " ranks",
             "; use a smaller --global-batch, or a larger --grad-accum");
}

}  // namespace

void add_flags(CLI::App& app, TrainOptions& o) {
  // A flag given twice takes its last value, so a script can append overrides.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
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
                 "gpt2 of its shape), a full checkpoint (.safetensors read as this rank's byte "
                 "ranges, or .pt) or a sharded checkpoint directory, from any mesh; --resume "
                 "wins when it finds a checkpoint")
      ->type_name("PATH")
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
                 "unchanged: leave malloc's settings alone (README \"The CPU heap\")")
      ->group(runtime);

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
                 "CRC-32), print its step, strategy, mesh, tensors and bytes, and exit (1 if "
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
  app.add_option("--sample", o.sample,
                 "at the end, print N bytes sampled from the model (deterministic for --seed); "
                 "0 = none")
      ->type_name("N")
      ->group(ckpt);
  app.add_option("--prompt", o.prompt, "with --sample: the text the sample continues")->group(ckpt);
  app.add_option("--temperature", o.temperature,
                 "with --sample: softmax temperature; 0 = always the most likely byte")
      ->group(ckpt);

  const char* output = "Output";
  app.add_option("--metrics", o.metrics,
                 "write JSON Lines from rank 0, one object per optimizer step: step, loss (mean "
                 "over the global batch), lr, step_time_s (slowest rank), tokens_per_s (global "
                 "batch / step_time_s), and the largest over ranks of sharded_state_bytes, "
                 "peak_rss_bytes and comm_bytes {shard, replicate, world} (payload one rank "
                 "issued in the step)")
      ->type_name("FILE")
      ->group(output);
  app.add_option("--plot", o.plot, "draw the loss curve into this PNG at the end (needs gnuplot)")
      ->type_name("FILE.png")
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

  // Every option shows its default in --help, taken from TrainOptions above.
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_expected_min() > 0) opt->capture_default_str();
    // Integer options: CLI11's "INT", or "N" where a flag names its count.
    const std::string type = opt->get_type_name();
    if (type == "INT" || type == "N") opt->transform(decimal_int64());
  }
}

TrainPlan check_options(const TrainOptions& o, int64_t world_size, int64_t local_world_size) {
  TrainPlan p;
  p.world_size = world_size;
  p.local_world_size = local_world_size;

  bool found = false;
  for (const auto& m : model_presets()) {
    if (m.name == lower(o.model)) {
      p.preset = m;
      found = true;
    }
  }
  FSDP_CHECK(found, "--model '", o.model, "' is not a preset; use ", preset_names());
  // An explicit shape: the preset's context (the longest --seq-len) stays.
  constexpr int64_t kMaxLayers = 4096, kMaxWidth = 1 << 16;
  FSDP_CHECK(o.layers >= 0 && o.layers <= kMaxLayers, "--layers ", o.layers,
             " is invalid; use 1 to ", kMaxLayers, " (0 = the preset's)");
  FSDP_CHECK(o.d_model >= 0 && o.d_model <= kMaxWidth, "--d-model ", o.d_model,
             " is invalid; use 1 to ", kMaxWidth, " (0 = the preset's)");
  FSDP_CHECK(o.heads >= 0 && o.heads <= kMaxWidth, "--heads ", o.heads, " is invalid; use 1 to ",
             kMaxWidth, " (0 = the preset's)");
  if (o.layers || o.d_model || o.heads) {
    if (o.layers) p.preset.n_layers = o.layers;
    if (o.d_model) p.preset.d_model = o.d_model;
    if (o.heads) p.preset.n_heads = o.heads;
    FSDP_CHECK(p.preset.d_model % p.preset.n_heads == 0, "--heads ", p.preset.n_heads,
               " does not divide the width ", p.preset.d_model, "; use a divisor such as ",
               std::gcd(p.preset.d_model, int64_t{8}), " or set --d-model to a multiple of it");
    p.preset.name = cat(p.preset.name, " (d ", p.preset.d_model, ", ", p.preset.n_layers,
                        " blocks, ", p.preset.n_heads, " heads)");
  }
  FSDP_CHECK(o.steps >= 1, "--steps ", o.steps, " is invalid; use 1 or more");
  FSDP_CHECK(o.global_batch >= 1, "--global-batch ", o.global_batch, " is invalid; use 1 or more");
  FSDP_CHECK(o.seq_len >= 1 && o.seq_len <= p.preset.context, "--seq-len ", o.seq_len,
             " is outside 1..", p.preset.context, " (the context of --model ", p.preset.name,
             "); use a value in that range");
  FSDP_CHECK(o.grad_accum >= 1, "--grad-accum ", o.grad_accum, " is invalid; use 1 or more");
  FSDP_CHECK(std::isfinite(o.lr) && o.lr > 0, "--lr ", o.lr,
             " is invalid; use a positive learning rate such as 1e-3");
  FSDP_CHECK(o.warmup_steps >= 0, "--warmup-steps ", o.warmup_steps, " is invalid; use 0 or more");
  FSDP_CHECK(std::isfinite(o.clip_grad) && o.clip_grad >= 0, "--clip-grad ", o.clip_grad,
             " is invalid; use a positive norm, or 0 to turn clipping off");
  FSDP_CHECK(o.seed >= 0, "--seed ", o.seed, " is invalid; use 0 or more");
  FSDP_CHECK(o.launch.threads >= 0 && o.launch.threads <= kMaxThreads, "--threads ",
             o.launch.threads, " is invalid; use 1 to ", kMaxThreads, " (0 = auto)");
  // Timeouts count whole milliseconds.
  FSDP_CHECK(std::isfinite(o.timeout) && o.timeout >= 0.001 && o.timeout <= 7 * 24 * 3600,
             "--timeout ", o.timeout, " is invalid; use seconds in [0.001, 604800], e.g. 300");

  const std::string precision = lower(o.precision);
  FSDP_CHECK(precision == "fp32" || precision == "bf16-mixed", "--precision '", o.precision,
             "' is unknown; use fp32 or bf16-mixed");
  p.bf16 = precision == "bf16-mixed";
  FSDP_CHECK(std::isfinite(o.dropout) && o.dropout >= 0 && o.dropout < 1, "--dropout ", o.dropout,
             " is invalid; use a probability in [0, 1), e.g. 0.1");
  p.preset.dropout = o.dropout;
  for (const auto& g : o.freeze) {
    FSDP_CHECK(!g.empty(), "--freeze '' is empty; give a glob of parameter names, e.g. 'tok_emb.*'");
  }
  const std::string init = lower(o.init);
  FSDP_CHECK(init == "deferred" || init == "eager", "--init '", o.init,
             "' is unknown; use deferred or eager");
  p.deferred_init = init == "deferred";
  try {
    p.heap = fsdp::parse_heap_policy(o.heap);
  } catch (const fsdp::Error& e) {
    throw fsdp::Error(cat("--heap: ", e.what()));
  }
  const std::string prefetch = lower(o.prefetch);
  FSDP_CHECK(prefetch == "on" || prefetch == "off", "--prefetch '", o.prefetch,
             "' is unknown; use on or off");

  // The library's parsers name the value and list the choices; prefix the flag.
  auto flag_error = [](const char* flag, const std::exception& e) {
    return fsdp::Error(cat(flag, ": ", e.what()));
  };
  try {
    p.strategy.sharding_strategy(o.strategy);
  } catch (const fsdp::Error& e) {
    throw flag_error("--strategy", e);
  }
  try {
    p.strategy.grad_sync(fsdp::parse_grad_sync(o.grad_sync));
  } catch (const fsdp::Error& e) {
    throw flag_error("--grad-sync", e);
  }
  if (!o.mesh.empty()) {
    try {
      p.strategy.device_mesh(fsdp::parse_mesh_shape(o.mesh));
    } catch (const fsdp::Error& e) {
      throw flag_error("--mesh", e);
    }
  }
  if (p.bf16) p.strategy.mixed_precision(fsdp::MixedPrecision::bf16());
  p.strategy.forward_prefetch(prefetch == "on").backward_prefetch(prefetch == "on");
  if (o.activation_checkpointing) {
    p.strategy.activation_checkpointing(fsdp::CheckpointPolicy::all_units());  // the blocks
  }
  p.strategy.debug_collectives(o.debug_collectives);
  p.strategy.timeout(std::chrono::milliseconds(static_cast<int64_t>(o.timeout * 1000)));
  try {
    p.sharding = fsdp::plan_sharding(p.strategy, world_size, local_world_size);
  } catch (const fsdp::Error& e) {
    std::string flags = cat("--strategy ", o.strategy);
    if (!o.mesh.empty()) flags += cat(" --mesh ", o.mesh);
    if (p.strategy.grad_sync() != fsdp::GradSync::kEveryMicroStep) {
      flags += cat(" --grad-sync ", o.grad_sync);
    }
    throw fsdp::Error(cat(flags, " on world size ", world_size, ": ", e.what()));
  }

  FSDP_CHECK(o.global_batch % world_size == 0, "--global-batch ", o.global_batch,
             " does not split evenly over world size ", world_size, "; use a multiple of ",
             world_size, ", e.g. ", (o.global_batch / world_size + 1) * world_size);
  p.per_rank_batch = o.global_batch / world_size;
  FSDP_CHECK(p.per_rank_batch % o.grad_accum == 0, "--global-batch ", o.global_batch, " gives ",
             p.per_rank_batch, " sequences per rank (world size ", world_size,
             "), which --grad-accum ", o.grad_accum,
             " does not divide; use a --grad-accum that "
             "divides ",
             p.per_rank_batch, " or a --global-batch that is a multiple of ",
             world_size * o.grad_accum);
  p.micro_batch = p.per_rank_batch / o.grad_accum;
  check_batch_fits(o, p);

  FSDP_CHECK(!o.json || o.dry_run || o.plan,
             "--json only applies to --dry-run and --plan; add one or drop --json");
  FSDP_CHECK(!(o.dry_run && o.plan), "--dry-run and --plan each print a report; give one");
  if (!o.metrics.empty()) check_output_path("--metrics", o.metrics);
  if (!o.plot.empty()) {
    check_output_path("--plot", o.plot);
    const std::string ext = ".png";
    FSDP_CHECK(
        o.plot.size() > ext.size() && lower(o.plot.substr(o.plot.size() - ext.size())) == ext,
        "--plot '", o.plot, "' is not a .png file name; plots are PNG, e.g. --plot loss.png");
    FSDP_CHECK(!fsdp_plot::find_gnuplot().empty(),
               "--plot needs gnuplot, which is not in PATH; install it "
               "(apt-get install gnuplot-nox, or make setup) or drop --plot");
  }
  FSDP_CHECK(o.checkpoint_every >= 0, "--checkpoint-every ", o.checkpoint_every,
             " is invalid; use 0 (only at the end) or more");
  FSDP_CHECK(o.keep_last >= 0, "--keep-last ", o.keep_last, " is invalid; use 0 (keep all) or more");
  FSDP_CHECK(!o.resume_fallback || o.resume, "--resume-fallback only applies to --resume; add "
             "--resume or drop --resume-fallback");
  const bool needs_dir = o.resume || o.checkpoint_every > 0 || o.keep_last > 0;
  FSDP_CHECK(!needs_dir || !o.checkpoint_dir.empty(),
             o.resume ? "--resume" : o.checkpoint_every > 0 ? "--checkpoint-every" : "--keep-last",
             " needs --checkpoint-dir DIR; add it");
  FSDP_CHECK(!o.checkpoint_async || o.checkpoint_every > 0, "--checkpoint-async applies to the "
             "--checkpoint-every saves; add --checkpoint-every N or drop --checkpoint-async");
  if (!o.checkpoint_dir.empty()) check_checkpoint_dir(o.checkpoint_dir);
  const std::vector<int> signals = parse_signal_list(o.save_on_signal);
  if (!o.checkpoint_dir.empty()) p.save_signals = signals;
  FSDP_CHECK(std::isfinite(o.signal_save_timeout) && o.signal_save_timeout >= 1 &&
                 o.signal_save_timeout <= 86400,
             "--signal-save-timeout ", o.signal_save_timeout, " is invalid; use seconds in [1, "
             "86400], e.g. 120");
  FSDP_CHECK(!o.requeue || !p.save_signals.empty(), "--requeue requeues after a save on a "
             "signal, which needs --checkpoint-dir DIR and --save-on-signal other than none; "
             "add them or drop --requeue");
  if (!o.export_full.empty()) {
    check_output_path("--export-full", o.export_full);
    const std::string e = lower(o.export_full);
    auto ends = [&](const std::string& x) {
      return e.size() > x.size() && e.compare(e.size() - x.size(), x.size(), x) == 0;
    };
    FSDP_CHECK(ends(".pt") || ends(".safetensors"), "--export-full '", o.export_full,
               "' must end in .pt (torch.load) or .safetensors; e.g. --export-full model.pt");
  }
  FSDP_CHECK(o.sample >= 0 && o.sample <= 1000000, "--sample ", o.sample,
             " is invalid; use 0 (none) to 1000000 bytes");
  FSDP_CHECK(std::isfinite(o.temperature) && o.temperature >= 0 && o.temperature <= 100,
             "--temperature ", o.temperature, " is invalid; use 0 (greedy) to 100, e.g. 0.8");
  FSDP_CHECK(o.sample == 0 || !o.prompt.empty(), "--prompt is empty; give at least one byte");
  FSDP_CHECK(o.eval_every >= 0, "--eval-every ", o.eval_every,
             " is invalid; use 0 (step 0 and the end only) or more");
  FSDP_CHECK(o.eval_batches >= 1, "--eval-batches ", o.eval_batches, " is invalid; use 1 or more");
  FSDP_CHECK(o.eval_every == 0 || !o.val_data.empty(), "--eval-every ",
             o.eval_every, " needs --val-data FILE; add it");
  FSDP_CHECK(o.data_order == "random" || o.data_order == "sequential", "--data-order '",
             o.data_order, "' is unknown; use random or sequential");
  FSDP_CHECK(o.lr_schedule == "cosine" || o.lr_schedule == "constant", "--lr-schedule '",
             o.lr_schedule, "' is unknown; use cosine or constant");
  FSDP_CHECK(std::isfinite(o.beta1) && o.beta1 >= 0 && o.beta1 < 1, "--beta1 ", o.beta1,
             " is invalid; use a value in [0, 1), e.g. 0.9");
  FSDP_CHECK(std::isfinite(o.beta2) && o.beta2 >= 0 && o.beta2 < 1, "--beta2 ", o.beta2,
             " is invalid; use a value in [0, 1), e.g. 0.999");
  FSDP_CHECK(std::isfinite(o.adam_eps) && o.adam_eps > 0, "--adam-eps ", o.adam_eps,
             " is invalid; use a small positive value, e.g. 1e-8");
  FSDP_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0, "--weight-decay ",
             o.weight_decay, " is invalid; use 0 or more");
  const bool token_data = lower(o.data_format) == "llmc" || lower(o.data_format) == "nanogpt";
  if (!o.init_from.empty() && init_from_llmc_file(o.init_from)) {
    FSDP_CHECK(p.preset.gpt2, "--init-from reads llm.c's GPT-2 model files; add --model gpt2 "
               "(with the file's --layers, --d-model and --heads)");
    check_llmc_model_file("--init-from", o.init_from, p.preset);
  } else if (!o.init_from.empty()) {
    check_init_from(o.init_from);
  }
  if (!o.export_llmc.empty()) {
    FSDP_CHECK(p.preset.gpt2, "--export-llmc writes llm.c's GPT-2 model file; add --model gpt2");
    check_output_path("--export-llmc", o.export_llmc);
  }
  resolve_data(o, p);
  FSDP_CHECK(o.sample == 0 || (!token_data && p.data.format == DataFormat::kBytes), "--sample "
             "prints bytes, but --data '", p.data.label, "' holds tokens; drop --sample");
  return p;
}

}  // namespace fsdp_train
