// Device meshes and strategy validation: mesh arithmetic for every shape of up to 16 ranks,
// every validation error, group membership over real Gloo groups, and the topology report.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <set>

#include "fsdp/error.h"
#include "fsdp/mesh.h"
#include "fsdp/parse_enum.h"
#include "fsdp/report.h"
#include "fsdp/runtime.h"
#include "fsdp/strategy.h"
#include "testing.h"

using namespace fsdp;

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const fsdp::Error& e) {
    return e.what();
  }
  return "(no error)";
}

void check_layout(const MeshLayout& m, int64_t R, int64_t S) {
  ASSERT_EQ(m.shape(), (std::vector<int64_t>{R, S}));
  EXPECT_EQ(m.names(), (std::vector<std::string>{"replicate", "shard"}));
  auto shard_groups = m.groups(1), replicate_groups = m.groups(0);
  ASSERT_EQ(static_cast<int64_t>(shard_groups.size()), R);
  ASSERT_EQ(static_cast<int64_t>(replicate_groups.size()), S);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t s = 0; s < S; ++s) {
      // Row-major: shard groups are contiguous ranks, replicate groups stride by S.
      EXPECT_EQ(shard_groups[r][s], r * S + s);
      EXPECT_EQ(replicate_groups[s][r], r * S + s);
      EXPECT_EQ(m.rank_at({r, s}), r * S + s);
      EXPECT_EQ(m.coordinate_of(r * S + s), (std::vector<int64_t>{r, s}));
      EXPECT_EQ(m.group_of(1, r * S + s), shard_groups[r]);
      EXPECT_EQ(m.group_of(0, r * S + s), replicate_groups[s]);
    }
  }
}

}  // namespace

TEST(MeshLayout, EveryShapeUpTo16Ranks) {
  for (int64_t W = 1; W <= 16; ++W) {
    for (int64_t S = 1; S <= W; ++S) {
      if (W % S != 0) continue;
      const int64_t R = W / S;
      check_layout(MeshLayout::resolve({R, S}, W), R, S);
      check_layout(MeshLayout::resolve({-1, S}, W), R, S);
      check_layout(MeshLayout::resolve({R, -1}, W), R, S);
    }
    auto one = MeshLayout::resolve({-1}, W);
    EXPECT_EQ(one.shape(), std::vector<int64_t>{W});
    EXPECT_EQ(one.names(), std::vector<std::string>{"shard"});
    EXPECT_EQ(one.groups(0).size(), 1u);
  }
}

TEST(MeshLayout, Errors) {
  EXPECT_EQ(error_of([] { MeshLayout::resolve({3, 2}, 4); }),
            "device_mesh (3, 2) has 6 ranks but the world has 4 processes; use (2, 2) or (-1, 2)");
  EXPECT_EQ(error_of([] { MeshLayout::resolve({4}, 6); }),
            "device_mesh (4) has 4 ranks but the world has 6 processes; use (6) or (-1)");
  EXPECT_NE(error_of([] { MeshLayout::resolve({0, 4}, 4); }).find("dim 0 is 0; every dim must be >= 1"),
            std::string::npos);
  EXPECT_NE(error_of([] { MeshLayout::resolve({-2, 2}, 4); }).find("dim 0 is -2"), std::string::npos);
  EXPECT_NE(error_of([] { MeshLayout::resolve({-1, -1}, 4); }).find("more than one -1"),
            std::string::npos);
  EXPECT_EQ(error_of([] { MeshLayout::resolve({-1, 3}, 4); }),
            "device_mesh (-1, 3) cannot be inferred: 3 does not divide the world of 4 processes; "
            "use (2, 2) or (-1, 2)");
  EXPECT_NE(error_of([] { MeshLayout::resolve({2, 2, 2}, 8); }).find("has 3 dims"),
            std::string::npos);
  EXPECT_NE(error_of([] { MeshLayout::resolve({}, 8); }).find("empty"), std::string::npos);
  // Found by fuzz_mesh_strategy: dims whose product overflows int64 were undefined behaviour
  // (UBSan: signed integer overflow), not an error.
  EXPECT_EQ(error_of([] { MeshLayout::resolve({3333333333333333, 33334}, 4); }),
            "device_mesh (3333333333333333, 33334) has more ranks than the world of 4 processes; "
            "use (1, 4) or (-1, 4)");
  // The hint is a mesh of the right size that shards (shard size > 1 unless the world is 1):
  // the shard size nearest the given one, then the replicate size nearest the given one.
  auto hint = [](std::vector<int64_t> shape, int64_t world) {
    const std::string e = error_of([&] { MeshLayout::resolve(shape, world); });
    const size_t at = e.find("; use ");
    return at == std::string::npos ? "no hint in: " + e : e.substr(at + 6);
  };
  EXPECT_EQ(hint({2, 2}, 3), "(1, 3) or (-1, 3)");  // not (3, 1), which shards nothing
  EXPECT_EQ(hint({2, 2}, 5), "(1, 5) or (-1, 5)");  // a prime world: only (1, W) shards
  EXPECT_EQ(hint({3, 3}, 7), "(1, 7) or (-1, 7)");
  EXPECT_EQ(hint({2, 2}, 1), "(1, 1) or (-1, 1)");
  EXPECT_EQ(hint({4, 2}, 6), "(3, 2) or (-1, 2)");
  EXPECT_EQ(hint({2, 4}, 6), "(2, 3) or (-1, 3)");
  EXPECT_EQ(hint({2, 2}, 6), "(3, 2) or (-1, 2)");
  EXPECT_EQ(hint({3, 3}, 8), "(4, 2) or (-1, 2)");   // S 2 and 4 tie: R 4 and 2 tie: smaller S
  EXPECT_EQ(hint({5, 5}, 12), "(3, 4) or (-1, 4)");  // S 4 and 6 tie: R 3 is nearer 5 than 2
  EXPECT_EQ(hint({3, -1}, 4), "(2, 2) or (-1, 2)");  // only R given: the nearest R that shards
  EXPECT_EQ(hint({-1, 3}, 8), "(4, 2) or (-1, 2)");
  EXPECT_EQ(hint({4, 4}, 4), "(1, 4) or (-1, 4)");
  EXPECT_EQ(hint({2}, 3), "(3) or (-1)");
  for (int64_t W = 1; W <= 64; ++W) {  // every hint is itself a valid mesh for W
    for (std::vector<int64_t> shape : {std::vector<int64_t>{W + 1, 2}, {2, W + 1}, {W + 1, -1}}) {
      const std::string h = hint(shape, W);
      int64_t r = 0, s = 0;
      ASSERT_EQ(std::sscanf(h.c_str(), "(%ld, %ld)", &r, &s), 2) << h;
      EXPECT_EQ(r * s, W) << h;
      EXPECT_TRUE(s > 1 || W == 1) << h;
      EXPECT_NO_THROW(MeshLayout::resolve({r, s}, W));
    }
  }
  EXPECT_NE(error_of([] { MeshLayout::resolve({2, 2}, 4, {"a", "a"}); }).find("used twice"),
            std::string::npos);
  EXPECT_NE(error_of([] { MeshLayout::resolve({2, 2}, 4).dim_index("tensor"); })
                .find("the dims are replicate, shard"),
            std::string::npos);
}

TEST(MeshLayout, ExplicitRankGrid) {
  // Replicas paired across "sockets": shard groups {0,2} and {1,3}.
  auto m = MeshLayout::from_grid({{0, 2}, {1, 3}}, 4);
  EXPECT_EQ(m.groups(1), (std::vector<std::vector<int64_t>>{{0, 2}, {1, 3}}));
  EXPECT_EQ(m.groups(0), (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}}));
  EXPECT_EQ(m.coordinate_of(2), (std::vector<int64_t>{0, 1}));
  EXPECT_NE(error_of([] { MeshLayout::from_grid({{0, 1}, {1, 3}}, 4); }).find("listed twice"),
            std::string::npos);
  EXPECT_NE(error_of([] { MeshLayout::from_grid({{0, 1}, {2}}, 3); }).find("differ in length"),
            std::string::npos);
}

TEST(Strategy, ParsingIsCaseInsensitive) {
  EXPECT_EQ(parse_sharding_strategy("hybrid_shard"), ShardingStrategy::kHybridShard);
  EXPECT_EQ(parse_sharding_strategy("Hybrid-Shard-Zero2"), ShardingStrategy::kHybridShardZero2);
  EXPECT_EQ(parse_sharding_strategy("FULL_SHARD"), ShardingStrategy::kFullShard);
  EXPECT_EQ(FSDPStrategy().sharding_strategy("no_shard").sharding_strategy(),
            ShardingStrategy::kNoShard);
  EXPECT_NE(error_of([] { parse_sharding_strategy("zero3"); }).find("'zero3' is unknown; use FULL_SHARD"),
            std::string::npos);
  EXPECT_EQ(parse_mesh_shape("2,4"), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(parse_mesh_shape("(2, 4)"), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(parse_mesh_shape("-1,4"), (std::vector<int64_t>{-1, 4}));
  EXPECT_EQ(parse_mesh_shape("8"), (std::vector<int64_t>{8}));
  for (const char* bad : {"2x4", "", "2,", ",4", "a,b", "2,4.5"}) {
    EXPECT_NE(error_of([&] { parse_mesh_shape(bad); }).find("does not parse"), std::string::npos)
        << bad;
  }
  EXPECT_EQ(parse_grad_sync("replicate-on-last"), GradSync::kReplicateOnLast);
  EXPECT_NE(error_of([] { parse_grad_sync("sometimes"); }).find("use every, local or"),
            std::string::npos);
}

TEST(ParseEnum, OneRuleForEveryChoiceOfTheLibrary) {
  // Any case; aliases parse but only the first name of each value is listed.
  enum class Mode { kNone, kFull };
  auto parse = [](const char* text) {
    return parse_enum<Mode>(text, {{"none", Mode::kNone}, {"full", Mode::kFull},
                                   {"off", Mode::kNone}, {"on", Mode::kFull}}, "mode");
  };
  EXPECT_EQ(parse("FULL"), Mode::kFull);
  EXPECT_EQ(parse("Off"), Mode::kNone);
  EXPECT_EQ(error_of([&] { parse("half"); }), "mode 'half' is unknown; use none or full");
  // kLoose also ignores whitespace and reads '-' as '_'; kAnyCase does not.
  EXPECT_TRUE(parse_enum<bool>(" Replicate-On_Last\t", {{"replicate_on_last", true}}, "x",
                               Spelling::kLoose));
  EXPECT_EQ(error_of([] { parse_enum<bool>("a-b", {{"a_b", true}, {"c", false}}, "--flag"); }),
            "--flag 'a-b' is unknown; use a_b or c");
  // The library's parsers: each names its option and lists every choice.
  EXPECT_EQ(error_of([] { parse_backend("mpi"); }),
            "backend 'mpi' is unknown; use auto, gloo or nccl");
  EXPECT_EQ(parse_backend("GLOO"), Backend::kGloo);
  EXPECT_EQ(parse_collective_algorithm("AllToAll"), CollectiveAlgorithm::kAllToAll);
  EXPECT_EQ(error_of([] { parse_collective_algorithm("tree"); }),
            "all-gather/reduce-scatter algorithm 'tree' is unknown; use auto, native, ring, "
            "alltoall or allreduce");
  EXPECT_EQ(parse_heap_policy("Lean"), HeapPolicy::kLean);
  EXPECT_EQ(error_of([] { parse_grad_sync("sometimes"); }),
            "gradient sync mode 'sometimes' is unknown; use every, local or replicate_on_last");
  EXPECT_EQ(error_of([] { parse_sharding_strategy("zero3"); }),
            "sharding strategy 'zero3' is unknown; use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
            "HYBRID_SHARD or HYBRID_SHARD_ZERO2");
}

// The strategy's backend and timeout are shorthands for its runtime options (one definition of
// each setting, in RuntimeOptions): the defaults are RuntimeOptions's, and a setter changes only
// its field of runtime().
TEST(Strategy, BackendAndTimeoutAreItsRuntimeOptions) {
  const RuntimeOptions defaults;
  FSDPStrategy s;
  EXPECT_EQ(s.backend(), defaults.backend);
  EXPECT_EQ(s.timeout(), defaults.timeout);
  RuntimeOptions ro;
  ro.threads = 3;
  ro.heap = HeapPolicy::kLean;
  s.runtime(ro).backend(Backend::kGloo).timeout(std::chrono::seconds(20));
  EXPECT_EQ(s.runtime().backend, Backend::kGloo);
  EXPECT_EQ(s.runtime().timeout, std::chrono::seconds(20));
  EXPECT_EQ(s.runtime().threads, 3);
  EXPECT_EQ(s.runtime().heap, HeapPolicy::kLean);
  EXPECT_NE(s.describe().find(" backend=gloo timeout_ms=20000 "), std::string::npos)
      << s.describe();
}

TEST(Strategy, PlansResolveEveryStrategyToAMesh) {
  auto plan = [](const FSDPStrategy& s, int64_t W, int64_t local) {
    return plan_sharding(s, W, local);
  };
  auto p = plan(FSDPStrategy(), 8, 4);
  EXPECT_EQ(p.layout.shape(), (std::vector<int64_t>{1, 8}));
  EXPECT_TRUE(p.reshard_after_forward);
  p = plan(FSDPStrategy().sharding_strategy("shard_grad_op"), 8, 4);
  EXPECT_EQ(p.layout.shape(), (std::vector<int64_t>{1, 8}));
  EXPECT_FALSE(p.reshard_after_forward);
  p = plan(FSDPStrategy().sharding_strategy("no_shard"), 8, 4);
  EXPECT_EQ(p.layout.shape(), (std::vector<int64_t>{8, 1}));
  // HYBRID_SHARD without a mesh: shard inside a node, replicate across nodes.
  p = plan(FSDPStrategy().sharding_strategy("hybrid_shard"), 8, 4);
  EXPECT_EQ(p.layout.shape(), (std::vector<int64_t>{2, 4}));
  EXPECT_TRUE(p.warnings.empty());
  p = plan(FSDPStrategy().sharding_strategy("hybrid_shard_zero2").device_mesh({-1, 2}), 8, 4);
  EXPECT_EQ(p.layout.shape(), (std::vector<int64_t>{4, 2}));
  EXPECT_FALSE(p.reshard_after_forward);
  // FULL_SHARD with (1, W) is the same as (W).
  p = plan(FSDPStrategy().device_mesh({1, 4}), 4, 4);
  EXPECT_EQ(p.layout.shape(), (std::vector<int64_t>{1, 4}));
}

TEST(Strategy, ValidationErrors) {
  auto err = [](const FSDPStrategy& s, int64_t W = 8, int64_t local = 4) {
    return error_of([&] { plan_sharding(s, W, local); });
  };
  EXPECT_EQ(err(FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh({3, 2}), 4, 2),
            "device_mesh (3, 2) has 6 ranks but the world has 4 processes; use (2, 2) or (-1, 2)");
  // A 2-D mesh with a non-hybrid strategy must not silently ignore a dim.
  std::string e = err(FSDPStrategy().device_mesh({2, 4}));
  EXPECT_NE(e.find("FULL_SHARD shards over one mesh dim"), std::string::npos) << e;
  EXPECT_NE(e.find("use HYBRID_SHARD with this mesh, or a 1-D mesh (8)"), std::string::npos) << e;
  e = err(FSDPStrategy().sharding_strategy("shard_grad_op").device_mesh({2, 4}));
  EXPECT_NE(e.find("use HYBRID_SHARD_ZERO2"), std::string::npos) << e;
  e = err(FSDPStrategy().sharding_strategy("no_shard").device_mesh({2, 4}));
  EXPECT_NE(e.find("NO_SHARD replicates over every rank"), std::string::npos) << e;
  // A hybrid strategy needs both dims.
  e = err(FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh({8}));
  EXPECT_NE(e.find("HYBRID_SHARD needs a 2-D device_mesh (replicate, shard) but got (8)"),
            std::string::npos) << e;
  e = err(FSDPStrategy().sharding_strategy("full_shard").grad_sync(GradSync::kReplicateOnLast));
  EXPECT_NE(e.find("replicate_on_last needs a hybrid strategy"), std::string::npos) << e;
  e = err(FSDPStrategy().mixed_precision({c10::kLong, std::nullopt}));
  EXPECT_NE(e.find("not a floating-point compute type"), std::string::npos) << e;
  e = err(FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh({2, 2, 2}));
  EXPECT_NE(e.find("has 3 dims"), std::string::npos) << e;
}

TEST(Strategy, ShardGroupAcrossNodesWarns) {
  // 2 ranks per node, shard groups of 4: every shard group spans two nodes.
  auto p = plan_sharding(FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh({2, 4}), 8, 2);
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_NE(p.warnings[0].find("spans 2 nodes"), std::string::npos) << p.warnings[0];
  EXPECT_NE(p.warnings[0].find("(4, 2) keeps them inside nodes"), std::string::npos);
  EXPECT_TRUE(plan_sharding(FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh({4, 2}),
                            8, 2).warnings.empty());
  // FULL_SHARD over 2 nodes spans them too.
  EXPECT_EQ(plan_sharding(FSDPStrategy(), 8, 4).warnings.size(), 1u);
}

class MeshGroups : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(MeshGroups, EachGroupHoldsExactlyItsRanks) {
  const auto shape = GetParam();
  const int64_t W = shape[0] * shape[1];
  fsdp::testing::run_ranks(W, [&](Runtime& rt) {
    auto runtime = std::shared_ptr<Runtime>(&rt, [](Runtime*) {});
    auto mesh = DeviceMesh::create(runtime, shape);
    const auto& layout = mesh->layout();
    for (const std::string dim : {"replicate", "shard"}) {
      auto group = mesh->group(dim);
      const auto expected = layout.group_of(layout.dim_index(dim), rt.rank());
      EXPECT_EQ(group->ranks(), expected);
      EXPECT_EQ(group->kind(), dim);
      // Sum and bitmask of the members' global ranks, computed by the group itself.
      at::Tensor t = at::tensor({static_cast<double>(rt.rank()), std::pow(2.0, rt.rank())},
                                at::kDouble);
      group->all_reduce(t)->wait();
      double sum = 0, mask = 0;
      for (int64_t r : expected) {
        sum += r;
        mask += std::pow(2.0, r);
      }
      EXPECT_EQ(t[0].item<double>(), sum) << dim;
      EXPECT_EQ(t[1].item<double>(), mask) << dim;
    }
    EXPECT_EQ(mesh->coordinate("replicate"), rt.rank() / shape[1]);
    EXPECT_EQ(mesh->coordinate("shard"), rt.rank() % shape[1]);
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, MeshGroups,
                         ::testing::Values(std::vector<int64_t>{1, 4}, std::vector<int64_t>{2, 2},
                                           std::vector<int64_t>{4, 1}, std::vector<int64_t>{2, 4},
                                           std::vector<int64_t>{4, 2}),
                         [](const auto& info) {
                           return std::to_string(info.param[0]) + "x" + std::to_string(info.param[1]);
                         });

TEST(Report, DescribesTheTopology) {
  auto plan = plan_sharding(FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh({2, 4}), 8, 4);
  std::vector<UnitInfo> units(2);
  units[0] = {"", 1000, 1000, 250, {}};
  units[1] = {"blocks.0", 4002, 4004, 1001, {}};
  ReportOptions opts;
  auto r = make_topology_report(plan, 4, units, opts);
  auto j = nlohmann::json::parse(r.to_json());
  EXPECT_EQ(j["world_size"], 8);
  EXPECT_EQ(j["mesh"], (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(j["strategy"], "HYBRID_SHARD");
  EXPECT_EQ(j["shard_groups"], (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(j["replicate_groups"],
            (std::vector<std::vector<int64_t>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(j["ranks"][5]["replicate"], 1);
  EXPECT_EQ(j["ranks"][5]["shard"], 1);
  EXPECT_EQ(j["ranks"][5]["node"], 1);
  // fp32: root gathered once (kept through backward), the block twice (freed after forward).
  EXPECT_EQ(r.comm.shard_all_gather, 1000 * 4 + 2 * 4004 * 4);
  EXPECT_EQ(r.comm.shard_reduce_scatter, (1000 + 4004) * 4);
  EXPECT_EQ(r.comm.replicate_all_reduce, (250 + 1001) * 4);
  EXPECT_EQ(r.sharded.params, (250 + 1001) * 4);
  EXPECT_EQ(r.replica.params, (1000 + 4002) * 4);
  EXPECT_EQ(r.sharded.optimizer, 2 * r.sharded.params);
  const std::string text = r.to_text();
  EXPECT_NE(text.find("replica 1   rank 4   rank 5"), std::string::npos) << text;
  EXPECT_NE(text.find("[0, 4]  [1, 5]  [2, 6]  [3, 7]"), std::string::npos) << text;
}
