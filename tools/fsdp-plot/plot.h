// Loss curves into a PNG with gnuplot: reading fsdp-train's --metrics files and drawing one or
// more runs into one picture with a legend. Used by fsdp-plot and by fsdp-train --plot.
// No libtorch: fsdp-plot starts instantly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp_plot {

// One run: loss per optimizer step.
struct LossCurve {
  std::string label;  // legend entry
  std::vector<int64_t> steps;
  std::vector<double> losses;
};

// Reads the "step" and "loss" of every line of a JSON Lines metrics file (fsdp-train --metrics),
// skipping its validation lines ({"step", "val_loss"}). Throws fsdp::Error naming the file and
// line of anything else that is not such an object, or for a file without steps. The label is
// the file's base name.
LossCurve read_metrics(const std::string& path);

// gnuplot's path in PATH, or "" if it is not installed.
std::string find_gnuplot();

// Runs a gnuplot `script` that draws `png` (fsdp-plan --chart, fsdp-plot --trace). Throws
// fsdp::Error if gnuplot is missing, fails (with its first error line) or writes no file.
void run_gnuplot_script(const std::string& script, const std::string& png);

// The start of a script that draws a `width` x `height` PNG into `png`: pngcairo if gnuplot has
// it, else its libgd png terminal (both ship with gnuplot-nox); no enhanced-text markup.
std::string png_terminal(int width, int height, const std::string& png);

// `s` as a gnuplot single-quoted string: '' stands for one quote; nothing else is special, but a
// line break would end the command, so it becomes a space.
std::string gnuplot_quoted(const std::string& s);

// Draws `curves` into `png` with run_gnuplot_script (same errors).
void plot_losses(const std::vector<LossCurve>& curves, const std::string& png,
                 const std::string& title);

}  // namespace fsdp_plot
