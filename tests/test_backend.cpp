// Which backend a rank gets, why, and the one-line errors of the GPU rules (runtime_internal.h):
// nccl on a CPU-only libtorch or without a GPU, more ranks on a node than visible GPUs. Runs on
// every build: the rules are pure functions, and the Runtime part checks this machine's answer.
// Also the heap policy (set_heap_policy) every Runtime applies, and configure_process, which
// applies it and the thread count.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdlib>
#include <cstring>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <memory>
#include <string>

#include "fsdp/error.h"
#include "comm/backend_internal.h"
#include "runtime/runtime_internal.h"
#include "testing.h"

using namespace fsdp;

namespace {

// Runs `fn`, which must throw fsdp::Error; returns its message.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no fsdp::Error thrown";
  return "";
}

void expect_one_line_with(const std::string& message, const std::string& part) {
  EXPECT_NE(message.find(part), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
}

TEST(Backend, AutoPicksGlooOnACpuOnlyLibtorch) {
  auto c = fsdp::detail::choose_backend(Backend::kAuto, /*cuda_built=*/false, 0);
  EXPECT_EQ(c.backend, Backend::kGloo);
  EXPECT_EQ(c.reason, "auto picked gloo: this libtorch is a CPU-only build");
}

TEST(Backend, AutoPicksGlooOnACudaLibtorchWithoutAGpuAndSaysWhy) {
  auto c = fsdp::detail::choose_backend(Backend::kAuto, /*cuda_built=*/true, 0);
  EXPECT_EQ(c.backend, Backend::kGloo);
  expect_one_line_with(c.reason, "auto picked gloo: this libtorch has CUDA but sees no GPU");
  expect_one_line_with(c.reason, "CUDA_VISIBLE_DEVICES");
}

TEST(Backend, AutoPicksNcclWhereAGpuIsVisible) {
  auto c = fsdp::detail::choose_backend(Backend::kAuto, /*cuda_built=*/true, 2);
  EXPECT_EQ(c.backend, Backend::kNccl);
  EXPECT_EQ(c.reason, "auto picked nccl: this libtorch has CUDA and sees 2 GPUs");
  EXPECT_EQ(fsdp::detail::choose_backend(Backend::kGloo, true, 2).backend, Backend::kGloo);
}

TEST(Backend, NcclOnACpuOnlyLibtorchIsAClearError) {
  expect_one_line_with(error_of([] { fsdp::detail::choose_backend(Backend::kNccl, false, 0); }),
                       "backend nccl needs CUDA, but this libtorch is a CPU-only build; use "
                       "--backend gloo (or auto)");
}

void expect_retained() {
  ASSERT_TRUE(set_heap_policy(HeapPolicy::kRetain));
  constexpr size_t kBlock = 24 << 20;  // under kRetainMmapThreshold, over glibc's adaptive start
  static_assert(kBlock < kRetainMmapThreshold);
  const struct mallinfo2 before = ::mallinfo2();
  void* block = std::malloc(kBlock);
  ASSERT_NE(block, nullptr);
  std::memset(block, 1, kBlock);
  const struct mallinfo2 held = ::mallinfo2();
  EXPECT_LT(held.hblkhd, before.hblkhd + kBlock) << "the block was mmapped, not taken from the heap";
  std::free(block);
  const struct mallinfo2 after = ::mallinfo2();
  EXPECT_GE(after.fordblks, kBlock) << "the freed block went back to the system";
  // Over the mmap threshold too (M_MMAP_MAX 0): no mapping of its own, kept after free.
  constexpr size_t kLarge = 96 << 20;
  static_assert(kLarge > kRetainMmapThreshold);
  const struct mallinfo2 large_before = ::mallinfo2();
  void* large = std::malloc(kLarge);
  ASSERT_NE(large, nullptr);
  std::memset(large, 1, kLarge);
  EXPECT_EQ(::mallinfo2().hblkhd, large_before.hblkhd) << "the large block was mmapped";
  std::free(large);
  EXPECT_GE(::mallinfo2().fordblks, kLarge) << "the freed large block went back to the system";
}

TEST(Backend, NcclWithoutAVisibleGpuIsAClearError) {
  expect_one_line_with(error_of([] { fsdp::detail::choose_backend(Backend::kNccl, true, 0); }),
                       "backend nccl needs a GPU, but this CUDA libtorch sees none (");
}

TEST(Backend, MoreRanksOnANodeThanGpusIsAClearError) {
  fsdp::detail::check_one_gpu_per_rank(0, 1, 1);
  fsdp::detail::check_one_gpu_per_rank(3, 4, 8);
  expect_one_line_with(error_of([] { fsdp::detail::check_one_gpu_per_rank(3, 4, 2); }),
                       "4 ranks run on this node but it has only 2 visible GPUs (");
  expect_one_line_with(error_of([] { fsdp::detail::check_one_gpu_per_rank(1, 2, 1); }),
                       "NCCL needs one GPU per rank; start at most 1 ranks per node (--devices 1)");
}

// This process, as built: auto resolves to what choose_backend says for this libtorch and its
// GPUs, and nccl is refused with the same message where it cannot run.
TEST(Backend, RuntimeReportsItsChoice) {
  ClusterEnv env;
  env.kind = ClusterKind::kTorchElastic;
  RuntimeOptions opts;
  auto rt = fsdp::detail::make_runtime(c10::make_intrusive<c10d::HashStore>(), env, opts);
  if (rt->backend() == Backend::kNccl) {
    EXPECT_EQ(rt->device(), c10::Device(c10::kCUDA, 0));
    GTEST_SKIP() << "a GPU is visible: " << rt->backend_reason();
  }
  EXPECT_EQ(rt->device(), c10::Device(c10::kCPU));
#if defined(FSDP_WITH_CUDA)
  EXPECT_NE(rt->backend_reason().find("this libtorch has CUDA but sees no GPU"), std::string::npos)
      << rt->backend_reason();
#else
  EXPECT_EQ(rt->backend_reason(), "auto picked gloo: this libtorch is a CPU-only build");
#endif
  opts.backend = Backend::kNccl;
  expect_one_line_with(error_of([&] {
                         fsdp::detail::make_runtime(c10::make_intrusive<c10d::HashStore>(), env, opts);
                       }),
                       "; use --backend gloo (or auto)");
}

// Two ranks (threads) connecting at once each quiet glog: whichever scope ends first, the level
// from before both comes back when the last ends, not the other scope's FATAL-only.
TEST(Runtime, OverlappingQuietGlogScopesRestoreTheOriginalLevel) {
  int* level = fsdp::detail::glog_min_level();
  if (!level) GTEST_SKIP() << "this libtorch does not log via glog";
  const int original = *level;
  *level = 1;
  {
    auto a = std::make_unique<fsdp::detail::QuietGlog>();
    EXPECT_EQ(*level, 3);
    auto b = std::make_unique<fsdp::detail::QuietGlog>();
    a.reset();  // a ends first: b still wants quiet
    EXPECT_EQ(*level, 3);
    b.reset();
  }
  EXPECT_EQ(*level, 1);
  *level = original;
}

// kRetain: a block under the mmap threshold comes from the heap, and freeing it keeps it there
// for the next step instead of returning it to the system. Sanitizers bring their own allocator,
// which ignores mallopt: there set_heap_policy says so.
TEST(Heap, RetainKeepsFreedBuffersInTheHeap) {
  EXPECT_TRUE(set_heap_policy(HeapPolicy::kUnchanged));
  EXPECT_STREQ(to_string(HeapPolicy::kRetain), "retain");
  EXPECT_STREQ(to_string(HeapPolicy::kUnchanged), "unchanged");
  if (fsdp::testing::kSanitized) {
    EXPECT_FALSE(set_heap_policy(HeapPolicy::kRetain));
  } else {
    expect_retained();
  }
}

// configure_process applies the thread count and the heap policy together and says what took
// effect; 0 threads leaves the pools alone; a negative count is refused before anything changes.
TEST(Process, ConfigureProcessAppliesThreadsAndHeap) {
  const int before = at::get_num_threads();
  ProcessOptions options;
  options.threads = 2;
  options.heap = HeapPolicy::kUnchanged;
  ProcessSetup setup = configure_process(options);
  EXPECT_EQ(setup.threads, 2);
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_TRUE(setup.heap_applied);
  options.threads = 0;
  EXPECT_EQ(configure_process(options).threads, 2);
  options.threads = -1;
  expect_one_line_with(error_of([&] { configure_process(options); }), "threads -1 is invalid");
  EXPECT_EQ(at::get_num_threads(), 2);
  set_threads(before);
}

}  // namespace
