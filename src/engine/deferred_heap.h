// deferred_heap.h (internal): large CPU allocations in mappings of their own while a model is
// built under fsdp::DeferredInit.
//
// NOTE [deferred heap]
// Deferred construction builds one unit, slices this rank's shard and frees the unit's whole
// values before the next unit exists. Through glibc's malloc those values land in the heap from
// the second unit on (freeing the first raises glibc's adaptive mmap threshold to its size), and
// what stays between them (modules, names, small tensors) keeps that freed memory from going
// back: construction's own peak held most of the units at once (W = 8, 16 blocks of d 768:
// 448 MiB; eager construction, which allocates every value before freeing any, gets fresh
// mmaps for all of them).
// So while any DeferredInit is active (CPU runtimes; counted, ranks may be threads of one
// process), the process's CPU allocator maps every block of at least 1 MiB on its own and
// unmaps it on free: the same run's construction peaks at 242 MiB, one unit above the shards.
// Smaller blocks, and every block when no DeferredInit is active, go to the allocator that was
// there before (it stays installed, passing everything through, once installed). Not under a
// sanitizer's allocator, which must see every block.
#pragma once

namespace fsdp::detail {

class DeferredHeapScope {
 public:
  DeferredHeapScope();
  ~DeferredHeapScope();
  DeferredHeapScope(const DeferredHeapScope&) = delete;
  DeferredHeapScope& operator=(const DeferredHeapScope&) = delete;
};

}  // namespace fsdp::detail
