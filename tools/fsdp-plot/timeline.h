// One training step per rank as a Gantt chart (fsdp-plot --trace), from the per-rank timeline
// fsdp-train --trace writes (trace_file.h): each rank's step measured (compute, exposed
// communication, update), optionally the planner's prediction for the same strategy and mesh
// beside it, drawn with gnuplot. No libtorch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "trace_file.h"

namespace fsdp_plot {

// One rank's step, measured on its training thread. Each instant of the step counts once:
// inside a wait span (outermost) as exposed communication, else as the innermost span's
// category: compute, optimizer (update), or the rest (data, loss, eval, checkpoint, gaps).
struct RankStep {
  int64_t rank = 0;
  double start_us = 0, end_us = 0;
  double compute_us = 0, exposed_us = 0, update_us = 0;
  double peak_rss_bytes = 0;  // the largest "memory" counter inside the step (0: none)
  double duration_us() const { return end_us - start_us; }
  double exposed_fraction() const;  // exposed_us over the duration
};

struct TimelineOptions {
  std::optional<int64_t> step;    // default: the middle traced step
  std::optional<PlanTimes> plan;  // adds the predicted-vs-measured rows
  std::string title;              // the title's first line; default: the step and the file
};

// What plot_timeline drew.
struct TimelineSummary {
  int64_t step = 0;
  std::vector<RankStep> ranks;         // by rank
  std::vector<int64_t> missing_ranks;  // ranks in the trace without this step
  size_t rows = 0;                     // thread rows drawn
};

// Draws one step of `trace` into `png` with gnuplot (run_gnuplot_script: same errors). Throws
// fsdp::Error if the step is not in the trace, naming the steps that are.
TimelineSummary plot_timeline(const Trace& trace, const TimelineOptions& options,
                              const std::string& png);
// The gnuplot script plot_timeline runs, and in `summary` what it draws; the same errors, and
// no gnuplot needed.
std::string timeline_script(const Trace& trace, const TimelineOptions& options,
                            const std::string& png, TimelineSummary* summary);

// The summary as text, one line a rank (and the plan's), for the terminal.
std::string describe(const TimelineSummary& summary, const std::optional<PlanTimes>& plan);

}  // namespace fsdp_plot
