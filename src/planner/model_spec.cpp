// Model shapes for the planner: parameter counts per unit, FLOPs per token, activation memory
// (see fsdp/planner.h).

#include "fsdp/error.h"
#include "fsdp/parse_enum.h"
#include "fsdp/planner.h"

namespace fsdp {

using detail::cat;

const char* to_string(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "?";
}

Recompute parse_recompute(const std::string& text) {
  return parse_enum<Recompute>(text,
                               {{"none", Recompute::kNone},
                                {"selective", Recompute::kSelective},
                                {"full", Recompute::kFull},
                                {"off", Recompute::kNone},
                                {"on", Recompute::kFull}},
                               "activation recompute");
}

void ModelSpec::validate() const {
  if (!units.empty()) {
    for (const auto& u : units) {
      FSDP_CHECK(u.numel >= 0 && u.frozen_numel >= 0, "model ", name, ": unit '", u.name,
                 "' has a negative parameter count (", u.numel, ")");
    }
  }
  auto positive = [&](const char* what, int64_t v) {
    FSDP_CHECK(v >= 1, "model ", name, ": ", what, " ", v, " is invalid; give 1 or more");
  };
  positive("layers", layers);
  positive("hidden size", hidden);
  positive("heads", heads);
  positive("vocab", vocab);
  positive("sequence length", seq_len);
  FSDP_CHECK(hidden % heads == 0, "model ", name, ": hidden size ", hidden,
             " is not a multiple of heads ", heads, "; pick heads that divide it");
  FSDP_CHECK(kv_heads >= 0 && (kv_heads == 0 || heads % kv_heads == 0), "model ", name,
             ": kv heads ", kv_heads, " must divide heads ", heads, " (0 means heads)");
  FSDP_CHECK(ffn_hidden >= 0 && positions >= 0, "model ", name,
             ": ffn width and positions must not be negative");
}

std::vector<UnitInfo> ModelSpec::unit_counts() const {
  if (!units.empty()) return units;
  const int64_t h = hidden, kv = h / heads * (kv_heads > 0 ? kv_heads : heads);
  const int64_t f = ffn_hidden > 0 ? ffn_hidden : 4 * h;
  const int64_t norm = biases ? 2 * h : h;  // LayerNorm (weight, bias) or RMSNorm (weight)
  int64_t block = 2 * h * h + 2 * h * kv + (gated_mlp ? 3 : 2) * h * f + 2 * norm;
  if (biases) block += 2 * h + 2 * kv + (gated_mlp ? 2 : 1) * f + h;
  std::vector<UnitInfo> out(static_cast<size_t>(layers + 1));
  out[0].numel = vocab * h + positions * h + norm + (tied_embeddings ? 0 : vocab * h);
  for (int64_t i = 1; i <= layers; ++i) {
    out[i].name = cat("block", i - 1);
    out[i].numel = block;
  }
  return out;
}

int64_t ModelSpec::parameters() const {
  int64_t n = 0;
  for (const auto& u : unit_counts()) n += u.total_numel();
  return n;
}

double ModelSpec::flops_per_token(Recompute r) const {
  // Matmul parameters: everything but the embedding lookups (the tied head still multiplies).
  const double n = double(parameters()) - double(positions * hidden) -
                   (tied_embeddings ? 0.0 : double(vocab * hidden));
  const double L = double(layers), h = double(hidden), s = double(seq_len);
  const double head = 2.0 * double(vocab) * h;   // the head's forward, per token
  const double blocks_fwd = 2.0 * (n - double(vocab) * h) + 4.0 * L * h * s;
  double f = 3.0 * (head + blocks_fwd);          // forward + backward (twice the forward)
  if (r == Recompute::kFull) f += blocks_fwd;
  if (r == Recompute::kSelective) f += 4.0 * L * h * s;
  return f;
}

int64_t activation_bytes(const ModelSpec& m, int64_t micro_batch, Recompute recompute,
                         c10::ScalarType dtype) {
  // Korthikanti et al. 2022, per layer with 16-bit activations: s b h (34 + 5 a s / h) bytes;
  // 34 s b h are the linear layers' and norms' inputs, 5 a s^2 b the attention scores, their
  // softmax and its dropout mask. Selective recompute drops the score term; full recompute keeps
  // one 16-bit block input per layer (2 s b h) and one whole layer while it is recomputed.
  const double s = double(m.seq_len), b = double(micro_batch), h = double(m.hidden);
  const double scores = m.stores_attention_scores ? 5.0 * double(m.heads) * s * s * b : 0.0;
  const double layer = 34.0 * s * b * h + scores;
  double bytes = 0;
  switch (recompute) {
    case Recompute::kNone: bytes = double(m.layers) * layer; break;
    case Recompute::kSelective: bytes = double(m.layers) * 34.0 * s * b * h; break;
    case Recompute::kFull: bytes = double(m.layers) * 2.0 * s * b * h + layer; break;
  }
  bytes *= double(c10::elementSize(dtype)) / 2.0;  // the formula counts 2-byte activations
  // The logits in the compute dtype and their fp32 copy for the loss.
  bytes += s * b * double(m.vocab) * double(c10::elementSize(dtype) + 4);
  return static_cast<int64_t>(bytes);
}

namespace {

struct NamedModel {
  const char* name;
  ModelSpec spec;
};

ModelSpec gpt(const char* name, int64_t d, int64_t layers, int64_t heads, int64_t context) {
  // fsdp-train's byte-level GPT (tools/fsdp-train/gpt.h): LayerNorm and linear biases, learned
  // positions, an untied head without bias, 256 tokens.
  ModelSpec m;
  m.name = name;
  m.layers = layers;
  m.hidden = d;
  m.heads = heads;
  m.vocab = 256;
  m.seq_len = 64;
  m.positions = context;
  m.biases = true;
  return m;
}

// GPT-2 as fsdp-train's --model gpt2 builds it (tools/fsdp-train/gpt2.h) and GPT-2 / llm.c
// define it: biases, learned positions, the head tied to the token embedding, whose rows are
// the vocabulary padded to a multiple of 128 (50257 -> 50304, as llm.c pads it). The planner's
// vocab is those rows, so its parameter count is the built model's (124.48 M for GPT-2 124M);
// the logits cover 50257 of them, 0.1% fewer than it counts.
ModelSpec gpt2(const char* name, int64_t d, int64_t layers, int64_t heads) {
  ModelSpec m = gpt(name, d, layers, heads, 1024);
  m.vocab = 50304;
  m.seq_len = 1024;
  m.tied_embeddings = true;
  return m;
}

// Llama shapes: RMSNorm, SwiGLU, rotary positions, untied head, fused attention. Sizes from the
// models' published configurations (config.json of each Hugging Face release).
ModelSpec llama(const char* name, int64_t layers, int64_t d, int64_t heads, int64_t kv,
                int64_t ffn, int64_t vocab, int64_t seq) {
  ModelSpec m;
  m.name = name;
  m.layers = layers;
  m.hidden = d;
  m.heads = heads;
  m.kv_heads = kv;
  m.ffn_hidden = ffn;
  m.vocab = vocab;
  m.seq_len = seq;
  m.gated_mlp = true;
  m.stores_attention_scores = false;
  return m;
}

const std::vector<NamedModel>& presets() {
  static const std::vector<NamedModel> p = {
      // fsdp-train's presets (options.cpp's model_presets(); a test checks they agree).
      {"tiny", gpt("tiny", 64, 2, 4, 64)},
      {"small", gpt("small", 256, 4, 4, 256)},
      {"medium", gpt("medium", 512, 8, 8, 512)},
      {"gpt2", gpt2("gpt2", 768, 12, 12)},
      {"llama2-7b", llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096)},
      {"llama2-13b", llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096)},
      // Llama 2 34B was not released; its shape is Code Llama 34B's (GQA, 8 KV heads).
      {"llama2-34b", llama("llama2-34b", 48, 8192, 64, 8, 22016, 32000, 4096)},
      {"llama2-70b", llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096)},
      {"llama3-8b", llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192)},
      {"llama3-70b", llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192)},
  };
  return p;
}

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.push_back(p.name);
  return names;
}

ModelSpec model_preset(const std::string& name) {
  std::string list;
  for (const auto& p : presets()) {
    if (p.name == name) return p.spec;
    list += (list.empty() ? "" : ", ") + std::string(p.name);
  }
  throw Error(cat("model preset '", name, "' is unknown; use one of ", list,
                  ", or give the shape (--layers, --d-model, --heads, --vocab, --seq-len)"));
}

}  // namespace fsdp
