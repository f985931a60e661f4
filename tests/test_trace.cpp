// fsdp::Trace and fsdp-train --trace (issue 39): the file is Chrome's trace event format, every
// collective the groups count appears once with its bytes, one thread's events nest, every rank
// is a named process, a rank's clock offset is estimated within the reported uncertainty, a
// failing run still writes what it has, and bad --trace-steps are refused in one line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "fsdp/trace.h"
#include "testing.h"

using namespace fsdp;
using namespace fsdp::testing;
using nlohmann::json;

namespace {

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "fsdp_trace_" + std::to_string(::getpid()) + "_" + name;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in);
}

// Every thread's complete events either nest or are disjoint.
void expect_nested(const json& trace) {
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> by_thread;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const double ts = e["ts"], dur = e["dur"];
    by_thread[{e["pid"].get<int>(), e["tid"].get<int>()}].push_back({ts, ts + dur});
  }
  for (auto& [thread, spans] : by_thread) {
    std::sort(spans.begin(), spans.end(), [](auto& a, auto& b) {
      return a.first < b.first || (a.first == b.first && a.second > b.second);
    });
    std::vector<double> open;  // ends of the enclosing spans
    for (const auto& s : spans) {
      while (!open.empty() && open.back() <= s.first + 1e-3) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(s.second, open.back() + 1e-3)
            << "rank " << thread.first << " thread " << thread.second << ": the event at "
            << s.first << " us overlaps its enclosing one without nesting";
      }
      open.push_back(s.second);
    }
  }
}

std::map<int, std::string> process_names(const json& trace) {
  std::map<int, std::string> names;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") names[e["pid"]] = e["args"]["name"];
  }
  return names;
}

}  // namespace

// Two ranks as threads; rank 1's clock runs 5 s ahead. Its offset to rank 0 must be found
// within the uncertainty the trace reports, and every collective issued in the traced steps
// appears once, on its group's worker track, with the bytes the group's counters count.
TEST(Trace, OneClockAndEveryCollectiveOnce) {
  const std::string path = temp_path("collectives.json");
  constexpr int64_t kAhead = 5'000'000'000;  // ns
  std::vector<double> offset(2), uncertainty(2);
  std::vector<CommCounters> counted(2);
  std::vector<int64_t> calls(2);
  run_ranks(2, [&](Runtime& rt) {
    TraceOptions o;
    o.path = path;
    o.first_step = 2;
    o.last_step = 3;
    o.mesh = {1, 2};
    o.strategy = "FULL_SHARD";
    const int64_t ahead = rt.rank() == 1 ? kAhead : 0;
    o.clock = [ahead] {
      return std::chrono::duration_cast<std::chrono::nanoseconds>(
                 std::chrono::steady_clock::now().time_since_epoch())
                 .count() +
             ahead;
    };
    Trace trace(std::shared_ptr<Runtime>(&rt, [](Runtime*) {}), o);
    auto world = rt.world();
    auto run_step = [&](int64_t step) {
      trace.begin_step(step);
      auto x = at::ones({1024 * rt.world_size()});
      auto mine = at::empty({1024});
      auto in = at::ones({1024});
      world->reduce_scatter(mine, x, "unit 'a'")->wait();
      world->all_gather(x, in, "unit 'a'")->wait();
      world->all_reduce(mine, nullptr, "unit 'b'")->wait();
      trace.end_step();
    };
    run_step(1);  // not traced
    const CommCounters before = world->counters();
    run_step(2);
    run_step(3);
    counted[rt.rank()] = world->counters() - before;
    run_step(4);  // not traced
    const TraceSummary s = trace.finish();
    offset[rt.rank()] = trace.offset_us();
    uncertainty[rt.rank()] = trace.uncertainty_us();
    if (rt.rank() == 0) {
      EXPECT_TRUE(s.written);
      ASSERT_EQ(s.exposed_fraction.size(), 2u);
      for (double f : s.exposed_fraction) EXPECT_TRUE(f >= 0 && f <= 1) << f;
    }
  });
  EXPECT_EQ(offset[0], 0);
  EXPECT_NEAR(offset[1], -double(kAhead) / 1e3, uncertainty[1] + 1)
      << "uncertainty " << uncertainty[1] << " us";
  EXPECT_LT(uncertainty[1], 1e6);

  const json trace = read_json(path);
  ASSERT_TRUE(trace.contains("traceEvents"));
  EXPECT_EQ(trace["metadata"]["world_size"], 2);
  EXPECT_EQ(trace["metadata"]["clock"]["ranks"].size(), 2u);
  const auto names = process_names(trace);
  EXPECT_EQ(names.at(0), "rank 0: replica 0, shard 0");
  EXPECT_EQ(names.at(1), "rank 1: replica 0, shard 1");
  expect_nested(trace);
  std::map<int, int64_t> events, bytes;
  std::map<int, std::set<int64_t>> numbers;
  std::map<int, std::vector<double>> steps;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    if (e["cat"] == "collective") {
      events[e["pid"]] += 1;
      bytes[e["pid"]] += e["args"]["bytes"].get<int64_t>();
      EXPECT_TRUE(numbers[e["pid"]].insert(e["args"]["collective"].get<int64_t>()).second)
          << "collective #" << e["args"]["collective"] << " appears twice";
      EXPECT_EQ(e["args"]["group"], "world");
    }
    if (e["cat"] == "step") steps[e["pid"]].push_back(e["ts"]);
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(events[r], counted[r].calls) << "rank " << r;
    EXPECT_EQ(bytes[r], counted[r].total_bytes()) << "rank " << r;
    ASSERT_EQ(steps[r].size(), 2u) << "steps 2 and 3 only";
  }
  // On one clock, the ranks' steps start together (they meet in collectives), not 5 s apart.
  EXPECT_NEAR(steps[0][0], steps[1][0], 0.5e6);
  std::remove(path.c_str());
}

TEST(Trace, BadOptionsAreRefusedOnEveryRank) {
  expect_every_rank_fails(2, [](Runtime& rt) {
    TraceOptions o;
    o.first_step = 4;
    o.last_step = 2;
    Trace t(std::shared_ptr<Runtime>(&rt, [](Runtime*) {}), o);
  }, "trace steps 4:2 are invalid");
}

// fsdp-train --trace on FULL_SHARD W = 2: a valid trace whose collectives carry exactly the
// bytes --metrics counts for the traced steps, units' forward and backward, waits, and the
// summary's exposed-communication line.
TEST(Trace, FsdpTrainTraceMatchesItsMetrics) {
  const std::string path = temp_path("train.json"), metrics = temp_path("train.jsonl");
  const auto r = run(train_args({"--devices", "2", "--strategy", "full_shard", "--steps", "5",
                                 "--trace", path, "--trace-steps", "2:4", "--metrics", metrics}),
                     {}, std::chrono::seconds(int(120 * time_scale())));
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_NE(r.output.find("exposed communication"), std::string::npos) << r.output;
  const json trace = read_json(path);
  expect_nested(trace);
  EXPECT_EQ(process_names(trace).size(), 2u);
  EXPECT_EQ(trace["metadata"]["strategy"], "FULL_SHARD");
  std::map<std::string, int64_t> by_group;  // rank 0's bytes per group
  std::set<std::string> categories, names;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    categories.insert(e["cat"].get<std::string>());
    if (e["pid"] == 0) names.insert(e["name"].get<std::string>());
    if (e["cat"] == "collective" && e["pid"] == 0) {
      by_group[e["args"]["group"].get<std::string>()] += e["args"]["bytes"].get<int64_t>();
    }
  }
  for (const char* c : {"step", "compute", "collective", "optimizer", "data", "loss"}) {
    EXPECT_TRUE(categories.count(c)) << "no event of category " << c;
  }
  EXPECT_TRUE(names.count("forward block0") && names.count("backward block0")) << r.output;
  // Each optimizer span's end samples the memory counter before the next unit's compute: the
  // first step's optimizer makes AdamW's state, which the units' samples would not see.
  std::vector<double> optimizer_ends, compute_starts, memory_samples;
  for (const auto& e : trace["traceEvents"]) {
    if (e["pid"] != 0) continue;
    if (e["ph"] == "X" && e["name"] == "optimizer") {
      optimizer_ends.push_back(e["ts"].get<double>() + e["dur"].get<double>());
    }
    if (e["ph"] == "X" && e["cat"] == "compute") compute_starts.push_back(e["ts"].get<double>());
    if (e["ph"] == "C" && e["name"] == "memory") memory_samples.push_back(e["ts"].get<double>());
  }
  EXPECT_EQ(optimizer_ends.size(), 3u);  // steps 2 to 4
  for (double end : optimizer_ends) {
    double next = 1e300;
    for (double t : compute_starts) {
      if (t >= end) next = std::min(next, t);
    }
    bool sampled = false;
    for (double t : memory_samples) sampled = sampled || (t >= end - 0.01 && t <= next);
    EXPECT_TRUE(sampled) << "no memory sample after the optimizer span ending at " << end;
  }
  std::ifstream in(metrics);
  std::string line;
  int64_t shard = 0, world = 0;
  while (std::getline(in, line)) {
    const json m = json::parse(line);
    if (!m.contains("comm_bytes")) continue;
    const int64_t step = m["step"];
    EXPECT_TRUE(m.contains("minor_faults"));
    if (step < 2 || step > 4) continue;
    shard += m["comm_bytes"]["shard"].get<int64_t>();
    world += m["comm_bytes"]["world"].get<int64_t>();
  }
  EXPECT_GT(shard, 0);
  EXPECT_EQ(by_group["shard"], shard);
  // The world group also carries fsdp-train's per-step metrics, which --metrics leaves out.
  EXPECT_GE(by_group["world"], world);
  std::remove(path.c_str());
  std::remove(metrics.c_str());
}

// A run that fails inside the traced steps (the loss diverges at --lr 1e9) still leaves rank
// 0's trace, marked incomplete with the error, and the other rank's beside it.
TEST(Trace, FailingRunWritesWhatItHas) {
  const std::string path = temp_path("failing.json");
  const std::string other = path.substr(0, path.size() - 5) + ".rank1.json";
  const auto r = run(train_args({"--devices", "2", "--steps", "20", "--lr", "1e9", "--trace",
                                 path, "--trace-steps", "1:20", "--clip-grad", "0"}),
                     {}, std::chrono::seconds(int(120 * time_scale())));
  ASSERT_NE(r.exit_code(), 0) << r.output;
  ASSERT_NE(r.output.find("diverged"), std::string::npos) << r.output;
  const json trace = read_json(path);
  EXPECT_EQ(trace["metadata"]["complete"], false);
  EXPECT_NE(trace["metadata"]["error"].get<std::string>().find("diverged"), std::string::npos);
  int steps = 0;
  for (const auto& e : trace["traceEvents"]) steps += e["ph"] == "X" && e["cat"] == "step";
  EXPECT_GE(steps, 1);
  EXPECT_EQ(read_json(other)["metadata"]["complete"], false);
  std::remove(path.c_str());
  std::remove(other.c_str());
}

TEST(Trace, BadTraceStepsAreRefusedInOneLine) {
  for (const char* bad : {"5", "0:3", "4:2", "a:b", "3:", ":3", "3:5x"}) {
    const auto r = run(train_args({"--trace", temp_path("bad.json"), "--trace-steps", bad}), {},
                       std::chrono::seconds(60));
    EXPECT_EQ(r.exit_code(), 2) << bad << ": " << r.output;
    EXPECT_NE(r.output.find(std::string("--trace-steps '") + bad + "' is invalid"),
              std::string::npos)
        << r.output;
  }
  const auto late = run(train_args({"--trace", temp_path("bad.json"), "--steps", "2"}), {},
                        std::chrono::seconds(60));
  EXPECT_EQ(late.exit_code(), 2) << late.output;
  EXPECT_NE(late.output.find("starts after the last step"), std::string::npos) << late.output;
}
