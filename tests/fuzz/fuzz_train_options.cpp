// libFuzzer target: fsdp-train's command line, the way its main() checks it before starting
// anything: CLI11 parses the flags that add_flags declares, then fsdp::validate(launch) and
// check_options(). The input is the argument list, one argument per line. Flags that name files
// to create or read (--metrics, --plot, --data, --val-data, --init-from, --checkpoint-dir,
// --resume, --export-full, --export-llmc, --check-checkpoint and CLI11's --config) make the input
// uninteresting: the fuzzer must not write files where an input tells it to.
#include <CLI/CLI.hpp>

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/launcher.h"
#include "fuzz_common.h"
#include "options.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"fsdp-train"};
  std::istringstream lines(std::string(reinterpret_cast<const char*>(data), size));
  std::string line;
  while (std::getline(lines, line)) {
    for (const char* f : {"--metrics", "--plot", "--data", "--val-data", "--init-from",
                          "--checkpoint-dir", "--export-full", "--export-llmc", "--resume",
                          "--config", "--check-checkpoint"}) {
      if (line.find(f) != std::string::npos) return -1;  // not added to the corpus
    }
    args.push_back(line);
  }
  if (args.size() > 64) return -1;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());

  fsdp_train::TrainOptions o;
  CLI::App app{"fsdp-train"};
  fsdp_train::add_flags(app, o);
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::Error&) {
    return 0;  // a usage error CLI11 reports (main prints it and exits 2)
  }
  fsdp_fuzz::expect_ok_or_fsdp_error("fsdp-train option checks", [&] {
    fsdp::validate(o.launch);
    fsdp_train::check_options(o, o.launch.nproc_per_node * o.launch.num_nodes,
                              o.launch.nproc_per_node);
  });
  return 0;
}
