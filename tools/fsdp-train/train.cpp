// fsdp-train's modes (see train.h): the dry run, the --freeze check, and training, whose run on
// each rank is the Trainer's (trainer.h), followed by rank 0's summary once the job has ended.
#include "train.h"

#include <chrono>
#include <cstdio>
#include <iostream>

#include "fsdp/error.h"
#include "fsdp/report.h"
#include "fsdp/sharded.h"
#include "elapsed.h"
#include "gpt2.h"
#include "plot.h"
#include "summary.h"
#include "trainer.h"

namespace fsdp_train {

using fsdp::cat;
using Clock = std::chrono::steady_clock;

namespace {

// Bytes a terminal can show: control characters other than newline and tab become '?'.
std::string printable(std::string s) {
  for (char& c : s) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f) c = '?';
  }
  return s;
}

// Rank 0, after the job: the summary, --sample's text and the --plot.
void print_results(const TrainOptions& o, const TrainPlan& p, const RunLog& log, double total_s) {
  print_summary(o, p, log.records, log.val_losses, log.report, total_s, log.ckpt, log.backend,
                log.heap, log.construction, log.account, log.trace);
  if (o.sample > 0) {
    std::printf("\nfsdp-train: sample (%lld bytes, temperature %g, seed %lld):\n%s%s\n",
                static_cast<long long>(o.sample), o.temperature, static_cast<long long>(o.seed),
                printable(o.prompt).c_str(), printable(log.sample).c_str());
    std::fflush(stdout);
  }
  if (o.plot.empty()) return;
  fsdp_plot::LossCurve curve;
  curve.label = cat(fsdp::to_string(p.sharding.strategy), " ", mesh_string(p.sharding));
  for (size_t i = 0; i < log.records.size(); ++i) {
    curve.steps.push_back(log.ckpt.resumed_step + static_cast<int64_t>(i + 1));
    curve.losses.push_back(log.records[i].loss);
  }
  std::vector<fsdp_plot::LossCurve> curves = {curve};
  if (!log.val_losses.empty()) {
    fsdp_plot::LossCurve v;
    v.label = "validation";
    for (const auto& [step, loss] : log.val_losses) {
      v.steps.push_back(step);
      v.losses.push_back(loss);
    }
    curves.push_back(v);
  }
  fsdp_plot::plot_losses(curves, o.plot,
                         cat("fsdp-train: model ", p.preset.name, ", ",
                             fsdp::format_count(double(log.construction.params)),
                             " parameters, world ", p.world_size));
  std::printf("  %-22s %s\n", "plot", o.plot.c_str());
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
  const auto start = Clock::now();
  RunLog log;
  {
    Trainer trainer(o, p, &log);
    const int status = trainer.run();
    if (status != 0) return status;  // saved on a signal; the summary is for finished runs
  }  // every rank leaves the job here (Runtime's destructor waits for the others)
  if (log.lead) print_results(o, p, log, seconds_since(start));
  return 0;
}

}  // namespace fsdp_train
