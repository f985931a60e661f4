// Test helpers (see testing.h): thread ranks over a shared HashStore, child processes with deadlines.
#include "testing.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

#include "fsdp/error.h"
#include "runtime/runtime_internal.h"

extern char** environ;

namespace fsdp::testing {

TempDir::TempDir() {
  char tmpl[] = "/tmp/fsdp-test-XXXXXX";
  const char* made = ::mkdtemp(tmpl);
  if (!made) throw std::runtime_error(std::string("mkdtemp failed: ") + std::strerror(errno));
  path_ = made;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void run_ranks(int64_t world, const std::function<void(Runtime&)>& fn, int64_t local_world,
               std::chrono::milliseconds timeout, CollectiveAlgorithm algorithm,
               Backend backend) {
  if (local_world <= 0) local_world = world;
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int64_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        ClusterEnv env;
        env.kind = ClusterKind::kTorchElastic;
        env.rank = r;
        env.world_size = world;
        env.local_rank = r % local_world;
        env.local_world_size = local_world;
        env.node_rank = r / local_world;
        env.num_nodes = world / local_world;
        env.master_port = 1;
        RuntimeOptions opts;
        opts.backend = backend;
        opts.timeout = timeout;
        opts.algorithm = algorithm;
        auto rt = detail::make_runtime(store, env, opts);
        fn(*rt);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

int ProcessResult::exit_code() const {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

bool ProcessResult::killed_by(int sig) const {
  return WIFSIGNALED(status) && WTERMSIG(status) == sig;
}

Process::Process(const std::vector<std::string>& argv,
                 const std::map<std::string, std::string>& env) {
  std::map<std::string, std::string> merged;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) merged[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : env) {
    if (v.empty()) {
      merged.erase(k);
    } else {
      merged[k] = v;
    }
  }
  std::vector<std::string> strings;
  for (const auto& [k, v] : merged) strings.push_back(k + "=" + v);
  std::vector<char*> cenv, cargv;
  for (auto& s : strings) cenv.push_back(s.data());
  cenv.push_back(nullptr);
  std::vector<std::string> args = argv;
  for (auto& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);

  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ == 0) {
    ::setpgid(0, 0);  // its own process group: the destructor can kill it with its children
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  out_fd_ = fds[0];
  if (pid_ < 0) throw std::runtime_error("fork failed");
  ::setpgid(pid_, pid_);
}

void Process::drain() {
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(out_fd_, buf, sizeof(buf));
    if (n > 0) {
      output_.append(buf, n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;
  }
}

ProcessResult Process::wait(std::chrono::milliseconds deadline) {
  if (done_) return result_;
  auto end = std::chrono::steady_clock::now() + deadline;
  ::fcntl(out_fd_, F_SETFL, O_NONBLOCK);
  for (;;) {
    drain();
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      ::fcntl(out_fd_, F_SETFL, 0);
      // Grandchildren (ranks) may still hold the pipe; read what is there without blocking on it.
      ::fcntl(out_fd_, F_SETFL, O_NONBLOCK);
      drain();
      result_.status = status;
      break;
    }
    if (std::chrono::steady_clock::now() > end) {
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      drain();
      result_.status = status;
      result_.timed_out = true;
      break;
    }
    pollfd p{out_fd_, POLLIN, 0};
    ::poll(&p, 1, 20);
  }
  ::kill(-pid_, SIGKILL);  // leftovers in its process group
  result_.output = output_;
  done_ = true;
  return result_;
}

void Process::signal(int sig) {
  if (!done_) ::kill(pid_, sig);
}

Process::~Process() {
  if (!done_ && pid_ > 0) {
    ::kill(-pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (out_fd_ >= 0) ::close(out_fd_);
}

ProcessResult run(const std::vector<std::string>& argv,
                  const std::map<std::string, std::string>& env,
                  std::chrono::milliseconds deadline) {
  Process p(argv, env);
  return p.wait(deadline);
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

void expect_comm_matches_report(const CommSnapshot& before, const CommSnapshot& after,
                                const TopologyReport& report) {
  ASSERT_GE(before.size(), 2u);  // shard, replicate (then world)
  ASSERT_EQ(after.size(), before.size());
  ASSERT_EQ(before[0].first, "shard");
  ASSERT_EQ(before[1].first, "replicate");
  const auto shard = after[0].second - before[0].second;
  const auto replicate = after[1].second - before[1].second;
  EXPECT_EQ(shard.all_gather_bytes, report.comm.shard_all_gather);
  EXPECT_EQ(shard.reduce_scatter_bytes, report.comm.shard_reduce_scatter);
  EXPECT_EQ(shard.all_reduce_bytes, report.comm.shard_all_reduce);
  EXPECT_EQ(replicate.all_reduce_bytes, report.comm.replicate_all_reduce);
  EXPECT_EQ(replicate.all_gather_bytes + replicate.reduce_scatter_bytes, 0);
}

std::vector<std::string> tcp_sockets(int port, const std::string& state) {
  std::vector<std::string> found;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, st;
      fields >> slot >> local >> remote >> st;
      const auto colon = local.rfind(':');
      if (st != state || colon == std::string::npos) continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) != port) continue;
      found.push_back(local.substr(0, colon));
    }
  }
  return found;
}

double time_scale() {
  const char* text = std::getenv("FSDP_TEST_TIME_SCALE");
  if (text == nullptr || *text == '\0') return 1.0;
  char* end = nullptr;
  const double scale = std::strtod(text, &end);
  if (*end != '\0' || !(scale >= 1.0 && scale <= 100.0)) {
    throw std::runtime_error(std::string("FSDP_TEST_TIME_SCALE=") + text +
                             " is invalid; use a number from 1 to 100");
  }
  return scale;
}

std::string binary_dir() { return FSDP_TEST_BINARY_DIR; }
std::string tool_dir() { return FSDP_TOOL_DIR; }

namespace {
// The pids of `pid`'s children now (its main thread's, as the kernel lists them).
std::vector<int> children_now(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  std::vector<int> pids;
  for (int p; in >> p;) pids.push_back(p);
  return pids;
}
}  // namespace

std::vector<int> children_of(int pid, size_t n) {
  std::vector<int> pids;
  for (int i = 0; i < 600 && pids.size() < n; ++i) {
    pids = children_now(pid);
    if (pids.size() < n) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pids;
}

namespace {
// The value of `var` in /proc/PID/environ ("" when unset or the process is gone).
std::string environ_value(int pid, const std::string& var) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  const std::string prefix = var + "=";
  for (std::string entry; std::getline(in, entry, '\0');) {
    if (entry.compare(0, prefix.size(), prefix) == 0) return entry.substr(prefix.size());
  }
  return "";
}
}  // namespace

int kill_local_rank_when(const Process& launcher, int local_rank,
                         const std::function<bool()>& due, std::chrono::milliseconds deadline) {
  const auto until = std::chrono::steady_clock::now() + deadline;
  const std::string want = std::to_string(local_rank);
  while (std::chrono::steady_clock::now() < until) {
    if (due()) {
      for (int child : children_now(launcher.pid())) {
        if (environ_value(child, "LOCAL_RANK") == want && ::kill(child, SIGKILL) == 0) {
          return child;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return -1;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

bool is_png(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[8] = {};
  in.read(magic, 8);
  return in && std::string(magic, 8) == "\x89PNG\r\n\x1a\n";
}

bool have_gnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

std::map<int64_t, double> metrics_losses(const std::string& file) {
  std::map<int64_t, double> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    out[j.at("step").get<int64_t>()] = j.at("loss").get<double>();
  }
  return out;
}

std::vector<std::string> train_args(const std::vector<std::string>& flags,
                                    const std::vector<std::string>& extra) {
  std::vector<std::string> argv{kTrain,      "--model=tiny",     "--global-batch=8", "--seq-len=32",
                                "--lr=3e-3", "--warmup-steps=2", "--seed=7"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

void expect_every_rank_fails(int64_t world, const std::function<void(Runtime&)>& fn,
                             const std::string& expected) {
  std::atomic<int64_t> failed{0};
  std::mutex mu;
  std::vector<std::string> messages;
  try {
    run_ranks(world, [&](Runtime& rt) {
      try {
        fn(rt);
      } catch (const fsdp::Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        messages.push_back(e.what());
        ++failed;
        return;
      }
      ADD_FAILURE() << "rank " << rt.rank() << ": no error; expected '" << expected << "'";
    });
  } catch (const std::exception& e) {
    ADD_FAILURE() << "a rank failed outside fsdp::Error: " << e.what();
  }
  EXPECT_EQ(failed.load(), world) << "expected every rank to fail with: " << expected;
  for (const auto& m : messages) {
    EXPECT_NE(m.find(expected), std::string::npos) << "message: " << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << "not one line: " << m;
  }
}

std::set<int> ranks_saying(const std::string& output, const std::string& text) {
  std::set<int> ranks;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("fsdp-train: error: ", 0) != 0 || line.find(text) == std::string::npos) continue;
    const std::string who = line.substr(19, line.find(':', 19) - 19);
    if (who == "ranks 0,1" || who == "ranks 0-1") ranks.insert({0, 1});
    if (who == "rank 0") ranks.insert(0);
    if (who == "rank 1") ranks.insert(1);
  }
  return ranks;
}

}  // namespace fsdp::testing
