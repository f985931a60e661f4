// libFuzzer target: the launcher's environment parsing. The input is an environment, one
// "KEY=VALUE" per line; a line may start with a byte >= 0x80 that stands for one of the
// variables detect_cluster reads (so the fuzzer reaches them without guessing names). Runs
// detect_cluster (torchrun, SLURM, OpenMPI, fsdp's own), and the SLURM helpers on every value:
// first_slurm_host (host lists such as "rack[1-2]-n[003-005,9]"), parse_slurm_tasks_per_node
// ("2(x3),1") and slurm_port_for_step.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "fsdp/cluster.h"
#include "fuzz_common.h"

namespace {
const char* const kVars[] = {  // every variable src/launch/cluster.cpp reads
    "FSDP_LAUNCHER", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE", "OMP_NUM_THREADS", "RANK", "SLURM_CPUS_PER_TASK", "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_LOCALID", "SLURM_NNODES", "SLURM_NODEID",
    "SLURM_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_STEPID", "SLURM_STEP_ID",
    "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "WORLD_SIZE"};
constexpr size_t kNumVars = sizeof(kVars) / sizeof(kVars[0]);
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fsdp::EnvMap env;
  std::istringstream lines(std::string(reinterpret_cast<const char*>(data), size));
  std::string line;
  while (std::getline(lines, line)) {
    std::string key, value;
    const unsigned char first = line.empty() ? 0 : static_cast<unsigned char>(line[0]);
    if (first >= 0x80) {
      key = kVars[(first - 0x80) % kNumVars];
      value = line.substr(line.size() > 1 && line[1] == '=' ? 2 : 1);
    } else {
      const auto eq = line.find('=');
      if (eq == std::string::npos) continue;
      key = line.substr(0, eq);
      value = line.substr(eq + 1);
    }
    env[key] = value;
  }
  using fsdp_fuzz::expect_ok_or_fsdp_error;
  expect_ok_or_fsdp_error("detect_cluster", [&] { fsdp::detect_cluster(env); });
  for (const auto& entry : env) {
    const std::string& value = entry.second;  // (structured bindings cannot be captured in C++17)
    expect_ok_or_fsdp_error("first_slurm_host", [&] { fsdp::first_slurm_host(value); });
    expect_ok_or_fsdp_error("parse_slurm_tasks_per_node",
                            [&] { fsdp::parse_slurm_tasks_per_node(value); });
    expect_ok_or_fsdp_error("slurm_port_for_step",
                            [&] { fsdp::slurm_port_for_step(value, static_cast<int64_t>(size)); });
  }
  return 0;
}
