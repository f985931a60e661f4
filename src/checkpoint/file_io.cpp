// File operations of checkpoints (see file_io.h).
#include "checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "fsdp/error.h"

namespace fsdp::detail {

std::string errno_text() { return std::strerror(errno); }

File::File(const std::string& path, int flags, mode_t mode)
    : path_(path), fd_(::open(path.c_str(), flags | O_CLOEXEC, mode)) {
  FSDP_CHECK(fd_.valid(), "cannot open '", path, "': ", errno_text());
}

void File::write(const void* data, int64_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd_.get(), p, static_cast<size_t>(std::min<int64_t>(n, 1 << 30)));
    if (w < 0 && errno == EINTR) continue;
    FSDP_CHECK(w > 0, "writing '", path_, "' failed: ", errno_text());
    p += w;
    n -= w;
  }
}

// NOTE [direct writes]
// An async save's background thread writes each rank's file from its staging buffer, an exact
// image of the file. Through the page cache that costs the kernel a copy of every byte into new
// page-cache pages (and, in a VM, the host's first touch of those pages) on the cores that
// train: measured as steps 55% slower while a save was written (BENCHMARKS.md). With O_DIRECT
// the device reads the staging buffer itself and the cache is not filled with data nobody reads
// back soon. O_DIRECT needs the buffer, offsets and lengths aligned to the device's block
// (kDirectAlign covers 512 and 4096); the image's tail is written whole and cut off with
// ftruncate. A file system that refuses O_DIRECT (fcntl or the first write says EINVAL) is
// written through the cache as before: the file is the same either way, and fsync follows; the
// save counts such files (CheckpointInfo::page_cache_writes) and fsdp-train says so.
bool File::write_direct(const void* data, int64_t n) {
  const int flags = ::fcntl(fd_.get(), F_GETFL);
  const bool aligned = reinterpret_cast<uintptr_t>(data) % kDirectAlign == 0;
  if (!aligned || flags < 0 || ::fcntl(fd_.get(), F_SETFL, flags | O_DIRECT) != 0) {
    write(data, n);
    return false;
  }
  const int64_t whole = direct_bytes(n);
  const char* p = static_cast<const char*>(data);
  int64_t done = 0;
  while (done < whole) {
    const auto len = static_cast<size_t>(std::min<int64_t>(whole - done, 1 << 30));
    const ssize_t w = ::pwrite(fd_.get(), p + done, len, static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EINVAL && done == 0) {  // refused after all: the ordinary way
      FSDP_CHECK(::fcntl(fd_.get(), F_SETFL, flags) == 0, "cannot clear O_DIRECT on '", path_,
                 "': ", errno_text());
      write(data, n);
      return false;
    }
    FSDP_CHECK(w > 0, "writing '", path_, "' failed: ", errno_text());
    done += w;
    if (done % kDirectAlign != 0) {  // a short write off the block grid: finish through the cache
      FSDP_CHECK(::fcntl(fd_.get(), F_SETFL, flags) == 0, "cannot clear O_DIRECT on '", path_,
                 "': ", errno_text());
    }
  }
  FSDP_CHECK(::ftruncate(fd_.get(), static_cast<off_t>(n)) == 0, "truncating '", path_,
             "' failed: ", errno_text());
  return true;
}

void File::read_at(void* data, int64_t n, int64_t offset) const {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::pread(fd_.get(), p, static_cast<size_t>(std::min<int64_t>(n, 1 << 30)), offset);
    if (r < 0 && errno == EINTR) continue;
    FSDP_CHECK(r >= 0, "reading '", path_, "' failed: ", errno_text());
    FSDP_CHECK(r > 0, "'", path_, "' ended early (truncated?)");
    p += r;
    n -= r;
    offset += r;
  }
}

void File::prefetch(int64_t offset, int64_t n) const {
  (void)::posix_fadvise(fd_.get(), static_cast<off_t>(offset), static_cast<off_t>(n), POSIX_FADV_WILLNEED);
}

void File::sync_and_close() {
  FSDP_CHECK(::fsync(fd_.get()) == 0, "fsync of '", path_, "' failed: ", errno_text());
  const int fd = fd_.release();  // closed here, where a failure (lost data) is reported
  FSDP_CHECK(::close(fd) == 0, "closing '", path_, "' failed: ", errno_text());
}

int64_t File::size() const {
  struct stat st {};
  FSDP_CHECK(::fstat(fd_.get(), &st) == 0, "cannot stat '", path_, "': ", errno_text());
  return static_cast<int64_t>(st.st_size);
}

void sync_dir(const std::string& dir) {
  const UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return;
  // EINVAL: this file system does not fsync directories (nothing to make durable that way).
  FSDP_CHECK(::fsync(fd.get()) == 0 || errno == EINVAL, "fsync of the directory '", dir,
             "' failed: ", errno_text(), "; the files renamed into it may not survive a crash");
}

std::string parent_dir(const std::string& path) {
  std::filesystem::path p = std::filesystem::path(path).parent_path();
  return p.empty() ? "." : p.string();
}

std::string read_text(const std::string& path, int64_t limit) {
  File f(path, O_RDONLY);
  const int64_t n = f.size();
  FSDP_CHECK(n <= limit, "'", path, "' is ", n, " bytes, more than the ", limit,
             " allowed; it is not a file fsdp wrote");
  std::string s(static_cast<size_t>(n), '\0');
  if (n > 0) f.read_at(s.data(), n, 0);
  return s;
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".partial";
  File f(tmp, O_WRONLY | O_CREAT | O_TRUNC);
  f.write(text.data(), static_cast<int64_t>(text.size()));
  f.sync_and_close();
  FSDP_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '", tmp, "' to '", path,
             "': ", errno_text());
  sync_dir(parent_dir(path));
}

uint32_t crc32_of(const void* data, int64_t n, uint32_t crc) {
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {
    const auto len = static_cast<uInt>(std::min<int64_t>(n, 1 << 30));
    crc = static_cast<uint32_t>(::crc32(crc, p, len));
    p += len;
    n -= len;
  }
  return crc;
}

}  // namespace fsdp::detail
