// Reading the per-rank timeline fsdp-train --trace writes (Chrome's trace event format, every
// timestamp on rank 0's clock) and the plans fsdp-plan --json writes, for fsdp-plot --trace
// (timeline.h). No libtorch.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_plot {

// Timestamps are microseconds as floats: ends this close count as equal.
constexpr double kTraceEpsUs = 1e-3;

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
// The same for a trace's text (`path` names it in the errors): what the fuzzer reads.
Trace parse_trace(const std::string& text, const std::string& path);

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
PlanTimes parse_plan(const std::string& text, const std::string& path, const Trace& trace);

// "3-5, 8": ascending step numbers as ranges.
std::string step_ranges(const std::vector<int64_t>& steps);

}  // namespace fsdp_plot
