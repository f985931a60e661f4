// fsdp/cluster.h: where this process sits in the job, read from the environment of whichever
// launcher started it: fsdp's own (fsdp-run, or a program's --devices), torchrun/torchelastic,
// SLURM (srun) or OpenMPI (mpirun). No libtorch here: the launcher uses it before any rank exists.
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace fsdp {

enum class ClusterKind {
  kSingle,        // no launcher environment: one process, world size 1
  kFsdpLauncher,  // started by fsdp-run or a program's own --devices launcher (FSDP_LAUNCHER=1)
  kTorchElastic,  // torchrun / torchelastic, or RANK and WORLD_SIZE set by hand
  kSlurm,         // srun: SLURM_PROCID, SLURM_NTASKS, ...
  kOpenMPI,       // mpirun: OMPI_COMM_WORLD_RANK, ...
};

const char* to_string(ClusterKind kind);

// This process's place in the job. Nodes are assumed to run the same number of ranks.
struct ClusterEnv {
  ClusterKind kind = ClusterKind::kSingle;
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  int64_t local_world_size = 1;
  int64_t node_rank = 0;
  int64_t num_nodes = 1;
  std::string master_addr = "127.0.0.1";  // host of rank 0's rendezvous store
  int master_port = 0;                    // its port; 0 only when world_size == 1
  // Intra-op threads the launcher asked for (OMP_NUM_THREADS), 0 if unset.
  int64_t threads = 0;

  // One line, e.g. "torchrun: rank 3 of 8 (node 1 of 2, local rank 1 of 4), master 10.0.0.1:29500".
  std::string describe() const;
};

using EnvMap = std::map<std::string, std::string>;

// A copy of this process's environment.
EnvMap current_environment();

// Detects the launcher from `env`. Precedence: FSDP_LAUNCHER / torchrun (RANK, WORLD_SIZE) over
// SLURM over OpenMPI (torchrun inside a SLURM allocation is common; torchrun then owns the ranks).
// Throws fsdp::Error naming the variable and the fix on missing, malformed or contradictory values
// (RANK >= WORLD_SIZE, RANK without WORLD_SIZE, SLURM_PROCID != OMPI_COMM_WORLD_RANK, ...).
ClusterEnv detect_cluster(const EnvMap& env);

// First host of a SLURM host list: "node[003-005,9],gpu1" -> "node003".
std::string first_slurm_host(const std::string& nodelist);

// The rendezvous port derived from a SLURM job id when MASTER_PORT is unset: 15000 + id % 10000,
// the same rule as Lightning's SLURMEnvironment, so mixed jobs agree.
int slurm_port_for_job(const std::string& job_id);

}  // namespace fsdp
