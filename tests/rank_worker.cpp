// fsdp_test_worker: a rank program for the multi-process tests. It joins the job from whatever
// launcher environment it finds and runs one scenario:
//   allreduce            all-reduce of rank+1 over the world, checked against W(W+1)/2
//   die RANK SIGNAL      after one all-reduce, rank RANK kills itself; the others keep reducing
//   exit RANK CODE       rank RANK exits with CODE after joining; the others sleep
//   exit-once RANK CODE  like exit in the first attempt (TORCHELASTIC_RESTART_COUNT 0), then
//                        allreduce in the restarted ones
//   stop RANK            after one all-reduce, rank RANK stops itself (SIGSTOP, frozen); the
//                        others keep reducing until their collective times out
//   sleep                join, then sleep (to be stopped)
// Env: FSDP_TEST_TIMEOUT_MS (collective timeout, default 20000); FSDP_TEST_ABORT_ON_ERROR=1 makes
// an error abort() the rank (SIGABRT), as an exception escaping a thread would.
#include <ATen/ATen.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "fsdp/error.h"
#include "fsdp/runtime.h"

namespace {

void all_reduce_check(fsdp::Runtime& rt) {
  auto t = at::full({3}, static_cast<double>(rt.rank() + 1), at::kFloat);
  rt.world()->all_reduce(t)->wait();
  const double W = static_cast<double>(rt.world_size());
  const double expect = W * (W + 1) / 2;
  if (t[0].item<double>() != expect) {
    throw std::runtime_error("all_reduce gave " + std::to_string(t[0].item<double>()) +
                             ", expected " + std::to_string(expect));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "allreduce";
  try {
    fsdp::RuntimeOptions opts;
    const char* t = std::getenv("FSDP_TEST_TIMEOUT_MS");
    opts.timeout = std::chrono::milliseconds(t ? std::atoll(t) : 20000);
    auto rt = fsdp::Runtime::init(opts);
    const auto& env = rt->env();
    if (mode == "allreduce") {
      all_reduce_check(*rt);
      std::cout << "ok rank " << env.rank << "/" << env.world_size << " kind="
                << fsdp::to_string(env.kind) << " node=" << env.node_rank << "/" << env.num_nodes
                << " local=" << env.local_rank << "/" << env.local_world_size
                << " threads=" << rt->threads() << " attempt=" << env.restart_count
                << std::endl;
      return 0;
    }
    if (mode == "exit-once" && argc > 3) {
      if (env.restart_count == 0 && rt->rank() == std::atoi(argv[2])) std::exit(std::atoi(argv[3]));
      all_reduce_check(*rt);
      std::cout << "ok rank " << env.rank << " attempt=" << env.restart_count << std::endl;
      return 0;
    }
    if (mode == "stop" && argc > 2) {
      all_reduce_check(*rt);
      if (rt->rank() == std::atoi(argv[2])) ::raise(SIGSTOP);
      for (int i = 0; i < 100000; ++i) all_reduce_check(*rt);
      return 0;
    }
    if (mode == "die" && argc > 3) {
      const int victim = std::atoi(argv[2]), sig = std::atoi(argv[3]);
      all_reduce_check(*rt);
      if (rt->rank() == victim) ::kill(::getpid(), sig);
      for (int i = 0; i < 100000; ++i) {
        all_reduce_check(*rt);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      return 0;
    }
    if (mode == "exit" && argc > 3) {
      if (rt->rank() == std::atoi(argv[2])) std::exit(std::atoi(argv[3]));
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    if (mode == "sleep") {
      std::cout << "rank " << rt->rank() << " pid " << ::getpid() << " sleeping" << std::endl;
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    std::cerr << "fsdp_test_worker: unknown mode '" << mode << "'\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fsdp_test_worker: error: " << fsdp::error_message(e) << std::endl;
    if (const char* a = std::getenv("FSDP_TEST_ABORT_ON_ERROR"); a && std::string(a) == "1") {
      std::abort();
    }
    return 1;
  }
}
