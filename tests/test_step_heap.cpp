// What a training step leaves in malloc's heap: the engine's backward makes no small block that
// outlives it (NOTE [pool records] in src/engine/buffer_pool.cpp, NOTE [gradient shells] in
// src/engine/engine.h). Such blocks land in the memory the backward frees and cut it into pieces
// too small for the optimizer's next large blocks (docs/performance.md, "Construction's heap").
//
// This executable replaces malloc and free (forwarding to glibc's) to see every block a rank's
// thread allocates while its backward runs; a block still allocated when the backward returns
// (and a second later) outlives it. Ranks are threads over Gloo; only the rank threads' own
// allocations are watched.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "fsdp/sharded.h"
#include "models.h"
#include "testing.h"

extern "C" void* __libc_malloc(size_t);
extern "C" void __libc_free(void*);

namespace {

constexpr size_t kSmall = 4096;  // blocks malloc serves from its heap's small bins

thread_local int watching = 0;   // the id of the rank whose backward this thread runs, or 0
thread_local bool inside = false;  // the watcher's own allocations are not watched
std::atomic<int> windows{0};     // backwards being watched, on any thread
std::mutex mu;
std::unordered_map<void*, int>* blocks = nullptr;  // small block -> the rank that made it

void note_malloc(void* p, size_t n) {
  if (!p || n > kSmall || watching == 0 || inside) return;
  inside = true;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!blocks) blocks = new std::unordered_map<void*, int>();
    (*blocks)[p] = watching;
  }
  inside = false;
}

void note_free(void* p) {
  if (!p || inside || windows.load(std::memory_order_relaxed) == 0) return;
  inside = true;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (blocks) blocks->erase(p);
  }
  inside = false;
}

int64_t blocks_of(int rank) {
  std::lock_guard<std::mutex> lock(mu);
  int64_t n = 0;
  if (blocks) {
    for (const auto& [p, r] : *blocks) n += r == rank;
  }
  return n;
}

}  // namespace

extern "C" void* malloc(size_t n) {
  void* p = __libc_malloc(n);
  note_malloc(p, n);
  return p;
}

extern "C" void free(void* p) {
  note_free(p);
  __libc_free(p);
}

namespace {

using namespace fsdp;
using namespace fsdp::testing;

// Steps 1 and 2 make what lasts for good (AdamW's state, the pool's mappings and records); the
// backward of step 3 is watched. Gradients are freed before each step, as fsdp-train does.
int64_t blocks_left_by_a_backward(ShardingStrategy strategy, std::vector<int64_t> mesh,
                                  MixedPrecision precision = {}) {
  std::atomic<int64_t> worst{0};
  int64_t world = 1;
  for (int64_t m : mesh) world *= m;
  run_ranks(world, [&](Runtime& rt) {
    torch::manual_seed(0);
    auto net = std::make_shared<NetImpl>(/*vocab=*/17, /*d=*/32, /*blocks=*/4);
    auto model = shard(net,
                       FSDPStrategy().sharding_strategy(strategy).device_mesh(mesh).mixed_precision(
                           precision),
                       std::shared_ptr<Runtime>(&rt, [](Runtime*) {}));
    torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(1e-3));
    const int id = static_cast<int>(rt.rank()) + 1;
    torch::Generator gen = at::detail::createCPUGenerator(7 + rt.rank());
    for (int step = 0; step < 3; ++step) {
      for (auto& p : model.parameters()) p.mutable_grad().reset();
      auto x = torch::randint(17, {2, 5}, gen);
      auto y = torch::randint(7, {2, 5}, gen);
      auto loss = loss_of(model(x), y);
      if (step == 2) {
        windows.fetch_add(1);
        watching = id;
      }
      loss.backward();
      watching = 0;
      // A collective's work object may still be released by its group's worker thread a
      // moment after the wait returned: blocks that go within a second were transient.
      int64_t left = step == 2 ? blocks_of(id) : 0;
      for (int i = 0; i < 100 && left > 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        left = blocks_of(id);
      }
      if (step == 2) windows.fetch_sub(1);
      int64_t w = worst.load();
      while (left > w && !worst.compare_exchange_weak(w, left)) {
      }
      optimizer.step();
    }
  });
  return worst.load();
}

TEST(StepHeap, BackwardLeavesNoSmallBlocks) {
  // The watcher itself works: a block made and kept inside a window is seen.
  // (Through volatile pointers: the compiler may drop a malloc whose block is never used.)
  void* (*volatile allocate)(size_t) = &malloc;
  void (*volatile release)(void*) = &free;
  windows.fetch_add(1);
  watching = 99;
  void* kept = allocate(48);
  void* freed = allocate(48);
  release(freed);
  watching = 0;
  EXPECT_EQ(blocks_of(99), 1);
  release(kept);
  EXPECT_EQ(blocks_of(99), 0);
  windows.fetch_sub(1);

  EXPECT_EQ(blocks_left_by_a_backward(ShardingStrategy::kFullShard, {2}), 0);
  EXPECT_EQ(blocks_left_by_a_backward(ShardingStrategy::kShardGradOp, {2}), 0);
  EXPECT_EQ(blocks_left_by_a_backward(ShardingStrategy::kHybridShard, {2, 2}), 0);
  // A bf16 reduce: .grad is the fp32 copy of the reduced shard.
  EXPECT_EQ(blocks_left_by_a_backward(ShardingStrategy::kFullShard, {2}, MixedPrecision::bf16()),
            0);
}

}  // namespace
