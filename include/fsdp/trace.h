// fsdp/trace.h: where a training step's time goes, per rank, on one clock.
//
// A Trace records a timeline of chosen steps on every rank and merges it into one file in
// Chrome's trace event format ({"traceEvents": [...]}), which Perfetto (ui.perfetto.dev) and
// chrome://tracing open, and `fsdp-plot --trace` draws. One process per rank, named with its
// mesh coordinates ("rank 5: replica 1, shard 1"); one track per real thread:
//   - "training": each step ("step 4", category step); each unit's forward, backward and
//     activation-checkpointing recomputation (compute); the waits of this thread on collectives
//     ("wait all_gather unit 'block3'", category wait): the communication the step could not
//     hide; the caller's own spans (span(): optimizer, data, loss, eval, ...); checkpoint
//     staging and commit (checkpoint);
//   - "comm: shard group", "comm: replicate group", "comm: world group": each collective from
//     the moment the group's worker starts it to its completion (category collective), with its
//     op, group, unit, payload bytes, collective number and how long it queued behind the
//     group's earlier collectives (Gloo; NCCL collectives run on the GPU and are not recorded);
//   - "checkpoint writer": a background save's write;
//   - a counter track "memory": resident bytes and the engine's gathered/unsharded buffer bytes
//     after each unit's forward and backward, and resident bytes at the end of the caller's spans.
// Events of one thread nest and never overlap otherwise.
//
// One clock: at construction every rank estimates its clock's offset to rank 0's through the
// rendezvous store (clock_rounds round trips; the sample with the least delay wins; its half
// delay is the uncertainty), and every event is written on rank 0's clock. The offsets and
// uncertainties are in the file's "metadata".
//
// Cost: off (no Trace, or outside its steps) each instrumented point is one relaxed atomic load.
// On, an event is a fixed-size record in memory allocated once (nothing per event), bounded by
// the steps asked for; finish() merges through the store. docs/performance.md ("Where a step's
// time goes") measures it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/runtime.h"

namespace fsdp {

namespace detail {
class TraceSlot;
class TraceSpan;
}  // namespace detail

struct TraceOptions {
  std::string path;  // the merged file rank 0 writes (atomically); "" writes nothing
  // The steps recorded, 1-based and inclusive, as begin_step numbers them (fsdp-train: its
  // step counter + 1). first_step <= last_step, both >= 1.
  int64_t first_step = 3, last_step = 5;
  std::string strategy;       // metadata and the title of fsdp-plot's chart, e.g. "FULL_SHARD"
  std::vector<int64_t> mesh;  // (replicate, shard) for the process names; empty: (1, world)
  // The clock events are stamped with, in nanoseconds; default std::chrono::steady_clock. A test
  // gives one rank an offset and checks the estimate.
  std::function<int64_t()> clock;
  int64_t clock_rounds = 8;  // store round trips per rank for the offset estimate
};

// What finish() measured. On rank 0, every rank's entry; elsewhere only the caller's.
struct TraceSummary {
  // Per rank: seconds of the traced steps, of those spent waiting on collectives on the
  // training thread (exposed communication), and the fraction.
  std::vector<double> step_seconds, exposed_seconds, exposed_fraction;
  std::vector<double> offset_us, uncertainty_us;  // each rank's clock to rank 0's
  int64_t events = 0;    // events in the file (rank 0) or recorded by this rank
  bool written = false;  // rank 0 wrote options.path
};

class Trace {
 public:
  // Collective over the runtime's world (the clock exchange). Throws fsdp::Error for bad
  // options (steps, rounds) on every rank before any exchange, or if a trace is already active
  // on this runtime.
  Trace(std::shared_ptr<Runtime> runtime, TraceOptions options);
  ~Trace();  // stops recording; writes nothing
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;

  // Marks a training step on the calling thread (the "training" track): recording is on from
  // begin_step(first_step) to end_step() of last_step.
  void begin_step(int64_t step);
  void end_step();
  bool recording() const;

  // A span of the caller's on the calling thread, e.g. span("optimizer", "optimizer"): recorded
  // from here to the Span's destruction (or end()), if recording now; its end also samples the
  // "memory" counter's resident bytes (the first step's optimizer makes AdamW's state there).
  class Span {
   public:
    Span();
    Span(Span&&) noexcept;
    ~Span();
    void end();

   private:
    friend class Trace;
    std::unique_ptr<detail::TraceSpan> impl_;
  };
  Span span(const char* category, const std::string& name) const;

  // Collective: every rank hands its events (on rank 0's clock) to rank 0 through the store;
  // rank 0 writes options.path. Call once, after the last step.
  TraceSummary finish();
  // Local, for a failing run: writes what this rank recorded, on rank 0's clock, to
  // options.path (rank 0) or "<path without .json>.rank<r>.json" (other ranks), with
  // "complete": false and `reason` in the metadata. Never throws; returns the path written or
  // "" (no path, or the write failed).
  std::string write_partial(const std::string& reason) noexcept;

  double offset_us() const;       // this rank's clock to rank 0's (0 on rank 0)
  double uncertainty_us() const;  // half the round trip of the chosen sample

 private:
  std::string events_json() const;
  std::shared_ptr<Runtime> runtime_;
  TraceOptions options_;
  detail::TraceSlot* slot_;
  int64_t offset_ns_ = 0, uncertainty_ns_ = 0;
  int64_t key_ = 0;           // this trace's store prefix number
  int32_t training_tid_ = -1;
  int64_t step_ = 0, step_start_ns_ = -1, step_faults_ = 0;
  bool finished_ = false;
};

}  // namespace fsdp
