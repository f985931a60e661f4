// fsdp/launcher.h: starting and supervising the ranks of a job on this node.
//
// The supervisor forks one process per local rank, gives each the torchrun-style environment
// (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
// FSDP_LAUNCHER=1, and OMP_NUM_THREADS / OPENBLAS_NUM_THREADS unless the user set them) and waits.
// When a rank exits non-zero or dies, it stops the others (SIGTERM, then SIGKILL after a grace
// period) and reports the rank that failed first in one line (see NOTE [culprit] in supervisor.cpp:
// a frozen (stopped) rank, then one killed by a signal, then one that aborted, then one that
// exited non-zero). With max_restarts > 0 it then starts every rank again, up to that many times,
// exporting TORCHELASTIC_RESTART_COUNT like torchrun. SIGINT/SIGTERM to the supervisor stop every
// rank (SIGTERM, which a rank may handle, e.g. by saving, within the grace period); SIGUSR1 and
// SIGUSR2 to the supervisor are relayed to every rank (SLURM's --signal=B:USR1@T). Ranks get PR_SET_PDEATHSIG, so even a SIGKILLed supervisor leaves no orphans. Each rank's
// stderr passes through the supervisor (a pseudo-terminal when the supervisor's stderr is one), so
// that a line every rank writes, such as an error they all found, is shown once, naming the ranks
// (NOTE [rank output] in rank_output.h).
// No libtorch here: the supervisor never initialises it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/cluster.h"

namespace fsdp {

struct LaunchOptions {
  // Ranks started on this node (--devices / --nproc-per-node). Must be >= 1.
  int64_t nproc_per_node = 1;
  // Nodes in the job (--num-nodes) and this node's index (--node-rank).
  int64_t num_nodes = 1;
  int64_t node_rank = 0;
  // Host of rank 0's rendezvous store (--master-addr). Every node must pass the same value.
  std::string master_addr = "127.0.0.1";
  // Its port (--master-port). 0 picks a free port, allowed only for a single-node job.
  int master_port = 0;
  // Intra-op threads per rank. 0: max(1, cores / nproc_per_node). Exported as OMP_NUM_THREADS
  // and OPENBLAS_NUM_THREADS unless the user's environment sets them.
  int64_t threads = 0;
  // Time between SIGTERM and SIGKILL when stopping ranks.
  std::chrono::milliseconds grace{3000};
  // The same when the supervisor itself got SIGINT/SIGTERM (a preemption), if longer than
  // `grace`: ranks that save on SIGTERM get this long. A rank's failure still gives `grace`.
  std::chrono::milliseconds signal_grace{0};
  // How long a line one rank wrote to stderr waits for the same line from the other ranks of this
  // node, so that it is shown once ("... [ranks 0-3]"; NOTE [rank output] in rank_output.h). Lines
  // of different ranks leave in the order they arrived either way. 0 forwards every line at once.
  std::chrono::milliseconds output_hold{1000};
  // When a rank fails, stop every rank and start them all again, up to this many times
  // (--max-restarts, like torchrun's). Each attempt's ranks see TORCHELASTIC_RESTART_COUNT (0 for
  // the first) and TORCHELASTIC_MAX_RESTARTS. Interrupts (Ctrl-C) are never restarted. Default 0.
  int64_t max_restarts = 0;
  // Prefix of the supervisor's messages ("fsdp-run: rank 2 ...") and the flag that sets
  // nproc_per_node, so errors name the flag the user typed.
  std::string name = "fsdp-run";
  std::string devices_flag = "--nproc-per-node";
  std::string num_nodes_flag = "--num-nodes";
};

// Throws fsdp::Error for invalid options: --devices 0, a node rank outside [0, num_nodes), a
// multi-node job without --master-port, a port outside 1..65535 or already bound on this machine.
void validate(const LaunchOptions& opts);

// Starts opts.nproc_per_node copies of `argv` (argv[0] is the executable; PATH is searched) with
// each rank's environment and supervises them. Returns 0 if every rank exited 0; otherwise the
// failed rank's exit status (128 + signal number for a signal) after printing one line to stderr.
// `executable` overrides the file that is run (argv[0] is still passed as the program name).
int supervise(const LaunchOptions& opts, const std::vector<std::string>& argv,
              const std::string& executable = "");

// For programs that launch themselves (fsdp-train --devices 4): if this process was started by a
// launcher (see detect_cluster) or the job is one process, returns nullopt and the caller goes on
// as a rank. Otherwise re-executes this program (/proc/self/exe, same arguments) as every local
// rank, supervises them and returns the exit code the caller should exit with.
std::optional<int> launch_self(int argc, char** argv, const LaunchOptions& opts);

}  // namespace fsdp
