// fsdp-tokenize: GPT-2's BPE gives the same ids as npm gpt-3-encoder's own encoder under node
// (tests/node/gpt2_encode.js) on ~400 KiB of real English text (Debian's fortunes); its train/val
// files are llm.c token files; bad input fails in one line.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "testing.h"

using namespace fsdp::testing;
using namespace std::chrono_literals;

namespace {

const std::string kTokenize = tool_dir() + "/fsdp-tokenize";
const std::string kFortunes = "/usr/share/games/fortunes";
const std::string kPackage = FSDP_GPT2_BPE_DIR;

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

}  // namespace

TEST(Tokenize, SameIdsAsGpt3EncoderUnderNode) {
  if (!exists(kFortunes + "/computers"))
    GTEST_SKIP() << "no " << kFortunes << " (apt-get install fortunes)";
  if (run({"/bin/sh", "-c", "command -v node"}).exit_code() != 0)
    GTEST_SKIP() << "no node (apt-get install nodejs)";
  if (!exists(kPackage + "/Encoder.js")) GTEST_SKIP() << "no " << kPackage << " (scripts/setup.sh)";
  TempDir dir;
  {
    std::ofstream out(dir / "text.txt", std::ios::binary);
    for (const char* f : {"computers", "science", "literature"})
      out << read_all(kFortunes + "/" + f);
  }
  auto ours = run({kTokenize, "--ids", dir / "text.txt"}, {}, 60s);
  ASSERT_EQ(ours.exit_code(), 0) << ours.output;
  auto node =
      run({"/usr/bin/env", "node", std::string(FSDP_SOURCE_DIR) + "/tests/node/gpt2_encode.js",
           kPackage, dir / "text.txt"},
          {}, 120s);
  ASSERT_EQ(node.exit_code(), 0) << node.output;
  const auto a = nlohmann::json::parse(ours.output).get<std::vector<int64_t>>();
  const auto b = nlohmann::json::parse(node.output).get<std::vector<int64_t>>();
  EXPECT_GT(a.size(), 80000u);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i], b[i]) << "first difference at token " << i;
  }
}

TEST(Tokenize, WritesLlmcTrainAndValFiles) {
  TempDir dir;
  {
    std::ofstream out(dir / "a.txt");
    for (int i = 0; i < 200; ++i) out << "The quick brown fox jumps over the lazy dog. ";
  }
  auto r = run({kTokenize, "-o", dir / "fox", "--val-fraction", "0.25", dir / "a.txt"}, {}, 60s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  for (const char* split : {"train", "val"}) {
    const std::string bytes = read_all(dir / (std::string("fox_") + split + ".bin"));
    ASSERT_GE(bytes.size(), 1026u) << split;
    int32_t header[3];
    std::memcpy(header, bytes.data(), sizeof(header));
    EXPECT_EQ(header[0], 20240520) << split;
    EXPECT_EQ(header[1], 1) << split;
    EXPECT_EQ(int64_t(bytes.size()), 1024 + 2 * int64_t(header[2])) << split;
  }
  const std::string val = read_all(dir / "fox_val.bin");
  uint16_t first;
  std::memcpy(&first, val.data() + 1024, 2);
  EXPECT_EQ(first, 50256) << "a document starts with <|endoftext|>";
  // <|endoftext|>, 200 x 10 tokens and the trailing space: 2002, a quarter of them (rounded) val.
  int32_t ntrain, nval;
  std::memcpy(&ntrain, read_all(dir / "fox_train.bin").data() + 8, 4);
  std::memcpy(&nval, val.data() + 8, 4);
  EXPECT_EQ(ntrain + nval, 2002);
  EXPECT_EQ(nval, 501);
}

TEST(Tokenize, BadInputFailsInOneLine) {
  TempDir dir;
  std::ofstream(dir / "bad.txt", std::ios::binary) << "ok \xff\xfe bytes";
  std::ofstream(dir / "ok.txt") << "some text";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{kTokenize, dir / "ok.txt"}, "give -o PREFIX"},
      {{kTokenize, "-o", dir / "x", dir / "missing.txt"}, "cannot read"},
      {{kTokenize, "--ids", dir / "bad.txt"}, "is not valid UTF-8 near byte 3"},
      {{kTokenize, "-o", dir / "x", "--val-fraction", "1.5", dir / "ok.txt"}, "--val-fraction 1.5"},
      {{kTokenize, "--ids", "--encoder", dir / "ok.txt", dir / "ok.txt"},
       "is not GPT-2's encoder.json"},
  };
  for (const auto& [argv, expect] : cases) {
    auto r = run(argv, {}, 60s);
    EXPECT_EQ(r.exit_code(), 2) << argv.back() << "\n" << r.output;
    EXPECT_NE(r.output.find(expect), std::string::npos) << expect << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
}
