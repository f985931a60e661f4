// fsdp-train's GPT-2 (--model gpt2, and the same family at any --layers/--d-model/--heads), built
// as GPT-2 and llm.c build it: learned position embeddings, pre-LayerNorm blocks (eps 1e-5) with
// fused qkv, causal self-attention and an MLP of width 4C with the tanh approximation of GELU, a
// final LayerNorm, and the LM head tied to the token embedding wte. wte has padded_vocab rows
// (50304 for GPT-2's 50257, as llm.c pads it); the rows past the real vocabulary start at zero
// and stay zero: the logits are cut to the real vocabulary before the loss, so those rows get no
// gradient (and weight decay of zero is zero). Init: N(0, 0.02) weights and embeddings, zero
// biases, LayerNorm 1/0, and the two projections that add into the residual stream (attn_proj,
// fc_proj) N(0, 0.02 / sqrt(2 L)) (GPT-2's paper, llm.c's train_gpt2.py).
//
// Every module initialises its own parameters in its own constructor: a block is an fsdp::Unit
// and nothing touches its parameters after it is built (deferred construction shards a unit as
// soon as it exists). wte, wpe and ln_f are the root unit's, so the tied head is in it too.
// Parameter names are the table of NOTE [llm.c model file] in llmc.h.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "fsdp/sharded.h"
#include "gpt.h"
#include "options.h"

namespace fsdp_train {

struct GPT2BlockImpl : torch::nn::Module {
  // `name` ("block3") and `freeze` (--freeze's globs): the block freezes its own parameters.
  explicit GPT2BlockImpl(const ModelPreset& c, const std::string& name = "",
                         const std::vector<std::string>& freeze = {})
      : n_heads(c.n_heads), dropout(c.dropout) {
    const int64_t C = c.d_model;
    auto norm = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({C}).eps(1e-5)); };
    ln1 = register_module("ln1", norm());
    qkv = register_module("qkv", torch::nn::Linear(C, 3 * C));
    attn_proj = register_module("attn_proj", torch::nn::Linear(C, C));
    ln2 = register_module("ln2", norm());
    fc = register_module("fc", torch::nn::Linear(C, 4 * C));
    fc_proj = register_module("fc_proj", torch::nn::Linear(4 * C, C));
    torch::NoGradGuard no_grad;
    const double residual_std = 0.02 / std::sqrt(2.0 * double(c.n_layers));
    for (auto* l : {&qkv, &attn_proj, &fc, &fc_proj}) {
      const bool residual = l == &attn_proj || l == &fc_proj;
      (*l)->weight.normal_(0.0, residual ? residual_std : 0.02);
      (*l)->bias.zero_();
    }
    freeze_own(*this, name, freeze);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = x + drop(attention(ln1(x)));
    return x + drop(fc_proj(torch::gelu(fc(ln2(x)), "tanh")));
  }

  torch::Tensor drop(const torch::Tensor& t) {
    return dropout > 0 ? torch::dropout(t, dropout, is_training()) : t;
  }

  // softmax(q k^T / sqrt(dh) + causal mask) v over n_heads heads, q k v from one (3C, C) matmul.
  torch::Tensor attention(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), dh = C / n_heads;
    auto parts = qkv(x).split(C, /*dim=*/-1);
    auto heads = [&](const torch::Tensor& t) {
      return t.reshape({B, T, n_heads, dh}).transpose(1, 2);  // [B, H, T, dh]
    };
    auto q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
    auto scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(dh)));
    auto future =
        torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    auto y = torch::matmul(torch::softmax(scores, -1), v);  // [B, H, T, dh]
    return attn_proj(y.transpose(1, 2).reshape({B, T, C}));
  }

  int64_t n_heads;
  double dropout;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, attn_proj{nullptr}, fc{nullptr}, fc_proj{nullptr};
};

// tokens [B, T] (int64, < vocab) -> logits [B, T, vocab] (the real vocabulary, not the padding).
struct GPT2Impl : LanguageModel {
  explicit GPT2Impl(const ModelPreset& c, const std::vector<std::string>& freeze = {})
      : vocab(c.vocab) {
    wte = register_module("wte", torch::nn::Embedding(c.padded_vocab, c.d_model));
    wpe = register_module("wpe", torch::nn::Embedding(c.context, c.d_model));
    {
      torch::NoGradGuard no_grad;
      wte->weight.normal_(0.0, 0.02);
      wte->weight.narrow(0, c.vocab, c.padded_vocab - c.vocab).zero_();  // padding rows
      wpe->weight.normal_(0.0, 0.02);
    }
    for (int64_t i = 0; i < c.n_layers; ++i) {
      const std::string name = "block" + std::to_string(i);
      blocks.push_back(register_module(name, fsdp::Unit<GPT2BlockImpl>(c, name, freeze)));
    }
    ln_f = register_module(
        "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model}).eps(1e-5)));
  }

  torch::Tensor forward(torch::Tensor tokens) override {
    const int64_t T = tokens.size(1);
    auto positions =
        torch::arange(T, torch::TensorOptions().dtype(torch::kLong).device(tokens.device()));
    auto x = wte(tokens) + wpe(positions);
    for (auto& b : blocks) x = b(x);
    // The tied head over the real rows only: llm.c's softmax likewise covers V, not Vp.
    return torch::nn::functional::linear(ln_f(x), wte->weight.narrow(0, 0, vocab));
  }

  int64_t vocab;
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<fsdp::Unit<GPT2BlockImpl>> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
};

// The model --model asks for.
// `freeze`: --freeze's globs, which each block applies to itself (NOTE [deferred init]).
inline std::shared_ptr<LanguageModel> make_model(const ModelPreset& preset,
                                                 const std::vector<std::string>& freeze = {}) {
  if (preset.gpt2) return std::make_shared<GPT2Impl>(preset, freeze);
  return std::make_shared<GPTImpl>(preset, freeze);
}

}  // namespace fsdp_train
