// One DCP item in the format of torch.save (see torch_save.h).
#include "dcp/torch_save.h"

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include "checkpoint/common.h"
#include "dcp/metadata.h"

namespace fsdp::detail {

namespace {

using pickle::Value;
using Kind = Value::Kind;

const std::vector<std::pair<at::ScalarType, const char*>> kStorages = {
    {at::kFloat, "FloatStorage"}, {at::kDouble, "DoubleStorage"}, {at::kHalf, "HalfStorage"},
    {at::kBFloat16, "BFloat16Storage"}, {at::kLong, "LongStorage"}, {at::kInt, "IntStorage"},
    {at::kShort, "ShortStorage"}, {at::kChar, "CharStorage"}, {at::kByte, "ByteStorage"},
    {at::kBool, "BoolStorage"}};

const std::set<std::string>& tensor_globals() {
  static const std::set<std::string> allowed = [] {
    std::set<std::string> s{"torch._utils._rebuild_tensor_v2", "collections.OrderedDict"};
    for (const auto& st : kStorages) s.insert(cat("torch.", st.second));
    return s;
  }();
  return allowed;
}

// A range of an open file, for PyTorchStreamReader.
class RangeAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  RangeAdapter(const File& f, int64_t offset, int64_t length)
      : f_(f), offset_(offset), length_(length) {}
  size_t size() const override { return static_cast<size_t>(length_); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* what) const override {
    if (pos >= static_cast<uint64_t>(length_)) return 0;
    n = std::min<size_t>(n, static_cast<size_t>(length_ - static_cast<int64_t>(pos)));
    f_.read_at(buf, static_cast<int64_t>(n), offset_ + static_cast<int64_t>(pos));
    return n;
  }

 private:
  const File& f_;
  int64_t offset_, length_;
};

std::unique_ptr<caffe2::serialize::PyTorchStreamReader> open_zip(const File& f, int64_t offset,
                                                                 int64_t length,
                                                                 const std::string& what) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  const std::string err = capture([&] {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
        std::make_shared<RangeAdapter>(f, offset, length));
    FSDP_CHECK(zip->hasRecord("data.pkl"), "it has no data.pkl");
  });
  FSDP_CHECK(err.empty(), what, " is not in torch.save's format (", err, ")");
  return zip;
}

std::string record(caffe2::serialize::PyTorchStreamReader& zip, const std::string& name,
                   const std::string& what) {
  std::string out;
  const std::string err = capture([&] {
    auto [ptr, n] = zip.getRecord(name);
    out.assign(static_cast<const char*>(ptr.get()), n);
  });
  FSDP_CHECK(err.empty(), what, ": its record ", name, " cannot be read (", err, ")");
  return out;
}

}  // namespace

at::Tensor read_saved_tensor(const File& f, int64_t offset, int64_t length, at::ScalarType dtype,
                             const std::vector<int64_t>& sizes, const std::string& what) {
  auto zip = open_zip(f, offset, length, what);
  const pickle::Pickle p(record(*zip, "data.pkl", what), tensor_globals(), what);
  const Value& root = p.root();
  FSDP_CHECK(root.is_object_of("torch._utils._rebuild_tensor_v2") && root.reduced &&
                 root.args->items.size() >= 5,
             what, " holds ", root.describe(), " where torch.save of a tensor was expected");
  const auto& a = root.args->items;
  FSDP_CHECK(a[0]->is(Kind::kPersistent) && a[0]->pid->is(Kind::kTuple) &&
                 a[0]->pid->items.size() == 5,
             what, " has no storage reference");
  const auto& pid = a[0]->pid->items;
  FSDP_CHECK(pickle::as_str(pid[0], what) == "storage" && pid[1]->is(Kind::kGlobal), what,
             " has a storage reference of an unknown form");
  at::ScalarType stored = at::kFloat;
  bool known = false;
  for (const auto& st : kStorages) {
    if (pid[1]->s == cat("torch.", st.second)) stored = st.first, known = true;
  }
  FSDP_CHECK(known && stored == dtype, what, " holds a ", pid[1]->s, " but .metadata says ",
             dcp_dtype_name(dtype));
  const std::string key = pickle::as_str(pid[2], cat(what, "'s storage key"));
  const int64_t numel = pickle::as_int(pid[4], cat(what, "'s storage size"));
  const int64_t storage_offset = pickle::as_int(a[1], cat(what, "'s storage offset"));
  const auto size = pickle::as_ints(a[2], cat(what, "'s size"));
  const auto stride = pickle::as_ints(a[3], cat(what, "'s stride"));
  FSDP_CHECK(size == sizes, what, " has shape ", shape_text(size), " but .metadata says ",
             shape_text(sizes));
  FSDP_CHECK(stride.size() == size.size(), what, " has ", stride.size(), " strides for ",
             size.size(), " dimensions");
  // The last element the view reaches must lie inside the storage.
  int64_t last = storage_offset, count = 1;
  for (size_t d = 0; d < size.size(); ++d) {
    FSDP_CHECK(stride[d] >= 0 && stride[d] < (int64_t{1} << 40), what, " has stride ", stride[d]);
    last += (size[d] - 1) * stride[d];
    count *= size[d];
  }
  FSDP_CHECK(numel >= 0 && storage_offset >= 0 && (count == 0 || last < numel), what,
             " views elements outside its storage (", numel, " elements)");
  const std::string bytes = record(*zip, "data/" + key, what);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  FSDP_CHECK(static_cast<int64_t>(bytes.size()) == numel * elem, what, "'s storage holds ",
             bytes.size(), " bytes, not the ", numel * elem, " of ", numel, " elements");
  at::Tensor storage = at::from_blob(const_cast<char*>(bytes.data()), {numel},
                                     at::TensorOptions().dtype(dtype));
  return storage.as_strided(size, stride, storage_offset).clone(at::MemoryFormat::Contiguous);
}

SavedValue read_saved_value(const File& f, int64_t offset, int64_t length, const std::string& what) {
  SavedValue v;
  char magic[4] = {};
  if (length >= 4) f.read_at(magic, 4, offset);
  if (std::string(magic, 4) != std::string("PK\x03\x04", 4)) {
    v.raw.resize(static_cast<size_t>(length));
    f.read_at(v.raw.data(), length, offset);
    return v;
  }
  auto zip = open_zip(f, offset, length, what);
  v.value = std::make_unique<pickle::Pickle>(record(*zip, "data.pkl", what),
                                             std::set<std::string>{"collections.OrderedDict"}, what);
  return v;
}

namespace {

std::string zip_of(const std::string& pickled, const at::Tensor* t) {
  std::string out;
  {
    caffe2::serialize::PyTorchStreamWriter zip([&](const void* data, size_t n) {
      out.append(static_cast<const char*>(data), n);
      return n;
    });
    zip.writeRecord("data.pkl", pickled.data(), pickled.size());
    zip.writeRecord("byteorder", "little", 6);
    if (t) zip.writeRecord("data/0", t->data_ptr(), static_cast<size_t>(t->nbytes()));
    zip.writeEndOfFile();
  }
  return out;
}

}  // namespace

std::string saved_tensor_bytes(const at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous() && t.device().is_cpu());
  const char* storage = nullptr;
  for (const auto& st : kStorages) {
    if (st.first == t.scalar_type()) storage = st.second;
  }
  FSDP_CHECK(storage, "a distributed checkpoint cannot hold dtype ", c10::toString(t.scalar_type()));
  pickle::PickleWriter w;
  w.global("torch._utils", "_rebuild_tensor_v2");
  w.mark();
  w.mark();
  w.str("storage");
  w.global("torch", storage);
  w.str("0");
  w.str("cpu");
  w.integer(t.numel());
  w.tuple_from_mark();
  w.binpersid();
  w.integer(0);
  w.ints(t.sizes().vec());
  w.ints(t.strides().vec());
  w.boolean(false);
  w.global("collections", "OrderedDict");
  w.tuple(0);
  w.reduce();
  w.tuple_from_mark();
  w.reduce();
  return zip_of(w.finish(), &t);
}

std::string saved_value_bytes(const std::string& pickled) { return zip_of(pickled, nullptr); }

}  // namespace fsdp::detail
