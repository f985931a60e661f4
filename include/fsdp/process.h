// fsdp/process.h: what fsdp changes in the whole process, as opposed to one Runtime: the
// intra-op thread pools, glibc malloc's heap policy, and glog's level while a rank connects to
// its rendezvous store. configure_process() applies the lasting ones; Runtime::init calls it.
//
// NOTE [process-global state]
// Several runtimes can coexist in one process (tests run ranks as threads, each with its own
// store, groups and counters), so a Runtime keeps its state to itself. Three things cannot be
// kept per runtime, because the libraries underneath have one per process:
//   1. the size of libtorch's and OpenBLAS's intra-op thread pools (set_threads);
//   2. glibc malloc's mmap and trim thresholds (set_heap_policy, NOTE [CPU heap] in
//      src/runtime/process_setup.cpp);
//   3. glog's minimum level, raised to FATAL-only while a rank connects to the rendezvous store
//      and restored when the last rank of the process has connected (NOTE [quiet glog] in
//      src/runtime/process_setup.cpp). Scoped, never lasting: nothing to configure.
// All three live in src/runtime/process_setup.cpp and nowhere else. configure_process() owns 1 and 2:
// Runtime::init calls it once per runtime, with the runtime's threads and heap policy (the
// last call's settings stay in effect; calls from several threads are serialised, and calling
// it again with the same settings changes nothing). Runtime::init also makes the rank's GPU the
// current CUDA device of the calling thread (NCCL): per thread, not per process.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp {

// What glibc's malloc does with memory a training step frees (NOTE [CPU heap] in
// src/runtime/process_setup.cpp).
enum class HeapPolicy {
  // Keep freed memory for the next step: every buffer comes from the heap (none gets a mapping
  // of its own), and up to 1 GiB of free heap is kept rather than returned to the system
  // (mallopt M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_MMAP_MAX). A step then reuses the pages of the one before instead of faulting them in
  // again: measured 15% less time per step for the small GPT on one CPU rank (minor page faults
  // fell from ~37,600 to ~100 per step), about 5% more peak RSS.
  kRetain,
  // Keep as little freed memory as possible: blocks of 128 KiB or more get mappings of their
  // own, unmapped when freed, and the heap top is trimmed past 256 KiB free. The smallest peak
  // RSS (no fragmentation by large blocks), at the cost of page faults for large activations
  // each step: for the largest model that fits a memory cap.
  kLean,
  // Leave the allocator's settings as they are (glibc: trims the heap whenever the free memory
  // at its top exceeds a threshold it adapts itself, often after every step).
  kUnchanged,
};
// kRetain's settings: the largest block served from the heap (glibc's maximum, HEAP_MAX_SIZE / 2
// on 64-bit), the free heap kept before glibc returns memory to the system, and no mmapped
// blocks at all (M_MMAP_MAX 0): a block over the threshold comes from the heap too, instead of a
// mapping of its own that is faulted in and unmapped every step (GPT-2 124M on CPU: minor page
// faults per step 265,600 -> 36).
constexpr int kRetainMmapThreshold = 32 << 20;
constexpr int kRetainTrimThreshold = 1 << 30;
constexpr int kRetainMmapMax = 0;
// kLean's settings (M_MMAP_MAX back to glibc's default, 65536 mappings).
constexpr int kLeanMmapThreshold = 128 << 10;
constexpr int kLeanTrimThreshold = 256 << 10;
constexpr int kLeanMmapMax = 65536;
const char* to_string(HeapPolicy p);  // "retain" | "lean" | "unchanged"
HeapPolicy parse_heap_policy(const std::string& text);  // any case; fsdp::Error lists the choices
// Applies `policy` to this process's allocator. Returns false where the allocator ignores these
// settings (not glibc, or a sanitizer's allocator), true otherwise (kUnchanged: always true).
bool set_heap_policy(HeapPolicy policy);

// Sets libtorch's and OpenBLAS's intra-op threads of this process. Throws fsdp::Error below 1.
void set_threads(int64_t threads);

// The lasting process-global settings (NOTE [process-global state]).
struct ProcessOptions {
  // Intra-op threads (set_threads). 0 (default): leave the pools as they are.
  int64_t threads = 0;
  // The allocator's policy (set_heap_policy). Default kRetain.
  HeapPolicy heap = HeapPolicy::kRetain;
};

// What configure_process did.
struct ProcessSetup {
  int64_t threads = 0;        // libtorch's intra-op threads afterwards
  bool heap_applied = false;  // set_heap_policy's result
};

// Applies `options` to this process: the one place fsdp changes process-wide settings (NOTE
// [process-global state]). Thread-safe: concurrent calls are serialised, the last one's settings
// stay in effect; the same options applied again change nothing. Throws fsdp::Error for
// negative threads, before changing anything.
ProcessSetup configure_process(const ProcessOptions& options);

}  // namespace fsdp
