// One rank's Runtime (see fsdp/runtime.h): its backend and device, the process settings it
// applies (configure_process, process_setup.cpp), its rendezvous (rendezvous.cpp), and the
// world group and new groups it builds on the rendezvous store.
#include "fsdp/runtime.h"

#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <mutex>

#include "base/addr_info.h"
#include "base/compat.h"
#include "base/unique_fd.h"
#include "comm/backend_internal.h"
#include "comm/c10d_group.h"
#include "fsdp/cluster.h"
#include "fsdp/error.h"
#include "runtime/rendezvous.h"
#include "runtime/runtime_internal.h"

#if defined(FSDP_WITH_CUDA)
#include <torch/cuda.h>
#endif

namespace fsdp {

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

// The local address this machine uses to reach `host`: Gloo must listen on an address the other
// nodes can reach, and the hostname often resolves to 127.0.1.1 on Debian.
std::string local_address_towards(const std::string& host, int port) {
  const detail::AddrInfo res = detail::resolve(host, port, AF_INET, SOCK_DGRAM);
  FSDP_CHECK(res.ok(), "cannot resolve the master address '", host, "': ", res.error(),
             "; fix --master-addr / MASTER_ADDR");
  const detail::UniqueFd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  std::string result = "127.0.0.1";
  const addrinfo* a = res.get();
  if (fd.valid() && ::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET_ADDRSTRLEN];
      if (inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf))) result = buf;
    }
  }
  return result;
}

}  // namespace

struct Runtime::Impl {
  ClusterEnv env;
  RuntimeOptions options;
  Backend backend = Backend::kGloo;
  std::string backend_reason;
  bool heap_applied = false;
  c10::Device device{c10::kCPU};
  int64_t threads = 1;
  // Declared before the groups, so destroyed after them: they use its store.
  std::unique_ptr<detail::Rendezvous> rendezvous;
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  std::shared_ptr<Group> world;
  std::mutex mu;  // guards groups_created
  int64_t groups_created = 0;
  // fsdp::Trace's events (fsdp/trace.h): this runtime's groups, engines and checkpoints record
  // into it while a trace is on.
  std::shared_ptr<detail::TraceSlot> trace = std::make_shared<detail::TraceSlot>();

  std::shared_ptr<Group> make_group(const std::vector<int64_t>& ranks, int64_t group_rank,
                                    const std::string& prefix, const std::string& kind,
                                    CollectiveAlgorithm algorithm = CollectiveAlgorithm::kAuto) {
    if (algorithm == CollectiveAlgorithm::kAuto) algorithm = options.algorithm;
    const int64_t size = static_cast<int64_t>(ranks.size());
    if (size == 1) return make_single_process_group(env.rank, kind);
    const auto& store = rendezvous->store();
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
                                     algorithm, check_store, options.timeout, trace);
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
                                   /*nccl=*/false, algorithm, check_store, options.timeout,
                                   trace);
  }
};

struct RuntimeFactory {
  static detail::Rendezvous& rendezvous(Runtime& rt) { return *rt.impl_->rendezvous; }
  static detail::TraceSlot* trace(const Runtime& rt) { return rt.impl_->trace.get(); }
  // Meets the other ranks on `store`, creates the world group and the Runtime.
  static std::shared_ptr<Runtime> finish(std::unique_ptr<Runtime::Impl> impl,
                                         c10::intrusive_ptr<c10d::Store> store) {
    auto& m = *impl;
    const ClusterEnv& env = m.env;
    m.rendezvous = std::make_unique<detail::Rendezvous>(std::move(store), env, m.options.timeout);
    m.rendezvous->join();
    if (env.world_size > 1) {
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
  ProcessOptions process;
  process.threads = impl->threads;
  process.heap = options.heap;
  impl->heap_applied = configure_process(process).heap_applied;
  auto store = detail::connect_store(env, options.timeout);
  return RuntimeFactory::finish(std::move(impl), std::move(store));
}

namespace detail {
std::shared_ptr<Runtime> make_runtime(c10::intrusive_ptr<c10d::Store> store, const ClusterEnv& env,
                                      const RuntimeOptions& options) {
  auto impl = RuntimeFactory::prepare(env, options);
  impl->threads = at::get_num_threads();
  return RuntimeFactory::finish(std::move(impl), std::move(store));
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
    impl_->rendezvous->leave();
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
  impl_->rendezvous->check_agreement(what, value);
}

void Runtime::check_all_ok(const std::string& what, const std::string& local_error) {
  impl_->rendezvous->check_all_ok(what, local_error);
}

namespace detail {

TraceSlot* trace_slot(const Runtime& rt) { return RuntimeFactory::trace(rt); }

c10::intrusive_ptr<c10d::Store> runtime_store(Runtime& rt) {
  return RuntimeFactory::rendezvous(rt).store();
}

int64_t reserve_agreement(Runtime& rt) {
  return RuntimeFactory::rendezvous(rt).reserve_agreement();
}

void check_all_ok_reserved(Runtime& rt, int64_t id, const std::string& what,
                           const std::string& local_error, const std::atomic<bool>* cancel) {
  RuntimeFactory::rendezvous(rt).check_all_ok_reserved(id, what, local_error, cancel);
}

}  // namespace detail

}  // namespace fsdp
