// fsdp-train's one stopwatch: seconds of the steady clock since a time point.
#pragma once

#include <chrono>

namespace fsdp_train {

inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace fsdp_train
