// fsdp_desync_worker: one rank of a job whose ranks disagree on the order of a model's units
// (NOTE [collective check]): three equal-sized units, run in order on every rank except rank 1,
// which runs them reversed, as a data-dependent branch would. Started by test_debug_collectives
// under fsdp-run.
//   fsdp_desync_worker on    FSDPStrategy::debug_collectives: prints the error and exits 1
//   fsdp_desync_worker off   trains one step and prints how far the sharded forward's output is
//                            from the same model's unsharded one: nothing else notices
#include <torch/torch.h>

#include <cstdio>
#include <cstring>

#include "fsdp/fsdp.h"
#include "models.h"

namespace {

constexpr int64_t kWidth = 16;

struct BranchyImpl : torch::nn::Module {
  explicit BranchyImpl(bool reversed) : reversed(reversed) {
    for (int i = 0; i < 3; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i),
                                       fsdp::Unit<fsdp::testing::BlockImpl>(kWidth)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    if (reversed) {
      for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) x = (*it)(x);
    } else {
      for (auto& b : blocks) x = b(x);
    }
    return x;
  }
  bool reversed;
  std::vector<fsdp::Unit<fsdp::testing::BlockImpl>> blocks;
};

}  // namespace

int main(int argc, char** argv) {
  const bool debug = argc > 1 && std::strcmp(argv[1], "on") == 0;
  const int rank = std::atoi(std::getenv("RANK") ? std::getenv("RANK") : "0");
  torch::set_num_threads(1);
  try {
    torch::manual_seed(0);
    auto reference = std::make_shared<BranchyImpl>(rank == 1);
    torch::manual_seed(0);  // the same values: every rank builds the same model
    auto model = fsdp::shard(std::make_shared<BranchyImpl>(rank == 1),
                             fsdp::FSDPStrategy()
                                 .timeout(std::chrono::seconds(20))
                                 .debug_collectives(debug));
    torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.1));
    torch::manual_seed(1);
    const auto x = torch::randn({4, kWidth});
    const auto out = model(x);
    const double diff = (out - reference->forward(x)).abs().max().item<double>();
    out.pow(2).mean().backward();
    opt.step();
    std::printf("rank %d: max |sharded - unsharded| = %g\n", rank, diff);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_desync_worker[%d]: error: %s\n", rank, e.what());
    return 1;
  }
}
