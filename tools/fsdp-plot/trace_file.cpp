// Reading fsdp-train --trace files and fsdp-plan --json plans (see trace_file.h).
#include "trace_file.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "fsdp/error.h"

namespace fsdp_plot {

using fsdp::cat;
using nlohmann::json;

namespace {

const char* const kFix = "; give a file written by fsdp-train --trace";

std::string read_text(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  FSDP_CHECK(in, "cannot read ", what, " '", path, "': ", std::strerror(errno));
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// A trace the run did not finish writing ends inside an event: parse it up to the last event
// that ends whole. Tries the last few '}' from the end; discarded if none gives JSON.
json parse_cut_trace(const std::string& text) {
  if (text.find("\"traceEvents\"") == std::string::npos) return json(json::value_t::discarded);
  size_t end = text.size();
  for (int tries = 0; tries < 16; ++tries) {
    end = end == 0 ? std::string::npos : text.rfind('}', end - 1);
    if (end == std::string::npos) break;
    json j = json::parse(text.substr(0, end + 1) + "]}", nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("traceEvents")) return j;
  }
  return json(json::value_t::discarded);
}

bool is_int(const json& e, const char* key) {
  return e.contains(key) && e[key].is_number_integer();
}
bool is_num(const json& e, const char* key) { return e.contains(key) && e[key].is_number(); }

// Depth of every span in its thread: sorted by start (the longer first when two start
// together), a span is inside every earlier one that has not ended by its start.
void set_depths(std::vector<TraceSpan>& spans) {
  std::vector<size_t> order(spans.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto& x = spans[a];
    const auto& y = spans[b];
    if (x.pid != y.pid) return x.pid < y.pid;
    if (x.tid != y.tid) return x.tid < y.tid;
    if (x.start_us != y.start_us) return x.start_us < y.start_us;
    return x.end_us > y.end_us;
  });
  std::vector<double> open;  // ends of the spans containing the current one
  for (size_t k = 0; k < order.size(); ++k) {
    auto& s = spans[order[k]];
    if (k > 0 && (spans[order[k - 1]].pid != s.pid || spans[order[k - 1]].tid != s.tid))
      open.clear();
    while (!open.empty() && open.back() <= s.start_us + kTraceEpsUs) open.pop_back();
    s.depth = static_cast<int>(open.size());
    open.push_back(s.end_us);
  }
}

void read_metadata(const json& m, Trace& t) {
  if (!m.is_object()) return;
  if (m.contains("strategy") && m["strategy"].is_string()) t.strategy = m["strategy"];
  if (m.contains("mesh") && m["mesh"].is_array()) {
    for (const auto& v : m["mesh"]) {
      if (v.is_number_integer()) t.mesh.push_back(v.get<int64_t>());
    }
  }
  if (is_int(m, "world_size")) t.world_size = m["world_size"];
  if (m.contains("complete") && m["complete"].is_boolean() && !m["complete"].get<bool>()) {
    t.complete = false;
  }
  if (m.contains("error") && m["error"].is_string()) t.error = m["error"];
  // "clock": {"uncertainty_us": [...]} or {"ranks": [{"uncertainty_us": u}, ...]}.
  const json clock = m.contains("clock") && m["clock"].is_object() ? m["clock"] : json::object();
  std::vector<json> uncertainties;
  if (clock.contains("uncertainty_us") && clock["uncertainty_us"].is_array()) {
    for (const auto& u : clock["uncertainty_us"]) uncertainties.push_back(u);
  }
  if (clock.contains("ranks") && clock["ranks"].is_array()) {
    for (const auto& r : clock["ranks"]) {
      if (r.is_object() && r.contains("uncertainty_us"))
        uncertainties.push_back(r["uncertainty_us"]);
    }
  }
  for (const auto& u : uncertainties) {
    if (u.is_number()) t.clock_uncertainty_us = std::max(t.clock_uncertainty_us, u.get<double>());
  }
}

// The step number of a "step" event: "args": {"step": N}, else its name "step N".
int64_t step_number(const json& e, const std::string& name) {
  if (e.contains("args") && e["args"].is_object() && is_num(e["args"], "step")) {
    const double n = e["args"]["step"].get<double>();  // 4 or 4.0
    if (n >= 0 && n < 1e15 && n == std::floor(n)) return static_cast<int64_t>(n);
  }
  long long n = -1;
  char rest = 0;
  return std::sscanf(name.c_str(), "step %lld%c", &n, &rest) == 1 ? n : -1;
}

std::string upper_snake(std::string s) {
  for (char& c : s)
    c = c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string mesh_label(const std::string& strategy, int64_t replicate, int64_t shard) {
  return cat(strategy, " (", replicate, ", ", shard, ")");
}

}  // namespace

std::vector<int64_t> Trace::steps() const {
  std::set<int64_t> s;
  for (const auto& span : spans) {
    if (span.cat == "step") s.insert(span.step);
  }
  return {s.begin(), s.end()};
}

std::string step_ranges(const std::vector<int64_t>& steps) {
  std::string out;
  for (size_t i = 0; i < steps.size();) {
    size_t j = i;
    while (j + 1 < steps.size() && steps[j + 1] == steps[j] + 1) ++j;
    out += cat(out.empty() ? "" : ", ", steps[i]);
    if (j > i) out += cat("-", steps[j]);
    i = j + 1;
  }
  return out;
}

Trace read_trace(const std::string& path) {
  return parse_trace(read_text(path, "trace file"), path);
}

Trace parse_trace(const std::string& text, const std::string& path) {
  Trace t;
  t.path = path;
  FSDP_CHECK(text.find_first_not_of(" \t\r\n") != std::string::npos, "trace file '", path,
             "' is empty", kFix);
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded()) {
    j = parse_cut_trace(text);
    if (j.is_discarded()) {
      try {
        (void)json::parse(text);
      } catch (const json::exception& e) {
        throw fsdp::Error(cat("trace file '", path, "' is not JSON (", e.what(), ")", kFix));
      }
    }
    t.complete = false;
  }
  // Chrome also reads a bare array of events.
  const json* events = j.is_array() ? &j : nullptr;
  if (j.is_object() && j.contains("traceEvents") && j["traceEvents"].is_array()) {
    events = &j["traceEvents"];
  }
  FSDP_CHECK(events, "trace file '", path, "' has no \"traceEvents\" array", kFix);
  if (j.is_object() && j.contains("metadata")) read_metadata(j["metadata"], t);
  for (size_t i = 0; i < events->size(); ++i) {
    const json& e = (*events)[i];
    const std::string where = cat("trace file '", path, "': traceEvents[", i, "]");
    FSDP_CHECK(e.is_object(), where, " is not an object", kFix);
    const std::string ph =
        e.contains("ph") && e["ph"].is_string() ? e["ph"].get<std::string>() : "";
    const std::string name =
        e.contains("name") && e["name"].is_string() ? e["name"].get<std::string>() : "";
    const json args = e.contains("args") && e["args"].is_object() ? e["args"] : json::object();
    if (ph == "M") {
      if (!is_int(e, "pid") || !args.contains("name") || !args["name"].is_string()) continue;
      if (name == "thread_name" && is_int(e, "tid")) {
        t.thread_names[{e["pid"].get<int64_t>(), e["tid"].get<int64_t>()}] = args["name"];
      }
    } else if (ph == "C") {
      if (is_int(e, "pid") && is_num(e, "ts") && is_num(args, "rss_bytes")) {
        t.rss.push_back({e["pid"], {e["ts"].get<double>(), args["rss_bytes"].get<double>()}});
      }
    } else if (ph == "X") {
      for (const char* key : {"pid", "tid"}) {
        FSDP_CHECK(is_int(e, key), where, " (\"", name, "\") has no integer \"", key, "\"", kFix);
      }
      for (const char* key : {"ts", "dur"}) {
        FSDP_CHECK(is_num(e, key), where, " (\"", name, "\") has no numeric \"", key, "\"", kFix);
      }
      TraceSpan s;
      s.name = name;
      s.cat = e.contains("cat") && e["cat"].is_string() ? e["cat"].get<std::string>() : "";
      s.pid = e["pid"];
      s.tid = e["tid"];
      s.start_us = e["ts"];
      s.end_us = s.start_us + std::max(0.0, e["dur"].get<double>());
      if (s.cat == "step") {
        s.step = step_number(e, name);
        FSDP_CHECK(s.step >= 0, where, " is a step event without \"args\": {\"step\": N}", kFix);
      }
      t.spans.push_back(std::move(s));
    }
  }
  FSDP_CHECK(!t.steps().empty(), "trace file '", path, "' has no step events (\"cat\": \"step\") ",
             "in its ", events->size(), " events, so there is no step to draw", kFix,
             " that traced at least one whole step");
  set_depths(t.spans);
  return t;
}

PlanTimes read_plan(const std::string& path, const Trace& trace) {
  return parse_plan(read_text(path, "plan file"), path, trace);
}

PlanTimes parse_plan(const std::string& text, const std::string& path, const Trace& trace) {
  FSDP_CHECK(!trace.strategy.empty() && trace.mesh.size() == 2, "trace file '", trace.path,
             "' has no \"strategy\" and \"mesh\" in its \"metadata\", so the candidate of '", path,
             "' to compare with cannot be chosen");
  const std::string fix = "; give the output of fsdp-plan --json or fsdp-train --plan --json";
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw fsdp::Error(cat("plan file '", path, "' is not JSON (", e.what(), ")", fix));
  }
  FSDP_CHECK(j.is_object() && j.contains("candidates") && j["candidates"].is_array(), "plan file '",
             path, "' has no \"candidates\" array", fix);
  const std::string want = upper_snake(trace.strategy);
  const std::string label = mesh_label(want, trace.mesh[0], trace.mesh[1]);
  const auto matches = [&](const json& c) {
    return c.is_object() && c.contains("strategy") && c["strategy"].is_string() &&
           upper_snake(c["strategy"]) == want && c.contains("mesh") &&
           c["mesh"] == json::array({trace.mesh[0], trace.mesh[1]});
  };
  std::string cluster;
  if (j.contains("cluster") && j["cluster"].is_object() && j["cluster"].contains("name") &&
      j["cluster"]["name"].is_string()) {
    cluster = j["cluster"]["name"];
  }
  std::vector<std::string> others;
  for (const auto& c : j["candidates"]) {
    if (!matches(c)) {
      if (c.is_object() && c.contains("strategy") && c["strategy"].is_string() &&
          c.contains("mesh") && c["mesh"].is_array() && c["mesh"].size() == 2 &&
          c["mesh"][0].is_number_integer() && c["mesh"][1].is_number_integer()) {
        others.push_back(mesh_label(c["strategy"], c["mesh"][0], c["mesh"][1]));
      }
      continue;
    }
    const json& times = c.contains("time_s") ? c["time_s"] : json::object();
    for (const char* key : {"compute", "exposed", "update"}) {
      FSDP_CHECK(is_num(times, key), "plan file '", path, "': candidate ", label,
                 " has no numeric \"time_s\" \"", key, "\"", fix);
    }
    PlanTimes p;
    p.label = cluster.empty() ? label : cat(label, " on ", cluster);
    p.compute_s = times["compute"];
    p.exposed_s = times["exposed"];
    p.update_s = times["update"];
    return p;
  }
  if (j.contains("excluded") && j["excluded"].is_array()) {
    for (const auto& e : j["excluded"]) {
      if (matches(e)) {
        throw fsdp::Error(cat("plan file '", path, "' has no candidate ", label,
                              ", the traced run's: the planner excluded it (",
                              e.contains("reason") && e["reason"].is_string()
                                  ? e["reason"].get<std::string>()
                                  : "no reason given",
                              ")"));
      }
    }
  }
  std::string list;
  for (size_t i = 0; i < others.size() && i < 8; ++i) list += cat(i ? ", " : "", others[i]);
  if (others.size() > 8) list += cat(" and ", others.size() - 8, " more");
  throw fsdp::Error(cat("plan file '", path, "' has no candidate ", label,
                        ", the traced run's (its candidates: ", list.empty() ? "none" : list,
                        "); plan for the traced run's world size and strategy"));
}

}  // namespace fsdp_plot
