// Deferred construction (NOTE [deferred init]): a model built under fsdp::DeferredInit is
// bit-identical to the same model built eagerly and sharded, on every mesh, before and after
// training; construction never holds more than the root, one unit and the shards; and every way
// it could silently go wrong is an error on every rank.
#include <gtest/gtest.h>
#include <malloc.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "fsdp/checkpoint.h"
#include "fsdp/memory.h"
#include "fsdp/deferred_init.h"
#include "fsdp/error.h"
#include "fsdp/report.h"
#include "fsdp/sharded.h"
#include "testing.h"

namespace fsdp::testing {
namespace {

// libtorch's default generator is process-wide and the ranks are threads: a rank builds its
// model (seed + constructors) holding this lock.
std::mutex& rng_mutex() {
  static std::mutex mu;
  return mu;
}

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(int64_t d) {
    up = register_module("up", torch::nn::Linear(d, 2 * d));
    down = register_module("down", torch::nn::Linear(2 * d, d));
  }
  torch::Tensor forward(torch::Tensor x) { return down(torch::gelu(up(x))); }
  torch::nn::Linear up{nullptr}, down{nullptr};
};

struct Options {
  bool frozen = false;   // each block's `ln` is frozen in the block's constructor
  bool nested = false;   // each block holds an inner unit (fsdp::Unit<MlpImpl>)
};

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, const Options& o) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc = register_module("fc", torch::nn::Linear(d, d));
    // Initialised here, in the unit's own constructor (as deferred init requires).
    torch::NoGradGuard no_grad;
    fc->weight.normal_(0.0, 0.05);
    scale = register_buffer("scale", torch::full({d}, 0.5));
    if (o.nested) mlp = register_module("mlp", fsdp::Unit<MlpImpl>(d));
    if (o.frozen) {
      for (auto& p : ln->parameters()) p.requires_grad_(false);
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::tanh(fc(ln(x))) * scale.to(x.scalar_type());  // bf16 compute too
    if (!mlp.is_empty()) h = h + mlp(h);
    return x + h;
  }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc{nullptr};
  fsdp::Unit<MlpImpl> mlp{nullptr};
  torch::Tensor scale;
};

constexpr int64_t kVocab = 19, kDim = 21, kBlocks = 3, kSeq = 4;

// tokens [B, T] -> logits [B, T, vocab], the head tied to the embedding (both in the root).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(const Options& o = {}) {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    for (int64_t i = 0; i < kBlocks; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), fsdp::Unit<BlockImpl>(kDim, o)));
    }
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    head = register_parameter("head_weight", emb->weight);  // tied: one tensor, two names
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto x = emb(tokens);
    for (auto& b : blocks) x = b(x);
    return torch::nn::functional::linear(norm(x), head);
  }
  torch::nn::Embedding emb{nullptr};
  std::vector<fsdp::Unit<BlockImpl>> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::Tensor head;
};

std::shared_ptr<Runtime> borrow(Runtime& rt) { return std::shared_ptr<Runtime>(&rt, [](Runtime*) {}); }

std::shared_ptr<NetImpl> build_seeded(uint64_t seed, const Options& o) {
  std::lock_guard<std::mutex> lock(rng_mutex());
  torch::manual_seed(seed);
  return std::make_shared<NetImpl>(o);
}

// Every entry's bytes equal, named on failure.
void expect_bit_identical(const torch::OrderedDict<std::string, at::Tensor>& a,
                          const torch::OrderedDict<std::string, at::Tensor>& b,
                          const std::string& where) {
  ASSERT_EQ(a.size(), b.size()) << where;
  for (const auto& item : a) {
    const at::Tensor* other = b.find(item.key());
    ASSERT_NE(other, nullptr) << where << ": " << item.key() << " missing";
    at::Tensor x = item.value().contiguous(), y = other->contiguous();
    ASSERT_EQ(x.sizes(), y.sizes()) << where << ": " << item.key();
    ASSERT_EQ(x.scalar_type(), y.scalar_type()) << where << ": " << item.key();
    EXPECT_EQ(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()), 0)
        << where << ": " << item.key() << " differs (max |diff| "
        << (x.to(at::kDouble) - y.to(at::kDouble)).abs().max().item<double>() << ")";
  }
}

struct Case {
  std::string name;
  std::string strategy;
  std::vector<int64_t> mesh;
  Options model;
  bool checkpoint = false;
  bool bf16 = false;
};

FSDPStrategy strategy_of(const Case& c) {
  FSDPStrategy s;
  s.sharding_strategy(c.strategy).device_mesh(c.mesh);
  if (c.checkpoint) s.activation_checkpointing(CheckpointPolicy::all_units());
  if (c.bf16) s.mixed_precision(MixedPrecision::bf16());
  return s;
}

int64_t world_of(const std::vector<int64_t>& mesh) {
  int64_t w = 1;
  for (int64_t d : mesh) w *= d;
  return w;
}

class BitIdentical : public ::testing::TestWithParam<Case> {};

// The same seed, built eagerly then sharded, and built under DeferredInit: byte-equal state
// dicts, then byte-equal after three AdamW steps on the same batches.
TEST_P(BitIdentical, DeferredEqualsEager) {
  const Case c = GetParam();
  const int64_t W = world_of(c.mesh);
  torch::Generator gen = at::detail::createCPUGenerator(99);
  const at::Tensor tokens = torch::randint(kVocab, {3, W * 2, kSeq}, gen);
  run_ranks(W, [&](Runtime& rt) {
    const auto strategy = strategy_of(c);
    auto eager = shard(build_seeded(5, c.model), strategy, borrow(rt));
    DeferredInit init(strategy, borrow(rt));
    auto built = build_seeded(5, c.model);
    EXPECT_EQ(init.stats().units, kBlocks * (c.model.nested ? 2 : 1));
    auto deferred = shard(built, init);
    const std::string where = c.name + " rank " + std::to_string(rt.rank());
    expect_bit_identical(eager.state_dict(), deferred.state_dict(), where + " after shard");
    torch::optim::AdamW opt_e(eager.parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt_d(deferred.parameters(), torch::optim::AdamWOptions(1e-2));
    for (int64_t step = 0; step < 3; ++step) {
      auto x = tokens[step].narrow(0, rt.rank() * 2, 2);
      for (auto* m : {&eager, &deferred}) {
        auto& opt = m == &eager ? opt_e : opt_d;
        opt.zero_grad();
        auto logits = (*m)(x);
        torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}).to(at::kFloat),
                                             x.reshape({-1}))
            .backward();
        opt.step();
      }
    }
    expect_bit_identical(eager.state_dict(), deferred.state_dict(), where + " after 3 steps");
  });
}

std::vector<Case> cases() {
  return {
      {"one_process", "full_shard", {1}, {}},
      {"full_shard_4", "full_shard", {4}, {}},
      {"full_shard_3_uneven", "full_shard", {3}, {}},
      {"hybrid_2x2", "hybrid_shard", {2, 2}, {}},
      {"no_shard_2", "no_shard", {2}, {}},
      {"shard_grad_op_2", "shard_grad_op", {2}, {}},
      {"frozen_in_unit_2x2", "hybrid_shard", {2, 2}, {/*frozen=*/true}},
      {"nested_units_3", "full_shard", {3}, {false, /*nested=*/true}},
      {"activation_checkpointing_4", "full_shard", {4}, {}, /*checkpoint=*/true},
      {"bf16_2", "full_shard", {2}, {}, false, /*bf16=*/true},
  };
}

INSTANTIATE_TEST_SUITE_P(Meshes, BitIdentical, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------
// Memory: 16 units of 16 MiB. Each rank builds holding the RNG lock, so no other rank allocates
// meanwhile; the blocks' constructors sample the process's anonymous resident memory (the
// units' values and the shards live in mappings of their own, outside malloc: NOTE [deferred
// heap], NOTE [mapped shards]). Deferred, it never exceeds one unit + the shards so far + a
// small margin; eager it would reach the whole 256 MiB model.

std::atomic<int64_t> g_heap_base{0}, g_heap_peak{0};

int64_t heap_in_use() { return fsdp::process_memory().rss_anon; }

struct BigBlockImpl : torch::nn::Module {
  explicit BigBlockImpl(int64_t d) {
    fc = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)));
    const int64_t live = heap_in_use() - g_heap_base.load();
    int64_t peak = g_heap_peak.load();
    while (live > peak && !g_heap_peak.compare_exchange_weak(peak, live)) {
    }
  }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};

struct BigNetImpl : torch::nn::Module {
  BigNetImpl(int64_t d, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      blocks.push_back(register_module("b" + std::to_string(i), fsdp::Unit<BigBlockImpl>(d)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = b(x);
    return x;
  }
  std::vector<fsdp::Unit<BigBlockImpl>> blocks;
};

TEST(DeferredInitMemory, NeverHoldsMoreThanOneUnitPlusShards) {
  if (fsdp::testing::kSanitized) {
    GTEST_SKIP() << "the probe reads mallinfo2, which a sanitizer's allocator leaves at zero";
  }
  constexpr int64_t W = 4, kD = 2048, kUnits = 16;
  constexpr int64_t unit_bytes = kD * kD * 4;  // 16 MiB
  constexpr int64_t shard_bytes = kUnits * unit_bytes / W;
  constexpr int64_t margin = 4 << 20;
  std::vector<int64_t> peaks(W);
  run_ranks(W, [&](Runtime& rt) {
    DeferredInit init(FSDPStrategy().sharding_strategy("full_shard"), borrow(rt));
    std::shared_ptr<BigNetImpl> net;
    {
      std::lock_guard<std::mutex> lock(rng_mutex());
      g_heap_base = heap_in_use();
      g_heap_peak = 0;
      torch::manual_seed(1);
      net = std::make_shared<BigNetImpl>(kD, kUnits);
      peaks[rt.rank()] = g_heap_peak.load();
    }
    EXPECT_EQ(init.stats().largest_unit_bytes, unit_bytes);
    EXPECT_EQ(init.stats().shard_bytes, shard_bytes);
    auto model = shard(net, init);
    EXPECT_EQ(model.memory_stats().param_shard_bytes, shard_bytes);
  });
  for (int64_t r = 0; r < W; ++r) {
    // The sample in unit k's constructor sees unit k whole and the k earlier shards.
    EXPECT_LE(peaks[r], unit_bytes + shard_bytes + margin)
        << "rank " << r << ": construction held " << peaks[r] / (1 << 20) << " MiB; the whole "
        << "model is " << kUnits * unit_bytes / (1 << 20) << " MiB";
    EXPECT_GE(peaks[r], unit_bytes) << "the probe saw no unit being built";
  }
}

// ---------------------------------------------------------------------------------------------
// Errors: each one on every rank, before any collective, naming the parameter.

// Runs `build` under DeferredInit on 2 ranks and expects fsdp::shard to throw `expected` on both.
void expect_shard_error(const std::function<std::shared_ptr<NetImpl>()>& build,
                        const std::string& expected, const FSDPStrategy& strategy = FSDPStrategy()) {
  expect_every_rank_fails(2, [&](Runtime& rt) {
    DeferredInit init(strategy, borrow(rt));
    std::shared_ptr<NetImpl> net;
    {
      std::lock_guard<std::mutex> lock(rng_mutex());
      torch::manual_seed(3);
      net = build();
    }
    shard(net, init);
  }, expected);
}

TEST(DeferredInitErrors, ParentReinitialisesAUnitInPlace) {
  expect_shard_error(
      [] {
        auto net = std::make_shared<NetImpl>();
        torch::NoGradGuard no_grad;
        net->blocks[1]->fc->weight.mul_(2.0);  // a parent's "scaled re-initialisation"
        return net;
      },
      "parameter 'block1.fc.weight' was modified in place after its unit was built");
}

TEST(DeferredInitErrors, ParentWritesThroughData) {
  expect_shard_error(
      [] {
        auto net = std::make_shared<NetImpl>();
        net->blocks[2]->fc->bias.data().fill_(1.0);  // .data() has a version counter of its own
        return net;
      },
      "parameter 'block2.fc.bias' was written after its unit was built");
}

TEST(DeferredInitErrors, ParentReplacesAUnitsData) {
  expect_shard_error(
      [] {
        auto net = std::make_shared<NetImpl>();
        net->blocks[0]->fc->weight.set_data(torch::zeros({kDim, kDim}));
        return net;
      },
      "parameter 'block0.fc.weight' got new data after its unit was built");
}

TEST(DeferredInitErrors, RequiresGradChangedAfterBuild) {
  expect_shard_error(
      [] {
        auto net = std::make_shared<NetImpl>();
        net->blocks[0]->ln->weight.requires_grad_(false);
        return net;
      },
      "requires_grad of parameter 'block0.ln.weight' changed to false");
}

TEST(DeferredInitErrors, PolicyLeavesAUnitOut) {
  expect_shard_error([] { return std::make_shared<NetImpl>(); },
                     "unit 'block0' (", FSDPStrategy().auto_wrap_policy(WrapPolicy::min_params(1 << 20)));
}

TEST(DeferredInitErrors, RanksBuiltDifferentValues) {
  std::atomic<int> errors{0};
  run_ranks(2, [&](Runtime& rt) {
    DeferredInit init(FSDPStrategy(), borrow(rt));
    std::shared_ptr<NetImpl> net;
    {
      std::lock_guard<std::mutex> lock(rng_mutex());
      torch::manual_seed(100 + rt.rank());  // a rank-dependent seed
      net = std::make_shared<NetImpl>();
    }
    try {
      shard(net, init);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("ranks built different values for unit 'block0'"),
                std::string::npos)
          << e.what();
      ++errors;
    }
  });
  EXPECT_EQ(errors.load(), 2);
}

TEST(DeferredInitErrors, ForwardBeforeShard) {
  run_ranks(1, [&](Runtime& rt) {
    DeferredInit init(FSDPStrategy(), borrow(rt));
    auto net = std::make_shared<NetImpl>();
    EXPECT_THROW(net->forward(torch::zeros({1, kSeq}, torch::kLong)), Error);
  });
}

TEST(DeferredInitErrors, OneScopePerThread) {
  run_ranks(1, [&](Runtime& rt) {
    DeferredInit first(FSDPStrategy(), borrow(rt));
    EXPECT_THROW(DeferredInit second(FSDPStrategy(), borrow(rt)), Error);
    first.finish();
    DeferredInit third(FSDPStrategy(), borrow(rt));  // fine once the first finished
    EXPECT_TRUE(third.active());
  });
}

// Built after finish(): eager, plain modules (units are only sharded inside the scope).
TEST(DeferredInit, UnitsBuiltOutsideTheScopeAreEager) {
  run_ranks(1, [&](Runtime& rt) {
    DeferredInit init(FSDPStrategy(), borrow(rt));
    init.finish();
    auto net = std::make_shared<NetImpl>();
    EXPECT_EQ(init.stats().units, 0);
    EXPECT_NO_THROW(net->forward(torch::zeros({1, kSeq}, torch::kLong)));
  });
}

// Pretrained weights into a deferred model: a .safetensors file is read as this rank's byte
// ranges and loads; a .pt file (read whole on every rank) is refused, saying to convert it.
TEST(DeferredInit, ImportsSafetensorsAndRefusesPt) {
  TempDir dir;
  run_ranks(2, [&](Runtime& rt) {
    auto source = shard(build_seeded(11, {}), FSDPStrategy(), borrow(rt));
    export_full_checkpoint(source, dir.file("w.safetensors"));
    export_full_checkpoint(source, dir.file("w.pt"));
    DeferredInit init(FSDPStrategy().sharding_strategy("hybrid_shard").device_mesh({1, 2}),
                      borrow(rt));
    auto model = shard(build_seeded(12, {}), init);
    import_full_checkpoint(model, dir.file("w.safetensors"));
    expect_bit_identical(source.state_dict(), model.state_dict(), "imported");
    try {
      import_full_checkpoint(model, dir.file("w.pt"));
      ADD_FAILURE() << "a .pt import into a deferred model was not refused";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("convert it to .safetensors"), std::string::npos)
          << e.what();
    }
  });
}

// A Sequential child the policy makes a unit cannot shard itself as it is built: the report
// says so, with its size.
struct SeqNetImpl : torch::nn::Module {
  SeqNetImpl() {
    block = register_module("block", fsdp::Unit<BlockImpl>(kDim, Options{}));
    seq = register_module("seq", torch::nn::Sequential(torch::nn::Linear(kDim, kDim)));
  }
  torch::Tensor forward(torch::Tensor x) { return seq->forward(block(x)); }
  fsdp::Unit<BlockImpl> block{nullptr};
  torch::nn::Sequential seq{nullptr};
};

TEST(DeferredInit, ReportSaysWhichUnitsWereBuiltWhole) {
  run_ranks(2, [&](Runtime& rt) {
    DeferredInit init(FSDPStrategy().auto_wrap_policy(WrapPolicy::min_params(1)), borrow(rt));
    std::shared_ptr<SeqNetImpl> net;
    {
      std::lock_guard<std::mutex> lock(rng_mutex());
      torch::manual_seed(4);
      net = std::make_shared<SeqNetImpl>();
    }
    auto model = shard(net, init);
    std::map<std::string, std::string> built;
    for (const auto& u : model.units()) built[u.name] = u.construction;
    EXPECT_EQ(built[""], "built whole");
    EXPECT_EQ(built["block"], "deferred");
    EXPECT_EQ(built["seq.0"], "built whole");
    const std::string text = make_topology_report(model.plan(), 2, model.units()).to_text();
    EXPECT_NE(text.find("built whole (" + format_bytes(double(kDim * kDim + kDim) * 4)), std::string::npos)
        << text;
    auto y = model(torch::randn({2, kDim}));
    EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, kDim}));
  });
}

}  // namespace
}  // namespace fsdp::testing
