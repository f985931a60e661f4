// fsdp-train's model: a GPT-style decoder over bytes. Token and position embeddings, N pre-norm
// blocks (causal self-attention with hand-written q/k/v/out projections, libtorch 1.13 having no
// scaled_dot_product_attention; an MLP with GELU), a final LayerNorm and an LM head.
// Dropout (--dropout, default 0) on the attention and MLP outputs; with the same seed a run is
// deterministic either way (activation checkpointing replays the random draws). Each block is one
// FSDP unit (fsdp::Unit, see
// NOTE [intercepting forward] in fsdp/sharded.h); embeddings, final norm and head form the root.
#pragma once

#include <fnmatch.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "fsdp/sharded.h"
#include "options.h"

namespace fsdp_train {

// What fsdp-train trains: token ids [B, T] (int64) -> logits [B, T, vocab] over the real
// vocabulary. The byte GPT below and GPT-2 (gpt2.h) both are one; fsdp::shard takes the base.
struct LanguageModel : torch::nn::Module {
  virtual torch::Tensor forward(torch::Tensor tokens) = 0;
};


// --freeze: whether `name` matches one of `patterns` (shell globs: * ? [...]).
inline bool matches_any(const std::vector<std::string>& patterns, const std::string& name) {
  for (const auto& g : patterns) {
    if (::fnmatch(g.c_str(), name.c_str(), 0) == 0) return true;
  }
  return false;
}

// --freeze inside a block's constructor: its parameters whose full name ("<name>.<param>")
// matches a glob get requires_grad false (NOTE [deferred init]: a built unit is not touched).
inline void freeze_own(torch::nn::Module& block, const std::string& name,
                       const std::vector<std::string>& freeze) {
  for (auto& p : block.named_parameters()) {
    if (matches_any(freeze, name + "." + p.key())) p.value().requires_grad_(false);
  }
}

// GPT-2's initialisation of `module`'s own parameters (those under `skip` are left alone):
// N(0, 0.02) weights, zero biases, LayerNorm at weight 1 and bias 0, and the projections that add
// into the residual stream (out, proj) scaled by 1/sqrt(2 * layers) so its variance stays put.
inline void init_gpt2_style(torch::nn::Module& module, int64_t n_layers, const std::string& skip = "") {
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * n_layers);
  for (auto& p : module.named_parameters()) {
    const std::string& name = p.key();
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (!skip.empty() && name.compare(0, skip.size(), skip) == 0) continue;
    if (name.find("ln") != std::string::npos) continue;  // LayerNorm: weight 1, bias 0
    if (ends_with(".bias")) {
      p.value().zero_();
    } else if (ends_with("out.weight") || ends_with("proj.weight")) {
      p.value().normal_(0.0, residual_std);
    } else {
      p.value().normal_(0.0, 0.02);
    }
  }
}

// One block. It initialises (and, for --freeze, freezes) its own parameters in its constructor,
// as deferred construction needs (NOTE [deferred init] in fsdp/deferred_init.h): `name` is its
// path in the model ("block3"), for the globs.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const ModelPreset& c, const std::string& name = "",
                     const std::vector<std::string>& freeze = {})
      : n_heads(c.n_heads), dropout(c.dropout) {
    const int64_t d = c.d_model;
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    q = register_module("q", torch::nn::Linear(d, d));
    k = register_module("k", torch::nn::Linear(d, d));
    v = register_module("v", torch::nn::Linear(d, d));
    out = register_module("out", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc = register_module("fc", torch::nn::Linear(d, 4 * d));
    proj = register_module("proj", torch::nn::Linear(4 * d, d));
    init_gpt2_style(*this, c.n_layers);
    freeze_own(*this, name, freeze);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = x + drop(attention(ln1(x)));
    return x + drop(proj(torch::gelu(fc(ln2(x)))));
  }

  torch::Tensor drop(const torch::Tensor& t) {
    return dropout > 0 ? torch::dropout(t, dropout, is_training()) : t;
  }

  // Causal multi-head self-attention: softmax(q k^T / sqrt(dh) + causal mask) v.
  torch::Tensor attention(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), dh = C / n_heads;
    auto heads = [&](const torch::Tensor& t) {
      return t.view({B, T, n_heads, dh}).transpose(1, 2);  // [B, H, T, dh]
    };
    auto qh = heads(q(x)), kh = heads(k(x)), vh = heads(v(x));
    auto scores = torch::matmul(qh, kh.transpose(-2, -1)) * (1.0 / std::sqrt(double(dh)));
    auto future =
        torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    auto y = torch::matmul(torch::softmax(scores, -1), vh);  // [B, H, T, dh]
    return out(y.transpose(1, 2).contiguous().view({B, T, C}));
  }

  int64_t n_heads;
  double dropout;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, out{nullptr}, fc{nullptr}, proj{nullptr};
};

// bytes [B, T] (int64) -> logits [B, T, 256]
// `freeze`: --freeze's globs, applied by each block to itself (the root's parameters are frozen
// by freeze_parameters after construction).
struct GPTImpl : LanguageModel {
  explicit GPTImpl(const ModelPreset& c, const std::vector<std::string>& freeze = {}) {
    tok = register_module("tok_emb", torch::nn::Embedding(kVocab, c.d_model));
    pos = register_module("pos_emb", torch::nn::Embedding(c.context, c.d_model));
    for (int64_t i = 0; i < c.n_layers; ++i) {
      const std::string name = "block" + std::to_string(i);
      blocks.push_back(register_module(name, fsdp::Unit<BlockImpl>(c, name, freeze)));
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    head = register_module(
        "head", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, kVocab).bias(false)));
    init_gpt2_style(*this, c.n_layers, /*skip=*/"block");  // the blocks did their own
  }

  torch::Tensor forward(torch::Tensor tokens) override {
    const int64_t T = tokens.size(1);
    auto positions =
        torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(tokens.device()));
    auto x = tok(tokens) + pos(positions);
    for (auto& b : blocks) x = b(x);
    return head(ln_f(x));
  }

  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  std::vector<fsdp::Unit<BlockImpl>> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
};

// --freeze: every parameter whose name matches one of `patterns` gets requires_grad false before
// sharding (NOTE [frozen parameters] in fsdp/sharded.h); the blocks' own are false already.
// Returns the number of parameters (elements) frozen.
inline int64_t freeze_parameters(torch::nn::Module& model, const std::vector<std::string>& patterns) {
  int64_t frozen = 0;
  for (auto& p : model.named_parameters()) {
    if (!matches_any(patterns, p.key())) continue;
    p.value().requires_grad_(false);
    frozen += p.value().numel();
  }
  return frozen;
}

}  // namespace fsdp_train
