// The CPU allocator of deferred construction (NOTE [deferred heap] in deferred_heap.h).
#include "engine/deferred_heap.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>

#include "base/compat.h"
#include "base/sanitizer.h"

namespace fsdp::detail {
namespace {

constexpr size_t kMappedFrom = size_t{1} << 20;

class MappingAllocator final : public c10::Allocator {
 public:
  explicit MappingAllocator(c10::Allocator* previous) : previous_(previous) {}

  c10::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override {
    if (active_.load(std::memory_order_relaxed) == 0 || n < kMappedFrom) {
      return previous_->allocate(n);
    }
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    {
      std::lock_guard<std::mutex> lock(mu());
      sizes().emplace(p, n);
    }
    return c10::DataPtr(p, p, &release, c10::Device(c10::kCPU));
  }

  // Frees a block of either kind, so that raw_allocate/raw_deallocate stay valid.
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  FSDP_ALLOCATOR_COPY_DATA

  void activate() { active_.fetch_add(1); }
  void deactivate() { active_.fetch_sub(1); }

  static MappingAllocator* installed;

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::unordered_map<void*, size_t>& sizes() {
    static auto* s = new std::unordered_map<void*, size_t>();  // outlives every tensor
    return *s;
  }
  static void release(void* p) {
    size_t n = 0;
    {
      std::lock_guard<std::mutex> lock(mu());
      auto it = sizes().find(p);
      if (it != sizes().end()) {
        n = it->second;
        sizes().erase(it);
      }
    }
    if (n > 0) {
      ::munmap(p, n);
    } else if (p) {
      installed->previous_->raw_deleter()(p);
    }
  }

  c10::Allocator* previous_;
  std::atomic<int> active_{0};
};

MappingAllocator* MappingAllocator::installed = nullptr;
std::mutex g_install;

}  // namespace

DeferredHeapScope::DeferredHeapScope() {
  // A sanitizer's allocator tracks every block itself; ours would hide them from it.
  if (kSanitizerAllocator) return;
  std::lock_guard<std::mutex> lock(g_install);
  if (!MappingAllocator::installed) {
    c10::Allocator* previous = c10::GetCPUAllocator();
    // Without a raw deleter the previous allocator's small blocks could not be freed raw.
    if (!previous->raw_deleter()) return;
    MappingAllocator::installed = new MappingAllocator(previous);  // never freed: blocks outlive
    c10::SetCPUAllocator(MappingAllocator::installed, /*priority=*/255);
  }
  MappingAllocator::installed->activate();
}

DeferredHeapScope::~DeferredHeapScope() {
  if (kSanitizerAllocator) return;
  std::lock_guard<std::mutex> lock(g_install);
  if (MappingAllocator::installed) MappingAllocator::installed->deactivate();
}

}  // namespace fsdp::detail
