// meta.json of sharded checkpoints: parsing and validation (see meta.h).
#include "checkpoint/meta.h"

#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <regex>

#include "checkpoint/crc32c.h"
#include "checkpoint/file_io.h"

namespace fsdp::detail {

uint32_t format_checksum(int64_t version, const void* data, int64_t n, uint32_t crc) {
  return version >= 2 ? crc32c(data, n, crc) : crc32_of(data, n, crc);
}

const char* checksum_name(int64_t version) { return version >= 2 ? "CRC-32C" : "CRC-32"; }

const char* checksum_key(int64_t version) { return version >= 2 ? "crc32c" : "crc32"; }

namespace {

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
const DtypeName kDtypes[] = {
    {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"},
    {at::kLong, "I64"},  {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},
    {at::kByte, "U8"},   {at::kBool, "BOOL"},
};

// The largest world whose RNG states rng.bin may hold (bounds rng_world * bytes_per_rank).
constexpr int64_t kMaxRngWorld = int64_t(1) << 24;

const json& array_field(const json& j, const char* key, const std::string& where) {
  FSDP_CHECK(j.is_object() && j.contains(key) && j.at(key).is_array(), where, " has no list '",
             key, "'; the file is corrupted");
  return j.at(key);
}

}  // namespace

const char* dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) return d.name;
  }
  throw Error(cat("dtype ", t, " cannot be stored in a checkpoint; use a standard dtype"));
}

std::optional<at::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  return std::nullopt;
}

int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    FSDP_CHECK(d >= 0 && d <= kMaxNumel && (d == 0 || n <= kMaxNumel / d), what,
               " has an invalid shape; the file is corrupted");
    n *= d;
  }
  return n;
}

bool safe_file_name(const std::string& n) {
  static const std::regex ok("[A-Za-z0-9._-]{1,128}");
  return n != "." && n != ".." && std::regex_match(n, ok);
}

namespace {

// parse_meta's steps. `where` names meta.json in every message; each throws on the first
// inconsistency.

// The header: format, version, world, strategy, mesh, caller state, optimizer type and lrs.
void parse_header(const json& j, const std::string& where, Meta& m) {
  FSDP_CHECK(get_field<std::string>(j, "format", where) == kCheckpointFormatName, where,
             " is not an fsdp.cpp sharded checkpoint");
  m.format_version = get_field<int64_t>(j, "format_version", where);
  FSDP_CHECK(m.format_version >= 1, where, " has an invalid format version ", m.format_version,
             "; the file is corrupted");
  FSDP_CHECK(m.format_version <= kCheckpointFormatVersion, where, " was written by format ",
             m.format_version, "; this fsdp.cpp reads up to ", kCheckpointFormatVersion,
             ": load it with a newer fsdp.cpp");
  m.world_size = get_field<int64_t>(j, "world_size", where);
  m.strategy = get_field<std::string>(j, "strategy", where);
  m.mesh = get_field<std::vector<int64_t>>(j, "mesh", where);
  const json& state = j.contains("state") ? j.at("state") : json();
  m.state.step = get_field<int64_t>(state, "step", where + " state");
  m.state.values = get_field<std::map<std::string, std::string>>(state, "values", where + " state");
  if (j.contains("optimizer") && !j.at("optimizer").is_null()) {
    m.optimizer = get_field<std::string>(j.at("optimizer"), "type", where + " optimizer");
    m.lrs = get_field<std::vector<double>>(j.at("optimizer"), "lr", where + " optimizer");
  }
}

// The files, each checked against the disk. Returns each file's index in m.files by name.
std::map<std::string, int64_t> parse_files(const json& j, const std::string& where,
                                           const FileSizeFn& file_size, Meta& m) {
  std::map<std::string, int64_t> file_index;
  for (const auto& f : array_field(j, "files", where)) {
    FileEntry fe;
    fe.name = get_field<std::string>(f, "name", where + " files");
    fe.bytes = get_field<int64_t>(f, "bytes", where + " files");
    fe.crc = get_field<uint32_t>(f, checksum_key(m.format_version), where + " files");
    FSDP_CHECK(safe_file_name(fe.name), where, " lists an invalid file '", fe.name,
               "' (not a plain name inside the checkpoint directory); the file is corrupted");
    FSDP_CHECK(fe.bytes >= 0 && !file_index.count(fe.name), where, " lists an invalid file '",
               fe.name, "' (negative size or listed twice); the file is corrupted");
    const int64_t real = file_size(fe.name);
    FSDP_CHECK(real >= 0, "checkpoint '", m.path, "' is missing '", fe.name,
               "'; the checkpoint is incomplete: use an earlier one");
    FSDP_CHECK(real == fe.bytes, "checkpoint '", m.path, "': '", fe.name, "' has ", real,
               " bytes but meta.json records ", fe.bytes,
               " (truncated or replaced); use an earlier checkpoint");
    file_index[fe.name] = static_cast<int64_t>(m.files.size());
    m.files.push_back(fe);
  }
  return file_index;
}

// Tensor `t`'s chunks, appended to m.chunks: each inside its tensor and its file, together
// covering the tensor's elements exactly once.
void parse_chunks(const json& t, const TensorEntry& e, int64_t index, const std::string& w,
                  const std::map<std::string, int64_t>& file_index, Meta& m) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(e.dtype));
  std::vector<std::pair<int64_t, int64_t>> covered;
  for (const auto& c : array_field(t, "chunks", w)) {
    Chunk ch;
    ch.tensor = index;
    const std::string file = get_field<std::string>(c, "file", w);
    FSDP_CHECK(file_index.count(file), w, " '", e.name, "' refers to file '", file,
               "', which meta.json does not list; the file is corrupted");
    ch.file = file_index.at(file);
    ch.offset = get_field<int64_t>(c, "offset", w);
    ch.begin = get_field<int64_t>(c, "begin", w);
    ch.end = get_field<int64_t>(c, "end", w);
    ch.crc = get_field<uint32_t>(c, checksum_key(m.format_version), w);
    const int64_t fbytes = m.files[static_cast<size_t>(ch.file)].bytes;
    FSDP_CHECK(ch.begin >= 0 && ch.begin < ch.end && ch.end <= e.numel && ch.offset >= 0 &&
                   ch.offset <= fbytes && (ch.end - ch.begin) <= (fbytes - ch.offset) / elem,
               w, " '", e.name, "' has a chunk outside its tensor or file '", file,
               "'; the file is corrupted");
    covered.emplace_back(ch.begin, ch.end);
    m.chunks.push_back(ch);
  }
  std::sort(covered.begin(), covered.end());
  int64_t next = 0;
  for (const auto& [b, en] : covered) {
    FSDP_CHECK(b == next, w, " '", e.name, "': its chunks do not cover its ", e.numel,
               " elements exactly once; the checkpoint is inconsistent");
    next = en;
  }
  FSDP_CHECK(next == e.numel, w, " '", e.name, "': its chunks hold ", next, " of its ", e.numel,
             " elements; the checkpoint is inconsistent");
}

// One entry of "tensors", with its chunks.
void parse_tensor(const json& t, const std::string& where,
                  const std::map<std::string, int64_t>& file_index, Meta& m) {
  TensorEntry e;
  const std::string w = where + " tensor";
  e.name = get_field<std::string>(t, "name", w);
  e.kind = get_field<std::string>(t, "kind", w);
  FSDP_CHECK(e.kind == "param" || e.kind == "buffer" || e.kind == "optim", w, " '", e.name,
             "' has unknown kind '", e.kind, "'; the file is corrupted");
  if (e.kind == "optim") e.field = get_field<std::string>(t, "field", w);
  auto dtype = dtype_from_name(get_field<std::string>(t, "dtype", w));
  FSDP_CHECK(dtype, w, " '", e.name, "' has an unknown dtype; the file is corrupted");
  e.dtype = *dtype;
  FSDP_CHECK(e.kind == "buffer" || e.dtype == at::kFloat, w, " '", e.name,
             "' is not F32; the file is corrupted");
  e.shape = get_field<std::vector<int64_t>>(t, "shape", w);
  e.numel = checked_numel(e.shape, cat(w, " '", e.name, "'"));
  if (t.contains("aliases")) e.aliases = get_field<std::vector<std::string>>(t, "aliases", w);
  if (t.contains("optim_step") && !t.at("optim_step").is_null()) {
    e.optim_step = get_field<int64_t>(t, "optim_step", w);
  }
  if (t.contains("optim_state")) e.optim_state = get_field<bool>(t, "optim_state", w);
  parse_chunks(t, e, static_cast<int64_t>(m.entries.size()), w, file_index, m);
  m.entries.push_back(std::move(e));
}

// The optional RNG file: one record of bytes_per_rank for each of world_size ranks, whose last
// cuda_bytes_per_rank bytes (absent: 0) are the rank's CUDA generator state.
void parse_rng(const json& j, const std::string& where,
               const std::map<std::string, int64_t>& file_index, Meta& m) {
  if (!j.contains("rng") || j.at("rng").is_null()) return;
  const json& r = j.at("rng");
  const std::string file = get_field<std::string>(r, "file", where + " rng");
  FSDP_CHECK(file_index.count(file), where, " rng refers to an unlisted file");
  m.rng_file = file_index.at(file);
  m.rng_world = get_field<int64_t>(r, "world_size", where + " rng");
  FSDP_CHECK(m.rng_world == m.world_size, where, " rng holds the states of ", m.rng_world,
             " ranks but the checkpoint was written by ", m.world_size, " (\"rng\": null says it "
             "holds none); the checkpoint is inconsistent");
  m.rng_bytes = get_field<int64_t>(r, "bytes_per_rank", where + " rng");
  if (r.contains("cuda_bytes_per_rank")) {
    m.rng_cuda_bytes = get_field<int64_t>(r, "cuda_bytes_per_rank", where + " rng");
  }
  FSDP_CHECK(m.rng_world >= 1 && m.rng_world <= kMaxRngWorld && m.rng_bytes >= 1 &&
                 m.rng_bytes <= (1 << 20) && m.rng_cuda_bytes >= 0 &&
                 m.rng_cuda_bytes < m.rng_bytes &&
                 m.rng_world * m.rng_bytes == m.files[static_cast<size_t>(m.rng_file)].bytes,
             where, " rng sizes are inconsistent; the file is corrupted");
}

}  // namespace

Meta parse_meta(const std::string& text, const std::string& path, const FileSizeFn& file_size) {
  const std::string where = cat("checkpoint '", path, "': meta.json");
  FSDP_CHECK(static_cast<int64_t>(text.size()) <= kMaxMetaBytes, where, " is ", text.size(),
             " bytes, more than the ", kMaxMetaBytes, " allowed; it is not a file fsdp wrote");
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  FSDP_CHECK(!j.is_discarded() && j.is_object(), where, " is not valid JSON",
             text.empty() ? " (it is empty)" : "", "; the file is corrupted");
  Meta m;
  m.path = path;
  parse_header(j, where, m);
  // Files first: every size and offset below is checked against them, and they against the disk.
  const auto file_index = parse_files(j, where, file_size, m);
  for (const auto& t : array_field(j, "tensors", where)) parse_tensor(t, where, file_index, m);
  parse_rng(j, where, file_index, m);
  check_manifest(m, where);
  return m;
}

Meta read_meta(const std::string& path) {
  struct stat st {};
  FSDP_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint '", path, "' does not exist (",
             errno_text(), "); give a directory written by save_checkpoint, e.g. DIR/step-00000100");
  FSDP_CHECK(S_ISDIR(st.st_mode), "checkpoint '", path, "' is not a directory; sharded "
             "checkpoints are directories (full checkpoints load with import_full_checkpoint)");
  const std::string meta_path = path + "/meta.json";
  FSDP_CHECK(::stat(meta_path.c_str(), &st) == 0, "'", path, "' is not an fsdp checkpoint: it has "
             "no meta.json (an interrupted save leaves only '<dir>.partial'); give a directory "
             "written by save_checkpoint");
  return parse_meta(read_text(meta_path, kMaxMetaBytes), path, [&](const std::string& name) {
    // Only regular files count: a directory or device named like a shard is no shard.
    struct stat fst {};
    if (::stat((path + "/" + name).c_str(), &fst) != 0 || !S_ISREG(fst.st_mode)) return int64_t(-1);
    return static_cast<int64_t>(fst.st_size);
  });
}

}  // namespace fsdp::detail
