// plan_cluster: every strategy on every mesh, ranked, with the reason (see fsdp/planner.h).
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "fsdp/error.h"
#include "fsdp/planner.h"

namespace fsdp {

using detail::cat;

std::string PlanCandidate::mesh_string() const { return cat("(", replicate, ", ", shard, ")"); }
std::string PlanCandidate::label() const { return cat(to_string(strategy), " ", mesh_string()); }

const PlanCandidate* ClusterPlan::find(ShardingStrategy s, int64_t r, int64_t sh) const {
  for (const auto& c : ranked) {
    if (c.strategy == s && c.replicate == r && c.shard == sh) return &c;
  }
  return nullptr;
}

void PlanOptions::validate() const {
  FSDP_CHECK(micro_batch >= 1, "micro-batch ", micro_batch, " is invalid; give 1 or more sequences");
  FSDP_CHECK(grad_accum >= 1, "grad accumulation ", grad_accum, " is invalid; give 1 or more");
  FSDP_CHECK(optimizer_states >= 0 && optimizer_states <= 4, "optimizer states ", optimizer_states,
             " per parameter is invalid; AdamW has 2, SGD with momentum 1");
  FSDP_CHECK(grad_sync != GradSync::kReplicateOnLast || strategies.empty() ||
                 std::all_of(strategies.begin(), strategies.end(), is_hybrid),
             "grad sync replicate_on_last needs hybrid strategies only");
}

namespace {

std::string percent(double f) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.0f%%", 100 * f);
  return buf;
}

std::string fraction_of(int64_t part, int64_t whole) {
  if (whole <= 0 || part <= 0) return "none";
  if (part == whole) return "all";
  if (whole % part == 0) return cat("1/", whole / part);
  return percent(double(part) / double(whole));
}

// Why `c` is excluded from the candidates, or "" if it is one.
std::string exclusion(ShardingStrategy s, int64_t R, int64_t S, const ClusterSpec& cl) {
  const int64_t rpn = cl.ranks_per_node;
  if (is_hybrid(s) && R == 1) {
    return cat("one replica: the same as ",
               s == ShardingStrategy::kHybridShard ? "FULL_SHARD" : "SHARD_GRAD_OP");
  }
  if (is_hybrid(s) && S == 1) return "shard groups of one rank: the same as NO_SHARD";
  if (S % rpn != 0 && rpn % S != 0) {
    return cat("shard groups of ", S, " straddle nodes of ", rpn,
               " ranks unevenly (neither divides the other)");
  }
  return "";
}

// The one-line reason for the winner, against the best alternative of another kind.
std::string reason_for(const PlanCandidate& best, const std::vector<PlanCandidate>& ranked) {
  std::string r = cat(best.label(), ": ");
  const PlanCandidate* full = nullptr;
  const PlanCandidate* other = nullptr;
  for (const auto& c : ranked) {
    if (&c == &best) continue;
    if (!full && c.strategy == ShardingStrategy::kFullShard) full = &c;
    if (!other && c.fits) other = &c;
  }
  const int64_t total_grad = best.memory.grads * best.shard;
  if (is_hybrid(best.strategy) && best.replicate_crosses_nodes && !best.shard_crosses_nodes) {
    r += cat("only ", fraction_of(best.memory.grads, total_grad),
             " of the gradient crosses nodes, parameters are gathered inside a node");
  } else if (best.strategy == ShardingStrategy::kNoShard) {
    r += "the model states fit unsharded, so nothing is gathered";
  } else {
    r += cat(percent(best.time.exposed_fraction()), " of its step waits on communication, ",
             format_bytes(double(best.memory.total())), " of ", format_bytes(double(best.capacity)),
             " per rank");
  }
  const PlanCandidate* cmp = (full && full->strategy != best.strategy) ? full : other;
  if (cmp) {
    if (!cmp->fits) {
      r += cat("; ", cmp->label(), " would not fit (", format_bytes(double(cmp->memory.total())),
               ")");
    } else {
      const double slower = cmp->time.step / std::max(best.time.step, 1e-12) - 1;
      r += cat("; ", cmp->label(), " would spend ", percent(cmp->time.exposed_fraction()),
               " of the step waiting on ",
               cmp->shard_crosses_nodes || cmp->replicate_crosses_nodes ? "the inter-node link"
                                                                       : "communication",
               slower >= 0.005 ? cat(" (", percent(slower), " slower)")
                               : cat(" (the same step time within 1%, ",
                                     format_bytes(double(cmp->memory.total())), " per rank)"));
    }
  }
  return r;
}

}  // namespace

ClusterPlan plan_cluster(const ModelSpec& model, const ClusterSpec& cluster,
                         const PlanOptions& options) {
  model.validate();
  cluster.validate();
  options.validate();
  ClusterPlan out;
  out.model = model;
  out.cluster = cluster;
  out.options = options;
  const int64_t W = cluster.world_size();
  std::vector<ShardingStrategy> strategies = options.strategies;
  if (strategies.empty()) {
    strategies = {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                  ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
                  ShardingStrategy::kHybridShardZero2};
  }
  std::vector<std::pair<int64_t, int64_t>> meshes;
  if (!options.mesh.empty()) {
    const MeshLayout l = MeshLayout::resolve(options.mesh, W);  // -1 inferred; throws with a fix
    meshes.push_back(l.ndim() == 1 ? std::make_pair(int64_t{1}, l.size(0))
                                   : std::make_pair(l.size(0), l.size(1)));
  } else {
    for (int64_t s = W; s >= 1; --s) {
      if (W % s == 0) meshes.push_back({W / s, s});
    }
  }
  for (ShardingStrategy st : strategies) {
    if (options.grad_sync == GradSync::kReplicateOnLast && !is_hybrid(st)) continue;
    for (auto [R, S] : meshes) {
      // Non-hybrid strategies have one mesh each.
      if ((st == ShardingStrategy::kFullShard || st == ShardingStrategy::kShardGradOp) && R != 1) {
        continue;
      }
      if (st == ShardingStrategy::kNoShard && S != 1) continue;
      const std::string why = exclusion(st, R, S, cluster);
      if (!why.empty() && options.mesh.empty()) {
        PlanCandidate c;
        c.strategy = st;
        c.replicate = R;
        c.shard = S;
        c.excluded = why;
        out.excluded.push_back(c);
        continue;
      }
      out.ranked.push_back(evaluate_candidate(model, cluster, options, st, R, S));
    }
  }
  FSDP_CHECK(!out.ranked.empty(), "no strategy/mesh is a candidate for ", W, " ranks with the ",
             "given --strategy/--mesh; drop the filter or choose a mesh that divides the world");
  std::stable_sort(out.ranked.begin(), out.ranked.end(),
                   [](const PlanCandidate& a, const PlanCandidate& b) {
                     if (a.fits != b.fits) return a.fits;
                     if (!a.fits) return a.memory.total() < b.memory.total();
                     return a.time.step < b.time.step;
                   });
  // Within 1% of the fastest, the smallest footprint goes first: the same speed, more headroom.
  if (out.ranked.front().fits) {
    const double limit = out.ranked.front().time.step * 1.01;
    size_t pick = 0;
    for (size_t i = 1; i < out.ranked.size() && out.ranked[i].fits && out.ranked[i].time.step <= limit; ++i) {
      if (out.ranked[i].memory.total() < out.ranked[pick].memory.total()) pick = i;
    }
    std::rotate(out.ranked.begin(), out.ranked.begin() + long(pick), out.ranked.begin() + long(pick) + 1);
  }
  for (auto& c : out.ranked) {
    if (!c.fits) {
      c.reason = cat("needs ", format_bytes(double(c.memory.total())), ", ",
                     format_bytes(double(c.memory.total() - c.capacity)), " more than a rank has");
    } else {
      c.reason = cat(percent(c.time.exposed_fraction()), " exposed communication");
    }
  }
  const PlanCandidate& best = out.ranked.front();
  if (best.fits) {
    out.recommendation = reason_for(best, out.ranked);
  } else {
    out.recommendation = cat(
        "nothing fits: the smallest footprint is ", best.label(), " at ",
        format_bytes(double(best.memory.total())), " per rank, ",
        format_bytes(double(best.capacity)), " available; enable activation recompute (",
        "--recompute full), lower the micro-batch or add nodes");
  }
  return out;
}

}  // namespace fsdp
