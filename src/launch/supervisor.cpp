// The local rank supervisor: forks the ranks, forwards their output and signals, reaps them, names
// the culprit of a failure and restarts (see fsdp/launcher.h).
#include "fsdp/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <thread>
#include <tuple>

#include "fsdp/error.h"

#include "fsdp/error.h"
#include "launch/rank_output.h"
#include "launch/tcp_port.h"

namespace fsdp {

namespace {

using detail::RankOutput;
using detail::try_bind;
using detail::write_line;
using detail::write_text;

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? detail::cat("SIG", abbrev) : detail::cat("signal ", sig);
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    return detail::cat("was killed by signal ", WTERMSIG(status), " (",
                       signal_name(WTERMSIG(status)), ")");
  }
  return detail::cat("exited with status ", WEXITSTATUS(status));
}

int exit_code_of(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

std::string resolve_executable(const std::string& prog) {
  auto runnable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (prog.find('/') != std::string::npos) {
    FSDP_CHECK(runnable(prog), "cannot execute '", prog, "': no such executable file");
    return prog;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(start, end - start);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + prog;
    if (runnable(candidate)) return candidate;
    start = end + 1;
  }
  throw Error(detail::cat("cannot execute '", prog, "': not found in PATH; give its path"));
}


volatile sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }
// SIGUSR1 and SIGUSR2 received so far (only the handler writes them), relayed to the ranks.
volatile sig_atomic_t g_usr1_count = 0, g_usr2_count = 0;
extern "C" void on_relay_signal(int sig) {
  if (sig == SIGUSR1) g_usr1_count = g_usr1_count + 1;
  if (sig == SIGUSR2) g_usr2_count = g_usr2_count + 1;
}

// Installs SIGINT/SIGTERM/SIGHUP handlers (stop the ranks) and SIGUSR1/SIGUSR2 handlers (relay
// them to the ranks: SLURM's --signal=B:USR1@T reaches only the batch step, i.e. the
// supervisor) for the supervisor's lifetime, and restores the old ones.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < kCount; ++i) {
      sa.sa_handler = i < 3 ? on_stop_signal : on_relay_signal;
      sigaction(kSignals[i], &sa, &old_[i]);
    }
  }
  ~StopSignals() {
    for (int i = 0; i < kCount; ++i) sigaction(kSignals[i], &old_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  static constexpr int kCount = 5;
  static constexpr int kSignals[kCount] = {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2};
  struct sigaction old_[kCount];
};

struct Child {
  int64_t rank = 0;
  int64_t local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  int stop_signal = 0;  // nonzero while the rank is stopped (SIGSTOP, SIGTSTP, ...)
  std::chrono::steady_clock::time_point stopped_at{};
};

// NOTE [culprit]: when several ranks fail, which one caused it? The supervisor reaps them in
// whatever order waitpid returns them, usually within one polling interval, so order alone cannot
// tell. A rank that a peer's death takes down exits with an error (or, if an exception escaped,
// SIGABRT); the cause is a rank that froze (stopped: its peers time out), or that was killed by a
// signal (SIGKILL, SIGSEGV, ...). Within one class, the first reaped wins.
int culprit_class(const Child& c) {
  if (c.stop_signal != 0) return 0;
  if (WIFSIGNALED(c.status) && WTERMSIG(c.status) != SIGABRT) return 1;
  if (WIFSIGNALED(c.status)) return 2;
  return 3;
}

// How one attempt of the job ended.
struct Attempt {
  int code = 0;            // the exit code the supervisor should return
  bool interrupted = false;
  std::string report;      // the one line naming the culprit ("" when all succeeded)
};

// 1. Forks and execs every local rank with its launcher environment; each rank's stderr goes to
// `output`. A failed fork kills the ranks already started and throws.
std::vector<Child> spawn_ranks(const LaunchOptions& opts, const std::string& exe,
                               std::vector<char*>& cargv, const EnvMap& base, int port,
                               int64_t attempt, RankOutput& output) {
  std::vector<Child> children(opts.nproc_per_node);
  const int64_t world = opts.nproc_per_node * opts.num_nodes;
  const pid_t supervisor = ::getpid();
  for (int64_t local = 0; local < opts.nproc_per_node; ++local) {
    Child& c = children[local];
    c.local_rank = local;
    c.rank = opts.node_rank * opts.nproc_per_node + local;
    EnvMap env = base;
    env["FSDP_LAUNCHER"] = "1";
    env["RANK"] = std::to_string(c.rank);
    env["LOCAL_RANK"] = std::to_string(local);
    env["WORLD_SIZE"] = std::to_string(world);
    env["LOCAL_WORLD_SIZE"] = std::to_string(opts.nproc_per_node);
    env["GROUP_RANK"] = std::to_string(opts.node_rank);
    env["MASTER_ADDR"] = opts.master_addr;
    env["MASTER_PORT"] = std::to_string(port);
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(opts.max_restarts);
    std::vector<std::string> strings;
    for (const auto& [k, v] : env) strings.push_back(k + "=" + v);
    std::vector<char*> cenv;
    for (auto& s : strings) cenv.push_back(s.data());
    cenv.push_back(nullptr);

    std::cout.flush();
    std::cerr.flush();
    pid_t pid = ::fork();
    if (pid == 0) {
      // Child: only async-signal-safe calls until exec.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != supervisor) ::_exit(1);
      if (::dup2(output.child_fd(local), 2) < 0) ::_exit(127);
      ::execve(exe.c_str(), cargv.data(), cenv.data());
      const char msg[] = "fsdp launcher: execve failed\n";
      (void)!::write(2, msg, sizeof(msg) - 1);
      ::_exit(127);
    }
    if (pid < 0) {
      int err = errno;
      for (auto& other : children) {
        if (other.running) ::kill(other.pid, SIGKILL);
      }
      for (auto& other : children) {
        if (other.running) ::waitpid(other.pid, nullptr, 0);
      }
      throw Error(detail::cat("could not start rank ", c.rank, ": fork failed: ",
                              std::strerror(err)));
    }
    c.pid = pid;
    c.running = true;
    output.started(local);
  }

  return children;
}

// How the ranks of one attempt ended, as the watch loop saw it.
struct Watched {
  std::vector<int64_t> failed;  // indices into the children, in the order they were reaped
  int stop_signal = 0;          // a stop signal the supervisor received (0: none)
  std::chrono::steady_clock::time_point first_failure_at{};
};

// 2. Reaps the ranks until none runs: relays SIGUSR1/2, and on the first failure or a stop
// signal sends SIGTERM to the others, then SIGKILL after the grace period.
Watched watch_ranks(const LaunchOptions& opts, std::vector<Child>& children, RankOutput& output) {
  using Clock = std::chrono::steady_clock;
  int64_t running = opts.nproc_per_node;
  Watched w;
  std::vector<int64_t>& failed = w.failed;
  bool stopping = false;
  int& stop_signal = w.stop_signal;
  Clock::time_point& first_failure_at = w.first_failure_at;
  Clock::time_point term_sent_at{};
  bool term_sent = false, kill_sent = false;
  sig_atomic_t usr1_relayed = g_usr1_count, usr2_relayed = g_usr2_count;

  while (running > 0) {
    bool reaped = false;
    for (auto& c : children) {
      // Our own pids only: a program that links fsdp may have children of its own (issue 21).
      int status = 0;
      if (!c.running || ::waitpid(c.pid, &status, WNOHANG | WUNTRACED | WCONTINUED) != c.pid) {
        continue;
      }
      reaped = true;
      if (WIFSTOPPED(status)) {
        c.stop_signal = WSTOPSIG(status);
        c.stopped_at = Clock::now();
        if (term_sent) ::kill(c.pid, SIGKILL);  // a stopped rank cannot handle SIGTERM
        continue;
      }
      if (WIFCONTINUED(status)) {
        c.stop_signal = 0;
        continue;
      }
      c.running = false;
      c.status = status;
      --running;
      bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && !term_sent && stop_signal == 0 && g_stop_signal == 0) {
        if (failed.empty()) first_failure_at = Clock::now();
        failed.push_back(c.local_rank);
      }
    }
    if (reaped) continue;  // reap everything that is ready before deciding
    if (g_stop_signal != 0 && stop_signal == 0) {
      stop_signal = g_stop_signal;
      stopping = true;
    }
    for (auto [count, relayed, sig] : {std::tuple{g_usr1_count, &usr1_relayed, SIGUSR1},
                                       std::tuple{g_usr2_count, &usr2_relayed, SIGUSR2}}) {
      if (count == *relayed) continue;
      *relayed = count;
      for (auto& c : children) {
        if (c.running) ::kill(c.pid, sig);
      }
    }
    // Give the other ranks a moment to report too, so the root cause (e.g. the rank that was
    // killed, not the ranks that then lost their connection to it) can be named.
    if (!failed.empty() && !stopping &&
        Clock::now() - first_failure_at > std::chrono::milliseconds(100)) {
      stopping = true;
    }
    if (stopping && !term_sent) {
      for (auto& c : children) {
        // A stopped rank would keep SIGTERM pending until continued: it gets SIGKILL at once.
        if (c.running) ::kill(c.pid, c.stop_signal != 0 ? SIGKILL : SIGTERM);
      }
      term_sent = true;
      term_sent_at = Clock::now();
    }
    const auto grace = stop_signal != 0 ? std::max(opts.grace, opts.signal_grace) : opts.grace;
    if (term_sent && !kill_sent && Clock::now() - term_sent_at > grace) {
      for (auto& c : children) {
        if (c.running) ::kill(c.pid, SIGKILL);
      }
      kill_sent = true;
    }
    output.pump(std::chrono::milliseconds(10));
  }
  return w;
}

// 3. The attempt's result: success, an interruption, or the one line naming the rank that caused
// the failure (NOTE [culprit]).
Attempt name_culprit(const LaunchOptions& opts, const std::vector<Child>& children,
                     const Watched& w) {
  const std::vector<int64_t>& failed = w.failed;
  const int stop_signal = w.stop_signal;
  const auto first_failure_at = w.first_failure_at;
  Attempt result;
  if (stop_signal != 0 && failed.empty()) {
    result.interrupted = true;
    result.code = 128 + stop_signal;
    result.report = detail::cat(opts.name, ": interrupted by ", signal_name(stop_signal),
                                "; stopped all ", opts.nproc_per_node, " ranks on this node");
    return result;
  }
  if (failed.empty()) return result;
  // NOTE [culprit]. A rank that was stopped when the others failed is not in `failed` (we
  // killed it): it comes first.
  int64_t culprit = -1;
  for (const Child& c : children) {
    if (c.stop_signal != 0 &&
        (culprit < 0 || c.stopped_at < children[culprit].stopped_at)) {
      culprit = c.local_rank;
    }
  }
  if (culprit < 0) {
    culprit = failed.front();
    for (int64_t i : failed) {
      if (culprit_class(children[i]) < culprit_class(children[culprit])) culprit = i;
    }
  }
  const Child& c = children[culprit];
  std::string others;
  for (int64_t i : failed) {
    if (i != culprit) others += detail::cat(others.empty() ? "" : ", ", children[i].rank);
  }
  std::string what;
  if (c.stop_signal != 0) {
    const double stalled =
        std::chrono::duration<double>(first_failure_at - c.stopped_at).count();
    what = detail::cat("stopped responding: it was stopped by signal ", c.stop_signal, " (",
                       signal_name(c.stop_signal), ") ",
                       std::round(std::max(0.0, stalled) * 10) / 10, " s before its peers gave up");
    result.code = 128 + c.stop_signal;
  } else {
    what = describe_status(c.status);
    result.code = exit_code_of(c.status);
    if (result.code == 0) result.code = 1;
  }
  result.report = detail::cat(opts.name, ": rank ", c.rank, " (local rank ", c.local_rank,
                              ", pid ", c.pid, ") ", what, "; stopped the other ranks");
  if (!others.empty()) result.report += detail::cat(" (rank(s) ", others, " had also failed)");
  return result;
}


Attempt run_attempt(const LaunchOptions& opts, const std::string& exe, std::vector<char*>& cargv,
                    const EnvMap& base, int port, int64_t attempt) {
  std::vector<int64_t> ranks;
  for (int64_t local = 0; local < opts.nproc_per_node; ++local) {
    ranks.push_back(opts.node_rank * opts.nproc_per_node + local);
  }
  RankOutput output(ranks, opts.output_hold);  // NOTE [rank output]
  std::vector<Child> children = spawn_ranks(opts, exe, cargv, base, port, attempt, output);
  const Watched w = watch_ranks(opts, children, output);
  output.finish();  // the ranks' last lines come before the supervisor's report
  return name_culprit(opts, children, w);
}

}  // namespace

int supervise(const LaunchOptions& opts, const std::vector<std::string>& argv,
              const std::string& executable) {
  FSDP_CHECK(!argv.empty(), "no program to launch; usage: fsdp-run [options] -- program args");
  validate(opts);
  const std::string exe = resolve_executable(executable.empty() ? argv[0] : executable);
  int port = opts.master_port;
  if (port == 0) {
    port = try_bind(0);
    FSDP_CHECK(port > 0, "could not find a free TCP port: ", std::strerror(-port),
               "; pass --master-port");
  }
  const int64_t threads =
      opts.threads > 0 ? opts.threads : default_threads_per_rank(opts.nproc_per_node);
  EnvMap base = current_environment();
  for (const char* var : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"}) {
    if (opts.threads > 0 || !base.count(var)) base[var] = std::to_string(threads);
  }
  // Variables of other launchers would contradict ours in the ranks (see detect_cluster).
  for (const char* var : {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID",
                          "SLURM_STEP_ID", "SLURM_STEPID", "OMPI_COMM_WORLD_RANK",
                          "OMPI_COMM_WORLD_SIZE"}) {
    base.erase(var);
  }

  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);

  StopSignals signals;
  for (int64_t attempt = 0;; ++attempt) {
    Attempt a = run_attempt(opts, exe, cargv, base, port, attempt);
    if (a.code == 0) return 0;
    if (a.interrupted || attempt >= opts.max_restarts) {
      write_line(a.report);
      return a.code;
    }
    write_line(detail::cat(a.report, "; restarting all ", opts.nproc_per_node,
                           " ranks on this node (restart ", attempt + 1, " of ",
                           opts.max_restarts, ")"));
  }
}

}  // namespace fsdp
