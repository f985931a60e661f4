// fsdp-plot as a real process, without fsdp-train: its bad metrics files, and --trace, the
// timeline of one training step per rank, over a sample trace written here in fsdp-train
// --trace's format (2 ranks, 2 steps, spans nested on the training thread, a comm thread, memory
// counters): the PNG, the exposed communication it measures, --step, --plan (with the real
// fsdp-plan's JSON where it is built), and every kind of bad input in one line.
// (fsdp-train --plot and fsdp-plot over real metrics files: Plot.FsdpTrainAndFsdpPlotDrawPngs in
// test_train.cpp.)
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "testing.h"

using namespace fsdp::testing;
using nlohmann::json;

namespace {

const std::string kPlot = tool_dir() + "/fsdp-plot";
const std::string kPlan = tool_dir() + "/fsdp-plan";

// A sample of fsdp-train --trace: ranks 0 and 1 (FULL_SHARD, mesh 1 x 2) each trace steps 3 and
// 4 on thread 1 ("training") and their shard group's collectives on thread 2. A step: data,
// forward of block0 after waiting on its all-gather (300 us + 100 us a rank), forward of block1,
// loss, backward of block1 and block0 (each with a recompute and a 100 us wait nested inside),
// a 400 us wait on the last reduce-scatter, clip_grad and optimizer. Rank 1 starts 40 us later.
// So a step of rank r lasts 7500 + 100 r us, of which 900 + 100 r us exposed communication,
// 5800 us compute, 500 us update and 300 us data and loss.
json sample_trace() {
  json events = json::array();
  auto span = [&](const std::string& name, const std::string& cat, int pid, int tid, double ts,
                  double dur, json args = nullptr) {
    json e = {{"ph", "X"},  {"name", name}, {"cat", cat}, {"pid", pid},
              {"tid", tid}, {"ts", ts},     {"dur", dur}};
    if (!args.is_null()) e["args"] = args;
    events.push_back(e);
  };
  int collective = 0;
  auto comm = [&](const std::string& op, const std::string& unit, int pid, double ts, double dur) {
    span(op + " " + unit, "collective", pid, 2, ts, dur,
         {{"op", op},
          {"group", "shard"},
          {"unit", unit},
          {"bytes", 1 << 20},
          {"collective", collective++},
          {"queued_us", 3.5}});
  };
  for (int r = 0; r < 2; ++r) {
    events.push_back(
        {{"ph", "M"},
         {"name", "process_name"},
         {"pid", r},
         {"tid", 0},
         {"args",
          {{"name", "rank " + std::to_string(r) + ": replica 0, shard " + std::to_string(r)}}}});
    events.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", r},
                      {"tid", 1},
                      {"args", {{"name", "training"}}}});
    events.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", r},
                      {"tid", 2},
                      {"args", {{"name", "comm: shard group"}}}});
    double t = 1000.5 + 40 * r;
    for (int step : {3, 4}) {
      const double start = t;
      span("data", "data", r, 1, t, 200);
      t += 200;
      comm("all_gather", "block0", r, t, 300);
      span("wait all_gather block0", "wait", r, 1, t, 300 + 100 * r);
      t += 300 + 100 * r;
      comm("all_gather", "block1", r, t, 300);
      for (const char* b : {"block0", "block1"}) {
        span(std::string("forward ") + b, "compute", r, 1, t, 1000);
        t += 1000;
      }
      span("loss", "loss", r, 1, t, 100);
      t += 100;
      for (const char* b : {"block1", "block0"}) {
        span(std::string("backward ") + b, "compute", r, 1, t, 2000);
        span(std::string("recompute ") + b, "compute", r, 1, t + 50, 600);
        span(std::string("wait all_gather ") + b, "wait", r, 1, t + 700, 100);
        comm("reduce_scatter", b, r, t + 2000, 400);
        t += 2000;
      }
      span("wait reduce_scatter block0", "wait", r, 1, t, 400);
      t += 400;
      span("clip_grad", "optimizer", r, 1, t, 100);
      span("optimizer", "optimizer", r, 1, t + 100, 400);
      t += 500;
      span("step " + std::to_string(step), "step", r, 1, start, t - start, {{"step", step}});
      events.push_back(
          {{"ph", "C"},
           {"name", "memory"},
           {"pid", r},
           {"tid", 1},
           {"ts", t - 1},
           {"args", {{"rss_bytes", (700 + step) << 20}, {"engine_buffer_bytes", 1 << 26}}}});
      t += 20;
    }
  }
  return {{"traceEvents", events},
          {"displayTimeUnit", "ms"},
          {"metadata",
           {{"world_size", 2},
            {"mesh", {1, 2}},
            {"strategy", "FULL_SHARD"},
            {"steps", {3, 4}},
            {"complete", true},
            {"clock",
             {{"reference", "rank 0"}, {"offsets_us", {0, 12.5}}, {"uncertainty_us", {0, 8}}}}}}};
}

// A plan as fsdp-plan --json writes it, with the candidates given as {strategy, replicate, shard}.
json sample_plan(const std::vector<std::tuple<std::string, int, int>>& candidates) {
  json cs = json::array();
  for (const auto& [strategy, replicate, shard] : candidates) {
    cs.push_back({{"strategy", strategy},
                  {"mesh", {replicate, shard}},
                  {"time_s",
                   {{"compute", 0.006},
                    {"communication", 0.002},
                    {"exposed", 0.001},
                    {"update", 0.0004},
                    {"step", 0.0074}}}});
  }
  return {{"cluster", {{"name", "sample-cluster"}}},
          {"candidates", cs},
          {"excluded", json::array({{{"strategy", "HYBRID_SHARD"},
                                     {"mesh", {1, 2}},
                                     {"reason", "one replica: use FULL_SHARD"}}})}};
}

size_t lines(const std::string& s) {
  return static_cast<size_t>(std::count(s.begin(), s.end(), '\n'));
}

off_t size_of(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

bool has(const ProcessResult& r, const std::string& text) {
  return r.output.find(text) != std::string::npos;
}

}  // namespace

TEST(Plot, FsdpPlotErrors) {
  TempDir dir;
  write_file(dir.file("bad.jsonl"), "{\"step\": 1, \"loss\": 5.1}\nnot json\n");
  auto r = run({kPlot, "-o", dir.file("x.png"), dir.file("bad.jsonl")});
  EXPECT_EQ(r.exit_code(), 1) << r.output;  // before looking for gnuplot
  EXPECT_NE(r.output.find("line 2 is not JSON"), std::string::npos) << r.output;
  write_file(dir.file("ok.jsonl"), "{\"step\": 1, \"loss\": 5.1}\n{\"step\": 2, \"loss\": 4.9}\n");
  r = run({kPlot, "-o", dir.file("x.png"), dir.file("ok.jsonl")}, {{"PATH", "/nonexistent"}});
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_NE(r.output.find("gnuplot is not in PATH"), std::string::npos) << r.output;
  r = run({kPlot, dir.file("ok.jsonl")});
  EXPECT_EQ(r.exit_code(), 2) << r.output;
}

TEST(Plot, TraceTimelineOfOneStep) {
  if (!have_gnuplot()) GTEST_SKIP() << "gnuplot is not installed (make setup installs gnuplot-nox)";
  TempDir dir;
  // A quote in the file name and the title must not break gnuplot's script.
  const std::string trace = dir.file("it's a trace.json");
  write_file(trace, sample_trace().dump());
  // Default: the middle traced step, 4 of 3 and 4.
  auto r = run({kPlot, "--trace", trace, "-o", dir.file("timeline.png")});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(is_png(dir.file("timeline.png"))) << r.output;
  EXPECT_GT(size_of(dir.file("timeline.png")), 1000) << r.output;
  EXPECT_TRUE(has(r, "(step 4 of " + trace + ": 2 ranks, 4 thread rows)")) << r.output;
  // Each rank's step as the sample's comment says, waits nested in backward counted once.
  EXPECT_TRUE(has(r,
                  "rank 0: step 7.50 ms = compute 5.80 + exposed communication 0.900 (12.0%) "
                  "+ update 0.500 + rest 0.300 ms; peak RSS 704.0 MiB"))
      << r.output;
  EXPECT_TRUE(has(r,
                  "rank 1: step 7.60 ms = compute 5.80 + exposed communication 1.00 (13.2%) "
                  "+ update 0.500 + rest 0.300 ms"))
      << r.output;

  r = run({kPlot, "--trace", trace, "--step", "3", "--title", "Bob's\nstep", "-o",
           dir.file("step3.png")});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(is_png(dir.file("step3.png"))) << r.output;
  EXPECT_TRUE(has(r, "(step 3 of ")) << r.output;
  EXPECT_FALSE(has(r, "(step 4 of ")) << r.output;

  // A step that was not traced: one line naming the steps that were; nothing is drawn.
  r = run({kPlot, "--trace", trace, "--step", "9", "-o", dir.file("step9.png")});
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_EQ(lines(r.output), 1u) << r.output;
  EXPECT_TRUE(
      has(r, "fsdp-plot: error: trace file '" + trace + "' has no step 9; its traced steps: 3-4"))
      << r.output;
  EXPECT_LT(size_of(dir.file("step9.png")), 0);

  // A rank without the step is named, not drawn.
  json partial = sample_trace();
  auto& events = partial["traceEvents"];
  events.erase(std::remove_if(events.begin(), events.end(),
                              [](const json& e) {
                                return e.value("name", "") == "step 3" && e.value("pid", -1) == 1;
                              }),
               events.end());
  write_file(dir.file("partial.json"), partial.dump());
  r = run({kPlot, "--trace", dir.file("partial.json"), "--step", "3", "-o", dir.file("p.png")});
  EXPECT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(has(r, ": 1 rank, 2 thread rows)")) << r.output;
  EXPECT_TRUE(has(r, "  not drawn: rank 1: no step 3 in the trace")) << r.output;

  // A partial trace a failing run wrote (fsdp::Trace::write_partial): drawn, with its reason;
  // its clock as {"ranks": [{"offset_us", "uncertainty_us"}, ...]}.
  json failed = sample_trace();
  failed["metadata"]["complete"] = false;
  failed["metadata"]["error"] = "rank 1 exited with status 1";
  failed["metadata"]["clock"] = {
      {"reference", "rank 0"},
      {"ranks",
       {{{"offset_us", 0}, {"uncertainty_us", 0}}, {{"offset_us", 12.5}, {"uncertainty_us", 8}}}}};
  write_file(dir.file("failed.json"), failed.dump());
  r = run({kPlot, "--trace", dir.file("failed.json"), "-o", dir.file("failed.png")});
  EXPECT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(has(r, "fsdp-plot: warning: " + dir.file("failed.json") +
                         " is incomplete (rank 1 exited with status 1); drawing what it has"))
      << r.output;
  EXPECT_TRUE(is_png(dir.file("failed.png"))) << r.output;

  // A trace the run did not finish writing: drawn up to its last whole event, with a warning.
  const std::string text = sample_trace().dump();
  write_file(dir.file("cut.json"), text.substr(0, text.find("\"step 4\"") + 200));
  r = run({kPlot, "--trace", dir.file("cut.json"), "--step", "3", "-o", dir.file("cut.png")});
  EXPECT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(has(r, "is incomplete")) << r.output;
  EXPECT_TRUE(is_png(dir.file("cut.png"))) << r.output;
}

TEST(Plot, TraceWithThePlannersPrediction) {
  if (!have_gnuplot()) GTEST_SKIP() << "gnuplot is not installed (make setup installs gnuplot-nox)";
  TempDir dir;
  write_file(dir.file("trace.json"), sample_trace().dump());
  // The real planner's JSON for the sample's model-less run, where fsdp-plan is built; else a
  // sample of its format.
  std::string plan = dir.file("plan.json");
  if (::access(kPlan.c_str(), X_OK) == 0) {
    auto p = run({kPlan, "--model", "tiny", "--ranks-per-node", "2", "--json"});
    ASSERT_EQ(p.exit_code(), 0) << p.output;
    write_file(plan, p.output);
  } else {
    write_file(plan, sample_plan({{"FULL_SHARD", 1, 2}, {"NO_SHARD", 1, 2}}).dump());
  }
  auto r =
      run({kPlot, "--trace", dir.file("trace.json"), "--plan", plan, "-o", dir.file("plan.png")});
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(is_png(dir.file("plan.png"))) << r.output;
  EXPECT_TRUE(has(r, "  plan FULL_SHARD (1, 2) on ")) << r.output;
  EXPECT_TRUE(has(r, " ms (predicted)")) << r.output;

  // The strategy is matched in any spelling; a plan without the traced strategy and mesh is
  // refused in one line that says why (excluded) or what it has.
  json trace = sample_trace();
  trace["metadata"]["strategy"] = "full-shard";
  write_file(dir.file("lower.json"), trace.dump());
  write_file(dir.file("sample.json"), sample_plan({{"FULL_SHARD", 1, 2}}).dump());
  r = run({kPlot, "--trace", dir.file("lower.json"), "--plan", dir.file("sample.json"), "-o",
           dir.file("lower.png")});
  EXPECT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(has(r,
                  "plan FULL_SHARD (1, 2) on sample-cluster: compute 6.00 + exposed "
                  "communication 1.00 + update 0.400 ms (predicted)"))
      << r.output;
  write_file(dir.file("other.json"),
             sample_plan({{"NO_SHARD", 1, 2}, {"FULL_SHARD", 1, 4}}).dump());
  r = run({kPlot, "--trace", dir.file("trace.json"), "--plan", dir.file("other.json"), "-o",
           dir.file("x.png")});
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_EQ(lines(r.output), 1u) << r.output;
  EXPECT_TRUE(has(r, "plan file '" + dir.file("other.json") +
                         "' has no candidate FULL_SHARD (1, 2), the traced run's (its "
                         "candidates: NO_SHARD (1, 2), FULL_SHARD (1, 4))"))
      << r.output;
  trace["metadata"]["strategy"] = "HYBRID_SHARD";
  write_file(dir.file("hybrid.json"), trace.dump());
  r = run({kPlot, "--trace", dir.file("hybrid.json"), "--plan", dir.file("other.json"), "-o",
           dir.file("x.png")});
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_TRUE(has(r, "the planner excluded it (one replica: use FULL_SHARD)")) << r.output;
  trace["metadata"].erase("mesh");
  write_file(dir.file("nomesh.json"), trace.dump());
  r = run({kPlot, "--trace", dir.file("nomesh.json"), "--plan", dir.file("other.json"), "-o",
           dir.file("x.png")});
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_TRUE(has(r, "has no \"strategy\" and \"mesh\" in its \"metadata\"")) << r.output;
  write_file(dir.file("notjson.json"), "candidates: none");
  r = run({kPlot, "--trace", dir.file("trace.json"), "--plan", dir.file("notjson.json"), "-o",
           dir.file("x.png")});
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_EQ(lines(r.output), 1u) << r.output;
  EXPECT_TRUE(has(r, "plan file '" + dir.file("notjson.json") + "' is not JSON")) << r.output;
}

// Bad traces and bad flags: one line naming the file and what is wrong, before gnuplot runs.
TEST(Plot, TraceBadInputFailsInOneLine) {
  TempDir dir;
  json no_steps = sample_trace();
  json& events = no_steps["traceEvents"];
  events.erase(std::remove_if(events.begin(), events.end(),
                              [](const json& e) { return e.value("cat", "") == "step"; }),
               events.end());
  json no_ts = sample_trace();
  no_ts["traceEvents"][3].erase("ts");  // rank 0's first span: data
  write_file(dir.file("no_steps.json"), no_steps.dump());
  write_file(dir.file("no_ts.json"), no_ts.dump());
  write_file(dir.file("not_json.json"), "this is not JSON");
  write_file(dir.file("empty.json"), "");
  write_file(dir.file("no_events.json"), R"({"metadata": {"world_size": 2}})");
  write_file(dir.file("trace.json"), sample_trace().dump());
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--trace", dir.file("missing.json")},
       "cannot read trace file '" + dir.file("missing.json") + "': No such file or directory"},
      {{"--trace", dir.file("not_json.json")},
       "trace file '" + dir.file("not_json.json") + "' is not JSON ("},
      {{"--trace", dir.file("empty.json")}, "trace file '" + dir.file("empty.json") + "' is empty"},
      {{"--trace", dir.file("no_events.json")},
       "trace file '" + dir.file("no_events.json") + "' has no \"traceEvents\" array"},
      {{"--trace", dir.file("no_steps.json")},
       "trace file '" + dir.file("no_steps.json") + "' has no step events"},
      {{"--trace", dir.file("no_ts.json")},
       "trace file '" + dir.file("no_ts.json") +
           "': traceEvents[3] (\"data\") has no numeric \"ts\""},
      {{"--trace", dir.file("trace.json"), "--plan", dir.file("missing.json")},
       "cannot read plan file '" + dir.file("missing.json") + "'"},
  };
  for (const auto& [flags, expected] : cases) {
    std::vector<std::string> argv{kPlot, "-o", dir.file("x.png")};
    argv.insert(argv.end(), flags.begin(), flags.end());
    // PATH without gnuplot: the input is refused before gnuplot is looked for.
    const auto r = run(argv, {{"PATH", "/nonexistent"}});
    EXPECT_EQ(r.exit_code(), 1) << flags[1] << ":\n" << r.output;
    EXPECT_EQ(lines(r.output), 1u) << flags[1] << ":\n" << r.output;
    EXPECT_TRUE(has(r, "fsdp-plot: error: " + expected)) << flags[1] << ":\n" << r.output;
  }
  // Usage errors (exit status 2): --step and --plan only with --trace; --trace or metrics files,
  // not both, and one of them.
  for (const auto& argv : std::vector<std::vector<std::string>>{
           {kPlot, "-o", dir.file("x.png"), "--step", "3", dir.file("a.jsonl")},
           {kPlot, "-o", dir.file("x.png"), "--plan", dir.file("p.json"), dir.file("a.jsonl")},
           {kPlot, "-o", dir.file("x.png"), "--trace", dir.file("trace.json"), dir.file("a.jsonl")},
           {kPlot, "-o", dir.file("x.png")},
           {kPlot, "-o", dir.file("x.png"), "--trace", dir.file("trace.json"), "--step", "four"}}) {
    const auto r = run(argv);
    EXPECT_EQ(r.exit_code(), 2) << argv.back() << ":\n" << r.output;
    EXPECT_EQ(lines(r.output), 1u) << argv.back() << ":\n" << r.output;
    EXPECT_TRUE(has(r, "fsdp-plot: error: ")) << r.output;
  }
}
