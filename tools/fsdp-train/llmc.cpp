// llm.c model files in and out (see llmc.h, NOTE [llm.c model file]).
#include "llmc.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "fsdp/error.h"
#include "fsdp/runtime.h"
#include "fsdp/sharded.h"

namespace fsdp_train {

using fsdp::cat;

int64_t LlmcTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// Each field of the header and the preset's field it is.
const std::pair<int64_t LlmcModelHeader::*, int64_t ModelPreset::*> kHeaderFields[] = {
    {&LlmcModelHeader::max_t, &ModelPreset::context},
    {&LlmcModelHeader::vocab, &ModelPreset::vocab},
    {&LlmcModelHeader::layers, &ModelPreset::n_layers},
    {&LlmcModelHeader::heads, &ModelPreset::n_heads},
    {&LlmcModelHeader::channels, &ModelPreset::d_model},
    {&LlmcModelHeader::padded_vocab, &ModelPreset::padded_vocab},
};

}  // namespace

LlmcModelHeader llmc_header_for(const ModelPreset& p) {
  LlmcModelHeader h;
  for (const auto& [in_header, in_preset] : kHeaderFields) h.*in_header = p.*in_preset;
  return h;
}

ModelPreset preset_of_llmc_header(const LlmcModelHeader& h, ModelPreset p) {
  for (const auto& [in_header, in_preset] : kHeaderFields) p.*in_preset = h.*in_header;
  return p;
}

std::vector<LlmcTensor> llmc_layout(const LlmcModelHeader& h) {
  const int64_t C = h.channels, L = h.layers;
  std::vector<LlmcTensor> out;
  int64_t offset = 256 * 4;
  auto whole = [&](const std::string& name, std::vector<int64_t> shape) {
    LlmcTensor t{name, offset, std::move(shape), -1};
    offset += 4 * t.numel();
    out.push_back(t);
  };
  // One stacked (L, shape...) tensor: layer l's slice is block<l>.<suffix>.
  auto stacked = [&](const std::string& suffix, std::vector<int64_t> shape) {
    for (int64_t l = 0; l < L; ++l) {
      LlmcTensor t{cat("block", l, ".", suffix), offset, shape, l};
      offset += 4 * t.numel();
      out.push_back(t);
    }
  };
  whole("wte.weight", {h.padded_vocab, C});
  whole("wpe.weight", {h.max_t, C});
  stacked("ln1.weight", {C});
  stacked("ln1.bias", {C});
  stacked("qkv.weight", {3 * C, C});
  stacked("qkv.bias", {3 * C});
  stacked("attn_proj.weight", {C, C});
  stacked("attn_proj.bias", {C});
  stacked("ln2.weight", {C});
  stacked("ln2.bias", {C});
  stacked("fc.weight", {4 * C, C});
  stacked("fc.bias", {4 * C});
  stacked("fc_proj.weight", {C, 4 * C});
  stacked("fc_proj.bias", {C});
  whole("ln_f.weight", {C});
  whole("ln_f.bias", {C});
  return out;
}

int64_t llmc_file_bytes(const LlmcModelHeader& h) {
  const auto layout = llmc_layout(h);
  return layout.back().offset + 4 * layout.back().numel();
}

namespace {

// The first 256 int32 of `path`, or false if it is shorter or unreadable.
bool read_ints(const std::string& path, int32_t (&header)[256], int64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  const bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
                  ::pread(fd, header, sizeof(header), 0) == static_cast<ssize_t>(sizeof(header));
  ::close(fd);
  *size = static_cast<int64_t>(st.st_size);
  return ok;
}

}  // namespace

bool is_llmc_model_file(const std::string& path) {
  int32_t header[256];
  int64_t size = 0;
  return read_ints(path, header, &size) && header[0] == kLlmcModelMagic;
}

LlmcModelHeader read_llmc_header(const std::string& flag, const std::string& path) {
  struct stat st {};
  FSDP_CHECK(::stat(path.c_str(), &st) == 0, flag, " '", path, "' cannot be read (",
             std::strerror(errno), "); give an llm.c model file");
  FSDP_CHECK(S_ISREG(st.st_mode), flag, " '", path,
             "' is not a regular file; give an llm.c "
             "model file");
  int32_t i[256];
  int64_t size = 0;
  FSDP_CHECK(read_ints(path, i, &size), flag, " '", path, "' is ", int64_t(st.st_size),
             " bytes, shorter than llm.c's 1024-byte header (or unreadable); give an llm.c "
             "model file");
  FSDP_CHECK(i[0] == kLlmcModelMagic, flag, " '", path, "' is not an llm.c model file: magic ",
             i[0], ", expected ", kLlmcModelMagic);
  FSDP_CHECK(i[1] == kLlmcModelVersion, flag, " '", path, "' is llm.c model version ", i[1],
             ", expected ", kLlmcModelVersion,
             i[1] == 5 ? " (fp32; version 5 is bf16, written by llm.c's CUDA trainer)" : " (fp32)",
             "; export it as fp32");
  LlmcModelHeader h;
  h.max_t = i[2];
  h.vocab = i[3];
  h.layers = i[4];
  h.heads = i[5];
  h.channels = i[6];
  h.padded_vocab = i[7];
  FSDP_CHECK(h.max_t > 0 && h.vocab > 0 && h.layers > 0 && h.heads > 0 && h.channels > 0 &&
                 h.padded_vocab >= h.vocab && h.channels % h.heads == 0,
             flag, " '", path, "' has an invalid llm.c header: maxT ", h.max_t, ", V ", h.vocab,
             ", L ", h.layers, ", NH ", h.heads, ", C ", h.channels, ", Vp ", h.padded_vocab);
  const int64_t expected = llmc_file_bytes(h);
  FSDP_CHECK(size == expected, flag, " '", path, "' is ", size, " bytes, but its header (maxT ",
             h.max_t, ", V ", h.vocab, ", L ", h.layers, ", C ", h.channels, ", Vp ",
             h.padded_vocab, ") needs ", expected, "; the file is truncated or not fp32");
  return h;
}

void check_llmc_model_file(const std::string& flag, const std::string& path,
                           const ModelPreset& preset) {
  const LlmcModelHeader f = read_llmc_header(flag, path), m = llmc_header_for(preset);
  std::string diff;
  auto field = [&](const char* what, const char* fix, int64_t file, int64_t model) {
    if (file == model) return;
    diff += cat(diff.empty() ? "" : ", ", what, " ", file, " (the model has ", model,
                fix[0] ? cat("; ", fix, " ", file) : std::string(), ")");
  };
  field("layers", "--layers", f.layers, m.layers);
  field("width", "--d-model", f.channels, m.channels);
  field("heads", "--heads", f.heads, m.heads);
  field("context", "--context", f.max_t, m.max_t);
  field("vocabulary", "", f.vocab, m.vocab);
  field("padded vocabulary", "", f.padded_vocab, m.padded_vocab);
  FSDP_CHECK(diff.empty(), flag, " '", path, "' is another shape than --model ", preset.name,
             ": the file has ", diff);
}

void init_from_llmc(fsdp::ShardedModuleBase& model, const ModelPreset& preset,
                    const std::string& path) {
  check_llmc_model_file("--init-from", path, preset);  // every rank: the file may have changed
  const LlmcModelHeader h = llmc_header_for(preset);
  const int64_t bytes = llmc_file_bytes(h);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  FSDP_CHECK(fd >= 0, "--init-from '", path, "': ", std::strerror(errno));
  void* base = ::mmap(nullptr, static_cast<size_t>(bytes), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  FSDP_CHECK(base != MAP_FAILED, "--init-from '", path,
             "' cannot be mapped: ", std::strerror(errno));
  // The full state dict as views of the read-only map; load_state_dict copies each rank's part.
  torch::OrderedDict<std::string, torch::Tensor> dict;
  for (const auto& t : llmc_layout(h)) {
    dict.insert(t.name,
                torch::from_blob(static_cast<char*>(base) + t.offset, t.shape, torch::kFloat));
  }
  try {
    model.load_state_dict(dict);
  } catch (...) {
    ::munmap(base, static_cast<size_t>(bytes));
    throw;
  }
  ::munmap(base, static_cast<size_t>(bytes));
}

void export_llmc(fsdp::ShardedModuleBase& model, torch::nn::Module& net, const ModelPreset& preset,
                 const std::string& path) {
  const LlmcModelHeader h = llmc_header_for(preset);
  auto guard = model.summon_full_params();  // collective
  if (model.runtime()->rank() != 0) return;
  const auto params = net.named_parameters();
  const std::string partial = path + ".partial";
  const int fd = ::open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  FSDP_CHECK(fd >= 0, "--export-llmc: cannot write '", partial, "': ", std::strerror(errno));
  auto write_at = [&](const void* data, int64_t n, int64_t offset) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::pwrite(fd, p, static_cast<size_t>(n), static_cast<off_t>(offset));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const int err = errno;
        ::close(fd);
        ::unlink(partial.c_str());
        throw fsdp::Error(
            cat("--export-llmc: writing '", partial, "' failed: ", std::strerror(err)));
      }
      p += w;
      n -= w;
      offset += w;
    }
  };
  int32_t header[256] = {kLlmcModelMagic,     kLlmcModelVersion,      int32_t(h.max_t),
                         int32_t(h.vocab),    int32_t(h.layers),      int32_t(h.heads),
                         int32_t(h.channels), int32_t(h.padded_vocab)};
  write_at(header, sizeof(header), 0);
  for (const auto& t : llmc_layout(h)) {
    const torch::Tensor* p = params.find(t.name);
    TORCH_INTERNAL_ASSERT(p != nullptr, "GPT-2 has no parameter ", t.name);
    torch::Tensor v = p->detach().to(torch::kCPU, torch::kFloat).contiguous();
    TORCH_INTERNAL_ASSERT(v.sizes() == torch::IntArrayRef(t.shape), t.name, " has shape ",
                          v.sizes(), ", the llm.c layout says ", torch::IntArrayRef(t.shape));
    write_at(v.data_ptr<float>(), 4 * v.numel(), t.offset);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  FSDP_CHECK(synced && ::rename(partial.c_str(), path.c_str()) == 0,
             "--export-llmc: cannot "
             "finish '",
             path, "': ", std::strerror(errno));
}

}  // namespace fsdp_train
