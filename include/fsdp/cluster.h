// fsdp/cluster.h: where this process sits in the job, read from the environment of whichever
// launcher started it: fsdp's own (fsdp-run, or a program's --devices), torchrun/torchelastic,
// SLURM (srun) or OpenMPI (mpirun). No libtorch here: the launcher uses it before any rank exists.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

enum class ClusterKind {
  kSingle,        // no launcher environment: one process, world size 1
  kFsdpLauncher,  // started by fsdp-run or a program's own --devices launcher (FSDP_LAUNCHER=1)
  kTorchElastic,  // torchrun / torchelastic, or RANK and WORLD_SIZE set by hand
  kSlurm,         // srun: SLURM_PROCID, SLURM_NTASKS, ...
  kOpenMPI,       // mpirun: OMPI_COMM_WORLD_RANK, ...
};

const char* to_string(ClusterKind kind);

// This process's place in the job. Nodes must run the same number of ranks; fsdp numbers ranks
// node by node (rank = node_rank * local_world_size + local_rank), so shard groups of contiguous
// ranks stay inside a node whatever order the launcher numbered its tasks in (srun -m cyclic).
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
  // False when fsdp derived the address or port itself (SLURM: first host of the step, a port
  // from the job and step ids) rather than reading MASTER_ADDR / MASTER_PORT: command-line flags
  // may then override them (apply_master_flags, below) without contradicting anything.
  bool master_addr_given = false;
  bool master_port_given = false;
  // torchrun (PyTorch 2.x) hosts the TCPStore in its agent on MASTER_ADDR:MASTER_PORT and says so
  // with TORCHELASTIC_USE_AGENT_STORE=True: every rank, rank 0 included, joins it as a client.
  bool use_agent_store = false;
  // Restarts of the whole job so far (TORCHELASTIC_RESTART_COUNT, set by torchrun and by fsdp's
  // launcher with --max-restarts). With the agent store, keys live under
  // "/worker/attempt_<restart_count>/", so a restarted attempt never sees the previous one's keys.
  int64_t restart_count = 0;
  // Identifies the job for the rendezvous ("SLURM job 12 step 3"); ranks of another job that
  // reach the same store are told so instead of joining it. Empty when unknown.
  std::string job_id;
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

// Tasks per node of a SLURM step, from SLURM_STEP_TASKS_PER_NODE: "2(x3),1" -> {2, 2, 2, 1}.
std::vector<int64_t> parse_slurm_tasks_per_node(const std::string& text);

// The rendezvous port of a SLURM job step when MASTER_PORT is unset: 15000 + (hash(job id) +
// step id) % 10000. Concurrent steps of one allocation (srun --exact ... &) get different ports,
// and so do jobs whose ids differ by 10000 (Lightning's 15000 + id % 10000 gave them the same).
int slurm_port_for_step(const std::string& job_id, int64_t step_id);

// Checks that command-line launch options agree with the launcher that started this process
// (e.g. --devices 2 under torchrun with LOCAL_WORLD_SIZE=4). `given` holds only the options the
// user set explicitly.
struct GivenLaunchOptions {
  std::optional<int64_t> devices, num_nodes, node_rank;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  std::optional<int64_t> max_restarts;  // fsdp's own launcher only: an error under the others
};
// A master address or port that the launcher's environment did not set (fsdp derived it, e.g.
// from SLURM's node list and job id) is no contradiction: the flag wins.
void check_matches_environment(const GivenLaunchOptions& given, const ClusterEnv& env);

// Makes --master-addr / --master-port take effect where check_matches_environment let them
// override derived values: exports them as MASTER_ADDR / MASTER_PORT into this process's
// environment (so Runtime::init() sees them) and returns `env` with them applied.
ClusterEnv apply_master_flags(const GivenLaunchOptions& given, const ClusterEnv& env);

// Number of CPU cores this process may use (sched_getaffinity, capped by SLURM_CPUS_PER_TASK);
// at least 1.
int64_t available_cores();

// Threads each of `local_ranks` ranks should use on this machine: max(1, cores / local_ranks).
int64_t default_threads_per_rank(int64_t local_ranks);

}  // namespace fsdp
