// Probing a TCP port on this machine (the launcher's --master-port check, and picking a free
// port for a single-node job).
#pragma once

namespace fsdp::detail {

// Binds a TCP socket on all interfaces to `port` (0: any free one) and returns the bound port,
// or -errno. A given port is probed with SO_REUSEADDR, like the store's own listening socket
// (rendezvous.cpp): connections of a previous job left in TIME_WAIT do not stop the store from
// binding, so they must not fail the probe either, while a socket *listening* on the port still
// gives EADDRINUSE. Port 0 is picked without it, so the kernel hands out a port nothing holds.
int try_bind(int port);

}  // namespace fsdp::detail
