// Test helpers: ranks as threads over one in-process store, and child processes with deadlines.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fsdp/collectives.h"
#include "fsdp/report.h"
#include "fsdp/runtime.h"
#include "base/sanitizer.h"

namespace fsdp::testing {

// Runs `fn` on `world` threads, each a rank with its own Runtime (Gloo groups over a shared
// c10d::HashStore). `local_world` ranks form a "node" (default: all). Rethrows the first error.
// Collectives time out after `timeout`, so a broken test fails instead of hanging. `backend`
// kNccl gives each rank the GPU of its local rank (tests/test_gpu.cpp).
void run_ranks(int64_t world, const std::function<void(Runtime&)>& fn,
               int64_t local_world = 0,
               std::chrono::milliseconds timeout = std::chrono::seconds(60),
               CollectiveAlgorithm algorithm = CollectiveAlgorithm::kAuto,
               Backend backend = Backend::kGloo);

// A finished child process.
struct ProcessResult {
  int status = 0;          // raw waitpid status
  bool timed_out = false;  // killed by us at the deadline
  std::string output;      // stdout and stderr, interleaved
  int exit_code() const;   // 128 + signal for a signal
  bool killed_by(int sig) const;
};

// Starts `argv` with `env` added to (or, for empty values, removed from) the current environment;
// output goes to a pipe. The destructor SIGKILLs what is still running: no test leaves orphans.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {});
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  int pid() const { return pid_; }
  // Waits up to `deadline`, then SIGKILLs (process group) and reports timed_out.
  ProcessResult wait(std::chrono::milliseconds deadline);
  void signal(int sig);

 private:
  int pid_ = -1;
  int out_fd_ = -1;
  std::string output_;
  bool done_ = false;
  ProcessResult result_;
  void drain();
};

// Runs a command to completion (see Process).
ProcessResult run(const std::vector<std::string>& argv,
                  const std::map<std::string, std::string>& env = {},
                  std::chrono::milliseconds deadline = std::chrono::seconds(120));

// A fresh directory under /tmp, removed with everything in it when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  std::string operator/(const std::string& name) const { return file(name); }

 private:
  std::string path_;
};

// Two snapshots of ShardedModule::comm_counters() around a step: the bytes each group counted in
// between equal the report's prediction (shard all-gather, reduce-scatter and all-reduce;
// replicate all-reduce, and nothing else on the replicate group).
using CommSnapshot = std::vector<std::pair<std::string, CommCounters>>;
void expect_comm_matches_report(const CommSnapshot& before, const CommSnapshot& after,
                                const TopologyReport& report);

// The local addresses (hex, as the kernel prints them) of every TCP socket on local `port` in
// `state` ("0A": listening, "06": TIME_WAIT), read from /proc/net/tcp and /proc/net/tcp6.
std::vector<std::string> tcp_sockets(int port, const std::string& state);

// A TCP port nobody listens on right now.
int free_port();

// The pids of `pid`'s children, polled until there are `n` (for at most 30 s).
std::vector<int> children_of(int pid, size_t n);

// Fault injection from outside the program under test (the library carries no test switch): once
// `due()` holds, SIGKILLs the child of `launcher` (an fsdp-run or fsdp-train --devices supervisor)
// that runs local rank `local_rank`, found by LOCAL_RANK in its environment. Polls every 5 ms for
// at most `deadline`; returns the killed pid, or -1 if `due()` never held or the rank never ran.
int kill_local_rank_when(const Process& launcher, int local_rank,
                         const std::function<bool()>& due, std::chrono::milliseconds deadline);

// Files the tool tests write and check: `text` into `path`; whether `path` starts with PNG's
// signature; whether gnuplot is in PATH (the plot tests skip without it, saying so).
void write_file(const std::string& path, const std::string& text);
bool is_png(const std::string& path);
bool have_gnuplot();

// step -> loss of an fsdp-train --metrics file (JSON Lines).
std::map<int64_t, double> metrics_losses(const std::string& file);

// How much slower than a plain build this one runs (FSDP_TEST_TIME_SCALE, default 1; `make
// sanitize` sets 3): tests that bound a duration multiply the timeouts they set and the bounds they
// check by it, so that what they compare (one timeout, not two) stays the same at sanitizer speed.
double time_scale();

// Whether this build runs under ASan or TSan (src/base/sanitizer.h): their allocators replace glibc's,
// so mallinfo2 does not see the heap and mallopt does not steer it.
inline constexpr bool kSanitized = fsdp::detail::kSanitizerAllocator;

// Directory of the test binaries (where fsdp_test_worker lives) and of the built tools.
std::string binary_dir();
std::string tool_dir();

// The fsdp-train under test.
inline const std::string kTrain = tool_dir() + "/fsdp-train";

// An fsdp-train command line for the tests' small deterministic run (the tiny model, 8 sequences
// of 32 tokens, lr 3e-3, 2 warm-up steps, seed 7), then `flags`, then `extra`: a flag given
// twice takes its last value, so both may override the defaults.
std::vector<std::string> train_args(const std::vector<std::string>& flags,
                                    const std::vector<std::string>& extra = {});

// The ranks 0 and 1 whose "fsdp-train: error:" lines in `output` contain `text` (the launcher
// merges identical lines as "ranks 0,1: ..." or "ranks 0-1: ...").
std::set<int> ranks_saying(const std::string& output, const std::string& text);

// Runs `fn` on `world` ranks (run_ranks); every rank must throw fsdp::Error whose message is one
// line containing `expected`. A rank that returns, or throws anything else, fails the test.
void expect_every_rank_fails(int64_t world, const std::function<void(Runtime&)>& fn,
                             const std::string& expected);

}  // namespace fsdp::testing
