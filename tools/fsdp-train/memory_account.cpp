// fsdp-train's memory account (see memory_account.h).
#include "memory_account.h"

#include <algorithm>

namespace fsdp_train {

void MemoryAccount::sample(int64_t step, const char* when, const fsdp::MemoryStats& engine) {
  const fsdp::ProcessMemory now = fsdp::process_memory();
  if (step_ >= 0 && now.rss_anon <= at_.rss_anon) return;
  at_ = now;
  engine_ = engine;
  step_ = step;
  when_ = when;
}

std::vector<MemoryAccount::Part> MemoryAccount::parts() const {
  // The sharded state lives in malloc's heap (shards, their gradients, AdamW's moments); the
  // engine's gathered and unsharded buffers in its own mappings (NOTE [buffer pool]); what else
  // the heap holds live since the base is activations and temporaries, and the free memory it
  // gained is slack.
  const int64_t state = engine_.sharded_state_bytes() + engine_.accumulation_bytes;
  const int64_t live = at_.heap_in_use - base_.heap_in_use - at_.checkpoint_staging;
  std::vector<Part> out{
      {"process base", base_.rss_anon, "RssAnon before the model: libtorch, Gloo, threads, data"},
      {"sharded state", state, "parameter and gradient shards, optimizer state"},
      {"engine buffers", engine_.pool_mapped_bytes,
       "gathered parameters and unsharded gradients (mapped, reused each step)"},
      {"activations", std::max<int64_t>(0, live - state),
       "the rest of malloc's live heap: saved activations, temporaries"},
      {"allocator slack", std::max<int64_t>(0, at_.heap_free - base_.heap_free),
       "memory freed but kept by malloc (--heap decides how much)"},
  };
  if (at_.checkpoint_staging > 0) {
    out.insert(out.begin() + 3, {"checkpoint staging", at_.checkpoint_staging,
                                 "--checkpoint-async's staging buffer, kept between saves"});
  }
  return out;
}

int64_t MemoryAccount::sum() const {
  int64_t s = 0;
  for (const auto& p : parts()) s += p.bytes;
  return s;
}

}  // namespace fsdp_train
