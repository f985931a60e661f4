// fsdp/dcp.h: PyTorch's distributed checkpoint format (DCP: torch.distributed.checkpoint), in
// both directions, so a run of PyTorch FSDP / FSDP2 / torchtitan / Lightning continues here and a
// run here continues there (docs/dcp.md).
//
// A DCP checkpoint is a directory: `.metadata` (a pickled Metadata: every key's dtype, size and
// the N-d chunks that tile it, and where each chunk's bytes are) and one `__<rank>_<n>.distcp`
// file per writing rank (each chunk as torch.save writes a tensor). Both calls are collective:
// every rank of the model's runtime calls them, and every error is raised on every rank before
// anything changes.
#pragma once

#include <torch/optim.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fsdp/sharded.h"

namespace fsdp {

// One renaming rule: every match of `pattern` (ECMAScript regex) in a name becomes
// `replacement` ($1, $2: the groups). A rule that turns a name into "" drops it.
struct DcpRename {
  std::string pattern;
  std::string replacement;
};

// "REGEX=REPLACEMENT" (the first '=' splits it; the replacement may be empty), checked as a regex;
// fsdp::Error naming `text` otherwise.
DcpRename parse_dcp_rename(const std::string& text);

struct DcpOptions {
  // Import: applied in order to every checkpoint name (with the wrappers' prefixes "model.",
  // "module.", "_orig_mod." and "_checkpoint_wrapped_module." removed) to give the model's name.
  // Export: applied in order to every model name to give the checkpoint's (before the prefix).
  std::vector<DcpRename> renames;
  // Export: further checkpoint names a model tensor is written under (tied weights, e.g. nanoGPT's
  // "lm_head.weight" beside "transformer.wte.weight": PyTorch's load asks for both).
  std::map<std::string, std::vector<std::string>> also_as;
  // Padded rows (a vocabulary padded to a multiple, e.g. GPT-2's 50257 rows to 50304): model
  // name -> the rows that are real. A checkpoint may hold any row count from that up to the
  // model's; the rows it lacks are zeros (import), and export writes the model's.
  std::map<std::string, int64_t> real_rows;
  // Import: also the optimizer's state (AdamW / Adam: state.<fqn>.exp_avg, .exp_avg_sq, .step as
  // torch.distributed.checkpoint.state_dict.get_state_dict names them), its param_groups checked
  // against the optimizer's (betas, eps, weight_decay, amsgrad, maximize must be equal; lr is
  // reported: the caller's schedule sets it). Export always writes the optimizer's state when
  // given one.
  bool optimizer = false;
  // Export: the prefixes of the model's and the optimizer's keys, as
  // dcp.save({"model": model_state_dict, "optim": optimizer_state_dict}) writes them.
  std::string model_prefix = "model.";
  std::string optimizer_prefix = "optim.";
};

struct DcpImportInfo {
  int64_t tensors = 0;          // model tensors read
  int64_t optimizer_step = -1;  // the optimizer's step count (the largest of the parameters'), or
                                // -1 where no optimizer state was read
  double checkpoint_lr = -1;    // the learning rate the checkpoint's param_groups hold, or -1
  int64_t bytes_read = 0;       // this rank's
  // Everything adapted or left out, one sentence each: padded rows, dtype conversions, tied names
  // read once, items that are neither the model's nor the optimizer's.
  std::vector<std::string> notes;
};

// Whether `dir` is a DCP checkpoint (a directory with a `.metadata`).
bool is_dcp_checkpoint(const std::string& dir);

// Reads the DCP checkpoint `dir` into `model` (and `optimizer`'s state with options.optimizer),
// on any mesh: each rank reads only the chunks that overlap its shards. Model names, shapes and
// missing tensors are checked first, all at once; every problem in one line.
DcpImportInfo import_dcp(ShardedModuleBase& model, const std::string& dir,
                         torch::optim::Optimizer* optimizer = nullptr,
                         const DcpOptions& options = {});

// Writes `model` (and `optimizer`'s state, if given) as the DCP checkpoint `dir`: each rank of the
// first replica writes `__<rank>_0.distcp` with the boxes of its shards (a flat shard cut
// anywhere in a 2-D tensor is up to three boxes), then rank 0 writes `.metadata` atomically,
// last: a directory without it is not a checkpoint. An earlier export in `dir` is replaced.
void export_dcp(ShardedModuleBase& model, const std::string& dir,
                const torch::optim::Optimizer* optimizer = nullptr, const DcpOptions& options = {});

}  // namespace fsdp
