// One training step per rank as a Gantt chart (fsdp-plot --trace): reading the per-rank timeline
// fsdp-train --trace writes (Chrome's trace event format, every timestamp on rank 0's clock),
// measuring each rank's step (compute, exposed communication, update), optionally the planner's
// prediction for the same strategy and mesh beside it, and drawing it with gnuplot. No libtorch.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_plot {

// One complete event ("ph": "X") of a trace: a span of one thread of one rank.
struct TraceSpan {
  std::string name;
  std::string cat;      // "step", "compute", "collective", "wait", "optimizer", "data", ...
  int64_t pid = 0;      // the rank
  int64_t tid = 0;      // the thread
  double start_us = 0;  // on rank 0's clock
  double end_us = 0;
  int depth = 0;      // how many spans of the same thread contain it
  int64_t step = -1;  // cat "step": its step number ("args": {"step": N})
};

// A trace written by fsdp-train --trace.
struct Trace {
  std::string path;
  std::vector<TraceSpan> spans;                                     // every "X" event
  std::map<std::pair<int64_t, int64_t>, std::string> thread_names;  // (rank, tid) -> "training"
  // (rank, microseconds, bytes) of every "memory" counter's "rss_bytes".
  std::vector<std::pair<int64_t, std::pair<double, double>>> rss;
  std::string strategy;             // metadata "strategy" ("" when absent)
  std::vector<int64_t> mesh;        // metadata "mesh": {replicate, shard} (empty when absent)
  int64_t world_size = 0;           // metadata "world_size" (0 when absent)
  bool complete = true;             // false: the metadata says so, or the file was cut short
  std::string error;                // metadata "error": why the run wrote a partial trace
  double clock_uncertainty_us = 0;  // the largest of metadata "clock" "uncertainty_us"

  std::vector<int64_t> steps() const;  // the traced step numbers, ascending, each once
};

// Reads a trace. A file cut short (the run died while writing it) is read up to its last whole
// event, with complete = false. Throws fsdp::Error, one line naming the file: unreadable, not
// JSON, no "traceEvents" array, an "X" event without numeric pid, tid, ts and dur, no step events.
Trace read_trace(const std::string& path);

// The planner's prediction for one strategy and mesh.
struct PlanTimes {
  std::string label;  // "FULL_SHARD (1, 2) on this-machine"
  double compute_s = 0, exposed_s = 0, update_s = 0;
};

// The candidate of a plan (fsdp-plan --json, fsdp-train --plan --json) with the strategy (any
// case, '-' or '_') and mesh {replicate, shard} of the trace's metadata. Throws fsdp::Error, one
// line naming the file: the trace has no strategy and mesh, the plan is not JSON, has no
// candidates, or none with that strategy and mesh (saying why the planner excluded it, or which
// candidates there are).
PlanTimes read_plan(const std::string& path, const Trace& trace);

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

// The summary as text, one line a rank (and the plan's), for the terminal.
std::string describe(const TimelineSummary& summary, const std::optional<PlanTimes>& plan);

// "3-5, 8": ascending step numbers as ranges.
std::string step_ranges(const std::vector<int64_t>& steps);

}  // namespace fsdp_plot
