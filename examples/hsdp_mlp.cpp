// hsdp_mlp: the smallest complete fsdp program. A residual MLP trained with HYBRID_SHARD on a
// (2, 2) mesh: 2 replicas, each sharded over 2 ranks. It launches its own 4 processes
// (or joins the ones torchrun / srun / mpirun / fsdp-run started).
//   ./hsdp_mlp
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <iostream>

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t d, int64_t depth) {
    for (int64_t i = 0; i < depth; ++i) {
      // fsdp::Unit<BlockImpl> instead of a plain holder: each block becomes one FSDP unit.
      blocks.push_back(register_module("block" + std::to_string(i), fsdp::Unit<BlockImpl>(d)));
    }
    head = register_module("head", torch::nn::Linear(d, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& block : blocks) x = block(x);
    return head(x);
  }
  std::vector<fsdp::Unit<BlockImpl>> blocks;
  torch::nn::Linear head{nullptr};
};

int main(int argc, char** argv) {
  try {
    fsdp::LaunchOptions launch;
    launch.nproc_per_node = 4;
    launch.name = "hsdp_mlp";
    if (auto exit_code = fsdp::launch_self(argc, argv, launch)) return *exit_code;

    const int64_t d = 32;
    auto model = fsdp::shard(std::make_shared<NetImpl>(d, 4),
                             fsdp::FSDPStrategy().sharding_strategy("HYBRID_SHARD").device_mesh({2, 2}));
    torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(3e-3));
    const int64_t rank = model.runtime()->rank(), world = model.runtime()->world_size();

    // Learn y = x . w for a fixed w; every rank draws its own batch of the global batch.
    const auto w = torch::randn({d, 1}, at::detail::createCPUGenerator(42));
    double first = 0, last = 0;
    for (int64_t step = 0; step < 60; ++step) {
      auto x = torch::randn({16, d}, at::detail::createCPUGenerator(step * world + rank));
      auto loss = torch::mse_loss(model(x), x.matmul(w));
      optimizer.zero_grad();
      loss.backward();
      model.clip_grad_norm(1.0);
      optimizer.step();
      last = loss.item<double>();
      if (step == 0) first = last;
      if (rank == 0 && step % 20 == 0) std::cout << "step " << step << " loss " << last << "\n";
    }
    if (rank == 0) {
      auto mem = model.memory_stats(&optimizer);
      std::cout << "rank 0 holds " << fsdp::format_bytes(mem.sharded_state_bytes())
                << " of sharded state; loss " << first << " -> " << last << "\n";
    }
    return last < first ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "hsdp_mlp: error: " << fsdp::error_message(e) << "\n";
    return 1;
  }
}
