// fsdp-train's model construction (see build_model.h).
#include "build_model.h"

#include <sys/stat.h>

#include <chrono>
#include <optional>

#include "fsdp/checkpoint.h"
#include "fsdp/deferred_init.h"
#include "fsdp/error.h"
#include "fsdp/memory.h"
#include "fsdp/report.h"
#include "elapsed.h"
#include "dcp.h"
#include "llmc.h"

namespace fsdp_train {

using fsdp::cat;

namespace {

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

std::string Construction::describe() const {
  std::string s = deferred ? cat("deferred: ", units_deferred, " units sharded as they were built "
                                 "(largest ", fsdp::format_bytes(double(largest_unit_bytes)), ")")
                           : std::string("eager: the whole model built, then sharded");
  s += cat(", peak RSS ", fsdp::format_bytes(double(peak_rss)),
           peak_rss_reset ? "" : " (since start: clear_refs refused)", ", ");
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f s", seconds);
  s += buf;
  if (!init_from.empty()) {
    std::snprintf(buf, sizeof buf, "%.2f s", init_from_seconds);
    s += cat("; weights from ", init_from, " (", buf, ")");
  }
  return s;
}

Model build_model(const TrainOptions& o, const TrainPlan& p,
                  const std::shared_ptr<fsdp::Runtime>& runtime, Construction* info) {
  info->deferred = p.deferred_init;
  info->peak_rss_reset = fsdp::reset_peak_rss();
  const auto start = std::chrono::steady_clock::now();
  std::optional<fsdp::DeferredInit> init;
  if (p.deferred_init) init.emplace(p.strategy, runtime);
  torch::manual_seed(static_cast<uint64_t>(o.seed));
  auto net = make_model(p.preset, o.freeze);
  for (const auto& q : net->parameters()) info->params += q.numel();
  freeze_parameters(*net, o.freeze);  // the root's; each block froze its own
  Model model = init ? fsdp::shard(net, *init) : fsdp::shard(net, p.strategy, runtime);
  info->seconds = seconds_since(start);
  info->peak_rss = fsdp::process_memory().peak_rss;
  info->peak_rss_reset_after = info->peak_rss_reset && fsdp::reset_peak_rss();
  if (init) {
    info->units_deferred = init->stats().units;
    info->largest_unit_bytes = init->stats().largest_unit_bytes;
  }
  if (!o.init_from.empty()) {
    const auto t = std::chrono::steady_clock::now();
    if (fsdp::is_dcp_checkpoint(o.init_from)) {
      // With --init-from-optimizer the trainer reads it, once its optimizer exists.
      if (!o.init_from_optimizer) {
        info->dcp = fsdp::import_dcp(model, o.init_from, nullptr, dcp_options(o, p.preset, false));
      }
    } else if (init_from_llmc_file(o.init_from)) {
      // Every rank maps the file and copies only the byte ranges its shards hold.
      init_from_llmc(model, p.preset, o.init_from);
    } else if (is_directory(o.init_from)) {
      fsdp::CheckpointOptions weights_only;
      weights_only.rng = false;  // a new run: its own seed draws, not the old run's
      fsdp::load_checkpoint(o.init_from, model, /*optimizer=*/nullptr, /*state=*/nullptr,
                            weights_only);
    } else {
      fsdp::import_full_checkpoint(model, o.init_from);
    }
    if (!(fsdp::is_dcp_checkpoint(o.init_from) && o.init_from_optimizer)) {
      info->init_from = o.init_from;
      info->init_from_seconds = seconds_since(t);
    }
  }
  return model;
}

}  // namespace fsdp_train
