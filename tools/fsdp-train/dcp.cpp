// fsdp-train and PyTorch's distributed checkpoints (see dcp.h).
#include "dcp.h"

#include <fstream>

#include "batches.h"
#include "fsdp/error.h"

namespace fsdp_train {

namespace {

using fsdp::cat;

// nanoGPT's names of GPT-2 (model.py: transformer.wte/wpe/h.N/ln_f, lm_head) against gpt2.h's.
struct NamePair {
  const char* theirs;  // regex over nanoGPT's name -> ours
  const char* ours_replacement;
  const char* ours;    // regex over ours -> nanoGPT's
  const char* theirs_replacement;
};
const NamePair kNanoGpt[] = {
    {R"(^transformer\.h\.([0-9]+)\.ln_1\.)", "block$1.ln1.", R"(^block([0-9]+)\.ln1\.)",
     "transformer.h.$1.ln_1."},
    {R"(^transformer\.h\.([0-9]+)\.ln_2\.)", "block$1.ln2.", R"(^block([0-9]+)\.ln2\.)",
     "transformer.h.$1.ln_2."},
    {R"(^transformer\.h\.([0-9]+)\.attn\.c_attn\.)", "block$1.qkv.", R"(^block([0-9]+)\.qkv\.)",
     "transformer.h.$1.attn.c_attn."},
    {R"(^transformer\.h\.([0-9]+)\.attn\.c_proj\.)", "block$1.attn_proj.",
     R"(^block([0-9]+)\.attn_proj\.)", "transformer.h.$1.attn.c_proj."},
    {R"(^transformer\.h\.([0-9]+)\.mlp\.c_fc\.)", "block$1.fc.", R"(^block([0-9]+)\.fc\.)",
     "transformer.h.$1.mlp.c_fc."},
    {R"(^transformer\.h\.([0-9]+)\.mlp\.c_proj\.)", "block$1.fc_proj.",
     R"(^block([0-9]+)\.fc_proj\.)", "transformer.h.$1.mlp.c_proj."},
    {R"(^transformer\.(wte|wpe|ln_f)\.)", "$1.", R"(^(wte|wpe|ln_f)\.)", "transformer.$1."},
    {R"(^lm_head\.weight$)", "wte.weight", nullptr, nullptr},  // tied: the same tensor
};

bool nanogpt_names(const TrainOptions& o, const ModelPreset& preset) {
  return o.dcp_names == "nanogpt" || (o.dcp_names == "auto" && preset.gpt2);
}

}  // namespace

void check_dcp_flags(const TrainOptions& o, const ModelPreset& preset) {
  FSDP_CHECK(o.dcp_names == "auto" || o.dcp_names == "nanogpt" || o.dcp_names == "none",
             "--dcp-names '", o.dcp_names, "' is unknown; use auto, nanogpt or none");
  FSDP_CHECK(o.dcp_names != "nanogpt" || preset.gpt2, "--dcp-names nanogpt names GPT-2's "
             "tensors; add --model gpt2 or use --dcp-names none");
  for (const auto& r : o.dcp_rename) (void)fsdp::parse_dcp_rename(r);
}

fsdp::DcpOptions dcp_options(const TrainOptions& o, const ModelPreset& preset, bool for_export) {
  fsdp::DcpOptions d;
  std::vector<fsdp::DcpRename> user;
  for (const auto& r : o.dcp_rename) user.push_back(fsdp::parse_dcp_rename(r));
  std::vector<fsdp::DcpRename> names;
  if (nanogpt_names(o, preset)) {
    for (const auto& p : kNanoGpt) {
      if (!for_export) {
        names.push_back({p.theirs, p.ours_replacement});
      } else if (p.ours) {
        names.push_back({p.ours, p.theirs_replacement});
      }
    }
    if (for_export) d.also_as["wte.weight"] = {"lm_head.weight"};
  }
  d.renames = for_export ? names : user;
  auto& rest = for_export ? user : names;
  d.renames.insert(d.renames.end(), rest.begin(), rest.end());
  if (preset.padded_vocab > preset.vocab) d.real_rows["wte.weight"] = preset.vocab;
  d.optimizer = !for_export && o.init_from_optimizer;
  return d;
}

void export_logits(Model& model, LanguageModel& net, const TokenStream& data, int64_t batch,
                   int64_t seq_len, const std::string& path, fsdp::Runtime& rt) {
  torch::NoGradGuard no_grad;
  net.eval();
  std::vector<int64_t> offsets(batch);
  for (int64_t b = 0; b < batch; ++b) offsets[b] = b * seq_len;
  auto tokens = batch_tokens(data, offsets, 0, batch, seq_len).narrow(1, 0, seq_len);
  const at::Tensor logits = model(tokens.to(rt.device())).to(torch::kFloat).cpu().contiguous();
  net.train();
  if (rt.rank() != 0) return;
  std::string header = cat("{'descr': '<f4', 'fortran_order': False, 'shape': (", logits.size(0),
                           ", ", logits.size(1), ", ", logits.size(2), "), }");
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  const std::string tmp = path + ".partial";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    const uint16_t n = static_cast<uint16_t>(header.size());
    out.write("\x93NUMPY\x01\x00", 8);
    out.write(reinterpret_cast<const char*>(&n), 2);
    out << header;
    out.write(static_cast<const char*>(logits.data_ptr()),
              static_cast<std::streamsize>(logits.nbytes()));
    FSDP_CHECK(out.good(), "--export-logits '", path, "': cannot write (", std::strerror(errno), ")");
  }
  FSDP_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "--export-logits '", path,
             "': cannot rename '", tmp, "' (", std::strerror(errno), ")");
}

}  // namespace fsdp_train
