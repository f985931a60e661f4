// fsdp/error.h: the error type the library throws for bad input, and helpers to raise it.
//
// Every message is one line that names the offending value, the rule it breaks and a fix, e.g.
//   device_mesh (3, 2) has 6 ranks but the world has 4 processes; use (2, 2) or (-1, 2)
// Internal invariants use TORCH_INTERNAL_ASSERT instead: they are our bugs, not the caller's.
#pragma once

#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>

namespace fsdp {

// Bad configuration, arguments or environment. what() is a single line without a backtrace.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Every part streamed (operator<<) into one string: how the library builds its messages, public
// so that programs build theirs the same way, e.g. fsdp::cat("rank ", r, ": ", what).
template <class... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

namespace detail {
using fsdp::cat;  // the library's code says detail::cat
}  // namespace detail

// One-line message of any exception: c10::Error loses its C++ backtrace, other text is cut at
// the first newline.
std::string error_message(const std::exception& e);

}  // namespace fsdp

// Throws fsdp::Error with the concatenated message parts unless `cond` holds.
#define FSDP_CHECK(cond, ...)                                      \
  do {                                                             \
    if (!(cond)) throw ::fsdp::Error(::fsdp::cat(__VA_ARGS__));     \
  } while (0)
