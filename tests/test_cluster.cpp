// Launcher-environment detection: every source, precedence, and each malformed or
// contradictory combination.
#include <gtest/gtest.h>

#include "fsdp/cluster.h"
#include "fsdp/error.h"
#include "fsdp/launcher.h"

using fsdp::ClusterKind;
using fsdp::detect_cluster;
using fsdp::EnvMap;

namespace {
std::string error_of(const EnvMap& env) {
  try {
    detect_cluster(env);
  } catch (const fsdp::Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Cluster, EmptyEnvironmentIsOneProcess) {
  auto c = detect_cluster({});
  EXPECT_EQ(c.kind, ClusterKind::kSingle);
  EXPECT_EQ(c.world_size, 1);
  EXPECT_EQ(c.rank, 0);
}

TEST(Cluster, Torchrun) {
  auto c = detect_cluster({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                           {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"},
                           {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"},
                           {"TORCHELASTIC_RUN_ID", "x"}, {"OMP_NUM_THREADS", "3"}});
  EXPECT_EQ(c.kind, ClusterKind::kTorchElastic);
  EXPECT_EQ(c.rank, 5);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.local_rank, 1);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_EQ(c.master_addr, "10.0.0.1");
  EXPECT_EQ(c.master_port, 29400);
  EXPECT_EQ(c.threads, 3);
}

TEST(Cluster, FsdpLauncherMarksItsRanks) {
  auto c = detect_cluster({{"FSDP_LAUNCHER", "1"}, {"RANK", "0"}, {"WORLD_SIZE", "2"},
                           {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"},
                           {"MASTER_PORT", "1234"}});
  EXPECT_EQ(c.kind, ClusterKind::kFsdpLauncher);
  EXPECT_EQ(c.master_addr, "127.0.0.1");
}

TEST(Cluster, HandSetRankDefaultsToOneNode) {
  auto c = detect_cluster({{"RANK", "2"}, {"WORLD_SIZE", "4"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(c.local_rank, 2);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.num_nodes, 1);
}

TEST(Cluster, Slurm) {
  auto c = detect_cluster({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
                           {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"}, {"SLURM_STEP_ID", "0"},
                           {"SLURM_NODELIST", "gpu[017-018]"}, {"SLURM_JOB_ID", "123456"},
                           {"SLURM_CPUS_PER_TASK", "3"}});
  EXPECT_EQ(c.kind, ClusterKind::kSlurm);
  EXPECT_EQ(c.rank, 6);
  EXPECT_EQ(c.local_rank, 2);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.master_addr, "gpu017");
  EXPECT_EQ(c.master_port, fsdp::slurm_port_for_step("123456", 0));
  EXPECT_FALSE(c.master_addr_given);
  EXPECT_FALSE(c.master_port_given);
  EXPECT_EQ(c.job_id, "SLURM job 123456 step 0");
  EXPECT_EQ(c.threads, 3);  // SLURM_CPUS_PER_TASK, unless OMP_NUM_THREADS is set
}

TEST(Cluster, SlurmStepNodesAndTasks) {
  // A step on a subset of the job's nodes: rank 0 is on the step's first node, and the step's
  // task counts win over the allocation's.
  auto c = detect_cluster({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                           {"SLURM_NODEID", "0"}, {"SLURM_NNODES", "4"}, {"SLURM_STEP_ID", "3"},
                           {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_STEP_NUM_NODES", "2"},
                           {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}, {"SLURM_JOB_ID", "77"},
                           {"SLURM_NODELIST", "n[1-4]"}, {"SLURM_STEP_NODELIST", "n[3-4]"}});
  EXPECT_EQ(c.world_size, 4);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_EQ(c.local_world_size, 2);
  EXPECT_EQ(c.master_addr, "n3");
  EXPECT_EQ(c.master_port, fsdp::slurm_port_for_step("77", 3));
}

TEST(Cluster, SlurmCyclicDistributionIsNumberedByNode) {
  // srun -N2 -n4 -m cyclic: task 1 is on node 1. fsdp numbers ranks node by node, so the shard
  // groups of a (2, 2) mesh stay inside the nodes.
  auto c = detect_cluster({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"},
                           {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"}, {"SLURM_STEP_ID", "0"},
                           {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}, {"SLURM_JOB_ID", "5"},
                           {"SLURM_NODELIST", "a,b"}});
  EXPECT_EQ(c.rank, 2);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.local_rank, 0);
}

TEST(Cluster, SlurmUnevenTasksFailOnEveryRank) {
  for (const char* id : {"0", "1", "2", "3"}) {
    const std::string local = std::string(id) == "3" ? "0" : id;
    const std::string node = std::string(id) == "3" ? "1" : "0";
    const std::string e = error_of({{"SLURM_PROCID", id}, {"SLURM_NTASKS", "4"},
                                    {"SLURM_LOCALID", local}, {"SLURM_NODEID", node},
                                    {"SLURM_NNODES", "2"}, {"SLURM_STEP_ID", "0"},
                                    {"SLURM_STEP_TASKS_PER_NODE", "3,1"}, {"SLURM_JOB_ID", "5"}});
    EXPECT_NE(e.find("unevenly on 2 nodes (SLURM_STEP_TASKS_PER_NODE=3,1)"), std::string::npos)
        << e;
    EXPECT_NE(e.find("--ntasks-per-node"), std::string::npos) << e;
  }
}

TEST(Cluster, SlurmTasksPerNode) {
  EXPECT_EQ(fsdp::parse_slurm_tasks_per_node("4"), (std::vector<int64_t>{4}));
  EXPECT_EQ(fsdp::parse_slurm_tasks_per_node("2(x3),1"), (std::vector<int64_t>{2, 2, 2, 1}));
  EXPECT_EQ(fsdp::parse_slurm_tasks_per_node("3,1"), (std::vector<int64_t>{3, 1}));
  for (const char* bad : {"", "x", "2(x", "2(x0)", "2(3)", ",", "-1"}) {
    EXPECT_THROW(fsdp::parse_slurm_tasks_per_node(bad), fsdp::Error) << bad;
  }
}

TEST(Cluster, BatchScriptIsNotARank) {
  // Inside an sbatch script SLURM sets SLURM_PROCID=0 (and SLURM_NTASKS), but only srun's tasks
  // have a step id: the script is one process that may launch its own ranks (--devices N).
  auto c = detect_cluster({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "9"},
                           {"SLURM_CPUS_PER_TASK", "4"}});
  EXPECT_EQ(c.kind, ClusterKind::kSingle);
  EXPECT_EQ(c.world_size, 1);
}

TEST(Cluster, TorchrunAgentStore) {
  auto c = detect_cluster({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"},
                           {"TORCHELASTIC_RUN_ID", "none"},
                           {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                           {"TORCHELASTIC_RESTART_COUNT", "2"}});
  EXPECT_EQ(c.kind, ClusterKind::kTorchElastic);
  EXPECT_TRUE(c.use_agent_store);
  EXPECT_EQ(c.restart_count, 2);
  EXPECT_EQ(c.job_id, "torchrun run 'none' attempt 2");
  c = detect_cluster({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"},
                      {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  EXPECT_FALSE(c.use_agent_store);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"},
                      {"TORCHELASTIC_USE_AGENT_STORE", "yes"}})
                .find("TORCHELASTIC_USE_AGENT_STORE='yes'"),
            std::string::npos);
}

TEST(Cluster, SlurmMasterOverride) {
  auto c = detect_cluster({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NNODES", "1"},
                           {"SLURM_NODELIST", "n1"}, {"SLURM_JOB_ID", "7"}, {"SLURM_STEP_ID", "0"},
                           {"MASTER_ADDR", "head"}, {"MASTER_PORT", "4000"}});
  EXPECT_EQ(c.master_addr, "head");
  EXPECT_EQ(c.master_port, 4000);
  EXPECT_TRUE(c.master_addr_given);
  EXPECT_TRUE(c.master_port_given);
}

TEST(Cluster, SallocShellWithoutSrunIsNotARank) {
  // salloc exports SLURM_NTASKS but only srun's tasks get SLURM_PROCID.
  auto c = detect_cluster({{"SLURM_NTASKS", "4"}, {"SLURM_JOB_ID", "9"}});
  EXPECT_EQ(c.kind, ClusterKind::kSingle);
}

TEST(Cluster, OpenMPI) {
  auto c = detect_cluster({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                           {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MASTER_ADDR", "h0"}});
  EXPECT_EQ(c.kind, ClusterKind::kOpenMPI);
  EXPECT_EQ(c.rank, 3);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.num_nodes, 2);
  EXPECT_EQ(c.master_addr, "h0");
  EXPECT_EQ(c.master_port, 29500);
}

TEST(Cluster, TorchrunWinsOverSlurm) {
  auto c = detect_cluster({{"RANK", "1"}, {"WORLD_SIZE", "8"}, {"MASTER_PORT", "5"},
                           {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}});
  EXPECT_EQ(c.kind, ClusterKind::kTorchElastic);
  EXPECT_EQ(c.world_size, 8);
}

TEST(Cluster, Errors) {
  EXPECT_NE(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_PORT", "1"}})
                .find("RANK=4 but WORLD_SIZE=4"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "1"}}).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "2"}}).find("RANK is not set"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}).find("RANK='x'"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}}).find("MASTER_PORT is not set"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT=70000"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "6"}, {"LOCAL_WORLD_SIZE", "4"},
                      {"LOCAL_RANK", "0"}, {"MASTER_PORT", "1"}})
                .find("not a multiple of LOCAL_WORLD_SIZE=4"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"},
                      {"LOCAL_RANK", "2"}, {"MASTER_PORT", "1"}})
                .find("LOCAL_RANK=2"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"},
                      {"LOCAL_RANK", "0"}, {"MASTER_PORT", "1"}})
                .find("MASTER_ADDR is not set"), std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}, {"SLURM_STEP_ID", "0"}})
                .find("SLURM_PROCID=3"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "5"},
                      {"SLURM_STEP_ID", "0"},
                      {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}})
                .find("contradict"), std::string::npos);
  EXPECT_NE(error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}})
                .find("mpirun -x MASTER_ADDR"), std::string::npos);
}

TEST(Cluster, SlurmHostLists) {
  EXPECT_EQ(fsdp::first_slurm_host("node1"), "node1");
  EXPECT_EQ(fsdp::first_slurm_host("a,b,c"), "a");
  EXPECT_EQ(fsdp::first_slurm_host("node[003-005,9],gpu1"), "node003");
  EXPECT_EQ(fsdp::first_slurm_host("node[7,9-12]"), "node7");
  EXPECT_EQ(fsdp::first_slurm_host("rack[1-2]-n[03-04]"), "rack1-n03");
  EXPECT_THROW(fsdp::first_slurm_host("node[1-2"), fsdp::Error);
}

TEST(Cluster, SlurmPort) {
  for (int64_t job : {42, 1234567, 99}) {
    const std::string id = std::to_string(job);
    const int p0 = fsdp::slurm_port_for_step(id, 0);
    EXPECT_GE(p0, 15000);
    EXPECT_LT(p0, 25000);
    // Concurrent steps of one allocation get different ports...
    for (int64_t step = 1; step < 50; ++step) EXPECT_NE(fsdp::slurm_port_for_step(id, step), p0);
    // ... and so do jobs 10000 apart (15000 + id % 10000 gave them the same one).
    EXPECT_NE(fsdp::slurm_port_for_step(std::to_string(job + 10000), 0), p0);
  }
  EXPECT_EQ(fsdp::slurm_port_for_step("99_3", 0), fsdp::slurm_port_for_step("99", 0));  // array
  EXPECT_THROW(fsdp::slurm_port_for_step("abc", 0), fsdp::Error);
}

TEST(Cluster, LaunchOptionValidation) {
  fsdp::LaunchOptions o;
  o.devices_flag = "--devices";
  o.nproc_per_node = 0;
  try {
    fsdp::validate(o);
    FAIL() << "--devices 0 accepted";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--devices 0"), std::string::npos) << e.what();
  }
  o.nproc_per_node = 2;
  o.num_nodes = 2;
  EXPECT_THROW(fsdp::validate(o), fsdp::Error);  // multi-node needs a port
  o.master_port = 29999;
  o.node_rank = 2;
  EXPECT_THROW(fsdp::validate(o), fsdp::Error);  // node rank out of range
  o.node_rank = 1;
  EXPECT_NO_THROW(fsdp::validate(o));
}

TEST(Cluster, FlagsMustMatchTheLauncher) {
  fsdp::ClusterEnv env = detect_cluster({{"RANK", "0"}, {"WORLD_SIZE", "4"},
                                         {"LOCAL_WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"},
                                         {"MASTER_PORT", "7"}});
  fsdp::GivenLaunchOptions given;
  given.devices = 2;
  try {
    fsdp::check_matches_environment(given, env);
    FAIL() << "contradiction accepted";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--devices 2 contradicts"), std::string::npos);
  }
  given.devices = 4;
  EXPECT_NO_THROW(fsdp::check_matches_environment(given, env));
}

TEST(Cluster, MasterFlagsOverrideOnlyDerivedValues) {
  // Under srun without MASTER_ADDR / MASTER_PORT, fsdp derives both: flags may set them.
  fsdp::ClusterEnv env = detect_cluster({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"},
                                         {"SLURM_STEP_ID", "0"}, {"SLURM_JOB_ID", "8"},
                                         {"SLURM_NODELIST", "n1"}});
  fsdp::GivenLaunchOptions given;
  given.master_addr = "10.0.0.9";
  given.master_port = 4567;
  EXPECT_NO_THROW(fsdp::check_matches_environment(given, env));
  // ... but not contradict what a launcher set.
  env = detect_cluster({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "7"}});
  given.master_addr.reset();
  EXPECT_THROW(fsdp::check_matches_environment(given, env), fsdp::Error);
}

TEST(Cluster, NodesFlagIsNamedAsTyped) {
  fsdp::LaunchOptions o;
  o.num_nodes_flag = "--nnodes";
  o.num_nodes = 2;
  try {
    fsdp::validate(o);
    FAIL() << "multi-node without a port accepted";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--nnodes 2 needs --master-port"), std::string::npos)
        << e.what();
  }
  o.master_port = 29999;
  o.max_restarts = -1;
  EXPECT_THROW(fsdp::validate(o), fsdp::Error);
}

TEST(Cluster, MaxRestartsOnlyUnderFsdpsLauncher) {
  fsdp::GivenLaunchOptions given;
  given.max_restarts = 2;
  auto torchrun = detect_cluster({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "7"}});
  try {
    fsdp::check_matches_environment(given, torchrun);
    FAIL() << "--max-restarts under torchrun accepted";
  } catch (const fsdp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("torchrun --max-restarts"), std::string::npos) << e.what();
  }
  // fsdp's own launcher re-executes the program with the same flags: no contradiction there.
  auto own = detect_cluster({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "7"},
                             {"FSDP_LAUNCHER", "1"}});
  EXPECT_NO_THROW(fsdp::check_matches_environment(given, own));
}
