// Rendezvous, process groups and threads of one rank (see fsdp/runtime.h).
#include "fsdp/runtime.h"

#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <dlfcn.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>

#include "c10d_group.h"
#include "compat.h"
#include "fsdp/error.h"
#include "fsdp/parse_enum.h"
#include "fsdp/cluster.h"
#include "runtime_internal.h"

#if defined(FSDP_WITH_CUDA)
#include <torch/cuda.h>
#endif

namespace fsdp {

const char* to_string(Backend b) {
  switch (b) {
    case Backend::kAuto: return "auto";
    case Backend::kGloo: return "gloo";
    case Backend::kNccl: return "nccl";
  }
  return "?";
}

Backend parse_backend(const std::string& text) {
  return parse_enum(text, {Backend::kAuto, Backend::kGloo, Backend::kNccl}, "backend");
}

// NOTE [CPU heap]: a training step allocates and frees the same activations, gradients and
// gathered parameters every step, most of them 128 KiB - 32 MiB. glibc serves the first large
// blocks with mmap, raises its mmap threshold to the size of the largest one freed, and trims the
// heap top whenever more than twice that is free: after every backward, the activations' pages
// go back to the kernel and the next forward faults them in again, zeroed. Measured with
// fsdp-train (small GPT, global batch 16 x 128, one rank, libtorch 1.13): 37,600 minor faults
// and 0.50 s per step, against about 100 and 0.42 s with the thresholds below (peak RSS 480 ->
// 503 MiB). PyTorch's Python processes mostly escape it: something large freed early (at import)
// raises the adaptive threshold high enough (ddp_peer.py's one process: ~900 faults per step).
// Setting either threshold turns glibc's adaptation off, so both are set.
// kLean does the opposite: a fixed, small mmap threshold sends every block of 128 KiB or more to
// its own mapping, returned to the kernel when freed, and a small trim threshold returns the
// heap top: the heap then holds little freed memory (no fragmentation by large blocks), at the
// cost of faulting large activations in again each step. The engine's own large buffers are
// pooled either way (NOTE [buffer pool] in src/buffer_pool.h).
const char* to_string(HeapPolicy p) {
  switch (p) {
    case HeapPolicy::kRetain: return "retain";
    case HeapPolicy::kLean: return "lean";
    case HeapPolicy::kUnchanged: return "unchanged";
  }
  return "?";
}

HeapPolicy parse_heap_policy(const std::string& text) {
  return parse_enum(text, {HeapPolicy::kRetain, HeapPolicy::kLean, HeapPolicy::kUnchanged},
                    "heap policy");
}

bool set_heap_policy(HeapPolicy policy) {
  if (policy == HeapPolicy::kUnchanged) return true;
#if defined(__GLIBC__)
  const bool retain = policy == HeapPolicy::kRetain;
  // mallopt returns 1 on success; sanitizers' allocators take the call and return 0.
  return ::mallopt(M_MMAP_THRESHOLD, retain ? kRetainMmapThreshold : kLeanMmapThreshold) == 1 &&
         ::mallopt(M_TRIM_THRESHOLD, retain ? kRetainTrimThreshold : kLeanTrimThreshold) == 1 &&
         ::mallopt(M_MMAP_MAX, retain ? kRetainMmapMax : kLeanMmapMax) == 1;
#else
  return false;
#endif
}

void set_threads(int64_t threads) {
  FSDP_CHECK(threads >= 1, "threads ", threads, " is invalid; use 1 or more");
  at::set_num_threads(static_cast<int>(threads));
  // OpenBLAS keeps its own pool, sized from OPENBLAS_NUM_THREADS or the core count at load time.
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(static_cast<int>(threads));
  }
}

namespace detail {

// NOTE [quiet glog]: glog's minimum level is one process-wide flag, and ranks running as threads
// (tests) connect to their stores at the same time. Each scope saving and restoring the level
// itself would race: A saves 0 and sets 3, B saves 3, A restores 0, B restores 3, and glog stays
// quiet for good. So the scopes are counted under one mutex: the first saves the level, the last
// restores it.
namespace {
std::mutex glog_mutex;
int glog_scopes = 0;
int glog_saved_level = 0;
}  // namespace

int* glog_min_level() {
  static int* const level =
      static_cast<int*>(dlsym(RTLD_DEFAULT, "_ZN3fLI17FLAGS_minloglevelE"));
  return level;
}

QuietGlog::QuietGlog() {
  int* level = glog_min_level();
  if (!level) return;
  std::lock_guard<std::mutex> lock(glog_mutex);
  if (glog_scopes++ == 0) {
    glog_saved_level = *level;
    *level = 3;  // FATAL only
  }
}

QuietGlog::~QuietGlog() {
  int* level = glog_min_level();
  if (!level) return;
  std::lock_guard<std::mutex> lock(glog_mutex);
  if (--glog_scopes == 0) *level = glog_saved_level;
}

}  // namespace detail

namespace {

// Whether the libtorch we were compiled against has CUDA (then FSDP_WITH_CUDA is set), and how
// many GPUs this process sees: 0 without a driver, a GPU, or with CUDA_VISIBLE_DEVICES empty.
constexpr bool kCudaBuilt =
#if defined(FSDP_WITH_CUDA)
    true;
#else
    false;
#endif

int64_t visible_gpus() {
#if defined(FSDP_WITH_CUDA)
  return static_cast<int64_t>(torch::cuda::device_count());
#else
  return 0;
#endif
}

std::string cuda_visible_devices() {
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  return v ? detail::cat("CUDA_VISIBLE_DEVICES='", v, "'") : "CUDA_VISIBLE_DEVICES unset";
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// The local address this machine uses to reach `host`: Gloo must listen on an address the other
// nodes can reach, and the hostname often resolves to 127.0.1.1 on Debian.
std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  FSDP_CHECK(rc == 0 && res, "cannot resolve the master address '", host, "': ", gai_strerror(rc),
             "; fix --master-addr / MASTER_ADDR");
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  std::string result = "127.0.0.1";
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET_ADDRSTRLEN];
      if (inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf))) result = buf;
    }
  }
  if (fd >= 0) ::close(fd);
  freeaddrinfo(res);
  return result;
}

// Rank 0's listening socket for the rendezvous store, bound to the master address only (not to
// every interface, which is what c10d does on its own): README "Security". Returns the fd, which
// the store's server then owns. Prefers IPv4, like local_address_towards.
int listen_on_master_address(const std::string& host, int port) {
  std::string last_error = "no address";
  for (int family : {AF_INET, AF_INET6}) {
    addrinfo hints{};
    hints.ai_family = family;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) continue;
    for (addrinfo* a = res; a; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 2048) == 0) {
        freeaddrinfo(res);
        return fd;
      }
      const int err = errno;
      last_error = std::strerror(err);
      ::close(fd);
      if (err == EADDRINUSE) {
        freeaddrinfo(res);
        throw Error(detail::cat("rank 0 could not host the rendezvous store: port ", port,
                                " is already in use; choose another --master-port / MASTER_PORT"));
      }
    }
    freeaddrinfo(res);
  }
  throw Error(detail::cat("rank 0 cannot listen on the master address ", host, ":", port, " (",
                          last_error, "): rank 0 hosts the rendezvous store, so --master-addr / "
                          "MASTER_ADDR must be an address of rank 0's own host"));
}

std::string seconds(std::chrono::milliseconds ms) {
  return detail::cat(static_cast<double>(ms.count()) / 1000.0, " s");
}

}  // namespace

namespace detail {

BackendChoice choose_backend(Backend requested, bool cuda_built, int64_t visible_gpus) {
  switch (requested) {
    case Backend::kGloo: return {Backend::kGloo, "gloo, as requested"};
    case Backend::kNccl:
      FSDP_CHECK(cuda_built, "backend nccl needs CUDA, but this libtorch is a CPU-only build; use "
                 "--backend gloo (or auto), or build against a CUDA libtorch");
      FSDP_CHECK(visible_gpus > 0, "backend nccl needs a GPU, but this CUDA libtorch sees none (",
                 cuda_visible_devices(), "); use --backend gloo (or auto), or run where a GPU is "
                 "visible");
      return {Backend::kNccl, "nccl, as requested"};
    case Backend::kAuto: break;
  }
  if (!cuda_built) return {Backend::kGloo, "auto picked gloo: this libtorch is a CPU-only build"};
  if (visible_gpus == 0) {
    return {Backend::kGloo, detail::cat("auto picked gloo: this libtorch has CUDA but sees no GPU (",
                                        cuda_visible_devices(), ")")};
  }
  return {Backend::kNccl, detail::cat("auto picked nccl: this libtorch has CUDA and sees ",
                                      visible_gpus, visible_gpus == 1 ? " GPU" : " GPUs")};
}

void check_one_gpu_per_rank(int64_t local_rank, int64_t local_world_size, int64_t visible_gpus) {
  FSDP_CHECK(local_world_size <= visible_gpus && local_rank < visible_gpus, local_world_size,
             " ranks run on this node but it has only ", visible_gpus,
             visible_gpus == 1 ? " visible GPU (" : " visible GPUs (", cuda_visible_devices(),
             "), and NCCL needs one GPU per rank; start at most ", visible_gpus,
             " ranks per node (--devices ", visible_gpus, "), or use --backend gloo");
}

}  // namespace detail

struct Runtime::Impl {
  ClusterEnv env;
  RuntimeOptions options;
  Backend backend = Backend::kGloo;
  std::string backend_reason;
  bool heap_applied = false;
  c10::Device device{c10::kCPU};
  int64_t threads = 1;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  std::shared_ptr<Group> world;
  std::mutex mu;  // guards the counters below
  int64_t groups_created = 0;
  int64_t agreements = 0;

  // Waits until `count_key` reached `expected` (every rank add()s 1), up to the timeout. The
  // last arrival sets `count_key + "/all"`, which the others wait for.
  int64_t arrive_and_wait(const std::string& count_key, int64_t expected, bool wait) {
    int64_t n = store->add(count_key, 1);
    FSDP_CHECK(n >= 1 && n <= expected, "the rendezvous store at ", env.master_addr, ":",
               env.master_port, " answered nonsense (", count_key, " = ", n, "): something else ",
               "listens there, or another job shares the port; fix --master-addr / --master-port");
    if (n == expected) store->set(count_key + "/all", bytes("1"));
    if (!wait) return n;
    try {
      store->wait({count_key + "/all"}, options.timeout);
    } catch (const std::exception&) {
      return store->add(count_key, 0);
    }
    return expected;
  }

  std::shared_ptr<Group> make_group(const std::vector<int64_t>& ranks, int64_t group_rank,
                                    const std::string& prefix, const std::string& kind,
                                    CollectiveAlgorithm algorithm = CollectiveAlgorithm::kAuto) {
    if (algorithm == CollectiveAlgorithm::kAuto) algorithm = options.algorithm;
    const int64_t size = static_cast<int64_t>(ranks.size());
    if (size == 1) return make_single_process_group(env.rank, kind);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
    // NOTE [collective check]: its keys, apart from the backend's.
    auto check_store = c10::make_intrusive<c10d::PrefixStore>(prefix + "check/", store);
    if (backend == Backend::kNccl) {
#if defined(FSDP_WITH_CUDA)
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = options.timeout;
      auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, static_cast<int>(group_rank),
                                                            static_cast<int>(size), opts);
      return detail::make_c10d_group(pg, ranks, group_rank, kind, /*flat=*/true, /*nccl=*/true,
                                     algorithm, check_store, options.timeout);
#else
      TORCH_INTERNAL_ASSERT(false, "nccl backend without CUDA support");
#endif
    }
    auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout);
    opts->devices.push_back(gloo_device);
    opts->threads = 2;
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, static_cast<int>(group_rank),
                                                          static_cast<int>(size), opts);
    return detail::make_c10d_group(pg, ranks, group_rank, kind, compat::kGlooHasFlatCollectives,
                                   /*nccl=*/false, algorithm, check_store, options.timeout);
  }
};

struct RuntimeFactory {
  // Rank 0 records which job owns the store; the others compare, so a rank that reached another
  // job's store (two srun steps on one derived port) fails naming both instead of joining it.
  static void check_same_job(Runtime::Impl& m) {
    const ClusterEnv& env = m.env;
    if (env.rank == 0) {
      m.store->set("fsdp/job", bytes(env.job_id));
      return;
    }
    std::string owner;
    try {
      m.store->wait({"fsdp/job"}, m.options.timeout);
      owner = text(m.store->get("fsdp/job"));
    } catch (const std::exception&) {
      throw Error(detail::cat("rendezvous at ", env.master_addr, ":", env.master_port,
                              ": rank 0 did not arrive within ", seconds(m.options.timeout),
                              "; start it (same --devices and --num-nodes on every node) or "
                              "raise --timeout"));
    }
    FSDP_CHECK(owner == env.job_id, "rank ", env.rank, " (", env.job_id, ") reached the "
               "rendezvous store at ", env.master_addr, ":", env.master_port, " of another job (",
               owner, "); give each job its own MASTER_PORT");
  }

  // Meets the other ranks on impl's store, creates the world group and the Runtime.
  static std::shared_ptr<Runtime> finish(std::unique_ptr<Runtime::Impl> impl) {
    auto& m = *impl;
    const ClusterEnv& env = m.env;
    if (env.world_size > 1) {
      if (!env.job_id.empty()) check_same_job(m);
      int64_t arrived = m.arrive_and_wait("fsdp/join", env.world_size, /*wait=*/true);
      FSDP_CHECK(arrived == env.world_size, "rendezvous at ", env.master_addr, ":",
                 env.master_port, ": only ", arrived, " of ", env.world_size,
                 " ranks arrived within ", seconds(m.options.timeout),
                 "; start the missing ranks (same --devices and --num-nodes on every node) or "
                 "raise --timeout");
      if (m.backend == Backend::kGloo) {
        if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
          m.gloo_device = c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
        } else if (env.num_nodes == 1) {
          m.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
        } else {
          m.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname(
              local_address_towards(env.master_addr, env.master_port));
        }
      }
    }
    std::vector<int64_t> all(env.world_size);
    for (int64_t r = 0; r < env.world_size; ++r) all[r] = r;
    m.world = m.make_group(all, env.rank, "fsdp/world/", "world");
    return std::shared_ptr<Runtime>(new Runtime(std::move(impl)));
  }

  static std::unique_ptr<Runtime::Impl> prepare(const ClusterEnv& env,
                                                const RuntimeOptions& options) {
    FSDP_CHECK(options.timeout.count() > 0, "timeout ", options.timeout.count(),
               " ms is invalid; use a positive timeout");
    FSDP_CHECK(options.threads >= 0, "threads ", options.threads,
               " is invalid; use 1 or more (0 = auto)");
    auto impl = std::make_unique<Runtime::Impl>();
    impl->env = env;
    impl->options = options;
    const int64_t gpus = visible_gpus();
    auto choice = detail::choose_backend(options.backend, kCudaBuilt, gpus);
    impl->backend = choice.backend;
    impl->backend_reason = std::move(choice.reason);
    if (impl->backend == Backend::kNccl) {
      detail::check_one_gpu_per_rank(env.local_rank, env.local_world_size, gpus);
      const auto index = static_cast<c10::DeviceIndex>(env.local_rank);
      impl->device = c10::Device(c10::kCUDA, index);
      // Current device of this thread: where c10d's NCCL communicators, its barrier and any
      // tensor created without an explicit device end up.
      compat::set_cuda_device(index);
    }
    return impl;
  }
};

std::shared_ptr<Runtime> Runtime::init(const RuntimeOptions& options) {
  return init(detect_cluster(current_environment()), options);
}

std::shared_ptr<Runtime> Runtime::init(const ClusterEnv& env, const RuntimeOptions& options) {
  auto impl = RuntimeFactory::prepare(env, options);
  impl->threads = options.threads > 0  ? options.threads
                  : env.threads > 0    ? env.threads
                                       : default_threads_per_rank(env.local_world_size);
  set_threads(impl->threads);
  impl->heap_applied = set_heap_policy(options.heap);
  if (env.world_size == 1) {
    impl->store = c10::make_intrusive<c10d::HashStore>();
    return RuntimeFactory::finish(std::move(impl));
  }
  auto opts = compat::tcp_store_options();
  opts.port = static_cast<uint16_t>(env.master_port);
  // torchrun 2.x's agent already hosts the store on MASTER_PORT: every rank is a client then.
  opts.isServer = env.rank == 0 && !env.use_agent_store;
  opts.numWorkers = static_cast<size_t>(env.world_size);
  opts.waitWorkers = false;  // our own join (RuntimeFactory::finish) names the missing ranks
  opts.timeout = options.timeout;
  if (compat::kStoreBindsMasterAddr && opts.isServer) {
    compat::set_store_listen_fd(opts, listen_on_master_address(env.master_addr, env.master_port));
  }
  try {
    detail::QuietGlog quiet;
    impl->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    if (env.use_agent_store) {
      // The agent's store outlives restarts: each attempt keeps to its own keys, with the prefix
      // PyTorch's env:// rendezvous used for agent stores.
      impl->store = c10::make_intrusive<c10d::PrefixStore>(
          detail::cat("/worker/attempt_", env.restart_count), impl->store);
    }
  } catch (const std::exception& e) {
    const std::string reason = error_message(e);
    if (env.rank == 0 && reason.find("in use") != std::string::npos) {
      throw Error(detail::cat("rank 0 could not host the rendezvous store: port ",
                              env.master_port, " is already in use; choose another "
                              "--master-port / MASTER_PORT"));
    }
    throw Error(detail::cat("rank ", env.rank, " could not reach the rendezvous store at ",
                            env.master_addr, ":", env.master_port, " within ",
                            seconds(options.timeout), " (", reason,
                            env.use_agent_store
                                ? "); it is hosted by torchrun's agent (TORCHELASTIC_USE_AGENT_"
                                  "STORE=True): check that torchrun on the first node runs"
                                : "); check that rank 0 runs and that --master-addr / MASTER_ADDR "
                                  "and --master-port / MASTER_PORT point to it, or raise "
                                  "--timeout"));
  }
  return RuntimeFactory::finish(std::move(impl));
}

namespace detail {
std::shared_ptr<Runtime> make_runtime(c10::intrusive_ptr<c10d::Store> store, const ClusterEnv& env,
                                      const RuntimeOptions& options) {
  auto impl = RuntimeFactory::prepare(env, options);
  impl->threads = at::get_num_threads();
  impl->store = std::move(store);
  return RuntimeFactory::finish(std::move(impl));
}
}  // namespace detail

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Runtime::~Runtime() {
  if (!impl_ || impl_->env.world_size == 1) return;
  // A rank leaving on an error does not touch the store: the store may be what failed (a lost
  // link, a dead rank 0), and each store call would add up to another timeout to the failure.
  if (std::uncaught_exceptions() > 0) return;
  // Rank 0 hosts the store: it must outlive every other rank's last use of it.
  try {
    impl_->world.reset();
    impl_->arrive_and_wait("fsdp/exit", impl_->env.world_size, impl_->env.rank == 0);
  } catch (...) {  // a destructor must not throw; peers that died are reported elsewhere
  }
}

const ClusterEnv& Runtime::env() const { return impl_->env; }
int64_t Runtime::rank() const { return impl_->env.rank; }
int64_t Runtime::world_size() const { return impl_->env.world_size; }
Backend Runtime::backend() const { return impl_->backend; }
const std::string& Runtime::backend_reason() const { return impl_->backend_reason; }
bool Runtime::heap_applied() const { return impl_->heap_applied; }
c10::Device Runtime::device() const { return impl_->device; }
const RuntimeOptions& Runtime::options() const { return impl_->options; }
int64_t Runtime::threads() const { return impl_->threads; }
std::shared_ptr<Group> Runtime::world() const { return impl_->world; }

std::shared_ptr<Group> Runtime::new_group(const std::vector<int64_t>& ranks,
                                          const std::string& kind,
                                          CollectiveAlgorithm algorithm) {
  FSDP_CHECK(!ranks.empty(), "new_group: the rank list is empty");
  std::vector<int64_t> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    FSDP_CHECK(sorted[i] >= 0 && sorted[i] < world_size(), "new_group: rank ", sorted[i],
               " is outside the world of ", world_size(), " ranks");
    FSDP_CHECK(i == 0 || sorted[i] != sorted[i - 1], "new_group: rank ", sorted[i],
               " is listed twice");
  }
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    id = impl_->groups_created++;
  }
  auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end()) return nullptr;
  return impl_->make_group(ranks, it - ranks.begin(), detail::cat("fsdp/group/", id, "/"), kind,
                           algorithm);
}

void Runtime::check_agreement(const std::string& what, const std::string& value) {
  const int64_t W = world_size();
  if (W == 1) return;
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    id = impl_->agreements++;
  }
  auto& store = *impl_->store;
  const std::string key = detail::cat("fsdp/agree/", id, "/");
  store.set(key + std::to_string(rank()), bytes(value));
  std::string first;
  try {
    store.wait({key + "0"}, impl_->options.timeout);
    first = text(store.get(key + "0"));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(detail::cat("rank ", rank(), " waited ", seconds(impl_->options.timeout),
                            " for rank 0 to report its ", what, ": ", error_message(e)));
  }
  if (first != value) store.set(key + "mismatch", bytes(detail::cat(rank(), "\n", value)));
  store.add(key + "mismatches", first != value ? 1 : 0);
  int64_t arrived = impl_->arrive_and_wait(key + "checked", W, /*wait=*/true);
  FSDP_CHECK(arrived == W, "only ", arrived, " of ", W, " ranks checked their ", what, " within ",
             seconds(impl_->options.timeout), "; a rank is missing or stuck");
  if (store.add(key + "mismatches", 0) == 0) return;
  std::string mismatch = text(store.get(key + "mismatch"));
  auto nl = mismatch.find('\n');
  throw Error(detail::cat("ranks disagree on the ", what, ": rank 0 has '", first, "' but rank ",
                          mismatch.substr(0, nl), " has '", mismatch.substr(nl + 1),
                          "'; start every rank with the same arguments"));
}

void Runtime::check_all_ok(const std::string& what, const std::string& local_error) {
  const int64_t W = world_size();
  if (W == 1) {
    FSDP_CHECK(local_error.empty(), what, " failed: ", local_error);
    return;
  }
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    id = impl_->agreements++;
  }
  auto& store = *impl_->store;
  const std::string key = detail::cat("fsdp/agree/", id, "/");
  if (!local_error.empty()) store.set(key + "error/" + std::to_string(rank()), bytes(local_error));
  store.add(key + "failures", local_error.empty() ? 0 : 1);
  int64_t arrived = impl_->arrive_and_wait(key + "checked", W, /*wait=*/true);
  FSDP_CHECK(local_error.empty(), what, " failed: ", local_error);
  FSDP_CHECK(arrived == W, "only ", arrived, " of ", W, " ranks finished ", what, " within ",
             seconds(impl_->options.timeout), "; a rank is missing or stuck");
  if (store.add(key + "failures", 0) == 0) return;
  for (int64_t r = 0; r < W; ++r) {
    const std::string k = key + "error/" + std::to_string(r);
    if (!store.check({k})) continue;
    throw Error(detail::cat(what, " failed on rank ", r, ": ", text(store.get(k))));
  }
  throw Error(detail::cat(what, " failed on another rank"));
}

}  // namespace fsdp
