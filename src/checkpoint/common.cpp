// What the checkpoint files share (see checkpoint/common.h).
#include "checkpoint/common.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <new>

#include "checkpoint/file_io.h"

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

namespace {
constexpr size_t kHugePage = size_t(2) << 20;
}  // namespace

namespace {

// `numel` elements of `dtype` in a heap block of at least `bytes`, starting at `align`.
at::Tensor aligned_tensor(int64_t numel, at::ScalarType dtype, size_t align, size_t bytes) {
  void* p = nullptr;
  if (::posix_memalign(&p, align, std::max<size_t>(bytes, 1)) != 0) throw std::bad_alloc();
  return at::from_blob(p, {numel}, [](void* q) { std::free(q); },
                       at::TensorOptions().dtype(dtype));
}

}  // namespace

at::Tensor empty_mapped(int64_t numel, at::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (bytes < kHugePage) return at::empty({numel}, at::TensorOptions().dtype(dtype));
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  at::Tensor t = aligned_tensor(numel, dtype, kHugePage, rounded);
#ifdef MADV_HUGEPAGE
  (void)::madvise(t.data_ptr(), rounded, MADV_HUGEPAGE);
#endif
#ifdef MADV_POPULATE_WRITE
  (void)::madvise(t.data_ptr(), rounded, MADV_POPULATE_WRITE);
#endif
  return t;
}

at::Tensor empty_direct_buffer(int64_t bytes) {
  if (static_cast<size_t>(bytes) >= kHugePage) return empty_mapped(bytes, at::kByte);
  return aligned_tensor(bytes, at::kByte, kDirectAlign, static_cast<size_t>(bytes));
}

namespace {

// The generator `rng_state` saves for `device`: the CPU one, or a CUDA device's default one (the
// CUDA hooks throw in a libtorch without CUDA; a CUDA runtime never exists there).
at::Generator generator_of(const at::Device& device) {
  return device.is_cuda() ? at::globalContext().defaultGenerator(device)
                          : at::detail::getDefaultCPUGenerator();
}

at::Tensor state_of(const at::Device& device) {
  at::Generator gen = generator_of(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state().contiguous();
}

void restore(const at::Device& device, const at::Tensor& state) {
  at::Generator gen = generator_of(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

at::Tensor rng_state(const at::Device& device, int64_t* cuda_bytes) {
  const at::Tensor cpu = state_of(at::kCPU);
  *cuda_bytes = 0;
  if (!device.is_cuda()) return cpu;  // get_state() made a new tensor
  const at::Tensor cuda = state_of(device);
  *cuda_bytes = cuda.numel();
  return at::cat({cpu, cuda});
}

bool set_rng_state(const at::Tensor& state, int64_t cuda_bytes, const at::Device& device) {
  const int64_t cpu_bytes = state.numel() - cuda_bytes;
  restore(at::kCPU, state.narrow(0, 0, cpu_bytes).clone());
  if (cuda_bytes == 0 || !device.is_cuda()) return false;
  restore(device, state.narrow(0, cpu_bytes, cuda_bytes).clone());
  return true;
}

}  // namespace fsdp::detail
