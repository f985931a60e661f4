// Collectives against a local reference, ranks as threads over Gloo: world sizes 1, 2, 3, 4, 8,
// per-rank sizes that are odd and prime, every reduce-scatter algorithm, byte counters, chaining,
// and sub-groups.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "comm/collective_check.h"
#include "fsdp/error.h"
#include "testing.h"

using fsdp::CollectiveAlgorithm;
using fsdp::Runtime;
using fsdp::testing::run_ranks;

namespace {

const std::vector<int64_t> kSizes = {1, 5, 33, 1001};

// What rank r contributes: distinct small integers, exact in float.
at::Tensor contribution(int64_t r, int64_t numel, at::ScalarType dtype) {
  return (at::arange(numel, at::kDouble).remainder(97) + 100 * (r + 1)).to(dtype);
}

void check_all(Runtime& rt, at::ScalarType dtype) {
  auto& g = *rt.world();
  const int64_t W = g.size(), r = g.rank();
  for (int64_t n : kSizes) {
    // all_gather
    at::Tensor in = contribution(r, n, dtype);
    at::Tensor out = at::empty({W * n}, dtype);
    g.all_gather(out, in)->wait();
    std::vector<at::Tensor> parts;
    for (int64_t q = 0; q < W; ++q) parts.push_back(contribution(q, n, dtype));
    ASSERT_TRUE(out.equal(at::cat(parts))) << "all_gather W=" << W << " n=" << n;

    // reduce_scatter: every rank contributes a full buffer
    at::Tensor full = contribution(r, W * n, dtype);
    at::Tensor shard = at::empty({n}, dtype);
    g.reduce_scatter(shard, full)->wait();
    at::Tensor sum = at::zeros({W * n}, at::kDouble);
    for (int64_t q = 0; q < W; ++q) sum += contribution(q, W * n, at::kDouble);
    ASSERT_TRUE(shard.to(at::kDouble).equal(sum.narrow(0, r * n, n)))
        << "reduce_scatter W=" << W << " n=" << n << " rank " << r;

    // all_reduce
    at::Tensor t = contribution(r, n, dtype);
    g.all_reduce(t)->wait();
    at::Tensor expect = at::zeros({n}, at::kDouble);
    for (int64_t q = 0; q < W; ++q) expect += contribution(q, n, at::kDouble);
    ASSERT_TRUE(t.to(at::kDouble).equal(expect)) << "all_reduce W=" << W << " n=" << n;

    // broadcast from the last rank
    at::Tensor b = contribution(r, n, dtype);
    g.broadcast(b, W - 1)->wait();
    ASSERT_TRUE(b.equal(contribution(W - 1, n, dtype))) << "broadcast W=" << W;
  }
}

}  // namespace

class Collectives
    : public ::testing::TestWithParam<std::tuple<int64_t, CollectiveAlgorithm>> {};

TEST_P(Collectives, MatchLocalReference) {
  auto [W, algo] = GetParam();
  run_ranks(W, [&](Runtime& rt) {
    check_all(rt, at::kFloat);
    check_all(rt, at::kDouble);
  }, 0, std::chrono::seconds(60), algo);
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizes, Collectives,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                       ::testing::Values(CollectiveAlgorithm::kAuto,
                                         CollectiveAlgorithm::kRing,
                                         CollectiveAlgorithm::kAllToAll,
                                         CollectiveAlgorithm::kAllReduce)),
    [](const auto& info) {
      return "W" + std::to_string(std::get<0>(info.param)) + "_" +
             fsdp::to_string(std::get<1>(info.param));
    });

TEST(Collectives, NativeAlgorithmWhereTheBackendHasOne) {
  try {
    run_ranks(2, [&](Runtime& rt) { check_all(rt, at::kFloat); }, 0, std::chrono::seconds(60),
              CollectiveAlgorithm::kNative);
  } catch (const fsdp::Error& e) {
    // libtorch 1.13's Gloo: the request must be refused clearly, never silently downgraded.
    ASSERT_NE(std::string(e.what()).find("has no _allgather_base / _reduce_scatter_base"),
              std::string::npos)
        << e.what();
    GTEST_SKIP() << "this libtorch's Gloo has no flat collectives: " << e.what();
  }
}

TEST(Collectives, Bf16OnEveryWorldSize) {
  // Gloo cannot sum bf16: reductions take the ring (local sums), gathers move the bytes as fp16
  // bit patterns. Small integers keep every sum exact in bf16.
  for (int64_t W : {1, 2, 3, 4}) {
    run_ranks(W, [&](Runtime& rt) {
      auto& g = *rt.world();
      const int64_t r = g.rank();
      auto val = [](int64_t q, int64_t n) {
        return (at::arange(n, at::kFloat).remainder(7) + q).to(at::kBFloat16);
      };
      for (int64_t n : {1, 5, 33}) {
        at::Tensor out = at::empty({W * n}, at::kBFloat16);
        g.all_gather(out, val(r, n))->wait();
        std::vector<at::Tensor> parts;
        for (int64_t q = 0; q < W; ++q) parts.push_back(val(q, n));
        ASSERT_TRUE(out.equal(at::cat(parts))) << "bf16 all_gather W=" << W;

        at::Tensor shard = at::empty({n}, at::kBFloat16);
        g.reduce_scatter(shard, val(r, W * n))->wait();
        at::Tensor sum = at::zeros({W * n});
        for (int64_t q = 0; q < W; ++q) sum += val(q, W * n).to(at::kFloat);
        ASSERT_TRUE(shard.to(at::kFloat).equal(sum.narrow(0, r * n, n))) << "bf16 reduce_scatter";

        at::Tensor t = val(r, n);
        g.all_reduce(t)->wait();
        at::Tensor expect = at::zeros({n});
        for (int64_t q = 0; q < W; ++q) expect += val(q, n).to(at::kFloat);
        ASSERT_TRUE(t.to(at::kFloat).equal(expect))
            << "bf16 all_reduce W=" << W << " n=" << n;

        at::Tensor b = val(r, n);
        g.broadcast(b, 0)->wait();
        ASSERT_TRUE(b.equal(val(0, n))) << "bf16 broadcast";
      }
    });
  }
}

// NOTE [ring buffers]: rings run in segments of 8 MiB per chunk; a buffer of several segments
// per chunk, with chunks of unequal length (the bf16 all-reduce) and a last, short segment,
// sums exactly.
TEST(Collectives, RingsOverSeveralSegments) {
  const int64_t W = 3, n = 5'000'001;  // ~19 MiB of floats per rank: 3 segments
  run_ranks(W, [&](Runtime& rt) {
    auto& g = *rt.world();
    const int64_t r = rt.rank();
    auto value = [](int64_t q, int64_t numel) {
      return (at::arange(numel, at::kLong).remainder(7) + q).to(at::kFloat);
    };
    // bf16: Gloo cannot sum it, so it takes the ring (small integers: exact in bf16).
    const int64_t m = 3 * n + 1;  // ~10 MiB of bf16 per chunk (one a bit longer): 2 segments
    at::Tensor t = value(r, m).to(at::kBFloat16);
    g.all_reduce(t)->wait();
    at::Tensor expect = at::zeros({m});
    for (int64_t q = 0; q < W; ++q) expect += value(q, m);
    ASSERT_TRUE(t.to(at::kFloat).equal(expect)) << "bf16 all_reduce of " << m << " over " << W;
    at::Tensor shard = at::empty({n - 1});
    g.reduce_scatter(shard, value(r, W * (n - 1)))->wait();
    at::Tensor sum = at::zeros({W * (n - 1)});
    for (int64_t q = 0; q < W; ++q) sum += value(q, W * (n - 1));
    ASSERT_TRUE(shard.equal(sum.narrow(0, r * (n - 1), n - 1))) << "reduce_scatter, rank " << r;
  });
}

TEST(Collectives, CountersAndChaining) {
  run_ranks(4, [&](Runtime& rt) {
    auto& g = *rt.world();
    auto before = g.counters();
    at::Tensor full = at::ones({4 * 10});
    at::Tensor shard = at::empty({10});
    auto rs = g.reduce_scatter(shard, full);
    auto ar = g.all_reduce(shard, rs);  // must see the reduce-scatter's result
    ar->wait();
    EXPECT_TRUE(rs->completed());
    EXPECT_TRUE(shard.equal(at::full({10}, 16.0f)));
    auto d = g.counters() - before;
    EXPECT_EQ(d.reduce_scatter_bytes, 4 * 10 * 4);
    EXPECT_EQ(d.all_reduce_bytes, 10 * 4);
    EXPECT_EQ(d.calls, 2);
  });
}

TEST(Collectives, SubGroups) {
  run_ranks(6, [&](Runtime& rt) {
    // Two groups of three: {0,1,2} and {3,4,5}; every rank creates both, in the same order.
    auto a = rt.new_group({0, 1, 2}, "shard");
    auto b = rt.new_group({3, 4, 5}, "shard");
    auto mine = rt.rank() < 3 ? a : b;
    EXPECT_EQ(rt.rank() < 3 ? b : a, nullptr);
    ASSERT_NE(mine, nullptr);
    EXPECT_EQ(mine->size(), 3);
    at::Tensor t = at::full({1}, static_cast<float>(rt.rank()));
    mine->all_reduce(t)->wait();
    EXPECT_EQ(t.item<float>(), rt.rank() < 3 ? 3.0f : 12.0f);
  });
}

TEST(Collectives, BadArgumentsAreRefusedBeforeCommunicating) {
  auto g = fsdp::make_single_process_group(0, "world");
  EXPECT_THROW(g->all_gather(at::empty({3}), at::empty({2})), fsdp::Error);
  EXPECT_THROW(g->reduce_scatter(at::empty({2}), at::empty({3})), fsdp::Error);
  EXPECT_THROW(g->all_gather(at::empty({2}), at::empty({2}, at::kDouble)), fsdp::Error);
  EXPECT_THROW(g->broadcast(at::empty({2}), 1), fsdp::Error);
  EXPECT_THROW(g->all_reduce(at::empty({4, 4}).t()), fsdp::Error);
  EXPECT_EQ(g->counters().calls, 0);
}

TEST(Collectives, AgreementCheckNamesBothValues) {
  try {
    run_ranks(3, [&](Runtime& rt) {
      rt.check_agreement("configuration", rt.rank() == 2 ? "mesh=(3)" : "mesh=(1, 3)");
    });
    FAIL() << "disagreement accepted";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 has 'mesh=(1, 3)' but rank 2 has 'mesh=(3)'"),
              std::string::npos)
        << e.what();
  }
  run_ranks(3, [&](Runtime& rt) { rt.check_agreement("configuration", "same"); });
}

// NOTE [collective check]: with debug_collectives on, a call that differs from group rank 0's
// fails on every member with the same one-line error, before any data moves.
namespace {

// Runs `fn` on `world` thread ranks with debug_collectives on the world group; returns each
// rank's error ("" if none).
std::vector<std::string> errors_of(int64_t world, const std::function<void(fsdp::Group&)>& fn,
                                   std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  std::vector<std::string> errors(static_cast<size_t>(world));
  run_ranks(
      world,
      [&](Runtime& rt) {
        auto& g = *rt.world();
        g.set_debug_collectives(true);
        try {
          fn(g);
        } catch (const fsdp::Error& e) {
          errors[static_cast<size_t>(rt.rank())] = e.what();
        }
      },
      0, timeout);
  return errors;
}

TEST(CollectiveCheck, TheFirstRankThatDiffersIsNamedOnEveryRank) {
  const auto errors = errors_of(3, [](fsdp::Group& g) {
    at::Tensor in = at::ones({4}), out = at::empty({12});
    g.all_gather(out, in, "unit 'a'")->wait();
    g.all_reduce(in, nullptr, "the gradient norm")->wait();
    // Collective #3: rank 2 gathers another (equal-sized) unit.
    g.all_gather(out, in, g.rank() == 2 ? "unit 'c'" : "unit 'b'")->wait();
  });
  const std::string expected =
      "collective #3 on the world group [0, 1, 2]: rank 2 issued all_gather of unit 'c' (12 Float "
      "elements) while rank 0 issued all_gather of unit 'b' (12 Float elements); the ranks' "
      "control flow differs";
  for (const auto& e : errors) {
    EXPECT_EQ(e.rfind(expected, 0), 0u) << e;
    EXPECT_EQ(e, errors[0]);
  }
}

TEST(CollectiveCheck, SizesOperationsAndRootsAreCompared) {
  auto errors = errors_of(2, [](fsdp::Group& g) {
    at::Tensor t = at::ones({g.rank() == 1 ? 5 : 4});
    g.all_reduce(t, nullptr, "x")->wait();
  });
  EXPECT_NE(errors[0].find("rank 1 issued all_reduce of x (5 Float elements) while rank 0 issued "
                           "all_reduce of x (4 Float elements)"),
            std::string::npos) << errors[0];
  errors = errors_of(2, [](fsdp::Group& g) {
    at::Tensor t = at::ones({4}), out = at::empty({8});
    if (g.rank() == 0) g.all_reduce(t)->wait();
    else g.all_gather(out, t)->wait();
  });
  EXPECT_NE(errors[1].find("collective #1 on the world group [0, 1]: rank 1 issued all_gather "
                           "(8 Float elements) while rank 0 issued all_reduce (4 Float elements)"),
            std::string::npos) << errors[1];
  errors = errors_of(2, [](fsdp::Group& g) { g.broadcast(at::ones({2}), g.rank())->wait(); });
  EXPECT_NE(errors[0].find("rank 1 issued broadcast from group rank 1 (2 Float elements) while "
                           "rank 0 issued broadcast from group rank 0"),
            std::string::npos) << errors[0];
}

TEST(CollectiveCheck, ARankThatIssuesNothingIsNamedAfterTheTimeout) {
  const auto errors = errors_of(
      2,
      [](fsdp::Group& g) {
        if (g.rank() == 1) return;  // skips the collective
        g.all_reduce(at::ones({3}), nullptr, "unit 'x'")->wait();
      },
      std::chrono::seconds(2));
  EXPECT_NE(errors[0].find("collective #1 on the world group [0, 1]: rank 1 did not issue it "
                           "within 2 s while rank 0 issued all_reduce of unit 'x' (3 Float "
                           "elements)"),
            std::string::npos) << errors[0];
  EXPECT_EQ(errors[1], "");
}

// Without the check, a failed collective's error still names its number, unit and size.
TEST(CollectiveCheck, AFailedCollectiveNamesItsNumberAndUnit) {
  std::string error;
  run_ranks(
      2,
      [&](Runtime& rt) {
        auto& g = *rt.world();
        at::Tensor t = at::ones({3});
        g.all_reduce(t)->wait();
        if (rt.rank() == 1) return;  // leaves; rank 0's next collective fails or times out
        try {
          g.all_reduce(t, nullptr, "unit 'x'")->wait();
        } catch (const fsdp::Error& e) {
          error = e.what();
        }
      },
      0, std::chrono::seconds(3));
  EXPECT_EQ(error.rfind("all_reduce on the world group [0, 1] failed at collective #2 (unit 'x', "
                        "3 Float elements): ", 0), 0u) << error;
}

TEST(CollectiveCheck, MatchingCallsRunAndAreNumbered) {
  run_ranks(2, [](Runtime& rt) {
    auto& g = *rt.world();
    const int64_t before = g.sequence();
    g.set_debug_collectives(true);
    for (int i = 0; i < 20; ++i) {
      at::Tensor t = at::full({3}, static_cast<float>(rt.rank()));
      g.all_reduce(t, nullptr, "t")->wait();
      ASSERT_EQ(t[0].item<float>(), 1.0f);
    }
    g.barrier();
    EXPECT_EQ(g.sequence(), before + 21);
    g.set_debug_collectives(false);
  });
}

// Each member's store holds at most two of its calls, however many were checked.
TEST(CollectiveCheck, TheStoreKeepsOnlyTheLastCalls) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  fsdp::detail::CollectiveCheck check(store, std::chrono::seconds(5));
  auto g = fsdp::make_single_process_group(0, "shard");
  for (int64_t n = 1; n <= 50; ++n) {
    fsdp::CollectiveCall call;
    call.sequence = n;
    call.op = "all_gather";
    check.verify(*g, call);
  }
  EXPECT_EQ(store->getNumKeys(), 1);
}

TEST(CollectiveCheck, CallsDescribeThemselves) {
  fsdp::CollectiveCall c;
  c.sequence = 17;
  c.op = "all_gather";
  c.what = "unit 'blocks.3'";
  c.numel = 4096;
  c.dtype = at::kBFloat16;
  EXPECT_EQ(c.summary(), "all_gather of unit 'blocks.3' (4096 BFloat16 elements)");
  EXPECT_EQ(c.describe(), "collective #17 (unit 'blocks.3', 4096 BFloat16 elements)");
  fsdp::CollectiveCall b;
  b.sequence = 2;
  b.op = "barrier";
  EXPECT_EQ(b.summary(), "barrier");
  EXPECT_EQ(b.describe(), "collective #2");
}

}  // namespace
