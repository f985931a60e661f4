// libFuzzer target: fsdp-plot --trace's readers (tools/fsdp-plot/trace_file.h) and the chart it
// builds from what they read, between a damaged, cut short or hostile trace (or plan) file and
// gnuplot. Input: one mode byte, then the text. Mode bit 0 clear: the text is a trace:
// parse_trace, then for its middle step (and, mode bit 1, its first step with a plan)
// timeline_script and describe. Set: the text is a plan: parse_plan against a FULL_SHARD (1, 2)
// trace. They may reject input only with fsdp::Error (fuzz_common.h); crashes, sanitizer reports
// and other exceptions are bugs. Nothing is read from or written to disk, and gnuplot is not run.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "timeline.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return -1;
  const uint8_t mode = data[0];
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (mode & 1) {
    fsdp_plot::Trace trace;
    trace.path = "trace.json";
    trace.strategy = "FULL_SHARD";
    trace.mesh = {1, 2};
    fsdp_fuzz::expect_ok_or_fsdp_error("fsdp-plot plan reader",
                                       [&] { fsdp_plot::parse_plan(text, "plan.json", trace); });
    return 0;
  }
  fsdp_fuzz::expect_ok_or_fsdp_error("fsdp-plot trace reader and chart", [&] {
    const fsdp_plot::Trace trace = fsdp_plot::parse_trace(text, "trace.json");
    fsdp_plot::TimelineOptions options;
    if (mode & 2) {
      options.step = trace.steps().front();
      options.plan = fsdp_plot::PlanTimes{"FULL_SHARD (1, 2)", 0.006, 0.001, 0.0004};
    }
    fsdp_plot::TimelineSummary summary;
    fsdp_plot::timeline_script(trace, options, "timeline.png", &summary);
    fsdp_plot::describe(summary, options.plan);
  });
  return 0;
}
