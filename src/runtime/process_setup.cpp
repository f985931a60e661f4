// Everything fsdp changes in the whole process: the intra-op thread pools, glibc malloc's heap
// policy (configure_process, fsdp/process.h) and glog's level while a rank connects (QuietGlog,
// process_setup.h). NOTE [process-global state] in fsdp/process.h says why these and no others.
#include "fsdp/process.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <malloc.h>

#include <cctype>
#include <mutex>
#include <string>

#include "fsdp/error.h"
#include "fsdp/parse_enum.h"
#include "runtime/process_setup.h"

namespace fsdp {

// NOTE [CPU heap]: a training step allocates and frees the same activations, gradients and
// gathered parameters every step, most of them 128 KiB - 32 MiB. glibc serves the first large
// blocks with mmap, raises its mmap threshold to the size of the largest one freed, and trims the
// heap top whenever more than twice that is free: after every backward, the activations' pages
// go back to the kernel and the next forward faults them in again, zeroed. Measured with
// fsdp-train (small GPT, global batch 16 x 128, one rank, libtorch 1.13): 37,600 minor faults
// and 0.50 s per step, against about 100 and 0.42 s with the thresholds below (peak RSS 480 ->
// 503 MiB). PyTorch's Python processes mostly escape it: something large freed early (at import)
// raises the adaptive threshold high enough (ddp_peer.py's one process: ~900 faults per step).
// Setting either threshold turns glibc's adaptation off, so both are set.
// kLean does the opposite: a fixed, small mmap threshold sends every block of 128 KiB or more to
// its own mapping, returned to the kernel when freed, and a small trim threshold returns the
// heap top: the heap then holds little freed memory (no fragmentation by large blocks), at the
// cost of faulting large activations in again each step. The engine's own large buffers are
// pooled either way (NOTE [buffer pool] in src/engine/buffer_pool.h).
const char* to_string(HeapPolicy p) {
  switch (p) {
    case HeapPolicy::kRetain: return "retain";
    case HeapPolicy::kLean: return "lean";
    case HeapPolicy::kUnchanged: return "unchanged";
  }
  return "?";
}

HeapPolicy parse_heap_policy(const std::string& text) {
  return parse_enum(text, {HeapPolicy::kRetain, HeapPolicy::kLean, HeapPolicy::kUnchanged},
                    "heap policy");
}

bool set_heap_policy(HeapPolicy policy) {
  if (policy == HeapPolicy::kUnchanged) return true;
#if defined(__GLIBC__)
  const bool retain = policy == HeapPolicy::kRetain;
  // mallopt returns 1 on success; sanitizers' allocators take the call and return 0.
  return ::mallopt(M_MMAP_THRESHOLD, retain ? kRetainMmapThreshold : kLeanMmapThreshold) == 1 &&
         ::mallopt(M_TRIM_THRESHOLD, retain ? kRetainTrimThreshold : kLeanTrimThreshold) == 1 &&
         ::mallopt(M_MMAP_MAX, retain ? kRetainMmapMax : kLeanMmapMax) == 1;
#else
  return false;
#endif
}

void set_threads(int64_t threads) {
  FSDP_CHECK(threads >= 1, "threads ", threads, " is invalid; use 1 or more");
  at::set_num_threads(static_cast<int>(threads));
  // OpenBLAS keeps its own pool, sized from OPENBLAS_NUM_THREADS or the core count at load time.
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(static_cast<int>(threads));
  }
}

namespace detail {

// NOTE [quiet glog]: glog's minimum level is one process-wide flag, and ranks running as threads
// (tests) connect to their stores at the same time. Each scope saving and restoring the level
// itself would race: A saves 0 and sets 3, B saves 3, A restores 0, B restores 3, and glog stays
// quiet for good. So the scopes are counted under one mutex: the first saves the level, the last
// restores it.
namespace {
std::mutex glog_mutex;
int glog_scopes = 0;
int glog_saved_level = 0;
}  // namespace

int* glog_min_level() {
  static int* const level =
      static_cast<int*>(dlsym(RTLD_DEFAULT, "_ZN3fLI17FLAGS_minloglevelE"));
  return level;
}

QuietGlog::QuietGlog() {
  int* level = glog_min_level();
  if (!level) return;
  std::lock_guard<std::mutex> lock(glog_mutex);
  if (glog_scopes++ == 0) {
    glog_saved_level = *level;
    *level = 3;  // FATAL only
  }
}

QuietGlog::~QuietGlog() {
  int* level = glog_min_level();
  if (!level) return;
  std::lock_guard<std::mutex> lock(glog_mutex);
  if (--glog_scopes == 0) *level = glog_saved_level;
}

}  // namespace detail

ProcessSetup configure_process(const ProcessOptions& options) {
  FSDP_CHECK(options.threads >= 0, "threads ", options.threads,
             " is invalid; use 1 or more (0 = leave the thread pools as they are)");
  // Serialised so that two runtimes starting at once (ranks as threads) leave one call's
  // settings, not a mix of both.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (options.threads > 0) set_threads(options.threads);
  ProcessSetup setup;
  setup.heap_applied = set_heap_policy(options.heap);
  setup.threads = at::get_num_threads();
  return setup;
}

}  // namespace fsdp
