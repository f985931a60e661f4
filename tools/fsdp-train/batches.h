// fsdp-train's batches: the training sampler (NOTE [batch sampling]) and llm.c's validation loss
// (NOTE [validation loss]), both over a memory-mapped TokenStream (token_data.h).
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/error.h"
#include "fsdp/runtime.h"
#include "gpt.h"
#include "token_data.h"

namespace fsdp_train {

// NOTE [batch sampling]
// Every rank draws the whole global batch of every step from one RNG seeded by --seed alone and
// keeps its contiguous slice: rank r takes sequences [r*B, (r+1)*B) of the G drawn (B = G/W), and
// micro-step k of --grad-accum K takes [k*B/K, (k+1)*B/K) of those. The global batch, hence the
// mean loss and the gradient, is the same for every world size, mesh and strategy. mt19937_64's
// output is fixed by the C++ standard (unlike std::uniform_int_distribution), so it is the same
// on every machine too. The RNG's state is the data position a checkpoint records.
// --data-order sequential is llm.c's training loader instead: step s reads window s (wrapping
// around) of B*T + 1 consecutive tokens, sequence b starting at its token b*T; the position
// recorded is the number of windows read.
class BatchSampler {
 public:
  BatchSampler(int64_t seed, int64_t data_tokens, int64_t seq_len, int64_t global_batch,
               bool sequential)
      : rng_(static_cast<uint64_t>(seed) ^ 0x9e3779b97f4a7c15ULL),
        starts_(data_tokens - seq_len),
        windows_(std::max<int64_t>(1, (data_tokens - 1) / (global_batch * seq_len))),
        seq_len_(seq_len),
        global_batch_(global_batch),
        sequential_(sequential) {}
  // Start offsets of the next step's global batch: each sequence is data[o, o + seq_len] inclusive
  // (inputs and their shifted targets).
  std::vector<int64_t> next() {
    std::vector<int64_t> offsets(global_batch_);
    if (sequential_) {
      const int64_t window = (read_++ % windows_) * global_batch_ * seq_len_;
      for (int64_t b = 0; b < global_batch_; ++b) offsets[b] = window + b * seq_len_;
      return offsets;
    }
    for (auto& o : offsets) o = static_cast<int64_t>(rng_() % static_cast<uint64_t>(starts_));
    return offsets;
  }
  // The data position, as text for a checkpoint (mt19937_64's state, whose form the standard
  // fixes; or "sequential N").
  std::string state() const {
    std::ostringstream os;
    if (sequential_) {
      os << "sequential " << read_;
    } else {
      os << rng_;
    }
    return os.str();
  }
  void restore(const std::string& text) {
    const bool sequential = text.rfind("sequential ", 0) == 0;
    FSDP_CHECK(sequential == sequential_, "--resume: the checkpoint was written with --data-order ",
               sequential ? "sequential" : "random", "; resume with the same --data-order");
    std::istringstream is(sequential ? text.substr(11) : text);
    if (sequential) {
      is >> read_;
    } else {
      is >> rng_;
    }
    FSDP_CHECK(!is.fail(),
               "the checkpoint's data position is unreadable; it was not written by "
               "fsdp-train");
  }

 private:
  std::mt19937_64 rng_;
  int64_t starts_;
  int64_t windows_;
  int64_t seq_len_;
  int64_t global_batch_;
  bool sequential_;
  int64_t read_ = 0;  // windows read (sequential)
};

// tokens [count, seq_len + 1] (int64) of the sequences starting at offsets[begin, begin + count).
inline torch::Tensor batch_tokens(const TokenStream& data, const std::vector<int64_t>& offsets,
                                  int64_t begin, int64_t count, int64_t seq_len) {
  auto out = torch::empty({count, seq_len + 1}, torch::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    data.read(offsets[begin + i], seq_len + 1, p + i * (seq_len + 1));
  return out;
}

// NOTE [validation loss]
// llm.c's convention (train_gpt2.c, dataloader_reset on the val loader): window i of K covers
// tokens [i*B*T, i*B*T + B*T] of the validation stream, unshuffled, B the global batch and T
// --seq-len; its B sequences are the consecutive T + 1 token runs starting at i*B*T + b*T. The
// validation loss is the mean over all K*B*T predicted tokens (every window has the same count,
// so it equals llm.c's mean of window means). Rank r evaluates its contiguous slice of each
// window's B sequences, micro_batch at a time; one all_reduce sums the per-token losses. So the
// number is the same for any world size, mesh or strategy, and for llm.c on the same file.
template <class Model>
double validation_loss(Model& model, LanguageModel& net, const TokenStream& val, int64_t windows,
                       int64_t global_batch, int64_t seq_len, int64_t per_rank_batch,
                       int64_t micro_batch, fsdp::Runtime& rt) {
  torch::NoGradGuard no_grad;
  net.eval();
  const c10::Device device = rt.device();
  double sum = 0;
  for (int64_t w = 0; w < windows; ++w) {
    std::vector<int64_t> offsets(global_batch);
    for (int64_t b = 0; b < global_batch; ++b) offsets[b] = (w * global_batch + b) * seq_len;
    for (int64_t m = 0; m < per_rank_batch; m += micro_batch) {
      auto tokens = batch_tokens(val, offsets, rt.rank() * per_rank_batch + m, micro_batch, seq_len)
                        .to(device);
      auto logits = model(tokens.narrow(1, 0, seq_len));
      sum += torch::nn::functional::cross_entropy(
                 logits.to(torch::kFloat).reshape({-1, logits.size(-1)}),
                 tokens.narrow(1, 1, seq_len).reshape({-1}),
                 torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                 .template item<double>();
    }
  }
  net.train();
  auto total = torch::tensor({sum}, torch::TensorOptions(torch::kDouble).device(device));
  if (rt.world_size() > 1) rt.world()->all_reduce(total)->wait();
  return total.cpu().item<double>() / double(windows * global_batch * seq_len);
}

}  // namespace fsdp_train
