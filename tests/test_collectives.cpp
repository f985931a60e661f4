// Collectives against a local reference, ranks as threads over Gloo: world sizes 1, 2, 3, 4, 8,
// per-rank sizes that are odd and prime, every reduce-scatter algorithm, byte counters, chaining,
// and sub-groups.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

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
