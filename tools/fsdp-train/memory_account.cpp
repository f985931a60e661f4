// fsdp-train's memory account (see memory_account.h).
#include "memory_account.h"

#include <algorithm>

#include "fsdp/error.h"
#include "fsdp/report.h"

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
  // The sharded state: AdamW's moments in malloc's heap, the parameter shards and reduced
  // gradients in mappings of the engine's (NOTE [mapped shards], NOTE [gradient pool]); the
  // gathered and unsharded buffers in the engine's pool (NOTE [buffer pool]); what else the
  // heap holds live since the base is activations and temporaries.
  const int64_t state = engine_.sharded_state_bytes() + engine_.accumulation_bytes;
  const int64_t live = at_.heap_in_use - base_.heap_in_use - at_.checkpoint_staging;
  const int64_t state_in_heap = state - engine_.mapped_state_bytes;  // shards, pooled .grad: mapped
  std::vector<Part> out{
      {"process base", base_.rss_anon, "RssAnon before the model: libtorch, Gloo, threads, data"},
      {"sharded state", state, "parameter and gradient shards, optimizer state"},
      {"engine buffers", engine_.pool_mapped_bytes - engine_.pooled_grad_bytes,
       "gathered parameters and unsharded gradients (mapped, reused each step)"},
      {"activations", std::max<int64_t>(0, live - state_in_heap),
       "the rest of malloc's live heap: saved activations, temporaries"},
  };
  if (at_.checkpoint_staging > 0) {
    out.insert(out.begin() + 3, {"checkpoint staging", at_.checkpoint_staging,
                                 "--checkpoint-async's staging buffer, kept between saves"});
  }
  // Slack: memory malloc holds freed. Not all of it is resident (construction's freed heap was
  // given back: NOTE [construction's heap]; pages of free blocks never touched again are not),
  // and nothing says which, so it is the rest of RssAnon, as long as malloc holds that much
  // freed: an account that cannot explain RssAnon still shows a sum below it.
  int64_t explained = 0;
  for (const auto& p : out) explained += p.bytes;
  const int64_t freed = std::max<int64_t>(0, at_.heap_free - base_.heap_free);
  const int64_t slack = std::clamp<int64_t>(at_.rss_anon - explained, 0, freed);
  out.push_back({"allocator slack", slack,
                 fsdp::cat("freed but kept by malloc, resident: the rest of RssAnon (malloc holds ",
                           fsdp::format_bytes(double(freed)), " freed; --heap decides how much)")});
  return out;
}

int64_t MemoryAccount::sum() const {
  int64_t s = 0;
  for (const auto& p : parts()) s += p.bytes;
  return s;
}

}  // namespace fsdp_train
