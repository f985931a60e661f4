// A DCP checkpoint's .metadata (see metadata.h).
#include "dcp/metadata.h"

#include <sys/stat.h>

#include <algorithm>
#include <map>

#include "checkpoint/common.h"
#include "dcp/pickle.h"

namespace fsdp::detail {

namespace {

using pickle::Value;
using Kind = Value::Kind;

const std::string kMeta = "torch.distributed.checkpoint.metadata.";
const std::string kStorageInfo = "torch.distributed.checkpoint.filesystem._StorageInfo";

const std::vector<std::pair<at::ScalarType, const char*>> kDtypes = {
    {at::kFloat, "float32"}, {at::kDouble, "float64"}, {at::kHalf, "float16"},
    {at::kBFloat16, "bfloat16"}, {at::kLong, "int64"}, {at::kInt, "int32"},
    {at::kShort, "int16"}, {at::kChar, "int8"}, {at::kByte, "uint8"}, {at::kBool, "bool"}};

// Every class a 2.x .metadata refers to, and nothing else.
const std::set<std::string>& metadata_globals() {
  static const std::set<std::string> allowed = [] {
    std::set<std::string> s;
    for (const char* c : {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                          "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                          "StorageMeta", "_MEM_FORMAT_ENCODING"}) {
      s.insert(kMeta + c);
    }
    s.insert(kStorageInfo);
    for (const auto& d : kDtypes) s.insert(cat("torch.", d.second));
    for (const char* c : {"torch.Size", "torch.serialization._get_layout", "torch.strided",
                          "torch.contiguous_format", "torch.channels_last",
                          "torch.preserve_format", "pathlib.PosixPath", "pathlib._local.PosixPath",
                          "collections.OrderedDict"}) {
      s.insert(c);
    }
    return s;
  }();
  return allowed;
}

// The dict state BUILD gave an object of class `cls` (a dataclass's __dict__).
const Value& object_state(const Value* v, const std::string& cls, const std::string& what) {
  FSDP_CHECK(v && v->is_object_of(cls), what, " is ", v ? v->describe() : "missing", " where a ",
             cls, " was expected");
  FSDP_CHECK(v->state && v->state->is(Kind::kDict), what, " (a ", cls,
             ") has no field dict; this is not a DCP .metadata PyTorch 2.x writes");
  return *v->state;
}

const Value* field(const Value& state, const std::string& name, const std::string& what) {
  const Value* f = state.get(name);
  FSDP_CHECK(f, what, " has no field '", name, "'");
  return f;
}

at::ScalarType dtype_of_properties(const Value* props, const std::string& what) {
  FSDP_CHECK(props && props->is_object_of(kMeta + "TensorProperties") && props->state, what,
             "'s properties are ", props ? props->describe() : "missing",
             " where a TensorProperties was expected");
  const Value* dtype = nullptr;
  if (props->state->is(Kind::kTuple) && !props->state->items.empty()) {
    dtype = props->state->items[0];  // PyTorch >= 2.1: __getstate__'s tuple, dtype first
  } else {
    dtype = props->state->get("dtype");  // a plain dataclass dict
  }
  FSDP_CHECK(dtype && dtype->is(Kind::kGlobal) && dtype->s.rfind("torch.", 0) == 0, what,
             "'s dtype is ", dtype ? dtype->describe() : "missing");
  return dcp_dtype(dtype->s.substr(6), what);
}

int64_t volume(const std::vector<int64_t>& sizes, const std::string& what) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    FSDP_CHECK(s >= 0 && (s == 0 || n <= INT64_MAX / s), what, " has an impossible size ",
               shape_text(sizes));
    n *= s;
  }
  return n;
}

bool boxes_overlap(const DcpChunk& a, const DcpChunk& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.offsets[d] + a.sizes[d] <= b.offsets[d] || b.offsets[d] + b.sizes[d] <= a.offsets[d]) {
      return false;
    }
  }
  return true;
}

std::string box_text(const DcpChunk& c) {
  return cat("offsets ", shape_text(c.offsets), " sizes ", shape_text(c.sizes));
}

// Every chunk inside the tensor, no two overlapping, their volumes summing to the tensor's.
void check_tiling(const DcpItem& it, const std::string& what) {
  const std::string w = cat(what, ": tensor '", it.key, "' ", shape_text(it.size));
  const int64_t numel = volume(it.size, w);
  FSDP_CHECK(!it.chunks.empty() || numel == 0, w, " has no chunks");
  int64_t covered = 0;
  for (const auto& c : it.chunks) {
    FSDP_CHECK(c.offsets.size() == it.size.size() && c.sizes.size() == it.size.size(), w,
               " has a chunk of another rank (", box_text(c), ")");
    for (size_t d = 0; d < it.size.size(); ++d) {
      FSDP_CHECK(c.offsets[d] >= 0 && c.sizes[d] >= 0 && c.offsets[d] <= it.size[d] &&
                     c.sizes[d] <= it.size[d] - c.offsets[d],
                 w, " has a chunk outside it (", box_text(c), ")");
    }
    covered += volume(c.sizes, w);
    FSDP_CHECK(covered <= numel || numel == 0, w, " has chunks that overlap (their sizes add up "
               "to more than the tensor)");
  }
  // Overlaps: sweep along the first dimension, comparing only chunks whose rows meet.
  std::vector<const DcpChunk*> order;
  for (const auto& c : it.chunks) {
    if (volume(c.sizes, w) > 0) order.push_back(&c);
  }
  if (!it.size.empty()) {
    std::sort(order.begin(), order.end(),
              [](const DcpChunk* a, const DcpChunk* b) { return a->offsets[0] < b->offsets[0]; });
  }
  for (size_t i = 0; i < order.size(); ++i) {
    for (size_t j = i + 1; j < order.size(); ++j) {
      if (!it.size.empty() && order[j]->offsets[0] >= order[i]->offsets[0] + order[i]->sizes[0]) {
        break;
      }
      FSDP_CHECK(!boxes_overlap(*order[i], *order[j]), w, " has chunks that overlap (",
                 box_text(*order[i]), " and ", box_text(*order[j]), ")");
    }
  }
  FSDP_CHECK(covered == numel, w, " is not covered by its chunks (a gap of ", numel - covered,
             " elements)");
}

}  // namespace

const DcpItem* DcpMetadata::find(const std::string& key) const {
  for (const auto& it : items) {
    if (it.key == key) return &it;
  }
  return nullptr;
}

std::string dcp_dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.first == t) return d.second;
  }
  throw Error(cat("a distributed checkpoint cannot hold dtype ", c10::toString(t), " here"));
}

at::ScalarType dcp_dtype(const std::string& torch_name, const std::string& what) {
  for (const auto& d : kDtypes) {
    if (torch_name == d.second) return d.first;
  }
  throw Error(cat(what, " has dtype torch.", torch_name, ", which is not read (float32, "
                  "bfloat16, float16, float64 and the integer types are)"));
}

DcpMetadata parse_dcp_metadata(const std::string& bytes, const std::string& what) {
  FSDP_CHECK(bytes.size() >= 2 && static_cast<uint8_t>(bytes[0]) == 0x80, what,
             " is not a pickle (it does not start with a pickle protocol byte); a DCP "
             "checkpoint's .metadata is the one torch.distributed.checkpoint.save writes");
  pickle::Pickle p(bytes, metadata_globals(), what);
  const Value& root = object_state(&p.root(), kMeta + "Metadata", what);
  if (const Value* version = root.get("version"); version && !version->is(Kind::kNone)) {
    const std::string& v = pickle::as_str(version, cat(what, "'s version"));
    FSDP_CHECK(v.rfind("1.", 0) == 0, what, " is of DCP format version '", v,
               "', which this reader does not know (it reads PyTorch 2.x's, up to version 1.x)");
  }
  const Value* sdm = field(root, "state_dict_metadata", what);
  FSDP_CHECK(sdm->is(Kind::kDict), what, "'s state_dict_metadata is ", sdm->describe());
  DcpMetadata m;
  std::map<std::string, size_t> index;
  for (size_t k = 0; k + 1 < sdm->items.size(); k += 2) {
    DcpItem it;
    it.key = pickle::as_str(sdm->items[k], cat(what, ": a state_dict_metadata key"));
    const std::string w = cat(what, ": '", it.key, "'");
    FSDP_CHECK(!index.count(it.key), w, " appears twice");
    const Value* v = sdm->items[k + 1];
    if (v && v->is_object_of(kMeta + "BytesStorageMetadata")) {
      it.tensor = false;
    } else {
      const Value& st = object_state(v, kMeta + "TensorStorageMetadata", w);
      it.tensor = true;
      it.dtype = dtype_of_properties(field(st, "properties", w), w);
      it.size = pickle::as_ints(field(st, "size", w), cat(w, "'s size"));
      const Value* chunks = field(st, "chunks", w);
      FSDP_CHECK(chunks->is(Kind::kList), w, "'s chunks are ", chunks->describe());
      for (const Value* c : chunks->items) {
        const Value& cs = object_state(c, kMeta + "ChunkStorageMetadata", cat(w, "'s chunk"));
        DcpChunk ch;
        ch.offsets = pickle::as_ints(field(cs, "offsets", w), cat(w, "'s chunk offsets"));
        ch.sizes = pickle::as_ints(field(cs, "sizes", w), cat(w, "'s chunk sizes"));
        it.chunks.push_back(std::move(ch));
      }
      check_tiling(it, what);
    }
    index[it.key] = m.items.size();
    m.items.push_back(std::move(it));
  }
  if (const Value* pd = root.get("planner_data"); pd && pd->is(Kind::kDict)) {
    for (size_t k = 0; k + 1 < pd->items.size(); k += 2) {
      const Value* key = pd->items[k];
      const Value* path = pd->items[k + 1];
      if (!key->is(Kind::kStr) || !index.count(key->s) || !path->is(Kind::kTuple)) continue;
      auto& out = m.items[index[key->s]].path;
      for (const Value* part : path->items) {
        out.push_back(part->is(Kind::kInt) ? std::to_string(part->i)
                                           : pickle::as_str(part, cat(what, ": planner_data")));
      }
    }
  }
  const Value* sd = field(root, "storage_data", what);
  FSDP_CHECK(sd->is(Kind::kDict), what, "'s storage_data is ", sd->describe(),
             "; only torch.distributed.checkpoint.FileSystemWriter's checkpoints are read");
  std::vector<std::vector<bool>> stored(m.items.size());
  for (size_t i = 0; i < m.items.size(); ++i) {
    stored[i].assign(std::max<size_t>(m.items[i].chunks.size(), 1), false);
  }
  for (size_t k = 0; k + 1 < sd->items.size(); k += 2) {
    const Value& idx = object_state(sd->items[k], kMeta + "MetadataIndex", cat(what, ": a storage key"));
    const std::string fqn = pickle::as_str(field(idx, "fqn", what), cat(what, ": a storage key"));
    const std::string w = cat(what, ": the storage of '", fqn, "'");
    auto found = index.find(fqn);
    FSDP_CHECK(found != index.end(), w, " belongs to no item of state_dict_metadata");
    DcpItem& it = m.items[found->second];
    const Value& info = object_state(sd->items[k + 1], kStorageInfo, w);
    if (const Value* t = info.get("transform_descriptors"); t && !t->is(Kind::kNone)) {
      FSDP_CHECK(t->items.empty(), w, " is transformed (compressed or encrypted), which this "
                 "reader does not undo");
    }
    DcpChunk where;
    where.file = pickle::as_str(field(info, "relative_path", w), cat(w, "'s file"));
    where.offset = pickle::as_int(field(info, "offset", w), cat(w, "'s offset"));
    where.length = pickle::as_int(field(info, "length", w), cat(w, "'s length"));
    FSDP_CHECK(where.offset >= 0 && where.length > 0 && where.length <= INT64_MAX - where.offset,
               w, " has offset ", where.offset, " and length ", where.length);
    FSDP_CHECK(!where.file.empty() && where.file.find('/') == std::string::npos &&
                   where.file != "." && where.file != "..",
               w, " names file '", where.file, "', which is not a file name in the checkpoint "
               "directory");
    size_t c = 0;
    if (it.tensor) {
      const Value* off = idx.get("offset");
      FSDP_CHECK(off && !off->is(Kind::kNone), w, " has no chunk offset");
      const auto offsets = pickle::as_ints(off, cat(w, "'s chunk offset"));
      c = it.chunks.size();
      for (size_t j = 0; j < it.chunks.size(); ++j) {
        if (it.chunks[j].offsets == offsets) c = j;
      }
      FSDP_CHECK(c < it.chunks.size(), w, " is for a chunk at ", shape_text(offsets),
                 ", which the tensor does not have");
    } else {
      it.chunks.resize(1);
    }
    FSDP_CHECK(!stored[found->second][c], w, " is given twice");
    stored[found->second][c] = true;
    DcpChunk& ch = it.chunks[c];
    ch.file = where.file;
    ch.offset = where.offset;
    ch.length = where.length;
  }
  for (size_t i = 0; i < m.items.size(); ++i) {
    for (size_t c = 0; c < m.items[i].chunks.size() || (!m.items[i].tensor && c < 1); ++c) {
      FSDP_CHECK(stored[i][c], what, ": '", m.items[i].key, "' has ",
                 m.items[i].tensor ? cat("a chunk (", box_text(m.items[i].chunks[c]), ")")
                                   : std::string("a value"),
                 " stored in no file");
    }
  }
  return m;
}

void check_dcp_files(const DcpMetadata& m, const std::string& dir) {
  std::map<std::string, int64_t> sizes;
  for (const auto& it : m.items) {
    for (const auto& c : it.chunks) {
      auto s = sizes.find(c.file);
      if (s == sizes.end()) {
        struct stat st {};
        const std::string path = dir + "/" + c.file;
        FSDP_CHECK(::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode), "DCP checkpoint '", dir,
                   "': its .metadata stores '", it.key, "' in ", c.file, ", which is missing (",
                   ::stat(path.c_str(), &st) == 0 ? "not a file" : errno_text(),
                   "); copy the whole checkpoint directory");
        s = sizes.emplace(c.file, static_cast<int64_t>(st.st_size)).first;
      }
      FSDP_CHECK(c.offset + c.length <= s->second, "DCP checkpoint '", dir, "': ", c.file,
                 " is too short (", s->second, " bytes) for '", it.key, "' at bytes ", c.offset,
                 "..", c.offset + c.length, "; the file was cut short, copy it again");
    }
  }
}

// ---- writing

namespace {

void write_obj_start(pickle::PickleWriter& w, const std::string& cls) {
  w.global("torch.distributed.checkpoint.metadata", cls);
  w.tuple(0);
  w.newobj();
}

}  // namespace

std::string dcp_metadata_bytes(const DcpMetadata& m) {
  pickle::PickleWriter w;
  write_obj_start(w, "Metadata");
  w.empty_dict();
  w.mark();
  w.str("state_dict_metadata");
  w.empty_dict();
  w.mark();
  for (const auto& it : m.items) {
    w.str(it.key);
    if (!it.tensor) {
      write_obj_start(w, "BytesStorageMetadata");
      continue;
    }
    write_obj_start(w, "TensorStorageMetadata");
    w.empty_dict();
    w.mark();
    w.str("properties");
    write_obj_start(w, "TensorProperties");
    w.mark();
    w.global("torch", dcp_dtype_name(it.dtype));
    w.global("torch.serialization", "_get_layout");
    w.str("torch.strided");
    w.tuple(1);
    w.reduce();
    w.boolean(false);
    w.global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING");
    w.integer(0);
    w.tuple(1);
    w.reduce();
    w.boolean(false);
    w.tuple_from_mark();
    w.build();
    w.str("size");
    w.size(it.size);
    w.str("chunks");
    w.empty_list();
    w.mark();
    for (const auto& c : it.chunks) {
      write_obj_start(w, "ChunkStorageMetadata");
      w.empty_dict();
      w.mark();
      w.str("offsets");
      w.size(c.offsets);
      w.str("sizes");
      w.size(c.sizes);
      w.setitems();
      w.build();
    }
    w.appends();
    w.setitems();
    w.build();
  }
  w.setitems();
  w.str("planner_data");
  w.empty_dict();
  w.mark();
  for (const auto& it : m.items) {
    w.str(it.key);
    w.mark();
    for (const auto& part : it.path) {
      const bool index = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
      if (index) {
        w.integer(std::stoll(part));
      } else {
        w.str(part);
      }
    }
    w.tuple_from_mark();
  }
  w.setitems();
  w.str("storage_data");
  w.empty_dict();
  w.mark();
  for (const auto& it : m.items) {
    for (size_t c = 0; c < it.chunks.size(); ++c) {
      write_obj_start(w, "MetadataIndex");
      w.empty_dict();
      w.mark();
      w.str("fqn");
      w.str(it.key);
      w.str("index");
      if (it.tensor) {
        w.integer(static_cast<int64_t>(c));
        w.str("offset");
        w.size(it.chunks[c].offsets);
      } else {
        w.none();
      }
      w.setitems();
      w.build();
      w.global("torch.distributed.checkpoint.filesystem", "_StorageInfo");
      w.tuple(0);
      w.newobj();
      w.empty_dict();
      w.mark();
      w.str("relative_path");
      w.str(it.chunks[c].file);
      w.str("offset");
      w.integer(it.chunks[c].offset);
      w.str("length");
      w.integer(it.chunks[c].length);
      w.setitems();
      w.build();
    }
  }
  w.setitems();
  w.str("storage_meta");
  w.none();
  w.setitems();
  w.build();
  return w.finish();
}

std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> flat_range_boxes(
    const std::vector<int64_t>& shape, int64_t lo, int64_t hi) {
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> out;
  if (lo >= hi) return out;
  if (shape.empty()) {
    out.push_back({{}, {}});
    return out;
  }
  if (shape.size() == 1) {
    out.push_back({{lo}, {hi - lo}});
    return out;
  }
  const std::vector<int64_t> inner_shape(shape.begin() + 1, shape.end());
  int64_t inner = 1;
  for (int64_t s : inner_shape) inner *= s;
  auto within_row = [&](int64_t row, int64_t a, int64_t b) {
    for (auto& [off, sz] : flat_range_boxes(inner_shape, a, b)) {
      off.insert(off.begin(), row);
      sz.insert(sz.begin(), 1);
      out.push_back({off, sz});
    }
  };
  int64_t r0 = lo / inner;
  const int64_t r1 = hi / inner;
  if (r0 == r1) {
    within_row(r0, lo - r0 * inner, hi - r0 * inner);
    return out;
  }
  if (lo % inner != 0) {
    within_row(r0, lo % inner, inner);
    ++r0;
  }
  if (r1 > r0) {
    std::vector<int64_t> off(shape.size(), 0), sz = shape;
    off[0] = r0;
    sz[0] = r1 - r0;
    out.push_back({off, sz});
  }
  if (hi % inner != 0) within_row(r1, 0, hi % inner);
  return out;
}

}  // namespace fsdp::detail
