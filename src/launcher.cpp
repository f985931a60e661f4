// Local rank supervisor (see fsdp/launcher.h).
#include "fsdp/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
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

namespace fsdp {

int64_t available_cores() {
  int64_t cores = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    cores = std::max(1, CPU_COUNT(&set));
  } else {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    cores = n > 0 ? n : 1;
  }
  // SLURM without CPU binding (task/none) leaves the affinity mask whole: its allocation counts.
  if (const char* slurm = std::getenv("SLURM_CPUS_PER_TASK")) {
    char* end = nullptr;
    long long n = std::strtoll(slurm, &end, 10);
    if (end && *end == '\0' && n >= 1 && n < cores) cores = n;
  }
  return cores;
}

int64_t default_threads_per_rank(int64_t local_ranks) {
  return std::max<int64_t>(1, available_cores() / std::max<int64_t>(1, local_ranks));
}

namespace {

// Binds a TCP socket on all interfaces to `port` (0: any free one) and returns the bound port,
// or -errno. A given port is probed with SO_REUSEADDR, like the store's own listening socket
// (runtime.cpp): connections of a previous job left in TIME_WAIT do not stop the store from
// binding, so they must not fail the probe either, while a socket *listening* on the port still
// gives EADDRINUSE. Port 0 is picked without it, so the kernel hands out a port nothing holds.
int try_bind(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  if (port != 0) {
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  int result;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    result = -errno;
  } else {
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    result = ntohs(addr.sin_port);
  }
  ::close(fd);
  return result;
}

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

// Writes `text` to stderr with one write(2) where it fits, so lines of several processes sharing
// the terminal never interleave.
void write_text(const std::string& text) {
  std::cerr.flush();
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0) {
    ssize_t n = ::write(2, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

void write_line(const std::string& line) { write_text(line + "\n"); }

// NOTE [rank output]: when a job fails, every rank usually prints the same error line, and a
// user of 8 ranks would read it 8 times. The supervisor therefore carries each rank's stderr (a
// pipe, or a pseudo-terminal when its own stderr is a terminal, so that a rank still sees one
// and draws its progress bar) and forwards it line by line: a complete line waits up to `hold`
// (LaunchOptions::output_hold, 1 s by default) for the same line from the other ranks of this
// node, and identical lines leave as one that names the ranks ("... [ranks 0-3]"). A line that names its own rank ("rank 2: lost rank 3") matches
// the same line of another rank naming that one, and leaves as "ranks 1-2: lost rank 3". Lines
// that differ, and lines of one rank, are forwarded unchanged, each rank's in its own order; text
// that is not a complete line (a progress bar redrawn with "\r", a prompt) leaves at once.
// Standard output is not touched.
class RankOutput {
 public:
  RankOutput(const std::vector<int64_t>& ranks, std::chrono::milliseconds hold)
      : hold_(hold), tty_(::isatty(2) == 1) {
    streams_.resize(ranks.size());
    for (size_t i = 0; i < ranks.size(); ++i) {
      Stream& s = streams_[i];
      s.rank = ranks[i];
      if (!(tty_ && open_pty(s)) && !open_pipe(s)) {
        throw Error(detail::cat("could not create the output channel of rank ", s.rank, ": ",
                                std::strerror(errno)));
      }
    }
  }
  ~RankOutput() {
    for (Stream& s : streams_) {
      if (s.read_fd >= 0) ::close(s.read_fd);
      if (s.child_fd >= 0) ::close(s.child_fd);
    }
  }
  RankOutput(const RankOutput&) = delete;
  RankOutput& operator=(const RankOutput&) = delete;

  // The descriptor that becomes stderr of the i-th rank (dup2 it in the child, before exec).
  int child_fd(size_t i) const { return streams_[i].child_fd; }
  // After the i-th rank was forked: the supervisor's copy of its end is closed, so that the
  // rank's exit ends the stream.
  void started(size_t i) {
    ::close(streams_[i].child_fd);
    streams_[i].child_fd = -1;
  }

  // Waits up to `timeout` for output, forwards what is due.
  void pump(std::chrono::milliseconds timeout) {
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i].read_fd < 0) continue;
      fds.push_back({streams_[i].read_fd, POLLIN, 0});
      which.push_back(i);
    }
    if (fds.empty()) {
      std::this_thread::sleep_for(timeout);
    } else if (::poll(fds.data(), fds.size(), static_cast<int>(timeout.count())) > 0) {
      for (size_t k = 0; k < fds.size(); ++k) {
        if (fds[k].revents != 0) read_from(which[k]);
      }
    }
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (!streams_[i].partial.empty()) take_lines(i);  // text that waited long enough
    }
    release(false);
  }

  // After every rank has exited: reads what they left (a stream that a rank's own child still
  // holds open is not waited for) and forwards everything.
  void finish() {
    for (int round = 0; round < 100; ++round) {
      std::vector<pollfd> fds;
      std::vector<size_t> which;
      for (size_t i = 0; i < streams_.size(); ++i) {
        if (streams_[i].read_fd >= 0) {
          fds.push_back({streams_[i].read_fd, POLLIN, 0});
          which.push_back(i);
        }
      }
      if (fds.empty() || ::poll(fds.data(), fds.size(), 20) <= 0) break;
      for (size_t k = 0; k < fds.size(); ++k) {
        if (fds[k].revents != 0) read_from(which[k]);
      }
    }
    for (size_t i = 0; i < streams_.size(); ++i) {
      Stream& s = streams_[i];
      if (s.read_fd >= 0) ::close(s.read_fd);
      s.read_fd = -1;
      s.closed = true;
      if (!s.partial.empty()) {  // a last line without its newline
        s.partial += '\n';
        take_lines(i);
      } else if (s.mid_line) {  // e.g. a progress bar: what follows starts on a line of its own
        write_text("\n");
        s.mid_line = false;
      }
    }
    release(true);
  }

 private:
  struct Stream {
    int64_t rank = 0;
    int read_fd = -1;
    int child_fd = -1;
    bool closed = false;
    bool mid_line = false;  // the start of the current line was already forwarded
    std::string partial;    // text after the last newline
    std::chrono::steady_clock::time_point partial_since{};
  };
  struct Line {
    std::string key;   // the text, with the rank it names replaced by kRankMark
    std::string text;  // as the first rank wrote it
    bool names_rank = false;
    std::vector<int64_t> ranks;  // indices into streams_
    std::chrono::steady_clock::time_point first{};
  };
  static constexpr char kRankMark = '\x01';

  static bool open_pipe(Stream& s) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return false;
    s.read_fd = fds[0];
    s.child_fd = fds[1];
    ::fcntl(s.read_fd, F_SETFL, O_NONBLOCK);
    return true;
  }

  static bool open_pty(Stream& s) {
    int master = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master < 0) return false;
    char name[128];
    int slave = -1;
    if (::grantpt(master) == 0 && ::unlockpt(master) == 0 &&
        ::ptsname_r(master, name, sizeof(name)) == 0) {
      slave = ::open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
    }
    if (slave < 0) {
      ::close(master);
      return false;
    }
    termios t{};
    if (::tcgetattr(slave, &t) == 0) {
      ::cfmakeraw(&t);  // no "\n" -> "\r\n": the bytes arrive as the rank wrote them
      ::tcsetattr(slave, TCSANOW, &t);
    }
    winsize size{};
    if (::ioctl(2, TIOCGWINSZ, &size) == 0) ::ioctl(slave, TIOCSWINSZ, &size);
    ::fcntl(master, F_SETFL, O_NONBLOCK);
    s.read_fd = master;
    s.child_fd = slave;
    return true;
  }

  void read_from(size_t i) {
    Stream& s = streams_[i];
    char buf[65536];
    for (;;) {
      const ssize_t n = ::read(s.read_fd, buf, sizeof(buf));
      if (n > 0) {
        if (s.partial.empty()) s.partial_since = std::chrono::steady_clock::now();
        s.partial.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) break;
      // EOF, or EIO: a pseudo-terminal whose rank side is closed.
      ::close(s.read_fd);
      s.read_fd = -1;
      s.closed = true;
      break;
    }
    take_lines(i);
  }

  // Moves the complete lines of stream i into the queue; forwards text that must not wait.
  void take_lines(size_t i) {
    Stream& s = streams_[i];
    size_t begin = 0;
    for (size_t nl; (nl = s.partial.find('\n', begin)) != std::string::npos; begin = nl + 1) {
      if (s.mid_line) {  // the rest of a line already begun on the terminal
        write_text(s.partial.substr(begin, nl + 1 - begin));
        s.mid_line = false;
      } else {
        queue(i, s.partial.substr(begin, nl - begin));
      }
    }
    s.partial.erase(0, begin);
    if (begin > 0) s.partial_since = std::chrono::steady_clock::now();
    const bool urgent = s.partial.find('\r') != std::string::npos || s.mid_line ||
                        std::chrono::steady_clock::now() - s.partial_since >= hold_;
    if (!s.partial.empty() && urgent) {
      release_through(i);  // the rank's earlier lines first
      write_text(s.partial);
      s.partial.clear();
      s.mid_line = true;
    }
  }

  void queue(size_t i, std::string text) {
    const int64_t rank = streams_[i].rank;
    std::string key = text;
    bool names_rank = false;
    const std::string word = detail::cat("rank ", rank);
    for (size_t at = key.find(word); at != std::string::npos; at = key.find(word, at + 1)) {
      const size_t end = at + word.size();
      const bool starts = at == 0 || !std::isalnum(static_cast<unsigned char>(key[at - 1]));
      const bool ends = end == key.size() || !std::isdigit(static_cast<unsigned char>(key[end]));
      if (starts && ends) {
        key.replace(at, word.size(), std::string(1, kRankMark));
        names_rank = true;
        break;
      }
    }
    // Join the same line of other ranks, where every rank's lines keep their order: in place
    // when this rank has no later line queued, else moved behind everything when its ranks have
    // no later line queued.
    auto has = [](const Line& l, int64_t r) {
      return std::find(l.ranks.begin(), l.ranks.end(), r) != l.ranks.end();
    };
    const int64_t me = static_cast<int64_t>(i);
    for (size_t k = hold_.count() > 0 ? pending_.size() : 0; k-- > 0;) {  // hold 0: never merged
      if (pending_[k].key != key || has(pending_[k], me)) continue;
      bool mine_later = false, theirs_later = false;
      for (size_t later = k + 1; later < pending_.size(); ++later) {
        mine_later = mine_later || has(pending_[later], me);
        for (int64_t r : pending_[k].ranks) theirs_later = theirs_later || has(pending_[later], r);
      }
      if (!mine_later) {
        pending_[k].ranks.push_back(me);
        return;
      }
      if (!theirs_later) {
        Line moved = std::move(pending_[k]);
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(k));
        moved.ranks.push_back(me);
        pending_.push_back(std::move(moved));
        return;
      }
    }
    Line line;
    line.key = std::move(key);
    line.text = std::move(text);
    line.names_rank = names_rank;
    line.ranks = {static_cast<int64_t>(i)};
    line.first = std::chrono::steady_clock::now();
    pending_.push_back(std::move(line));
  }

  // A line is due when every rank of this node wrote it (or can write nothing more), or `hold`
  // passed; lines leave in the order they first arrived.
  void release(bool all) {
    const auto now = std::chrono::steady_clock::now();
    while (!pending_.empty()) {
      const Line& line = pending_.front();
      bool complete = true;
      for (size_t i = 0; i < streams_.size() && complete; ++i) {
        complete = streams_[i].closed ||
                   std::find(line.ranks.begin(), line.ranks.end(), i) != line.ranks.end();
      }
      if (!all && !complete && now - line.first < hold_) return;
      write_text(render(line) + "\n");
      pending_.pop_front();
    }
  }

  // Forwards the queue up to the last line of stream i.
  void release_through(size_t i) {
    size_t last = 0;
    bool found = false;
    for (size_t k = 0; k < pending_.size(); ++k) {
      if (std::find(pending_[k].ranks.begin(), pending_[k].ranks.end(), i) !=
          pending_[k].ranks.end()) {
        last = k;
        found = true;
      }
    }
    if (!found) return;
    for (size_t k = 0; k <= last; ++k) {
      write_text(render(pending_.front()) + "\n");
      pending_.pop_front();
    }
  }

  std::string render(const Line& line) const {
    if (line.ranks.size() == 1) return line.text;
    std::vector<int64_t> ranks;
    for (int64_t i : line.ranks) ranks.push_back(streams_[i].rank);
    std::sort(ranks.begin(), ranks.end());
    std::string list;
    for (size_t a = 0; a < ranks.size();) {
      size_t b = a;
      while (b + 1 < ranks.size() && ranks[b + 1] == ranks[b] + 1) ++b;
      list += detail::cat(list.empty() ? "" : ",", ranks[a]);
      if (b > a) list += detail::cat(b == a + 1 ? "," : "-", ranks[b]);
      a = b + 1;
    }
    if (!line.names_rank) return detail::cat(line.text, " [ranks ", list, "]");
    std::string text = line.key;
    text.replace(text.find(kRankMark), 1, "ranks " + list);
    return text;
  }

  std::chrono::milliseconds hold_;
  bool tty_;
  std::vector<Stream> streams_;
  std::deque<Line> pending_;
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

// Test hook (see tests): FSDP_TEST_KILL_RANK="R:S" SIGKILLs local rank R of the first attempt S
// seconds after it started; "R:PATH" does so as soon as PATH exists (e.g. a checkpoint), so
// restart tests need no timing in the program under test.
struct TestKill {
  int64_t local_rank = -1;
  std::chrono::milliseconds after{0};
  std::string when_exists;
};

TestKill test_kill_from_env() {
  TestKill k;
  const char* v = std::getenv("FSDP_TEST_KILL_RANK");
  if (!v) return k;
  const std::string text(v);
  const size_t colon = text.find(':');
  auto bad = [&]() {
    return Error(detail::cat("FSDP_TEST_KILL_RANK='", text,
                             "' is not LOCAL_RANK:SECONDS or LOCAL_RANK:PATH; fix or unset it"));
  };
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) throw bad();
  const std::string rank = text.substr(0, colon), when = text.substr(colon + 1);
  if (rank.find_first_not_of("0123456789") != std::string::npos || rank.size() > 6) throw bad();
  k.local_rank = std::stoll(rank);
  if (when.find('/') != std::string::npos) {
    k.when_exists = when;
    return k;
  }
  char* end = nullptr;
  const double seconds = std::strtod(when.c_str(), &end);
  if (!end || *end != '\0' || !(seconds >= 0) || seconds > 1e6) throw bad();
  k.after = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  return k;
}

bool test_kill_due(const TestKill& k, std::chrono::steady_clock::duration running) {
  if (!k.when_exists.empty()) return ::access(k.when_exists.c_str(), F_OK) == 0;
  return running >= k.after;
}

Attempt run_attempt(const LaunchOptions& opts, const std::string& exe, std::vector<char*>& cargv,
                    const EnvMap& base, int port, int64_t attempt, const TestKill& test_kill) {
  std::vector<Child> children(opts.nproc_per_node);
  const int64_t world = opts.nproc_per_node * opts.num_nodes;
  const pid_t supervisor = ::getpid();
  std::vector<int64_t> ranks;
  for (int64_t local = 0; local < opts.nproc_per_node; ++local) {
    ranks.push_back(opts.node_rank * opts.nproc_per_node + local);
  }
  RankOutput output(ranks, opts.output_hold);  // NOTE [rank output]
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

  using Clock = std::chrono::steady_clock;
  const Clock::time_point started = Clock::now();
  int64_t running = opts.nproc_per_node;
  std::vector<int64_t> failed;  // indices into children, in the order they were reaped
  bool stopping = false, test_killed = false;
  int stop_signal = 0;
  Clock::time_point first_failure_at{}, term_sent_at{};
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
    if (test_kill.local_rank >= 0 && !test_killed && attempt == 0 &&
        test_kill.local_rank < opts.nproc_per_node &&
        test_kill_due(test_kill, Clock::now() - started)) {
      test_killed = true;
      const Child& victim = children[test_kill.local_rank];
      if (victim.running) ::kill(victim.pid, SIGKILL);
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
  output.finish();  // the ranks' last lines come before the supervisor's report

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

}  // namespace

void validate(const LaunchOptions& o) {
  FSDP_CHECK(o.nproc_per_node >= 1, o.devices_flag, " ", o.nproc_per_node,
             " is invalid: at least 1 process per node is needed; use ", o.devices_flag, " 1 or more");
  FSDP_CHECK(o.nproc_per_node <= 1024, o.devices_flag, " ", o.nproc_per_node,
             " is more processes than one node can run; use at most 1024");
  const std::string& nodes = o.num_nodes_flag;
  FSDP_CHECK(o.num_nodes >= 1, nodes, " ", o.num_nodes, " is invalid; use 1 or more");
  FSDP_CHECK(o.node_rank >= 0 && o.node_rank < o.num_nodes, "--node-rank ", o.node_rank,
             " is outside 0..", o.num_nodes - 1, " for ", nodes, " ", o.num_nodes);
  FSDP_CHECK(!o.master_addr.empty(), "--master-addr is empty; give rank 0's host name or address");
  FSDP_CHECK(o.master_port >= 0 && o.master_port <= 65535, "--master-port ", o.master_port,
             " is not a TCP port; use 1..65535, or omit it to pick a free port");
  FSDP_CHECK(o.num_nodes == 1 || o.master_port != 0, nodes, " ", o.num_nodes,
             " needs --master-port: every node must use the same port, so it cannot be picked "
             "at random");
  FSDP_CHECK(o.threads >= 0, "--threads ", o.threads, " is invalid; use 1 or more (0 = auto)");
  FSDP_CHECK(o.max_restarts >= 0 && o.max_restarts <= 1000, "--max-restarts ", o.max_restarts,
             " is invalid; use 0 (no restarts) .. 1000");
  if (o.node_rank == 0 && o.master_port != 0) {
    int r = try_bind(o.master_port);
    FSDP_CHECK(r != -EADDRINUSE, "--master-port ", o.master_port,
               " is already in use on this machine; choose another port, or omit --master-port "
               "to pick a free one");
  }
}

int supervise(const LaunchOptions& opts, const std::vector<std::string>& argv,
              const std::string& executable) {
  FSDP_CHECK(!argv.empty(), "no program to launch; usage: fsdp-run [options] -- program args");
  validate(opts);
  const std::string exe = resolve_executable(executable.empty() ? argv[0] : executable);
  const TestKill test_kill = test_kill_from_env();
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
                          "OMPI_COMM_WORLD_SIZE", "FSDP_TEST_KILL_RANK"}) {
    base.erase(var);
  }

  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);

  StopSignals signals;
  for (int64_t attempt = 0;; ++attempt) {
    Attempt a = run_attempt(opts, exe, cargv, base, port, attempt, test_kill);
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

std::optional<int> launch_self(int argc, char** argv, const LaunchOptions& opts) {
  ClusterEnv env = detect_cluster(current_environment());
  if (env.kind != ClusterKind::kSingle) return std::nullopt;
  if (opts.nproc_per_node == 1 && opts.num_nodes == 1) return std::nullopt;
  std::vector<std::string> args(argv, argv + argc);
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  FSDP_CHECK(n > 0, "cannot find this program's executable (/proc/self/exe): ",
             std::strerror(errno));
  self[n] = '\0';
  return supervise(opts, args, self);
}

void check_matches_environment(const GivenLaunchOptions& given, const ClusterEnv& env) {
  if (env.kind == ClusterKind::kSingle) return;
  const char* who = to_string(env.kind);
  FSDP_CHECK(!given.max_restarts || *given.max_restarts == 0 ||
                 env.kind == ClusterKind::kFsdpLauncher,
             "--max-restarts ", given.max_restarts.value_or(0), " restarts ranks that fsdp's own "
             "launcher (--devices) started, but ", who, " started this one; use the launcher's "
             "own restarts (torchrun --max-restarts) or drop the flag");
  FSDP_CHECK(!given.devices || *given.devices == env.local_world_size, "--devices ",
             given.devices.value_or(0), " contradicts the ", who, " environment, which started ",
             env.local_world_size, " ranks on this node; drop --devices or make them equal");
  FSDP_CHECK(!given.num_nodes || *given.num_nodes == env.num_nodes, "--num-nodes ",
             given.num_nodes.value_or(0), " contradicts the ", who, " environment (", env.num_nodes,
             " nodes); drop --num-nodes or make them equal");
  FSDP_CHECK(!given.node_rank || *given.node_rank == env.node_rank, "--node-rank ",
             given.node_rank.value_or(0), " contradicts the ", who, " environment (node ",
             env.node_rank, "); drop --node-rank or make them equal");
  FSDP_CHECK(!given.master_addr || !env.master_addr_given || *given.master_addr == env.master_addr,
             "--master-addr ",
             given.master_addr.value_or(""), " contradicts the ", who,
             " environment (MASTER_ADDR ", env.master_addr, "); drop one of them");
  // --master-port 0 means "pick one", which the launcher did: not a contradiction.
  FSDP_CHECK(!given.master_port || *given.master_port == 0 || !env.master_port_given ||
                 *given.master_port == env.master_port,
             "--master-port ",
             given.master_port.value_or(0), " contradicts the ", who, " environment (port ",
             env.master_port, "); drop one of them");
}

ClusterEnv apply_master_flags(const GivenLaunchOptions& given, const ClusterEnv& env) {
  ClusterEnv result = env;
  if (env.kind == ClusterKind::kSingle) return result;
  if (given.master_addr && !env.master_addr_given) {
    result.master_addr = *given.master_addr;
    result.master_addr_given = true;
    ::setenv("MASTER_ADDR", given.master_addr->c_str(), 1);
  }
  if (given.master_port && *given.master_port != 0 && !env.master_port_given) {
    result.master_port = *given.master_port;
    result.master_port_given = true;
    ::setenv("MASTER_PORT", std::to_string(*given.master_port).c_str(), 1);
  }
  return result;
}

}  // namespace fsdp
