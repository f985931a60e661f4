// bench_collectives: time the collectives the engine uses, on real processes, per algorithm
// (see CollectiveAlgorithm in collectives.h; "native" exists with libtorch 2.x Gloo and NCCL).
// Prints the median time and the bus bandwidth (bytes each rank moves on the wire per second:
// (S-1)/S of the buffer for all-gather and reduce-scatter, 2(S-1)/S for all-reduce).
//
//   build/bench_collectives [--devices 4] [--sizes 1,4,16,64] [--iters 5]
//
// Sizes are MiB of the full (unsharded) fp32 buffer. It launches its own ranks.
#include <ATen/ATen.h>
#include <torch/version.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "fsdp/error.h"
#include "fsdp/launcher.h"
#include "fsdp/runtime.h"
#include "fsdp/strategy.h"

namespace {

double median_ms(fsdp::Group& world, int iters, const std::function<void()>& op) {
  op();  // warm-up: connections, allocations
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    world.barrier();
    auto t0 = std::chrono::steady_clock::now();
    op();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                     .count());
  }
  // The slowest rank decides: take the max over ranks of each rank's median.
  std::sort(ms.begin(), ms.end());
  at::Tensor m = at::tensor({ms[ms.size() / 2]}, at::kDouble);
  at::Tensor gathered = at::empty({world.size()}, at::kDouble);
  world.all_gather(gathered, m)->wait();
  return gathered.max().item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::LaunchOptions launch;
  launch.name = "bench_collectives";
  launch.devices_flag = "--devices";
  launch.nproc_per_node = 4;
  std::vector<int64_t> sizes = {1, 4, 16, 64};
  int iters = 5;
  const char* usage =
      "usage: bench_collectives [--devices N] [--sizes MiB,MiB,...] [--iters K]\n"
      "  Times all-gather, reduce-scatter (every algorithm) and all-reduce on N local ranks\n"
      "  (default 4) for each buffer size in MiB (default 1,4,16,64), median of K runs\n"
      "  (default 5) after a warm-up, and prints one row per collective and size.\n";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::cout << usage;
      return 0;
    }
    if (flag != "--devices" && flag != "--sizes" && flag != "--iters") {
      std::cerr << "bench_collectives: error: unknown argument '" << flag << "'\n" << usage;
      return 2;
    }
    if (i + 1 >= argc) {
      std::cerr << "bench_collectives: error: " << flag << " needs a value\n" << usage;
      return 2;
    }
    const std::string value = argv[++i];
    if (flag == "--sizes") {
      try {
        sizes = fsdp::parse_mesh_shape(value);  // the same "a,b,c" list syntax
      } catch (const fsdp::Error&) {
        std::cerr << "bench_collectives: error: --sizes '" << value
                  << "' must be MiB sizes separated by commas, e.g. 1,4,16\n";
        return 2;
      }
      for (int64_t mib : sizes) {
        if (mib < 1 || mib > 65536) {
          std::cerr << "bench_collectives: error: --sizes '" << value << "' has " << mib
                    << "; sizes are MiB from 1 to 65536\n";
          return 2;
        }
      }
      continue;
    }
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || errno == ERANGE || n < 1 || n > 1000000) {
      std::cerr << "bench_collectives: error: " << flag << " '" << value
                << "' is invalid; use a whole number from 1 to 1000000\n";
      return 2;
    }
    if (flag == "--devices") launch.nproc_per_node = n;
    if (flag == "--iters") iters = static_cast<int>(n);
  }
  try {
    if (auto rc = fsdp::launch_self(argc, argv, launch)) return *rc;
    auto rt = fsdp::Runtime::init();
    auto& world = *rt->world();
    const int64_t S = world.size();
    std::vector<int64_t> all(S);
    for (int64_t r = 0; r < S; ++r) all[r] = r;
    using A = fsdp::CollectiveAlgorithm;
    struct Algo {
      A algo;
      std::shared_ptr<fsdp::Group> group;
      std::string error;
    };
    std::vector<Algo> algos;
    for (A a : {A::kNative, A::kRing, A::kAllToAll, A::kAllReduce}) {
      Algo entry{a, nullptr, ""};
      try {
        entry.group = rt->new_group(all, "bench", a);
      } catch (const fsdp::Error& e) {
        entry.error = "n/a: this libtorch's Gloo has no flat collectives";
      }
      algos.push_back(entry);
    }
    if (rt->rank() == 0) {
      std::printf("bench_collectives: %lld ranks, Gloo, libtorch %s, %d threads/rank, median of %d\n",
                  static_cast<long long>(S), TORCH_VERSION, static_cast<int>(rt->threads()), iters);
      std::printf("%-26s %9s %10s %12s\n", "collective", "MiB", "ms", "busbw GB/s");
    }
    for (int64_t mib : sizes) {
      const int64_t n = mib * (1 << 20) / 4 / S * S, chunk = n / S;
      const double bytes = static_cast<double>(n) * 4;
      at::Tensor full = at::ones({n}), shard = at::ones({chunk});
      // factor: 1 for all-gather / reduce-scatter, 2 for all-reduce; elem: 4 fp32, 2 bf16.
      auto report = [&](const std::string& name, double ms, double factor, double elem = 4) {
        if (rt->rank() != 0) return;
        std::printf("%-26s %9lld %10.2f %12.3f\n", name.c_str(), static_cast<long long>(mib), ms,
                    bytes / 4 * elem * factor * (S - 1) / S / (ms / 1000) / 1e9);
      };
      for (auto& a : algos) {
        const std::string algo = fsdp::to_string(a.algo);
        if (!a.group) {
          if (rt->rank() == 0) {
            std::printf("%-26s %9lld %s\n", (algo + " all_gather/reduce_scatter").c_str(),
                        static_cast<long long>(mib), a.error.c_str());
          }
          continue;
        }
        if (a.algo == A::kNative || a.algo == A::kRing) {
          report("all_gather/" + algo,
                 median_ms(world, iters, [&] { a.group->all_gather(full, shard)->wait(); }), 1);
        }
        report("reduce_scatter/" + algo,
               median_ms(world, iters, [&] { a.group->reduce_scatter(shard, full)->wait(); }), 1);
      }
      report("all_reduce", median_ms(world, iters, [&] { world.all_reduce(full)->wait(); }), 2);
      at::Tensor half = at::ones({n}, at::kBFloat16);
      report("all_reduce bf16 (ring)", median_ms(world, iters, [&] { world.all_reduce(half)->wait(); }), 2, 2);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_collectives: error: " << fsdp::error_message(e) << "\n";
    return 1;
  }
}
