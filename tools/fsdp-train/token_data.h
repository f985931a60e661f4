// fsdp-train's training data: token files (llm.c's and nanoGPT's uint16 .bin files) and text read
// as bytes, found from a file name or a glob of shards, checked before any rank starts, and read
// through read-only memory maps (the dataset's size does not count against RSS: only the pages a
// batch touches are read, and the kernel may drop them again). No libtorch here.
//
// NOTE [token files]
// - llm.c (karpathy/llm.c dev/data/data_common.py, llmc/dataloader.h): a header of 256 int32
//   [20240520, 1, ntok, 0, ...], then ntok little-endian uint16 tokens; the size must be exactly
//   1024 + 2 * ntok. Detected by its magic.
// - nanoGPT (prepare.py's train.bin): raw uint16 tokens, no header. It cannot be told from other
//   binary data, so it is only read with --data-format nanogpt.
// - bytes: any file, every byte a token (vocabulary 256): fsdp-train's original text input.
// --data-format auto reads an llm.c header where there is one and a text file as bytes; a ".bin"
// file without llm.c's magic is refused (it is most likely nanoGPT's format, which needs the flag).
// The shards of a glob are concatenated in name order into one token stream; a training window
// may span two shards.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp_train {

enum class DataFormat { kAuto, kBytes, kNanoGPT, kLlmc };
const char* to_string(DataFormat f);
// "auto" | "bytes" | "nanogpt" | "llmc" (any case); throws fsdp::Error naming `flag` otherwise.
DataFormat parse_data_format(const std::string& flag, const std::string& text);

constexpr int32_t kLlmcTokensMagic = 20240520;
constexpr int32_t kLlmcTokensVersion = 1;
constexpr int64_t kLlmcHeaderBytes = 256 * 4;

// One file of a dataset, inspected.
struct TokenFile {
  std::string path;
  DataFormat format = DataFormat::kBytes;  // never kAuto
  int64_t offset = 0;                      // bytes before the first token
  int64_t tokens = 0;
  int64_t token_bytes() const { return format == DataFormat::kBytes ? 1 : 2; }
};

// A dataset: one file or the shards of a glob, in order.
struct DataSource {
  std::vector<TokenFile> files;
  DataFormat format = DataFormat::kBytes;  // the files', all the same
  int64_t tokens = 0;                      // over all files
  int64_t max_token = -1;                  // largest token id, found by reading every file
  std::string label;                       // for people: the --data value, or the default corpus
};

// Expands `spec` (a file name or a shell glob; "[" "*" "?" make it a glob) and inspects every file
// in `format`: one line naming `flag` and the file for an empty glob, a directory, an unreadable
// file, a wrong llm.c magic, version or size, an odd nanoGPT size, or mixed formats. Reads every
// token once (pread in 1 MiB chunks, nothing kept) to find max_token, unless this process
// inherited the result for the unchanged file from the launcher (NOTE [token scan] in
// token_data.cpp).
DataSource inspect_data(const std::string& flag, const std::string& spec, DataFormat format);

// The same for a list of text files read as bytes (the default corpus).
DataSource inspect_text_files(const std::vector<std::string>& paths, const std::string& label);

// The checks a dataset must pass for a model: at least `need` tokens (`need_what` says why), every
// token id below `vocab` (`model` names the model in the message).
void check_data_fits(const std::string& flag, const DataSource& d, int64_t need,
                     const std::string& need_what, int64_t vocab, const std::string& model);

// The tokens of a DataSource through read-only shared memory maps (MAP_SHARED, PROT_READ): pages
// are read on first touch and belong to the page cache, not to this process's heap. Not
// thread-safe to construct; read() may be called from any thread.
class TokenStream {
 public:
  explicit TokenStream(const DataSource& data);
  ~TokenStream();
  TokenStream(const TokenStream&) = delete;
  TokenStream& operator=(const TokenStream&) = delete;

  int64_t size() const { return total_; }
  // Copies tokens [begin, begin + count) of the concatenated stream into out.
  void read(int64_t begin, int64_t count, int64_t* out) const;

 private:
  struct Map {
    const unsigned char* base = nullptr;  // the whole file mapped
    size_t length = 0;
    TokenFile file;
    int64_t first = 0;  // index of its first token in the stream
  };
  std::vector<Map> maps_;
  int64_t total_ = 0;
};

}  // namespace fsdp_train
