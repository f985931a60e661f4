// fsdp-plot: draw the loss curves of several fsdp-train --metrics files into one PNG, one line
// per file with the file name in the legend, so runs (strategies, meshes, precisions) can be
// compared by eye:
//
//   fsdp-plot -o compare.png full_shard.jsonl hybrid_2x2.jsonl no_shard.jsonl
//
// Needs gnuplot (gnuplot-nox). Exit status: 0 drawn, 2 usage error, 1 anything else.
#include <CLI/CLI.hpp>
#include <iostream>

#include "plot.h"

int main(int argc, char** argv) {
  std::string output;
  std::string title = "training loss";
  std::vector<std::string> files;
  CLI::App app{"fsdp-plot: draw the loss curves of fsdp-train --metrics files into one PNG."};
  app.add_option("-o,--output", output, "PNG file to write")->required()->type_name("FILE.png");
  app.add_option("--title", title, "title of the plot")->capture_default_str();
  app.add_option("files", files, "metrics files (JSON Lines from fsdp-train --metrics)")
      ->required()
      ->type_name("FILE.jsonl");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "fsdp-plot: error: " << e.what() << " (see fsdp-plot --help)\n";
    return 2;
  }
  try {
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
