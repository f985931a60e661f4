// Frozen and trainable parameters in one unit (NOTE [frozen parameters]): a LoRA-style model
// (frozen base Linear + trainable low-rank adapters inside the units, a frozen embedding next to a
// trainable head in the root, one unit frozen whole) on every strategy and several meshes, ranks
// as threads, against one process training the global batch; frozen parameters stay
// bit-identical; memory and communication follow the trainable parameters; checkpoints carry
// both; bad input fails on every rank.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <mutex>
#include <set>

#include "engine/engine.h"
#include "fsdp/checkpoint.h"
#include "fsdp/error.h"
#include "fsdp/report.h"
#include "fsdp/sharded.h"
#include "models.h"
#include "testing.h"

using namespace fsdp;
using namespace fsdp::testing;

namespace {

constexpr int64_t kSteps = 4, kRows = 12, kSeq = 5, kVocab = 17, kClasses = 7;
using State = std::map<std::string, torch::Tensor>;

std::shared_ptr<Runtime> borrow(Runtime& rt) { return {&rt, [](Runtime*) {}}; }

State snapshot(torch::nn::Module& m) {
  State s;
  for (const auto& p : m.named_parameters()) s[p.key()] = p.value().detach().clone();
  return s;
}

// The model every run starts from (same weights everywhere), frozen per LoRANetImpl::freeze.
std::shared_ptr<LoRANetImpl> make_net() {
  static std::mutex mu;
  static State init;
  std::lock_guard<std::mutex> lock(mu);
  if (init.empty()) {
    torch::manual_seed(11);
    init = snapshot(*std::make_shared<LoRANetImpl>());
  }
  auto net = std::make_shared<LoRANetImpl>();
  torch::NoGradGuard g;
  for (auto& p : net->named_parameters()) p.value().copy_(init.at(p.key()));
  net->freeze();
  return net;
}

std::vector<torch::Tensor> trainable(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

std::unique_ptr<torch::optim::Optimizer> adamw(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::AdamW>(params,
                                               torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

// bf16 runs use SGD: AdamW's normalized update turns bf16 rounding of near-zero gradient
// elements into full-size steps of either sign, which no useful bound separates from a bug.
std::unique_ptr<torch::optim::Optimizer> optimizer_for(bool sgd, std::vector<torch::Tensor> params) {
  if (sgd) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1));
  return adamw(std::move(params));
}

struct Data {
  torch::Tensor tokens, targets;  // [kSteps, kRows, kSeq]: the global batch of every step
};

Data make_data() {
  torch::Generator gen = at::detail::createCPUGenerator(99);
  return {torch::randint(kVocab, {kSteps, kRows, kSeq}, gen),
          torch::randint(kClasses, {kSteps, kRows, kSeq}, gen)};
}

// One process on the whole global batch, the trainable parameters in the optimizer.
std::vector<State> reference(bool sgd) {
  auto net = make_net();
  auto opt = optimizer_for(sgd, trainable(*net));
  const Data d = make_data();
  std::vector<State> states;
  for (int64_t step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    loss_of(net->forward(d.tokens[step]), d.targets[step]).backward();
    opt->step();
    states.push_back(snapshot(*net));
  }
  return states;
}

// Trainable parameters within tolerance of `want`; frozen ones bit-identical to `init`.
void expect_matches(const torch::OrderedDict<std::string, torch::Tensor>& got, const State& want,
                    const State& init, const std::set<std::string>& frozen, double atol,
                    double rtol, const std::string& where) {
  for (const auto& [name, b] : want) {
    const torch::Tensor* a = got.find(name);
    ASSERT_NE(a, nullptr) << where << ": missing " << name;
    if (frozen.count(name)) {
      EXPECT_TRUE(torch::equal(*a, init.at(name))) << where << ": frozen " << name << " changed";
      continue;
    }
    auto diff = (*a - b).abs();
    if ((diff > atol + rtol * b.abs()).any().item<bool>()) {
      ADD_FAILURE() << where << ": parameter " << name << " differs: max abs "
                    << diff.max().item<double>() << " (bound " << atol << " + " << rtol << "|b|)";
    }
  }
}

std::set<std::string> frozen_names() {
  std::set<std::string> out;
  for (const auto& p : make_net()->named_parameters()) {
    if (!p.value().requires_grad()) out.insert(p.key());
  }
  return out;
}

struct Case {
  std::string strategy;
  std::vector<int64_t> mesh;
  bool recompute = false;  // activation checkpointing of every unit
  int64_t accum = 1;       // micro-steps per step (no_sync on all but the last)
  bool bf16 = false;
};

std::string name_of(const Case& c) {
  std::string s = c.strategy;
  for (auto v : c.mesh) s += "_" + std::to_string(v);
  if (c.recompute) s += "_recompute";
  if (c.accum > 1) s += "_accum" + std::to_string(c.accum);
  if (c.bf16) s += "_bf16";
  return s;
}

void PrintTo(const Case& c, std::ostream* os) { *os << name_of(c); }

int64_t world_of(const std::vector<int64_t>& mesh) {
  int64_t w = 1;
  for (auto v : mesh) w *= v;
  return w;
}

FSDPStrategy strategy_of(const Case& c) {
  auto s = FSDPStrategy().sharding_strategy(c.strategy).device_mesh(c.mesh);
  if (c.recompute) s.activation_checkpointing(CheckpointPolicy::all_units());
  if (c.bf16) s.mixed_precision(MixedPrecision::bf16());
  return s;
}

class FrozenEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(FrozenEquivalence, MatchesSingleProcessAndKeepsFrozenWeights) {
  const Case c = GetParam();
  const int64_t W = world_of(c.mesh);
  ASSERT_EQ(kRows % (W * c.accum), 0);
  const int64_t rows = kRows / (W * c.accum);
  static const auto ref_adamw = reference(false), ref_sgd = reference(true);
  const auto& ref = c.bf16 ? ref_sgd : ref_adamw;
  const Data d = make_data();
  const State init = snapshot(*make_net());
  const auto frozen = frozen_names();
  run_ranks(W, [&](Runtime& rt) {
    auto model = shard(make_net(), strategy_of(c), borrow(rt));
    auto opt = optimizer_for(c.bf16, model.parameters());
    for (int64_t step = 0; step < kSteps; ++step) {
      opt->zero_grad();
      for (int64_t k = 0; k < c.accum; ++k) {
        const int64_t row = (rt.rank() * c.accum + k) * rows;
        auto guard = model.no_sync(/*enabled=*/k + 1 < c.accum);
        auto loss = loss_of(model(d.tokens[step].narrow(0, row, rows)),
                            d.targets[step].narrow(0, row, rows));
        (loss / static_cast<double>(c.accum)).backward();
      }
      opt->step();
      // bf16: see MixedPrecisionBf16TracksFp32 in test_engine.cpp for the bound.
      expect_matches(model.state_dict(), ref[step], init, frozen, c.bf16 ? 4e-3 : 2e-5,
                     c.bf16 ? 2e-2 : 1e-5,
                     name_of(c) + " rank " + std::to_string(rt.rank()) + " step " +
                         std::to_string(step));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    AllStrategies, FrozenEquivalence,
    ::testing::Values(Case{"full_shard", {1}}, Case{"full_shard", {2}}, Case{"full_shard", {3}},
                      Case{"full_shard", {4}}, Case{"shard_grad_op", {2}},
                      Case{"shard_grad_op", {3}}, Case{"no_shard", {2}}, Case{"no_shard", {4}},
                      Case{"hybrid_shard", {2, 2}}, Case{"hybrid_shard", {1, 3}},
                      Case{"hybrid_shard", {3, 1}}, Case{"hybrid_shard", {2, 1}},
                      Case{"hybrid_shard_zero2", {2, 2}}, Case{"hybrid_shard_zero2", {1, 2}},
                      Case{"full_shard", {3}, true}, Case{"hybrid_shard", {2, 2}, true},
                      Case{"hybrid_shard", {2, 2}, false, 3},
                      Case{"hybrid_shard_zero2", {1, 2}, true, 2},
                      Case{"full_shard", {2}, false, 1, true}),
    [](const auto& info) { return name_of(info.param); });

int64_t sum_of(const std::vector<UnitInfo>& units, int64_t UnitInfo::*field) {
  int64_t n = 0;
  for (const auto& u : units) n += u.*field;
  return n;
}

// Gradient shards, optimizer state and gradient bytes follow the trainable parameters only, and
// the topology report equals the counted bytes.
TEST(Frozen, MemoryAndCommunicationFollowTheTrainableParameters) {
  for (auto mesh : std::vector<std::vector<int64_t>>{{4}, {2, 2}}) {
    const int64_t W = world_of(mesh);
    const Data d = make_data();
    run_ranks(W, [&](Runtime& rt) {
      auto model = shard(make_net(), FSDPStrategy().sharding_strategy(mesh.size() == 1
                                                                           ? "full_shard"
                                                                           : "hybrid_shard")
                                         .device_mesh(mesh),
                         borrow(rt));
      const auto& units = model.units();
      const int64_t trainable_shard = sum_of(units, &UnitInfo::shard_numel);
      const int64_t frozen_shard = sum_of(units, &UnitInfo::frozen_shard_numel);
      ASSERT_GT(frozen_shard, trainable_shard);  // the point of the model: mostly frozen
      EXPECT_EQ(model.trainable_numel(), sum_of(units, &UnitInfo::numel));
      EXPECT_EQ(model.total_numel(), model.trainable_numel() + sum_of(units, &UnitInfo::frozen_numel));
      auto params = model.parameters();
      int64_t given = 0;
      for (const auto& p : params) given += p.numel();
      EXPECT_EQ(given, trainable_shard);
      torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
      const int64_t rows = kRows / W;
      auto before = model.comm_counters();
      loss_of(model(d.tokens[0].narrow(0, rt.rank() * rows, rows)),
              d.targets[0].narrow(0, rt.rank() * rows, rows))
          .backward();
      model.clip_grad_norm(1.0);
      opt.step();
      auto after = model.comm_counters();
      const auto m = model.memory_stats(&opt);
      EXPECT_EQ(m.param_shard_bytes, 4 * (trainable_shard + frozen_shard));
      EXPECT_EQ(m.grad_shard_bytes, 4 * trainable_shard);
      EXPECT_EQ(m.optimizer_state_bytes, 2 * 4 * trainable_shard);
      ReportOptions o;
      o.clip = true;
      const auto report = make_topology_report(model.plan(), W, units, o);
      expect_comm_matches_report(before, after, report);
      EXPECT_EQ(report.comm.shard_reduce_scatter, 4 * sum_of(units, &UnitInfo::padded_numel));
      EXPECT_GT(report.comm.frozen_all_gather, 0);
      EXPECT_EQ(report.trainable_params, model.trainable_numel());
      EXPECT_EQ(report.sharded.grads, 4 * trainable_shard);
      EXPECT_EQ(report.sharded.params, 4 * (trainable_shard + frozen_shard));
      const std::string text = report.to_text();
      EXPECT_NE(text.find("trainable"), std::string::npos) << text;
      EXPECT_NE(text.find("frozen"), std::string::npos) << text;
      auto json = nlohmann::json::parse(report.to_json());
      EXPECT_EQ(json["trainable_params"].get<int64_t>(), model.trainable_numel());
      EXPECT_EQ(json["units"][1]["frozen_params"].get<int64_t>(), units[1].frozen_numel);
    });
  }
}

// A frozen flat is freed in backward once its unit's input gradient exists, not at the end of
// backward: when the gradient reaches the embedding output, every block's frozen part is sharded.
TEST(Frozen, FrozenParametersAreFreedDuringBackward) {
  const Data d = make_data();
  run_ranks(2, [&](Runtime& rt) {
    auto net = make_net();
    auto model = shard(net, FSDPStrategy().sharding_strategy("full_shard"), borrow(rt));
    auto engine = fsdp::detail::engine_of(model);
    int64_t seen = 0, gathered_at_probe = -1;
    // pos is added to the embedding: its gradient is complete only after every block's backward
    // (and after the engine's hook on block0's input).
    net->pos.register_hook([&](const torch::Tensor&) {
      gathered_at_probe = 0;
      for (const auto& u : engine->unit_states()) {
        if (u->owner && u->owner->index > 0) {
          ++seen;
          gathered_at_probe += u->phase != fsdp::detail::Phase::kSharded ? 1 : 0;
        }
      }
    });
    loss_of(model(d.tokens[0].narrow(0, rt.rank() * 6, 6)),
            d.targets[0].narrow(0, rt.rank() * 6, 6))
        .backward();
    EXPECT_EQ(seen, 3);  // block0 (frozen whole), block1, block2
    EXPECT_EQ(gathered_at_probe, 0) << "frozen flats still gathered when backward left the blocks";
  });
}

TEST(Frozen, ChangingRequiresGradAfterShardIsAnError) {
  run_ranks(2, [&](Runtime& rt) {
    auto net = make_net();
    auto model = shard(net, FSDPStrategy().sharding_strategy("full_shard"), borrow(rt));
    auto tokens = torch::zeros({1, kSeq}, torch::kLong);
    (void)model(tokens);
    net->blocks[1]->q->lora_a.requires_grad_(false);
    try {
      (void)model(tokens);
      ADD_FAILURE() << "freezing after shard() was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'block1.q.lora_a' has requires_grad false but was "
                                           "trainable"), std::string::npos) << e.what();
    }
    net->blocks[1]->q->lora_a.requires_grad_(true);
    net->emb->weight.requires_grad_(true);
    try {
      (void)model(tokens);
      ADD_FAILURE() << "unfreezing after shard() was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'emb.weight' has requires_grad true but was frozen"),
                std::string::npos) << e.what();
    }
  });
}

TEST(Frozen, AModelWithNothingToTrainIsAnError) {
  run_ranks(2, [&](Runtime& rt) {
    auto net = make_net();
    for (auto& p : net->parameters()) p.requires_grad_(false);
    try {
      shard(net, FSDPStrategy(), borrow(rt));
      ADD_FAILURE() << "a model without trainable parameters was sharded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("no trainable parameter"), std::string::npos) << e.what();
    }
  });
}

TEST(Frozen, AnOptimizerOverFrozenOrInnerTensorsIsAnError) {
  run_ranks(2, [&](Runtime& rt) {
    auto net = make_net();
    auto model = shard(net, FSDPStrategy().sharding_strategy("full_shard"), borrow(rt));
    torch::optim::SGD inner(net->parameters(), 0.1);
    try {
      model.check_optimizer(inner);
      ADD_FAILURE() << "an optimizer over the inner module's parameters was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("inner module's parameter 'pos'"),
                std::string::npos) << e.what();
    }
    at::Tensor frozen_shard;
    for (const auto& u : fsdp::detail::engine_of(model)->unit_states()) {
      if (u->owner && u->name == "block1") frozen_shard = u->shard;
    }
    ASSERT_TRUE(frozen_shard.defined());
    torch::optim::SGD with_frozen({frozen_shard}, 0.1);
    EXPECT_THROW(
        {
          try {
            save_checkpoint("/nonexistent-never-written", model, &with_frozen);
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("frozen parameters of unit 'block1'"),
                      std::string::npos) << e.what();
            throw;
          }
        },
        Error);
    torch::optim::SGD good(model.parameters(), 0.1);
    EXPECT_NO_THROW(model.check_optimizer(good));
  });
}

std::set<std::string> safetensors_names(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  std::set<std::string> names;
  const auto json = nlohmann::json::parse(header);
  for (const auto& kv : json.items()) {
    if (kv.key() != "__metadata__") names.insert(kv.key());
  }
  return names;
}

// A checkpoint saved on (2, 2) HYBRID_SHARD resumes on 3-way FULL_SHARD: frozen parameters come
// back with the trainable ones and the optimizer state; the run ends where one run would.
// Full exports hold both; trainable_only exports the adapters and the root's trainable ones.
TEST(Frozen, CheckpointsCarryFrozenParametersAcrossMeshes) {
  TempDir dir;
  const Data d = make_data();
  auto train = [&](ShardedModule<LoRANetImpl>& model, torch::optim::Optimizer& opt, Runtime& rt,
                   int64_t from, int64_t to) {
    const int64_t rows = kRows / rt.world_size();
    for (int64_t step = from; step < to; ++step) {
      opt.zero_grad();
      loss_of(model(d.tokens[step].narrow(0, rt.rank() * rows, rows)),
              d.targets[step].narrow(0, rt.rank() * rows, rows))
          .backward();
      opt.step();
    }
  };
  torch::OrderedDict<std::string, torch::Tensor> straight;
  run_ranks(4, [&](Runtime& rt) {
    auto model = shard(make_net(), FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh({2, 2}),
                       borrow(rt));
    auto opt = adamw(model.parameters());
    train(model, *opt, rt, 0, 2);
    save_checkpoint(dir / "ckpt", model, opt.get());
    export_full_checkpoint(model, dir / "full.safetensors");
    ExportOptions adapters;
    adapters.trainable_only = true;
    export_full_checkpoint(model, dir / "adapters.safetensors", adapters);
    train(model, *opt, rt, 2, kSteps);
    auto sd = model.state_dict();
    if (rt.rank() == 0) straight = sd;
  });
  const State init = snapshot(*make_net());
  const auto frozen = frozen_names();
  auto all = safetensors_names(dir / "full.safetensors");
  auto adapter_names = safetensors_names(dir / "adapters.safetensors");
  for (const auto& [name, t] : init) {
    EXPECT_TRUE(all.count(name)) << name << " missing from the full export";
    EXPECT_EQ(adapter_names.count(name), frozen.count(name) ? 0u : 1u) << name;
  }
  run_ranks(3, [&](Runtime& rt) {
    auto model = shard(make_net(), FSDPStrategy().sharding_strategy("full_shard"), borrow(rt));
    auto opt = adamw(model.parameters());
    load_checkpoint(dir / "ckpt", model, opt.get());
    train(model, *opt, rt, 2, kSteps);
    State want;
    for (const auto& kv : straight) want[kv.key()] = kv.value();
    expect_matches(model.state_dict(), want, init, frozen, 2e-5, 1e-5,
                   "resumed on 3 ranks, rank " + std::to_string(rt.rank()));
  });
}

}  // namespace
