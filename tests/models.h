// Small models for the engine tests: uneven sizes (33-wide), an embedding, layer norms, a
// bias-free layer, and two kinds of units (fsdp::Unit<M> members and Sequential children).
#pragma once

#include <torch/torch.h>

#include "fsdp/sharded.h"

namespace fsdp::testing {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, d));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::tanh(fc1(ln(x)))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// tokens [B, T] -> logits [B, T, classes]
struct NetImpl : torch::nn::Module {
  NetImpl(int64_t vocab = 17, int64_t d = 33, int64_t blocks = 3, int64_t classes = 7) {
    emb = register_module("emb", torch::nn::Embedding(vocab, d));
    for (int64_t i = 0; i < blocks; ++i) {
      this->blocks.push_back(register_module("block" + std::to_string(i), fsdp::Unit<BlockImpl>(d)));
    }
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(d, classes).bias(false)));
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto x = emb(tokens);
    for (auto& b : blocks) x = b(x);
    return head(norm(x));
  }
  torch::nn::Embedding emb{nullptr};
  std::vector<fsdp::Unit<BlockImpl>> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};

inline torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat).reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

}  // namespace fsdp::testing
