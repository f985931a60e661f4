// Writing the supervisor's lines (see rank_output.h; RankOutput itself is defined there).
#include "launch/rank_output.h"

#include <iostream>

namespace fsdp::detail {

void write_text(const std::string& text) {
  std::cerr.flush();
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    ssize_t n = ::write(2, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

void write_line(const std::string& line) { write_text(line + "\n"); }

}  // namespace fsdp::detail
