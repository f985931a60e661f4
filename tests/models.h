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

// LoRA-style fine-tuning (NOTE [frozen parameters]): a frozen base Linear plus a trainable
// low-rank B·A added to its output.
struct LoRALinearImpl : torch::nn::Module {
  LoRALinearImpl(int64_t in, int64_t out, int64_t rank) {
    base = register_module("base", torch::nn::Linear(in, out));
    lora_a = register_parameter("lora_a", torch::randn({rank, in}) * 0.2);
    lora_b = register_parameter("lora_b", torch::randn({out, rank}) * 0.2);
  }
  torch::Tensor forward(torch::Tensor x) {
    namespace F = torch::nn::functional;
    return base(x) + F::linear(F::linear(x, lora_a), lora_b);
  }
  torch::nn::Linear base{nullptr};
  torch::Tensor lora_a, lora_b;
};
TORCH_MODULE(LoRALinear);

struct LoRABlockImpl : torch::nn::Module {
  explicit LoRABlockImpl(int64_t d, int64_t rank = 3) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    q = register_module("q", LoRALinear(d, d, rank));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(d, d).bias(false)));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::tanh(q(ln(x)))); }
  torch::nn::LayerNorm ln{nullptr};
  LoRALinear q{nullptr};
  torch::nn::Linear fc2{nullptr};
};

// tokens [B, T] -> logits [B, T, classes]. freeze() leaves trainable: the adapters of every block
// but the first, the positional table, the final norm and the head; so the root and the blocks
// mix frozen and trainable parameters, block0 is frozen whole, and block0's input requires grad.
struct LoRANetImpl : torch::nn::Module {
  LoRANetImpl(int64_t vocab = 17, int64_t d = 33, int64_t blocks = 3, int64_t classes = 7,
              int64_t seq = 5) {
    emb = register_module("emb", torch::nn::Embedding(vocab, d));
    pos = register_parameter("pos", torch::randn({seq, d}) * 0.1);
    for (int64_t i = 0; i < blocks; ++i) {
      this->blocks.push_back(register_module("block" + std::to_string(i), fsdp::Unit<LoRABlockImpl>(d)));
    }
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(d, classes).bias(false)));
  }
  void freeze() {
    for (auto& p : named_parameters()) {
      const std::string& n = p.key();
      const bool adapter = n.find("lora_") != std::string::npos && n.rfind("block0.", 0) != 0;
      const bool root_trainable = n == "pos" || n.rfind("norm.", 0) == 0 || n.rfind("head.", 0) == 0;
      p.value().requires_grad_(adapter || root_trainable);
    }
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto x = emb(tokens) + pos.narrow(0, 0, tokens.size(1));
    for (auto& b : blocks) x = b(x);
    return head(norm(x));
  }
  torch::nn::Embedding emb{nullptr};
  torch::Tensor pos;
  std::vector<fsdp::Unit<LoRABlockImpl>> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};

inline torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat).reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

}  // namespace fsdp::testing
