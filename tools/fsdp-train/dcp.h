// fsdp-train and PyTorch's distributed checkpoints (fsdp/dcp.h): the names --dcp-names gives
// (GPT-2 as nanoGPT writes it), the rules of --dcp-rename, and --export-logits, which writes what
// the trained model predicts so that another implementation can be compared with it.
#pragma once

#include <string>

#include "fsdp/dcp.h"
#include "fsdp/runtime.h"
#include "build_model.h"
#include "options.h"
#include "token_data.h"

namespace fsdp_train {

// --dcp-names / --dcp-rename as fsdp::DcpOptions: for reading a checkpoint (import) or writing
// one (export). Import: --dcp-rename's rules, then the preset's (nanoGPT's names -> the model's);
// export: the preset's (the model's -> nanoGPT's, lm_head.weight beside transformer.wte.weight),
// then --dcp-rename's. GPT-2's embedding may have 50257 to 50304 rows in a checkpoint.
fsdp::DcpOptions dcp_options(const TrainOptions& o, const ModelPreset& preset, bool for_export);

// Checks --dcp-names and every --dcp-rename rule; fsdp::Error naming the bad one.
void check_dcp_flags(const TrainOptions& o, const ModelPreset& preset);

// The logits [B, T, vocab] of the first window of `data` (sequence b: tokens [b*T, b*T + T)),
// written by rank 0 as float32 .npy; every rank runs the forward (collective).
void export_logits(Model& model, LanguageModel& net, const TokenStream& data,
                   int64_t batch, int64_t seq_len, const std::string& path, fsdp::Runtime& rt);

}  // namespace fsdp_train
