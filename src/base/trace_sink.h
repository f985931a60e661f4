// trace_sink.h (internal): where the library's code records timeline events for fsdp::Trace
// (fsdp/trace.h), and what that costs when no trace is on: one relaxed atomic load per span.
//
// A TraceSlot belongs to one Runtime (tests run several runtimes as threads of one process, so
// nothing here is process-wide): its groups, engine and checkpoint code record into it; Trace
// turns it on for the steps it covers and reads the events back. Events are complete events
// ("X": a name, a category, a start and a duration on this slot's clock, in nanoseconds) and
// counters ("C"), each on the thread that recorded it; a thread's name (set_trace_thread_name)
// becomes its track.
//
// NOTE [trace memory]
// An event is a fixed-size record (its name and text arguments cut to fixed lengths) stored in
// chunks of kChunk events that are allocated once and kept: recording allocates nothing per
// event. A first version built strings and JSON objects per event; on NO_SHARD GPT-2 that churn
// fragmented the heap under the training step's large activations and cost tens of thousands
// of page faults per step, which is exactly what the trace is meant to measure.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace fsdp::detail {

struct TraceArg {
  const char* key = nullptr;  // a string literal; nullptr: unused
  bool is_text = false;
  double number = 0;
  char text[48] = {};
};

struct TraceEvent {
  static constexpr int kMaxArgs = 6;
  char phase = 'X';        // 'X' complete, 'C' counter
  const char* category = "";  // a string literal
  char name[80] = {};
  int32_t tid = 0;         // the slot's number for the recording thread
  int64_t start_ns = 0;    // the slot's clock
  int64_t duration_ns = 0;
  TraceArg args[kMaxArgs];

  void set_name(std::string_view a, std::string_view b = {});
  TraceEvent& add(const char* key, double number);
  TraceEvent& add(const char* key, std::string_view text);
};

class TraceSlot {
 public:
  TraceSlot();
  ~TraceSlot();
  TraceSlot(const TraceSlot&) = delete;
  TraceSlot& operator=(const TraceSlot&) = delete;

  // Whether events are being recorded now (relaxed: a span that races the switch is dropped or
  // kept whole, never torn).
  bool on() const { return on_.load(std::memory_order_relaxed); }
  void set_on(bool on) { on_.store(on, std::memory_order_relaxed); }
  // The clock every event is stamped with, in nanoseconds (default: steady_clock). Set it only
  // while off.
  void set_clock(std::function<int64_t()> clock);
  int64_t now() const { return clock_(); }

  void record(TraceEvent& event);  // stamps the calling thread's tid
  // Every event recorded so far, and the tracks: (tid, thread name).
  std::vector<TraceEvent> events() const;
  std::vector<std::pair<int32_t, std::string>> threads() const;
  // The calling thread's tid (registered on first use).
  int32_t current_tid();
  void clear();
  // One fsdp::Trace at a time per slot: claim() is false while another holds it. Each claim
  // gets the next number (the same on every rank that claims in the same order).
  bool claim(int64_t* number);
  void release();

 private:
  static constexpr size_t kChunk = 2048;
  std::atomic<bool> on_{false};
  std::atomic<bool> claimed_{false};
  std::atomic<int64_t> claims_{0};
  std::function<int64_t()> clock_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<TraceEvent[]>> chunks_;
  size_t count_ = 0;
  std::vector<std::pair<std::thread::id, std::pair<int32_t, std::string>>> threads_;
};

// Names the calling thread's track in every trace ("training", "comm: shard group", ...). A
// thread that records without a name gets "thread N".
void set_trace_thread_name(std::string name);

// The slot of the training thread's trace, for code that has no runtime at hand (activation
// checkpointing's recomputation runs inside autograd's backward on that thread): fsdp::Trace
// sets it on the thread that calls begin_step, and clears it.
TraceSlot* thread_trace_slot();
void set_thread_trace_slot(TraceSlot* slot);

// A complete event on the calling thread, from construction to destruction; nothing when the
// slot is null or off at construction.
class TraceSpan {
 public:
  TraceSpan(TraceSlot* slot, const char* category, std::string_view name,
            std::string_view name_more = {});
  ~TraceSpan() { end(); }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;
  bool active() const { return slot_ != nullptr; }
  TraceSlot* slot() const { return slot_; }  // null once ended
  TraceSpan& arg(const char* key, double number);
  TraceSpan& arg(const char* key, std::string_view text);
  void end();  // records now (idempotent)

 private:
  TraceSlot* slot_ = nullptr;
  int64_t faults_ = 0;
  TraceEvent event_;
};

// A counter sample ("C" event) with up to TraceEvent::kMaxArgs series.
void trace_counter(TraceSlot* slot, const char* name,
                   std::initializer_list<std::pair<const char*, double>> values);

// Resident set size of this process in bytes (/proc/self/statm), for the memory counter.
int64_t resident_bytes();
// Minor page faults of the calling thread so far (getrusage RUSAGE_THREAD): every span records
// the faults its thread took inside it ("minor_faults"), which says which part of a step
// touches fresh memory.
int64_t thread_minor_faults();

}  // namespace fsdp::detail
