// llm.c's fp32 model file (karpathy/llm.c train_gpt2.c gpt2_build_from_checkpoint, train_gpt2.py
// write_model): reading it into fsdp-train's GPT-2 (gpt2.h) and writing one from it.
//
// NOTE [llm.c model file]
// A header of 256 int32 [20240326, 3, maxT, V, L, NH, C, Vp, 0...], then fp32 tensors back to
// back: wte (Vp, C), wpe (maxT, C), ln1w (L, C), ln1b (L, C), qkvw (L, 3C, C), qkvb (L, 3C),
// attprojw (L, C, C), attprojb (L, C), ln2w (L, C), ln2b (L, C), fcw (L, 4C, C), fcb (L, 4C),
// fcprojw (L, C, 4C), fcprojb (L, C), lnfw (C), lnfb (C). Linear weights are (out, in) as in
// nn.Linear; the per-layer tensors are stacked, so layer l of qkvw is the l-th (3C, C) slice.
// The layout is one table (llmc_layout): our parameter name, its byte offset in the file, its
// shape; the reader and the writer both walk it. The lm_head is wte (tied), so it has no entry.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "options.h"

namespace torch::nn {
class Module;
}
namespace fsdp {
class ShardedModuleBase;
}

namespace fsdp_train {

constexpr int32_t kLlmcModelMagic = 20240326;
constexpr int32_t kLlmcModelVersion = 3;  // fp32 weights (version 5 is llm.c's bf16)

struct LlmcModelHeader {
  int64_t max_t = 0, vocab = 0, layers = 0, heads = 0, channels = 0, padded_vocab = 0;
};

// One tensor of the file: where our parameter `name` lies (byte offset) and its shape.
struct LlmcTensor {
  std::string name;            // fsdp-train's name, e.g. "block3.qkv.weight"
  int64_t offset = 0;          // bytes from the start of the file
  std::vector<int64_t> shape;  // of this parameter (one layer's slice of a stacked tensor)
  int64_t layer = -1;          // the slice of a stacked (L, ...) tensor; -1: not stacked
  int64_t numel() const;
};

LlmcModelHeader llmc_header_for(const ModelPreset& preset);
// The inverse: `preset` with the shape of `h` (the rest, e.g. the name and dropout, kept).
ModelPreset preset_of_llmc_header(const LlmcModelHeader& h, ModelPreset preset);
// Every parameter of GPT-2 with `h`'s shape, in file order.
std::vector<LlmcTensor> llmc_layout(const LlmcModelHeader& h);
// 1024 + 4 x (every parameter).
int64_t llmc_file_bytes(const LlmcModelHeader& h);

// True if `path` starts with llm.c's model magic (how --init-from tells this format).
bool is_llmc_model_file(const std::string& path);

// Reads `path`'s header and checks magic, version and size; throws one line naming `flag`, the
// file and what differs.
LlmcModelHeader read_llmc_header(const std::string& flag, const std::string& path);

// read_llmc_header, then the shape against `preset`: one line naming each field that differs and
// the flags that would match the file.
void check_llmc_model_file(const std::string& flag, const std::string& path,
                           const ModelPreset& preset);

// --init-from for llm.c files: every rank reads `path` into a full state dict under our names and
// loads it into the sharded `model` (each rank keeps its shards). Collective.
void init_from_llmc(fsdp::ShardedModuleBase& model, const ModelPreset& preset,
                    const std::string& path);

// --export-llmc: gathers the full parameters (collective) and rank 0 writes `path` atomically
// ("<path>.partial", then renamed). `net` is the module `model` shards.
void export_llmc(fsdp::ShardedModuleBase& model, torch::nn::Module& net, const ModelPreset& preset,
                 const std::string& path);

}  // namespace fsdp_train
