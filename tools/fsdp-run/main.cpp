// fsdp-run: start N ranks of any program on this node and supervise them, like torchrun.
//
//   fsdp-run --nproc-per-node 4 ./my_prog args
//   fsdp-run --nproc-per-node 4 --nnodes 2 --node-rank 0 --master-addr H --master-port P -- ./my_prog
//
// Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT and FSDP_LAUNCHER=1; fsdp::Runtime::init() reads them. Links no libtorch, so it
// starts instantly.
#include <CLI/CLI.hpp>

#include <cmath>
#include <iostream>
#include <optional>

#include "fsdp/error.h"
#include "fsdp/launcher.h"

namespace {

// A duration flag in seconds: finite, 0 .. 1 day (what fits in milliseconds without surprise).
std::optional<std::chrono::milliseconds> seconds_flag(const char* flag, double seconds) {
  if (!std::isfinite(seconds) || seconds < 0 || seconds > 86400) {
    std::cerr << "fsdp-run: error: " << flag << " " << seconds
              << " is invalid; use 0 .. 86400 seconds\n";
    return std::nullopt;
  }
  return std::chrono::milliseconds(std::llround(seconds * 1000));
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::LaunchOptions opts;
  opts.name = "fsdp-run";
  opts.devices_flag = "--nproc-per-node";
  double grace_s = 3.0;
  double hold_s = 1.0;

  opts.num_nodes_flag = "--nnodes";
  // CLI11 prints its own "Usage:" line; the description shows where the program goes.
  CLI::App app{"fsdp-run: start and supervise the ranks of a distributed program on this node.\n"
               "  fsdp-run [options] [--] program [args...]",
               "fsdp-run"};
  app.prefix_command();  // everything from the first positional on belongs to the program
  app.add_option("--nproc-per-node", opts.nproc_per_node, "ranks to start on this node")
      ->capture_default_str();
  app.add_option("--nnodes,--num-nodes", opts.num_nodes, "nodes in the job")->capture_default_str();
  app.add_option("--node-rank", opts.node_rank, "this node's index, 0 .. nnodes-1")
      ->capture_default_str();
  app.add_option("--master-addr", opts.master_addr, "host of rank 0 (on node 0)")
      ->capture_default_str();
  app.add_option("--master-port", opts.master_port,
                 "port of rank 0's rendezvous store; 0 = pick a free one (single node only)")
      ->capture_default_str();
  app.add_option("--threads", opts.threads,
                 "intra-op threads per rank (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS); "
                 "0 = max(1, cores / nproc-per-node) unless already set in the environment")
      ->capture_default_str();
  app.add_option("--max-restarts", opts.max_restarts,
                 "when a rank fails, stop every rank and start them all again, up to this many "
                 "times (TORCHELASTIC_RESTART_COUNT tells the ranks which attempt they are)")
      ->capture_default_str();
  app.add_option("--grace-period", grace_s,
                 "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->capture_default_str();
  app.add_option("--output-hold", hold_s,
                 "seconds a line one rank wrote to stderr waits for the same line from the other "
                 "ranks, to be shown once as '... [ranks 0-3]'; 0 = forward every line at once")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "fsdp-run: error: " << e.what() << " (see fsdp-run --help)\n";
    return 2;
  }
  std::vector<std::string> program = app.remaining();
  if (!program.empty() && program.front() == "--") program.erase(program.begin());
  if (program.empty()) {
    std::cerr << "fsdp-run: error: no program given; usage: fsdp-run [options] [--] program "
                 "[args...]\n";
    return 2;
  }
  const auto grace = seconds_flag("--grace-period", grace_s);
  const auto hold = seconds_flag("--output-hold", hold_s);
  if (!grace || !hold) return 2;
  opts.grace = *grace;
  opts.output_hold = *hold;
  try {
    return fsdp::supervise(opts, program);
  } catch (const fsdp::Error& e) {
    std::cerr << "fsdp-run: error: " << e.what() << "\n";
    return 2;
  }
}
