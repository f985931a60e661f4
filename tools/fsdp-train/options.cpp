// fsdp-train's flag validation: check_options turns the parsed flags into a TrainPlan or one
// line naming the value and the fix (see options.h; the flag table is in flags.cpp).
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
#include <filesystem>
#include <limits>
#include <numeric>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>

#include "fsdp/error.h"
#include "fsdp/parse_enum.h"
#include "fsdp/report.h"
#include "dcp.h"
#include "llmc.h"
#include "plot.h"
#include "preempt.h"

namespace fsdp_train {

using fsdp::cat;

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

const std::vector<std::string>& default_corpus_files() {
  // Checked byte-identical in Debian 12 (bookworm) and 13 (trixie); GPL-2, LGPL-2.1 and others
  // changed between them (the FSF's address), so they are left out. About 125 KiB in all.
  static const std::vector<std::string> files = {
      "Apache-2.0", "BSD", "CC0-1.0", "GFDL-1.3", "GPL-3", "LGPL-3", "MPL-1.1", "MPL-2.0",
  };
  return files;
}

namespace {

// More layers, width or intra-op threads per rank than these is a typo, not a machine.
constexpr int64_t kMaxLayers = 4096, kMaxWidth = 1 << 16, kMaxThreads = 4096;
constexpr int64_t kMaxContext = 1 << 20;

std::string preset_names() {
  std::string s;
  const auto& p = model_presets();
  for (size_t i = 0; i < p.size(); ++i) {
    s += (i == 0 ? "" : i + 1 == p.size() ? " or " : ", ") + p[i].name;
  }
  return s;
}

// The directory part of `path` ("." for a bare name).
std::string parent_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Why directory `dir` cannot be made, or "" if it exists or its missing parts can be created:
// the nearest existing ancestor must be a writable directory. access() says yes to root even in
// a read-only directory; a regular file in the way stops everyone.
std::string uncreatable_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  fs::path at = fs::path(dir).lexically_normal();
  struct stat st {};
  while (::stat(at.c_str(), &st) != 0) {  // up to the nearest existing ancestor
    if (!at.has_parent_path() || at.parent_path() == at) {
      at = ".";  // "a/b" when "a" is missing: made in the working directory
      break;
    }
    at = at.parent_path();
  }
  if (::stat(at.c_str(), &st) != 0) return cat("'", at.string(), "' cannot be read");
  if (!S_ISDIR(st.st_mode)) return cat("'", at.string(), "' is not a directory");
  if (::access(at.c_str(), W_OK | X_OK) != 0) return cat("'", at.string(), "' is not writable");
  return "";
}

// An output file must be creatable: it is no directory, and its directory exists and is
// writable or can be created (create_output_dirs makes it before any rank starts).
void check_output_path(const char* flag, const std::string& path) {
  FSDP_CHECK(!path.empty(), flag, " is empty; give a file name");
  struct stat st {};
  FSDP_CHECK(!(::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)), flag, " '", path,
             "' is a directory; give a file name");
  const std::string dir = parent_of(path);
  const std::string why = uncreatable_dir(dir);
  FSDP_CHECK(why.empty(), flag, " '", path, "': directory '", dir, "' cannot be created (", why,
             "); choose another place");
  if (::stat(dir.c_str(), &st) != 0) return;  // created later, so nothing to open yet
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

// The checkpoint directory exists and is writable, or can be created with its missing parents.
void check_checkpoint_dir(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) == 0) {
    FSDP_CHECK(S_ISDIR(st.st_mode), "--checkpoint-dir '", dir,
               "' is not a directory; give a directory (it is created if missing)");
    FSDP_CHECK(::access(dir.c_str(), W_OK | X_OK) == 0, "--checkpoint-dir '", dir,
               "' is not writable; choose another place");
    return;
  }
  const std::string why = uncreatable_dir(dir);
  FSDP_CHECK(why.empty(), "--checkpoint-dir '", dir, "' does not exist and cannot be created (",
             why, "); choose another place");
}

}  // namespace

void create_output_dirs(const TrainOptions& o) {
  std::vector<std::pair<const char*, std::string>> dirs;
  if (!o.checkpoint_dir.empty()) dirs.emplace_back("--checkpoint-dir", o.checkpoint_dir);
  for (const auto& [flag, file] : {std::pair<const char*, const std::string*>{"--metrics", &o.metrics},
                                   {"--plot", &o.plot}, {"--export-full", &o.export_full},
                                   {"--export-llmc", &o.export_llmc},
                                   {"--export-logits", &o.export_logits}}) {
    if (!file->empty()) dirs.emplace_back(flag, parent_of(*file));
  }
  for (const auto& [flag, dir] : dirs) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    FSDP_CHECK(!ec, flag, ": cannot create the directory '", dir, "' (", ec.message(),
               "); choose another place");
  }
}

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
    if (fsdp::is_dcp_checkpoint(path)) return;  // PyTorch's: checked as it loads (fsdp/dcp.h)
    const std::string meta = path + "/meta.json";
    FSDP_CHECK(::access(meta.c_str(), R_OK) == 0, "--init-from '", path, "' is a directory "
               "without a readable meta.json or .metadata, so neither a sharded checkpoint nor a "
               "PyTorch distributed checkpoint; give a checkpoint directory (e.g. "
               "DIR/step-00000100) or a .safetensors/.pt file");
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

// An integer flag's range: the check_options error is "<flag> <value> is invalid; use <fix>".
struct IntRange {
  const char* flag;
  std::function<int64_t(const TrainOptions&)> value;  // a member pointer or a getter
  int64_t min;
  std::optional<int64_t> max;  // nullopt: no upper bound
  std::string fix;
};

// Every integer flag with a fixed range, in the order they are checked (the first one out of
// range is the error). --seq-len is checked against the model's context in check_options.
const std::vector<IntRange>& int_ranges() {
  constexpr auto kNone = std::nullopt;
  static const std::vector<IntRange> ranges = {
      {"--layers", &TrainOptions::layers, 0, kMaxLayers,
       cat("1 to ", kMaxLayers, " (0 = the preset's)")},
      {"--d-model", &TrainOptions::d_model, 0, kMaxWidth,
       cat("1 to ", kMaxWidth, " (0 = the preset's)")},
      {"--heads", &TrainOptions::heads, 0, kMaxWidth,
       cat("1 to ", kMaxWidth, " (0 = the preset's)")},
      {"--context", &TrainOptions::context, 0, kMaxContext,
       cat("1 to ", kMaxContext, " (0 = the preset's)")},
      {"--steps", &TrainOptions::steps, 1, kNone, "1 or more"},
      {"--global-batch", &TrainOptions::global_batch, 1, kNone, "1 or more"},
      {"--grad-accum", &TrainOptions::grad_accum, 1, kNone, "1 or more"},
      {"--warmup-steps", &TrainOptions::warmup_steps, 0, kNone, "0 or more"},
      {"--seed", &TrainOptions::seed, 0, kNone, "0 or more"},
      {"--threads", [](const TrainOptions& o) { return o.launch.threads; }, 0, kMaxThreads,
       cat("1 to ", kMaxThreads, " (0 = auto)")},
      {"--checkpoint-every", &TrainOptions::checkpoint_every, 0, kNone,
       "0 (only at the end) or more"},
      {"--keep-last", &TrainOptions::keep_last, 0, kNone, "0 (keep all) or more"},
      {"--sample", &TrainOptions::sample, 0, 1000000, "0 (none) to 1000000 bytes"},
      {"--eval-every", &TrainOptions::eval_every, 0, kNone, "0 (step 0 and the end only) or more"},
      {"--eval-batches", &TrainOptions::eval_batches, 1, kNone, "1 or more"},
  };
  return ranges;
}

// Throws fsdp::Error for the first flag of int_ranges() outside its range.
void check_int_ranges(const TrainOptions& o) {
  for (const IntRange& r : int_ranges()) {
    const int64_t v = r.value(o);
    FSDP_CHECK(v >= r.min && (!r.max || v <= *r.max), r.flag, " ", v, " is invalid; use ", r.fix);
  }
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

// --model: the preset it names.
ModelPreset find_preset(const TrainOptions& o) {
  ModelPreset preset;
  bool found = false;
  for (const auto& m : model_presets()) {
    if (m.name == fsdp::lower_ascii(o.model)) {
      preset = m;
      found = true;
    }
  }
  FSDP_CHECK(found, "--model '", o.model, "' is not a preset; use ", preset_names());
  return preset;
}

// The model's shape: an llm.c --init-from file's header where a flag is 0 (nanoGPT and llm.c
// train other sizes than the presets': the file says which), then the explicit flags (--layers,
// --d-model, --heads, --context) over the preset's or the file's. A flag that differs from the
// file stays an error (check_llmc_model_file, in check_weights_files).
void apply_shape(const TrainOptions& o, ModelPreset& preset) {
  const ModelPreset before = preset;
  if (!o.init_from.empty() && preset.gpt2 && init_from_llmc_file(o.init_from)) {
    const LlmcModelHeader h = read_llmc_header("--init-from", o.init_from);
    FSDP_CHECK(h.layers <= kMaxLayers && h.channels <= kMaxWidth && h.max_t <= kMaxContext,
               "--init-from '", o.init_from, "' has ", h.layers, " layers, width ", h.channels,
               " and context ", h.max_t, ", beyond fsdp-train's ", kMaxLayers, ", ", kMaxWidth,
               " and ", kMaxContext, "; give an llm.c model file of a trainable size");
    preset = preset_of_llmc_header(h, preset);
  }
  if (o.layers) preset.n_layers = o.layers;
  if (o.d_model) preset.d_model = o.d_model;
  if (o.heads) preset.n_heads = o.heads;
  if (o.context) preset.context = o.context;
  FSDP_CHECK(preset.d_model % preset.n_heads == 0, "--heads ", preset.n_heads,
             " does not divide the width ", preset.d_model, "; use a divisor such as ",
             std::gcd(preset.d_model, int64_t{8}), " or set --d-model to a multiple of it");
  const bool shape = preset.n_layers != before.n_layers || preset.d_model != before.d_model ||
                     preset.n_heads != before.n_heads || o.layers || o.d_model || o.heads;
  const bool context = preset.context != before.context;
  const bool vocab = preset.vocab != before.vocab;
  if (shape || context || vocab) {
    preset.name = cat(preset.name, " (d ", preset.d_model, ", ", preset.n_layers, " blocks, ",
                      preset.n_heads, " heads",
                      context ? cat(", context ", preset.context) : std::string(),
                      vocab ? cat(", vocabulary ", preset.vocab) : std::string(), ")");
  }
}

// The step's numbers that are not whole: --seq-len against the context, --lr, --clip-grad,
// --timeout.
void check_step_values(const TrainOptions& o, const TrainPlan& p) {
  FSDP_CHECK(o.seq_len >= 1 && o.seq_len <= p.preset.context, "--seq-len ", o.seq_len,
             " is outside 1..", p.preset.context, " (the context of --model ", p.preset.name,
             "); use a value in that range");
  FSDP_CHECK(std::isfinite(o.lr) && o.lr > 0, "--lr ", o.lr,
             " is invalid; use a positive learning rate such as 1e-3");
  FSDP_CHECK(std::isfinite(o.clip_grad) && o.clip_grad >= 0, "--clip-grad ", o.clip_grad,
             " is invalid; use a positive norm, or 0 to turn clipping off");
  // Timeouts count whole milliseconds.
  FSDP_CHECK(std::isfinite(o.timeout) && o.timeout >= 0.001 && o.timeout <= 7 * 24 * 3600,
             "--timeout ", o.timeout, " is invalid; use seconds in [0.001, 604800], e.g. 300");
}

// --precision, --dropout, --freeze, --init and --heap.
void resolve_model_flags(const TrainOptions& o, TrainPlan& p) {
  p.bf16 = fsdp::parse_enum<bool>(o.precision, {{"fp32", false}, {"bf16-mixed", true}},
                                  "--precision");
  FSDP_CHECK(std::isfinite(o.dropout) && o.dropout >= 0 && o.dropout < 1, "--dropout ", o.dropout,
             " is invalid; use a probability in [0, 1), e.g. 0.1");
  p.preset.dropout = o.dropout;
  for (const auto& g : o.freeze) {
    FSDP_CHECK(!g.empty(), "--freeze '' is empty; give a glob of parameter names, e.g. 'tok_emb.*'");
  }
  p.deferred_init =
      fsdp::parse_enum<bool>(o.init, {{"deferred", true}, {"eager", false}}, "--init");
  try {
    p.heap = fsdp::parse_heap_policy(o.heap);
  } catch (const fsdp::Error& e) {
    throw fsdp::Error(cat("--heap: ", e.what()));
  }
}

// The sharding strategy of --strategy, --grad-sync, --mesh, --prefetch and the switches, and its
// plan for this world.
void plan_strategy(const TrainOptions& o, TrainPlan& p, int64_t world_size,
                   int64_t local_world_size) {
  const bool prefetch =
      fsdp::parse_enum<bool>(o.prefetch, {{"on", true}, {"off", false}}, "--prefetch");

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
  p.strategy.forward_prefetch(prefetch).backward_prefetch(prefetch);
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
}

// --global-batch over the ranks and --grad-accum's micro-steps, and whether a micro-step fits.
void split_batch(const TrainOptions& o, TrainPlan& p, int64_t world_size) {
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
}

// The reports (--json, --dry-run, --plan) and the output files (--metrics, --plot).
void check_outputs(const TrainOptions& o, TrainPlan& p) {
  FSDP_CHECK(!o.json || o.dry_run || o.plan,
             "--json only applies to --dry-run and --plan; add one or drop --json");
  FSDP_CHECK(!(o.dry_run && o.plan), "--dry-run and --plan each print a report; give one");
  if (!o.metrics.empty()) check_output_path("--metrics", o.metrics);
  {
    // --trace-steps A:B, 1 <= A <= B; checked with or without --trace, so a typo never waits.
    const std::string& t = o.trace_steps;
    const size_t colon = t.find(':');
    char* end = nullptr;
    bool ok = colon != std::string::npos && colon > 0 && colon + 1 < t.size();
    if (ok) {
      p.trace_first = std::strtoll(t.c_str(), &end, 10);
      ok = end == t.c_str() + colon;
      p.trace_last = std::strtoll(t.c_str() + colon + 1, &end, 10);
      ok = ok && *end == '\0';
    }
    FSDP_CHECK(ok && p.trace_first >= 1 && p.trace_last >= p.trace_first, "--trace-steps '", t,
               "' is invalid; give first:last with 1 <= first <= last, e.g. 3:5");
    FSDP_CHECK(o.trace.empty() || p.trace_first <= o.steps, "--trace-steps ", t,
               " starts after the last step (--steps ", o.steps, "); trace earlier steps");
  }
  if (!o.trace.empty()) check_output_path("--trace", o.trace);
  if (!o.plot.empty()) {
    check_output_path("--plot", o.plot);
    const std::string ext = ".png";
    const bool png = o.plot.size() > ext.size() &&
                     fsdp::lower_ascii(o.plot.substr(o.plot.size() - ext.size())) == ext;
    FSDP_CHECK(png, "--plot '", o.plot,
               "' is not a .png file name; plots are PNG, e.g. --plot loss.png");
    FSDP_CHECK(!fsdp_plot::find_gnuplot().empty(),
               "--plot needs gnuplot, which is not in PATH; install it "
               "(apt-get install gnuplot-nox, or make setup) or drop --plot");
  }
}

// --checkpoint-dir and what needs it: --resume, periodic and async saves, --keep-last, the
// signals a save answers, --requeue; and --export-full.
void check_checkpoint_flags(const TrainOptions& o, TrainPlan& p) {
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
    const std::string e = fsdp::lower_ascii(o.export_full);
    auto ends = [&](const std::string& x) {
      return e.size() > x.size() && e.compare(e.size() - x.size(), x.size(), x) == 0;
    };
    FSDP_CHECK(ends(".pt") || ends(".safetensors"), "--export-full '", o.export_full,
               "' must end in .pt (torch.load) or .safetensors; e.g. --export-full model.pt");
  }
}

// --sample's settings, validation, the data order, the schedule and AdamW's hyperparameters.
void check_sampling_and_optimizer(const TrainOptions& o) {
  FSDP_CHECK(std::isfinite(o.temperature) && o.temperature >= 0 && o.temperature <= 100,
             "--temperature ", o.temperature, " is invalid; use 0 (greedy) to 100, e.g. 0.8");
  FSDP_CHECK(o.sample == 0 || !o.prompt.empty(), "--prompt is empty; give at least one byte");
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
}

// The weights files: --init-from (llm.c's model file, a full or a sharded checkpoint) and
// --export-llmc.
void check_weights_files(const TrainOptions& o, const TrainPlan& p) {
  if (!o.init_from.empty() && init_from_llmc_file(o.init_from)) {
    FSDP_CHECK(p.preset.gpt2, "--init-from reads llm.c's GPT-2 model files; add --model gpt2 "
               "(its shape is the file's)");
    check_llmc_model_file("--init-from", o.init_from, p.preset);
  } else if (!o.init_from.empty()) {
    check_init_from(o.init_from);
  }
  FSDP_CHECK(!o.init_from_optimizer || fsdp::is_dcp_checkpoint(o.init_from),
             "--init-from-optimizer reads AdamW's state from a PyTorch distributed checkpoint; "
             "give one with --init-from DIR (a directory with a .metadata)",
             o.init_from.empty() ? std::string() : fsdp::cat(" ('", o.init_from, "' is not)"));
  check_dcp_flags(o, p.preset);
  if (!o.export_dcp.empty()) {
    struct stat st {};
    FSDP_CHECK(!(::stat(o.export_dcp.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)), "--export-dcp '",
               o.export_dcp, "' is a file; give a directory (created if missing)");
    check_output_path("--export-dcp", o.export_dcp + "/.metadata");
  }
  if (!o.export_logits.empty()) {
    check_output_path("--export-logits", o.export_logits);
    FSDP_CHECK(o.export_logits.size() > 4 &&
                   o.export_logits.compare(o.export_logits.size() - 4, 4, ".npy") == 0,
               "--export-logits '", o.export_logits, "' must end in .npy (numpy.load reads it)");
  }
  if (!o.export_llmc.empty()) {
    FSDP_CHECK(p.preset.gpt2, "--export-llmc writes llm.c's GPT-2 model file; add --model gpt2");
    check_output_path("--export-llmc", o.export_llmc);
  }
}

}  // namespace

TrainPlan check_options(const TrainOptions& o, int64_t world_size, int64_t local_world_size) {
  TrainPlan p;
  p.world_size = world_size;
  p.local_world_size = local_world_size;
  // In this order: the first error found is the one reported.
  p.preset = find_preset(o);
  check_int_ranges(o);
  apply_shape(o, p.preset);
  check_step_values(o, p);
  resolve_model_flags(o, p);
  plan_strategy(o, p, world_size, local_world_size);
  split_batch(o, p, world_size);
  check_outputs(o, p);
  check_checkpoint_flags(o, p);
  check_sampling_and_optimizer(o);
  check_weights_files(o, p);
  resolve_data(o, p);
  FSDP_CHECK(o.sample == 0 || p.data.format == DataFormat::kBytes, "--sample "
             "prints bytes, but --data '", p.data.label, "' holds tokens; drop --sample");
  return p;
}

}  // namespace fsdp_train
