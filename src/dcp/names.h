// dcp/names.h (internal): from a DCP checkpoint's keys to the model's names and back — renaming
// rules, the wrappers' prefixes PyTorch adds, and the keys of optimizer state and param_groups
// (get_state_dict's "state.<fqn>.<field>", flattened by dcp.save under the optimizer's prefix).
#pragma once

#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "fsdp/dcp.h"

namespace fsdp::detail {

class Renamer {
 public:
  explicit Renamer(const std::vector<DcpRename>& rules);
  // `name` through every rule in order; "" where a rule dropped it.
  std::string operator()(std::string name) const;

 private:
  std::vector<std::pair<std::regex, std::string>> rules_;
};

// `name` without the prefixes wrappers add: "model." (Lightning, dcp.save({"model": ...})),
// "module." (DistributedDataParallel), "_orig_mod." (torch.compile), and without
// "_checkpoint_wrapped_module." anywhere (activation checkpointing).
std::string strip_wrappers(std::string name);

// "[<prefix>.]state.<fqn>.<field>": the optimizer state of parameter fqn.
struct OptimizerStateKey {
  std::string fqn, field;
};
std::optional<OptimizerStateKey> optimizer_state_key(const std::string& key);

// "[<prefix>.]param_groups[.<group>.<field>]": a param_groups item; group -1 for the whole list
// (older PyTorch pickles it in one item), field "" then.
struct ParamGroupKey {
  int64_t group = -1;
  std::string field;
};
std::optional<ParamGroupKey> param_group_key(const std::string& key);

}  // namespace fsdp::detail
