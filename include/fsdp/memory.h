// fsdp/memory.h: a process's memory as the kernel and the allocator see it, for accounting a
// rank's peak part by part (fsdp-train's summary; docs/performance.md, "Where a rank's memory
// goes").
//
// The engine's own bytes (shards, optimizer state, gathered parameters, pooled buffers) are in
// MemoryStats (fsdp/sharded.h); this adds what only the process knows: resident anonymous memory
// and how much of malloc's heap is live versus freed but kept.
#pragma once

#include <cstdint>

namespace fsdp {

struct ProcessMemory {
  int64_t rss_anon = 0;     // RssAnon: resident anonymous pages (heap, mappings, stacks)
  int64_t rss_file = 0;     // RssFile: resident pages of mapped files (libtorch's code...)
  int64_t peak_rss = 0;     // VmHWM: the most resident memory since start (or the last reset)
  int64_t heap_in_use = 0;  // malloc'ed and not yet freed (glibc mallinfo2: uordblks + hblkhd)
  int64_t heap_free = 0;    // freed but kept by malloc in its arenas (mallinfo2 fordblks)
  // The staging buffers of this process's fsdp::AsyncCheckpointers (fsdp/async_checkpoint.h),
  // kept between saves; part of heap_in_use.
  int64_t checkpoint_staging = 0;
};

// Reads /proc/self/status and glibc's mallinfo2 (heap fields 0 where the allocator is not
// glibc's). Local; cheap (no lock held while the heap is walked: mallinfo2 locks each arena).
ProcessMemory process_memory();

// Resets VmHWM to the current resident size (Linux 4.0+, /proc/self/clear_refs); false where the
// kernel refuses, and then peak_rss keeps counting from the process's start.
bool reset_peak_rss();

namespace detail {
// AsyncCheckpointer reports its staging buffer's growth (+) and release (-) here.
void add_checkpoint_staging_bytes(int64_t delta);
// Gives the pages of every free block of malloc's heap back to the system (glibc's
// malloc_trim(0): the top of the heap and whole free pages anywhere in it); the blocks stay
// malloc's, to be faulted in again when reused. Nothing under a sanitizer's allocator.
void release_free_heap();
}  // namespace detail

}  // namespace fsdp
