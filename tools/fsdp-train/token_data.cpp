// Token files: detection, checks and memory-mapped reading (see token_data.h).
#include "token_data.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "fsdp/error.h"
#include "fsdp/parse_enum.h"

namespace fsdp_train {

using fsdp::cat;

const char* to_string(DataFormat f) {
  switch (f) {
    case DataFormat::kAuto:
      return "auto";
    case DataFormat::kBytes:
      return "bytes";
    case DataFormat::kNanoGPT:
      return "nanogpt";
    case DataFormat::kLlmc:
      return "llmc";
  }
  return "?";
}

DataFormat parse_data_format(const std::string& flag, const std::string& text) {
  return fsdp::parse_enum(
      text, {DataFormat::kAuto, DataFormat::kBytes, DataFormat::kNanoGPT, DataFormat::kLlmc}, flag);
}

namespace {

// A file descriptor, closed on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Reads exactly n bytes at `offset`, or throws naming the file.
void pread_all(int fd, void* buf, size_t n, int64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    FSDP_CHECK(got > 0, "reading '", path, "' failed at byte ", offset, " (",
               got == 0 ? "unexpected end of file" : std::strerror(errno), ")");
    p += got;
    n -= static_cast<size_t>(got);
    offset += got;
  }
}

// Opens and classifies one file; fills `file` (format, offset, tokens). `flag` names the flag.
TokenFile inspect_file(const std::string& flag, const std::string& path, DataFormat format) {
  struct stat st {};
  FSDP_CHECK(::stat(path.c_str(), &st) == 0, flag, " '", path, "' cannot be read (",
             std::strerror(errno), "); give an existing file or glob");
  FSDP_CHECK(!S_ISDIR(st.st_mode), flag, " '", path,
             "' is a directory; give a file or a glob of shards, e.g. '", path, "/*.bin'");
  FSDP_CHECK(S_ISREG(st.st_mode), flag, " '", path, "' is not a regular file; give a data file");
  Fd fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  FSDP_CHECK(fd.fd >= 0, flag, " '", path, "' cannot be read (", std::strerror(errno),
             "); check its permissions");
  const int64_t size = static_cast<int64_t>(st.st_size);
  FSDP_CHECK(size > 0, flag, " '", path, "' is empty; give a file with data");
  int32_t header[3] = {0, 0, 0};
  const bool has_header_room = size >= kLlmcHeaderBytes;
  if (size >= static_cast<int64_t>(sizeof(header)))
    pread_all(fd.fd, header, sizeof(header), 0, path);
  const bool llmc_magic = header[0] == kLlmcTokensMagic;

  TokenFile f;
  f.path = path;
  if (format == DataFormat::kAuto) {
    if (llmc_magic) {
      format = DataFormat::kLlmc;
    } else {
      FSDP_CHECK(!ends_with(path, ".bin"), flag, " '", path, "' has no llm.c header (magic ",
                 header[0], ", expected ", kLlmcTokensMagic,
                 "); if it holds raw uint16 "
                 "tokens (nanoGPT) add --data-format nanogpt, for text --data-format bytes");
      format = DataFormat::kBytes;
    }
  }
  f.format = format;
  switch (format) {
    case DataFormat::kLlmc: {
      FSDP_CHECK(has_header_room && llmc_magic, flag, " '", path,
                 "' is not an llm.c token file: "
                 "magic ",
                 header[0], ", expected ", kLlmcTokensMagic,
                 (has_header_room ? ""
                                  : cat(" (and ", size,
                                        " bytes is shorter than its 1024-byte "
                                        "header)")),
                 "; for raw uint16 tokens use --data-format nanogpt");
      FSDP_CHECK(header[1] == kLlmcTokensVersion, flag, " '", path, "': llm.c token file version ",
                 header[1], ", expected ", kLlmcTokensVersion,
                 "; regenerate it with llm.c's "
                 "current dev/data scripts or fsdp-tokenize");
      const int64_t ntok = header[2];
      FSDP_CHECK(ntok >= 0 && size == kLlmcHeaderBytes + 2 * ntok, flag, " '", path, "' is ", size,
                 " bytes but its llm.c header says ", ntok, " tokens, which take ",
                 kLlmcHeaderBytes + 2 * ntok, " bytes (1024 + 2 x ", ntok,
                 "); the file is truncated or not a token file");
      f.offset = kLlmcHeaderBytes;
      f.tokens = ntok;
      break;
    }
    case DataFormat::kNanoGPT:
      FSDP_CHECK(!llmc_magic, flag, " '", path, "' starts with llm.c's magic ", kLlmcTokensMagic,
                 "; read it with --data-format llmc (or auto)");
      FSDP_CHECK(size % 2 == 0, flag, " '", path, "' is ", size,
                 " bytes, an odd number, so it "
                 "is not raw uint16 tokens (nanoGPT); check --data-format");
      f.tokens = size / 2;
      break;
    case DataFormat::kBytes:
      f.tokens = size;
      break;
    case DataFormat::kAuto:
      break;  // resolved above
  }
  return f;
}

// NOTE [token scan]: finding a dataset's largest id reads every byte. fsdp-train's launcher
// (--devices N) scans before it starts the ranks and leaves each file's result in its
// environment, kScanEnv (";<key>=<max>" entries), which the ranks inherit: a rank reads a file
// again only if its identity (device, inode, size, modification time, token region) changed
// since. Under other launchers (torchrun, srun) every rank scans. The variable stays below 64 KiB
// (an environment string may not exceed 128 KiB); files past that are scanned by each rank.
constexpr const char* kScanEnv = "FSDP_TRAIN_TOKEN_SCAN";
constexpr size_t kScanEnvLimit = 64 << 10;

std::string scan_key(const TokenFile& f, int fd) {
  struct stat st {};
  FSDP_CHECK(::fstat(fd, &st) == 0, "cannot stat '", f.path, "': ", std::strerror(errno));
  return cat(st.st_dev, ":", st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".",
             st.st_mtim.tv_nsec, ":", f.offset, ":", f.tokens, ":", f.token_bytes());
}

std::optional<int64_t> inherited_scan(const std::string& key) {
  const char* env = std::getenv(kScanEnv);
  if (!env) return std::nullopt;
  const std::string all(env), entry = ";" + key + "=";
  const auto at = all.find(entry);
  if (at == std::string::npos) return std::nullopt;
  const char* begin = all.c_str() + at + entry.size();
  char* end = nullptr;
  const long long v = std::strtoll(begin, &end, 10);
  if (end == begin || (*end != ';' && *end != '\0') || v < -1) return std::nullopt;
  return v;
}

void remember_scan(const std::string& key, int64_t max) {
  const char* env = std::getenv(kScanEnv);
  const std::string all = cat(env ? env : "", ";", key, "=", max);
  if (all.size() <= kScanEnvLimit) ::setenv(kScanEnv, all.c_str(), 1);
}

// The largest token of `f`, reading it once in 1 MiB chunks (nothing stays in memory), unless
// this process inherited the result (NOTE [token scan]). Holes of a sparse file (SEEK_DATA /
// SEEK_HOLE) read as zeros, i.e. token 0, and are skipped.
int64_t max_token_of(const TokenFile& f) {
  Fd fd{::open(f.path.c_str(), O_RDONLY | O_CLOEXEC)};
  FSDP_CHECK(fd.fd >= 0, "cannot open '", f.path, "': ", std::strerror(errno));
  const std::string key = scan_key(f, fd.fd);
  if (const auto known = inherited_scan(key)) return *known;
  ::posix_fadvise(fd.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  constexpr int64_t kChunk = 1 << 20;
  std::vector<uint16_t> buf16(kChunk / 2);  // 2-byte aligned for uint16 tokens
  auto* buf = reinterpret_cast<unsigned char*>(buf16.data());
  const int64_t end = f.offset + f.tokens * f.token_bytes();
  int64_t best = -1;
  for (int64_t at = f.offset; at < end;) {
    // The data region holding or following `at` (a file system without SEEK_DATA: all data).
    int64_t data = ::lseek(fd.fd, at, SEEK_DATA), stop = end;
    if (data < 0 && errno == ENXIO) data = end;  // only a hole is left
    if (data < 0) data = at;
    if (data > at) best = std::max<int64_t>(best, 0);  // a hole: zeros
    // Holes are whole pages, so `data` stays token-aligned (offset 0 or 1024).
    at = std::min(data, end);
    if (at >= end) break;
    const int64_t hole = ::lseek(fd.fd, at, SEEK_HOLE);
    if (hole > at) stop = std::min(stop, hole);
    for (; at < stop;) {
      const int64_t n = std::min(kChunk, stop - at);
      pread_all(fd.fd, buf, static_cast<size_t>(n), at, f.path);
      // Plain loops: the compiler vectorises them (std::max_element it does not).
      unsigned m = 0;
      if (f.token_bytes() == 1) {
        for (int64_t i = 0; i < n; ++i) m = std::max<unsigned>(m, buf[i]);
      } else {
        for (int64_t i = 0; i < n / 2; ++i) m = std::max<unsigned>(m, buf16[i]);
      }
      best = std::max<int64_t>(best, m);
      at += n;
    }
  }
  // Drop what this pass brought into the page cache: training reads only its windows.
  ::posix_fadvise(fd.fd, 0, 0, POSIX_FADV_DONTNEED);
  remember_scan(key, best);
  return best;
}

DataSource finish(std::vector<TokenFile> files, const std::string& flag, const std::string& label) {
  DataSource d;
  d.label = label;
  d.format = files.front().format;
  for (const auto& f : files) {
    FSDP_CHECK(f.format == d.format, flag, " '", label, "' mixes formats: '", files.front().path,
               "' is ", to_string(d.format), ", '", f.path, "' is ", to_string(f.format),
               "; give shards of one format");
    d.tokens += f.tokens;
    d.max_token = std::max(d.max_token, max_token_of(f));
  }
  d.files = std::move(files);
  return d;
}

}  // namespace

DataSource inspect_data(const std::string& flag, const std::string& spec, DataFormat format) {
  FSDP_CHECK(!spec.empty(), flag, " is empty; give a file or a glob of shards");
  std::vector<std::string> paths;
  if (spec.find_first_of("*?[") == std::string::npos) {
    paths.push_back(spec);
  } else {
    glob_t g{};
    const int rc = ::glob(spec.c_str(), GLOB_ERR, nullptr, &g);
    for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) paths.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    FSDP_CHECK(rc == 0 || rc == GLOB_NOMATCH, flag, " '", spec, "': the glob could not be read (",
               rc == GLOB_NOSPACE ? "out of memory" : "read error",
               "); check the directory's permissions");
    FSDP_CHECK(!paths.empty(), flag, " '", spec, "' matches no file; check the path and pattern");
    std::sort(paths.begin(), paths.end());
  }
  std::vector<TokenFile> files;
  for (const auto& p : paths) files.push_back(inspect_file(flag, p, format));
  return finish(std::move(files), flag, spec);
}

DataSource inspect_text_files(const std::vector<std::string>& paths, const std::string& label) {
  std::vector<TokenFile> files;
  for (const auto& p : paths) files.push_back(inspect_file("--data", p, DataFormat::kBytes));
  return finish(std::move(files), "--data", label);
}

void check_data_fits(const std::string& flag, const DataSource& d, int64_t need,
                     const std::string& need_what, int64_t vocab, const std::string& model) {
  FSDP_CHECK(d.tokens >= need, flag, " '", d.label, "' has ", d.tokens, " tokens, fewer than the ",
             need, " ", need_what, "; give more data or smaller sizes");
  if (d.max_token < vocab) return;
  // Name the first file that holds the offending id.
  std::string where;
  for (const auto& f : d.files) {
    if (max_token_of(f) >= vocab) {
      where = f.path;
      break;
    }
  }
  throw fsdp::Error(cat(flag, " '", where, "' holds token id ", d.max_token,
                        ", outside the vocabulary of --model ", model, " (", vocab, " ids",
                        vocab == 256 ? ", bytes" : "", "); ",
                        vocab == 256 ? "train GPT-2 on token files with --model gpt2"
                                     : "the file was made with another tokenizer"));
}

TokenStream::TokenStream(const DataSource& data) {
  for (const auto& f : data.files) {
    Map m;
    m.file = f;
    m.first = total_;
    Fd fd{::open(f.path.c_str(), O_RDONLY | O_CLOEXEC)};
    FSDP_CHECK(fd.fd >= 0, "cannot open '", f.path, "': ", std::strerror(errno));
    m.length = static_cast<size_t>(f.offset + f.tokens * f.token_bytes());
    void* p = ::mmap(nullptr, m.length, PROT_READ, MAP_SHARED, fd.fd, 0);
    FSDP_CHECK(p != MAP_FAILED, "cannot map '", f.path, "' (", m.length,
               " bytes): ", std::strerror(errno));
    ::madvise(p, m.length, MADV_RANDOM);  // windows are drawn at random: no read-ahead
    m.base = static_cast<const unsigned char*>(p);
    total_ += f.tokens;
    maps_.push_back(m);
  }
}

TokenStream::~TokenStream() {
  for (auto& m : maps_) ::munmap(const_cast<unsigned char*>(m.base), m.length);
}

void TokenStream::read(int64_t begin, int64_t count, int64_t* out) const {
  FSDP_CHECK(begin >= 0 && count >= 0 && begin + count <= total_, "reading tokens [", begin, ", ",
             begin + count, ") of a stream of ", total_, "; this is a bug in fsdp-train");
  // The map holding `begin`: the last whose first token is <= begin.
  auto it = std::upper_bound(maps_.begin(), maps_.end(), begin,
                             [](int64_t b, const Map& m) { return b < m.first; });
  --it;
  while (count > 0) {
    const int64_t local = begin - it->first;
    const int64_t n = std::min(count, it->file.tokens - local);
    const unsigned char* p = it->base + it->file.offset;
    if (it->file.token_bytes() == 1) {
      for (int64_t i = 0; i < n; ++i) out[i] = p[local + i];
    } else {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t t;
        std::memcpy(&t, p + 2 * (local + i), 2);  // little-endian, as llm.c and numpy write it
        out[i] = t;
      }
    }
    out += n;
    begin += n;
    count -= n;
    ++it;
  }
}

}  // namespace fsdp_train
