// The engine's pool of large CPU buffers (NOTE [buffer pool] in buffer_pool.h).
#include "engine/buffer_pool.h"

#include <sys/mman.h>

#include <ATen/ATen.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

#include "fsdp/error.h"

namespace fsdp::detail {

namespace {
constexpr size_t kPage = 4096;
size_t round_up(size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }
constexpr size_t kRecordPage = 64 * 1024;  // records are mapped this many bytes at a time
}  // namespace

// NOTE [pool records]: the pool's bookkeeping (one record per mapping: its address, size and
// the pool to return it to) lives in pages the pool maps for it, never in malloc's heap. A record
// made with `new` during a step's backward (each reduced gradient is a new lease, and the free
// list grew a node for each buffer given back) landed in the middle of the memory the backward
// had just freed, every 2-4 MiB of it: the freed activations and parameter gradients could then
// only be reused in pieces smaller than AdamW's state, which the first optimizer step put on the
// heap's top instead (W = 8, 16 blocks of d 768, --heap unchanged: the heap's free memory at the
// end of the backward was 53-78 MiB in pieces of about 3 MiB, each state block 3.5 MiB).
struct BufferPool::State {
  struct Record {
    void* ptr = nullptr;
    size_t size = 0;
    bool seen_by_trim = false;  // free when the last trim() ran: unmapped by the next if still free
    Record* next = nullptr;     // in `free` or `spare`
    std::shared_ptr<State> lease;  // while leased: keeps the pool's state alive for give_back
  };
  std::mutex mu;
  Record* free = nullptr;   // mapped blocks kept for reuse (a step uses a few dozen)
  Record* spare = nullptr;  // records without a block
  std::vector<void*> record_pages;  // each kRecordPage bytes of records
  int64_t mapped = 0, cached = 0, peak = 0;

  ~State();
  Record* take_record();  // under mu
};

namespace {

void* map_bytes(size_t size, const char* what) {
  void* ptr = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ptr == MAP_FAILED) {
    throw Error(cat("cannot map ", size, " bytes for ", what, " (", std::strerror(errno),
                    "): the rank is out of memory"));
  }
  return ptr;
}

void give_back(void* ctx) {
  auto* record = static_cast<BufferPool::State::Record*>(ctx);
  // Moved out first: the state must outlive the lock (this may be its last owner).
  std::shared_ptr<BufferPool::State> state = std::move(record->lease);
  std::lock_guard<std::mutex> lock(state->mu);
  record->seen_by_trim = false;
  record->next = state->free;
  state->free = record;
  state->cached += static_cast<int64_t>(record->size);
}

}  // namespace

BufferPool::State::~State() {
  for (Record* r = free; r; r = r->next) ::munmap(r->ptr, r->size);
  for (void* page : record_pages) {
    auto* records = static_cast<Record*>(page);
    for (size_t i = 0; i < kRecordPage / sizeof(Record); ++i) records[i].~Record();
    ::munmap(page, kRecordPage);
  }
}

BufferPool::State::Record* BufferPool::State::take_record() {
  if (!spare) {
    void* page = map_bytes(kRecordPage, "the engine's buffer records");
    record_pages.push_back(page);
    auto* records = static_cast<Record*>(page);
    for (size_t i = 0; i < kRecordPage / sizeof(Record); ++i) {
      new (&records[i]) Record();
      records[i].next = spare;
      spare = &records[i];
    }
  }
  Record* r = spare;
  spare = r->next;
  r->next = nullptr;
  return r;
}

bool BufferPool::pooled(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data_ptr().get_deleter() == &give_back;
}

BufferPool::BufferPool() : state_(std::make_shared<State>()) {}

at::DataPtr BufferPool::allocate(size_t bytes) {
  const size_t size = round_up(std::max<size_t>(bytes, 1));
  State& st = *state_;
  std::unique_lock<std::mutex> lock(st.mu);
  State::Record* record = nullptr;
  for (State::Record** link = &st.free; *link; link = &(*link)->next) {
    if ((*link)->size != size) continue;
    record = *link;
    *link = record->next;
    st.cached -= static_cast<int64_t>(size);
    break;
  }
  if (!record) {
    lock.unlock();
    void* ptr = map_bytes(size, "an engine buffer");
    lock.lock();
    try {
      record = st.take_record();
    } catch (...) {
      ::munmap(ptr, size);
      throw;
    }
    record->ptr = ptr;
    record->size = size;
    st.mapped += static_cast<int64_t>(size);
    st.peak = std::max(st.peak, st.mapped);
  }
  record->next = nullptr;
  record->lease = state_;
  return at::DataPtr(record->ptr, record, &give_back, at::Device(at::kCPU));
}

at::Tensor BufferPool::shell(c10::ScalarType dtype) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, at::DataPtr(nullptr, at::kCPU),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {0}, {1});
}

void BufferPool::fill(at::Tensor& shell, int64_t numel) {
  auto* storage = shell.storage().unsafeGetStorageImpl();
  TORCH_INTERNAL_ASSERT(storage->nbytes() == 0 && shell.numel() == 0, "fill: not an empty shell");
  const size_t bytes = static_cast<size_t>(numel) * shell.element_size();
  storage->set_data_ptr_noswap(allocate(bytes));
  storage->set_nbytes(bytes);
  shell.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
}

at::Tensor BufferPool::empty(int64_t numel, c10::ScalarType dtype) {
  at::Tensor t = shell(dtype);
  fill(t, numel);
  return t;
}

void BufferPool::trim() {
  std::vector<std::pair<void*, size_t>> unmap;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (State::Record** link = &state_->free; *link;) {
      State::Record* r = *link;
      // Blocks given back during this step were in use in it: they stay for the next one.
      if (!r->seen_by_trim) {
        r->seen_by_trim = true;
        link = &r->next;
        continue;
      }
      *link = r->next;
      unmap.emplace_back(r->ptr, r->size);
      state_->cached -= static_cast<int64_t>(r->size);
      state_->mapped -= static_cast<int64_t>(r->size);
      r->ptr = nullptr;
      r->size = 0;
      r->next = state_->spare;
      state_->spare = r;
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
