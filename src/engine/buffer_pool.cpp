// The engine's pool of large CPU buffers (NOTE [buffer pool] in buffer_pool.h).
#include "engine/buffer_pool.h"

#include <sys/mman.h>

#include <ATen/ATen.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "fsdp/error.h"

namespace fsdp::detail {

namespace {
constexpr size_t kPage = 4096;
size_t round_up(size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }
}  // namespace

struct BufferPool::State {
  struct Block {
    void* ptr;
    bool seen_by_trim;  // free when the last trim() ran: unmapped by the next if still free
  };
  std::mutex mu;
  std::multimap<size_t, Block> free;  // by mapped size
  int64_t mapped = 0, cached = 0, peak = 0;
};

namespace {

// What a pooled DataPtr's context holds: its block and the pool to return it to.
struct Lease {
  std::shared_ptr<BufferPool::State> state;
  void* ptr;
  size_t bytes;
};

void give_back(void* ctx) {
  auto* lease = static_cast<Lease*>(ctx);
  {
    std::lock_guard<std::mutex> lock(lease->state->mu);
    lease->state->free.emplace(lease->bytes, BufferPool::State::Block{lease->ptr, false});
    lease->state->cached += static_cast<int64_t>(lease->bytes);
  }
  delete lease;
}

}  // namespace

bool BufferPool::pooled(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data_ptr().get_deleter() == &give_back;
}

BufferPool::BufferPool() : state_(std::make_shared<State>()) {}

at::DataPtr BufferPool::allocate(size_t bytes) {
  const size_t size = round_up(std::max<size_t>(bytes, 1));
  void* ptr = nullptr;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->free.find(size);
    if (it != state_->free.end()) {
      ptr = it->second.ptr;
      state_->free.erase(it);
      state_->cached -= static_cast<int64_t>(size);
    }
  }
  if (!ptr) {
    ptr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      throw Error(cat("cannot map ", size, " bytes for an engine buffer (", std::strerror(errno),
                      "): the rank is out of memory"));
    }
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->mapped += static_cast<int64_t>(size);
    state_->peak = std::max(state_->peak, state_->mapped);
  }
  auto* lease = new Lease{state_, ptr, size};
  return at::DataPtr(ptr, lease, &give_back, at::Device(at::kCPU));
}

at::Tensor BufferPool::empty(int64_t numel, c10::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  at::DataPtr data = allocate(bytes);
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {numel}, {1});
}

void BufferPool::trim() {
  std::vector<std::pair<void*, size_t>> unmap;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (auto it = state_->free.begin(); it != state_->free.end();) {
      // Blocks given back during this step were in use in it: they stay for the next one.
      if (!it->second.seen_by_trim) {
        it->second.seen_by_trim = true;
        ++it;
        continue;
      }
      unmap.emplace_back(it->second.ptr, it->first);
      state_->cached -= static_cast<int64_t>(it->first);
      state_->mapped -= static_cast<int64_t>(it->first);
      it = state_->free.erase(it);
    }
  }
  for (const auto& [ptr, size] : unmap) ::munmap(ptr, size);
}

BufferPool::Stats BufferPool::stats() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return {state_->mapped, state_->cached, state_->peak};
}

void BufferPool::reset_peak() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->peak = state_->mapped;
}

}  // namespace fsdp::detail
