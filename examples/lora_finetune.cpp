// lora_finetune: fine-tuning with frozen weights (LoRA). A base model is loaded from a full
// checkpoint, low-rank adapters are added inside its blocks, the base is frozen, and only the
// adapters (and the head) train, under HYBRID_SHARD on a (2, 2) mesh: 2 replicas, each sharded
// over 2 ranks. Frozen weights are sharded and gathered like the rest but get no gradient, no
// reduction and no optimizer state. At the end the trainable tensors alone are exported.
//
//   ./lora_finetune --make-base base.pt            one process: "pre-trains" a base model on task A
//   ./lora_finetune --base base.pt --out lora.pt   4 ranks: adapts it to task B, writes the adapters
//
// The .pt files are PyTorch's format: torch.load("lora.pt") in Python gives {name: tensor}.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <iostream>
#include <string>

namespace F = torch::nn::functional;

// A Linear with an optional LoRA adapter: y = base(x) + B·A·x, A: [rank, in], B: [out, rank].
// With rank 0 it is the plain base layer; the base's parameter names are the same either way.
struct LoRALinearImpl : torch::nn::Module {
  LoRALinearImpl(int64_t in, int64_t out, int64_t rank)
      : base(register_module("base", torch::nn::Linear(in, out))) {
    if (rank > 0) {
      lora_a = register_parameter("lora_a", torch::randn({rank, in}) * 0.01);
      lora_b = register_parameter("lora_b", torch::zeros({out, rank}));  // starts as the base
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = base(x);
    return lora_a.defined() ? y + F::linear(F::linear(x, lora_a), lora_b) : y;
  }
  torch::nn::Linear base;
  torch::Tensor lora_a, lora_b;
};
TORCH_MODULE(LoRALinear);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t d, int64_t rank)
      : fc1(register_module("fc1", LoRALinear(d, 4 * d, rank))),
        fc2(register_module("fc2", LoRALinear(4 * d, d, rank))) {}
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(x))); }
  LoRALinear fc1, fc2;
};

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t d, int64_t depth, int64_t rank) {
    for (int64_t i = 0; i < depth; ++i) {
      // Each block is one FSDP unit holding frozen base weights and trainable adapters.
      blocks.push_back(register_module("block" + std::to_string(i), fsdp::Unit<BlockImpl>(d, rank)));
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

constexpr int64_t kDim = 32, kDepth = 4, kRank = 4;

// Task A: y = x . w; task B: the same with w changed by a low-rank term, which adapters can learn.
torch::Tensor target_weights(bool task_b) {
  auto w = torch::randn({kDim, 1}, at::detail::createCPUGenerator(42));
  if (task_b) w = w + 0.5 * torch::randn({kDim, 1}, at::detail::createCPUGenerator(43));
  return w;
}

int make_base(const std::string& file) {
  torch::manual_seed(1);
  auto net = std::make_shared<NetImpl>(kDim, kDepth, /*rank=*/0);
  torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(3e-3));
  const auto w = target_weights(false);
  for (int64_t step = 0; step < 100; ++step) {
    auto x = torch::randn({32, kDim}, at::detail::createCPUGenerator(1000 + step));
    auto loss = torch::mse_loss(net->forward(x), x.matmul(w));
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
  }
  fsdp::save_full_checkpoint(*net, file);
  std::cout << "base model written to " << file << "\n";
  return 0;
}

int finetune(int argc, char** argv, const std::string& base_file, const std::string& out) {
  fsdp::LaunchOptions launch;
  launch.nproc_per_node = 4;
  launch.name = "lora_finetune";
  if (auto exit_code = fsdp::launch_self(argc, argv, launch)) return *exit_code;

  // 1. The pre-trained base, then the same model with adapters, given the base's weights by name.
  auto base = std::make_shared<NetImpl>(kDim, kDepth, /*rank=*/0);
  fsdp::load_full_checkpoint(*base, base_file);
  torch::manual_seed(2);  // the adapters' initial values: the same on every rank
  auto net = std::make_shared<NetImpl>(kDim, kDepth, kRank);
  {
    torch::NoGradGuard no_grad;
    auto params = net->named_parameters();
    for (const auto& p : base->named_parameters()) params[p.key()].copy_(p.value());
  }
  // 2. Freeze everything but the adapters and the head, before sharding: fsdp reads
  //    requires_grad once, at shard().
  for (auto& p : net->named_parameters()) {
    const bool train = p.key().find("lora_") != std::string::npos || p.key().rfind("head.", 0) == 0;
    p.value().requires_grad_(train);
  }
  auto model = fsdp::shard(net, fsdp::FSDPStrategy().sharding_strategy("HYBRID_SHARD").device_mesh({2, 2}));
  // parameters() holds this rank's shards of the trainable tensors only.
  torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(1e-2));
  model.check_optimizer(optimizer);
  const int64_t rank = model.runtime()->rank(), world = model.runtime()->world_size();
  if (rank == 0) {
    std::cout << "trainable " << model.trainable_numel() << " of " << model.total_numel()
              << " parameters\n";
  }

  // 3. Fine-tune on task B; every rank draws its part of the global batch.
  const auto w = target_weights(true);
  double first = 0, last = 0;
  for (int64_t step = 0; step < 80; ++step) {
    auto x = torch::randn({16, kDim}, at::detail::createCPUGenerator(step * world + rank));
    auto loss = torch::mse_loss(model(x), x.matmul(w));
    optimizer.zero_grad();
    loss.backward();
    model.clip_grad_norm(1.0);
    optimizer.step();
    last = loss.item<double>();
    if (step == 0) first = last;
    if (rank == 0 && step % 20 == 0) std::cout << "step " << step << " loss " << last << "\n";
  }
  // 4. The adapters (and head) alone, unsharded, for merging into the base later.
  fsdp::ExportOptions adapters;
  adapters.trainable_only = true;
  fsdp::export_full_checkpoint(model, out, adapters);
  if (rank == 0) {
    auto mem = model.memory_stats(&optimizer);
    std::cout << "rank 0: optimizer state " << fsdp::format_bytes(mem.optimizer_state_bytes)
              << ", gradient shards " << fsdp::format_bytes(mem.grad_shard_bytes)
              << "; loss " << first << " -> " << last << "; adapters written to " << out << "\n";
  }
  return last < first ? 0 : 1;
}

int main(int argc, char** argv) {
  try {
    const std::string usage =
        "usage: lora_finetune --make-base FILE | lora_finetune --base FILE --out FILE";
    if (argc == 3 && std::string(argv[1]) == "--make-base") return make_base(argv[2]);
    if (argc == 5 && std::string(argv[1]) == "--base" && std::string(argv[3]) == "--out") {
      return finetune(argc, argv, argv[2], argv[4]);
    }
    std::cerr << "lora_finetune: error: " << usage << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "lora_finetune: error: " << fsdp::error_message(e) << "\n";
    return 1;
  }
}
