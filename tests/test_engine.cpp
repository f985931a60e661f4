// The engine against single-process training: every strategy on every mesh shape of 1, 2, 3, 4
// and 8 ranks (ranks as threads over Gloo), SGD and AdamW, 5 steps, every parameter compared
// after every step with one process training the concatenated global batch.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <mutex>

#include "fsdp/error.h"
#include "fsdp/report.h"
#include "fsdp/sharded.h"
#include "models.h"
#include "testing.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

constexpr int64_t kSteps = 5, kPerRank = 2, kSeq = 5, kVocab = 17, kClasses = 7;

using State = std::map<std::string, torch::Tensor>;

State snapshot(torch::nn::Module& m) {
  State s;
  for (const auto& p : m.named_parameters()) s[p.key()] = p.value().detach().clone();
  return s;
}

void load(torch::nn::Module& m, const State& s) {
  torch::NoGradGuard g;
  for (auto& p : m.named_parameters()) p.value().copy_(s.at(p.key()));
}

enum class Opt { kSGD, kAdamW };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, std::vector<torch::Tensor> params) {
  if (o == Opt::kSGD) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

struct Data {
  torch::Tensor tokens, targets;  // [kSteps, W * kPerRank, kSeq]
};

Data make_data(int64_t world) {
  torch::Generator gen = at::detail::createCPUGenerator(1234);
  Data d;
  d.tokens = torch::randint(kVocab, {kSteps, world * kPerRank, kSeq}, gen);
  d.targets = torch::randint(kClasses, {kSteps, world * kPerRank, kSeq}, gen);
  return d;
}

State initial_weights() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(7);
  auto net = std::make_shared<NetImpl>();
  return snapshot(*net);
}

// One process on the whole global batch: the ground truth after every step.
std::vector<State> reference(Opt opt, int64_t world, double clip = 0) {
  auto net = std::make_shared<NetImpl>();
  load(*net, initial_weights());
  auto optimizer = make_optimizer(opt, net->parameters());
  Data d = make_data(world);
  std::vector<State> states;
  for (int64_t step = 0; step < kSteps; ++step) {
    optimizer->zero_grad();
    auto loss = loss_of(net->forward(d.tokens[step]), d.targets[step]);
    loss.backward();
    if (clip > 0) torch::nn::utils::clip_grad_norm_(net->parameters(), clip);
    optimizer->step();
    states.push_back(snapshot(*net));
  }
  return states;
}

// Compares a rank's full state dict with the reference; names the worst parameter.
void expect_close(const torch::OrderedDict<std::string, torch::Tensor>& got, const State& want,
                  double atol, double rtol, const std::string& where) {
  for (const auto& [name, b] : want) {
    const torch::Tensor* a = got.find(name);
    ASSERT_NE(a, nullptr) << where << ": missing " << name;
    auto diff = (*a - b).abs();
    auto bound = atol + rtol * b.abs();
    if ((diff > bound).any().item<bool>()) {
      double max_abs = diff.max().item<double>();
      double max_rel = (diff / (b.abs() + 1e-12)).max().item<double>();
      ADD_FAILURE() << where << ": parameter " << name << " differs: max abs " << max_abs
                    << ", max rel " << max_rel << " (bound " << atol << " + " << rtol << "|b|)";
      return;
    }
  }
}

struct Case {
  ShardingStrategy strategy;
  std::vector<int64_t> mesh;  // world = product
  Opt opt;
};

std::string name_of(const Case& c) {
  std::string s = to_string(c.strategy);
  for (auto v : c.mesh) s += "_" + std::to_string(v);
  return s + (c.opt == Opt::kSGD ? "_SGD" : "_AdamW");
}

int64_t world_of(const std::vector<int64_t>& mesh) {
  int64_t w = 1;
  for (auto v : mesh) w *= v;
  return w;
}

// Tolerances. SGD: 1e-6 + 1e-5|b|. AdamW divides by sqrt(v) + eps: where a gradient element is
// near zero its update is ~lr * g / |g| and the last-bit differences of the reduction order
// (reduce-scatter vs one big matmul) are amplified up to lr; 5 steps of lr 1e-2 give ~1e-4 worst
// case, so AdamW gets 2e-5 absolute on top of the same relative bound.
double atol_for(Opt o) { return o == Opt::kSGD ? 1e-6 : 2e-5; }

class Equivalence : public ::testing::TestWithParam<Case> {};

TEST_P(Equivalence, MatchesSingleProcessTraining) {
  const Case c = GetParam();
  const int64_t W = world_of(c.mesh);
  const auto ref = reference(c.opt, W);
  const Data d = make_data(W);
  const State init = initial_weights();
  run_ranks(W, [&](Runtime& rt) {
    auto net = std::make_shared<NetImpl>();
    load(*net, init);
    auto model = shard(net, FSDPStrategy().sharding_strategy(c.strategy).device_mesh(c.mesh),
                       std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    auto optimizer = make_optimizer(c.opt, model.parameters());
    const int64_t r = rt.rank();
    for (int64_t step = 0; step < kSteps; ++step) {
      optimizer->zero_grad();
      auto x = d.tokens[step].narrow(0, r * kPerRank, kPerRank);
      auto y = d.targets[step].narrow(0, r * kPerRank, kPerRank);
      loss_of(model(x), y).backward();
      optimizer->step();
      auto full = model.state_dict();
      expect_close(full, ref[step], atol_for(c.opt), 1e-5,
                   name_of(c) + " rank " + std::to_string(r) + " step " + std::to_string(step));
    }
  });
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (Opt o : {Opt::kSGD, Opt::kAdamW}) {
    // Non-hybrid strategies take a 1-D mesh (a 2-D one with a replicate dim > 1 is an error).
    for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                   ShardingStrategy::kNoShard}) {
      for (int64_t w : {1, 2, 3, 4, 8}) cases.push_back({s, {w}, o});
    }
    // Every 2-D shape of 1, 2, 3, 4 and 8 ranks (3: an odd world, shards that do not divide).
    for (auto s : {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
      for (auto mesh : std::vector<std::vector<int64_t>>{{1, 1},
                                                         {1, 2},
                                                         {2, 1},
                                                         {1, 3},
                                                         {3, 1},
                                                         {1, 4},
                                                         {2, 2},
                                                         {4, 1},
                                                         {1, 8},
                                                         {2, 4},
                                                         {4, 2},
                                                         {8, 1}}) {
        cases.push_back({s, mesh, o});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, Equivalence, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return name_of(info.param); });


// ---------------------------------------------------------------------------------------------
// Gradient accumulation: K micro-steps per optimizer step in each GradSync mode equal one step
// on the whole global batch.

struct AccumCase {
  ShardingStrategy strategy;
  std::vector<int64_t> mesh;
  GradSync sync;
};

class Accumulation : public ::testing::TestWithParam<AccumCase> {};

TEST_P(Accumulation, MatchesOneBigBatch) {
  const AccumCase c = GetParam();
  const int64_t W = world_of(c.mesh), K = 2;
  // Reference batches hold W * K * kPerRank rows per step: run it with a "world" of W * K.
  const auto ref = reference(Opt::kSGD, W * K);
  const Data d = make_data(W * K);
  const State init = initial_weights();
  run_ranks(W, [&](Runtime& rt) {
    auto net = std::make_shared<NetImpl>();
    load(*net, init);
    auto model = shard(net, FSDPStrategy().sharding_strategy(c.strategy).device_mesh(c.mesh)
                                .grad_sync(c.sync),
                       std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    auto optimizer = make_optimizer(Opt::kSGD, model.parameters());
    const int64_t r = rt.rank();
    for (int64_t step = 0; step < kSteps; ++step) {
      optimizer->zero_grad();
      for (int64_t k = 0; k < K; ++k) {
        const int64_t row = (r * K + k) * kPerRank;
        auto x = d.tokens[step].narrow(0, row, kPerRank);
        auto y = d.targets[step].narrow(0, row, kPerRank);
        auto guard = model.no_sync(/*enabled=*/k + 1 < K);
        (loss_of(model(x), y) / static_cast<double>(K)).backward();
      }
      optimizer->step();
      expect_close(model.state_dict(), ref[step], 1e-6, 1e-5,
                   std::string(to_string(c.sync)) + " rank " + std::to_string(r) + " step " +
                       std::to_string(step));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Modes, Accumulation,
    ::testing::Values(AccumCase{ShardingStrategy::kFullShard, {4}, GradSync::kEveryMicroStep},
                      AccumCase{ShardingStrategy::kFullShard, {4}, GradSync::kLocal},
                      AccumCase{ShardingStrategy::kNoShard, {2}, GradSync::kLocal},
                      AccumCase{ShardingStrategy::kHybridShard, {2, 2}, GradSync::kEveryMicroStep},
                      AccumCase{ShardingStrategy::kHybridShard, {2, 2}, GradSync::kLocal},
                      AccumCase{ShardingStrategy::kHybridShard, {2, 2}, GradSync::kReplicateOnLast},
                      AccumCase{ShardingStrategy::kHybridShardZero2, {2, 2},
                                GradSync::kReplicateOnLast},
                      AccumCase{ShardingStrategy::kHybridShard, {2, 1}, GradSync::kReplicateOnLast},
                      AccumCase{ShardingStrategy::kHybridShard, {1, 2}, GradSync::kReplicateOnLast}),
    [](const auto& info) {
      std::string s = std::string(to_string(info.param.strategy)) + "_";
      for (auto v : info.param.mesh) s += std::to_string(v) + "_";
      return s + to_string(info.param.sync);
    });

// ---------------------------------------------------------------------------------------------
// Clipping by the global norm, with the norm itself checked.

TEST(Engine, ClipGradNormMatchesSingleProcess) {
  for (auto mesh : std::vector<std::vector<int64_t>>{{2, 2}, {1, 4}}) {
    const double max_norm = 0.05;  // small enough that every step clips
    const int64_t W = world_of(mesh);
    const auto ref = reference(Opt::kSGD, W, max_norm);
    const Data d = make_data(W);
    const State init = initial_weights();
    run_ranks(W, [&](Runtime& rt) {
      auto net = std::make_shared<NetImpl>();
      load(*net, init);
      auto model = shard(net, FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh(mesh),
                         std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
      auto optimizer = make_optimizer(Opt::kSGD, model.parameters());
      const int64_t r = rt.rank();
      for (int64_t step = 0; step < kSteps; ++step) {
        optimizer->zero_grad();
        loss_of(model(d.tokens[step].narrow(0, r * kPerRank, kPerRank)),
                d.targets[step].narrow(0, r * kPerRank, kPerRank))
            .backward();
        const double norm = model.clip_grad_norm(max_norm);
        EXPECT_GT(norm, max_norm) << "the test must exercise clipping";
        optimizer->step();
        expect_close(model.state_dict(), ref[step], 1e-6, 1e-5, "clip step " + std::to_string(step));
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Mixed precision: bf16 compute against the fp32 reference.

TEST(Engine, MixedPrecisionBf16TracksFp32) {
  const int64_t W = 4;
  const auto ref = reference(Opt::kSGD, W);
  const Data d = make_data(W);
  const State init = initial_weights();
  run_ranks(W, [&](Runtime& rt) {
    auto net = std::make_shared<NetImpl>();
    load(*net, init);
    auto model = shard(net, FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh({2, 2})
                                .mixed_precision(MixedPrecision::bf16()),
                       std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    ASSERT_EQ(model.param_dtype(), torch::kBFloat16);
    auto optimizer = make_optimizer(Opt::kSGD, model.parameters());
    const int64_t r = rt.rank();
    double worst = 0;
    for (int64_t step = 0; step < kSteps; ++step) {
      optimizer->zero_grad();
      auto logits = model(d.tokens[step].narrow(0, r * kPerRank, kPerRank));
      ASSERT_EQ(logits.scalar_type(), torch::kBFloat16) << "forward did not run in bf16";
      loss_of(logits, d.targets[step].narrow(0, r * kPerRank, kPerRank)).backward();
      optimizer->step();
      // bf16 keeps 8 mantissa bits (relative rounding 2^-9 ~ 0.2%); activations and gradients
      // carry a few of those roundings, and 5 SGD steps of lr 0.1 move each weight by ~1e-2, so
      // the master weights may drift ~1e-3 from fp32. Bound: 4e-3 + 2e-2|b|.
      auto full = model.state_dict();
      for (const auto& [name, b] : ref[step]) {
        worst = std::max(worst, (full[name] - b).abs().max().item<double>());
      }
      expect_close(full, ref[step], 4e-3, 2e-2, "bf16 step " + std::to_string(step));
    }
    EXPECT_GT(worst, 1e-6) << "bf16 run is bit-identical to fp32: mixed precision not applied";
  });
}

TEST(Engine, Fp16WithoutKernelsIsAClearError) {
  // libtorch 1.13 has no fp16 matmul on CPU; where it has one, fp16 must simply work.
  run_ranks(1, [&](Runtime& rt) {
    try {
      auto model = shard(std::make_shared<NetImpl>(),
                         FSDPStrategy().mixed_precision(MixedPrecision::fp16()),
                         std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
      auto logits = model(torch::zeros({1, 3}, torch::kLong));
      EXPECT_EQ(logits.scalar_type(), torch::kHalf);
    } catch (const fsdp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("use MixedPrecision::bf16() on CPU"), std::string::npos)
          << e.what();
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Memory: sharded bytes match the formula; unsharded buffers really are freed.

int64_t storage_bytes(const torch::Tensor& t) {
  return static_cast<int64_t>(t.storage().nbytes());
}

TEST(Engine, ShardedBytesMatchTheFormula) {
  // Parameters per unit, counted from the layer shapes (d = 33, vocab 17, 7 classes):
  //   block: ln 2*33 + fc1 33*33+33 + fc2 33*33 = 2277;  root: emb 17*33 + norm 2*33 + head 33*7 = 858
  const int64_t block = 2 * 33 + 33 * 33 + 33 + 33 * 33, root = 17 * 33 + 2 * 33 + 33 * 7;
  for (int64_t S : {1, 3, 4}) {
    const Data d = make_data(S);
    run_ranks(S, [&](Runtime& rt) {
      auto model = shard(std::make_shared<NetImpl>(), FSDPStrategy().device_mesh({S}),
                         std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
      torch::optim::AdamW optimizer(model.parameters(), 1e-3);
      optimizer.zero_grad();
      loss_of(model(d.tokens[0].narrow(0, rt.rank() * kPerRank, kPerRank)),
              d.targets[0].narrow(0, rt.rank() * kPerRank, kPerRank)).backward();
      optimizer.step();
      const int64_t elems = (root + S - 1) / S + 3 * ((block + S - 1) / S);
      auto m = model.memory_stats(&optimizer);
      EXPECT_EQ(m.param_shard_bytes, elems * 4) << "S=" << S;
      EXPECT_EQ(m.grad_shard_bytes, elems * 4) << "S=" << S;
      EXPECT_EQ(m.optimizer_state_bytes, 2 * elems * 4) << "S=" << S;
      EXPECT_EQ(m.replica_param_bytes, (root + 3 * block) * 4);
      EXPECT_EQ(m.unsharded_now_bytes, 0) << "gathered buffers outlived the step";
    });
  }
}

TEST(Engine, FullShardFreesUnitsAfterForward) {
  for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
    const Data d = make_data(2);
    run_ranks(2, [&](Runtime& rt) {
      auto net = std::make_shared<NetImpl>();
      auto model = shard(net, FSDPStrategy().sharding_strategy(strategy),
                         std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
      auto logits = model(d.tokens[0].narrow(0, rt.rank() * kPerRank, kPerRank));
      const bool zero3 = strategy == ShardingStrategy::kFullShard;
      for (auto& b : net->blocks) {
        for (auto& p : b->parameters()) {
          EXPECT_EQ(storage_bytes(p) == 0, zero3) << to_string(strategy) << " after forward";
        }
      }
      EXPECT_GT(storage_bytes(net->head->weight), 0) << "the root stays gathered until backward";
      const int64_t held = model.memory_stats().unsharded_now_bytes;
      const int64_t root_bytes = (17 * 33 + 2 * 33 + 33 * 7 + 1) / 2 * 2 * 4;
      if (zero3) EXPECT_EQ(held, root_bytes);
      loss_of(logits, d.targets[0].narrow(0, rt.rank() * kPerRank, kPerRank)).backward();
      for (auto& p : net->parameters()) EXPECT_EQ(storage_bytes(p), 0) << "after backward";
      EXPECT_EQ(model.memory_stats().unsharded_now_bytes, 0);
    });
  }
}

// A block that, when it runs forward or backward, counts how many blocks are gathered.
struct ProbeBlockImpl : BlockImpl {
  using BlockImpl::BlockImpl;
  std::function<void(const char*)> probe;
  torch::Tensor forward(torch::Tensor x) {
    if (probe) {
      probe("forward");
      if (x.requires_grad()) x.register_hook([p = probe](torch::Tensor) { p("backward"); });
    }
    return BlockImpl::forward(x);
  }
};

struct ProbeNetImpl : torch::nn::Module {
  ProbeNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, 33));
    for (int i = 0; i < 5; ++i) {
      blocks.push_back(register_module("b" + std::to_string(i), fsdp::Unit<ProbeBlockImpl>(33)));
    }
    head = register_module("head", torch::nn::Linear(33, kClasses));
  }
  torch::Tensor forward(torch::Tensor t) {
    auto x = emb(t);
    for (auto& b : blocks) x = b(x);
    return head(x);
  }
  torch::nn::Embedding emb{nullptr};
  std::vector<fsdp::Unit<ProbeBlockImpl>> blocks;
  torch::nn::Linear head{nullptr};
};

TEST(Engine, AtMostTheRunningAndThePrefetchedUnitAreGathered) {
  for (bool prefetch : {true, false}) {
    const Data d = make_data(2);
    run_ranks(2, [&](Runtime& rt) {
      auto net = std::make_shared<ProbeNetImpl>();
      int64_t most = 0, calls = 0;
      auto count = [&](const char*) {
        int64_t gathered = 0;
        for (auto& b : net->blocks) gathered += storage_bytes(b->fc1->weight) > 0 ? 1 : 0;
        most = std::max(most, gathered);
        ++calls;
      };
      for (auto& b : net->blocks) b->probe = count;
      auto model = shard(net, FSDPStrategy().forward_prefetch(prefetch).backward_prefetch(prefetch),
                         std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
      for (int step = 0; step < 2; ++step) {  // the second step prefetches by the recorded order
        loss_of(model(d.tokens[step].narrow(0, rt.rank() * kPerRank, kPerRank)),
                d.targets[step].narrow(0, rt.rank() * kPerRank, kPerRank))
            .backward();
      }
      EXPECT_EQ(calls, 2 * 2 * 5);
      EXPECT_EQ(most, prefetch ? 2 : 1) << "prefetch " << prefetch;
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Units inside a Sequential are wrapped automatically by a type or size policy.

TEST(Engine, SequentialChildrenBecomeUnits) {
  auto make = [] {
    // Ranks are threads sharing the process-wide generator: seed and draw under one lock, or the
    // two ranks' initialisations interleave and neither equals the reference (flaky, ~1 in 3).
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    torch::manual_seed(3);
    return torch::nn::Sequential(torch::nn::Linear(33, 33), torch::nn::Tanh(),
                                 torch::nn::Linear(33, 33), torch::nn::Tanh(),
                                 torch::nn::Linear(torch::nn::LinearOptions(33, 5).bias(false)));
  };
  auto ref = make();
  const auto x = torch::randn({8, 33}, at::detail::createCPUGenerator(5));
  const auto y = torch::randint(5, {8}, at::detail::createCPUGenerator(6));
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  std::vector<State> want;
  for (int step = 0; step < 3; ++step) {
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
    ref_opt.step();
    want.push_back(snapshot(*ref));
  }
  run_ranks(2, [&](Runtime& rt) {
    auto seq = make();
    auto model = shard(seq, FSDPStrategy().auto_wrap_policy(WrapPolicy::by_type<torch::nn::LinearImpl>()),
                       std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    ASSERT_EQ(model.units().size(), 4u);  // root + 3 Linear children
    EXPECT_EQ(model.units()[1].name, "0");
    EXPECT_EQ(model.units()[3].name, "4");
    torch::optim::SGD opt(model.parameters(), 0.1);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      auto xs = x.narrow(0, rt.rank() * 4, 4), ys = y.narrow(0, rt.rank() * 4, 4);
      torch::nn::functional::cross_entropy(model(xs), ys).backward();
      opt.step();
      for (auto& p : seq->parameters()) EXPECT_EQ(storage_bytes(p), 0);
      expect_close(model.state_dict(), want[step], 1e-6, 1e-5, "sequential");
    }
  });
}

// A peer that stops answering: the failed all-gather must reach the caller of model(x) or of
// backward() as fsdp::Error. (The forward's cleanup used to wait on the same failed gather again
// inside a destructor, so the rank died by std::terminate instead; issue 9.)
void expect_gather_error(const std::function<void()>& fn, const std::string& what) {
  try {
    fn();
    ADD_FAILURE() << what << " succeeded without its peer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all_gather on the shard group [0, 1]"),
              std::string::npos)
        << what << ": " << e.what();
  }
}

std::shared_ptr<torch::nn::SequentialImpl> three_linears() {
  return torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8),
                               torch::nn::Linear(8, 2))
      .ptr();
}

TEST(Engine, FailedGatherInForwardReachesTheCaller) {
  run_ranks(
      2,
      [&](Runtime& rt) {
        auto model = shard(
            three_linears(),
            FSDPStrategy().auto_wrap_policy(WrapPolicy::by_type<torch::nn::LinearImpl>()),
            std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
        if (rt.rank() == 1) return;  // "dies": never joins rank 0's all-gathers
        const auto x = torch::randn({4, 8});
        // Twice: the first failure leaves the engine clean for the next forward.
        expect_gather_error([&] { (void)model(x); }, "forward");
        expect_gather_error([&] { (void)model(x); }, "second forward");
      },
      0, std::chrono::seconds(2));
}

// The same with frozen parameters and prefetch (issue 21): a prefetched unit then has two
// gathers pending (its frozen flat's and its own), and the forward's cleanup used to retry the
// unit once, so the second failed gather escaped ~RootForwardScope (std::terminate).
TEST(Engine, FailedGathersOfAPrefetchedUnitWithFrozenParametersReachTheCaller) {
  run_ranks(
      2,
      [&](Runtime& rt) {
        auto net = three_linears();
        for (auto& p : net->named_parameters()) {
          if (p.key().find("bias") != std::string::npos) p.value().requires_grad_(false);
        }
        auto model = shard(
            net, FSDPStrategy().auto_wrap_policy(WrapPolicy::by_type<torch::nn::LinearImpl>()),
            std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
        const auto x = torch::randn({4, 8});
        {
          torch::NoGradGuard no_grad;
          (void)model(x);  // both ranks: records the order that the next forward prefetches in
        }
        if (rt.rank() == 1) return;  // "dies"
        expect_gather_error([&] { (void)model(x); }, "forward");
        expect_gather_error([&] { (void)model(x); }, "second forward");
      },
      0, std::chrono::seconds(2));
}

TEST(Engine, FailedGatherInBackwardReachesTheCaller) {
  run_ranks(
      2,
      [&](Runtime& rt) {
        auto model = shard(
            three_linears(),
            FSDPStrategy().auto_wrap_policy(WrapPolicy::by_type<torch::nn::LinearImpl>()),
            std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
        auto loss = model(torch::randn({4, 8})).sum();  // both ranks: gathers succeed
        if (rt.rank() == 1) return;  // dies before backward
        // FULL_SHARD freed the units after forward; backward's re-gather (in an autograd hook)
        // fails, and backward() throws.
        expect_gather_error([&] { loss.backward(); }, "backward");
      },
      0, std::chrono::seconds(2));
}

TEST(Engine, MinParamsPolicyPicksLargeChildren) {
  auto seq = torch::nn::Sequential(torch::nn::Linear(33, 33), torch::nn::Linear(33, 2));
  auto units = plan_units(*seq, WrapPolicy::min_params(1000), 2);
  ASSERT_EQ(units.size(), 2u);
  EXPECT_EQ(units[1].name, "0");
  EXPECT_EQ(units[1].numel, 33 * 33 + 33);
  EXPECT_EQ(units[1].shard_numel, (33 * 33 + 33 + 1) / 2);
  EXPECT_EQ(units[0].numel, 33 * 2 + 2);
}

// ---------------------------------------------------------------------------------------------
// Errors that must be clear, never silent.

struct PlainNetImpl : torch::nn::Module {
  PlainNetImpl() { block = register_module("block", torch::nn::ModuleHolder<BlockImpl>(8)); }
  torch::Tensor forward(torch::Tensor x) { return block(x); }
  torch::nn::ModuleHolder<BlockImpl> block{nullptr};
};

TEST(Engine, PolicyNamingAnUninterceptableModuleIsAnError) {
  PlainNetImpl net;
  try {
    plan_units(net, WrapPolicy::by_type<BlockImpl>(), 2);
    FAIL() << "accepted";
  } catch (const fsdp::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("selects 'block'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("fsdp::Unit<"), std::string::npos) << msg;
  }
}

// A ShardedModule<M> owned through its base releases M (the destructor is virtual).
TEST(Engine, DeletingThroughTheBaseReleasesTheModel) {
  run_ranks(1, [&](Runtime& rt) {
    auto net = std::make_shared<NetImpl>();
    std::weak_ptr<NetImpl> weak = net;
    std::unique_ptr<ShardedModuleBase> model = std::make_unique<ShardedModule<NetImpl>>(
        shard(std::move(net), FSDPStrategy(), std::shared_ptr<Runtime>(&rt, [](Runtime*) {})));
    EXPECT_FALSE(weak.expired());
    model.reset();
    EXPECT_TRUE(weak.expired()) << "the model outlived its sharded module";
  });
}

TEST(Engine, CallingTheInnerModuleDirectlyIsAnError) {
  run_ranks(2, [&](Runtime& rt) {
    auto net = std::make_shared<NetImpl>();
    auto model = shard(net, FSDPStrategy(), std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    try {
      // A unit called on its own, outside the sharded model's forward.
      net->blocks[1](torch::zeros({1, 3, 33}));
      FAIL() << "accepted";
    } catch (const fsdp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("ran outside the sharded model's forward"),
                std::string::npos);
    }
    // The model still works afterwards.
    auto out = model(torch::zeros({1, 3}, torch::kLong));
    EXPECT_EQ(out.size(-1), kClasses);
  });
}

TEST(Engine, MismatchedConfigurationsFailOnEveryRank) {
  std::atomic<int> errors{0};
  try {
    run_ranks(2, [&](Runtime& rt) {
      try {
        shard(std::make_shared<NetImpl>(),
              FSDPStrategy().sharding_strategy(rt.rank() == 0 ? "full_shard" : "shard_grad_op"),
              std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
      } catch (const fsdp::Error& e) {
        EXPECT_NE(std::string(e.what()).find("ranks disagree on the FSDP configuration"),
                  std::string::npos);
        ++errors;
        throw;
      }
    });
  } catch (const fsdp::Error&) {
  }
  EXPECT_EQ(errors, 2);
}

// ---------------------------------------------------------------------------------------------
// State dicts: full ones reshard to another mesh; sharded ones round-trip on the same mesh.

TEST(Engine, FullStateDictMovesBetweenMeshes) {
  const Data d = make_data(4);
  torch::OrderedDict<std::string, torch::Tensor> saved;
  std::mutex mu;
  run_ranks(4, [&](Runtime& rt) {
    auto model = shard(std::make_shared<NetImpl>(),
                       FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh({2, 2}),
                       std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    torch::optim::SGD opt(model.parameters(), 0.1);
    loss_of(model(d.tokens[0].narrow(0, rt.rank() * kPerRank, kPerRank)),
            d.targets[0].narrow(0, rt.rank() * kPerRank, kPerRank)).backward();
    opt.step();
    auto sd = model.state_dict();
    std::lock_guard<std::mutex> lock(mu);
    if (rt.rank() == 0) saved = sd;
  });
  run_ranks(3, [&](Runtime& rt) {
    auto model = shard(std::make_shared<NetImpl>(), FSDPStrategy().device_mesh({3}),
                       std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    model.load_state_dict(saved);
    State want;
    for (const auto& kv : saved) want[kv.key()] = kv.value();
    expect_close(model.state_dict(), want, 0, 0, "reloaded on (3)");
  });
}

TEST(Engine, ShardedStateDictRoundTrip) {
  run_ranks(2, [&](Runtime& rt) {
    auto strategy = FSDPStrategy().state_dict_type(StateDictType::kSharded);
    auto a = shard(std::make_shared<NetImpl>(), strategy, std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    auto sd = a.state_dict();
    EXPECT_TRUE(sd.contains("block1.flat_param"));
    auto b = shard(std::make_shared<NetImpl>(), strategy.sync_module_states(false),
                   std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    b.load_state_dict(sd);
    for (const auto& kv : b.named_parameters()) {
      EXPECT_TRUE(kv.value().equal(sd[kv.key()])) << kv.key();
    }
  });
}

TEST(Engine, SummonGivesReadableParameters) {
  run_ranks(2, [&](Runtime& rt) {
    auto net = std::make_shared<NetImpl>();
    auto model = shard(net, FSDPStrategy(), std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    auto full = model.state_dict();
    {
      auto guard = model.summon_full_params();
      EXPECT_TRUE(net->blocks[1]->fc1->weight.equal(full["block1.fc1.weight"]));
      torch::NoGradGuard no_grad;
      model(torch::zeros({1, 2}, torch::kLong));  // must not free inside the guard
      EXPECT_GT(storage_bytes(net->blocks[1]->fc1->weight), 0);
    }
    EXPECT_EQ(storage_bytes(net->blocks[1]->fc1->weight), 0);
  });
}

// ---------------------------------------------------------------------------------------------
// The topology report's communication prediction equals what the groups count.

struct CommCase {
  ShardingStrategy strategy;
  std::vector<int64_t> mesh;
  GradSync sync;
  int64_t K;
  bool clip;
  bool bf16;
};

class ReportedComm : public ::testing::TestWithParam<CommCase> {};

TEST_P(ReportedComm, EqualsTheCountedBytes) {
  const CommCase c = GetParam();
  const int64_t W = world_of(c.mesh);
  const Data d = make_data(W * c.K);
  run_ranks(W, [&](Runtime& rt) {
    auto strategy = FSDPStrategy().sharding_strategy(c.strategy).device_mesh(c.mesh).grad_sync(c.sync);
    if (c.bf16) strategy.mixed_precision(MixedPrecision::bf16());
    auto model = shard(std::make_shared<NetImpl>(), strategy,
                       std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    torch::optim::SGD opt(model.parameters(), 0.1);
    auto before = model.comm_counters();
    for (int64_t k = 0; k < c.K; ++k) {
      const int64_t row = (rt.rank() * c.K + k) * kPerRank;
      auto guard = model.no_sync(/*enabled=*/k + 1 < c.K);
      loss_of(model(d.tokens[0].narrow(0, row, kPerRank)), d.targets[0].narrow(0, row, kPerRank))
          .backward();
    }
    if (c.clip) model.clip_grad_norm(1.0);
    opt.step();
    auto after = model.comm_counters();
    ReportOptions o;
    o.grad_accum = c.K;
    o.grad_sync = c.sync;
    o.clip = c.clip;
    o.param_dtype = o.reduce_dtype = c.bf16 ? torch::kBFloat16 : torch::kFloat;
    expect_comm_matches_report(before, after,
                               make_topology_report(model.plan(), W, model.units(), o));
  });
}

INSTANTIATE_TEST_SUITE_P(
    Plans, ReportedComm,
    ::testing::Values(CommCase{ShardingStrategy::kFullShard, {4}, GradSync::kEveryMicroStep, 1, true, false},
                      CommCase{ShardingStrategy::kShardGradOp, {2}, GradSync::kEveryMicroStep, 1, false, false},
                      CommCase{ShardingStrategy::kNoShard, {2}, GradSync::kLocal, 2, false, false},
                      CommCase{ShardingStrategy::kHybridShard, {2, 2}, GradSync::kEveryMicroStep, 2, true, false},
                      CommCase{ShardingStrategy::kHybridShard, {2, 2}, GradSync::kReplicateOnLast, 2, false, true},
                      CommCase{ShardingStrategy::kHybridShardZero2, {2, 2}, GradSync::kLocal, 3, false, false}),
    [](const auto& info) { return std::to_string(info.index); });

// ---------------------------------------------------------------------------------------------
// A mesh from explicit rank lists, and Adam: the same single-process result.

TEST(Engine, ExplicitRankGridMeshWithAdam) {
  const int64_t W = 4;
  auto net0 = std::make_shared<NetImpl>();
  load(*net0, initial_weights());
  torch::optim::Adam ref_opt(net0->parameters(), torch::optim::AdamOptions(1e-2));
  const Data d = make_data(W);
  std::vector<State> ref;
  for (int64_t step = 0; step < kSteps; ++step) {
    ref_opt.zero_grad();
    loss_of(net0->forward(d.tokens[step]), d.targets[step]).backward();
    ref_opt.step();
    ref.push_back(snapshot(*net0));
  }
  const State init = initial_weights();
  run_ranks(W, [&](Runtime& rt) {
    auto runtime = std::shared_ptr<Runtime>(&rt, [](Runtime*) {});
    // Shard groups {0, 2} and {1, 3}: replicas pair ranks 0-1 and 2-3.
    auto mesh = std::make_shared<DeviceMesh>(runtime, MeshLayout::from_grid({{0, 2}, {1, 3}}, W));
    auto net = std::make_shared<NetImpl>();
    load(*net, init);
    auto model = shard(net, FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh(mesh),
                       runtime);
    EXPECT_EQ(model.mesh()->group("shard")->ranks(),
              (std::vector<int64_t>{rt.rank() % 2, rt.rank() % 2 + 2}));
    torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(1e-2));
    const int64_t r = rt.rank();
    for (int64_t step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      loss_of(model(d.tokens[step].narrow(0, r * kPerRank, kPerRank)),
              d.targets[step].narrow(0, r * kPerRank, kPerRank))
          .backward();
      opt.step();
      expect_close(model.state_dict(), ref[step], atol_for(Opt::kAdamW), 1e-5,
                   "grid mesh Adam step " + std::to_string(step));
    }
  });
}
}  // namespace
