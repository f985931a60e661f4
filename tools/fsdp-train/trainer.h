// fsdp-train's training run on one rank (run_training in train.h is its entry point): the Trainer
// that joins the job, builds and shards the model, resumes, trains, validates, checkpoints and
// stops on a signal, and the RunLog it leaves for rank 0's summary once the job has ended.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/async_checkpoint.h"
#include "fsdp/report.h"
#include "fsdp/runtime.h"
#include "fsdp/trace.h"
#include "batches.h"
#include "build_model.h"
#include "memory_account.h"
#include "options.h"
#include "preempt.h"
#include "progress.h"
#include "summary.h"
#include "token_data.h"

namespace fsdp_train {

// The topology report's options for this run (AdamW, --grad-accum, --clip-grad).
fsdp::ReportOptions report_options(const TrainOptions& o, const TrainPlan& p);

// What a run leaves for the summary: it outlives the Trainer, and so the job (the Runtime).
struct RunLog {
  bool lead = false;  // rank 0: prints the banner, progress and summary
  std::vector<StepRecord> records;
  ValLosses val_losses;
  CheckpointLog ckpt;
  std::string backend;  // the collective backend, and why (e.g. auto picked gloo: no GPU)
  std::string heap;     // what --heap did
  std::string sample;   // --sample's bytes
  fsdp::TopologyReport report;
  std::optional<fsdp::TraceSummary> trace;  // --trace: what the timeline measured
  Construction construction;
  MemoryAccount account;  // rank 0's memory at its largest end of forward or backward
};

// One rank's training run. Every method is collective unless it says otherwise: every rank
// calls it at the same point. Not thread-safe.
class Trainer {
 public:
  // Joins the job (fsdp::Runtime::init), checks that every rank runs with the same settings,
  // builds and shards the model and its AdamW, and (rank 0) prints the banner and opens
  // --metrics. `log` must outlive the Trainer. Throws fsdp::Error on failure.
  Trainer(const TrainOptions& o, const TrainPlan& p, RunLog* log);

  // Resumes (--resume), trains to o.steps optimizer steps, validating and checkpointing on the
  // way, then the final save, the exports and --sample. Returns 0, or 128 + the signal after a
  // --save-on-signal save (NOTE [preemption] in preempt.h). Throws fsdp::Error on failure.
  int run();

 private:
  int train_all();  // run() without --trace's failure path
  using Clock = std::chrono::steady_clock;

  // Member initialisers, in member order (see below).
  std::shared_ptr<fsdp::Runtime> join();
  Model build();
  // Setup: rank 0's banner; --resume, returning the first step to train.
  void print_banner() const;
  int64_t resume();
  int64_t continue_from_dcp();  // NOTE [continuing a PyTorch run] in trainer.cpp
  void report_dcp() const;
  // One optimizer step: gradients of the global batch, the update, metrics, checkpoint, logs.
  void train_step(int64_t step);
  double set_lr(int64_t step);
  // Forward and backward of this rank's K micro-batches of the global batch at `offsets`;
  // returns this rank's mean loss over them.
  double accumulate_gradients(int64_t step, const std::vector<int64_t>& offsets);
  StepRecord gather_metrics(double loss, double step_time, double lr,
                            const std::vector<std::pair<std::string, fsdp::CommCounters>>& before,
                            int64_t faults);
  double checkpoint_after(int64_t step);  // seconds a background save blocked, or -1
  void log_step(int64_t step, const StepRecord& rec, double blocked_by_save);  // rank 0: --metrics
  void validate(int64_t steps_done);
  // Checkpoints (NOTE [async saves in fsdp-train] in trainer.cpp).
  void save(int64_t steps_done, bool background);
  void committed(const fsdp::CheckpointInfo& info, bool background);
  void finish_async_save();
  void stop_on_signal(int sig, int64_t steps_done);
  // After the last step: the final save, --export-full, --export-llmc and --sample.
  void finish();

  const TrainOptions& o_;
  const TrainPlan& p_;
  RunLog& log_;
  // Members are built in this order and destroyed in the reverse one, as the locals of the loop
  // they replace were: the runtime first and last (its destructor waits for every rank to leave
  // the job); the data before the model (the memory account's base includes the mapped files);
  // the signal handlers only after --resume (a signal while loading keeps its default action).
  std::shared_ptr<fsdp::Runtime> runtime_;
  const int64_t rank_, world_size_;
  const TokenStream data_;  // memory-mapped (NOTE [token files])
  const std::unique_ptr<TokenStream> val_;  // --val-data, or null
  Model model_;
  LanguageModel& net_;
  torch::optim::AdamW optimizer_;
  std::ofstream metrics_;  // --metrics, rank 0
  BatchSampler sampler_;
  fsdp::AsyncCheckpointer saver_;
  bool staging_reserved_ = false;  // saver_.reserve() called (after the first step run)
  std::optional<fsdp::Trace> trace_;  // --trace, from run() on
  // An event of the training thread in --trace's timeline (nothing without --trace).
  fsdp::Trace::Span span(const char* category, const char* name) const;
  std::optional<PreemptSignals> preempt_;  // installed by run(), after --resume
  // Checkpoints --resume-fallback skipped as damaged (a checksum): never pruned as complete.
  std::vector<std::string> damaged_;
  Progress progress_;
  int64_t first_step_ = 0;
  int stopped_by_ = 0;  // the signal every rank stopped on (NOTE [preemption])
  Clock::time_point train_start_;
};

}  // namespace fsdp_train
