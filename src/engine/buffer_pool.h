// buffer_pool.h (internal): the engine's large CPU buffers outside malloc (NOTE [buffer pool]).
//
// NOTE [buffer pool]
// A training step frees and allocates the same large buffers again and again: each unit's
// gathered flat (all-gather output) and its unsharded gradient. Through
// glibc they land in the brk heap (under its adaptive mmap threshold, or always under
// HeapPolicy::kRetain), where activations freed in between fragment it: freed memory the
// process keeps but cannot reuse for the next large block. Measured on FULL_SHARD, 13 blocks of
// d 512 at W = 4: 216 MiB of a 548 MiB anonymous peak explained by nothing the engine holds.
// So these buffers come from anonymous mappings of their own, cached by byte size: a step reuses
// the previous step's mappings (no page faults, no fragmentation), and a mapping no step asked
// for since the previous trim() goes back to the system (a run that shrinks gives memory back).
// Only activations and small allocations go through malloc. CPU only: CUDA memory is the CUDA
// caching allocator's business.
// Thread-safe: buffers are freed on autograd's threads.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>

namespace fsdp::detail {

class BufferPool {
 public:
  BufferPool();
  // `bytes` of zero-or-stale memory; returns to the pool when the DataPtr dies.
  at::DataPtr allocate(size_t bytes);
  // A 1-D CPU tensor of `numel` elements of `dtype` in pooled memory (uninitialised).
  at::Tensor empty(int64_t numel, c10::ScalarType dtype);
  // A 1-D tensor of `dtype` with no elements and no memory, for fill() to give a block later:
  // its objects (TensorImpl, StorageImpl...) can be made before a step's large buffers exist
  // (NOTE [gradient shells] in engine.h).
  static at::Tensor shell(c10::ScalarType dtype);
  // Gives `shell` (from shell(), empty so far) `numel` elements of pooled memory.
  void fill(at::Tensor& shell, int64_t numel);
  // Whether `t`'s memory comes from a BufferPool (any pool).
  static bool pooled(const at::Tensor& t);
  // Unmaps cached blocks that no allocation reused since the previous trim(). Call once a step.
  void trim();

  struct Stats {
    int64_t mapped_bytes = 0;  // mapped now: in use + cached
    int64_t cached_bytes = 0;  // free, kept for reuse
    int64_t peak_mapped_bytes = 0;
  };
  Stats stats() const;
  void reset_peak();

  struct State;

 private:
  std::shared_ptr<State> state_;  // shared with every live buffer's deleter
};

}  // namespace fsdp::detail
