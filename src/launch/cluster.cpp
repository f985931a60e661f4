// Launcher environment detection (see fsdp/cluster.h).
#include "fsdp/cluster.h"

#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <optional>
#include <vector>

#include "fsdp/error.h"

extern char** environ;

namespace fsdp {

const char* to_string(ClusterKind kind) {
  switch (kind) {
    case ClusterKind::kSingle: return "single process";
    case ClusterKind::kFsdpLauncher: return "fsdp-run";
    case ClusterKind::kTorchElastic: return "torchrun";
    case ClusterKind::kSlurm: return "SLURM";
    case ClusterKind::kOpenMPI: return "OpenMPI";
  }
  return "?";
}

std::string ClusterEnv::describe() const {
  std::string s = detail::cat(to_string(kind), ": rank ", rank, " of ", world_size, " (node ",
                              node_rank, " of ", num_nodes, ", local rank ", local_rank, " of ",
                              local_world_size, ")");
  if (world_size > 1) s += detail::cat(", master ", master_addr, ":", master_port);
  return s;
}

EnvMap current_environment() {
  EnvMap env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

namespace {

std::optional<std::string> get(const EnvMap& env, const std::string& key) {
  auto it = env.find(key);
  if (it == env.end()) return std::nullopt;
  return it->second;
}

int64_t to_int(const std::string& name, const std::string& text, int64_t min_value) {
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  FSDP_CHECK(!text.empty() && end && *end == '\0' && errno == 0 && v >= min_value, name, "='",
             text, "' is not an integer >= ", min_value, "; fix or unset it");
  return v;
}

std::optional<int64_t> get_int(const EnvMap& env, const std::string& key, int64_t min_value) {
  auto v = get(env, key);
  if (!v) return std::nullopt;
  return to_int(key, *v, min_value);
}

int64_t require_int(const EnvMap& env, const std::string& key, int64_t min_value,
                    const std::string& because) {
  auto v = get_int(env, key, min_value);
  FSDP_CHECK(v.has_value(), key, " is not set but ", because, "; set it (launchers set both)");
  return *v;
}

// Checks the relations every source must satisfy, naming the variables involved.
void check_layout(const ClusterEnv& c, const char* rank_var, const char* size_var,
                  const char* local_rank_var, const char* local_size_var) {
  FSDP_CHECK(c.rank < c.world_size, rank_var, "=", c.rank, " but ", size_var, "=", c.world_size,
             ": a rank must be below the world size; fix the launcher's variables");
  FSDP_CHECK(c.local_rank < c.local_world_size, local_rank_var, "=", c.local_rank, " but ",
             local_size_var, "=", c.local_world_size,
             ": a local rank must be below the local world size");
  FSDP_CHECK(c.local_world_size <= c.world_size, local_size_var, "=", c.local_world_size,
             " exceeds ", size_var, "=", c.world_size, "; fix the launcher's variables");
  FSDP_CHECK(c.world_size % c.local_world_size == 0, size_var, "=", c.world_size,
             " is not a multiple of ", local_size_var, "=", c.local_world_size,
             ": fsdp needs the same number of ranks on every node");
  FSDP_CHECK(c.node_rank < c.num_nodes, "node rank ", c.node_rank, " is not below the ",
             c.num_nodes, " nodes implied by ", size_var, "/", local_size_var);
}

void read_master(const EnvMap& env, ClusterEnv& c, const std::string& who) {
  if (auto a = get(env, "MASTER_ADDR")) {
    FSDP_CHECK(!a->empty(), "MASTER_ADDR is set but empty; set it to rank 0's host");
    c.master_addr = *a;
    c.master_addr_given = true;
  }
  if (auto p = get_int(env, "MASTER_PORT", 1)) {
    FSDP_CHECK(*p <= 65535, "MASTER_PORT=", *p, " is not a TCP port; use 1..65535");
    c.master_port = static_cast<int>(*p);
    c.master_port_given = true;
  }
  if (c.world_size > 1) {
    FSDP_CHECK(c.master_port != 0, "MASTER_PORT is not set but ", who, " started ", c.world_size,
               " ranks; export MASTER_PORT (the same on every rank)");
  }
}

ClusterEnv from_torchrun(const EnvMap& env, ClusterKind kind) {
  ClusterEnv c;
  c.kind = kind;
  c.rank = require_int(env, "RANK", 0, "WORLD_SIZE is set");
  c.world_size = require_int(env, "WORLD_SIZE", 1, "RANK is set");
  c.local_rank = get_int(env, "LOCAL_RANK", 0).value_or(c.rank);
  c.local_world_size = get_int(env, "LOCAL_WORLD_SIZE", 1).value_or(c.world_size);
  check_layout(c, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  c.num_nodes = c.world_size / c.local_world_size;
  c.node_rank = get_int(env, "GROUP_RANK", 0).value_or(c.rank / c.local_world_size);
  FSDP_CHECK(c.node_rank < c.num_nodes, "GROUP_RANK=", c.node_rank, " but WORLD_SIZE/",
             "LOCAL_WORLD_SIZE gives ", c.num_nodes, " nodes; fix the launcher's variables");
  c.restart_count = get_int(env, "TORCHELASTIC_RESTART_COUNT", 0).value_or(0);
  if (auto agent = get(env, "TORCHELASTIC_USE_AGENT_STORE")) {
    // PyTorch writes str(bool): "True" or "False".
    FSDP_CHECK(*agent == "True" || *agent == "False", "TORCHELASTIC_USE_AGENT_STORE='", *agent,
               "' is neither True nor False; unset it unless torchrun set it");
    c.use_agent_store = *agent == "True";
  }
  if (auto run = get(env, "TORCHELASTIC_RUN_ID")) {
    c.job_id = detail::cat("torchrun run '", *run, "' attempt ", c.restart_count);
  }
  read_master(env, c, to_string(kind));
  if (!get(env, "MASTER_ADDR") && c.num_nodes > 1) {
    throw Error(detail::cat("MASTER_ADDR is not set but the job spans ", c.num_nodes,
                            " nodes; export MASTER_ADDR=<rank 0's host>"));
  }
  return c;
}

// srun's tasks (SLURM_STEP_ID is set; a batch script has SLURM_PROCID=0 but is no task of a step).
ClusterEnv from_slurm(const EnvMap& env) {
  ClusterEnv c;
  c.kind = ClusterKind::kSlurm;
  // The step's values: inside an allocation a step may use only some of its tasks and nodes.
  const char* ntasks_var =
      get(env, "SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  const char* nnodes_var = get(env, "SLURM_STEP_NUM_NODES") ? "SLURM_STEP_NUM_NODES"
                           : get(env, "SLURM_NNODES")       ? "SLURM_NNODES"
                                                            : "SLURM_JOB_NUM_NODES";
  const int64_t task = require_int(env, "SLURM_PROCID", 0, "SLURM_STEP_ID is set");
  c.world_size = require_int(env, ntasks_var, 1, "SLURM_PROCID is set");
  FSDP_CHECK(task < c.world_size, "SLURM_PROCID=", task, " but ", ntasks_var, "=", c.world_size,
             ": a rank must be below the world size; fix the launcher's variables");
  c.num_nodes = get_int(env, nnodes_var, 1).value_or(1);
  if (auto per_node = get(env, "SLURM_STEP_TASKS_PER_NODE")) {
    std::vector<int64_t> tasks = parse_slurm_tasks_per_node(*per_node);
    for (int64_t t : tasks) {
      FSDP_CHECK(t == tasks.front(), "srun placed ", c.world_size, " tasks unevenly on ",
                 tasks.size(), " nodes (SLURM_STEP_TASKS_PER_NODE=", *per_node,
                 "), but fsdp needs the same number of ranks on every node; use srun "
                 "--ntasks-per-node=N (with -n a multiple of the nodes)");
    }
    FSDP_CHECK(static_cast<int64_t>(tasks.size()) == c.num_nodes, "SLURM_STEP_TASKS_PER_NODE=",
               *per_node, " lists ", tasks.size(), " nodes but ", nnodes_var, "=", c.num_nodes,
               "; fix the launcher's variables");
  }
  FSDP_CHECK(c.world_size % c.num_nodes == 0, ntasks_var, "=", c.world_size,
             " is not a multiple of ", nnodes_var, "=", c.num_nodes,
             ": fsdp needs the same number of tasks on every node (srun --ntasks-per-node)");
  c.local_world_size = c.world_size / c.num_nodes;
  // Number ranks node by node from SLURM_NODEID and SLURM_LOCALID: with -m cyclic SLURM deals
  // task ids round-robin over the nodes, and the contiguous shard groups would span nodes.
  const auto node = get_int(env, "SLURM_NODEID", 0);
  const auto local = get_int(env, "SLURM_LOCALID", 0);
  c.node_rank = node.value_or(task / c.local_world_size);
  c.local_rank = local.value_or(task % c.local_world_size);
  check_layout(c, "SLURM_PROCID", ntasks_var, "SLURM_LOCALID", "tasks per node");
  c.rank = node && local ? c.node_rank * c.local_world_size + c.local_rank : task;
  auto nodelist = get(env, "SLURM_STEP_NODELIST");  // the step's nodes: rank 0 is on the first
  if (!nodelist) nodelist = get(env, "SLURM_JOB_NODELIST");
  if (!nodelist) nodelist = get(env, "SLURM_NODELIST");
  if (nodelist && !nodelist->empty()) c.master_addr = first_slurm_host(*nodelist);
  auto step = get(env, "SLURM_STEP_ID");
  if (!step) step = get(env, "SLURM_STEPID");
  const int64_t step_id = step ? to_int("SLURM_STEP_ID", *step, 0) : 0;
  if (auto job = get(env, "SLURM_JOB_ID")) {
    c.master_port = slurm_port_for_step(*job, step_id);
    c.job_id = detail::cat("SLURM job ", *job, " step ", step_id);
  }
  read_master(env, c, "srun");  // MASTER_ADDR / MASTER_PORT override the derived values
  if (auto cpus = get_int(env, "SLURM_CPUS_PER_TASK", 1)) c.threads = *cpus;
  return c;
}

ClusterEnv from_openmpi(const EnvMap& env) {
  ClusterEnv c;
  c.kind = ClusterKind::kOpenMPI;
  c.rank = require_int(env, "OMPI_COMM_WORLD_RANK", 0, "OMPI_COMM_WORLD_SIZE is set");
  c.world_size = require_int(env, "OMPI_COMM_WORLD_SIZE", 1, "OMPI_COMM_WORLD_RANK is set");
  c.local_rank = get_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0).value_or(0);
  c.local_world_size = get_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1).value_or(c.world_size);
  check_layout(c, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE");
  c.num_nodes = c.world_size / c.local_world_size;
  c.node_rank = c.rank / c.local_world_size;  // mpirun --map-by slot (its default)
  c.master_port = 29500;
  read_master(env, c, "mpirun");
  FSDP_CHECK(c.num_nodes == 1 || get(env, "MASTER_ADDR"), "MASTER_ADDR is not set but mpirun "
             "spans ", c.num_nodes, " nodes; pass it to every rank: mpirun -x MASTER_ADDR=<host of "
             "rank 0> -x MASTER_PORT=<port> ...");
  return c;
}

}  // namespace

ClusterEnv detect_cluster(const EnvMap& env) {
  ClusterEnv c;
  const bool fsdp = get(env, "FSDP_LAUNCHER").has_value();
  const bool torchrun = get(env, "RANK") || get(env, "WORLD_SIZE") ||
                        get(env, "TORCHELASTIC_RUN_ID");
  const bool slurm = get(env, "SLURM_PROCID") || get(env, "SLURM_NTASKS");
  const bool ompi = get(env, "OMPI_COMM_WORLD_RANK") || get(env, "OMPI_COMM_WORLD_SIZE");
  // Only srun's tasks have a step id; a batch script has SLURM_PROCID=0 too, but is no rank.
  const bool srun_step = get(env, "SLURM_PROCID") && (get(env, "SLURM_STEP_ID") ||
                                                      get(env, "SLURM_STEPID"));
  if (fsdp || torchrun) {
    c = from_torchrun(env, fsdp ? ClusterKind::kFsdpLauncher : ClusterKind::kTorchElastic);
  } else if (slurm && srun_step) {
    c = from_slurm(env);
    if (ompi) {  // srun --mpi=pmix sets both; they must agree
      ClusterEnv o = from_openmpi(env);
      FSDP_CHECK(o.rank == c.rank && o.world_size == c.world_size, "SLURM_PROCID=", c.rank,
                 " SLURM_NTASKS=", c.world_size, " contradict OMPI_COMM_WORLD_RANK=", o.rank,
                 " OMPI_COMM_WORLD_SIZE=", o.world_size,
                 "; unset the variables of the launcher you did not use");
    }
  } else if (ompi) {
    c = from_openmpi(env);
  }
  if (auto t = get_int(env, "OMP_NUM_THREADS", 1)) c.threads = *t;  // over SLURM_CPUS_PER_TASK
  return c;
}

std::string first_slurm_host(const std::string& nodelist) {
  // The first top-level entry: commas inside [...] belong to ranges.
  std::string entry;
  int depth = 0;
  for (char ch : nodelist) {
    if (ch == '[') ++depth;
    if (ch == ']') --depth;
    if (ch == ',' && depth == 0) break;
    entry += ch;
  }
  auto open = entry.find('[');
  if (open == std::string::npos) return entry;
  auto close = entry.find(']', open);
  FSDP_CHECK(close != std::string::npos, "SLURM_NODELIST='", nodelist,
             "' has an unclosed '['; set MASTER_ADDR to rank 0's host");
  std::string range = entry.substr(open + 1, close - open - 1);
  std::string first;
  for (char ch : range) {
    if (ch == ',' || ch == '-') break;
    first += ch;
  }
  // The rest may hold further brackets ("rack[1-2]-n[3-4]"): expand those the same way.
  return first_slurm_host(entry.substr(0, open) + first + entry.substr(close + 1));
}

std::vector<int64_t> parse_slurm_tasks_per_node(const std::string& text) {
  // Entries "N" or "N(xM)", separated by commas.
  std::vector<int64_t> tasks;
  size_t pos = 0;
  auto bad = [&]() {
    return Error(detail::cat("SLURM_STEP_TASKS_PER_NODE='", text, "' is not a list like "
                             "'4(x2),3'; fix or unset it"));
  };
  while (pos < text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string entry = text.substr(pos, end - pos);
    const size_t paren = entry.find("(x");
    const std::string count = entry.substr(0, paren);
    int64_t repeat = 1;
    if (paren != std::string::npos) {
      if (entry.back() != ')') throw bad();
      const std::string r = entry.substr(paren + 2, entry.size() - paren - 3);
      if (r.empty() || r.size() > 9 || r.find_first_not_of("0123456789") != std::string::npos) {
        throw bad();
      }
      repeat = std::stoll(r);
    }
    const bool digits = count.find_first_not_of("0123456789") == std::string::npos;
    if (count.empty() || count.size() > 9 || !digits || repeat < 1 || repeat > 1000000) {
      throw bad();
    }
    tasks.insert(tasks.end(), repeat, std::stoll(count));
    pos = end + 1;
  }
  if (tasks.empty()) throw bad();
  return tasks;
}

int slurm_port_for_step(const std::string& job_id, int64_t step_id) {
  // Array jobs look like "1234_5"; the numeric prefix identifies the allocation.
  std::string digits;
  for (char ch : job_id) {
    if (!std::isdigit(static_cast<unsigned char>(ch))) break;
    digits += ch;
  }
  FSDP_CHECK(!digits.empty() && digits.size() <= 19, "SLURM_JOB_ID='", job_id,
             "' does not start with a number; set MASTER_PORT explicitly");
  FSDP_CHECK(step_id >= 0, "SLURM_STEP_ID=", step_id, " is negative; set MASTER_PORT explicitly");
  // splitmix64 of the job id spreads neighbouring ids over the whole range; consecutive steps of
  // one job get consecutive ports.
  uint64_t z = std::stoull(digits) + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return 15000 + static_cast<int>((z % 10000 + static_cast<uint64_t>(step_id) % 10000) % 10000);
}

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
