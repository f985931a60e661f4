// What the checkpoint files share (see checkpoint/common.h).
#include "checkpoint/common.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

namespace fsdp::detail {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return cat(c10::IntArrayRef(shape));
}

// Joins up to 20 problems, then "and N more".
std::string join_problems(const std::vector<std::string>& problems) {
  std::string s;
  for (size_t i = 0; i < problems.size() && i < 20; ++i) s += (i ? "; " : "") + problems[i];
  if (problems.size() > 20) s += cat("; and ", problems.size() - 20, " more");
  return s;
}

std::string capture(const std::function<void()>& fn) {
  try {
    fn();
    return "";
  } catch (const std::exception& e) {
    return error_message(e);
  }
}

at::Tensor cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace fsdp::detail
