// fsdp-train: train a byte-level GPT with FSDP / HSDP on this machine or a cluster, the project's
// end-to-end demo.
//
//   fsdp-train --devices 4 --strategy hybrid_shard --mesh 2,2 --model small --plot loss.png
//   fsdp-train --devices 8 --mesh 2,4 --strategy hybrid_shard --dry-run
//   torchrun --nproc-per-node 4 fsdp-train --strategy full_shard      (or srun, mpirun)
//
// The same program is supervisor and rank: started by hand with --devices N > 1 it validates every
// flag, re-executes itself as N ranks and supervises them (fsdp::launch_self); started by a
// launcher it is one rank. Exit status: 0 done, 2 invalid flags (nothing was started), 1 failure
// while running (or the failed rank's status, from the supervisor).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <iostream>

#include "fsdp/cluster.h"
#include "fsdp/error.h"
#include "fsdp/launcher.h"
#include "options.h"
#include "resume.h"
#include "train.h"

namespace {

// One line, always: fsdp-train's errors are meant to be read at a glance.
int fail(int code, const std::string& message, const std::string& where = "") {
  std::string line = message;
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  // One write(2): ranks sharing a terminal must not interleave their lines (issue 9).
  line = "fsdp-train: error: " + where + line + "\n";
  std::cerr.flush();
  for (size_t done = 0; done < line.size();) {
    ssize_t n = ::write(2, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  return code;
}

// A launcher started us: the world comes from it; the launch flags the user gave must agree.
fsdp::ClusterEnv rank_environment(const CLI::App& app, const fsdp::LaunchOptions& launch,
                                  const fsdp::ClusterEnv& env) {
  fsdp::GivenLaunchOptions given;
  if (app.count("--devices")) given.devices = launch.nproc_per_node;
  if (app.count("--num-nodes")) given.num_nodes = launch.num_nodes;
  if (app.count("--node-rank")) given.node_rank = launch.node_rank;
  if (app.count("--master-addr")) given.master_addr = launch.master_addr;
  if (app.count("--master-port")) given.master_port = launch.master_port;
  if (app.count("--max-restarts")) given.max_restarts = launch.max_restarts;
  fsdp::check_matches_environment(given, env);
  return fsdp::apply_master_flags(given, env);  // e.g. --master-port under srun
}

// Usage errors: everything is checked here, before any process or thread starts. Returns the
// plan and sets `env` to where this process sits; throws fsdp::Error naming the bad flag.
fsdp_train::TrainPlan check_usage(const CLI::App& app, const fsdp_train::TrainOptions& o,
                                  fsdp::ClusterEnv* env) {
  const fsdp::LaunchOptions& launch = o.launch;
  fsdp_train::TrainPlan plan;
  *env = fsdp::detect_cluster(fsdp::current_environment());
  const bool is_rank = env->kind != fsdp::ClusterKind::kSingle && !o.dry_run && !o.plan;
  if (is_rank) {
    *env = rank_environment(app, launch, *env);
    plan = fsdp_train::check_options(o, env->world_size, env->local_world_size);
  } else {
    if ((o.dry_run || o.plan) && launch.num_nodes > 1) {
      // A dry run starts nothing, so a multi-node plan needs no --master-port: check the
      // node flags here and the rest as for one node.
      FSDP_CHECK(launch.node_rank >= 0 && launch.node_rank < launch.num_nodes, "--node-rank ",
                 launch.node_rank, " is outside 0..", launch.num_nodes - 1, " for --num-nodes ",
                 launch.num_nodes);
      fsdp::LaunchOptions one_node = launch;
      one_node.num_nodes = 1;
      one_node.node_rank = 0;
      fsdp::validate(one_node);
    } else {
      fsdp::validate(launch);
    }
    plan = fsdp_train::check_options(o, launch.nproc_per_node * launch.num_nodes,
                                     launch.nproc_per_node);
  }
  fsdp_train::check_freeze(o.freeze, plan.preset);
  return plan;
}

// This process as one rank of the job: trains, and turns a failure into one line naming the rank.
int train(const fsdp_train::TrainOptions& o, const fsdp_train::TrainPlan& plan,
          const fsdp::ClusterEnv& env) {
  try {
    return fsdp_train::run_training(o, plan);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    // Name the rank, unless the message already starts with it.
    const std::string message = fsdp::error_message(e);
    const std::string where = env.world_size > 1 && message.rfind("rank ", 0) != 0
                                  ? fsdp::cat("rank ", env.rank, ": ")
                                  : std::string();
    if (env.rank == 0 && !o.quiet && ::isatty(2)) std::cerr << "\n";  // leave the progress bar
    return fail(1, message, where);
  }
}

}  // namespace

int main(int argc, char** argv) {
  fsdp_train::TrainOptions o;
  CLI::App app{
      "fsdp-train: train a byte-level GPT with FSDP/HSDP (libtorch). With --devices N it starts\n"
      "and supervises N ranks itself; under torchrun, srun or mpirun it is one rank of the job."};
  fsdp_train::add_flags(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(2, std::string(e.what()) + " (see fsdp-train --help)");
  }

  // An operator's check of a checkpoint: no cluster, no training.
  if (!o.check_checkpoint.empty()) {
    try {
      return fsdp_train::run_check_checkpoint(o.check_checkpoint);
    } catch (const std::exception& e) {
      return fail(1, fsdp::error_message(e));
    }
  }

  fsdp::ClusterEnv env;
  fsdp_train::TrainPlan plan;
  try {
    plan = check_usage(app, o, &env);
  } catch (const std::exception& e) {
    return fail(2, fsdp::error_message(e));
  }

  // A rank that saves on SIGTERM (NOTE [preemption]) needs more than the supervisor's usual
  // grace before SIGKILL when the job is interrupted: its step and the save.
  if (!plan.save_signals.empty()) {
    o.launch.signal_grace =
        std::chrono::milliseconds(static_cast<int64_t>((o.signal_save_timeout + 60) * 1000));
  }
  try {
    if (o.dry_run) return fsdp_train::run_dry_run(o, plan);
    if (o.plan) return fsdp_train::run_plan(o, plan);
    fsdp_train::create_output_dirs(o);  // before any rank: the ranks find them
    if (env.kind == fsdp::ClusterKind::kSingle) {
      // Supervisor of a multi-process job, or nullopt for a one-process job.
      if (std::optional<int> code = fsdp::launch_self(argc, argv, o.launch)) return *code;
    }
  } catch (const std::exception& e) {
    return fail(1, fsdp::error_message(e));
  }
  return train(o, plan, env);
}
