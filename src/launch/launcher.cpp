// Launch options and launching this program as every local rank (see fsdp/launcher.h; the
// supervisor itself is in supervisor.cpp).
#include "fsdp/launcher.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/error.h"
#include "launch/tcp_port.h"

namespace fsdp {

using detail::try_bind;

void validate(const LaunchOptions& o) {
  FSDP_CHECK(o.nproc_per_node >= 1, o.devices_flag, " ", o.nproc_per_node,
             " is invalid: at least 1 process per node is needed; use ", o.devices_flag, " 1 or more");
  FSDP_CHECK(o.nproc_per_node <= 1024, o.devices_flag, " ", o.nproc_per_node,
             " is more processes than one node can run; use at most 1024");
  const std::string& nodes = o.num_nodes_flag;
  FSDP_CHECK(o.num_nodes >= 1, nodes, " ", o.num_nodes, " is invalid; use 1 or more");
  FSDP_CHECK(o.node_rank >= 0 && o.node_rank < o.num_nodes, "--node-rank ", o.node_rank,
             " is outside 0..", o.num_nodes - 1, " for ", nodes, " ", o.num_nodes);
  FSDP_CHECK(!o.master_addr.empty(), "--master-addr is empty; give rank 0's host name or address");
  FSDP_CHECK(o.master_port >= 0 && o.master_port <= 65535, "--master-port ", o.master_port,
             " is not a TCP port; use 1..65535, or omit it to pick a free port");
  FSDP_CHECK(o.num_nodes == 1 || o.master_port != 0, nodes, " ", o.num_nodes,
             " needs --master-port: every node must use the same port, so it cannot be picked "
             "at random");
  FSDP_CHECK(o.threads >= 0, "--threads ", o.threads, " is invalid; use 1 or more (0 = auto)");
  FSDP_CHECK(o.max_restarts >= 0 && o.max_restarts <= 1000, "--max-restarts ", o.max_restarts,
             " is invalid; use 0 (no restarts) .. 1000");
  if (o.node_rank == 0 && o.master_port != 0) {
    int r = try_bind(o.master_port);
    FSDP_CHECK(r != -EADDRINUSE, "--master-port ", o.master_port,
               " is already in use on this machine; choose another port, or omit --master-port "
               "to pick a free one");
  }
}

std::optional<int> launch_self(int argc, char** argv, const LaunchOptions& opts) {
  ClusterEnv env = detect_cluster(current_environment());
  if (env.kind != ClusterKind::kSingle) return std::nullopt;
  if (opts.nproc_per_node == 1 && opts.num_nodes == 1) return std::nullopt;
  std::vector<std::string> args(argv, argv + argc);
  char self[4096];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  FSDP_CHECK(n > 0, "cannot find this program's executable (/proc/self/exe): ",
             std::strerror(errno));
  self[n] = '\0';
  return supervise(opts, args, self);
}

}  // namespace fsdp
