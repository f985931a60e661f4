// plan_units(): which modules become units and which parameters each holds (pure; the engine,
// the topology report and fsdp-train --dry-run use it).
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "fsdp/error.h"
#include "fsdp/sharded.h"

namespace fsdp {

std::vector<UnitInfo> plan_units(torch::nn::Module& model, const WrapPolicy& policy,
                                 int64_t shard_size) {
  FSDP_CHECK(shard_size >= 1, "shard size ", shard_size, " is invalid");
  // Not named_modules(include_self): that needs the root in a shared_ptr.
  auto modules = model.named_modules("", /*include_self=*/false);
  // Candidates: fsdp::Unit<M> members, and (for policies other than units()) Sequential children.
  std::map<std::string, bool> candidate;
  for (const auto& m : modules) {
    if (dynamic_cast<const UnitHooks*>(m.value().get())) candidate[m.key()] = true;
  }
  if (policy.wraps_sequential_children()) {
    if (dynamic_cast<const torch::nn::SequentialImpl*>(&model)) {
      for (const auto& c : model.named_children()) candidate[c.key()] = true;
    }
    for (const auto& m : modules) {
      if (!dynamic_cast<const torch::nn::SequentialImpl*>(m.value().get())) continue;
      for (const auto& c : m.value()->named_children()) candidate[m.key() + "." + c.key()] = true;
    }
  }
  std::vector<std::string> selected;
  for (const auto& m : modules) {
    int64_t numel = 0;
    for (const auto& p : m.value()->parameters()) numel += p.numel();
    const bool is_candidate = candidate.count(m.key()) > 0;
    if (!is_candidate) {
      FSDP_CHECK(!(policy.strict_types() && policy.selects(*m.value(), numel)),
                 "wrap policy ", policy.name(), " selects '", m.key(), "' (", m.value()->name(),
                 ") but fsdp cannot intercept its forward (C++ modules have no forward hooks); "
                 "declare it as fsdp::Unit<", m.value()->name(), "> in the model, or put it in a "
                 "torch::nn::Sequential");
      continue;
    }
    if (numel > 0 && policy.selects(*m.value(), numel)) selected.push_back(m.key());
  }
  // Each parameter belongs to the innermost selected unit containing it, else to the root.
  std::vector<UnitInfo> units(selected.size() + 1);
  units[0].name = "";
  for (size_t i = 0; i < selected.size(); ++i) units[i + 1].name = selected[i];
  std::map<c10::TensorImpl*, size_t> owner;
  for (const auto& p : model.named_parameters()) {
    size_t best = 0, best_len = 0;
    for (size_t i = 1; i < units.size(); ++i) {
      const std::string& n = units[i].name;
      if (p.key().size() > n.size() && p.key().compare(0, n.size(), n) == 0 &&
          p.key()[n.size()] == '.' && n.size() >= best_len) {
        best = i;
        best_len = n.size();
      }
    }
    auto* impl = p.value().unsafeGetTensorImpl();
    auto it = owner.find(impl);
    if (it != owner.end() && it->second != best) {
      throw Error(detail::cat("parameter '", p.key(), "' is shared between units '",
                              detail::display(units[it->second].name), "' and '",
                              detail::display(units[best].name), "'; a shared (tied) parameter must "
                              "live in one unit: leave one of them out of the wrap policy"));
    }
    // NOTE [frozen parameters]: trainable and frozen parameters go to separate flats.
    const bool trainable = p.value().requires_grad();
    if (it == owner.end()) {
      owner[impl] = best;
      (trainable ? units[best].numel : units[best].frozen_numel) += p.value().numel();
    }
    (trainable ? units[best].params : units[best].frozen_params).push_back(p.key());
  }
  for (auto& u : units) u.set_shard_size(shard_size);
  // Units left without parameters (all in nested units) are dropped, except the root.
  std::vector<UnitInfo> out;
  for (size_t i = 0; i < units.size(); ++i) {
    if (i == 0 || units[i].total_numel() > 0) out.push_back(std::move(units[i]));
  }
  return out;
}

}  // namespace fsdp
