// GPT-2's byte-level BPE (Radford et al. 2019; OpenAI's encoder.py, which npm's gpt-3-encoder
// ports): text is split by GPT-2's pre-tokenisation pattern (PCRE2 with Unicode properties), each
// piece's UTF-8 bytes are mapped to printable characters (bytes_to_unicode) and merged by the
// ranks of vocab.bpe, and the merged symbols are looked up in encoder.json. No libtorch.
// Not thread-safe (encode() caches pieces).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp_tokenize {

// GPT-2's <|endoftext|>, which llm.c puts before every document.
constexpr int64_t kEndOfText = 50256;

class Gpt2Bpe {
 public:
  // Reads encoder.json and vocab.bpe; throws fsdp::Error naming a file that is missing or
  // malformed.
  Gpt2Bpe(const std::string& encoder_json, const std::string& vocab_bpe);
  ~Gpt2Bpe();
  Gpt2Bpe(const Gpt2Bpe&) = delete;
  Gpt2Bpe& operator=(const Gpt2Bpe&) = delete;

  // The token ids of `text` (UTF-8; throws fsdp::Error naming the byte offset of invalid UTF-8).
  std::vector<int64_t> encode(const std::string& text);
  int64_t vocab_size() const { return static_cast<int64_t>(encoder_.size()); }

 private:
  const std::vector<int64_t>& bpe(const std::string& piece);

  std::unordered_map<std::string, int64_t> encoder_;  // symbol (mapped UTF-8) -> id
  std::unordered_map<std::string, int64_t> ranks_;    // "a b" -> merge rank
  std::string byte_symbol_[256];                      // bytes_to_unicode, as UTF-8
  std::unordered_map<std::string, std::vector<int64_t>> cache_;
  struct Regex;
  std::unique_ptr<Regex> regex_;
};

}  // namespace fsdp_tokenize
