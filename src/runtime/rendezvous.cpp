// How the ranks of a job meet: the rendezvous store, the join and exit barriers, and the
// store-only agreements (see rendezvous.h). Runtime (runtime.cpp) builds its groups on top.
#include "runtime/rendezvous.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <cstring>
#include <exception>
#include <thread>
#include <vector>

#include "base/addr_info.h"
#include "base/compat.h"
#include "fsdp/error.h"
#include "runtime/process_setup.h"
#include "base/unique_fd.h"

namespace fsdp::detail {

namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// Rank 0's listening socket for the rendezvous store, bound to the master address only (not to
// every interface, which is what c10d does on its own): docs/security.md. Returns the fd, which
// the store's server then owns. Prefers IPv4, like local_address_towards
// (runtime.cpp).
int listen_on_master_address(const std::string& host, int port) {
  std::string last_error = "no address";
  for (int family : {AF_INET, AF_INET6}) {
    const AddrInfo res = resolve(host, port, family, SOCK_STREAM);
    for (const addrinfo* a = res.get(); a; a = a->ai_next) {
      UniqueFd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (!fd.valid()) continue;
      int one = 1;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd.get(), 2048) == 0) {
        return fd.release();
      }
      const int err = errno;
      last_error = std::strerror(err);
      if (err == EADDRINUSE) {
        throw Error(detail::cat("rank 0 could not host the rendezvous store: port ", port,
                                " is already in use; choose another --master-port / MASTER_PORT"));
      }
    }
  }
  throw Error(detail::cat("rank 0 cannot listen on the master address ", host, ":", port, " (",
                          last_error, "): rank 0 hosts the rendezvous store, so --master-addr / "
                          "MASTER_ADDR must be an address of rank 0's own host"));
}

std::string seconds(std::chrono::milliseconds ms) {
  return cat(static_cast<double>(ms.count()) / 1000.0, " s");
}

}  // namespace

c10::intrusive_ptr<c10d::Store> connect_store(const ClusterEnv& env,
                                              std::chrono::milliseconds timeout) {
  if (env.world_size == 1) return c10::make_intrusive<c10d::HashStore>();
  auto opts = compat::tcp_store_options();
  opts.port = static_cast<uint16_t>(env.master_port);
  // torchrun 2.x's agent already hosts the store on MASTER_PORT: every rank is a client then.
  opts.isServer = env.rank == 0 && !env.use_agent_store;
  opts.numWorkers = static_cast<size_t>(env.world_size);
  opts.waitWorkers = false;  // our own join (Rendezvous::join) names the missing ranks
  opts.timeout = timeout;
  if (compat::kStoreBindsMasterAddr && opts.isServer) {
    compat::set_store_listen_fd(opts, listen_on_master_address(env.master_addr, env.master_port));
  }
  c10::intrusive_ptr<c10d::Store> store;
  try {
    QuietGlog quiet;
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    if (env.use_agent_store) {
      // The agent's store outlives restarts: each attempt keeps to its own keys, with the prefix
      // PyTorch's env:// rendezvous used for agent stores.
      store = c10::make_intrusive<c10d::PrefixStore>(
          cat("/worker/attempt_", env.restart_count), store);
    }
  } catch (const std::exception& e) {
    const std::string reason = error_message(e);
    if (env.rank == 0 && reason.find("in use") != std::string::npos) {
      throw Error(cat("rank 0 could not host the rendezvous store: port ",
                      env.master_port, " is already in use; choose another "
                      "--master-port / MASTER_PORT"));
    }
    throw Error(cat("rank ", env.rank, " could not reach the rendezvous store at ",
                    env.master_addr, ":", env.master_port, " within ",
                    seconds(timeout), " (", reason,
                    env.use_agent_store
                        ? "); it is hosted by torchrun's agent (TORCHELASTIC_USE_AGENT_"
                          "STORE=True): check that torchrun on the first node runs"
                        : "); check that rank 0 runs and that --master-addr / MASTER_ADDR "
                          "and --master-port / MASTER_PORT point to it, or raise "
                          "--timeout"));
  }
  return store;
}

Rendezvous::Rendezvous(c10::intrusive_ptr<c10d::Store> store, const ClusterEnv& env,
                       std::chrono::milliseconds timeout)
    : store_(std::move(store)), env_(env), timeout_(timeout) {}

int64_t Rendezvous::arrive_and_wait(const std::string& count_key, int64_t expected, bool wait,
                                    const std::atomic<bool>* cancel) {
  int64_t n = store_->add(count_key, 1);
  FSDP_CHECK(n >= 1 && n <= expected, "the rendezvous store at ", env_.master_addr, ":",
             env_.master_port, " answered nonsense (", count_key, " = ", n, "): something else ",
             "listens there, or another job shares the port; fix --master-addr / --master-port");
  if (n == expected) store_->set(count_key + "/all", bytes("1"));
  if (!wait) return n;
  if (cancel) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (!store_->check({count_key + "/all"})) {
      FSDP_CHECK(!cancel->load(), "cancelled while waiting for the other ranks (", count_key, ")");
      if (std::chrono::steady_clock::now() > deadline) return store_->add(count_key, 0);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return expected;
  }
  try {
    store_->wait({count_key + "/all"}, timeout_);
  } catch (const std::exception&) {
    return store_->add(count_key, 0);
  }
  return expected;
}

// Rank 0 records which job owns the store; the others compare, so a rank that reached another
// job's store (two srun steps on one derived port) fails naming both instead of joining it.
void Rendezvous::check_same_job() {
  if (env_.rank == 0) {
    store_->set("fsdp/job", bytes(env_.job_id));
    return;
  }
  std::string owner;
  try {
    store_->wait({"fsdp/job"}, timeout_);
    owner = text(store_->get("fsdp/job"));
  } catch (const std::exception&) {
    throw Error(cat("rendezvous at ", env_.master_addr, ":", env_.master_port,
                    ": rank 0 did not arrive within ", seconds(timeout_),
                    "; start it (same --devices and --num-nodes on every node) or "
                    "raise --timeout"));
  }
  FSDP_CHECK(owner == env_.job_id, "rank ", env_.rank, " (", env_.job_id, ") reached the "
             "rendezvous store at ", env_.master_addr, ":", env_.master_port, " of another job (",
             owner, "); give each job its own MASTER_PORT");
}

void Rendezvous::join() {
  if (env_.world_size == 1) return;
  if (!env_.job_id.empty()) check_same_job();
  int64_t arrived = arrive_and_wait("fsdp/join", env_.world_size, /*wait=*/true);
  FSDP_CHECK(arrived == env_.world_size, "rendezvous at ", env_.master_addr, ":",
             env_.master_port, ": only ", arrived, " of ", env_.world_size,
             " ranks arrived within ", seconds(timeout_),
             "; start the missing ranks (same --devices and --num-nodes on every node) or "
             "raise --timeout");
}

void Rendezvous::leave() {
  if (env_.world_size == 1) return;
  arrive_and_wait("fsdp/exit", env_.world_size, env_.rank == 0);
}

int64_t Rendezvous::next_agreement() {
  std::lock_guard<std::mutex> lock(mu_);
  return agreements_++;
}

void Rendezvous::check_agreement(const std::string& what, const std::string& value) {
  const int64_t W = env_.world_size;
  if (W == 1) return;
  const int64_t id = next_agreement();
  auto& store = *store_;
  const std::string key = cat("fsdp/agree/", id, "/");
  const int64_t rank = env_.rank;
  store.set(key + std::to_string(rank), bytes(value));
  std::string first;
  try {
    store.wait({key + "0"}, timeout_);
    first = text(store.get(key + "0"));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(cat("rank ", rank, " waited ", seconds(timeout_), " for rank 0 to report its ",
                    what, ": ", error_message(e)));
  }
  if (first != value) store.set(key + "mismatch", bytes(cat(rank, "\n", value)));
  store.add(key + "mismatches", first != value ? 1 : 0);
  int64_t arrived = arrive_and_wait(key + "checked", W, /*wait=*/true);
  FSDP_CHECK(arrived == W, "only ", arrived, " of ", W, " ranks checked their ", what, " within ",
             seconds(timeout_), "; a rank is missing or stuck");
  if (store.add(key + "mismatches", 0) == 0) return;
  std::string mismatch = text(store.get(key + "mismatch"));
  auto nl = mismatch.find('\n');
  throw Error(cat("ranks disagree on the ", what, ": rank 0 has '", first, "' but rank ",
                  mismatch.substr(0, nl), " has '", mismatch.substr(nl + 1),
                  "'; start every rank with the same arguments"));
}

void Rendezvous::check_all_ok(const std::string& what, const std::string& local_error) {
  check_all_ok_reserved(next_agreement(), what, local_error, nullptr);
}

void Rendezvous::check_all_ok_reserved(int64_t id, const std::string& what,
                                       const std::string& local_error,
                                       const std::atomic<bool>* cancel) {
  const int64_t W = env_.world_size;
  if (W == 1) {
    FSDP_CHECK(local_error.empty(), what, " failed: ", local_error);
    return;
  }
  auto& store = *store_;
  const std::string key = cat("fsdp/agree/", id, "/");
  if (!local_error.empty()) store.set(key + "error/" + std::to_string(env_.rank), bytes(local_error));
  store.add(key + "failures", local_error.empty() ? 0 : 1);
  int64_t arrived = arrive_and_wait(key + "checked", W, /*wait=*/true, cancel);
  FSDP_CHECK(local_error.empty(), what, " failed: ", local_error);
  FSDP_CHECK(arrived == W, "only ", arrived, " of ", W, " ranks finished ", what, " within ",
             seconds(timeout_), "; a rank is missing or stuck");
  if (store.add(key + "failures", 0) == 0) return;
  for (int64_t r = 0; r < W; ++r) {
    const std::string k = key + "error/" + std::to_string(r);
    if (!store.check({k})) continue;
    throw Error(cat(what, " failed on rank ", r, ": ", text(store.get(k))));
  }
  throw Error(cat(what, " failed on another rank"));
}

}  // namespace fsdp::detail
