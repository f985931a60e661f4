// Preemption (--save-on-signal, --requeue, --signal-save-timeout): the signals that ask fsdp-train
// to finish its step, save a checkpoint and exit, and what happens after the save.
//
// NOTE [preemption]
// The first configured signal (default SIGTERM, SIGINT, SIGUSR1) only sets a flag. Every rank
// reports its flag in the step's metrics all-gather, a collective every rank runs after every
// step, so all ranks see the signal after the same step even if it reached one rank (or one
// node) only, and none blocks in a collective another rank skipped. They then save that step
// synchronously (bounded by --signal-save-timeout: past it a rank exits anyway, saying so), rank
// 0 runs `scontrol requeue $SLURM_JOB_ID` if --requeue (bounded the same way), and every rank
// exits with status 128 + the signal's number (143 SIGTERM, 130 SIGINT, 138 SIGUSR1). A second
// SIGINT stops at once (the default action: the rank dies by SIGINT, without saving). Without
// --checkpoint-dir signals keep their default action.
#pragma once

#include <string>
#include <vector>

namespace fsdp_train {

// "TERM,INT,USR1" (names with or without SIG, any case) -> signal numbers; "none" -> {}.
// Throws fsdp::Error naming an unknown or unsupported signal.
std::vector<int> parse_signal_list(const std::string& list);

// "SIGTERM" for SIGTERM.
std::string signal_name(int sig);

// Handlers for `signals` while alive (the old ones are restored after). Not thread-safe: one
// object per process.
class PreemptSignals {
 public:
  explicit PreemptSignals(const std::vector<int>& signals);
  ~PreemptSignals();
  PreemptSignals(const PreemptSignals&) = delete;
  PreemptSignals& operator=(const PreemptSignals&) = delete;
  // The first signal received, 0 if none.
  int received() const;

 private:
  std::vector<int> signals_;
  std::vector<std::vector<char>> old_;  // struct sigaction of each, as bytes
};

// Exits the process with `code` after printing `message` unless disarmed within `seconds`.
class Deadline {
 public:
  Deadline(double seconds, int code, std::string message);
  ~Deadline();  // disarms
  Deadline(const Deadline&) = delete;
  Deadline& operator=(const Deadline&) = delete;

 private:
  struct State;
  State* state_;
};

// Runs `scontrol requeue $SLURM_JOB_ID`; throws fsdp::Error with the reason if it fails.
void requeue_slurm_job();

}  // namespace fsdp_train
