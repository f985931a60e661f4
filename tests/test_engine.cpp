// The engine against single-process training: every strategy on every mesh of up to 8 ranks
// (ranks as threads over Gloo), SGD and AdamW, 5 steps, every parameter compared after every
// step with one process training the concatenated global batch.
#include <gtest/gtest.h>

#include <mutex>

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
      for (int64_t w : {1, 2, 4, 8}) cases.push_back({s, {w}, o});
    }
    for (auto s : {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
      for (auto mesh : std::vector<std::vector<int64_t>>{
               {1, 1}, {1, 2}, {2, 1}, {1, 4}, {2, 2}, {4, 1}, {2, 4}}) {
        cases.push_back({s, mesh, o});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, Equivalence, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return name_of(info.param); });

}  // namespace
