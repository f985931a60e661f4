// fsdp-train's training run (see trainer.h): joining the job, the model and its optimizer,
// --resume, the step (data sampling, the learning-rate schedule, gradient accumulation, metrics),
// validation, checkpoints and preemption, and what is left to do after the last step.
#include "trainer.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <random>

#include "fsdp/checkpoint.h"
#include "fsdp/error.h"
#include "elapsed.h"
#include "llmc.h"
#include "dcp.h"
#include "resume.h"

namespace fsdp_train {

using fsdp::cat;

namespace {

using Clock = std::chrono::steady_clock;

// Peak resident set size of this process (VmHWM), in bytes; 0 where /proc is unavailable.
int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "... kB"
  }
  return 0;
}

// Minor page faults of the whole process so far (every thread's): first touches of fresh memory.
int64_t minor_faults() {
  struct rusage u {};
  return getrusage(RUSAGE_SELF, &u) == 0 ? static_cast<int64_t>(u.ru_minflt) : 0;
}

// Linear warm-up to the peak over warmup_steps, then constant (--lr-schedule constant) or cosine
// decay to 10% of it at the last step.
double lr_at(const TrainOptions& o, int64_t step) {
  if (step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps);
  if (o.lr_schedule == "constant") return o.lr;
  const int64_t decay_steps = o.steps - o.warmup_steps;
  if (decay_steps <= 1) return o.lr;
  const double t = double(step - o.warmup_steps) / double(decay_steps - 1);
  return o.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * t)));
}

// The settings every rank must agree on; a node started with other flags fails fast.
std::string settings_line(const TrainOptions& o, const TrainPlan& p) {
  std::string freeze;
  for (const auto& g : o.freeze) freeze += " freeze " + g;
  return cat("model ", p.preset.name, freeze, " steps ", o.steps, " global-batch ", o.global_batch,
             " seq-len ", o.seq_len, " grad-accum ", o.grad_accum, " lr ", o.lr, " ",
             o.lr_schedule, " warmup ", o.warmup_steps, " clip ", o.clip_grad, " adamw ", o.beta1,
             " ", o.beta2, " ", o.adam_eps, " ", o.weight_decay, " seed ", o.seed, " order ",
             o.data_order, " dropout ", p.preset.dropout, " data ", p.data.tokens, " ",
             to_string(p.data.format),
             " tokens val ", p.val.tokens, " x ", o.eval_batches, " every ", o.eval_every,
             " init ", o.init_from, "; ", p.strategy.describe());
}

// What --heap did, for the summary.
std::string describe_heap(fsdp::HeapPolicy policy, bool applied) {
  if (policy == fsdp::HeapPolicy::kUnchanged) {
    return "unchanged (--heap unchanged: malloc's own settings)";
  }
  if (!applied) {
    return cat(fsdp::to_string(policy), " asked, not applied: this allocator ignores mallopt "
               "(sanitizer build or not glibc)");
  }
  if (policy == fsdp::HeapPolicy::kRetain) {
    return cat("retain (glibc keeps freed memory for the next step: mmap threshold ",
               fsdp::format_bytes(fsdp::kRetainMmapThreshold), ", trim threshold ",
               fsdp::format_bytes(fsdp::kRetainTrimThreshold), ")");
  }
  return cat("lean (glibc returns freed memory: mmap threshold ",
             fsdp::format_bytes(fsdp::kLeanMmapThreshold), ", trim threshold ",
             fsdp::format_bytes(fsdp::kLeanTrimThreshold), ")");
}

torch::optim::AdamWOptions adamw_options(const TrainOptions& o) {
  return torch::optim::AdamWOptions(o.lr)
      .betas(std::make_tuple(o.beta1, o.beta2))
      .eps(o.adam_eps)
      .weight_decay(o.weight_decay);
}

// Rank 0 returns `n` bytes sampled from the model after `prompt` (every rank runs the forwards:
// they are collective). Deterministic for --seed: rank 0 draws, the world receives its choice.
template <class Model>
std::string sample_text(Model& model, LanguageModel& net, const TrainOptions& o,
                        const ModelPreset& preset,
                        fsdp::Runtime& rt) {
  torch::NoGradGuard no_grad;
  net.eval();
  const c10::Device device = rt.device();
  std::vector<int64_t> tokens(o.prompt.begin(), o.prompt.end());
  for (auto& t : tokens) t &= 0xff;
  std::mt19937_64 rng(static_cast<uint64_t>(o.seed) * 0x2545f4914f6cdd1dULL + 1);
  std::string out;
  for (int64_t i = 0; i < o.sample; ++i) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(tokens.size()), preset.context);
    auto x = torch::tensor(std::vector<int64_t>(tokens.end() - T, tokens.end()), torch::kLong)
                 .view({1, T})
                 .to(device);
    torch::Tensor logits = model(x).select(1, T - 1).reshape({-1}).to(torch::kDouble).cpu();
    auto next = torch::zeros({1}, torch::TensorOptions(torch::kLong).device(device));
    if (rt.rank() == 0) {
      int64_t choice = 0;
      if (o.temperature == 0) {
        choice = logits.argmax().item<int64_t>();
      } else {
        torch::Tensor probs = torch::softmax(logits / o.temperature, 0);
        const double u = double(rng() >> 11) * 0x1.0p-53;
        auto acc = probs.accessor<double, 1>();
        double sum = 0;
        const int64_t vocab = probs.size(0);
        choice = vocab - 1;
        for (int64_t v = 0; v < vocab; ++v) {
          sum += acc[v];
          if (u < sum) {
            choice = v;
            break;
          }
        }
      }
      next.fill_(choice);
    }
    if (rt.world_size() > 1) rt.world()->broadcast(next, 0)->wait();
    tokens.push_back(next.cpu().item<int64_t>());
    out.push_back(static_cast<char>(tokens.back()));
  }
  net.train();
  return out;
}

}  // namespace

fsdp::ReportOptions report_options(const TrainOptions& o, const TrainPlan& p) {
  auto r = fsdp::ReportOptions::for_strategy(p.strategy);
  r.grad_accum = o.grad_accum;
  r.clip = o.clip_grad > 0;
  r.optimizer_states = 2;  // AdamW: exp_avg, exp_avg_sq
  return r;
}

Trainer::Trainer(const TrainOptions& o, const TrainPlan& p, RunLog* log)
    : o_(o),
      p_(p),
      log_(*log),
      runtime_(join()),
      rank_(runtime_->rank()),
      world_size_(runtime_->world_size()),
      data_(p.data),
      val_(p.val.files.empty() ? nullptr : std::make_unique<TokenStream>(p.val)),
      model_(build()),
      net_(*model_.module()),
      optimizer_(model_.parameters(), adamw_options(o)),
      sampler_(o.seed, p.data.tokens, o.seq_len, o.global_batch, o.data_order == "sequential"),
      progress_(o.steps, rank_ == 0 && !o.quiet) {
  log_.report = fsdp::make_topology_report(model_.plan(), p_.local_world_size, model_.units(),
                                           report_options(o_, p_));
  if (log_.lead) print_banner();
  if (log_.lead && !o_.metrics.empty()) {
    metrics_.open(o_.metrics, std::ios::out | std::ios::trunc);
    FSDP_CHECK(metrics_, "cannot write --metrics '", o_.metrics, "': ", std::strerror(errno));
  }
}

std::shared_ptr<fsdp::Runtime> Trainer::join() {
  fsdp::RuntimeOptions ro;
  ro.timeout = std::chrono::milliseconds(static_cast<int64_t>(o_.timeout * 1000));
  ro.threads = o_.launch.threads;
  ro.heap = p_.heap;
  auto runtime = fsdp::Runtime::init(ro);
  log_.heap = describe_heap(p_.heap, runtime->heap_applied());
  log_.backend = runtime->backend_reason().empty() ? fsdp::to_string(runtime->backend())
                                                   : runtime->backend_reason();
  const int64_t W = runtime->world_size();
  FSDP_CHECK(W == p_.world_size, "the job has ", W, " ranks but the flags were checked for ",
             p_.world_size, "; this is a bug in fsdp-train");
  log_.lead = runtime->rank() == 0;
  runtime->check_agreement("fsdp-train settings", settings_line(o_, p_));
  return runtime;
}

Model Trainer::build() {
  log_.account.set_base();  // after the data is mapped, before the model exists
  return build_model(o_, p_, runtime_, &log_.construction);
}

void Trainer::print_banner() const {
  const TrainPlan& p = p_;
  const int64_t W = world_size_;
  const int64_t n_params = log_.construction.params, n_trainable = model_.trainable_numel();
  std::printf(
      "fsdp-train: %s, mesh %s = %lld %s x %lld-way sharding, world %lld = %lld %s "
      "x %lld | model %s, %s params, %s | global batch %lld x %lld tokens, "
      "grad-accum %lld, %lld steps | data: %s (%s)\n",
      fsdp::to_string(p.sharding.strategy), mesh_string(p.sharding).c_str(),
      static_cast<long long>(p.sharding.replicate_size()),
      p.sharding.replicate_size() == 1 ? "replica" : "replicas",
      static_cast<long long>(p.sharding.shard_size()), static_cast<long long>(W),
      static_cast<long long>(W / p.local_world_size),
      W / p.local_world_size == 1 ? "node" : "nodes",
      static_cast<long long>(p.local_world_size), p.preset.name.c_str(),
      (fsdp::format_count(double(n_params)) +
       (n_trainable < n_params
            ? cat(" (", fsdp::format_count(double(n_trainable)), " trainable)")
            : std::string()))
          .c_str(),
      p.bf16 ? "bf16-mixed" : "fp32",
      static_cast<long long>(o_.global_batch), static_cast<long long>(o_.seq_len),
      static_cast<long long>(o_.grad_accum), static_cast<long long>(o_.steps),
      p.data.label.c_str(),
      cat(fsdp::format_count(double(p.data.tokens)), " tokens, ", to_string(p.data.format))
          .c_str());
  std::printf("fsdp-train: construction %s\n", log_.construction.describe().c_str());
  // The plan's warnings (e.g. groups spanning nodes): fsdp::shard printed them on rank 0.
  std::fflush(stdout);
}

int64_t Trainer::resume() {
  if (!o_.resume) return 0;
  // Every rank looks and decides; the ranks compare decisions through the store before any
  // collective, so a damaged checkpoint is the same error on every rank (resume.h).
  ResumeChoice choice;
  std::string error;
  try {
    choice = choose_resume(fsdp::list_checkpoints(o_.checkpoint_dir), o_.checkpoint_dir,
                           o_.resume_fallback);
  } catch (const fsdp::Error& e) {
    error = e.what();
  }
  runtime_->check_agreement("--resume's checkpoint",
                            error.empty() ? choice.path.value_or("(none)") : error);
  if (!error.empty()) throw fsdp::Error(error);
  if (log_.lead) {
    for (const auto& line : choice.notes) std::printf("%s\n", line.c_str());
  }
  int64_t first_step = 0;
  std::optional<std::string> latest = choice.path;
  fsdp::TrainingState state;
  // --resume-fallback: a checkpoint whose damage only reading finds (a checksum) is skipped like
  // one the listing refused. load_checkpoint throws CheckpointDamagedError on every rank alike,
  // before anything changed, so every rank moves on to the same older entry; the ranks compare
  // it through the store before loading it.
  while (latest) {
    try {
      log_.ckpt.loaded = fsdp::load_checkpoint(*latest, model_, &optimizer_, &state);
      break;
    } catch (const fsdp::CheckpointDamagedError& e) {
      if (!o_.resume_fallback) throw;
      if (log_.lead) {
        std::printf("fsdp-train: --resume-fallback: skipping %s: %s\n", latest->c_str(), e.what());
      }
      damaged_.push_back(*latest);
      if (choice.older.empty()) {
        latest.reset();
        if (log_.lead) {
          std::printf("fsdp-train: --resume-fallback: no valid checkpoint left in %s; starting "
                      "fresh\n", o_.checkpoint_dir.c_str());
        }
      } else {
        latest = choice.older.front();
        choice.older.erase(choice.older.begin());
        runtime_->check_agreement("--resume-fallback's checkpoint", *latest);
      }
    }
  }
  if (latest) {
    CheckpointLog& ckpt = log_.ckpt;
    FSDP_CHECK(state.step <= o_.steps, "--resume: ", *latest, " is at step ", state.step,
               ", beyond --steps ", o_.steps, "; give --steps ", state.step, " or more");
    FSDP_CHECK(state.values.count("sampler"), "--resume: ", *latest, " has no data position; "
               "it was not written by fsdp-train");
    sampler_.restore(state.values.at("sampler"));
    first_step = ckpt.resumed_step = state.step;
    if (log_.lead) {
      std::printf("fsdp-train: resumed from %s at step %lld (%s in %.3f s)\n", latest->c_str(),
                  static_cast<long long>(state.step),
                  fsdp::format_bytes(double(ckpt.loaded->bytes)).c_str(), ckpt.loaded->seconds);
      if (state.values.count("settings") && state.values.at("settings") != settings_line(o_, p_)) {
        std::printf("fsdp-train: note: the checkpoint was written with other settings (%s)\n",
                    state.values.at("settings").c_str());
      }
    }
  }
  std::fflush(stdout);
  return first_step;
}

// NOTE [continuing a PyTorch run]: --init-from DIR --init-from-optimizer (a DCP checkpoint) reads
// the weights and AdamW's state here, once the optimizer exists, unless --resume found a
// checkpoint of this run (which is newer). AdamW's per-parameter step carries over (its bias
// corrections go on), and so does fsdp-train's own step: training continues at step S, the
// checkpoint's, with the data position and the learning-rate schedule of step S (--data-order
// sequential reads window S next, as llm.c's loader would; random draws as if S steps had been
// taken) and --steps counts the total, as with --resume. The checkpoint's lr is reported, not
// used: the schedule sets it every step.
int64_t Trainer::continue_from_dcp() {
  const auto t = Clock::now();
  fsdp::DcpImportInfo info =
      fsdp::import_dcp(model_, o_.init_from, &optimizer_, dcp_options(o_, p_.preset, false));
  const int64_t step = info.optimizer_step;
  FSDP_CHECK(step < o_.steps, "--init-from-optimizer: ", o_.init_from, " is at step ", step,
             ", and --steps ", o_.steps, " counts the total; give --steps ", step + 1, " or more");
  for (int64_t s = 0; s < step; ++s) (void)sampler_.next();
  log_.construction.dcp = std::move(info);
  log_.construction.init_from = o_.init_from;
  log_.construction.init_from_seconds = seconds_since(t);
  return step;
}

void Trainer::report_dcp() const {
  const fsdp::DcpImportInfo& d = log_.construction.dcp;
  if (!log_.lead || d.tensors == 0) return;
  std::printf("fsdp-train: --init-from %s (PyTorch DCP): %lld tensors, %s read by rank 0",
              o_.init_from.c_str(), static_cast<long long>(d.tensors),
              fsdp::format_bytes(double(d.bytes_read)).c_str());
  if (d.optimizer_step >= 0) {
    std::printf("; AdamW's state at step %lld, training continues there",
                static_cast<long long>(d.optimizer_step));
    if (d.checkpoint_lr >= 0) {
      std::printf(" (the checkpoint's lr %g; this run's schedule gives %g)", d.checkpoint_lr,
                  lr_at(o_, d.optimizer_step));
    }
  }
  std::printf("\n");
  for (const auto& n : d.notes) std::printf("fsdp-train: note: %s\n", n.c_str());
  std::fflush(stdout);
}

int Trainer::run() {
  first_step_ = resume();
  if (o_.init_from_optimizer && !log_.ckpt.loaded) first_step_ = continue_from_dcp();
  report_dcp();
  if (!o_.trace.empty()) {
    fsdp::TraceOptions t;
    t.path = o_.trace;
    t.first_step = p_.trace_first;
    t.last_step = p_.trace_last;
    t.strategy = fsdp::to_string(p_.sharding.strategy);
    t.mesh = {p_.sharding.replicate_size(), p_.sharding.shard_size()};
    trace_.emplace(runtime_, t);
  }
  if (!trace_) return train_all();
  try {
    const int rc = train_all();
    log_.trace = trace_->finish();
    return rc;
  } catch (const std::exception& e) {
    // What this rank recorded, for the failure's post-mortem; the error itself goes on.
    const std::string written = trace_->write_partial(e.what());
    if (!written.empty()) std::fprintf(stderr, "fsdp-train: --trace: wrote %s\n", written.c_str());
    throw;
  }
}

fsdp::Trace::Span Trainer::span(const char* category, const char* name) const {
  return trace_ ? trace_->span(category, name) : fsdp::Trace::Span();
}

int Trainer::train_all() {
  preempt_.emplace(p_.save_signals);
  train_start_ = Clock::now();
  if (first_step_ == 0) validate(0);  // llm.c's convention: also before any update
  for (int64_t step = first_step_; step < o_.steps; ++step) {
    if (stopped_by_ != 0) {  // seen by every rank after the previous step
      stop_on_signal(stopped_by_, step);
      return 128 + stopped_by_;  // saved; the summary is for finished runs
    }
    train_step(step);
  }
  finish();
  return 0;
}

void Trainer::train_step(int64_t step) {
  if (trace_) trace_->begin_step(step + 1);
  const auto t0 = Clock::now();
  const int64_t faults_before = minor_faults();
  const auto comm_before = model_.comm_counters();
  const std::vector<int64_t> offsets = sampler_.next();
  const double lr = set_lr(step);
  const double loss = accumulate_gradients(step, offsets);
  log_.account.sample(step + 1, "backward", model_.memory_stats(&optimizer_));
  if (o_.clip_grad > 0) {
    auto s = span("optimizer", "clip_grad");
    model_.clip_grad_norm(o_.clip_grad);
  }
  {
    auto s = span("optimizer", "optimizer");
    optimizer_.step();
  }
  const double step_time = seconds_since(t0);
  if (trace_) trace_->end_step();
  const int64_t faults = minor_faults() - faults_before;
  // AdamW makes its state in the first step's optimizer step, after the backward: that step's
  // largest RssAnon is here, not at the backward's end. Outside the step's time.
  log_.account.sample(step + 1, "optimizer step", model_.memory_stats(&optimizer_));

  const StepRecord rec = gather_metrics(loss, step_time, lr, comm_before, faults);
  // rec.loss is the same number on every rank, so every rank stops here together.
  FSDP_CHECK(std::isfinite(rec.loss), "the loss is ", rec.loss, " at step ", step + 1,
             "; training diverged: lower --lr (", o_.lr, ") or enable --clip-grad");
  log_.records.push_back(rec);
  stopped_by_ = static_cast<int>(rec.max[kSignal]);  // the same on every rank
  const double blocked_by_save = checkpoint_after(step);
  if (log_.lead) log_step(step, rec, blocked_by_save);
  const bool last = step + 1 == o_.steps;
  if (o_.eval_every > 0 ? (step + 1) % o_.eval_every == 0 || last : last) validate(step + 1);
  // After the validation, so that the line shows this step's validation loss (the one --metrics
  // and the summary give), not the previous one. Rank 0 only: progress_ is off elsewhere.
  progress_.update(step + 1, rec.loss, rec.tokens_per_s, seconds_since(train_start_));
}

double Trainer::set_lr(int64_t step) {
  const double lr = lr_at(o_, step);
  for (auto& group : optimizer_.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
  return lr;
}

double Trainer::accumulate_gradients(int64_t step, const std::vector<int64_t>& offsets) {
  const int64_t K = o_.grad_accum, T = o_.seq_len;
  // Gradients freed, not zeroed (libtorch 1.13's zero_grad() zeroes them and keeps them):
  // the forward then runs without a gradient copy of the model in memory, as on 2.x.
  {
    auto s = span("optimizer", "zero_grad");
    for (auto& group : optimizer_.param_groups()) {
      for (auto& param : group.params()) param.mutable_grad().reset();
    }
  }
  double loss_sum = 0;
  for (int64_t k = 0; k < K; ++k) {
    auto data = span("data", "data");
    auto tokens = batch_tokens(data_, offsets, rank_ * p_.per_rank_batch + k * p_.micro_batch,
                               p_.micro_batch, T)
                      .to(runtime_->device());  // cpu, or this rank's GPU with NCCL
    data.end();
    // Micro-steps before the last skip what --grad-sync allows (see NOTE [gradient
    // averaging] in fsdp/sharded.h: the engine averages over ranks, we over micro-steps).
    auto no_sync = model_.no_sync(/*enabled=*/k + 1 < K);
    auto logits = model_(tokens.narrow(1, 0, T));
    auto loss_span = span("loss", "loss");
    auto loss = torch::nn::functional::cross_entropy(
        logits.to(torch::kFloat).reshape({-1, logits.size(-1)}),
        tokens.narrow(1, 1, T).reshape({-1}));
    loss_span.end();
    if (k + 1 == K) log_.account.sample(step + 1, "forward", model_.memory_stats(&optimizer_));
    (loss / double(K)).backward();
    loss_sum += loss.item<double>();
  }
  return loss_sum / double(K);
}

// Per-step metrics: one all_gather of a few numbers per rank on the world group.
StepRecord Trainer::gather_metrics(
    double loss, double step_time, double lr,
    const std::vector<std::pair<std::string, fsdp::CommCounters>>& before, int64_t faults) {
  const int64_t W = world_size_;
  const c10::Device device = runtime_->device();
  const auto comm_after = model_.comm_counters();
  const auto mem = model_.memory_stats(&optimizer_);
  auto mine = torch::zeros({kNumStats}, torch::kDouble);
  auto m = mine.accessor<double, 1>();
  m[kLoss] = loss;
  m[kStepTime] = step_time;
  m[kShardedState] = double(mem.sharded_state_bytes());
  m[kGatheredPeak] = double(mem.unsharded_peak_bytes);
  // NOTE [peak after construction]: build_model restarted VmHWM when construction ended, so that
  // the summary can tell the run's peak apart from construction's (eager construction holds the
  // whole model: its peak often hides training's).
  const Construction& built = log_.construction;
  const double vm_hwm = double(peak_rss_bytes());
  m[kPeakRss] = built.peak_rss_reset_after ? std::max(vm_hwm, double(built.peak_rss)) : vm_hwm;
  m[kPeakRssAfter] = built.peak_rss_reset_after ? vm_hwm : 0.0;
  m[kSignal] = double(preempt_->received());
  m[kMinorFaults] = double(faults);
  for (size_t g = 0; g < comm_after.size(); ++g) {
    const double bytes = double((comm_after[g].second - before[g].second).total_bytes());
    const std::string& kind = comm_after[g].first;
    if (kind == "shard") m[kCommShard] = bytes;
    if (kind == "replicate") m[kCommReplicate] = bytes;
    if (kind == "world") m[kCommWorld] = bytes;
  }
  // On the runtime's device: NCCL gathers only CUDA tensors.
  auto all = torch::zeros({W * kNumStats}, torch::TensorOptions(torch::kDouble).device(device));
  runtime_->world()->all_gather(all, mine.to(device))->wait();
  auto a = all.cpu().view({W, kNumStats});
  StepRecord rec;
  rec.loss = a.select(1, kLoss).sum().item<double>() / double(W);  // equal slices: mean
  rec.lr = lr;
  auto largest = std::get<0>(a.max(0));
  for (int64_t k = 0; k < kNumStats; ++k) rec.max[k] = largest[k].item<double>();
  rec.step_time_s = rec.max[kStepTime];
  rec.tokens_per_s = double(o_.global_batch * o_.seq_len) / std::max(rec.step_time_s, 1e-9);
  return rec;
}

double Trainer::checkpoint_after(int64_t step) {
  double blocked_by_save = -1;  // a background save started after this step: its cost
  // The optimizer has its state now: the staging buffer is allocated in the background, so
  // the first background save blocks only for its copy, as the later ones do.
  if (o_.checkpoint_async && !staging_reserved_) {
    saver_.reserve(model_, &optimizer_);
    staging_reserved_ = true;
  }
  if (!o_.checkpoint_dir.empty() && o_.checkpoint_every > 0 &&
      (step + 1) % o_.checkpoint_every == 0 && step + 1 < o_.steps) {
    save(step + 1, o_.checkpoint_async);
    if (o_.checkpoint_async) blocked_by_save = saver_.last_blocked_seconds();
  } else if (saver_.in_flight()) {  // the same on every rank: poll is collective
    if (auto info = saver_.poll()) committed(*info, /*background=*/true);
  }
  return blocked_by_save;
}

void Trainer::log_step(int64_t step, const StepRecord& rec, double blocked_by_save) {
  if (metrics_.is_open()) {
    const Construction& construction = log_.construction;
    nlohmann::ordered_json j;
    j["step"] = step + 1;
    j["loss"] = rec.loss;
    j["lr"] = rec.lr;
    j["step_time_s"] = rec.step_time_s;
    j["tokens_per_s"] = rec.tokens_per_s;
    j["sharded_state_bytes"] = static_cast<int64_t>(rec.max[kShardedState]);
    j["peak_rss_bytes"] = static_cast<int64_t>(rec.max[kPeakRss]);
    j["minor_faults"] = static_cast<int64_t>(rec.max[kMinorFaults]);
    j["comm_bytes"] = {{"shard", static_cast<int64_t>(rec.max[kCommShard])},
                       {"replicate", static_cast<int64_t>(rec.max[kCommReplicate])},
                       {"world", static_cast<int64_t>(rec.max[kCommWorld])}};
    if (blocked_by_save >= 0) j["checkpoint_blocked_s"] = blocked_by_save;
    if (step == first_step_) {  // once per run: building and sharding the model
      j["construction"] = {{"init", construction.deferred ? "deferred" : "eager"},
                           {"seconds", construction.seconds},
                           {"peak_rss_bytes", construction.peak_rss}};
    }
    metrics_ << j.dump() << "\n";
    metrics_.flush();  // a crash mid-run leaves every finished step readable
    FSDP_CHECK(metrics_, "writing --metrics '", o_.metrics, "' failed: ", std::strerror(errno));
  }
}

void Trainer::validate(int64_t steps_done) {
  if (!val_) return;
  auto s = span("eval", "eval");
  const double v = validation_loss(model_, net_, *val_, o_.eval_batches, o_.global_batch,
                                   o_.seq_len, p_.per_rank_batch, p_.micro_batch, *runtime_);
  FSDP_CHECK(std::isfinite(v), "the validation loss is ", v, " at step ", steps_done,
             "; training diverged: lower --lr (", o_.lr, ")");
  log_.val_losses.emplace_back(steps_done, v);
  if (!log_.lead) return;
  progress_.validation(v);
  if (metrics_.is_open()) {
    nlohmann::ordered_json j;
    j["step"] = steps_done;
    j["val_loss"] = v;
    metrics_ << j.dump() << "\n";
    metrics_.flush();
  }
}

// NOTE [async saves in fsdp-train]: a background save is committed by the poll after a later
// step (or by the wait before the next save, the final one or a signal's), and only then are old
// checkpoints pruned: pruning never runs while a save is in flight, so it can neither delete the
// ".partial" being written nor leave fewer than --keep-last complete.
void Trainer::committed(const fsdp::CheckpointInfo& info, bool background) {
  log_.ckpt.last_save = info;
  ++log_.ckpt.saves;
  if (background) {
    ++log_.ckpt.async_committed;
    log_.ckpt.async_write_s += info.write_seconds;
  }
  if (info.page_cache_writes > 0 && log_.ckpt.page_cache_writes == 0 && log_.lead) {
    std::printf("fsdp-train: note: the file system of %s refuses O_DIRECT: background saves "
                "go through the page cache (%lld file(s) of %s), which slows the steps while "
                "they are written\n",
                o_.checkpoint_dir.c_str(), static_cast<long long>(info.page_cache_writes),
                info.path.c_str());
  }
  log_.ckpt.page_cache_writes += info.page_cache_writes;
  // A damaged entry --resume-fallback skipped is evidence until a save of its step replaces it.
  damaged_.erase(std::remove(damaged_.begin(), damaged_.end(), info.path), damaged_.end());
  if (log_.lead && o_.keep_last > 0) {
    fsdp::prune_checkpoints(o_.checkpoint_dir, o_.keep_last, damaged_);
  }
}

void Trainer::finish_async_save() {
  if (auto info = saver_.wait()) committed(*info, /*background=*/true);
}

void Trainer::save(int64_t steps_done, bool background) {
  fsdp::TrainingState state;
  state.step = steps_done;
  state.values["sampler"] = sampler_.state();
  state.values["settings"] = settings_line(o_, p_);
  const std::string path = fsdp::checkpoint_path(o_.checkpoint_dir, steps_done);
  finish_async_save();
  if (background) {
    saver_.save(path, model_, &optimizer_, state);
    ++log_.ckpt.async_saves;
    log_.ckpt.async_blocked_s += saver_.last_blocked_seconds();
    log_.ckpt.staging_bytes = saver_.staging_bytes();
    return;
  }
  committed(fsdp::save_checkpoint(path, model_, &optimizer_, state), /*background=*/false);
}

// Every rank saw `sig` after step `steps_done`: save it, bounded, then requeue (rank 0).
void Trainer::stop_on_signal(int sig, int64_t steps_done) {
  const std::string name = signal_name(sig);
  const std::string path = fsdp::checkpoint_path(o_.checkpoint_dir, steps_done);
  {
    Deadline deadline(o_.signal_save_timeout, 128 + sig,
                      cat("fsdp-train: error: rank ", rank_, ": the save of step ", steps_done,
                          " on ", name, " did not finish within --signal-save-timeout ",
                          o_.signal_save_timeout, " s; exiting without it"));
    finish_async_save();
    const CheckpointLog& ckpt = log_.ckpt;
    if (ckpt.saves == 0 || ckpt.last_save.path != path) save(steps_done, false);  // unless periodic
  }
  if (!log_.lead) return;
  std::printf("\nfsdp-train: %s: saved step %lld to %s; exiting with status %d (continue "
              "with --resume)\n", name.c_str(), static_cast<long long>(steps_done),
              path.c_str(), 128 + sig);
  std::fflush(stdout);
  if (o_.requeue) {
    // Bounded too: scontrol waits while slurmctld does not answer.
    const char* job = std::getenv("SLURM_JOB_ID");
    Deadline deadline(o_.signal_save_timeout, 128 + sig,
                      cat("fsdp-train: error: 'scontrol requeue ", job ? job : "",
                          "' did not finish within --signal-save-timeout ",
                          o_.signal_save_timeout, " s; exiting without requeueing (step ",
                          steps_done, " is saved: requeue or resubmit the job by hand)"));
    requeue_slurm_job();
    std::printf("fsdp-train: requeued SLURM job %s\n", std::getenv("SLURM_JOB_ID"));
    std::fflush(stdout);
  }
}

void Trainer::finish() {
  if (!o_.checkpoint_dir.empty() && !log_.records.empty()) save(o_.steps, false);
  if (!o_.export_full.empty()) {
    const auto t = Clock::now();
    fsdp::export_full_checkpoint(model_, o_.export_full);
    log_.ckpt.exported = o_.export_full;
    log_.ckpt.export_s = seconds_since(t);
  }
  if (!o_.export_llmc.empty()) {
    export_llmc(model_, net_, p_.preset, o_.export_llmc);
    log_.ckpt.exported_llmc = o_.export_llmc;
  }
  if (!o_.export_dcp.empty()) {
    fsdp::export_dcp(model_, o_.export_dcp, &optimizer_, dcp_options(o_, p_.preset, true));
    if (log_.lead) std::printf("fsdp-train: wrote %s (PyTorch DCP)\n", o_.export_dcp.c_str());
  }
  if (!o_.export_logits.empty()) {
    export_logits(model_, net_, data_, o_.global_batch, o_.seq_len, o_.export_logits, *runtime_);
    if (log_.lead) std::printf("fsdp-train: wrote %s\n", o_.export_logits.c_str());
  }
  if (o_.sample > 0) log_.sample = sample_text(model_, net_, o_, p_.preset, *runtime_);
}

}  // namespace fsdp_train
