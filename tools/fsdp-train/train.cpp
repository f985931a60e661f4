// fsdp-train's training loop and dry run (see train.h): data sampling, the learning-rate schedule,
// gradient accumulation, metrics, progress and the end-of-run summary.
#include "train.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "fsdp/async_checkpoint.h"
#include "fsdp/checkpoint.h"
#include "fsdp/error.h"
#include "fsdp/report.h"
#include "fsdp/runtime.h"
#include "fsdp/sharded.h"
#include "batches.h"
#include "build_model.h"
#include "gpt2.h"
#include "llmc.h"
#include "memory_account.h"
#include "plot.h"
#include "token_data.h"
#include "preempt.h"
#include "resume.h"
#include "summary.h"

namespace fsdp_train {

using fsdp::cat;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string clock_time(double s) {
  const int64_t t = static_cast<int64_t>(std::llround(std::max(0.0, s)));
  char buf[32];
  if (t >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(t / 3600),
                  static_cast<long long>(t / 60 % 60), static_cast<long long>(t % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld", static_cast<long long>(t / 60),
                  static_cast<long long>(t % 60));
  }
  return buf;
}

// Peak resident set size of this process (VmHWM), in bytes; 0 where /proc is unavailable.
int64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "... kB"
  }
  return 0;
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

fsdp::ReportOptions report_options(const TrainOptions& o, const TrainPlan& p) {
  auto r = fsdp::ReportOptions::for_strategy(p.strategy);
  r.grad_accum = o.grad_accum;
  r.clip = o.clip_grad > 0;
  r.optimizer_states = 2;  // AdamW: exp_avg, exp_avg_sq
  return r;
}

class Progress {
 public:
  Progress(int64_t steps, bool enabled) : steps_(steps), enabled_(enabled), tty_(::isatty(2)) {}

  // The latest validation loss, shown from now on.
  void validation(double loss) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "  val %.4f", loss);
    val_ = buf;
  }

  void update(int64_t step, double loss, double tokens_per_s, double elapsed_s) {
    if (!enabled_) return;
    const double eta = elapsed_s / double(step) * double(steps_ - step);
    char stats[192];
    std::snprintf(stats, sizeof(stats), "step %lld/%lld  loss %.4f%s  %s tokens/s  ETA %s",
                  static_cast<long long>(step), static_cast<long long>(steps_), loss, val_.c_str(),
                  fsdp::format_count(tokens_per_s).c_str(), clock_time(eta).c_str());
    if (tty_) {
      constexpr int64_t kWidth = 24;
      const int64_t filled = kWidth * step / steps_;
      std::string bar = "[" + std::string(filled, '#') + std::string(kWidth - filled, '.') + "]";
      std::fprintf(stderr, "\r%s %s   ", bar.c_str(), stats);  // trailing blanks erase old text
      if (step == steps_) std::fprintf(stderr, "\n");
    } else {
      const int64_t every = std::max<int64_t>(1, steps_ / 10);
      if (step == 1 || step % every == 0 || step == steps_) std::fprintf(stderr, "%s\n", stats);
    }
    std::fflush(stderr);
  }

 private:
  int64_t steps_;
  bool enabled_;
  bool tty_;
  std::string val_;
};

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

// Bytes a terminal can show: control characters other than newline and tab become '?'.
std::string printable(std::string s) {
  for (char& c : s) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f) c = '?';
  }
  return s;
}

}  // namespace

void check_freeze(const std::vector<std::string>& patterns, const ModelPreset& preset) {
  if (patterns.empty()) return;
  // The same parameter names with tiny tensors: only the layer count shapes the names.
  ModelPreset names_only = preset;
  names_only.d_model = preset.n_heads;
  names_only.context = 1;
  const auto params = make_model(names_only)->named_parameters();
  int64_t frozen = 0;
  for (const auto& p : params) frozen += matches_any(patterns, p.key()) ? 1 : 0;
  for (const auto& g : patterns) {
    bool hit = false;
    for (const auto& p : params) hit = hit || matches_any({g}, p.key());
    FSDP_CHECK(hit, "--freeze '", g, "' matches no parameter of --model ", preset.name,
               " (its names look like ", params[0].key(), ", ", params[2].key(),
               ", ln_f.weight); give a glob that matches some, e.g. 'block0.*'");
  }
  FSDP_CHECK(frozen < static_cast<int64_t>(params.size()), "--freeze freezes all ",
             params.size(), " parameters of --model ", preset.name, ", so nothing would train; "
             "freeze fewer (e.g. --freeze 'tok_emb.*' --freeze 'block0.*')");
}

int run_dry_run(const TrainOptions& o, const TrainPlan& p) {
  auto net = make_model(p.preset);
  freeze_parameters(*net, o.freeze);
  const auto units = fsdp::plan_units(*net, p.strategy.auto_wrap_policy(), p.sharding.shard_size());
  const auto report =
      fsdp::make_topology_report(p.sharding, p.local_world_size, units, report_options(o, p));
  if (o.json) {
    std::cout << report.to_json() << "\n";
  } else {
    std::cout << "fsdp-train --dry-run: model " << p.preset.name << " ("
              << fsdp::format_count(double(report.total_params)) << " parameters), global batch "
              << o.global_batch << " x " << o.seq_len << " tokens: " << p.per_rank_batch
              << " sequences per rank in " << o.grad_accum
              << (o.grad_accum == 1 ? " micro-step" : " micro-steps") << "; nothing is started\n\n"
              << report.to_text();
  }
  return 0;
}

int run_training(const TrainOptions& o, const TrainPlan& p) {
  std::vector<StepRecord> records;
  ValLosses val_losses;
  CheckpointLog ckpt;
  std::string backend;  // the collective backend, and why (e.g. auto picked gloo: no GPU)
  std::string heap;     // what --heap did
  std::string sample;
  fsdp::TopologyReport report;
  Construction construction;
  MemoryAccount account;  // rank 0's memory at its largest end of forward or backward
  int64_t n_params = 0, n_trainable = 0;
  const auto start = Clock::now();
  bool lead = false;
  {
    fsdp::RuntimeOptions ro;
    ro.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout * 1000));
    ro.threads = o.launch.threads;
    ro.heap = p.heap;
    auto runtime = fsdp::Runtime::init(ro);
    if (p.heap == fsdp::HeapPolicy::kUnchanged) {
      heap = "unchanged (--heap unchanged: malloc's own settings)";
    } else if (!runtime->heap_applied()) {
      heap = cat(fsdp::to_string(p.heap), " asked, not applied: this allocator ignores mallopt "
                 "(sanitizer build or not glibc)");
    } else if (p.heap == fsdp::HeapPolicy::kRetain) {
      heap = cat("retain (glibc keeps freed memory for the next step: mmap threshold ",
                 fsdp::format_bytes(fsdp::kRetainMmapThreshold), ", trim threshold ",
                 fsdp::format_bytes(fsdp::kRetainTrimThreshold), ")");
    } else {
      heap = cat("lean (glibc returns freed memory: mmap threshold ",
                 fsdp::format_bytes(fsdp::kLeanMmapThreshold), ", trim threshold ",
                 fsdp::format_bytes(fsdp::kLeanTrimThreshold), ")");
    }
    backend = runtime->backend_reason().empty() ? fsdp::to_string(runtime->backend())
                                                : runtime->backend_reason();
    const int64_t rank = runtime->rank(), W = runtime->world_size();
    FSDP_CHECK(W == p.world_size, "the job has ", W, " ranks but the flags were checked for ",
               p.world_size, "; this is a bug in fsdp-train");
    lead = rank == 0;
    runtime->check_agreement("fsdp-train settings", settings_line(o, p));

    const TokenStream data(p.data);  // memory-mapped (NOTE [token files])
    std::optional<TokenStream> val;
    if (!p.val.files.empty()) val.emplace(p.val);
    account.set_base();
    Model model = build_model(o, p, runtime, &construction);
    auto& net = *model.module();
    n_params = construction.params;
    n_trainable = model.trainable_numel();
    torch::optim::AdamW optimizer(model.parameters(),
                                  torch::optim::AdamWOptions(o.lr)
                                      .betas(std::make_tuple(o.beta1, o.beta2))
                                      .eps(o.adam_eps)
                                      .weight_decay(o.weight_decay));
    report = fsdp::make_topology_report(model.plan(), p.local_world_size, model.units(),
                                        report_options(o, p));
    if (lead) {
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
          static_cast<long long>(o.global_batch), static_cast<long long>(o.seq_len),
          static_cast<long long>(o.grad_accum), static_cast<long long>(o.steps),
          p.data.label.c_str(),
          cat(fsdp::format_count(double(p.data.tokens)), " tokens, ", to_string(p.data.format))
              .c_str());
      std::printf("fsdp-train: construction %s\n", construction.describe().c_str());
      // The plan's warnings (e.g. groups spanning nodes): fsdp::shard printed them on rank 0.
      std::fflush(stdout);
    }
    std::ofstream metrics;
    if (lead && !o.metrics.empty()) {
      metrics.open(o.metrics, std::ios::out | std::ios::trunc);
      FSDP_CHECK(metrics, "cannot write --metrics '", o.metrics, "': ", std::strerror(errno));
    }

    BatchSampler sampler(o.seed, p.data.tokens, o.seq_len, o.global_batch,
                         o.data_order == "sequential");
    int64_t first_step = 0;
    if (o.resume) {
      // Every rank looks and decides; the ranks compare decisions through the store before any
      // collective, so a damaged checkpoint is the same error on every rank (resume.h).
      ResumeChoice choice;
      std::string error;
      try {
        choice = choose_resume(fsdp::list_checkpoints(o.checkpoint_dir), o.checkpoint_dir,
                               o.resume_fallback);
      } catch (const fsdp::Error& e) {
        error = e.what();
      }
      runtime->check_agreement("--resume's checkpoint", error.empty() ? choice.path.value_or("(none)")
                                                                      : error);
      if (!error.empty()) throw fsdp::Error(error);
      if (lead) {
        for (const auto& line : choice.notes) std::printf("%s\n", line.c_str());
      }
      const std::optional<std::string>& latest = choice.path;
      if (latest) {
        fsdp::TrainingState state;
        ckpt.loaded = fsdp::load_checkpoint(*latest, model, &optimizer, &state);
        FSDP_CHECK(state.step <= o.steps, "--resume: ", *latest, " is at step ", state.step,
                   ", beyond --steps ", o.steps, "; give --steps ", state.step, " or more");
        FSDP_CHECK(state.values.count("sampler"), "--resume: ", *latest, " has no data position; "
                   "it was not written by fsdp-train");
        sampler.restore(state.values.at("sampler"));
        first_step = ckpt.resumed_step = state.step;
        if (lead) {
          std::printf("fsdp-train: resumed from %s at step %lld (%s in %.3f s)\n", latest->c_str(),
                      static_cast<long long>(state.step),
                      fsdp::format_bytes(double(ckpt.loaded->bytes)).c_str(), ckpt.loaded->seconds);
          if (state.values.count("settings") && state.values.at("settings") != settings_line(o, p)) {
            std::printf("fsdp-train: note: the checkpoint was written with other settings (%s)\n",
                        state.values.at("settings").c_str());
          }
        }
      }
      std::fflush(stdout);
    }
    // NOTE [async saves in fsdp-train]: a background save is committed by the poll after a
    // later step (or by the wait before the next save, the final one or a signal's), and only
    // then are old checkpoints pruned: pruning never runs while a save is in flight, so it can
    // neither delete the ".partial" being written nor leave fewer than --keep-last complete.
    fsdp::AsyncCheckpointer saver;
    auto committed = [&](const fsdp::CheckpointInfo& info) {
      ckpt.last_save = info;
      ++ckpt.saves;
      if (lead && o.keep_last > 0) fsdp::prune_checkpoints(o.checkpoint_dir, o.keep_last);
    };
    auto finish_async_save = [&] {
      if (auto info = saver.wait()) committed(*info);
    };
    auto save = [&](int64_t steps_done, bool background) {
      fsdp::TrainingState state;
      state.step = steps_done;
      state.values["sampler"] = sampler.state();
      state.values["settings"] = settings_line(o, p);
      const std::string path = fsdp::checkpoint_path(o.checkpoint_dir, steps_done);
      finish_async_save();
      if (background) {
        saver.save(path, model, &optimizer, state);
        ++ckpt.async_saves;
        ckpt.async_blocked_s += saver.last_blocked_seconds();
        ckpt.staging_bytes = saver.staging_bytes();
        return;
      }
      committed(fsdp::save_checkpoint(path, model, &optimizer, state));
    };
    // Every rank saw `sig` after step `steps_done`: save it, bounded, then requeue (rank 0).
    auto stop_on_signal = [&](int sig, int64_t steps_done) {
      const std::string name = signal_name(sig);
      const std::string path = fsdp::checkpoint_path(o.checkpoint_dir, steps_done);
      {
        Deadline deadline(o.signal_save_timeout, 128 + sig,
                          cat("fsdp-train: error: rank ", rank, ": the save of step ", steps_done,
                              " on ", name, " did not finish within --signal-save-timeout ",
                              o.signal_save_timeout, " s; exiting without it"));
        finish_async_save();
        if (ckpt.saves == 0 || ckpt.last_save.path != path) save(steps_done, false);  // unless periodic
      }
      if (lead) {
        std::printf("\nfsdp-train: %s: saved step %lld to %s; exiting with status %d (continue "
                    "with --resume)\n", name.c_str(), static_cast<long long>(steps_done),
                    path.c_str(), 128 + sig);
        std::fflush(stdout);
        if (o.requeue) {
          // Bounded too: scontrol waits while slurmctld does not answer.
          const char* job = std::getenv("SLURM_JOB_ID");
          Deadline deadline(o.signal_save_timeout, 128 + sig,
                            cat("fsdp-train: error: 'scontrol requeue ", job ? job : "",
                                "' did not finish within --signal-save-timeout ",
                                o.signal_save_timeout, " s; exiting without requeueing (step ",
                                steps_done, " is saved: requeue or resubmit the job by hand)"));
          requeue_slurm_job();
          std::printf("fsdp-train: requeued SLURM job %s\n", std::getenv("SLURM_JOB_ID"));
          std::fflush(stdout);
        }
      }
    };
    PreemptSignals preempt(p.save_signals);
    int stopped_by = 0;  // the signal every rank stopped on (NOTE [preemption])
    Progress progress(o.steps, lead && !o.quiet);
    const int64_t K = o.grad_accum, T = o.seq_len;
    const auto world = runtime->world();
    const c10::Device device = runtime->device();  // cpu, or this rank's GPU with NCCL
    const auto train_start = Clock::now();
    auto validate = [&](int64_t steps_done) {
      if (!val) return;
      const double v = validation_loss(model, net, *val, o.eval_batches, o.global_batch, T,
                                       p.per_rank_batch, p.micro_batch, *runtime);
      FSDP_CHECK(std::isfinite(v), "the validation loss is ", v, " at step ", steps_done,
                 "; training diverged: lower --lr (", o.lr, ")");
      val_losses.emplace_back(steps_done, v);
      if (!lead) return;
      progress.validation(v);
      if (metrics.is_open()) {
        nlohmann::ordered_json j;
        j["step"] = steps_done;
        j["val_loss"] = v;
        metrics << j.dump() << "\n";
        metrics.flush();
      }
    };
    if (first_step == 0) validate(0);  // llm.c's convention: also before any update
    for (int64_t step = first_step; step < o.steps; ++step) {
      if (stopped_by != 0) {  // seen by every rank after the previous step
        stop_on_signal(stopped_by, step);
        return 128 + stopped_by;  // saved; the summary is for finished runs
      }
      const auto t0 = Clock::now();
      const auto comm_before = model.comm_counters();
      const std::vector<int64_t> offsets = sampler.next();
      const double lr = lr_at(o, step);
      for (auto& group : optimizer.param_groups()) {
        static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
      }
      // Gradients freed, not zeroed (libtorch 1.13's zero_grad() zeroes them and keeps them):
      // the forward then runs without a gradient copy of the model in memory, as on 2.x.
      for (auto& group : optimizer.param_groups()) {
        for (auto& param : group.params()) param.mutable_grad().reset();
      }
      double loss_sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        auto tokens = batch_tokens(data, offsets, rank * p.per_rank_batch + k * p.micro_batch,
                                   p.micro_batch, T)
                          .to(device);
        // Micro-steps before the last skip what --grad-sync allows (see NOTE [gradient
        // averaging] in fsdp/sharded.h: the engine averages over ranks, we over micro-steps).
        auto no_sync = model.no_sync(/*enabled=*/k + 1 < K);
        auto logits = model(tokens.narrow(1, 0, T));
        auto loss = torch::nn::functional::cross_entropy(
            logits.to(torch::kFloat).reshape({-1, logits.size(-1)}),
            tokens.narrow(1, 1, T).reshape({-1}));
        if (k + 1 == K) account.sample(step + 1, "forward", model.memory_stats(&optimizer));
        (loss / double(K)).backward();
        loss_sum += loss.item<double>();
      }
      account.sample(step + 1, "backward", model.memory_stats(&optimizer));
      if (o.clip_grad > 0) model.clip_grad_norm(o.clip_grad);
      optimizer.step();
      const double step_time = seconds_since(t0);

      // Per-step metrics: one all_gather of a few numbers per rank on the world group.
      const auto comm_after = model.comm_counters();
      const auto mem = model.memory_stats(&optimizer);
      auto mine = torch::zeros({kNumStats}, torch::kDouble);
      auto m = mine.accessor<double, 1>();
      m[kLoss] = loss_sum / double(K);
      m[kStepTime] = step_time;
      m[kShardedState] = double(mem.sharded_state_bytes());
      m[kGatheredPeak] = double(mem.unsharded_peak_bytes);
      m[kPeakRss] = double(peak_rss_bytes());
      m[kSignal] = double(preempt.received());
      for (size_t g = 0; g < comm_after.size(); ++g) {
        const double bytes = double((comm_after[g].second - comm_before[g].second).total_bytes());
        const std::string& kind = comm_after[g].first;
        if (kind == "shard") m[kCommShard] = bytes;
        if (kind == "replicate") m[kCommReplicate] = bytes;
        if (kind == "world") m[kCommWorld] = bytes;
      }
      // On the runtime's device: NCCL gathers only CUDA tensors.
      auto all = torch::zeros({W * kNumStats}, torch::TensorOptions(torch::kDouble).device(device));
      world->all_gather(all, mine.to(device))->wait();
      auto a = all.cpu().view({W, kNumStats});
      StepRecord rec;
      rec.loss = a.select(1, kLoss).sum().item<double>() / double(W);  // equal slices: mean
      rec.lr = lr;
      auto largest = std::get<0>(a.max(0));
      for (int64_t k = 0; k < kNumStats; ++k) rec.max[k] = largest[k].item<double>();
      rec.step_time_s = rec.max[kStepTime];
      rec.tokens_per_s = double(o.global_batch * T) / std::max(rec.step_time_s, 1e-9);
      // rec.loss is the same number on every rank, so every rank stops here together.
      FSDP_CHECK(std::isfinite(rec.loss), "the loss is ", rec.loss, " at step ", step + 1,
                 "; training diverged: lower --lr (", o.lr, ") or enable --clip-grad");
      records.push_back(rec);
      stopped_by = static_cast<int>(rec.max[kSignal]);  // the same on every rank
      double blocked_by_save = -1;  // a background save started after this step: its cost
      if (!o.checkpoint_dir.empty() && o.checkpoint_every > 0 &&
          (step + 1) % o.checkpoint_every == 0 && step + 1 < o.steps) {
        save(step + 1, o.checkpoint_async);
        if (o.checkpoint_async) blocked_by_save = saver.last_blocked_seconds();
      } else if (saver.in_flight()) {  // the same on every rank: poll is collective
        if (auto info = saver.poll()) committed(*info);
      }
      if (lead) {
        if (metrics.is_open()) {
          nlohmann::ordered_json j;
          j["step"] = step + 1;
          j["loss"] = rec.loss;
          j["lr"] = rec.lr;
          j["step_time_s"] = rec.step_time_s;
          j["tokens_per_s"] = rec.tokens_per_s;
          j["sharded_state_bytes"] = static_cast<int64_t>(rec.max[kShardedState]);
          j["peak_rss_bytes"] = static_cast<int64_t>(rec.max[kPeakRss]);
          j["comm_bytes"] = {{"shard", static_cast<int64_t>(rec.max[kCommShard])},
                             {"replicate", static_cast<int64_t>(rec.max[kCommReplicate])},
                             {"world", static_cast<int64_t>(rec.max[kCommWorld])}};
          if (blocked_by_save >= 0) j["checkpoint_blocked_s"] = blocked_by_save;
          if (step == first_step) {  // once per run: building and sharding the model
            j["construction"] = {{"init", construction.deferred ? "deferred" : "eager"},
                                 {"seconds", construction.seconds},
                                 {"peak_rss_bytes", construction.peak_rss}};
          }
          metrics << j.dump() << "\n";
          metrics.flush();  // a crash mid-run leaves every finished step readable
          FSDP_CHECK(metrics, "writing --metrics '", o.metrics, "' failed: ", std::strerror(errno));
        }
        progress.update(step + 1, rec.loss, rec.tokens_per_s, seconds_since(train_start));
      }
      const bool last = step + 1 == o.steps;
      if (o.eval_every > 0 ? (step + 1) % o.eval_every == 0 || last : last) validate(step + 1);
    }
    if (!o.checkpoint_dir.empty() && !records.empty()) save(o.steps, false);
    if (!o.export_full.empty()) {
      const auto t = Clock::now();
      fsdp::export_full_checkpoint(model, o.export_full);
      ckpt.exported = o.export_full;
      ckpt.export_s = seconds_since(t);
    }
    if (!o.export_llmc.empty()) {
      export_llmc(model, net, p.preset, o.export_llmc);
      ckpt.exported_llmc = o.export_llmc;
    }
    if (o.sample > 0) sample = sample_text(model, net, o, p.preset, *runtime);
  }  // every rank leaves the job here (Runtime's destructor waits for the others)

  if (!lead) return 0;
  print_summary(o, p, records, val_losses, report, seconds_since(start), ckpt, backend, heap,
                construction, account);
  if (o.sample > 0) {
    std::printf("\nfsdp-train: sample (%lld bytes, temperature %g, seed %lld):\n%s%s\n",
                static_cast<long long>(o.sample), o.temperature, static_cast<long long>(o.seed),
                printable(o.prompt).c_str(), printable(sample).c_str());
    std::fflush(stdout);
  }
  if (!o.plot.empty()) {
    fsdp_plot::LossCurve curve;
    curve.label = cat(fsdp::to_string(p.sharding.strategy), " ", mesh_string(p.sharding));
    for (size_t i = 0; i < records.size(); ++i) {
      curve.steps.push_back(ckpt.resumed_step + static_cast<int64_t>(i + 1));
      curve.losses.push_back(records[i].loss);
    }
    std::vector<fsdp_plot::LossCurve> curves = {curve};
    if (!val_losses.empty()) {
      fsdp_plot::LossCurve v;
      v.label = "validation";
      for (const auto& [step, loss] : val_losses) {
        v.steps.push_back(step);
        v.losses.push_back(loss);
      }
      curves.push_back(v);
    }
    fsdp_plot::plot_losses(curves, o.plot,
                           cat("fsdp-train: model ", p.preset.name, ", ",
                               fsdp::format_count(double(n_params)), " parameters, world ",
                               p.world_size));
    std::printf("  %-22s %s\n", "plot", o.plot.c_str());
  }
  return 0;
}

}  // namespace fsdp_train
