// fsdp-train's account of a rank's memory: the process's anonymous resident memory at the largest
// of the moments sampled (the end of a forward, when activations are at their largest; the end of
// a backward, when every gradient shard exists; the end of the optimizer step, when the first
// step's optimizer state has just been made), split into parts that are each measured on their
// own, so that their sum can be checked against the kernel's number (docs/performance.md,
// "Where a rank's memory goes").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/memory.h"
#include "fsdp/sharded.h"

namespace fsdp_train {

class MemoryAccount {
 public:
  // Call before the model exists: the process's base (libtorch, Gloo, threads, the data).
  void set_base() { base_ = fsdp::process_memory(); }
  // Call at a moment of the step (`when`: "forward", "backward", "optimizer step") with the
  // engine's numbers (memory_stats(&optimizer): the optimizer's state counts as sharded state);
  // keeps the sample of largest RssAnon.
  void sample(int64_t step, const char* when, const fsdp::MemoryStats& engine);
  bool empty() const { return step_ < 0; }

  struct Part {
    std::string name;
    int64_t bytes;
    std::string what;
  };
  // The parts (base, sharded state, engine buffers, activations and temporaries, allocator slack)
  // and, last, their sum and the measured RssAnon.
  std::vector<Part> parts() const;
  int64_t sum() const;
  int64_t measured() const { return at_.rss_anon; }
  int64_t step() const { return step_; }
  const char* when() const { return when_; }

 private:
  fsdp::ProcessMemory base_, at_;
  fsdp::MemoryStats engine_;
  int64_t step_ = -1;
  const char* when_ = "";
};

}  // namespace fsdp_train
