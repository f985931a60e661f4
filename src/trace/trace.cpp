// fsdp::Trace (see fsdp/trace.h): the steps it covers, the clock exchange, the merge and the
// event format. Recording itself is base/trace_sink.h.
#include "fsdp/trace.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <limits>
#include <sstream>

#include "base/trace_sink.h"
#include "fsdp/error.h"
#include "runtime/runtime_internal.h"

namespace fsdp {

using detail::cat;
using detail::TraceEvent;

namespace {

void append_escaped(std::string& out, const char* s) {
  out += '"';
  for (; *s; ++s) {
    const unsigned char c = static_cast<unsigned char>(*s);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
}

void append_number(std::string& out, double v) {
  char buf[40];
  if (v == static_cast<double>(static_cast<int64_t>(v)) && std::abs(v) < 9e15) {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
  } else {
    std::snprintf(buf, sizeof buf, "%.3f", v);
  }
  out += buf;
}

// "rank 5: replica 1, shard 1".
std::string process_name(int64_t rank, const std::vector<int64_t>& mesh) {
  const int64_t shard = mesh.size() == 2 && mesh[1] > 0 ? mesh[1] : 0;
  if (shard == 0) return cat("rank ", rank);
  return cat("rank ", rank, ": replica ", rank / shard, ", shard ", rank % shard);
}

int64_t parse_int(const std::vector<uint8_t>& v) {
  return std::stoll(std::string(v.begin(), v.end()));
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// The whole file at once, then renamed into place: a reader never sees half a trace.
void write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  FSDP_CHECK(f, "cannot write the trace '", tmp, "': ", std::strerror(errno));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const bool closed = std::fclose(f) == 0;
  FSDP_CHECK(ok && closed, "writing the trace '", tmp, "' failed: ", std::strerror(errno));
  FSDP_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename the trace '", tmp,
             "' to '", path, "': ", std::strerror(errno));
}

}  // namespace

Trace::Trace(std::shared_ptr<Runtime> runtime, TraceOptions options)
    : runtime_(std::move(runtime)), options_(std::move(options)) {
  FSDP_CHECK(runtime_, "fsdp::Trace needs a runtime");
  const auto& o = options_;
  FSDP_CHECK(o.first_step >= 1 && o.last_step >= o.first_step, "trace steps ", o.first_step, ":",
             o.last_step, " are invalid; give first:last with 1 <= first <= last, e.g. 3:5");
  FSDP_CHECK(o.clock_rounds >= 1 && o.clock_rounds <= 1000, "trace clock_rounds ",
             o.clock_rounds, " is invalid; give 1 to 1000");
  if (!o.mesh.empty()) {
    FSDP_CHECK(o.mesh.size() == 2 && o.mesh[0] * o.mesh[1] == runtime_->world_size(),
               "trace mesh does not cover the world of ", runtime_->world_size(),
               " ranks; give (replicate, shard) or leave it empty");
  }
  slot_ = detail::trace_slot(*runtime_);
  FSDP_CHECK(slot_->claim(&key_), "a trace is already active on this runtime; finish it first");
  slot_->set_clock(o.clock);
  slot_->clear();
  // The clock exchange (NOTE in fsdp/trace.h): rank 0 answers each rank's pings in turn.
  const int64_t W = runtime_->world_size(), r = runtime_->rank();
  if (W == 1) return;
  auto store = detail::runtime_store(*runtime_);
  const std::string prefix = cat("fsdp/trace/", key_, "/");
  if (r == 0) {
    for (int64_t i = 1; i < W; ++i) {
      for (int64_t k = 0; k < o.clock_rounds; ++k) {
        store->get(cat(prefix, "ping/", i, "/", k));
        store->set(cat(prefix, "pong/", i, "/", k), bytes_of(std::to_string(slot_->now())));
      }
    }
    return;
  }
  int64_t best = std::numeric_limits<int64_t>::max();
  for (int64_t k = 0; k < o.clock_rounds; ++k) {
    const int64_t t1 = slot_->now();
    store->set(cat(prefix, "ping/", r, "/", k), bytes_of("1"));
    const int64_t t0 = parse_int(store->get(cat(prefix, "pong/", r, "/", k)));
    const int64_t t2 = slot_->now();
    if (t2 - t1 < best) {
      best = t2 - t1;
      offset_ns_ = t0 - (t1 + (t2 - t1) / 2);
      uncertainty_ns_ = (t2 - t1 + 1) / 2;
    }
  }
}

Trace::~Trace() {
  if (step_start_ns_ >= 0) detail::set_thread_trace_slot(nullptr);
  slot_->release();
}

void Trace::begin_step(int64_t step) {
  step_ = step;
  if (step == options_.first_step) {
    detail::set_trace_thread_name("training");
    training_tid_ = slot_->current_tid();
    detail::set_thread_trace_slot(slot_);
    slot_->set_on(true);
  }
  step_start_ns_ = slot_->on() ? slot_->now() : -1;
  if (step_start_ns_ >= 0) step_faults_ = detail::thread_minor_faults();
}

void Trace::end_step() {
  if (step_start_ns_ >= 0 && slot_->on()) {
    TraceEvent e;
    e.category = "step";
    e.set_name(cat("step ", step_));
    e.start_ns = step_start_ns_;
    e.duration_ns = slot_->now() - step_start_ns_;
    e.add("step", double(step_));
    e.add("minor_faults", double(detail::thread_minor_faults() - step_faults_));
    slot_->record(e);
  }
  step_start_ns_ = -1;
  if (step_ == options_.last_step) {
    slot_->set_on(false);
    detail::set_thread_trace_slot(nullptr);
  }
}

bool Trace::recording() const { return slot_->on(); }

Trace::Span::Span() = default;
Trace::Span::Span(Span&&) noexcept = default;
Trace::Span::~Span() { end(); }
void Trace::Span::end() {
  if (!impl_ || !impl_->active()) return;
  detail::TraceSlot* slot = impl_->slot();
  impl_->end();
  detail::trace_counter(slot, "memory", {{"rss_bytes", double(detail::resident_bytes())}});
}

Trace::Span Trace::span(const char* category, const std::string& name) const {
  Span s;
  if (slot_->on()) s.impl_ = std::make_unique<detail::TraceSpan>(slot_, category, name);
  return s;
}

double Trace::offset_us() const { return double(offset_ns_) / 1e3; }
double Trace::uncertainty_us() const { return double(uncertainty_ns_) / 1e3; }

// This rank's events as JSON array elements (no brackets), on rank 0's clock, then
// "\n#summary step_ns exposed_ns offset_ns uncertainty_ns events".
std::string Trace::events_json() const {
  const int64_t rank = runtime_->rank();
  std::string out;
  auto meta = [&](const char* what, int64_t tid, const std::string& name) {
    out += cat("{\"ph\":\"M\",\"name\":\"", what, "\",\"pid\":", rank, ",\"tid\":", tid,
               ",\"args\":{\"name\":");
    append_escaped(out, name.c_str());
    out += "}},\n";
  };
  meta("process_name", 0, process_name(rank, options_.mesh));
  out += cat("{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":", rank,
             ",\"tid\":0,\"args\":{\"sort_index\":", rank, "}},\n");
  for (const auto& t : slot_->threads()) meta("thread_name", t.first, t.second);
  const auto events = slot_->events();
  // Steps and the training thread's waits inside them: the exposed communication.
  std::vector<std::pair<int64_t, int64_t>> steps;
  for (const auto& e : events) {
    if (e.phase == 'X' && std::string(e.category) == "step") {
      steps.emplace_back(e.start_ns, e.start_ns + e.duration_ns);
    }
  }
  int64_t step_ns = 0, exposed_ns = 0;
  for (const auto& s : steps) step_ns += s.second - s.first;
  for (const auto& e : events) {
    const double ts = double(e.start_ns + offset_ns_) / 1e3;
    out += cat("{\"ph\":\"", e.phase, "\",\"cat\":\"", e.category, "\",\"name\":");
    append_escaped(out, e.name);
    out += cat(",\"pid\":", rank, ",\"tid\":", e.tid, ",\"ts\":");
    append_number(out, ts);
    if (e.phase == 'X') {
      out += ",\"dur\":";
      append_number(out, double(e.duration_ns) / 1e3);
    }
    out += ",\"args\":{";
    bool first = true;
    for (const auto& a : e.args) {
      if (!a.key) continue;
      out += first ? "" : ",";
      first = false;
      append_escaped(out, a.key);
      out += ':';
      if (a.is_text) {
        append_escaped(out, a.text);
      } else {
        append_number(out, a.number);
      }
    }
    out += "}},\n";
    if (e.phase == 'X' && e.tid == training_tid_ && std::string(e.category) == "wait") {
      for (const auto& s : steps) {
        if (e.start_ns >= s.first && e.start_ns < s.second) {
          exposed_ns += std::min(e.duration_ns, s.second - e.start_ns);
          break;
        }
      }
    }
  }
  out += cat("#summary ", step_ns, " ", exposed_ns, " ", offset_ns_, " ", uncertainty_ns_, " ",
             events.size());
  return out;
}

namespace {

struct RankPart {
  std::string events;  // JSON elements, each followed by ",\n"
  int64_t step_ns = 0, exposed_ns = 0, offset_ns = 0, uncertainty_ns = 0, count = 0;
};

RankPart split(const std::string& text) {
  RankPart p;
  const size_t at = text.rfind("#summary ");
  TORCH_INTERNAL_ASSERT(at != std::string::npos, "trace part without its summary");
  p.events = text.substr(0, at);
  std::istringstream in(text.substr(at + 9));
  in >> p.step_ns >> p.exposed_ns >> p.offset_ns >> p.uncertainty_ns >> p.count;
  return p;
}

std::string document(const std::vector<RankPart>& parts, const TraceOptions& o, int64_t world,
                     bool complete, const std::string& reason) {
  std::string out = "{\"traceEvents\":[\n";
  for (const auto& p : parts) out += p.events;
  if (out.size() >= 2 && out.compare(out.size() - 2, 2, ",\n") == 0) out.resize(out.size() - 2);
  out += "\n],\n\"displayTimeUnit\":\"ms\",\n\"metadata\":{";
  out += cat("\"world_size\":", world, ",\"strategy\":");
  append_escaped(out, o.strategy.c_str());
  const auto mesh = o.mesh.empty() ? std::vector<int64_t>{1, world} : o.mesh;
  out += cat(",\"mesh\":[", mesh[0], ",", mesh[1], "],\"steps\":[", o.first_step, ",",
             o.last_step, "],\"complete\":", complete ? "true" : "false");
  if (!reason.empty()) {
    out += ",\"error\":";
    append_escaped(out, reason.c_str());
  }
  out += ",\"clock\":{\"reference\":\"rank 0\",\"ranks\":[";
  for (size_t i = 0; i < parts.size(); ++i) {
    out += i ? "," : "";
    out += "{\"offset_us\":";
    append_number(out, double(parts[i].offset_ns) / 1e3);
    out += ",\"uncertainty_us\":";
    append_number(out, double(parts[i].uncertainty_ns) / 1e3);
    out += "}";
  }
  out += "]}}}\n";
  return out;
}

}  // namespace

TraceSummary Trace::finish() {
  FSDP_CHECK(!finished_, "fsdp::Trace::finish was called twice");
  finished_ = true;
  slot_->set_on(false);
  const int64_t W = runtime_->world_size(), r = runtime_->rank();
  const std::string mine = events_json();
  TraceSummary s;
  std::vector<RankPart> parts;
  if (W == 1) {
    parts.push_back(split(mine));
  } else {
    auto store = detail::runtime_store(*runtime_);
    const std::string prefix = cat("fsdp/trace/", key_, "/");
    store->set(cat(prefix, "events/", r), bytes_of(mine));
    if (r == 0) {
      for (int64_t i = 0; i < W; ++i) {
        const auto v = store->get(cat(prefix, "events/", i));
        parts.push_back(split(std::string(v.begin(), v.end())));
      }
    } else {
      parts.push_back(split(mine));
    }
  }
  for (const auto& p : parts) {
    s.step_seconds.push_back(double(p.step_ns) / 1e9);
    s.exposed_seconds.push_back(double(p.exposed_ns) / 1e9);
    s.exposed_fraction.push_back(p.step_ns > 0 ? double(p.exposed_ns) / double(p.step_ns) : 0);
    s.offset_us.push_back(double(p.offset_ns) / 1e3);
    s.uncertainty_us.push_back(double(p.uncertainty_ns) / 1e3);
    s.events += p.count;
  }
  if (r == 0 && !options_.path.empty()) {
    write_file(options_.path, document(parts, options_, W, true, ""));
    s.written = true;
  }
  if (W > 1) {
    // Nobody leaves (and so possibly tears the store down) before rank 0 has read every part.
    auto store = detail::runtime_store(*runtime_);
    const std::string prefix = cat("fsdp/trace/", key_, "/");
    if (r == 0) store->set(cat(prefix, "read"), bytes_of("1"));
    store->get(cat(prefix, "read"));
  }
  return s;
}

std::string Trace::write_partial(const std::string& reason) noexcept {
  try {
    slot_->set_on(false);
    if (options_.path.empty()) return "";
    const int64_t r = runtime_->rank();
    std::string path = options_.path;
    if (r != 0) {
      const bool json = path.size() > 5 && path.compare(path.size() - 5, 5, ".json") == 0;
      path = cat(json ? path.substr(0, path.size() - 5) : path, ".rank", r, ".json");
    }
    std::vector<RankPart> parts{split(events_json())};
    parts[0].offset_ns = offset_ns_;
    write_file(path, document(parts, options_, runtime_->world_size(), false, reason));
    return path;
  } catch (...) {
    return "";
  }
}

}  // namespace fsdp
