// checkpoint/meta.h (internal): a sharded checkpoint's meta.json as data (NOTE [checkpoint
// format] in fsdp/checkpoint.h) and its reader. parse_meta validates everything meta.json says —
// format and version, file names (plain names inside the directory), every file's recorded size
// against its real size, dtypes, shapes (non-negative, no overflow), every chunk's element range
// and byte range within its tensor and file, chunks covering each tensor exactly once — before
// any byte of tensor data is read, so a damaged or hostile meta.json is refused with one line
// naming the checkpoint, the file and the reason. Pure functions; thread-safe.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "fsdp/checkpoint.h"
#include "fsdp/error.h"

namespace fsdp::detail {


// Format 2 checksums with CRC-32C (hardware instructions, crc32c.h); format 1, CRC-32 (zlib),
// is still read.
constexpr int64_t kCheckpointFormatVersion = 2;

// The checksum of format `version` over n bytes, continuing from `crc`: CRC-32 for version 1,
// CRC-32C from version 2. Its name for messages ("CRC-32", "CRC-32C") and its meta.json key
// ("crc32", "crc32c").
uint32_t format_checksum(int64_t version, const void* data, int64_t n, uint32_t crc = 0);
const char* checksum_name(int64_t version);
const char* checksum_key(int64_t version);
constexpr const char* kCheckpointFormatName = "fsdp.cpp sharded checkpoint";
constexpr int64_t kMaxMetaBytes = int64_t(1) << 28;  // 256 MiB of JSON is far beyond any model
constexpr int64_t kMaxNumel = int64_t(1) << 48;

// Dtypes, named as safetensors names them. dtype_name throws for a dtype checkpoints cannot hold.
const char* dtype_name(at::ScalarType t);
std::optional<at::ScalarType> dtype_from_name(const std::string& name);

// The element count of `shape`; fsdp::Error naming `what` for a negative or overflowing shape.
int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& what);

// A logical tensor of the checkpoint: a parameter, a buffer or one optimizer state of a parameter.
struct TensorEntry {
  std::string name;   // parameter or buffer name
  std::string kind;   // "param", "buffer" or "optim"
  std::string field;  // optimizer state name (kind "optim")
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  std::vector<std::string> aliases;    // tied names (kind "param")
  std::optional<int64_t> optim_step;   // kind "param": the step count of its optimizer state
  bool optim_state = false;            // kind "param": it has optimizer state
  std::string key() const { return kind == "optim" ? cat("optim/", field, "/", name) : cat(kind, "/", name); }
};

struct Chunk {
  int64_t tensor = 0;  // index into the entries
  int64_t file = 0;    // writing: shard index s (shard-<s>.bin); read: index into Meta::files
  int64_t offset = 0;  // bytes into the file
  int64_t begin = 0, end = 0;  // elements of the flattened tensor
  uint32_t crc = 0;
  // Where the writer finds the data (valid on the writer only).
  int64_t flat = -1;         // index into Layout::flats
  int64_t shard_offset = 0;  // elements into the flat's shard
  int64_t field = -1;        // -1: the parameter shard; else the optimizer state field
};

struct FileEntry {
  std::string name;
  int64_t bytes = 0;
  uint32_t crc = 0;
};

struct Meta {
  std::string path;  // the checkpoint directory
  int64_t format_version = 0;
  int64_t world_size = 0;
  std::string strategy;
  std::vector<int64_t> mesh;
  TrainingState state;
  std::string optimizer;  // "" : none
  std::vector<double> lrs;
  std::vector<TensorEntry> entries;
  std::vector<Chunk> chunks;  // file = index into files
  std::vector<FileEntry> files;
  int64_t rng_file = -1;  // index into files
  int64_t rng_world = 0, rng_bytes = 0;
  int64_t rng_cuda_bytes = 0;  // the CUDA generator's part at the end of each record
};

using json = nlohmann::ordered_json;

// j[key] as T, or fsdp::Error "<where> has no / an invalid '<key>'; the file is corrupted".
// Numbers must be integers where T is (a float such as 1e300 is not silently converted).
template <class T>
T get_field(const json& j, const char* key, const std::string& where) {
  FSDP_CHECK(j.is_object() && j.contains(key), where, " has no '", key, "'; the file is corrupted");
  const json& v = j.at(key);
  bool ok = true;
  if constexpr (std::is_same_v<T, bool>) {
    ok = v.is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    ok = v.is_number_integer() &&
         (std::is_signed_v<T> ? (v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(INT64_MAX)
                                                        : true)
                              : v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t(T(-1)));
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    ok = v.is_array();
    for (const auto& e : v) {
      ok = ok && e.is_number_integer() &&
           (!e.is_number_unsigned() || e.get<uint64_t>() <= uint64_t(INT64_MAX));
    }
  }
  if (ok) {
    try {
      return v.get<T>();
    } catch (const std::exception&) {
    }
  }
  throw Error(cat(where, " has an invalid '", key, "'; the file is corrupted"));
}

// A plain file name: no directory part, no "." or "..", at most 128 characters.
bool safe_file_name(const std::string& name);

// The real size of file `name` of the checkpoint directory, or -1 if there is no such file.
using FileSizeFn = std::function<int64_t(const std::string& name)>;

// Parses and validates meta.json's `text` of the checkpoint at `path` (used in messages and as
// Meta::path); `file_size` gives the files' real sizes. Throws fsdp::Error with one line naming
// the checkpoint, the file and the reason. Reads nothing itself: the fuzz target calls it.
Meta parse_meta(const std::string& text, const std::string& path, const FileSizeFn& file_size);

// The optimizer state a checkpoint of each optimizer type holds per parameter with state: the
// fields always stored, those stored only with an option (all-or-none), and whether a step count
// (optimizer_state.cpp's optimizer_kind stores the same fields; a test compares them).
struct SavedOptimizer {
  std::string type;  // meta.json's optimizer type, e.g. "adamw"
  std::vector<std::string> required, optional;
  bool step = false;
};
const std::vector<SavedOptimizer>& saved_optimizers();

// NOTE [complete manifest] (manifest.cpp): the entries of `m` together are the whole state a
// resume needs: none twice, every optimizer field of every parameter with state, the RNG of
// every rank, every byte of every shard file in one chunk. fsdp::Error naming the checkpoint,
// the tensor and what is missing or doubled. parse_meta calls it.
void check_manifest(const Meta& m, const std::string& where);

// parse_meta on the directory `path`: it must exist and hold meta.json; file sizes from stat.
Meta read_meta(const std::string& path);

}  // namespace fsdp::detail
