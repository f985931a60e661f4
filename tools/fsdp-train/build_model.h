// fsdp-train's model construction: the GPT built under fsdp::DeferredInit (--init deferred, the
// default: each block keeps only this rank's shard as it is built) or eagerly and then sharded
// (--init eager), optionally loaded from pretrained weights (--init-from), with what it cost.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "fsdp/dcp.h"
#include "fsdp/runtime.h"
#include "fsdp/sharded.h"
#include "gpt2.h"
#include "options.h"

namespace fsdp_train {

using Model = fsdp::ShardedModule<LanguageModel>;

// What construction did on this rank, for the banner and the summary.
struct Construction {
  bool deferred = true;
  double seconds = 0;         // building and sharding (not --init-from)
  int64_t peak_rss = 0;       // VmHWM reached while building and sharding, bytes
  bool peak_rss_reset = true; // false: /proc/self/clear_refs refused, the peak is since start
  // VmHWM was reset again when construction ended: from there on it measures what comes after
  // (weights loaded, training), which the summary shows beside the whole process's peak.
  bool peak_rss_reset_after = false;
  int64_t params = 0;         // the model's parameters (elements)
  int64_t units_deferred = 0; // units that sharded themselves as they were built
  int64_t largest_unit_bytes = 0;
  std::string init_from;      // --init-from, loaded
  fsdp::DcpImportInfo dcp;    // --init-from a DCP checkpoint: what was read and adapted
  double init_from_seconds = 0;
  // One line: "deferred: 12 units sharded as built, peak RSS 312 MiB, 0.41 s".
  std::string describe() const;
};

// Builds --model with --seed (and --freeze), shards it with plan.strategy on `runtime`, and loads
// --init-from, weights only: an llm.c model file, a full checkpoint file or a sharded checkpoint
// directory. Collective: every rank calls it.
Model build_model(const TrainOptions& o, const TrainPlan& plan,
                  const std::shared_ptr<fsdp::Runtime>& runtime, Construction* info);

}  // namespace fsdp_train
