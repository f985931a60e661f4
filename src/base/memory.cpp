// A process's memory from /proc and glibc (fsdp/memory.h).
#include "fsdp/memory.h"

#include <malloc.h>

#include <atomic>
#include <fstream>
#include <string>

#include "base/sanitizer.h"

namespace fsdp {

namespace {
std::atomic<int64_t> g_checkpoint_staging{0};
}  // namespace

void detail::add_checkpoint_staging_bytes(int64_t delta) { g_checkpoint_staging += delta; }

void detail::release_free_heap() {
  if constexpr (!detail::kSanitizerAllocator) ::malloc_trim(0);
}

ProcessMemory process_memory() {
  ProcessMemory m;
  m.checkpoint_staging = g_checkpoint_staging.load();
  std::ifstream in("/proc/self/status");
  std::string line;
  auto field = [&](const char* key, int64_t* out) {
    const std::string k = std::string(key) + ":";
    if (line.compare(0, k.size(), k) == 0) *out = std::stoll(line.substr(k.size())) * 1024;
  };
  while (std::getline(in, line)) {
    field("RssAnon", &m.rss_anon);
    field("RssFile", &m.rss_file);
    field("VmHWM", &m.peak_rss);
  }
// Under a sanitizer's allocator mallinfo2 reports nothing and crashed once in int_mallinfo.
#if defined(__GLIBC__) && !defined(FSDP_SANITIZER_ALLOCATOR)
  const struct mallinfo2 mi = ::mallinfo2();
  m.heap_in_use = static_cast<int64_t>(mi.uordblks + mi.hblkhd);
  m.heap_free = static_cast<int64_t>(mi.fordblks);
#endif
  return m;
}

bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

}  // namespace fsdp
