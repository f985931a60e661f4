// fsdp-train --plan: fsdp-plan's table (fsdp/planner.h) for this run's model, with the units the
// engine would make of it (frozen parameters included), on this machine: the calibrated cluster
// file if `fsdp-plan --calibrate` wrote one, else the "this-machine" preset. This run's strategy
// and mesh are marked.
#include <iostream>

#include "fsdp/error.h"
#include "fsdp/planner.h"
#include "gpt2.h"
#include "train.h"

namespace fsdp_train {

int run_plan(const TrainOptions& o, const TrainPlan& p) {
  // The model this run would train (GPT-2 or a byte GPT), for its exact units; the shape for
  // the FLOPs and activations.
  auto net = make_model(p.preset, o.freeze);
  freeze_parameters(*net, o.freeze);  // the root's; each block froze its own
  fsdp::ModelSpec model;
  model.name = p.preset.name;
  model.layers = p.preset.n_layers;
  model.hidden = p.preset.d_model;
  model.heads = p.preset.n_heads;
  model.vocab = p.preset.vocab;
  model.seq_len = o.seq_len;
  model.positions = p.preset.context;
  model.biases = true;
  model.tied_embeddings = p.preset.gpt2;
  model.units = fsdp::plan_units(*net, p.strategy.auto_wrap_policy(), 1);

  fsdp::ClusterSpec cluster = fsdp::this_machine_cluster();
  cluster.ranks_per_node = p.local_world_size;
  cluster.nodes = p.world_size / p.local_world_size;

  fsdp::PlanOptions options;
  options.micro_batch = p.micro_batch;
  options.grad_accum = o.grad_accum;
  options.param_dtype = p.bf16 ? c10::kBFloat16 : c10::kFloat;
  options.reduce_dtype = options.param_dtype;
  options.optimizer_states = 2;  // AdamW
  options.recompute = o.activation_checkpointing ? fsdp::Recompute::kFull : fsdp::Recompute::kNone;
  options.grad_sync = p.strategy.grad_sync();
  options.prefetch = p.strategy.forward_prefetch();
  options.clip = o.clip_grad > 0;
  if (options.grad_sync == fsdp::GradSync::kReplicateOnLast) {
    options.strategies = {fsdp::ShardingStrategy::kHybridShard,
                          fsdp::ShardingStrategy::kHybridShardZero2};
  }
  const fsdp::ClusterPlan plan = fsdp::plan_cluster(model, cluster, options);
  const auto& s = p.sharding;
  if (o.json) {
    std::cout << plan.to_json() << "\n";
    return 0;
  }
  const std::string mine = fsdp::cat(fsdp::to_string(s.strategy), " (",
                                             s.replicate_size(), ", ", s.shard_size(), ")");
  std::cout << "fsdp-train --plan: cluster " << cluster.name
            << (cluster.name == "this-machine" ? " (preset; fsdp-plan --calibrate measures it)"
                                               : " (" + fsdp::calibrated_cluster_path() + ")")
            << "; nothing is started\n\n"
            << plan.to_text(mine);
  if (!plan.find(s.strategy, s.replicate_size(), s.shard_size())) {
    for (const auto& e : plan.excluded) {
      if (e.label() == mine) std::cout << "\nthis run, " << mine << ", is " << e.excluded << "\n";
    }
  }
  return 0;
}

}  // namespace fsdp_train
