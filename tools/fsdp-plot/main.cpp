// fsdp-plot: draw the loss curves of several fsdp-train --metrics files into one PNG, one line
// per file with the file name in the legend, so runs (strategies, meshes, precisions) can be
// compared by eye:
//
//   fsdp-plot -o compare.png full_shard.jsonl hybrid_2x2.jsonl no_shard.jsonl
//
// or one training step of an fsdp-train --trace file as a timeline, a row per thread of each
// rank, with the planner's prediction beside the measured step:
//
//   fsdp-plot --trace trace.json -o timeline.png [--step 4] [--plan plan.json]
//
// Needs gnuplot (gnuplot-nox). Exit status: 0 drawn, 2 usage error, 1 anything else.
#include <CLI/CLI.hpp>
#include <iostream>

#include "plot.h"
#include "timeline.h"

namespace {

int draw_timeline(const std::string& trace_path, const std::string& output,
                  const fsdp_plot::TimelineOptions& given, const std::string& plan_path) {
  fsdp_plot::TimelineOptions options = given;
  const fsdp_plot::Trace trace = fsdp_plot::read_trace(trace_path);
  if (!trace.complete) {
    std::cerr << "fsdp-plot: warning: " << trace_path << " is incomplete ("
              << (trace.error.empty() ? "the run did not finish writing it" : trace.error)
              << "); drawing what it has\n";
  }
  if (!plan_path.empty()) options.plan = fsdp_plot::read_plan(plan_path, trace);
  const auto summary = fsdp_plot::plot_timeline(trace, options, output);
  std::cout << "fsdp-plot: wrote " << output << " (step " << summary.step << " of " << trace_path
            << ": " << summary.ranks.size() << (summary.ranks.size() == 1 ? " rank, " : " ranks, ")
            << summary.rows << " thread rows)\n"
            << fsdp_plot::describe(summary, options.plan);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string output;
  std::string title = "training loss";
  std::vector<std::string> files;
  std::string trace;
  std::string plan;
  int64_t step = 0;
  CLI::App app{
      "fsdp-plot: draw the loss curves of fsdp-train --metrics files into one PNG, or one step "
      "of an fsdp-train --trace file as a per-rank timeline."};
  app.add_option("-o,--output", output, "PNG file to write")->required()->type_name("FILE.png");
  auto* title_opt = app.add_option(
      "--title", title,
      "title of the plot (with --trace: its first line; default there: the step and the file)");
  title_opt->capture_default_str();
  auto* files_opt =
      app.add_option("files", files, "metrics files (JSON Lines from fsdp-train --metrics)")
          ->type_name("FILE.jsonl");
  auto* trace_opt =
      app.add_option("--trace", trace,
                     "draw one training step of this fsdp-train --trace file as a timeline: a "
                     "row per thread of each rank, boxes colored by what they do")
          ->type_name("FILE.json")
          ->excludes(files_opt);
  auto* step_opt = app.add_option("--step", step,
                                  "with --trace: the traced step to draw (default: the middle "
                                  "traced step)")
                       ->type_name("N")
                       ->needs(trace_opt);
  app.add_option("--plan", plan,
                 "with --trace: the JSON of fsdp-plan --json or fsdp-train --plan --json; adds the "
                 "planner's predicted compute, exposed communication and update for the traced "
                 "strategy and mesh beside rank 0's measured ones")
      ->type_name("PLAN.json")
      ->needs(trace_opt);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "fsdp-plot: error: " << e.what() << " (see fsdp-plot --help)\n";
    return 2;
  }
  if (files.empty() && trace.empty()) {
    std::cerr << "fsdp-plot: error: nothing to draw: give metrics files (FILE.jsonl ...) or "
                 "--trace FILE.json (see fsdp-plot --help)\n";
    return 2;
  }
  try {
    if (!trace.empty()) {
      fsdp_plot::TimelineOptions options;
      if (step_opt->count() > 0) options.step = step;
      if (title_opt->count() > 0) options.title = title;
      return draw_timeline(trace, output, options, plan);
    }
    std::vector<fsdp_plot::LossCurve> curves;
    for (const auto& f : files) curves.push_back(fsdp_plot::read_metrics(f));
    fsdp_plot::plot_losses(curves, output, title);
    std::cout << "fsdp-plot: wrote " << output << " (" << curves.size()
              << (curves.size() == 1 ? " run)" : " runs)") << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-plot: error: " << e.what() << "\n";
    return 1;
  }
}
