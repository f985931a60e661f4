// The planner's cost model: one candidate's memory, bytes and step time (see fsdp/planner.h).
//
// NOTE [planner cost model]
// Bytes and the memory of parameters, gradients and optimizer state are make_topology_report's,
// the arithmetic the engine's counters are tested against: the planner does not recount them.
// Time per optimizer step is a two-stream schedule, as the engine issues its collectives:
// - Collectives on the shard group run one at a time in issue order; the replicate group's run
//   beside them (collectives.h), unless both cross nodes, when they share the NICs and queue.
// - Forward: the root's all-gather first (nothing to hide it behind), then each block's gather
//   is issued when the block before it starts computing (prefetch depth 1; without prefetch,
//   when it is needed). Backward: blocks in reverse, each re-gathered (FULL_SHARD, HYBRID_SHARD)
//   with the next one's gather issued as it starts; its gradient is reduce-scattered when its
//   backward ends, then all-reduced across replicas. The root's reduction comes last, after the
//   embedding's backward: with nothing left to compute it is never hidden.
// - A collective on n ranks over one link: ring all-gather / reduce-scatter
//   (n-1) a + (n-1)/n * S / busbw(S), all-reduce twice that (nccl-tests' busbw), each with the
//   collective's own busbw where the link gives one (LinkSpec). A group that spans nodes runs at
//   the slower of its intra-node link and its share of the NICs.
// - Compute: FLOPs (ModelSpec::flops_per_token) at the rank's achievable rate, split over units
//   by their parameters; the head and its backward belong to the root.
// - A CPU machine (ClusterSpec::node_shared) with no spare core: Gloo's copies and sums run on
//   the cores that compute, so nothing overlaps: step = compute + x * communication, with
//   x = k r / m for r ranks per core planned and links measured at m ranks per core
//   (comm_ranks_per_node; at least 1). A core runs the collective work of all its r ranks one
//   after the other, so their time grows with r, and the benchmark already holds m ranks'
//   worth. k (comm_contention) is how many times their benchmarked time the collectives take
//   inside a step at r = m: ranks reach each collective at different moments when their cores
//   also compute, and a ring step waits for the slowest. fsdp-plan --calibrate measures k from
//   the middle of three FULL_SHARD runs (single runs gave 0.81-2.54 here on 2026-12-05: one
//   busy run sets it). Read off this machine's rows (bench "Planner"): (step - compute) /
//   (benchmarked collectives) was 0.87 at one rank per core, 1.65 at two, 3.1 at four (medians
//   over strategies and two models) -- linear in r. An earlier rule, max(1, (r - 1) / (m - 1)),
//   put 1 at two ranks per core and missed those rows by up to 31%. With this rule but one busbw
//   for every collective and no update: 27 and 26 of 30 rows within 20%, FULL_SHARD at four
//   ranks per core overstated by 21-30% and HYBRID_SHARD_ZERO2 (2, 2) understated by 22-25%;
//   with each collective's own busbw and the update below, 30 of 30 (largest 17%;
//   docs/planner.md, BENCHMARKS.md), HYBRID_SHARD_ZERO2 (2, 2) still 10-17% understated.
// - The update: after the last reduction each rank runs the optimizer over its shard (with the
//   gradient's averaging division and clipping): memory-bound, so its shard's parameters x
//   update_bytes_per_parameter (AdamW 88 bytes as libtorch runs it) / ClusterSpec::
//   memory_bandwidth, which fsdp-plan --calibrate measures by timing that very update. It is
//   what makes a larger shard slower on a CPU: a (2, 2) HYBRID_SHARD_ZERO2 rank updates half the
//   model where SHARD_GRAD_OP's (1, 4) updates a quarter, with the same bytes on the wire. On a
//   GPU it is a percent or two of a step.
// Not modelled: the gradient-norm all-reduce (8 bytes), kernel launch gaps, contention between
// compute and communication for memory bandwidth.
#include <algorithm>
#include <cmath>

#include "fsdp/error.h"
#include "fsdp/planner.h"

namespace fsdp {

using detail::cat;

namespace {

// An all-reduce is two rings' worth of steps and bytes (nccl-tests' busbw definition).
double ring_time(const LinkSpec& link, int64_t n, int64_t bytes, double scale, Collective kind) {
  if (n <= 1 || bytes <= 0) return 0;
  const double nn = double(n), steps = kind == Collective::kAllReduce ? 2 : 1;
  return steps * ((nn - 1) * link.latency_s +
                  (nn - 1) / nn * double(bytes) / (link.busbw_at(bytes, kind) * scale));
}

// The links one group's ring crosses, and the share of the node's NICs it gets.
struct GroupLinks {
  bool crosses = false;
  double nic_share = 1;  // nics_per_node x (group ranks per node) / ranks_per_node
};

GroupLinks group_links(const std::vector<int64_t>& group, const ClusterSpec& c) {
  GroupLinks g;
  std::vector<int64_t> per_node;
  for (int64_t r : group) {
    const size_t node = static_cast<size_t>(r / c.ranks_per_node);
    if (per_node.size() <= node) per_node.resize(node + 1, 0);
    ++per_node[node];
  }
  int64_t nodes = 0, most = 0;
  for (int64_t k : per_node) {
    nodes += k > 0 ? 1 : 0;
    most = std::max(most, k);
  }
  g.crosses = nodes > 1;
  g.nic_share = double(c.nics_per_node) * double(most) / double(c.ranks_per_node);
  return g;
}

// Time of one collective on a group: the slower of the intra-node ring and the NIC share.
double group_time(const ClusterSpec& c, const GroupLinks& g, int64_t n, int64_t bytes,
                  Collective kind) {
  const double intra = ring_time(c.intra, n, bytes, 1.0, kind);
  if (!g.crosses) return intra;
  return std::max(intra, ring_time(c.inter, n, bytes, g.nic_share, kind));
}

}  // namespace

double update_bytes_per_parameter(int64_t optimizer_states, bool clip, bool averaged) {
  const int64_t optimizer = optimizer_states >= 2 ? 22 : optimizer_states == 1 ? 8 : 3;
  return 4.0 * double(optimizer + (clip ? 3 : 0) + (averaged ? 2 : 0));
}

double all_gather_time(const LinkSpec& link, int64_t n, int64_t bytes, double scale) {
  return ring_time(link, n, bytes, scale, Collective::kAllGather);
}
double reduce_scatter_time(const LinkSpec& link, int64_t n, int64_t bytes, double scale) {
  return ring_time(link, n, bytes, scale, Collective::kReduceScatter);
}
double all_reduce_time(const LinkSpec& link, int64_t n, int64_t bytes, double scale) {
  return ring_time(link, n, bytes, scale, Collective::kAllReduce);
}

namespace {

// Per-rank memory beyond the sharded state: the gradient buffers of the unit being reduced, the
// activations, the runtime reserve; and whether it all fits.
void add_working_memory(PlanCandidate& c, const ModelSpec& model, const ClusterSpec& cluster,
                        const PlanOptions& o, const std::vector<UnitInfo>& units, int64_t shard) {
  const int64_t pb = c10::elementSize(o.param_dtype), rb = c10::elementSize(o.reduce_dtype);
  int64_t largest = 0;
  for (size_t i = 1; i < units.size(); ++i) largest = std::max(largest, units[i].padded_numel);
  if (units.size() == 1) largest = units[0].padded_numel;
  // The unsharded gradient of the unit being reduced (in the compute dtype, and its reduce-dtype
  // copy when they differ); with S = 1 in fp32 gradients land in the sharded buffer itself.
  if (shard > 1 || pb != 4) c.memory.grad_buffers = largest * (pb + (rb != pb ? rb : 0));
  if (o.grad_sync == GradSync::kLocal && o.grad_accum > 1 && shard > 1) {
    int64_t all = 0;
    for (const auto& u : units) all += u.padded_numel;
    c.memory.grad_buffers += all * 4;  // no_sync keeps every unit's unsharded gradient
  }
  c.memory.activations = activation_bytes(model, o.micro_batch, o.recompute, o.param_dtype);
  c.memory.reserve = cluster.reserve_bytes;
  c.capacity = cluster.rank_memory();
  c.fits = c.memory.total() <= c.capacity;
}

// The time of every unit's computation and collectives in one micro-step (seconds).
struct UnitTimes {
  std::vector<double> fwd, bwd, ag, rs, ar;
};

UnitTimes unit_times(const ModelSpec& model, const ClusterSpec& cluster, const PlanOptions& o,
                     const std::vector<UnitInfo>& units, const GroupLinks& sg,
                     const GroupLinks& rg, int64_t replicate, int64_t shard) {
  const int64_t pb = c10::elementSize(o.param_dtype), rb = c10::elementSize(o.reduce_dtype);
  const double tokens = double(o.micro_batch * model.seq_len);
  const double rate = cluster.rank_flops();
  const double head = 6.0 * double(model.vocab) * double(model.hidden) * tokens;
  const double plain_blocks = std::max(0.0, model.flops_per_token(Recompute::kNone) * tokens - head);
  const double recomputed =
      (model.flops_per_token(o.recompute) - model.flops_per_token(Recompute::kNone)) * tokens;
  int64_t block_params = 0;
  for (size_t i = 1; i < units.size(); ++i) block_params += units[i].total_numel();
  const size_t n = units.size();
  UnitTimes t{std::vector<double>(n, 0), std::vector<double>(n, 0), std::vector<double>(n, 0),
              std::vector<double>(n, 0), std::vector<double>(n, 0)};
  auto& [fwd, bwd, ag, rs, ar] = t;
  fwd[0] = head / 3 / rate;
  bwd[0] = 2 * head / 3 / rate;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0 && block_params > 0) {
      const double share = double(units[i].total_numel()) / double(block_params);
      fwd[i] = plain_blocks * share / 3 / rate;
      bwd[i] = (2 * plain_blocks / 3 + recomputed) * share / rate;
    }
    const int64_t gathered = (units[i].padded_numel + units[i].frozen_padded_numel) * pb;
    ag[i] = group_time(cluster, sg, shard, gathered, Collective::kAllGather);
    rs[i] = group_time(cluster, sg, shard, units[i].padded_numel * rb, Collective::kReduceScatter);
    ar[i] = group_time(cluster, rg, replicate, units[i].shard_numel * rb, Collective::kAllReduce);
  }
  return t;
}

// The two-stream schedule (NOTE above) of one optimizer step: fills c.time and c.tokens_per_s.
void schedule_step(PlanCandidate& c, const ModelSpec& model, const ClusterSpec& cluster,
                   const PlanOptions& o, const UnitTimes& t, bool regather, int64_t replicate,
                   int64_t shard, int64_t shard_params) {
  // Plain references, not a structured binding: the lambdas below use them, and C++17 does not
  // let a lambda capture a structured binding (clang refuses it).
  const auto &fwd = t.fwd, &bwd = t.bwd, &ag = t.ag, &rs = t.rs, &ar = t.ar;
  const size_t n = fwd.size();
  const double tokens = double(o.micro_batch * model.seq_len);
  const bool shared_nics = c.shard_crosses_nodes && c.replicate_crosses_nodes;
  double cpu = 0, shard_free = 0, rep_free = 0, comm = 0, compute = 0;
  std::vector<double> ready(n, 0);
  auto gather = [&](size_t i, double at) {
    if (shard <= 1) {
      ready[i] = at;
      return;
    }
    const double start = std::max(at, shard_free);
    shard_free = start + ag[i];
    ready[i] = shard_free;
    comm += ag[i];
  };
  auto reduce = [&](size_t i, double at, bool rs_on, bool ar_on) {
    double done = at;
    if (shard > 1 && rs_on) {
      const double start = std::max(at, shard_free);
      shard_free = start + rs[i];
      done = shard_free;
      comm += rs[i];
    }
    if (replicate > 1 && ar_on) {
      double& stream = shared_nics ? shard_free : rep_free;
      const double start = std::max(done, stream);
      stream = start + ar[i];
      comm += ar[i];
    }
  };
  for (int64_t k = 0; k < o.grad_accum; ++k) {
    const bool last = k + 1 == o.grad_accum;
    const bool rs_on = o.grad_sync != GradSync::kLocal || last;
    const bool ar_on = o.grad_sync == GradSync::kEveryMicroStep || last;
    // Forward: the root (embedding), the blocks, the root's head.
    gather(0, cpu);
    if (o.prefetch && n > 1) gather(1, cpu);
    for (size_t i = 1; i < n; ++i) {
      if (!o.prefetch) gather(i, std::max(cpu, ready[i - 1]));
      const double start = std::max(cpu, ready[i]);
      if (o.prefetch && i + 1 < n) gather(i + 1, start);
      cpu = start + fwd[i];
    }
    cpu = std::max(cpu, ready[0]) + fwd[0];
    // Backward: the head (the root stays gathered), the blocks in reverse, the root's reduction.
    if (regather && o.prefetch && n > 1) gather(n - 1, cpu);
    cpu += bwd[0];
    for (size_t i = n - 1; i >= 1; --i) {
      double start = cpu;
      if (regather) {
        if (!o.prefetch) gather(i, cpu);
        start = std::max(cpu, ready[i]);
        if (o.prefetch && i > 1) gather(i - 1, start);
      }
      cpu = start + bwd[i];
      reduce(i, cpu, rs_on, ar_on);
    }
    reduce(0, cpu, rs_on, ar_on);
    for (size_t i = 0; i < n; ++i) compute += fwd[i] + bwd[i];
  }
  c.time.compute = compute;
  c.time.communication = comm;
  c.time.step = std::max({cpu, shard_free, rep_free});
  // On a CPU node with no spare core the collectives compute on the cores that train: the step
  // is compute plus their time scaled by ClusterSpec::shared_comm_exposure (NOTE [planner cost
  // model]). With a spare core they overlap as scheduled above.
  const double exposure = cluster.shared_comm_exposure();
  if (exposure > 0) c.time.step = compute + exposure * comm;
  c.time.exposed = std::max(0.0, c.time.step - compute);
  // The optimizer step needs every reduced gradient: it follows the last reduction.
  c.time.update = double(shard_params) *
                  update_bytes_per_parameter(o.optimizer_states, o.clip, replicate * shard > 1) /
                  cluster.rank_memory_bandwidth();
  c.time.step += c.time.update;
  c.tokens_per_s = c.time.step > 0 ? tokens * double(o.grad_accum) / c.time.step : 0;
}


}  // namespace

PlanCandidate evaluate_candidate(const ModelSpec& model, const ClusterSpec& cluster,
                                 const PlanOptions& o, ShardingStrategy strategy,
                                 int64_t replicate, int64_t shard) {
  PlanCandidate c;
  c.strategy = strategy;
  c.replicate = replicate;
  c.shard = shard;
  const int64_t W = cluster.world_size(), rpn = cluster.ranks_per_node;
  FSDPStrategy s;
  s.sharding_strategy(strategy).grad_sync(o.grad_sync).forward_prefetch(o.prefetch)
      .backward_prefetch(o.prefetch);
  s.mixed_precision({o.param_dtype, o.reduce_dtype});
  if (is_hybrid(strategy)) s.device_mesh(std::vector<int64_t>{replicate, shard});
  const ShardingPlan plan = plan_sharding(s, W, rpn);
  TORCH_INTERNAL_ASSERT(plan.replicate_size() == replicate && plan.shard_size() == shard);

  // Bytes and model state: the topology report's arithmetic (report.h).
  std::vector<UnitInfo> units = model.unit_counts();
  for (auto& u : units) u.set_shard_size(shard);
  ReportOptions ro;
  ro.grad_accum = o.grad_accum;
  ro.grad_sync = o.grad_sync;
  ro.clip = o.clip;
  ro.optimizer_states = o.optimizer_states;
  ro.param_dtype = o.param_dtype;
  ro.reduce_dtype = o.reduce_dtype;
  ro.prefetch = o.prefetch;
  const TopologyReport report = make_topology_report(plan, rpn, units, ro);
  c.comm = report.comm;
  c.memory.params = report.sharded.params;
  c.memory.grads = report.sharded.grads;
  c.memory.optimizer = report.sharded.optimizer;
  c.memory.gathered_params = report.peak_unsharded_param_bytes;

  add_working_memory(c, model, cluster, o, units, shard);
  // Links.
  const GroupLinks sg = group_links(plan.layout.groups(1).front(), cluster);
  const GroupLinks rg = group_links(plan.layout.groups(0).front(), cluster);
  c.shard_crosses_nodes = sg.crosses && shard > 1;
  c.replicate_crosses_nodes = rg.crosses && replicate > 1;
  auto wire = [](int64_t payload, int64_t n, double factor) {
    return n > 1 ? static_cast<int64_t>(double(payload) * factor * double(n - 1) / double(n)) : 0;
  };
  const int64_t shard_wire = wire(report.comm.shard_all_gather + report.comm.shard_reduce_scatter, shard, 1) +
                             wire(report.comm.shard_all_reduce, shard, 2);
  const int64_t rep_wire = wire(report.comm.replicate_all_reduce, replicate, 2);
  (c.shard_crosses_nodes ? c.inter_bytes : c.intra_bytes) += shard_wire;
  (c.replicate_crosses_nodes ? c.inter_bytes : c.intra_bytes) += rep_wire;

  const UnitTimes t = unit_times(model, cluster, o, units, sg, rg, replicate, shard);
  int64_t shard_params = 0;  // trainable parameters this rank updates (padding included)
  for (const auto& u : units) shard_params += u.shard_numel;
  schedule_step(c, model, cluster, o, t, plan.reshard_after_forward, replicate, shard,
                shard_params);
  return c;
}

}  // namespace fsdp
