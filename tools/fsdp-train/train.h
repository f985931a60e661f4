// fsdp-train's two modes once the flags are valid: the dry run (topology report, in-process) and
// training (one rank of the job; the supervisor has already started the others).
#pragma once

#include "options.h"

namespace fsdp_train {

// Prints the topology report for plan.world_size ranks (text, or JSON with --json). Returns 0.
int run_dry_run(const TrainOptions& o, const TrainPlan& plan);

// --plan (plan.cpp): the planner's table for this model on this machine (the calibrated cluster
// file if there is one), with this run's strategy and mesh marked. Returns 0.
int run_plan(const TrainOptions& o, const TrainPlan& plan);

// Throws fsdp::Error unless every --freeze glob matches a parameter of the model and at least one
// parameter stays trainable. Builds nothing of the model's size.
void check_freeze(const std::vector<std::string>& patterns, const ModelPreset& preset);

// Joins the job (fsdp::Runtime::init), shards the GPT, trains o.steps optimizer steps (the
// Trainer, trainer.h); rank 0 prints the banner, progress and summary and writes --metrics and
// --plot. Returns 0, or 128 + the signal after a --save-on-signal save (NOTE [preemption] in
// preempt.h); throws on failure.
int run_training(const TrainOptions& o, const TrainPlan& plan);

}  // namespace fsdp_train
