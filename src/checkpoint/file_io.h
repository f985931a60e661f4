// checkpoint/file_io.h (internal): the file operations checkpoints are made of — a file descriptor
// that reports errors as fsdp::Error naming the file, whole-file reads with a size limit, atomic
// replacement, directory fsync and CRC-32. Used by the sharded save and load,
// meta.cpp (meta.json) and inspect.cpp (verification). Not thread-safe per
// object; distinct objects may be used from different threads.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "base/unique_fd.h"

namespace fsdp::detail {

// strerror(errno), read at the call.
std::string errno_text();

// Alignment of the memory, offsets and lengths of File::write_direct.
constexpr int64_t kDirectAlign = 4096;

// n rounded up to whole kDirectAlign blocks: what File::write_direct reads of its buffer.
constexpr int64_t direct_bytes(int64_t n) {
  return (n + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
}

// An open file descriptor (RAII). Every failure throws fsdp::Error naming the path.
class File {
 public:
  File(const std::string& path, int flags, mode_t mode = 0644);

  void write(const void* data, int64_t n);
  // Writes n bytes at the start of this empty file bypassing the page cache (O_DIRECT) where
  // the file system allows it and `data` is aligned to kDirectAlign, whose direct_bytes(n) bytes
  // must be readable (those past n are written, then cut off); an ordinary write()
  // otherwise (NOTE [direct writes] in file_io.cpp). Returns whether it bypassed the cache
  // (false: the file system refused O_DIRECT, or `data` is not aligned).
  bool write_direct(const void* data, int64_t n);
  // Reads exactly n bytes at `offset`; a file that ends before is an error ("truncated?").
  void read_at(void* data, int64_t n, int64_t offset) const;
  // Asks the kernel to start reading [offset, offset + n) into the page cache now (a hint:
  // posix_fadvise WILLNEED; failures are ignored, the read that follows reports real errors).
  void prefetch(int64_t offset, int64_t n) const;
  void sync_and_close();
  int64_t size() const;

 private:
  std::string path_;
  UniqueFd fd_;
};

// fsync of a directory: makes renames in it durable. Throws fsdp::Error naming the directory if
// the fsync fails; a directory that cannot be opened, or whose file system cannot fsync
// directories (EINVAL), is skipped as before.
void sync_dir(const std::string& dir);

// The directory part of `path` ("." for a bare name).
std::string parent_dir(const std::string& path);

// The whole file; an error if it is larger than `limit` bytes.
std::string read_text(const std::string& path, int64_t limit);

// Writes `text` to `path` atomically (temporary file, fsync, rename, fsync of the directory).
void write_file_atomically(const std::string& path, const std::string& text);

// zlib's CRC-32 of n bytes, continuing from `crc`.
uint32_t crc32_of(const void* data, int64_t n, uint32_t crc = 0);

}  // namespace fsdp::detail
