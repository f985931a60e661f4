// The safetensors format of full checkpoints: an 8-byte little-endian header length, a JSON
// header (dtype, shape, data offsets per tensor), raw little-endian data (see full_format.h).
#include "checkpoint/full_format.h"

namespace fsdp::detail {

namespace {

class SafetensorsWriter final : public FullWriter {
 public:
  SafetensorsWriter(const std::string& path, const std::vector<FullEntry>& entries)
      : file_(path, O_WRONLY | O_CREAT | O_TRUNC) {
    json header;
    header["__metadata__"] = {{"format", "pt"}, {"producer", "fsdp.cpp"}};
    int64_t offset = 0;
    for (const auto& e : entries) {
      const int64_t n = e.bytes();
      header[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape},
                        {"data_offsets", {offset, offset + n}}};
      offset += n;
    }
    std::string text = header.dump();
    text.resize((text.size() + 7) / 8 * 8, ' ');  // data starts 8-byte aligned
    uint64_t len = text.size();
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(len >> (8 * i));
    file_.write(le, 8);
    file_.write(text.data(), static_cast<int64_t>(text.size()));
  }
  void write(const at::Tensor& t) override {
    file_.write(t.data_ptr(), t.numel() * static_cast<int64_t>(t.element_size()));
  }
  void finish() override { file_.sync_and_close(); }

 private:
  File file_;
};

class SafetensorsReader final : public FullReader {
 public:
  explicit SafetensorsReader(const std::string& path) : path_(path), file_(path, O_RDONLY) {
    const int64_t size = file_.size();
    FSDP_CHECK(size >= 8, "'", path, "' is not a safetensors file (", size, " bytes)");
    unsigned char le[8];
    file_.read_at(le, 8, 0);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | le[i];
    FSDP_CHECK(n <= static_cast<uint64_t>(std::min<int64_t>(size - 8, kMaxMetaBytes)), "'", path,
               "' has a header length of ", n, " bytes, beyond the file; it is not a valid "
               "safetensors file");
    std::string text(static_cast<size_t>(n), '\0');
    file_.read_at(text.data(), static_cast<int64_t>(n), 8);
    data_start_ = 8 + static_cast<int64_t>(n);
    const int64_t data_size = size - data_start_;
    json h = json::parse(text, nullptr, false);
    FSDP_CHECK(!h.is_discarded() && h.is_object(), "'", path, "' has an invalid safetensors "
               "header (not a JSON object)");
    for (const auto& [name, t] : h.items()) {
      if (name == "__metadata__") continue;
      const std::string w = cat("'", path, "' tensor '", name, "'");
      auto dtype = dtype_from_name(get_field<std::string>(t, "dtype", w));
      FSDP_CHECK(dtype, w, " has a dtype this reader does not know");
      auto shape = get_field<std::vector<int64_t>>(t, "shape", w);
      auto off = get_field<std::vector<int64_t>>(t, "data_offsets", w);
      const int64_t numel = checked_numel(shape, w);
      FSDP_CHECK(off.size() == 2 && off[0] >= 0 && off[0] <= off[1] && off[1] <= data_size &&
                     off[1] - off[0] == numel * static_cast<int64_t>(c10::elementSize(*dtype)),
                 w, " has data offsets outside the file or of the wrong size; the file is "
                 "corrupted");
      shapes[name] = shape;
      info_[name] = {*dtype, off[0]};
    }
  }
  at::Tensor slice(const std::string& name, int64_t lo, int64_t hi) override {
    const auto& [dtype, offset] = info_.at(name);
    at::Tensor out = at::empty({hi - lo}, at::TensorOptions().dtype(dtype));
    const auto elem = static_cast<int64_t>(c10::elementSize(dtype));
    file_.read_at(out.data_ptr(), (hi - lo) * elem, data_start_ + offset + lo * elem);
    return out;
  }

 private:
  std::string path_;
  File file_;
  int64_t data_start_ = 0;
  std::map<std::string, std::pair<at::ScalarType, int64_t>> info_;
};

}  // namespace

std::unique_ptr<FullWriter> make_safetensors_writer(const std::string& path,
                                                    const std::vector<FullEntry>& entries) {
  return std::make_unique<SafetensorsWriter>(path, entries);
}

std::unique_ptr<FullReader> make_safetensors_reader(const std::string& path) {
  return std::make_unique<SafetensorsReader>(path);
}

}  // namespace fsdp::detail
