// GPT-2's byte-level BPE (see bpe.h).
#include "bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fsdp/error.h"

namespace fsdp_tokenize {

using fsdp::cat;

namespace {

// GPT-2's pre-tokenisation pattern, as encoder.py and gpt-3-encoder write it.
constexpr const char* kPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FSDP_CHECK(in, "cannot read '", path, "' (", std::strerror(errno),
             "); install GPT-2's BPE "
             "files with scripts/setup.sh or give --encoder and --vocab");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

}  // namespace

struct Gpt2Bpe::Regex {
  pcre2_code* code = nullptr;
  pcre2_match_data* match = nullptr;
  ~Regex() {
    if (match) pcre2_match_data_free(match);
    if (code) pcre2_code_free(code);
  }
};

Gpt2Bpe::Gpt2Bpe(const std::string& encoder_json, const std::string& vocab_bpe)
    : regex_(std::make_unique<Regex>()) {
  try {
    const auto j = nlohmann::json::parse(read_file(encoder_json));
    for (const auto& [symbol, id] : j.items()) encoder_[symbol] = id.get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    throw fsdp::Error(cat("'", encoder_json, "' is not GPT-2's encoder.json (", e.what(), ")"));
  }
  std::istringstream merges(read_file(vocab_bpe));
  std::string line;
  int64_t rank = 0;
  for (int64_t n = 1; std::getline(merges, line); ++n) {
    if (n == 1 && line.rfind("#version", 0) == 0) continue;
    if (line.empty()) continue;
    FSDP_CHECK(line.find(' ') != std::string::npos, "'", vocab_bpe, "' line ", n,
               " is not a merge 'a b'; give GPT-2's vocab.bpe");
    ranks_[line] = rank++;
  }
  FSDP_CHECK(!encoder_.empty() && rank > 0, "'", encoder_json, "' or '", vocab_bpe,
             "' is empty; give GPT-2's files");
  // bytes_to_unicode: printable bytes stand for themselves, the others for 256 + n.
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    byte_symbol_[b] = utf8(printable ? b : 256 + n++);
  }
  int err = 0;
  PCRE2_SIZE at = 0;
  regex_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED,
                               PCRE2_UTF | PCRE2_UCP, &err, &at, nullptr);
  FSDP_CHECK(regex_->code != nullptr, "PCRE2 cannot compile GPT-2's pattern (error ", err, " at ",
             at, "); this PCRE2 lacks Unicode support");
  regex_->match = pcre2_match_data_create_from_pattern(regex_->code, nullptr);
}

Gpt2Bpe::~Gpt2Bpe() = default;

const std::vector<int64_t>& Gpt2Bpe::bpe(const std::string& piece) {
  auto hit = cache_.find(piece);
  if (hit != cache_.end()) return hit->second;
  std::vector<std::string> word;
  for (unsigned char c : piece) word.push_back(byte_symbol_[c]);
  while (word.size() > 1) {
    // The adjacent pair of lowest merge rank.
    int64_t best = std::numeric_limits<int64_t>::max();
    std::string first, second;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      auto r = ranks_.find(word[i] + " " + word[i + 1]);
      if (r != ranks_.end() && r->second < best) {
        best = r->second;
        first = word[i];
        second = word[i + 1];
      }
    }
    if (best == std::numeric_limits<int64_t>::max()) break;
    std::vector<std::string> merged;
    for (size_t i = 0; i < word.size();) {
      if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
        merged.push_back(first + second);
        i += 2;
      } else {
        merged.push_back(word[i]);
        i += 1;
      }
    }
    word.swap(merged);
  }
  std::vector<int64_t> ids;
  for (const auto& symbol : word) {
    auto id = encoder_.find(symbol);
    FSDP_CHECK(id != encoder_.end(), "symbol '", symbol,
               "' is not in encoder.json; the "
               "encoder.json and vocab.bpe given do not belong together");
    ids.push_back(id->second);
  }
  return cache_.emplace(piece, std::move(ids)).first->second;
}

std::vector<int64_t> Gpt2Bpe::encode(const std::string& text) {
  std::vector<int64_t> out;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  PCRE2_SIZE offset = 0;
  uint32_t options = 0;  // the first match checks the whole text's UTF-8, the others need not
  while (offset < text.size()) {
    const int rc =
        pcre2_match(regex_->code, subject, text.size(), offset, options, regex_->match, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      throw fsdp::Error(
          cat("the text is not valid UTF-8 near byte ", pcre2_get_startchar(regex_->match), " (",
              reinterpret_cast<const char*>(message), "); convert it to UTF-8 first"));
    }
    options = PCRE2_NO_UTF_CHECK;
    const PCRE2_SIZE* v = pcre2_get_ovector_pointer(regex_->match);
    const auto& ids = bpe(text.substr(v[0], v[1] - v[0]));
    out.insert(out.end(), ids.begin(), ids.end());
    offset = v[1];
  }
  return out;
}

}  // namespace fsdp_tokenize
