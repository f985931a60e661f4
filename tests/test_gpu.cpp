// GPU tests: NCCL's flat collectives through our Group, the engine on CUDA tensors against
// single-process training (every mesh the visible GPUs allow), bf16 on GPU, a checkpoint's save
// and load with every rank's CUDA generator, and the CUDA caching allocator's peak against the
// sharded formula. They run where this libtorch has CUDA and a GPU
// is visible (scripts/gpu-check.sh) and skip with the reason elsewhere; scripts/cuda-check.sh
// compiles them against Debian's CUDA libtorch, where no GPU is visible.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "comm/c10d_group.h"
#include "base/compat.h"
#include "fsdp/checkpoint.h"
#include "fsdp/error.h"
#include "fsdp/sharded.h"
#include "models.h"
#include "testing.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

constexpr int64_t kSteps = 3, kPerRank = 2, kSeq = 5, kVocab = 17, kClasses = 7;

int64_t visible_gpus() { return static_cast<int64_t>(torch::cuda::device_count()); }

// Why this process cannot run a test that needs `n` GPUs; empty if it can.
std::string missing_gpus(int64_t n) {
#if !defined(FSDP_WITH_CUDA)
  (void)n;
  return "this libtorch is a CPU-only build; the GPU tests need a CUDA libtorch and a GPU "
         "(scripts/gpu-check.sh)";
#else
  const int64_t have = visible_gpus();
  if (have >= n) return "";
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  return fsdp::detail::cat("needs ", n, n == 1 ? " GPU" : " GPUs", " but this process sees ", have,
                     v ? fsdp::detail::cat(" (CUDA_VISIBLE_DEVICES='", v, "')") : std::string());
#endif
}

#define REQUIRE_GPUS(n)                               \
  do {                                                \
    const std::string why = missing_gpus(n);          \
    if (!why.empty()) GTEST_SKIP() << why;            \
  } while (0)

std::shared_ptr<Runtime> borrow(Runtime& rt) { return {&rt, [](Runtime*) {}}; }

// ---------------------------------------------------------------------------------------------
// Collectives: NCCL's own _allgather_base / _reduce_scatter_base behind fsdp::Group.

TEST(Gpu, NcclGroupOnOneGpu) {
  REQUIRE_GPUS(1);
#if defined(FSDP_WITH_CUDA)
  compat::set_cuda_device(0);
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(
      c10::make_intrusive<c10d::HashStore>(), 0, 1, c10d::ProcessGroupNCCL::Options::create());
  auto group = fsdp::detail::make_c10d_group(pg, {0}, 0, "shard", /*flat=*/true, /*nccl=*/true,
                                       CollectiveAlgorithm::kAuto);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto o = torch::TensorOptions().dtype(dtype).device(torch::kCUDA, 0);
    auto in = torch::arange(12, o);
    auto out = torch::empty({12}, o);
    group->all_gather(out, in)->wait();
    EXPECT_TRUE(out.equal(in)) << dtype;
    auto reduced = torch::empty({12}, o);
    group->reduce_scatter(reduced, in)->wait();
    EXPECT_TRUE(reduced.equal(in)) << dtype;
    auto summed = in.clone();
    group->all_reduce(summed)->wait();
    group->broadcast(summed, 0)->wait();
    EXPECT_TRUE(summed.equal(in)) << dtype;
  }
  group->barrier();
  try {
    fsdp::detail::make_c10d_group(pg, {0}, 0, "shard", true, true, CollectiveAlgorithm::kRing);
    ADD_FAILURE() << "an NCCL group accepted the ring algorithm";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL groups use NCCL's own"), std::string::npos)
        << e.what();
  }
#endif
}

TEST(Gpu, NcclCollectivesAcrossEveryVisibleGpu) {
  REQUIRE_GPUS(2);
  const int64_t W = visible_gpus();
  run_ranks(
      W,
      [&](Runtime& rt) {
        ASSERT_EQ(rt.backend(), Backend::kNccl);
        ASSERT_EQ(rt.device(), c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(rt.rank())));
        for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
          const auto o = torch::TensorOptions().dtype(dtype).device(rt.device());
          auto mine = torch::full({3}, static_cast<double>(rt.rank() + 1), o);
          auto gathered = torch::empty({3 * W}, o);
          rt.world()->all_gather(gathered, mine)->wait();
          auto want = torch::arange(1, W + 1, o).repeat_interleave(3);
          EXPECT_TRUE(gathered.equal(want)) << dtype << " rank " << rt.rank();
          auto shard = torch::empty({3}, o);
          rt.world()->reduce_scatter(shard, torch::full({3 * W}, rt.rank() + 1.0, o))->wait();
          EXPECT_TRUE(shard.equal(torch::full({3}, W * (W + 1) / 2.0, o))) << dtype;
        }
        rt.world()->barrier();
      },
      W, std::chrono::seconds(120), CollectiveAlgorithm::kAuto, Backend::kNccl);
}

// ---------------------------------------------------------------------------------------------
// The engine on CUDA tensors against one process training the global batch on the CPU.

using Weights = std::map<std::string, torch::Tensor>;

Weights weights_of(torch::nn::Module& m) {
  Weights w;
  for (const auto& p : m.named_parameters()) w[p.key()] = p.value().detach().cpu().clone();
  return w;
}

void set_weights(torch::nn::Module& m, const Weights& w) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) p.value().copy_(w.at(p.key()));
}

struct Batches {
  torch::Tensor tokens, targets;  // [kSteps, W * kPerRank, kSeq], on the CPU
  Batches(int64_t world) {
    torch::Generator gen = at::detail::createCPUGenerator(4321);
    tokens = torch::randint(kVocab, {kSteps, world * kPerRank, kSeq}, gen);
    targets = torch::randint(kClasses, {kSteps, world * kPerRank, kSeq}, gen);
  }
};

Weights initial_weights() {
  torch::manual_seed(11);
  NetImpl net;
  return weights_of(net);
}

torch::optim::SGD sgd(std::vector<torch::Tensor> params) {
  return torch::optim::SGD(std::move(params), torch::optim::SGDOptions(0.1).momentum(0.9));
}

// The weights after each step of one CPU process on all ranks' batches.
std::vector<Weights> cpu_reference(int64_t world) {
  auto net = std::make_shared<NetImpl>();
  set_weights(*net, initial_weights());
  auto opt = sgd(net->parameters());
  const Batches b(world);
  std::vector<Weights> after;
  for (int64_t step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    loss_of(net->forward(b.tokens[step]), b.targets[step]).backward();
    opt.step();
    after.push_back(weights_of(*net));
  }
  return after;
}

void expect_close(const torch::OrderedDict<std::string, torch::Tensor>& got, const Weights& want,
                  double atol, double rtol, const std::string& where) {
  for (const auto& [name, b] : want) {
    const torch::Tensor* a = got.find(name);
    ASSERT_NE(a, nullptr) << where << ": missing " << name;
    auto diff = (a->detach().cpu().to(torch::kFloat) - b).abs();
    if ((diff > atol + rtol * b.abs()).any().item<bool>()) {
      ADD_FAILURE() << where << ": parameter " << name << " differs: max abs "
                    << diff.max().item<double>() << " (bound " << atol << " + " << rtol << "|b|)";
      return;
    }
  }
}

// Trains kSteps on every rank's own GPU and compares with the CPU reference after each step.
void train_on_gpus(const std::vector<int64_t>& mesh, ShardingStrategy strategy,
                   const MixedPrecision& mp, double atol, double rtol, const std::string& name) {
  int64_t W = 1;
  for (auto v : mesh) W *= v;
  const auto reference = cpu_reference(W);
  const Batches b(W);
  const Weights init = initial_weights();
  run_ranks(
      W,
      [&](Runtime& rt) {
        ASSERT_EQ(rt.backend(), Backend::kNccl) << rt.backend_reason();
        auto net = std::make_shared<NetImpl>();
        set_weights(*net, init);
        auto model = shard(net,
                           FSDPStrategy().sharding_strategy(strategy).device_mesh(mesh)
                               .mixed_precision(mp).backend(Backend::kNccl),
                           borrow(rt));
        for (const auto& p : model.parameters()) {
          ASSERT_EQ(p.device(), rt.device()) << "a parameter shard is not on the rank's GPU";
        }
        auto opt = sgd(model.parameters());
        const int64_t r = rt.rank();
        for (int64_t step = 0; step < kSteps; ++step) {
          opt.zero_grad();
          auto x = b.tokens[step].narrow(0, r * kPerRank, kPerRank).to(rt.device());
          auto y = b.targets[step].narrow(0, r * kPerRank, kPerRank).to(rt.device());
          auto logits = model(x);
          ASSERT_TRUE(logits.is_cuda()) << "forward did not run on the GPU";
          if (mp.param_dtype) {
            ASSERT_EQ(logits.scalar_type(), *mp.param_dtype) << "forward ignored the param dtype";
          }
          loss_of(logits, y).backward();
          opt.step();
          expect_close(model.state_dict(), reference[step], atol, rtol,
                       fsdp::detail::cat(name, " rank ", r, " step ", step));
        }
      },
      W, std::chrono::seconds(120), CollectiveAlgorithm::kAuto, Backend::kNccl);
}

struct MeshCase {
  ShardingStrategy strategy;
  std::vector<int64_t> mesh;
};

class GpuEquivalence : public ::testing::TestWithParam<MeshCase> {};

// fp32 on the GPU against fp32 on the CPU: the same sums in another order (cuBLAS, NCCL), so
// 1e-5 + 1e-4|b| after 3 SGD steps.
TEST_P(GpuEquivalence, MatchesSingleProcessTraining) {
  const MeshCase c = GetParam();
  int64_t W = 1;
  for (auto v : c.mesh) W *= v;
  REQUIRE_GPUS(W);
  train_on_gpus(c.mesh, c.strategy, MixedPrecision{}, 1e-5, 1e-4, to_string(c.strategy));
}

std::string mesh_case_name(const ::testing::TestParamInfo<MeshCase>& info) {
  std::string s = to_string(info.param.strategy);
  for (auto v : info.param.mesh) s += "_" + std::to_string(v);
  return s;
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, GpuEquivalence,
    ::testing::Values(MeshCase{ShardingStrategy::kFullShard, {1}},
                      MeshCase{ShardingStrategy::kShardGradOp, {1}},
                      MeshCase{ShardingStrategy::kNoShard, {1}},
                      MeshCase{ShardingStrategy::kFullShard, {2}},
                      MeshCase{ShardingStrategy::kNoShard, {2}},
                      MeshCase{ShardingStrategy::kHybridShard, {1, 2}},
                      MeshCase{ShardingStrategy::kHybridShard, {2, 1}},
                      MeshCase{ShardingStrategy::kFullShard, {4}},
                      MeshCase{ShardingStrategy::kHybridShard, {2, 2}},
                      MeshCase{ShardingStrategy::kFullShard, {8}},
                      MeshCase{ShardingStrategy::kHybridShard, {2, 4}}),
    mesh_case_name);

// bf16 compute and NCCL's native bf16 reductions against the fp32 CPU reference; the bound is
// test_engine's MixedPrecisionBf16TracksFp32 one (bf16 keeps 8 mantissa bits).
TEST(Gpu, MixedPrecisionBf16) {
  REQUIRE_GPUS(1);
  const int64_t W = std::min<int64_t>(visible_gpus(), 2);
  train_on_gpus({W}, ShardingStrategy::kFullShard, MixedPrecision::bf16(), 4e-3, 2e-2, "bf16");
}

// ---------------------------------------------------------------------------------------------
// Checkpoints on GPUs: the save's commit exchanges checksums and generator states through NCCL
// (on the runtime's device), and each rank's CUDA generator is saved and restored with the CPU
// one: after a load a rank draws what it drew after the save.

TEST(Gpu, CheckpointRestoresEachRanksCudaGenerator) {
  REQUIRE_GPUS(1);
  const int64_t W = std::min<int64_t>(visible_gpus(), 2);
  TempDir dir;
  run_ranks(
      W,
      [&](Runtime& rt) {
        const auto on = torch::TensorOptions().device(rt.device());
        auto model = shard(std::make_shared<NetImpl>(kVocab, 16, 2, kClasses),
                           FSDPStrategy().device_mesh({W}).backend(Backend::kNccl), borrow(rt));
        torch::optim::AdamW opt(model.parameters(), 1e-3);
        torch::rand({rt.rank() + 3}, on);  // each device's generator somewhere of its own
        save_checkpoint(dir / "ck", model, &opt);
        const auto after_save = torch::rand({8}, on).cpu();
        torch::rand({5}, on);
        const auto info = load_checkpoint(dir / "ck", model, &opt);
        EXPECT_TRUE(info.rng_restored);
        EXPECT_TRUE(info.cuda_rng_restored);
        EXPECT_TRUE(torch::equal(torch::rand({8}, on).cpu(), after_save)) << "rank " << rt.rank();
      },
      0, std::chrono::seconds(120), CollectiveAlgorithm::kAuto, Backend::kNccl);
}

// ---------------------------------------------------------------------------------------------
// Memory: what the CUDA caching allocator hands out follows the sharded formula.

TEST(Gpu, CachingAllocatorPeakFollowsTheShardedFormula) {
  REQUIRE_GPUS(1);
#if defined(FSDP_WITH_CUDA)
  const int64_t W = std::min<int64_t>(visible_gpus(), 2);
  // Parameters dominate: 4 blocks of d = 512 (2.1 MB each), a batch of 1 x 4 tokens.
  constexpr int64_t d = 512, vocab = 64, classes = 64;
  const int64_t unit_bytes = (2 * d + d * d + d + d * d) * 4;  // the largest unit, gathered
  constexpr int64_t kSlack = int64_t{1} << 20;  // activations, loss, allocator rounding
  run_ranks(
      W,
      [&](Runtime& rt) {
        const auto index = rt.device().index();
        auto model = shard(std::make_shared<NetImpl>(vocab, d, 4, classes),
                           FSDPStrategy().device_mesh({W}).backend(Backend::kNccl), borrow(rt));
        torch::optim::AdamW opt(model.parameters(), 1e-3);
        auto x = torch::randint(vocab, {1, 4}, torch::TensorOptions(torch::kLong).device(rt.device()));
        auto y = torch::randint(classes, {1, 4}, torch::TensorOptions(torch::kLong).device(rt.device()));
        torch::cuda::synchronize();
        compat::reset_cuda_peak(index);
        for (int step = 0; step < 2; ++step) {
          opt.zero_grad();
          loss_of(model(x), y).backward();
          opt.step();
        }
        torch::cuda::synchronize();
        const auto bytes = compat::cuda_allocated_bytes(index);
        const auto m = model.memory_stats(&opt);
        // After the step only the shards, their gradients and AdamW's two moments remain.
        EXPECT_NEAR(static_cast<double>(bytes.current), static_cast<double>(m.sharded_state_bytes()),
                    static_cast<double>(kSlack))
            << "rank " << rt.rank();
        // During it: at most the running unit, the prefetched one and one unsharded gradient on
        // top of the sharded state.
        EXPECT_LE(bytes.peak, m.sharded_state_bytes() + 3 * unit_bytes + kSlack)
            << "rank " << rt.rank() << ": sharded state " << m.sharded_state_bytes();
        if (W > 1) {
          // Not a replica's training state: parameters, gradients and two moments, all full.
          EXPECT_LT(bytes.peak, 4 * m.replica_param_bytes) << "rank " << rt.rank();
        }
      },
      W, std::chrono::seconds(120), CollectiveAlgorithm::kAuto, Backend::kNccl);
#endif
}

}  // namespace
