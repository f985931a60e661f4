// PyTorch's ".pt" zip format of full checkpoints, as torch.save writes and torch.load reads it (see
// full_format.h).
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <unordered_map>

#include "checkpoint/full_format.h"

namespace fsdp::detail {

namespace {

// PyTorch's zip format as torch.save writes it: data.pkl (a dict name -> tensor whose storages
// are persistent ids "0", "1", ...), then one record data/<id> per tensor. The pickle is made
// first from placeholder tensors (right shapes, no memory), so tensors can be written one by one.
// The zip writer's destructor finishes an unfinished archive, so its sink never throws: the
// first error is kept, later writes are dropped, and write()/finish() report it (issue 21).
class PtWriter final : public FullWriter {
 public:
  PtWriter(const std::string& path, const std::vector<FullEntry>& entries)
      : file_(path, O_WRONLY | O_CREAT | O_TRUNC), zip_([this](const void* data, size_t n) {
          if (error_.empty()) error_ = capture([&] { file_.write(data, static_cast<int64_t>(n)); });
          return n;
        }) {
    c10::Dict<std::string, at::Tensor> dict;
    std::unordered_map<const c10::TensorImpl*, std::string> ids;
    std::vector<at::Tensor> placeholders;
    for (size_t i = 0; i < entries.size(); ++i) {
      const auto& e = entries[i];
      c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(e.bytes()),
                           at::DataPtr(nullptr, at::Device(at::kCPU)), nullptr, false);
      at::Tensor t = at::empty({0}, at::TensorOptions().dtype(e.dtype));
      t.set_(storage, 0, e.shape, c10::contiguous_strides(e.shape));
      ids[t.unsafeGetTensorImpl()] = std::to_string(i);
      placeholders.push_back(t);
      dict.insert(e.name, t);
    }
    std::string pickle;
    torch::jit::Pickler pickler(
        [&](const char* data, size_t n) { pickle.append(data, n); }, nullptr, nullptr, nullptr,
        [&](const at::Tensor& t) { return ids.at(t.unsafeGetTensorImpl()); },
        /*tag_aggregates=*/false);
    pickler.protocol();
    pickler.pushIValue(dict);
    pickler.stop();
    zip_.writeRecord("data.pkl", pickle.data(), pickle.size());
    zip_.writeRecord("byteorder", "little", 6);
    FSDP_CHECK(error_.empty(), error_);
  }
  void write(const at::Tensor& t) override {
    zip_.writeRecord(cat("data/", next_++), t.data_ptr(),
                     static_cast<size_t>(t.numel()) * t.element_size());
    FSDP_CHECK(error_.empty(), error_);
  }
  void finish() override {
    zip_.writeEndOfFile();
    FSDP_CHECK(error_.empty(), error_);
    file_.sync_and_close();
  }

 private:
  File file_;  // before zip_: its destructor writes into file_
  std::string error_;
  caffe2::serialize::PyTorchStreamWriter zip_;
  int64_t next_ = 0;
};

class PtReader final : public FullReader {
 public:
  explicit PtReader(const std::string& path) {
    File f(path, O_RDONLY);
    std::vector<char> data(static_cast<size_t>(f.size()));
    if (!data.empty()) f.read_at(data.data(), static_cast<int64_t>(data.size()), 0);
    c10::IValue v;
    try {
      v = torch::jit::pickle_load(data);
    } catch (const std::exception& e) {
      throw Error(cat("'", path, "' is not a readable PyTorch file (", error_message(e), ")"));
    }
    FSDP_CHECK(v.isGenericDict(), "'", path, "' holds a ", v.tagKind(), ", not a dict of "
               "tensors; save a state dict (name -> tensor)");
    for (const auto& kv : v.toGenericDict()) {
      FSDP_CHECK(kv.key().isString() && kv.value().isTensor(), "'", path, "' has an entry that "
                 "is not name -> tensor; save a state dict");
      at::Tensor t = kv.value().toTensor();
      shapes[kv.key().toStringRef()] = t.sizes().vec();
      tensors_[kv.key().toStringRef()] = t.contiguous().view({-1});
    }
  }
  at::Tensor slice(const std::string& name, int64_t lo, int64_t hi) override {
    return tensors_.at(name).narrow(0, lo, hi - lo);
  }

 private:
  std::map<std::string, at::Tensor> tensors_;
};

}  // namespace

std::unique_ptr<FullWriter> make_pt_writer(const std::string& path,
                                           const std::vector<FullEntry>& entries) {
  return std::make_unique<PtWriter>(path, entries);
}

std::unique_ptr<FullReader> make_pt_reader(const std::string& path) {
  return std::make_unique<PtReader>(path);
}

}  // namespace fsdp::detail
