// fsdp-train's end-of-run summary (see summary.h).
#include "summary.h"

#include <algorithm>
#include <cstdio>

#include "fsdp/error.h"

namespace fsdp_train {

using fsdp::cat;

std::string mesh_string(const fsdp::ShardingPlan& s) {
  return cat("(", s.replicate_size(), ", ", s.shard_size(), ")");
}

namespace {

// One line of the summary: "  key                    value".
void row(const std::string& key, const std::string& value) {
  std::printf("  %-22s %s\n", key.c_str(), value.c_str());
}

std::string seconds_text(double seconds) {
  char s[32];
  std::snprintf(s, sizeof(s), "%.3f", seconds);
  return s;
}

std::string rate(double bytes, double seconds) {
  return cat(fsdp::format_bytes(bytes), " in ", seconds_text(seconds), " s (",
             fsdp::format_bytes(bytes / std::max(seconds, 1e-9)), "/s)");
}

// Minor page faults per step (largest rank), the first steps apart: they allocate for good.
// Steady steps that fault are touching fresh memory every step (NOTE [gradient pool]).
void print_faults(const std::vector<StepRecord>& steps) {
  const size_t first = std::min<size_t>(3, steps.size() - 1);
  std::vector<double> steady;
  for (size_t i = first; i < steps.size(); ++i) steady.push_back(steps[i].max[kMinorFaults]);
  std::sort(steady.begin(), steady.end());
  row("  page faults", cat(fsdp::format_count(steady[steady.size() / 2]), " minor faults per step",
                           first > 0 ? cat(" after step ", first) : std::string(),
                           " (median; step 1: ", fsdp::format_count(steps[0].max[kMinorFaults]),
                           "; largest rank, whole process)"));
}

// --trace: the file, and each rank's exposed communication (its training thread's waits on
// collectives) over the traced steps.
void print_trace(const TrainOptions& o, const TrainPlan& p, const fsdp::TraceSummary& t) {
  double uncertainty = 0;
  for (double u : t.uncertainty_us) uncertainty = std::max(uncertainty, u);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.0f", uncertainty);
  row("trace", cat(o.trace, " (steps ", p.trace_first, " to ", p.trace_last, ", ", t.events,
                   " events; every rank on rank 0's clock within ", buf, " us)"));
  std::string ranks;
  for (size_t r = 0; r < t.exposed_fraction.size(); ++r) {
    std::snprintf(buf, sizeof buf, "%s%zu: %.1f%%", r ? ", " : "", r, 100 * t.exposed_fraction[r]);
    ranks += buf;
  }
  row("  exposed communication", cat(ranks, " of the step (trace: the training thread's waits "
                                     "on collectives)"));
}

// The summary's memory lines: each rank's largest, and where rank 0's goes.
void print_memory(const double (&peak)[kNumStats], double replica, const MemoryAccount& account) {
  char buf[256];
  std::printf("  memory per rank (largest rank)\n");
  row("  sharded state", cat(fsdp::format_bytes(peak[kShardedState]),
                             " (parameter and gradient shards, AdamW state)"));
  row("  one replica", cat(fsdp::format_bytes(replica), " (the same unsharded, as DDP keeps it)"));
  if (peak[kShardedState] > 0) {
    std::snprintf(buf, sizeof(buf), "%.2fx less", replica / peak[kShardedState]);
    row("  saving", buf);
  }
  row("  gathered peak", cat(fsdp::format_bytes(peak[kGatheredPeak]),
                             " (unsharded parameters and gradients held at once)"));
  row("  peak RSS", cat(fsdp::format_bytes(peak[kPeakRss]), " (whole process)"));
  if (peak[kPeakRssAfter] > 0) {
    row("  after construction", cat(fsdp::format_bytes(peak[kPeakRssAfter]),
                                    " (peak RSS since the model was sharded: training, loading)"));
  }
  if (!account.empty()) {
    std::printf("  where rank 0's memory goes (anonymous RSS at its largest sampled: the end of "
                "step %lld's %s)\n",
                static_cast<long long>(account.step()), account.when());
    for (const auto& part : account.parts()) {
      row("  " + part.name, cat(fsdp::format_bytes(double(part.bytes)), " (", part.what, ")"));
    }
    const double off = 100.0 * (double(account.sum()) / double(account.measured()) - 1.0);
    char line[96];
    std::snprintf(line, sizeof line, " = %+.1f%% of the measured RssAnon ", off);
    row("  sum of the parts", cat(fsdp::format_bytes(double(account.sum())), line,
                                  fsdp::format_bytes(double(account.measured()))));
  }
}

// The summary's communication lines against the plan's.
void print_communication(const double (&mean)[kNumStats], const fsdp::StepComm& c) {
  std::printf("  communication per step (payload one rank issues; largest rank, mean of steps)\n");
  row("  shard group", cat(fsdp::format_bytes(mean[kCommShard]), "  (plan: ",
                           fsdp::format_bytes(double(c.shard_all_gather + c.shard_reduce_scatter +
                                                     c.shard_all_reduce)),
                           ")"));
  row("  replicate group", cat(fsdp::format_bytes(mean[kCommReplicate]), "  (plan: ",
                               fsdp::format_bytes(double(c.replicate_all_reduce)), ")"));
  row("  world group", fsdp::format_bytes(mean[kCommWorld]));
}

}  // namespace

void print_checkpoints(const TrainOptions& o, const CheckpointLog& c) {
  if (c.loaded) {
    row("resumed from", cat(c.loaded->path, " (step ", c.resumed_step, "): read ",
                            rate(double(c.loaded->bytes), c.loaded->seconds), " on rank 0"));
  }
  if (c.saves > 0) {
    row("checkpoints", cat(c.saves, " saved in ", o.checkpoint_dir, "; last ", c.last_save.path,
                           ": ", rate(double(c.last_save.bytes), c.last_save.seconds),
                           c.last_save.write_seconds > 0
                               ? cat(", its files written in ",
                                     seconds_text(c.last_save.write_seconds),
                                     " s (slowest rank, fsync included)")
                               : std::string()));
  }
  if (c.async_saves > 0) {
    char s[32];
    std::snprintf(s, sizeof(s), "%.4f", c.async_blocked_s / double(c.async_saves));
    const std::string w = c.async_committed > 0
                              ? seconds_text(c.async_write_s / double(c.async_committed))
                              : std::string("-");
    row("async checkpoints", cat(c.async_saves, " written in the background; training blocked ",
                                 s, " s per save on rank 0 (staging buffer ",
                                 fsdp::format_bytes(double(c.staging_bytes)),
                                 "); background write ", w, " s per save (slowest rank, fsync "
                                 "included)",
                                 c.page_cache_writes > 0
                                     ? cat("; ", c.page_cache_writes,
                                           " file(s) through the page cache: no O_DIRECT there")
                                     : std::string()));
  }
  if (!c.exported.empty()) {
    char s[32];
    std::snprintf(s, sizeof(s), "%.2f", c.export_s);
    row("full export", cat(c.exported, " (", s, " s)"));
  }
  if (!c.exported_llmc.empty()) row("llm.c export", c.exported_llmc);
}

void print_summary(const TrainOptions& o, const TrainPlan& p, const std::vector<StepRecord>& steps,
                   const ValLosses& val, const fsdp::TopologyReport& report, double total_s,
                   const CheckpointLog& ckpt, const std::string& backend, const std::string& heap,
                   const Construction& construction, const MemoryAccount& account,
                   const std::optional<fsdp::TraceSummary>& trace) {
  if (steps.empty()) {
    std::printf("\nfsdp-train summary: no steps to train (the checkpoint is at --steps %lld)\n",
                static_cast<long long>(o.steps));
    print_checkpoints(o, ckpt);
    std::fflush(stdout);
    return;
  }
  // Throughput leaves out step 1 (allocations, first touch of memory) unless it is the only one.
  const size_t first = steps.size() > 1 ? 1 : 0;
  double time = 0;
  for (size_t i = first; i < steps.size(); ++i) time += steps[i].step_time_s;
  const double mean_step = time / double(steps.size() - first);
  const int64_t tokens_per_step = o.global_batch * o.seq_len;
  double peak[kNumStats] = {}, mean[kNumStats] = {};
  for (const auto& s : steps) {
    for (int64_t k = 0; k < kNumStats; ++k) {
      peak[k] = std::max(peak[k], s.max[k]);
      mean[k] += s.max[k] / double(steps.size());
    }
  }
  const double replica = double(report.replica.total());
  std::printf("\nfsdp-train summary: %zu steps in %.1f s, %s on mesh %s, world %lld\n",
              steps.size(), total_s, fsdp::to_string(p.sharding.strategy),
              mesh_string(p.sharding).c_str(), static_cast<long long>(p.world_size));
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%.4f (step 1: %.4f; mean over the global batch)",
                steps.back().loss, steps.front().loss);
  row("final loss", buf);
  if (!val.empty()) {
    std::snprintf(buf, sizeof(buf), "%.4f at step %lld (step %lld: %.4f; mean over %lld x %lld "
                  "x %lld tokens of --val-data)", val.back().second,
                  static_cast<long long>(val.back().first), static_cast<long long>(val[0].first),
                  val[0].second, static_cast<long long>(o.eval_batches),
                  static_cast<long long>(o.global_batch), static_cast<long long>(o.seq_len));
    row("val loss", buf);
  }
  row("backend", backend);
  row("heap", heap);
  row("construction", construction.describe());
  row("parameters",
      report.trainable_params < report.total_params
          ? cat(fsdp::format_count(double(report.trainable_params)), " trainable of ",
                fsdp::format_count(double(report.total_params)), " (--freeze: the rest get no "
                "gradient, reduction or optimizer state)")
          : cat(fsdp::format_count(double(report.total_params)), ", all trainable"));
  row("activations", o.activation_checkpointing
                         ? "checkpointed: every block recomputes its forward in backward"
                         : "kept for backward (--activation-checkpointing recomputes them)");
  std::snprintf(buf, sizeof(buf), "%s tokens/s (%.3f s per step of %lld tokens)",
                fsdp::format_count(double(tokens_per_step) / mean_step).c_str(), mean_step,
                static_cast<long long>(tokens_per_step));
  row("throughput", buf);
  print_memory(peak, replica, account);
  print_faults(steps);
  print_communication(mean, report.comm);
  if (trace) print_trace(o, p, *trace);
  print_checkpoints(o, ckpt);
  if (!o.metrics.empty()) row("metrics", o.metrics);
  std::fflush(stdout);
}

}  // namespace fsdp_train
