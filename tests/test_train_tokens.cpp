// fsdp-train on token files and GPT-2, end to end as real processes: llm.c and nanoGPT token files
// (detection, shards by glob, every bad-file case failing in one line before anything starts),
// the same global batches for W = 1, 2, 4, validation loss (llm.c's convention) in metrics,
// summary and plot, memory-mapped reading (RSS does not grow with a 4 GiB file), bit-identical
// resume, GPT-2 124M's parameter count, the llm.c model file round trip, and parity with an
// independent PyTorch GPT-2 (tests/python/gpt2_reference.py) under NO_SHARD, FULL_SHARD and
// HYBRID_SHARD (2, 2).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "testing.h"

using namespace fsdp::testing;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

const std::string kReference = std::string(FSDP_SOURCE_DIR) + "/tests/python/gpt2_reference.py";

// Tokens with structure a model can learn (a repeated phrase of ids spread over GPT-2's
// vocabulary, plus a little noise), so losses move in a few steps.
std::vector<uint16_t> make_tokens(int64_t n, uint32_t seed) {
  std::vector<uint16_t> t(n);
  uint32_t x = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    t[i] = static_cast<uint16_t>((x >> 28) == 0 ? (x >> 8) % 50257 : (i % 37) * 1357 % 50257);
  }
  t[n / 2] = 50256;  // <|endoftext|>, the largest id
  return t;
}

void write_llmc_tokens(const std::string& path, const std::vector<uint16_t>& t,
                       int32_t magic = 20240520, int32_t version = 1, int64_t extra_bytes = 0) {
  int32_t header[256] = {magic, version, static_cast<int32_t>(t.size())};
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  out.write(reinterpret_cast<const char*>(t.data()), 2 * t.size() + extra_bytes);
}

void write_raw_tokens(const std::string& path, const std::vector<uint16_t>& t) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(t.data()), 2 * t.size());
}

// A small GPT-2 (2 layers, width 64, the full vocabulary) with llm.c's optimizer settings.
std::vector<std::string> gpt2_args(std::vector<std::string> extra) {
  std::vector<std::string> argv{kTrain,
                                "--model=gpt2",
                                "--layers=2",
                                "--d-model=64",
                                "--heads=4",
                                "--global-batch=4",
                                "--seq-len=32",
                                "--lr=1e-4",
                                "--warmup-steps=0",
                                "--lr-schedule=constant",
                                "--beta2=0.999",
                                "--weight-decay=0",
                                "--clip-grad=0",
                                "--quiet"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

struct Metrics {
  std::map<int64_t, double> loss, val;
};
Metrics read_metrics(const std::string& path) {
  Metrics m;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    const int64_t step = j["step"].get<int64_t>();
    if (j.contains("val_loss")) {
      m.val[step] = j["val_loss"].get<double>();
    } else {
      m.loss[step] = j["loss"].get<double>();
    }
  }
  return m;
}

int line_count(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

// Runs fsdp-train expecting exit 2 with one line that contains `expect`.
void expect_usage_error(const std::vector<std::string>& argv, const std::string& expect) {
  auto r = run(argv, {}, 60s);
  std::string cmd;
  for (const auto& a : argv) cmd += a + " ";
  EXPECT_EQ(r.exit_code(), 2) << cmd << "\n" << r.output;
  EXPECT_EQ(line_count(r.output), 1) << cmd << "\n" << r.output;
  EXPECT_NE(r.output.find(expect), std::string::npos) << cmd << "\nwanted: " << expect << "\n"
                                                      << r.output;
}

}  // namespace

TEST(TokenFiles, BadFilesFailInOneLineBeforeStarting) {
  TempDir dir;
  const auto tokens = make_tokens(4000, 1);
  write_llmc_tokens(dir / "good.bin", tokens);
  write_llmc_tokens(dir / "magic.bin", tokens, 12345);
  write_llmc_tokens(dir / "version.bin", tokens, 20240520, 2);
  write_llmc_tokens(dir / "short.bin", tokens, 20240520, 1, -2);
  write_raw_tokens(dir / "raw.bin", tokens);
  { std::ofstream(dir / "odd.tok", std::ios::binary) << "abc"; }
  ::mkdir((dir / "subdir").c_str(), 0755);
  auto gpt2 = [&](std::vector<std::string> extra) { return gpt2_args(extra); };
  expect_usage_error(gpt2({"--data", dir / "magic.bin"}),
                     "has no llm.c header (magic 12345, expected 20240520)");
  expect_usage_error(gpt2({"--data", dir / "magic.bin", "--data-format=llmc"}),
                     "is not an llm.c token file: magic 12345");
  expect_usage_error(gpt2({"--data", dir / "version.bin"}),
                     "llm.c token file version 2, expected 1");
  expect_usage_error(gpt2({"--data", dir / "short.bin"}),
                     "is 9022 bytes but its llm.c header says 4000 tokens, which take 9024 bytes");
  expect_usage_error(gpt2({"--data", dir / "raw.bin", "--data-format=nanogpt", "--model=tiny"}),
                     "holds token id 50256, outside the vocabulary of --model tiny");
  expect_usage_error(gpt2({"--data", dir / "good.bin", "--data-format=nanogpt"}),
                     "starts with llm.c's magic 20240520; read it with --data-format llmc");
  expect_usage_error(gpt2({"--data", dir / "odd.tok", "--data-format=nanogpt"}),
                     "is 3 bytes, an odd number");
  expect_usage_error(gpt2({"--data", dir / "none*.bin"}), "matches no file");
  expect_usage_error(gpt2({"--data", dir / "subdir"}), "is a directory");
  expect_usage_error(gpt2({"--data", dir / "good.bin", "--eval-every=2"}),
                     "--eval-every 2 needs --val-data FILE");
  expect_usage_error(
      gpt2({"--data", dir / "good.bin", "--val-data", dir / "good.bin", "--eval-batches=100"}),
      "fewer than the 12801 tokens --eval-batches 100 windows");
  // llm.c model files.
  expect_usage_error(gpt2({"--data", dir / "good.bin", "--init-from", dir / "good.bin"}),
                     "is not an llm.c model file: magic 20240520, expected 20240326");
  expect_usage_error(gpt2({"--data", dir / "good.bin", "--init-from", dir / "odd.tok"}),
                     "shorter than llm.c's 1024-byte header");
  {
    int32_t h[256] = {20240326, 5, 1024, 50257, 2, 4, 64, 50304};
    std::ofstream(dir / "bf16.bin", std::ios::binary).write(reinterpret_cast<char*>(h), sizeof(h));
    h[1] = 3;
    std::ofstream(dir / "trunc.bin", std::ios::binary).write(reinterpret_cast<char*>(h), sizeof(h));
  }
  expect_usage_error(gpt2({"--data", dir / "good.bin", "--init-from", dir / "bf16.bin"}),
                     "is llm.c model version 5, expected 3");
  expect_usage_error(gpt2({"--data", dir / "good.bin", "--init-from", dir / "trunc.bin"}),
                     "is 1024 bytes, but its header (maxT 1024, V 50257, L 2, C 64, Vp 50304) "
                     "needs 13541376");
  expect_usage_error({kTrain, "--model=tiny", "--init-from", dir / "trunc.bin"},
                     "--init-from reads llm.c's GPT-2 model files; add --model gpt2");
}

// Shards by glob (llm.c) and one nanoGPT file of the same tokens train identically; W = 1 and 4
// see the same global batches (losses equal to fp32 rounding) and the same validation losses,
// which are logged at step 0, every --eval-every steps and at the end, and plotted.
// NOTE [token scan]: a process trusts an inherited scan result (the launcher's, passed to the
// ranks it starts) only for a file with the same identity. A planted result beyond the
// vocabulary is used for the unchanged file (the run is refused, naming the planted id); once the
// file's modification time changes, the entry no longer applies and the real scan passes.
TEST(TokenFiles, InheritedScanCountsOnlyForTheSameFile) {
  TempDir tmp;
  const std::string path = tmp / "tokens.bin";
  write_llmc_tokens(path, make_tokens(4096, 3));
  auto planted = [&] {
    struct stat st {};
    EXPECT_EQ(::stat(path.c_str(), &st), 0);
    return ";" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" +
           std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
           std::to_string(st.st_mtim.tv_nsec) + ":1024:4096:2=60000";
  };
  const auto argv = gpt2_args({"--data=" + path, "--steps=1", "--devices=2"});
  const std::map<std::string, std::string> env{{"FSDP_TRAIN_TOKEN_SCAN", planted()}};
  auto r = run(argv, env, 120s);
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_NE(r.output.find("holds token id 60000"), std::string::npos) << r.output;
  const struct timespec times[2] = {{0, UTIME_OMIT}, {1700000000, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  r = run(argv, env, 120s);
  EXPECT_EQ(r.exit_code(), 0) << r.output;
}

TEST(TokenFiles, SameBatchesForEveryFormatAndWorldSize) {
  TempDir dir;
  const auto tokens = make_tokens(30000, 2);
  write_llmc_tokens(dir / "train_000.bin", {tokens.begin(), tokens.begin() + 10000});
  write_llmc_tokens(dir / "train_001.bin", {tokens.begin() + 10000, tokens.end()});
  write_raw_tokens(dir / "train.nanogpt", tokens);
  write_llmc_tokens(dir / "val.bin", make_tokens(2000, 3));
  write_raw_tokens(dir / "val.nanogpt", make_tokens(2000, 3));
  const std::vector<std::string> common = {"--steps=4",      "--val-data",       dir / "val.bin",
                                           "--eval-every=2", "--eval-batches=3", "--seed=5"};
  struct Run {
    std::string name;
    std::vector<std::string> flags;
  };
  const bool plot = std::system("command -v gnuplot >/dev/null 2>&1") == 0;
  const std::vector<Run> runs = {
      {"w1_llmc_glob", {"--data", dir / "train_*.bin", "--strategy=no_shard"}},
      {"w1_nanogpt",
       {"--data", dir / "train.nanogpt", "--data-format=nanogpt", "--val-data", dir / "val.nanogpt",
        "--strategy=no_shard"}},
      {"w4_hybrid_2x2",
       {"--data", dir / "train_*.bin", "--devices=4", "--strategy=hybrid_shard", "--mesh=2,2"}},
  };
  std::vector<Metrics> got;
  for (const auto& r_ : runs) {
    auto argv = gpt2_args(common);
    argv.insert(argv.end(), r_.flags.begin(), r_.flags.end());
    argv.insert(argv.end(), {"--metrics", dir / (r_.name + ".jsonl")});
    if (plot && r_.name == "w1_llmc_glob") argv.insert(argv.end(), {"--plot", dir / "loss.png"});
    const bool progress = r_.name == "w4_hybrid_2x2";  // its progress lines are checked below
    if (progress) argv.erase(std::remove(argv.begin(), argv.end(), "--quiet"), argv.end());
    auto r = run(argv, {}, 120s);
    ASSERT_EQ(r.exit_code(), 0) << r_.name << "\n" << r.output;
    EXPECT_NE(r.output.find("val loss "), std::string::npos) << r.output;
    if (progress) {
      // The last progress line comes before the summary, also through the 4-rank supervisor
      // (which held it up to a second on stderr), and shows the step's validation loss, the
      // summary's (it showed step 2's).
      const size_t last = r.output.find("step 4/4  loss ");
      const size_t summary = r.output.find("fsdp-train summary");
      ASSERT_NE(last, std::string::npos) << r.output;
      ASSERT_NE(summary, std::string::npos) << r.output;
      EXPECT_LT(last, summary) << r.output;
      const size_t val = r.output.find("  val ", last);
      ASSERT_LT(val, r.output.find('\n', last)) << r.output;
      const std::string shown = r.output.substr(val + 6, r.output.find(' ', val + 6) - val - 6);
      EXPECT_NE(r.output.find("val loss               " + shown + " at step 4 "),
                std::string::npos)
          << "the last progress line shows val " << shown << "\n" << r.output;
    }
    got.push_back(read_metrics(dir / (r_.name + ".jsonl")));
    ASSERT_EQ(got.back().loss.size(), 4u) << r_.name;
    ASSERT_EQ(got.back().val.size(), 3u) << r_.name;  // steps 0, 2, 4
    EXPECT_TRUE(got.back().val.count(0) && got.back().val.count(2) && got.back().val.count(4));
  }
  if (plot) {
    std::ifstream png(dir / "loss.png", std::ios::binary);
    char magic[4] = {};
    png.read(magic, 4);
    EXPECT_EQ(std::string(magic + 1, 3), "PNG");
  }
  // The loss moves: the data has structure and lr 1e-4 is enough in four steps.
  EXPECT_LT(got[0].val.at(4), got[0].val.at(0));
  for (size_t i = 1; i < runs.size(); ++i) {
    for (const auto& [step, loss] : got[0].loss) {
      if (i == 1) {
        EXPECT_EQ(got[i].loss.at(step), loss) << runs[i].name << " step " << step;
      } else {
        EXPECT_NEAR(got[i].loss.at(step), loss, 1e-5) << runs[i].name << " step " << step;
      }
    }
    for (const auto& [step, loss] : got[0].val) {
      EXPECT_NEAR(got[i].val.at(step), loss, 1e-5) << runs[i].name << " val step " << step;
    }
  }
}

// A 4 GiB llm.c file (sparse: all tokens 0) is mapped, not read into memory: the peak RSS of a
// run stays far below the file's size.
TEST(TokenFiles, MemoryMappedRssDoesNotGrowWithTheFile) {
  TempDir dir;
  const std::string path = dir / "huge.bin";
  const int64_t ntok = (int64_t{4} << 30) / 2 - 512;  // 4 GiB in all
  {
    int32_t header[256] = {20240520, 1, static_cast<int32_t>(ntok)};
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<char*>(header), sizeof(header));
  }
  ASSERT_EQ(::truncate(path.c_str(), 1024 + 2 * ntok), 0);
  auto r = run({kTrain, "--model=tiny", "--data", path, "--steps=2", "--global-batch=4",
                "--seq-len=32", "--quiet", "--metrics", dir / "m.jsonl"},
               {}, 120s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  std::ifstream in(dir / "m.jsonl");
  std::string line;
  int64_t peak = 0;
  while (std::getline(in, line))
    peak = std::max(peak, json::parse(line)["peak_rss_bytes"].get<int64_t>());
  EXPECT_GT(peak, 0);
  EXPECT_LT(peak, int64_t{1} << 30) << "peak RSS " << peak << " bytes with a 4 GiB data file";
}

// Token files resume bit-identically (the data position is in the checkpoint); --data-order
// random is tested so in test_train_checkpoint.
TEST(TokenFiles, ResumeIsBitIdentical) {
  TempDir dir;
  write_llmc_tokens(dir / "train.bin", make_tokens(20000, 4));
  for (const std::string order : {"sequential"}) {  // random: test_train_checkpoint
    const std::string ck = dir / ("ck_" + order);
    auto args = [&](std::vector<std::string> extra) {
      extra.insert(extra.end(), {"--data", dir / "train.bin", "--steps=4", "--data-order=" + order,
                                 "--checkpoint-dir=" + ck});
      return gpt2_args(extra);
    };
    auto r = run(args({"--checkpoint-every=2", "--metrics", dir / "full.jsonl"}), {}, 120s);
    ASSERT_EQ(r.exit_code(), 0) << r.output;
    std::filesystem::remove_all(ck + "/step-00000004");
    r = run(args({"--resume", "--metrics", dir / "resumed.jsonl"}), {}, 120s);
    ASSERT_EQ(r.exit_code(), 0) << r.output;
    const auto full = read_metrics(dir / "full.jsonl"),
               resumed = read_metrics(dir / "resumed.jsonl");
    ASSERT_EQ(resumed.loss.size(), 2u) << order;
    for (const auto& [step, loss] : resumed.loss) {
      EXPECT_EQ(loss, full.loss.at(step)) << order << " step " << step;
    }
  }
}

// --export-dcp then --init-from-optimizer continues the run: the optimizer's state, the data
// position and the learning-rate schedule of step 3 (a warm-up still rising there), so steps 4-6
// equal a straight run's (NOTE [continuing a PyTorch run]; PyTorch itself: dcp_pytorch_test.sh).
TEST(Gpt2, DcpExportContinuesTheRunAndItsSchedule) {
  fsdp::testing::TempDir tmp;
  const std::string dir = tmp.path();
  write_llmc_tokens(dir + "/train.bin", make_tokens(20000, 5));
  auto args = [&](const std::string& steps, std::vector<std::string> extra) {
    extra.insert(extra.end(), {"--data", dir + "/train.bin", "--data-order=sequential",
                               "--warmup-steps=6", "--lr=1e-3", "--weight-decay=0.1",
                               "--global-batch=6",
                               "--steps=" + steps});
    return gpt2_args(extra);
  };
  auto r = run(args("6", {"--metrics", dir + "/straight.jsonl"}), {}, 120s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  r = run(args("3", {"--devices=2", "--export-dcp", dir + "/dcp"}), {}, 120s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  r = run(args("6", {"--devices=3", "--init-from", dir + "/dcp", "--init-from-optimizer",
                     "--metrics", dir + "/continued.jsonl"}), {}, 120s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  const auto straight = read_metrics(dir + "/straight.jsonl"),
             continued = read_metrics(dir + "/continued.jsonl");
  ASSERT_EQ(continued.loss.size(), 3u);
  for (const auto& [step, loss] : continued.loss) {
    EXPECT_NEAR(loss, straight.loss.at(step), 1e-5 * std::abs(loss)) << "step " << step;
  }
  std::ifstream in(dir + "/continued.jsonl");
  std::string first;
  std::getline(in, first);
  EXPECT_EQ(json::parse(first)["step"].get<int64_t>(), 4);
  EXPECT_NEAR(json::parse(first)["lr"].get<double>(), 1e-3 * 4 / 6, 1e-12);  // warm-up step 4 of 6
  // Found when the ranks read the checkpoint: every rank fails with the same line.
  r = run(args("3", {"--devices=2", "--init-from", dir + "/dcp", "--init-from-optimizer"}), {},
          120s);
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_NE(r.output.find("fsdp-train: error: ranks 0,1: --init-from-optimizer: " + dir +
                          "/dcp is at step 3, and --steps 3 counts the total; give --steps 4 or "
                          "more"),
            std::string::npos) << r.output;
  expect_usage_error(args("6", {"--init-from-optimizer"}),
                     "--init-from-optimizer reads AdamW's state from a PyTorch distributed "
                     "checkpoint");
  expect_usage_error(args("6", {"--dcp-rename", "(=x"}), "is not a regular expression");
}

TEST(Gpt2, ThePresetIsGpt2_124M) {
  auto r = run({kTrain, "--model=gpt2", "--dry-run", "--json"}, {}, 60s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  const json j = json::parse(r.output);
  EXPECT_EQ(j["total_params"].get<int64_t>(), 124475904);  // llm.c's count with Vp = 50304
}

// --export-llmc writes the file --init-from reads: a run started from it sees exactly the weights
// the first run ended with (its validation loss at step 0 equals the first run's last one).
TEST(Gpt2, LlmcExportThenInitFromGivesIdenticalLosses) {
  TempDir dir;
  write_llmc_tokens(dir / "train.bin", make_tokens(20000, 5));
  write_llmc_tokens(dir / "val.bin", make_tokens(2000, 6));
  const std::vector<std::string> common = {"--data", dir / "train.bin", "--val-data",
                                           dir / "val.bin", "--eval-batches=2"};
  auto argv = gpt2_args(common);
  argv.insert(argv.end(),
              {"--steps=3", "--export-llmc", dir / "model.bin", "--metrics", dir / "a.jsonl"});
  auto r = run(argv, {}, 120s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  struct stat st {};
  ASSERT_EQ(::stat((dir / "model.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 13541376);  // 1024 + 4 x 3,385,088 parameters
  argv = gpt2_args(common);
  argv.insert(argv.end(), {"--steps=1", "--init-from", dir / "model.bin", "--metrics",
                           dir / "b.jsonl", "--export-llmc", dir / "again.bin"});
  r = run(argv, {}, 120s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_EQ(read_metrics(dir / "b.jsonl").val.at(0), read_metrics(dir / "a.jsonl").val.at(3));
}

// Issue 38: an llm.c model file gives its shape (here context 64, not the preset's 1024, and 2
// blocks of width 64): --model gpt2 --init-from needs no shape flags, and one that differs from
// the file is an error naming the flag that would match.
TEST(Gpt2, InitFromTakesTheLlmcFilesShape) {
  TempDir dir;
  write_llmc_tokens(dir / "train.bin", make_tokens(20000, 5));
  write_llmc_tokens(dir / "val.bin", make_tokens(2000, 6));
  auto argv = gpt2_args({"--data", dir / "train.bin", "--val-data", dir / "val.bin",
                         "--eval-batches=2", "--context=64", "--steps=2", "--export-llmc",
                         dir / "model.bin", "--metrics", dir / "a.jsonl"});
  auto r = run(argv, {}, 120s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  const std::vector<std::string> bare = {kTrain, "--model=gpt2", "--init-from", dir / "model.bin",
                                         "--data", dir / "train.bin", "--val-data",
                                         dir / "val.bin", "--eval-batches=2", "--global-batch=4",
                                         "--seq-len=32", "--steps=1", "--quiet"};
  argv = bare;
  argv.insert(argv.end(), {"--metrics", dir / "b.jsonl"});
  r = run(argv, {}, 120s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_EQ(read_metrics(dir / "b.jsonl").val.at(0), read_metrics(dir / "a.jsonl").val.at(2));
  argv = bare;
  argv.push_back("--context=1024");
  expect_usage_error(argv, "is another shape than --model gpt2 (d 64, 2 blocks, 4 heads): the "
                           "file has context 64 (the model has 1024; --context 64)");
  argv = bare;
  argv.push_back("--layers=3");
  expect_usage_error(argv, "the file has layers 2 (the model has 3; --layers 2)");
  argv = bare;
  argv.push_back("--seq-len=65");
  expect_usage_error(argv, "--seq-len 65 is outside 1..64");
}

// The same file and token batch in an independent PyTorch GPT-2: the first loss within 1e-5, and
// after five AdamW steps with llm.c's settings still within 1e-4, for three strategies.
TEST(Gpt2, ParityWithPyTorch) {
  if (run({"/usr/bin/python3", "-c", "import torch"}).exit_code() != 0) {
    GTEST_SKIP() << "/usr/bin/python3 has no torch module (apt-get install python3-torch)";
  }
  TempDir dir;
  write_llmc_tokens(dir / "train.bin", make_tokens(4000, 7));
  auto argv =
      gpt2_args({"--data", dir / "train.bin", "--steps=1", "--export-llmc", dir / "init.bin"});
  auto r = run(argv, {}, 60s);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  auto py = run({"/usr/bin/python3", kReference, dir / "init.bin", dir / "train.bin", "4", "32",
                 "5", "1e-4", "0.9", "0.999", "1e-8", "0"},
                {}, 120s);
  ASSERT_EQ(py.exit_code(), 0) << py.output;
  const auto reference = json::parse(py.output)["losses"].get<std::vector<double>>();
  ASSERT_EQ(reference.size(), 5u);
  EXPECT_LT(reference[4], reference[0] - 1e-3) << "the reference's loss should move in 5 steps";
  const std::vector<std::vector<std::string>> runs = {
      {"--strategy=no_shard"},
      {"--devices=2", "--strategy=full_shard"},
      {"--devices=4", "--strategy=hybrid_shard", "--mesh=2,2"},
  };
  for (const auto& flags : runs) {
    argv = gpt2_args({"--data", dir / "train.bin", "--data-order=sequential", "--steps=5",
                      "--init-from", dir / "init.bin", "--metrics", dir / "m.jsonl"});
    argv.insert(argv.end(), flags.begin(), flags.end());
    r = run(argv, {}, 120s);
    ASSERT_EQ(r.exit_code(), 0) << flags.back() << "\n" << r.output;
    const auto m = read_metrics(dir / "m.jsonl");
    ASSERT_EQ(m.loss.size(), 5u);
    EXPECT_NEAR(m.loss.at(1), reference[0], 1e-5) << flags.back() << " step 1";
    for (int64_t s = 2; s <= 5; ++s) {
      EXPECT_NEAR(m.loss.at(s), reference[s - 1], 1e-4) << flags.back() << " step " << s;
    }
  }
}
