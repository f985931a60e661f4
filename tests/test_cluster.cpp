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
                           {"SLURM_NODEID", "1"}, {"SLURM_NNODES", "2"},
                           {"SLURM_NODELIST", "gpu[017-018]"}, {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(c.kind, ClusterKind::kSlurm);
  EXPECT_EQ(c.rank, 6);
  EXPECT_EQ(c.local_rank, 2);
  EXPECT_EQ(c.local_world_size, 4);
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_EQ(c.master_addr, "gpu017");
  EXPECT_EQ(c.master_port, 15000 + 3456);
}

TEST(Cluster, SlurmMasterOverride) {
  auto c = detect_cluster({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NNODES", "1"},
                           {"SLURM_NODELIST", "n1"}, {"SLURM_JOB_ID", "7"},
                           {"MASTER_ADDR", "head"}, {"MASTER_PORT", "4000"}});
  EXPECT_EQ(c.master_addr, "head");
  EXPECT_EQ(c.master_port, 4000);
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
  EXPECT_NE(error_of({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}}).find("SLURM_PROCID=3"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "5"},
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
  EXPECT_EQ(fsdp::slurm_port_for_job("42"), 15042);
  EXPECT_EQ(fsdp::slurm_port_for_job("1234567"), 15000 + 4567);
  EXPECT_EQ(fsdp::slurm_port_for_job("99_3"), 15099);  // array job
  EXPECT_THROW(fsdp::slurm_port_for_job("abc"), fsdp::Error);
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
