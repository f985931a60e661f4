// The recording side of fsdp::Trace (see trace_sink.h).
#include "base/trace_sink.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

namespace fsdp::detail {
namespace {

thread_local std::string t_thread_name;
thread_local TraceSlot* t_slot = nullptr;

void copy_into(char* dst, size_t cap, std::string_view a, std::string_view b) {
  size_t n = std::min(a.size(), cap - 1);
  std::memcpy(dst, a.data(), n);
  if (!b.empty() && n < cap - 1) {
    dst[n++] = ' ';
    const size_t m = std::min(b.size(), cap - 1 - n);
    std::memcpy(dst + n, b.data(), m);
    n += m;
  }
  dst[n] = '\0';
}

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void TraceEvent::set_name(std::string_view a, std::string_view b) {
  copy_into(name, sizeof(name), a, b);
}

TraceEvent& TraceEvent::add(const char* key, double value) {
  for (auto& a : args) {
    if (a.key) continue;
    a.key = key;
    a.number = value;
    return *this;
  }
  return *this;  // full: extra arguments are dropped
}

TraceEvent& TraceEvent::add(const char* key, std::string_view text) {
  for (auto& a : args) {
    if (a.key) continue;
    a.key = key;
    a.is_text = true;
    copy_into(a.text, sizeof(a.text), text, {});
    return *this;
  }
  return *this;
}

TraceSlot::TraceSlot() : clock_(steady_ns) {}
TraceSlot::~TraceSlot() = default;

void TraceSlot::set_clock(std::function<int64_t()> clock) {
  clock_ = clock ? std::move(clock) : std::function<int64_t()>(steady_ns);
}

int32_t TraceSlot::current_tid() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto id = std::this_thread::get_id();
  for (const auto& t : threads_) {
    if (t.first == id) return t.second.first;
  }
  const auto tid = static_cast<int32_t>(threads_.size());
  std::string name = t_thread_name.empty() ? "thread " + std::to_string(tid) : t_thread_name;
  threads_.push_back({id, {tid, std::move(name)}});
  return tid;
}

void TraceSlot::record(TraceEvent& event) {
  event.tid = current_tid();
  std::lock_guard<std::mutex> lock(mu_);
  if (count_ == chunks_.size() * kChunk) chunks_.push_back(std::make_unique<TraceEvent[]>(kChunk));
  chunks_[count_ / kChunk][count_ % kChunk] = event;
  ++count_;
}

std::vector<TraceEvent> TraceSlot::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TraceEvent> out;
  out.reserve(count_);
  for (size_t i = 0; i < count_; ++i) out.push_back(chunks_[i / kChunk][i % kChunk]);
  return out;
}

std::vector<std::pair<int32_t, std::string>> TraceSlot::threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<int32_t, std::string>> out;
  for (const auto& t : threads_) out.push_back(t.second);
  return out;
}

void TraceSlot::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  count_ = 0;  // the chunks stay: the next trace records into them
}

bool TraceSlot::claim(int64_t* number) {
  bool expected = false;
  if (!claimed_.compare_exchange_strong(expected, true)) return false;
  *number = ++claims_;
  return true;
}

void TraceSlot::release() {
  set_on(false);
  claimed_ = false;
}

void set_trace_thread_name(std::string name) { t_thread_name = std::move(name); }
TraceSlot* thread_trace_slot() { return t_slot; }
void set_thread_trace_slot(TraceSlot* slot) { t_slot = slot; }

TraceSpan::TraceSpan(TraceSlot* slot, const char* category, std::string_view name,
                     std::string_view name_more) {
  if (!slot || !slot->on()) return;
  slot_ = slot;
  event_.category = category;
  event_.set_name(name, name_more);
  event_.start_ns = slot->now();
}

TraceSpan& TraceSpan::arg(const char* key, double number) {
  if (slot_) event_.add(key, number);
  return *this;
}

TraceSpan& TraceSpan::arg(const char* key, std::string_view text) {
  if (slot_) event_.add(key, text);
  return *this;
}

void TraceSpan::end() {
  if (!slot_) return;
  event_.duration_ns = slot_->now() - event_.start_ns;
  slot_->record(event_);
  slot_ = nullptr;
}

void trace_counter(TraceSlot* slot, const char* name,
                   std::initializer_list<std::pair<const char*, double>> values) {
  if (!slot || !slot->on()) return;
  TraceEvent e;
  e.phase = 'C';
  e.category = "memory";
  e.set_name(name);
  e.start_ns = slot->now();
  for (const auto& v : values) e.add(v.first, v.second);
  slot->record(e);
}

int64_t resident_bytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE)) : 0;
}

}  // namespace fsdp::detail
