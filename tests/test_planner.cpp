// The planner (fsdp/planner.h): collective formulas against hand-computed cases, NIC sharing,
// memory and bytes against hand-computed shards (uneven, bf16), mesh enumeration, bad input.
// No processes: the measured comparison with fsdp-train is tests/planner_measured_test.py.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "fsdp/error.h"
#include "fsdp/planner.h"

namespace fsdp {
namespace {

LinkSpec link(double busbw, double latency = 0) {
  LinkSpec l;
  l.latency_s = latency;
  l.bands.push_back({1, busbw});
  return l;
}

// A cluster whose numbers make hand computation easy.
ClusterSpec toy_cluster(int64_t nodes, int64_t rpn, int64_t nics) {
  ClusterSpec c;
  c.name = "toy";
  c.nodes = nodes;
  c.ranks_per_node = rpn;
  c.memory_bytes = int64_t(1) << 40;
  c.peak_flops = 1e12;
  c.flops_fraction = 1;
  c.memory_bandwidth = 1e30;  // the update costs nothing (its own test sets a rate)
  c.intra = link(1e15);  // effectively free inside a node
  c.inter = link(1e9);   // 1 GB/s per NIC
  c.nics_per_node = nics;
  return c;
}

// Two units with counts that do not divide the shard sizes used below.
ModelSpec toy_model() {
  ModelSpec m = model_preset("tiny");
  m.units.resize(2);
  m.units[0].numel = 1001;  // root
  m.units[1].name = "block0";
  m.units[1].numel = 2003;
  return m;
}

TEST(Planner, RingFormulasByHand) {
  const LinkSpec l = link(1e9, 1e-5);
  for (int64_t n = 1; n <= 8; ++n) {
    const double bytes = 8e6;
    const double ag = n == 1 ? 0 : (n - 1) * 1e-5 + double(n - 1) / double(n) * bytes / 1e9;
    EXPECT_DOUBLE_EQ(all_gather_time(l, n, 8'000'000), ag) << "n=" << n;
    EXPECT_DOUBLE_EQ(reduce_scatter_time(l, n, 8'000'000), ag) << "n=" << n;
    EXPECT_DOUBLE_EQ(all_reduce_time(l, n, 8'000'000), 2 * ag) << "n=" << n;
  }
  // n = 4, 1 MB: 3 steps of 10 us + 3/4 of 1 ms.
  EXPECT_NEAR(all_gather_time(l, 4, 1'000'000), 30e-6 + 0.75e-3, 1e-15);
}

// Each collective takes its own busbw where the link gives one (nccl-tests reports one per
// collective); an all-reduce still moves twice the ring's bytes.
TEST(Planner, EachCollectiveItsOwnBandwidth) {
  LinkSpec l = link(1e9, 1e-5);
  l.reduce_scatter_bands = {{1, 5e8}};
  l.all_reduce_bands = {{1 << 20, 2e9}, {1 << 30, 4e9}};
  const double f = 3.0 / 4.0;
  EXPECT_DOUBLE_EQ(all_gather_time(l, 4, 8'000'000), 3e-5 + f * 8e6 / 1e9);
  EXPECT_DOUBLE_EQ(reduce_scatter_time(l, 4, 8'000'000), 3e-5 + f * 8e6 / 5e8);
  EXPECT_DOUBLE_EQ(all_reduce_time(l, 4, 1 << 20), 2 * (3e-5 + f * double(1 << 20) / 2e9));
  EXPECT_DOUBLE_EQ(l.busbw_at(1 << 30, Collective::kAllReduce), 4e9);
  l.reduce_scatter_bands.clear();  // none given: the all-gather's
  EXPECT_DOUBLE_EQ(reduce_scatter_time(l, 4, 8'000'000), all_gather_time(l, 4, 8'000'000));

  // In a cluster file: "reduce_scatter" / "all_reduce" beside the link's own busbw.
  const ClusterSpec c = parse_cluster_json(R"({"name": "x", "ranks_per_node": 4, "memory_gib": 80,
      "peak_tflops": 100, "memory_bandwidth_gbs": 1000,
      "intra": {"latency_us": 10, "busbw_gbs": 100, "reduce_scatter": {"busbw_gbs": 50},
                "all_reduce": {"bands": [{"bytes": 1048576, "busbw_gbs": 20},
                                         {"bytes": 67108864, "busbw_gbs": 80}]}}})",
                                           "cluster file 'c.json'");
  EXPECT_DOUBLE_EQ(c.intra.busbw_at(1 << 20, Collective::kAllGather), 100e9);
  EXPECT_DOUBLE_EQ(c.intra.busbw_at(1 << 20, Collective::kReduceScatter), 50e9);
  EXPECT_DOUBLE_EQ(c.intra.busbw_at(1 << 26, Collective::kAllReduce), 80e9);
  EXPECT_DOUBLE_EQ(c.inter.busbw_at(1 << 20, Collective::kReduceScatter), 50e9);  // inter = intra
  const ClusterSpec back = parse_cluster_json(cluster_to_json(c), "round trip");
  for (Collective k : {Collective::kAllGather, Collective::kReduceScatter, Collective::kAllReduce}) {
    for (int64_t bytes : {int64_t(1) << 20, int64_t(1) << 24, int64_t(1) << 26}) {
      EXPECT_DOUBLE_EQ(back.intra.busbw_at(bytes, k), c.intra.busbw_at(bytes, k));
    }
  }
  // A plan uses them: FULL_SHARD's reduce-scatters at half the all-gathers' busbw.
  ClusterSpec toy = toy_cluster(1, 4, 1);
  toy.intra = link(1e8);
  const auto same = evaluate_candidate(model_preset("small"), toy, {}, ShardingStrategy::kFullShard, 1, 4);
  toy.intra.reduce_scatter_bands = {{1, 5e7}};
  const auto slow = evaluate_candidate(model_preset("small"), toy, {}, ShardingStrategy::kFullShard, 1, 4);
  const double rs = double(same.comm.shard_reduce_scatter) * f / 1e8;  // latency 0
  EXPECT_NEAR(slow.time.communication - same.time.communication, rs, 1e-9 * rs);
}

TEST(Planner, BandwidthBands) {
  LinkSpec l;
  l.bands = {{1 << 10, 1e8}, {1 << 20, 1e9}, {1 << 30, 2e9}};
  EXPECT_DOUBLE_EQ(l.busbw_at(1), 1e8);
  EXPECT_DOUBLE_EQ(l.busbw_at(1 << 10), 1e8);
  EXPECT_DOUBLE_EQ(l.busbw_at(1 << 20), 1e9);
  EXPECT_DOUBLE_EQ(l.busbw_at(int64_t(1) << 40), 2e9);
  EXPECT_NEAR(l.busbw_at(1 << 15), 0.5 * (1e8 + 1e9), 1);  // halfway in log size
}

TEST(Planner, UnevenShardsAndBf16ByHand) {
  const ModelSpec m = toy_model();
  const ClusterSpec c = toy_cluster(1, 4, 1);
  PlanOptions o;
  o.param_dtype = c10::kBFloat16;
  o.reduce_dtype = c10::kFloat;
  const auto p = evaluate_candidate(m, c, o, ShardingStrategy::kFullShard, 1, 4);
  // Shards: ceil(1001/4) = 251 (padded 1004), ceil(2003/4) = 501 (padded 2004).
  EXPECT_EQ(p.memory.params, (251 + 501) * 4);
  EXPECT_EQ(p.memory.grads, (251 + 501) * 4);
  EXPECT_EQ(p.memory.optimizer, (251 + 501) * 4 * 2);
  // bf16 all-gather: root once, block twice (re-gathered in backward); fp32 reduce-scatter.
  EXPECT_EQ(p.comm.shard_all_gather, 1004 * 2 + 2 * 2004 * 2);
  EXPECT_EQ(p.comm.shard_reduce_scatter, (1004 + 2004) * 4);
  EXPECT_EQ(p.comm.replicate_all_reduce, 0);
  // Gathered at peak: root + the largest block (no second block to prefetch).
  EXPECT_EQ(p.memory.gathered_params, (1004 + 2004) * 2);
  // Sent on the wire: 3/4 of the payload, all inside the node.
  EXPECT_EQ(p.intra_bytes, (1004 * 2 + 2 * 2004 * 2 + (1004 + 2004) * 4) * 3 / 4);
  EXPECT_EQ(p.inter_bytes, 0);

  const auto h = evaluate_candidate(m, c, o, ShardingStrategy::kHybridShard, 2, 2);
  EXPECT_EQ(h.memory.params, (501 + 1002) * 4);
  EXPECT_EQ(h.comm.replicate_all_reduce, (501 + 1002) * 4);
  const auto n = evaluate_candidate(m, c, o, ShardingStrategy::kNoShard, 4, 1);
  EXPECT_EQ(n.memory.params, (1001 + 2003) * 4);
  EXPECT_EQ(n.comm.shard_all_gather, 0);
  EXPECT_EQ(n.comm.replicate_all_reduce, (1001 + 2003) * 4);
}

TEST(Planner, ReplicateGroupWithOneRankPerNodeUsesOneNic) {
  // 2 nodes x 8 ranks, 8 NICs of 1 GB/s; intra-node links free, no latency.
  const ModelSpec m = toy_model();
  const ClusterSpec c = toy_cluster(2, 8, 8);
  PlanOptions o;
  const auto h = evaluate_candidate(m, c, o, ShardingStrategy::kHybridShard, 2, 8);
  EXPECT_FALSE(h.shard_crosses_nodes);
  EXPECT_TRUE(h.replicate_crosses_nodes);
  // All-reduce of the fp32 shards (126 + 251 elements) over 2 ranks on one NIC: 2 x 1/2 x S / B.
  const double ar = double((126 + 251) * 4) / 1e9;
  EXPECT_NEAR(h.time.communication, ar, 1e-10);
  // FULL_SHARD's ring spans both nodes with 8 ranks on each: all 8 NICs, 8 GB/s.
  const auto f = evaluate_candidate(m, c, o, ShardingStrategy::kFullShard, 1, 16);
  EXPECT_TRUE(f.shard_crosses_nodes);
  const double bytes = double((1008 + 2 * 2016) * 4 + (1008 + 2016) * 4);
  EXPECT_NEAR(f.time.communication, 15.0 / 16.0 * bytes / 8e9, 1e-12);
}

TEST(Planner, ExposedCommunicationIsFirstGatherAndLastReduce) {
  // With slow compute everything but the first gathers and the last reductions hides.
  const ModelSpec m = model_preset("small");
  ClusterSpec c = toy_cluster(1, 4, 1);
  c.intra = link(1e8);
  c.peak_flops = 1e6;  // compute dwarfs communication
  const auto p = evaluate_candidate(m, c, PlanOptions{}, ShardingStrategy::kFullShard, 1, 4);
  std::vector<UnitInfo> u = m.unit_counts();
  for (auto& x : u) x.set_shard_size(4);
  const double first = all_gather_time(c.intra, 4, u[0].padded_numel * 4) +
                       all_gather_time(c.intra, 4, u[1].padded_numel * 4);
  const double last = reduce_scatter_time(c.intra, 4, u[1].padded_numel * 4) +
                      reduce_scatter_time(c.intra, 4, u[0].padded_numel * 4);
  EXPECT_NEAR(p.time.exposed, first + last, 1e-9 * p.time.step);
  EXPECT_GT(p.time.communication, 2 * (first + last));  // the rest was hidden
}

// A CPU node (node_shared) without a spare core: nothing overlaps, and the step is compute +
// x * communication, x = k r / m at r ranks per core for links measured at m (at least 1) and
// k = comm_contention (NOTE [planner cost model]).
TEST(Planner, SharedCoresExposeCommunicationByOversubscription) {
  ClusterSpec c = toy_cluster(1, 2, 1);
  c.node_shared = true;
  c.cores = 4;
  c.comm_ranks_per_node = 8;  // links measured at 2 ranks per core
  EXPECT_EQ(c.shared_comm_exposure(), 0);  // a spare core
  c.cores = 2;
  EXPECT_DOUBLE_EQ(c.shared_comm_exposure(), 0.25);  // 1 per core, measured at 4 per core
  c.comm_ranks_per_node = 4;
  c.ranks_per_node = 4;
  EXPECT_DOUBLE_EQ(c.shared_comm_exposure(), 1);  // as measured
  c.ranks_per_node = 8;
  EXPECT_DOUBLE_EQ(c.shared_comm_exposure(), 2);  // twice the ranks on each core
  c.comm_contention = 1.5;
  EXPECT_DOUBLE_EQ(c.shared_comm_exposure(), 3);
  c.comm_ranks_per_node = 2;  // measured with a core per rank
  EXPECT_DOUBLE_EQ(c.shared_comm_exposure(), 6);
  c.comm_ranks_per_node = 1;  // with a spare core: as with a core per rank
  EXPECT_DOUBLE_EQ(c.shared_comm_exposure(), 6);
  c.comm_ranks_per_node = 0;  // not recorded: measured as planned
  EXPECT_DOUBLE_EQ(c.shared_comm_exposure(), 1.5);
  c.comm_contention = 0;  // not measured: 1
  EXPECT_DOUBLE_EQ(c.shared_comm_exposure(), 1);
  c.cores = 0;  // unknown cores: nothing overlaps, k x communication
  EXPECT_DOUBLE_EQ(c.shared_comm_exposure(), 1);
  c.comm_contention = 1.5;
  EXPECT_DOUBLE_EQ(c.shared_comm_exposure(), 1.5);
  c.node_shared = false;
  EXPECT_EQ(c.shared_comm_exposure(), 0);

  // The step: slow links so that communication matters.
  const ModelSpec m = model_preset("small");
  ClusterSpec cpu = toy_cluster(1, 2, 1);
  cpu.intra = link(1e8);
  cpu.peak_flops = 1e10;
  cpu.node_shared = true;
  cpu.cores = 4;
  cpu.comm_ranks_per_node = 8;
  const auto spare = evaluate_candidate(m, cpu, PlanOptions{}, ShardingStrategy::kFullShard, 1, 2);
  EXPECT_LT(spare.time.step, spare.time.compute + spare.time.communication);  // some hidden
  cpu.cores = 2;
  cpu.comm_ranks_per_node = 2;  // measured at 1 per core, planned at 1 per core
  const auto one = evaluate_candidate(m, cpu, PlanOptions{}, ShardingStrategy::kFullShard, 1, 2);
  EXPECT_NEAR(one.time.step, one.time.compute + one.time.communication, 1e-9 * one.time.step);
  cpu.comm_ranks_per_node = 4;  // measured at 2 per core
  cpu.ranks_per_node = 8;        // planned at 4 per core, k = 1.5: compute + 3 x communication
  cpu.comm_contention = 1.5;
  const auto four = evaluate_candidate(m, cpu, PlanOptions{}, ShardingStrategy::kFullShard, 1, 8);
  EXPECT_NEAR(four.time.step, four.time.compute + 3 * four.time.communication,
              1e-9 * four.time.step);
  EXPECT_NEAR(four.time.exposed, 3 * four.time.communication, 1e-9 * four.time.step);
}

// The update after the last reduction: the shard's parameters x the optimizer's bytes per
// parameter at the rank's memory bandwidth, added to the step.
TEST(Planner, UpdateIsTheShardAtMemoryBandwidth) {
  EXPECT_DOUBLE_EQ(update_bytes_per_parameter(2, false, false), 88);  // AdamW
  EXPECT_DOUBLE_EQ(update_bytes_per_parameter(2, true, true), 108);  // + clipping, averaging
  EXPECT_DOUBLE_EQ(update_bytes_per_parameter(1, false, true), 40);  // SGD with momentum
  EXPECT_DOUBLE_EQ(update_bytes_per_parameter(0, false, false), 12);  // plain SGD

  const ModelSpec m = toy_model();  // units of 1001 and 2003 parameters
  ClusterSpec c = toy_cluster(1, 4, 1);
  c.memory_bandwidth = 1e9;
  PlanOptions o;
  auto update = [&](ShardingStrategy s, int64_t R, int64_t S) {
    const auto p = evaluate_candidate(m, c, o, s, R, S);
    EXPECT_NEAR(p.time.step, p.time.compute + p.time.exposed + p.time.update, 1e-12);
    return p.time.update;
  };
  // Averaged over 4 ranks: 88 + 8 bytes per parameter of the shard.
  EXPECT_DOUBLE_EQ(update(ShardingStrategy::kFullShard, 1, 4), (251 + 501) * 96 / 1e9);
  EXPECT_DOUBLE_EQ(update(ShardingStrategy::kShardGradOp, 1, 4), (251 + 501) * 96 / 1e9);
  EXPECT_DOUBLE_EQ(update(ShardingStrategy::kHybridShardZero2, 2, 2), (501 + 1002) * 96 / 1e9);
  EXPECT_DOUBLE_EQ(update(ShardingStrategy::kNoShard, 4, 1), (1001 + 2003) * 96 / 1e9);
  o.clip = true;
  o.optimizer_states = 1;
  EXPECT_DOUBLE_EQ(update(ShardingStrategy::kNoShard, 4, 1), (1001 + 2003) * 52 / 1e9);
  // One rank does not average.
  c.ranks_per_node = 1;
  EXPECT_DOUBLE_EQ(update(ShardingStrategy::kFullShard, 1, 1), (1001 + 2003) * 44 / 1e9);
  // A CPU node shares its cores' bandwidth like their FLOP/s: 4 ranks on 2 cores, half each.
  c.ranks_per_node = 4;
  c.node_shared = true;
  c.cores = 2;
  EXPECT_DOUBLE_EQ(c.rank_memory_bandwidth(), 0.5e9);
  EXPECT_DOUBLE_EQ(update(ShardingStrategy::kNoShard, 4, 1), (1001 + 2003) * 52 / 0.5e9);
}

TEST(Planner, EnumeratesEveryFactorization) {
  const ModelSpec m = model_preset("tiny");
  const auto plan = plan_cluster(m, toy_cluster(2, 4, 4));
  // W = 8: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, and both hybrids on (4, 2) and (2, 4).
  EXPECT_EQ(plan.ranked.size(), 7u);
  EXPECT_NE(plan.find(ShardingStrategy::kHybridShard, 2, 4), nullptr);
  EXPECT_NE(plan.find(ShardingStrategy::kHybridShardZero2, 4, 2), nullptr);
  EXPECT_EQ(plan.excluded.size(), 4u);  // the hybrids' (1, 8) and (8, 1)
  for (const auto& e : plan.excluded) EXPECT_NE(e.excluded.find("the same as"), std::string::npos);

  // W = 12 with 4 ranks per node: shard groups of 3 and 6 straddle nodes, so they are excluded.
  const auto p12 = plan_cluster(m, toy_cluster(3, 4, 4));
  int straddle = 0;
  for (const auto& e : p12.excluded) straddle += e.excluded.find("unevenly") != std::string::npos;
  EXPECT_EQ(straddle, 4);  // (4, 3) and (2, 6), each for both hybrids
  for (const auto& c : p12.ranked) EXPECT_TRUE(c.shard == 1 || c.shard % 4 == 0 || 4 % c.shard == 0);
  EXPECT_FALSE(p12.recommendation.empty());
}

TEST(Planner, MeshFilterInfersMinusOne) {
  PlanOptions o;
  o.mesh = {-1, 4};
  const auto plan = plan_cluster(model_preset("tiny"), toy_cluster(2, 4, 4), o);
  ASSERT_EQ(plan.ranked.size(), 2u);  // HYBRID_SHARD and HYBRID_SHARD_ZERO2 on (2, 4)
  for (const auto& c : plan.ranked) {
    EXPECT_TRUE(is_hybrid(c.strategy));
    EXPECT_EQ(c.replicate, 2);
    EXPECT_EQ(c.shard, 4);
  }
}

// The message of the fsdp::Error `f` throws; fails the test if it throws none.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no fsdp::Error";
  return "";
}

void expect_one_line(const std::string& message, const std::string& names) {
  EXPECT_NE(message.find(names), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(Planner, BadInputIsOneLine) {
  const ModelSpec tiny = model_preset("tiny");
  const ClusterSpec c = toy_cluster(2, 4, 4);
  PlanOptions o;
  o.mesh = {-1, 3};
  expect_one_line(error_of([&] { plan_cluster(tiny, c, o); }), "-1");
  o = {};
  o.micro_batch = -2;
  expect_one_line(error_of([&] { plan_cluster(tiny, c, o); }), "micro-batch -2");
  ModelSpec bad = tiny;
  bad.layers = -1;
  expect_one_line(error_of([&] { plan_cluster(bad, c, {}); }), "layers -1");
  bad = tiny;
  bad.heads = 3;
  expect_one_line(error_of([&] { plan_cluster(bad, c, {}); }), "heads 3");
  ClusterSpec neg = c;
  neg.nodes = -4;
  expect_one_line(error_of([&] { plan_cluster(tiny, neg, {}); }), "nodes -4");
  neg = c;
  neg.comm_ranks_per_node = -2;
  expect_one_line(error_of([&] { plan_cluster(tiny, neg, {}); }), "comm_ranks_per_node -2");
  neg.comm_ranks_per_node = 0;
  neg.comm_contention = -1;
  expect_one_line(error_of([&] { plan_cluster(tiny, neg, {}); }), "comm_contention -1");
  expect_one_line(error_of([] { cluster_preset("dgx-9000"); }), "dgx-9000");
  expect_one_line(error_of([] { model_preset("gpt-7"); }), "gpt-7");
  expect_one_line(error_of([] { parse_cluster_json("{\"name\": \"x\",", "cluster file 'c.json'"); }),
                  "c.json");
  expect_one_line(error_of([] { parse_cluster_json("{\"name\": \"x\"}", "cluster file 'c.json'"); }),
                  "ranks_per_node");
  expect_one_line(
      error_of([] {
        parse_cluster_json(R"({"name": "x", "ranks_per_node": "eight", "memory_gib": 80})", "f");
      }),
      "ranks_per_node");
  expect_one_line(error_of([] { read_cluster_file("/nonexistent/cluster.json"); }), "/nonexistent");
  // A file from before the update was modelled: the missing field and the fix.
  const std::string old_file = error_of([] {
    parse_cluster_json(R"({"name": "x", "ranks_per_node": 4, "memory_gib": 80, "peak_tflops": 1,
                           "intra": {"busbw_gbs": 1}})", "cluster file 'old.json'");
  });
  expect_one_line(old_file, "memory_bandwidth_gbs");
  EXPECT_NE(old_file.find("fsdp-plan --calibrate"), std::string::npos) << old_file;
  neg = c;
  neg.memory_bandwidth = -5e9;
  expect_one_line(error_of([&] { plan_cluster(tiny, neg, {}); }), "memory_bandwidth_gbs -5");
  auto with_link = [](const std::string& intra) {
    return R"({"name": "x", "ranks_per_node": 4, "memory_gib": 80, "peak_tflops": 1,
               "memory_bandwidth_gbs": 10, "intra": )" + intra + "}";
  };
  expect_one_line(error_of([&] {
    parse_cluster_json(with_link(R"({"busbw_gbs": 1, "reduce_scatter": 3})"), "f");
  }), "reduce_scatter");
  expect_one_line(error_of([&] {
    parse_cluster_json(with_link(R"({"busbw_gbs": 1, "all_reduce": {"busbw_gbs": -2}})"), "f");
  }), "all_reduce band 0");
}

TEST(Planner, PresetsParseAndRoundTrip) {
  for (const auto& name : cluster_preset_names()) {
    const ClusterSpec c = cluster_preset(name);
    EXPECT_FALSE(c.sources.empty()) << name << ": every preset names its sources";
    const ClusterSpec back = parse_cluster_json(cluster_to_json(c), "round trip");
    EXPECT_EQ(back.memory_bytes / 1024, c.memory_bytes / 1024) << name;
    EXPECT_DOUBLE_EQ(back.inter.busbw_at(1 << 20), c.inter.busbw_at(1 << 20)) << name;
    EXPECT_EQ(back.comm_ranks_per_node, c.comm_ranks_per_node) << name;
  }
  // Llama 2 7B: 6.74 B parameters (its published count).
  EXPECT_NEAR(double(model_preset("llama2-7b").parameters()), 6.738e9, 1e6);
  EXPECT_NEAR(double(model_preset("llama3-8b").parameters()), 8.03e9, 1e7);
}

// FLOPs per token by hand for a two-block Llama-shaped model: h 8, 2 heads, SwiGLU width 16,
// vocab 10, sequence 4. Block: 2h^2 + 2h*8 (k, v) + 3h*16 + two norms = 656; root: embedding 80,
// final norm 8, head 80. Matmul parameters N = 1480 - 80 (the embedding lookup) = 1400; head
// forward 2*10*8 = 160; blocks forward 2*(1400 - 80) = 2640 plus attention 4 L h s = 256, the
// whole score matrix whether or not the kernel is fused (NOTE [planner cost model]).
TEST(Planner, FlopsPerTokenByHand) {
  ModelSpec m;
  m.layers = 2;
  m.hidden = 8;
  m.heads = 2;
  m.ffn_hidden = 16;
  m.vocab = 10;
  m.seq_len = 4;
  m.gated_mlp = true;
  ASSERT_EQ(m.parameters(), 1480);
  for (bool fused : {false, true}) {
    m.stores_attention_scores = !fused;
    EXPECT_DOUBLE_EQ(m.flops_per_token(Recompute::kNone), 3.0 * (160 + 2640 + 256));
    EXPECT_DOUBLE_EQ(m.flops_per_token(Recompute::kSelective), 3.0 * (160 + 2640 + 256) + 256);
    EXPECT_DOUBLE_EQ(m.flops_per_token(Recompute::kFull), 4.0 * (2640 + 256) + 3.0 * 160);
  }
}

TEST(Planner, ActivationsFollowKorthikanti) {
  ModelSpec m = model_preset("small");  // stores attention scores
  const double s = double(m.seq_len), h = double(m.hidden), a = double(m.heads), L = double(m.layers);
  const double logits = s * 2 * double(m.vocab) * (2 + 4);
  EXPECT_EQ(activation_bytes(m, 2, Recompute::kNone, c10::kBFloat16),
            int64_t(L * s * 2 * h * (34 + 5 * a * s / h) + logits));
  EXPECT_EQ(activation_bytes(m, 2, Recompute::kSelective, c10::kBFloat16),
            int64_t(L * s * 2 * h * 34 + logits));
  EXPECT_EQ(activation_bytes(m, 2, Recompute::kFull, c10::kBFloat16),
            int64_t(L * 2 * s * 2 * h + s * 2 * h * (34 + 5 * a * s / h) + logits));
}

}  // namespace
}  // namespace fsdp

namespace fsdp {
namespace {

// The published-run checks the issue sets, read from the page the planner generates (its
// misses are documented there and not asserted: HYBRID_SHARD against ZeRO++'s 400 Gb/s gain,
// IBM 70B by ~1 point).
TEST(Planner, PublishedRunChecks) {
  const std::string page = published_comparison();
  for (const char* check : {"within 15%: yes", "under 5%: yes", "not by a wide margin (< 5%): yes",
                            "grows as the bandwidth falls: yes", "as tokens per GPU fall: yes",
                            "without prefetch within 20% of every published point: yes",
                            "ZeRO++'s bytes at 400 Gb/s within 0.15 of 1.24-1.36x: yes"}) {
    EXPECT_NE(page.find(check), std::string::npos) << check;
  }
  // IBM/Meta: HSDP feasible for 7B and 13B, not for 34B and 70B; 13B and 34B within 20%.
  auto row = [&](const std::string& model) {
    const size_t at = page.find("| " + model + " |");
    EXPECT_NE(at, std::string::npos) << model;
    return page.substr(at, page.find('\n', at) - at);
  };
  auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  EXPECT_TRUE(ends_with(row("llama2-7b"), "| yes |")) << row("llama2-7b");
  EXPECT_TRUE(ends_with(row("llama2-13b"), "| yes |")) << row("llama2-13b");
  EXPECT_TRUE(ends_with(row("llama2-34b"), "| no |")) << row("llama2-34b");
  EXPECT_TRUE(ends_with(row("llama2-70b"), "| no |")) << row("llama2-70b");
  EXPECT_NE(row("llama2-13b").find("| yes | "), std::string::npos);
  EXPECT_NE(row("llama2-34b").find("| yes | "), std::string::npos);
}

}  // namespace
}  // namespace fsdp
