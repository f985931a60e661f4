// fsdp-train's progress line on rank 0: a bar redrawn in place on stderr when that is a terminal,
// else about ten plain lines per run on stdout, in order with the banner and the summary.
//
// Why stdout for the plain lines: under --devices N the supervisor holds each complete line of a
// rank's stderr up to --output-hold (1 s) to merge the same line of several ranks (NOTE [rank
// output]), while stdout passes straight through. On stderr, a line written less than a second
// before the summary came after it: the last step's line in `make demo`, every line of a 2 s run.
// The bar is not held (a "\r" redraw is forwarded at once), so it stays on stderr.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "fsdp/report.h"

namespace fsdp_train {

// "m:ss", or "h:mm:ss" from an hour on; negative times read 0:00.
inline std::string clock_time(double s) {
  const int64_t t = static_cast<int64_t>(std::llround(std::max(0.0, s)));
  char buf[32];
  if (t >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(t / 3600),
                  static_cast<long long>(t / 60 % 60), static_cast<long long>(t % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld", static_cast<long long>(t / 60),
                  static_cast<long long>(t % 60));
  }
  return buf;
}

// Not thread-safe: one object, used by the training loop only.
class Progress {
 public:
  Progress(int64_t steps, bool enabled) : steps_(steps), enabled_(enabled), tty_(::isatty(2)) {}

  // The latest validation loss, shown from now on.
  void validation(double loss) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "  val %.4f", loss);
    val_ = buf;
  }

  void update(int64_t step, double loss, double tokens_per_s, double elapsed_s) {
    if (!enabled_) return;
    const double eta = elapsed_s / double(step) * double(steps_ - step);
    char stats[192];
    std::snprintf(stats, sizeof(stats), "step %lld/%lld  loss %.4f%s  %s tokens/s  ETA %s",
                  static_cast<long long>(step), static_cast<long long>(steps_), loss, val_.c_str(),
                  fsdp::format_count(tokens_per_s).c_str(), clock_time(eta).c_str());
    if (tty_) {
      constexpr int64_t kWidth = 24;
      const int64_t filled = kWidth * step / steps_;
      std::string bar = "[" + std::string(filled, '#') + std::string(kWidth - filled, '.') + "]";
      std::fprintf(stderr, "\r%s %s   ", bar.c_str(), stats);  // trailing blanks erase old text
      if (step == steps_) std::fprintf(stderr, "\n");
      std::fflush(stderr);
    } else {
      const int64_t every = std::max<int64_t>(1, steps_ / 10);
      if (step == 1 || step % every == 0 || step == steps_) std::printf("%s\n", stats);
      std::fflush(stdout);
    }
  }

 private:
  int64_t steps_;
  bool enabled_;
  bool tty_;
  std::string val_;
};

}  // namespace fsdp_train
