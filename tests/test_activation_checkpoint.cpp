// Activation checkpointing: fsdp::checkpoint on its own (gradients equal a plain backward, RNG
// replay, errors), and per unit under sharding: every strategy x mesh, several-argument units
// with tuple outputs, Sequential children, bf16, no_sync accumulation, all with the same
// parameters as the run without checkpointing; one all-gather per unit per backward, as without;
// clear errors for policies that select what cannot be checkpointed.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <mutex>

#include <unistd.h>

#include "fsdp/activation_checkpoint.h"
#include "fsdp/error.h"
#include "fsdp/sharded.h"
#include "models.h"
#include "testing.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

constexpr int64_t kPerRank = 2, kSeq = 5, kVocab = 17, kClasses = 7, kD = 33;

using State = std::map<std::string, torch::Tensor>;

std::shared_ptr<Runtime> borrow(Runtime& rt) { return std::shared_ptr<Runtime>(&rt, [](Runtime*) {}); }

// Bound: 1e-9 + 1e-6|b| (relative 1e-6; the absolute part only for exact zeros).
void expect_same(const torch::OrderedDict<std::string, torch::Tensor>& got,
                 const torch::OrderedDict<std::string, torch::Tensor>& want, const std::string& where) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (const auto& kv : want) {
    const torch::Tensor* a = got.find(kv.key());
    ASSERT_NE(a, nullptr) << where << ": missing " << kv.key();
    const auto b = kv.value().to(torch::kFloat);
    auto diff = (a->to(torch::kFloat) - b).abs();
    if ((diff > 1e-9 + 1e-6 * b.abs()).any().item<bool>()) {
      ADD_FAILURE() << where << ": " << kv.key() << " differs with checkpointing: max abs "
                    << diff.max().item<double>() << ", max rel "
                    << (diff / (b.abs() + 1e-12)).max().item<double>();
      return;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// fsdp::checkpoint without sharding.

struct Grads {
  std::vector<torch::Tensor> tensors;  // inputs', then parameters' gradients
};

TEST(Checkpoint, SameGradientsAsPlainBackwardWithSeveralInputsAndTupleOutputs) {
  torch::manual_seed(1);
  torch::nn::Linear lin(6, 6);
  const auto x0 = torch::randn({3, 6}), g0 = torch::randn({3, 6});
  int calls = 0;
  auto fn = [&](const torch::Tensor& x, torch::Tensor gate, double scale, int64_t dim) {
    ++calls;
    auto h = torch::tanh(lin(x)) * torch::sigmoid(gate);
    return std::make_tuple(x + scale * h, h.sum(dim), int64_t{42});
  };
  auto run = [&](bool ckpt) {
    lin->zero_grad();
    auto x = x0.clone().requires_grad_(true), g = g0.clone().requires_grad_(true);
    std::tuple<torch::Tensor, torch::Tensor, int64_t> out =
        ckpt ? fsdp::checkpoint(fn, x, g, 0.5, int64_t{1}) : fn(x, g, 0.5, 1);
    EXPECT_EQ(std::get<2>(out), 42);
    (std::get<0>(out).pow(2).sum() + std::get<1>(out).sum() * 3).backward();
    return Grads{{x.grad(), g.grad(), lin->weight.grad().clone(), lin->bias.grad().clone()}};
  };
  const Grads plain = run(false);
  calls = 0;
  const Grads ckpt = run(true);
  EXPECT_EQ(calls, 2) << "forward once, recomputed once in backward";
  for (size_t i = 0; i < plain.tensors.size(); ++i) {
    ASSERT_TRUE(ckpt.tensors[i].defined()) << i;
    EXPECT_TRUE(ckpt.tensors[i].allclose(plain.tensors[i], 1e-6, 1e-9)) << "gradient " << i;
  }
}

TEST(Checkpoint, KeepsNoActivationsOfTheFunction) {
  torch::manual_seed(2);
  torch::nn::Linear lin(4, 4);
  auto x = torch::randn({2, 4}, torch::requires_grad());
  auto y = fsdp::checkpoint([&](const torch::Tensor& t) { return torch::tanh(lin(t)); }, x);
  ASSERT_TRUE(y.requires_grad());
  // The output's node is the checkpoint itself, whose only edge leads to x: no tanh or addmm
  // node (nor the tensors they save) was recorded.
  const auto fn = y.grad_fn();
  ASSERT_TRUE(fn);
  EXPECT_NE(fn->name().find("CheckpointFunction"), std::string::npos) << fn->name();
  EXPECT_EQ(fn->num_inputs(), 1u);
  ASSERT_EQ(fn->next_edges().size(), 1u);
  EXPECT_EQ(fn->next_edges()[0].function, x.grad_fn() ? x.grad_fn()
                                                       : torch::autograd::impl::grad_accumulator(x));
}

TEST(Checkpoint, ParametersGetGradientsWhenNoInputRequiresGrad) {
  torch::manual_seed(3);
  torch::nn::Linear lin(4, 2);
  const auto x = torch::randn({5, 4});  // data: no grad
  fsdp::checkpoint([&](const torch::Tensor& t) { return lin(t); }, x).sum().backward();
  const auto w_ckpt = lin->weight.grad().clone();
  lin->zero_grad();
  lin(x).sum().backward();
  EXPECT_TRUE(w_ckpt.allclose(lin->weight.grad()));
  EXPECT_GT(w_ckpt.abs().sum().item<double>(), 0);
}

TEST(Checkpoint, DropoutRecomputesWithTheSameMask) {
  torch::manual_seed(4);
  torch::nn::Linear lin(16, 16);
  const auto x0 = torch::randn({8, 16});
  auto fn = [&](const torch::Tensor& t) { return torch::dropout(torch::relu(lin(t)), 0.5, true); };
  auto run = [&](int mode, double* next_draw) {  // 0 plain, 1 checkpoint, 2 without RNG replay
    lin->zero_grad();
    torch::manual_seed(99);
    auto x = x0.clone().requires_grad_(true);
    ActivationCheckpointOptions o;
    o.preserve_rng_state = mode != 2;
    auto y = mode == 0 ? fn(x) : fsdp::checkpoint(o, fn, x);
    torch::randn({1});  // the caller draws between forward and backward
    y.pow(2).sum().backward();
    *next_draw = torch::rand({1}).item<double>();
    return std::make_pair(x.grad(), lin->weight.grad().clone());
  };
  double next_plain = 0, next_ckpt = 0, next_off = 0;
  const auto plain = run(0, &next_plain);
  const auto ckpt = run(1, &next_ckpt);
  const auto off = run(2, &next_off);
  EXPECT_TRUE(ckpt.first.allclose(plain.first, 1e-6, 1e-9));
  EXPECT_TRUE(ckpt.second.allclose(plain.second, 1e-6, 1e-9));
  EXPECT_EQ(next_ckpt, next_plain) << "the recomputation must leave the caller's random stream as "
                                      "a plain backward does";
  // Proof the test can fail: without the replay the recomputation draws another mask.
  EXPECT_FALSE(off.second.allclose(plain.second, 1e-6, 1e-9));
}

TEST(Checkpoint, InputModifiedInPlaceBeforeBackwardIsAnError) {
  torch::nn::Linear lin(3, 3);
  auto x = torch::randn({2, 3}, torch::requires_grad());
  auto h = x * 2;
  auto y = fsdp::checkpoint([&](const torch::Tensor& t) { return lin(t); }, h);
  {
    torch::NoGradGuard g;
    h.add_(1);
  }
  try {
    y.sum().backward();
    FAIL() << "accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("modified by an inplace operation"), std::string::npos)
        << e.what();
  }
}

TEST(Checkpoint, OutputWithoutGradIsAnError) {
  auto x = torch::randn({2, 3}, torch::requires_grad());
  ActivationCheckpointOptions o;
  o.name = "my block";
  auto y = fsdp::checkpoint(o, [](const torch::Tensor& t) { return t.detach() * 2; }, x);
  try {
    y.sum().backward();
    FAIL() << "accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("my block: the recomputed forward returned no tensor that "
                                         "requires grad"),
              std::string::npos)
        << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Models for the sharded tests.

// A unit with two tensor arguments and a number, returning a tuple; optional dropout.
struct PairBlockImpl : torch::nn::Module {
  explicit PairBlockImpl(int64_t d) {
    a = register_module("a", torch::nn::Linear(d, d));
    b = register_module("b", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, const torch::Tensor& gate,
                                                   double scale) {
    ++calls;
    auto h = torch::tanh(a(ln(x))) * torch::sigmoid(gate);
    if (dropout > 0) h = torch::dropout(h, dropout, is_training());
    return {x + scale * b(h), gate + h.mean(-1, /*keepdim=*/true)};
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  double dropout = 0;
  int64_t calls = 0;
};

struct PairNetImpl : torch::nn::Module {
  explicit PairNetImpl(double dropout = 0) {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kD));
    gate_emb = register_module("gate_emb", torch::nn::Embedding(kVocab, kD));
    for (int i = 0; i < 3; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), fsdp::Unit<PairBlockImpl>(kD)));
      blocks.back()->dropout = dropout;
    }
    head = register_module("head", torch::nn::Linear(kD, kClasses));
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto x = emb(tokens), gate = gate_emb(tokens);
    for (auto& blk : blocks) std::tie(x, gate) = blk(x, gate, 0.5);
    return head(x + gate);
  }
  int64_t calls() const {
    int64_t n = 0;
    for (const auto& blk : blocks) n += blk->calls;
    return n;
  }
  torch::nn::Embedding emb{nullptr}, gate_emb{nullptr};
  std::vector<fsdp::Unit<PairBlockImpl>> blocks;
  torch::nn::Linear head{nullptr};
};

enum class Model { kNet, kPairNet, kSequential };

const char* name_of(Model m) {
  return m == Model::kNet ? "Net" : m == Model::kPairNet ? "PairNet" : "Sequential";
}

std::shared_ptr<torch::nn::Module> make_model(Model m, uint64_t seed, double dropout = 0) {
  static std::mutex mu;  // the default generator is process-wide: one model at a time
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(seed);
  switch (m) {
    case Model::kNet: return std::make_shared<NetImpl>();
    case Model::kPairNet: return std::make_shared<PairNetImpl>(dropout);
    case Model::kSequential:
      return torch::nn::Sequential(torch::nn::Embedding(kVocab, kD), torch::nn::Linear(kD, kD),
                                   torch::nn::Tanh(), torch::nn::Linear(kD, kD), torch::nn::Tanh(),
                                   torch::nn::Linear(kD, kClasses))
          .ptr();
  }
  return nullptr;
}

// A sharded model of any of the kinds, called on tokens.
// `base` is a shared_ptr made from the derived type, so it destroys a ShardedModule<M> (and
// releases its model): ShardedModuleBase's destructor is not virtual.
struct Sharded {
  std::shared_ptr<ShardedModuleBase> base;
  std::function<torch::Tensor(const torch::Tensor&)> call;
};

template <class M>
Sharded shard_as(std::shared_ptr<torch::nn::Module> module, const FSDPStrategy& s, Runtime& rt) {
  auto typed = std::make_shared<ShardedModule<M>>(std::dynamic_pointer_cast<M>(module), s, borrow(rt));
  auto* raw = typed.get();
  return {std::move(typed), [raw](const torch::Tensor& t) { return raw->forward(t); }};
}

Sharded make_sharded(Model m, std::shared_ptr<torch::nn::Module> module, FSDPStrategy s, Runtime& rt) {
  switch (m) {
    case Model::kNet: return shard_as<NetImpl>(module, s, rt);
    case Model::kPairNet: return shard_as<PairNetImpl>(module, s, rt);
    case Model::kSequential:
      return shard_as<torch::nn::SequentialImpl>(
          module, s.auto_wrap_policy(WrapPolicy::by_type<torch::nn::LinearImpl>()), rt);
  }
  return {};
}

struct Data {
  torch::Tensor tokens, targets;  // [steps, rows, kSeq]
};

Data make_data(int64_t steps, int64_t rows) {
  torch::Generator gen = at::detail::createCPUGenerator(1234);
  Data d;
  d.tokens = torch::randint(kVocab, {steps, rows, kSeq}, gen);
  d.targets = torch::randint(kClasses, {steps, rows, kSeq}, gen);
  return d;
}

struct Case {
  Model model = Model::kNet;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  std::vector<int64_t> mesh{1};
  bool bf16 = false;
  GradSync sync = GradSync::kEveryMicroStep;
  int64_t K = 1;  // micro-steps per optimizer step (no_sync on all but the last)
};

std::string name_of(const Case& c) {
  std::string s = std::string(name_of(c.model)) + "_" + to_string(c.strategy);
  for (auto v : c.mesh) s += "_" + std::to_string(v);
  if (c.bf16) s += "_bf16";
  if (c.K > 1) s += std::string("_accum") + std::to_string(c.K) + "_" + to_string(c.sync);
  return s;
}

int64_t world_of(const std::vector<int64_t>& mesh) {
  int64_t w = 1;
  for (auto v : mesh) w *= v;
  return w;
}

class Equivalence : public ::testing::TestWithParam<Case> {};

// Trains the model with and without checkpointing side by side (same ranks, same data, SGD with
// momentum) and compares every parameter after every step.
TEST_P(Equivalence, SameParametersAsWithoutCheckpointing) {
  const Case c = GetParam();
  const int64_t W = world_of(c.mesh), steps = 3;
  const Data d = make_data(steps, W * c.K * kPerRank);
  run_ranks(W, [&](Runtime& rt) {
    auto strategy = FSDPStrategy().sharding_strategy(c.strategy).device_mesh(c.mesh).grad_sync(c.sync);
    if (c.bf16) strategy.mixed_precision(MixedPrecision::bf16());
    auto plain = make_sharded(c.model, make_model(c.model, 7), strategy, rt);
    auto ckpt = make_sharded(c.model, make_model(c.model, 7),
                             strategy.activation_checkpointing(CheckpointPolicy::all_units()), rt);
    torch::optim::SGD opt_plain(plain.base->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD opt_ckpt(ckpt.base->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int64_t step = 0; step < steps; ++step) {
      opt_plain.zero_grad();
      opt_ckpt.zero_grad();
      for (int64_t k = 0; k < c.K; ++k) {
        const int64_t row = (rt.rank() * c.K + k) * kPerRank;
        auto x = d.tokens[step].narrow(0, row, kPerRank);
        auto y = d.targets[step].narrow(0, row, kPerRank);
        for (auto* m : {&plain, &ckpt}) {
          auto guard = m->base->no_sync(/*enabled=*/k + 1 < c.K);
          (loss_of(m->call(x), y) / static_cast<double>(c.K)).backward();
        }
      }
      opt_plain.step();
      opt_ckpt.step();
      expect_same(ckpt.base->state_dict(), plain.base->state_dict(),
                  name_of(c) + " rank " + std::to_string(rt.rank()) + " step " + std::to_string(step));
      EXPECT_EQ(ckpt.base->memory_stats().unsharded_now_bytes, 0)
          << "gathered parameters outlived the step";
    }
  });
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  // Every strategy x mesh of the engine's equivalence tests.
  for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                 ShardingStrategy::kNoShard}) {
    for (int64_t w : {1, 2, 4, 8}) cases.push_back({Model::kNet, s, {w}});
  }
  for (auto s : {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
    for (auto mesh : std::vector<std::vector<int64_t>>{
             {1, 1}, {1, 2}, {2, 1}, {1, 4}, {2, 2}, {4, 1}, {2, 4}}) {
      cases.push_back({Model::kNet, s, mesh});
    }
  }
  // Several tensor arguments and tuple outputs; Sequential children.
  for (auto m : {Model::kPairNet, Model::kSequential}) {
    cases.push_back({m, ShardingStrategy::kFullShard, {2}});
    cases.push_back({m, ShardingStrategy::kHybridShard, {2, 2}});
    cases.push_back({m, ShardingStrategy::kShardGradOp, {3}});
  }
  // bf16 mixed precision.
  for (auto m : {Model::kNet, Model::kPairNet}) {
    cases.push_back({m, ShardingStrategy::kFullShard, {4}, true});
    cases.push_back({m, ShardingStrategy::kHybridShard, {2, 2}, true});
  }
  // Gradient accumulation with no_sync, every GradSync mode.
  for (auto m : {Model::kNet, Model::kPairNet}) {
    cases.push_back({m, ShardingStrategy::kFullShard, {2}, false, GradSync::kEveryMicroStep, 2});
    cases.push_back({m, ShardingStrategy::kFullShard, {2}, false, GradSync::kLocal, 2});
    cases.push_back({m, ShardingStrategy::kHybridShard, {2, 2}, false, GradSync::kReplicateOnLast, 2});
  }
  cases.push_back({Model::kPairNet, ShardingStrategy::kHybridShard, {2, 2}, true, GradSync::kLocal, 3});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(All, Equivalence, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return name_of(info.param); });

// ---------------------------------------------------------------------------------------------
// What checkpointing costs under sharding: one recomputation, no extra communication.

TEST(ShardedCheckpoint, RecomputesOnceAndGathersNoMoreThanWithout) {
  const Data d = make_data(2, 2 * kPerRank);
  run_ranks(2, [&](Runtime& rt) {
    std::vector<CommCounters> gathered;
    std::vector<int64_t> calls;
    for (bool on : {false, true}) {
      auto net = std::dynamic_pointer_cast<PairNetImpl>(make_model(Model::kPairNet, 5));
      auto s = FSDPStrategy();
      if (on) s.activation_checkpointing(CheckpointPolicy::by_type<PairBlockImpl>());
      auto model = shard(net, s, borrow(rt));
      const auto before = model.comm_counters()[0].second;
      for (int64_t step = 0; step < 2; ++step) {
        loss_of(model(d.tokens[step].narrow(0, rt.rank() * kPerRank, kPerRank)),
                d.targets[step].narrow(0, rt.rank() * kPerRank, kPerRank))
            .backward();
        // FULL_SHARD: every unit freed again after its (recomputed) backward.
        for (auto& p : net->parameters()) EXPECT_EQ(p.storage().nbytes(), 0u) << "on=" << on;
      }
      gathered.push_back(model.comm_counters()[0].second - before);
      calls.push_back(net->calls());
    }
    EXPECT_EQ(gathered[1].all_gather_bytes, gathered[0].all_gather_bytes)
        << "checkpointing must reuse the pre-backward gather";
    EXPECT_GT(gathered[0].all_gather_bytes, 0);
    EXPECT_EQ(gathered[1].reduce_scatter_bytes, gathered[0].reduce_scatter_bytes);
    EXPECT_EQ(calls[0], 2 * 3);      // 2 steps x 3 blocks
    EXPECT_EQ(calls[1], 2 * 3 * 2);  // ... and each recomputed once
  });
}

// Dropout inside checkpointed units: the recomputation draws the same masks, so training matches
// the run without checkpointing. One rank: ranks as threads share the process-wide generator.
TEST(ShardedCheckpoint, DropoutUnitsMatchTheRunWithoutCheckpointing) {
  const Data d = make_data(3, kPerRank);
  for (bool bf16 : {false, true}) {
    run_ranks(1, [&](Runtime& rt) {
      std::vector<torch::OrderedDict<std::string, torch::Tensor>> after;
      for (bool on : {false, true}) {
        auto s = FSDPStrategy();
        if (bf16) s.mixed_precision(MixedPrecision::bf16());
        if (on) s.activation_checkpointing(CheckpointPolicy::all_units());
        auto net = std::dynamic_pointer_cast<PairNetImpl>(make_model(Model::kPairNet, 11, 0.3));
        auto model = shard(net, s, borrow(rt));
        torch::optim::SGD opt(model.parameters(), 0.1);
        torch::manual_seed(123);
        for (int64_t step = 0; step < 3; ++step) {
          opt.zero_grad();
          loss_of(model(d.tokens[step]), d.targets[step]).backward();
          opt.step();
        }
        after.push_back(model.state_dict());
      }
      expect_same(after[1], after[0], bf16 ? "dropout bf16" : "dropout fp32");
      // The masks matter: a third run with other draws ends elsewhere.
      auto net = std::dynamic_pointer_cast<PairNetImpl>(make_model(Model::kPairNet, 11, 0.3));
      auto s = FSDPStrategy().activation_checkpointing(CheckpointPolicy::all_units());
      if (bf16) s.mixed_precision(MixedPrecision::bf16());
      auto model = shard(net, s, borrow(rt));
      torch::optim::SGD opt(model.parameters(), 0.1);
      torch::manual_seed(321);
      for (int64_t step = 0; step < 3; ++step) {
        opt.zero_grad();
        loss_of(model(d.tokens[step]), d.targets[step]).backward();
        opt.step();
      }
      auto other = model.state_dict();
      EXPECT_FALSE(other["block0.a.weight"].equal(after[0]["block0.a.weight"]));
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Errors: one line at shard() time or at the first forward, naming the module.

struct PlainNetImpl : torch::nn::Module {
  PlainNetImpl() {
    block = register_module("block", torch::nn::ModuleHolder<BlockImpl>(8));
    unit = register_module("unit", fsdp::Unit<BlockImpl>(8));
  }
  torch::Tensor forward(torch::Tensor x) { return unit(block(x)); }
  torch::nn::ModuleHolder<BlockImpl> block{nullptr};
  fsdp::Unit<BlockImpl> unit{nullptr};
};

std::string shard_error(std::shared_ptr<torch::nn::Module> net, const FSDPStrategy& s) {
  std::string msg;
  run_ranks(1, [&](Runtime& rt) {
    try {
      ShardedModule<torch::nn::Module> model(net, s, borrow(rt));
    } catch (const fsdp::Error& e) {
      msg = e.what();
    }
  });
  return msg;
}

TEST(ShardedCheckpoint, PolicySelectingANonUnitIsAnError) {
  const std::string msg = shard_error(
      std::make_shared<PlainNetImpl>(),
      FSDPStrategy().activation_checkpointing(CheckpointPolicy::by_type<BlockImpl>()));
  EXPECT_NE(msg.find("selects 'block'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not an fsdp unit"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  // The root module is not a unit either.
  const std::string root = shard_error(
      std::make_shared<NetImpl>(),
      FSDPStrategy().activation_checkpointing(CheckpointPolicy::by_type<NetImpl>()));
  EXPECT_NE(root.find("selects '(root)'"), std::string::npos) << root;
}

struct OuterImpl : torch::nn::Module {
  OuterImpl() {
    inner = register_module("inner", fsdp::Unit<BlockImpl>(8));
    fc = register_module("fc", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(torch::Tensor x) { return fc(inner(x)); }
  fsdp::Unit<BlockImpl> inner{nullptr};
  torch::nn::Linear fc{nullptr};
};
struct NestedNetImpl : torch::nn::Module {
  NestedNetImpl() { outer = register_module("outer", fsdp::Unit<OuterImpl>()); }
  torch::Tensor forward(torch::Tensor x) { return outer(x); }
  fsdp::Unit<OuterImpl> outer{nullptr};
};

TEST(ShardedCheckpoint, UnitContainingUnitsIsAnError) {
  const std::string msg =
      shard_error(std::make_shared<NestedNetImpl>(),
                  FSDPStrategy().activation_checkpointing(CheckpointPolicy::by_type<OuterImpl>()));
  EXPECT_NE(msg.find("selects unit 'outer', which contains unit 'outer.inner'"), std::string::npos)
      << msg;
  // Checkpointing the inner unit alone is fine.
  EXPECT_EQ(shard_error(std::make_shared<NestedNetImpl>(),
                        FSDPStrategy().activation_checkpointing(CheckpointPolicy::by_type<BlockImpl>())),
            "");
}

struct DetachingBlockImpl : torch::nn::Module {
  DetachingBlockImpl() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x).detach(); }
  torch::nn::Linear fc{nullptr};
};
struct DetachingNetImpl : torch::nn::Module {
  DetachingNetImpl() {
    fc = register_module("fc", torch::nn::Linear(4, 4));
    blk = register_module("blk", fsdp::Unit<DetachingBlockImpl>());
  }
  torch::Tensor forward(torch::Tensor x) { return blk(fc(x)); }
  torch::nn::Linear fc{nullptr};
  fsdp::Unit<DetachingBlockImpl> blk{nullptr};
};

TEST(ShardedCheckpoint, UnitReturningNoGradTensorFailsAtFirstForward) {
  run_ranks(1, [&](Runtime& rt) {
    auto model = shard(std::make_shared<DetachingNetImpl>(),
                       FSDPStrategy().activation_checkpointing(CheckpointPolicy::all_units()),
                       borrow(rt));
    try {
      model(torch::randn({2, 4}));
      FAIL() << "accepted";
    } catch (const fsdp::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("activation-checkpointed unit 'blk' returned no tensor that requires grad"),
                std::string::npos)
          << msg;
    }
  });
}

// ---------------------------------------------------------------------------------------------
// fsdp-train end to end, ranks as processes (each with its own generator): dropout with and
// without --activation-checkpointing gives the same losses.

std::vector<double> losses_in(const std::string& path) {
  std::vector<double> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("\"loss\":");
    if (at != std::string::npos) out.push_back(std::stod(line.substr(at + 7)));
  }
  return out;
}

TEST(TrainCheckpoint, DropoutLossesMatchWithAndWithoutCheckpointing) {
  const std::string train = tool_dir() + "/fsdp-train";
  if (::access(train.c_str(), X_OK) != 0) GTEST_SKIP() << train << " is not built";
  char tmpl[] = "/tmp/fsdp-test-ac-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  std::vector<std::vector<double>> losses;
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {"--dropout", "0.2"}, {"--dropout", "0.2", "--activation-checkpointing"}, {}}) {
    const std::string metrics = dir + "/m" + std::to_string(losses.size()) + ".jsonl";
    std::vector<std::string> argv{train, "--devices", "2", "--model", "tiny", "--steps", "4",
                                  "--global-batch", "4", "--seq-len", "32", "--seed", "7",
                                  "--quiet", "--metrics", metrics};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto r = run(argv, {}, std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code(), 0) << r.output;
    const bool on = extra.size() == 3;
    EXPECT_NE(r.output.find(on ? "checkpointed: every block recomputes" : "kept for backward"),
              std::string::npos)
        << r.output;
    losses.push_back(losses_in(metrics));
    ASSERT_EQ(losses.back().size(), 4u) << metrics;
  }
  (void)!std::system(("rm -rf '" + dir + "'").c_str());
  EXPECT_EQ(losses[1], losses[0]) << "dropout recomputed with other masks";
  EXPECT_NE(losses[2], losses[0]) << "--dropout 0.2 changed nothing";
  const auto bad = run({train, "--dropout", "1.5"}, {}, std::chrono::seconds(60));
  EXPECT_EQ(bad.exit_code(), 2);
  EXPECT_NE(bad.output.find("--dropout 1.5 is invalid"), std::string::npos) << bad.output;
}

}  // namespace
