// Preemption signals, the save deadline and SLURM requeue (see preempt.h, NOTE [preemption]).
#include "preempt.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "fsdp/error.h"

extern char** environ;

namespace fsdp_train {

using fsdp::cat;

namespace {

struct Named {
  const char* name;
  int sig;
};
const Named kSignals[] = {{"TERM", SIGTERM}, {"INT", SIGINT}, {"USR1", SIGUSR1},
                          {"USR2", SIGUSR2}, {"HUP", SIGHUP}};

volatile sig_atomic_t g_received = 0;

extern "C" void on_preempt_signal(int sig) {
  if (g_received == 0) g_received = sig;
  if (sig == SIGINT) {
    // A second SIGINT stops at once: its default action from now on.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGINT, &dfl, nullptr);
  }
}

void write_stderr(const std::string& line) {
  for (size_t done = 0; done < line.size();) {
    const ssize_t n = ::write(2, line.data() + done, line.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace

std::vector<int> parse_signal_list(const std::string& list) {
  std::vector<int> out;
  std::string upper = list;
  std::transform(upper.begin(), upper.end(), upper.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  if (upper == "NONE") return out;
  size_t start = 0;
  while (start <= upper.size()) {
    size_t end = upper.find(',', start);
    if (end == std::string::npos) end = upper.size();
    std::string name = upper.substr(start, end - start);
    if (name.rfind("SIG", 0) == 0) name = name.substr(3);
    const Named* hit = nullptr;
    for (const auto& n : kSignals) {
      if (name == n.name) hit = &n;
    }
    FSDP_CHECK(hit, "--save-on-signal '", list, "': '", list.substr(start, end - start),
               "' is not a signal fsdp-train can save on; use a comma-separated list of TERM, "
               "INT, USR1, USR2, HUP, or none");
    if (std::find(out.begin(), out.end(), hit->sig) == out.end()) out.push_back(hit->sig);
    start = end + 1;
  }
  return out;
}

std::string signal_name(int sig) {
  for (const auto& n : kSignals) {
    if (n.sig == sig) return cat("SIG", n.name);
  }
  return cat("signal ", sig);
}

PreemptSignals::PreemptSignals(const std::vector<int>& signals) : signals_(signals) {
  g_received = 0;
  struct sigaction sa {};
  sa.sa_handler = on_preempt_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // collectives and file writes continue through the signal
  for (int sig : signals_) {
    std::vector<char> old(sizeof(struct sigaction));
    sigaction(sig, &sa, reinterpret_cast<struct sigaction*>(old.data()));
    old_.push_back(std::move(old));
  }
}

PreemptSignals::~PreemptSignals() {
  for (size_t i = 0; i < signals_.size(); ++i) {
    sigaction(signals_[i], reinterpret_cast<const struct sigaction*>(old_[i].data()), nullptr);
  }
}

int PreemptSignals::received() const { return g_received; }

struct Deadline::State {
  std::mutex mu;
  std::condition_variable cv;
  bool disarmed = false;
  std::thread thread;
};

Deadline::Deadline(double seconds, int code, std::string message) : state_(new State) {
  State* s = state_;
  s->thread = std::thread([s, seconds, code, message = std::move(message)] {
    std::unique_lock<std::mutex> lock(s->mu);
    const auto limit = std::chrono::duration<double>(seconds);
    if (s->cv.wait_for(lock, limit, [s] { return s->disarmed; })) return;
    write_stderr(message + "\n");
    std::_Exit(code);  // the save hangs in a collective or on the disk: nothing to unwind safely
  });
}

Deadline::~Deadline() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->disarmed = true;
  }
  state_->cv.notify_all();
  state_->thread.join();
  delete state_;
}

void requeue_slurm_job() {
  const char* job = std::getenv("SLURM_JOB_ID");
  FSDP_CHECK(job && *job, "--requeue: SLURM_JOB_ID is not set, so there is no SLURM job to "
             "requeue; run under sbatch, or drop --requeue");
  std::string id = job;
  std::vector<char*> argv = {const_cast<char*>("scontrol"), const_cast<char*>("requeue"),
                             id.data(), nullptr};
  pid_t pid = -1;
  const int err = ::posix_spawnp(&pid, "scontrol", nullptr, nullptr, argv.data(), environ);
  FSDP_CHECK(err == 0, "--requeue: cannot run scontrol: ", std::strerror(err),
             "; is SLURM's client installed on this node?");
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  FSDP_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "--requeue: 'scontrol requeue ", id,
             "' failed (status ", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status),
             "); requeue the job by hand (the checkpoint is saved)");
}

}  // namespace fsdp_train
