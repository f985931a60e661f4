// fsdp/runtime.h: this process's membership in the job: rendezvous, process groups, threads.
//
// Runtime::init() reads the launcher's environment (cluster.h), sets this rank's intra-op threads,
// meets the other ranks through a c10d TCPStore hosted by rank 0 and creates the world group
// (Gloo on CPU, NCCL on CUDA). Several runtimes can coexist (tests run ranks as threads); nothing
// here is process-global except libtorch's own thread-pool size.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/cluster.h"
#include "fsdp/collectives.h"

namespace fsdp {

enum class Backend {
  kAuto,  // nccl when this libtorch has CUDA and a GPU is visible, else gloo
  kGloo,  // CPU tensors
  kNccl,  // CUDA tensors, one GPU per local rank (cuda:<LOCAL_RANK>); more local ranks than
          // visible GPUs is an error
};
const char* to_string(Backend b);
Backend parse_backend(const std::string& text);  // "auto" | "gloo" | "nccl", any case

// What glibc's malloc does with memory a training step frees (NOTE [CPU heap] in runtime.cpp).
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

struct RuntimeOptions {
  // Collective backend. Default kAuto.
  Backend backend = Backend::kAuto;
  // Rendezvous and collective timeout: a rank that waits longer for its peers fails with an
  // error naming what it waited for, instead of hanging. Default 5 minutes.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Intra-op threads of this rank. 0 (default): OMP_NUM_THREADS if set (the launcher sets it),
  // else max(1, cores / local world size).
  int64_t threads = 0;
  // How all-gather and reduce-scatter run (see collectives.h). Default kAuto.
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::kAuto;
  // Applied by init() to the whole process (set_heap_policy). Default kRetain.
  HeapPolicy heap = HeapPolicy::kRetain;
};

class Runtime {
 public:
  // Joins the job described by the environment (detect_cluster). Throws fsdp::Error on a bad
  // environment, an unreachable or busy rendezvous address, or ranks missing past the timeout.
  static std::shared_ptr<Runtime> init(const RuntimeOptions& options = {});
  static std::shared_ptr<Runtime> init(const ClusterEnv& env, const RuntimeOptions& options);

  // Waits (up to the timeout) until every rank reached shutdown before rank 0 closes the store.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const ClusterEnv& env() const;
  int64_t rank() const;
  int64_t world_size() const;
  Backend backend() const;           // resolved: never kAuto
  // Why backend() is what it is, e.g. "auto picked gloo: this libtorch has CUDA but sees no GPU
  // (CUDA_VISIBLE_DEVICES='')". The library prints nothing: a tool shows it where it reports
  // its setup.
  const std::string& backend_reason() const;
  // Whether options().heap took effect (set_heap_policy's result).
  bool heap_applied() const;
  c10::Device device() const;        // cpu, or cuda:<local rank> with NCCL
  const RuntimeOptions& options() const;
  int64_t threads() const;           // intra-op threads this rank uses

  // The group of all ranks.
  std::shared_ptr<Group> world() const;

  // Creates the group of the global `ranks` (in group-rank order). Every rank must call it with
  // the same arguments in the same order, members or not (each call takes the next store
  // prefix); non-members get nullptr. `kind` labels the group's metrics ("shard", "replicate").
  // `algorithm` overrides the runtime's choice for this group (benchmarks).
  std::shared_ptr<Group> new_group(const std::vector<int64_t>& ranks, const std::string& kind,
                                   CollectiveAlgorithm algorithm = CollectiveAlgorithm::kAuto);

  // Throws fsdp::Error on every rank, naming both values, unless every rank passed the same
  // `value` for `what`. Uses only the store, so it is safe before the first collective and
  // cannot hang on mismatched collectives.
  void check_agreement(const std::string& what, const std::string& value);

  // Makes a local failure everyone's: each rank passes "" if its part of `what` succeeded, else
  // its error message. Returns on every rank if all succeeded; otherwise throws fsdp::Error on
  // every rank: a failed rank its own ("<what> failed: ..."), the others the lowest failed
  // rank's ("<what> failed on rank k: ..."), so
  // no rank goes on into a collective its peers will never join. Store only; call on every rank
  // in the same order.
  void check_all_ok(const std::string& what, const std::string& local_error);

  struct Impl;  // defined in runtime.cpp; tests build runtimes on an in-process store through it

 private:
  explicit Runtime(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend struct RuntimeFactory;
};

// Sets libtorch's and OpenBLAS's intra-op threads of this process.
void set_threads(int64_t threads);

}  // namespace fsdp
