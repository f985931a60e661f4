// bench_crc32c (a benchmark, not a test; it lives here because it reaches the internal CRC-32C
// header, which bench/ may not): CRC-32C throughput (hardware path and slicing-by-8) against
// zlib's CRC-32 on a 256 MiB buffer; prints GB/s. Usage: build/tests/bench_crc32c [MiB]
#include <zlib.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "checkpoint/crc32c.h"

namespace {

template <class F>
double gbps(const std::vector<unsigned char>& buf, F f) {
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    volatile uint32_t sink = f(buf.data(), static_cast<int64_t>(buf.size()));
    (void)sink;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(buf.size()) / s / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t mib = argc > 1 ? std::atoll(argv[1]) : 256;
  std::vector<unsigned char> buf(static_cast<size_t>(mib) << 20);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 2654435761u >> 24);
  std::printf("buffer %lld MiB, hardware CRC-32C: %s\n", static_cast<long long>(mib),
              fsdp::detail::crc32c_hardware() ? "yes" : "no");
  std::printf("crc32c (dispatch)   %6.2f GB/s\n",
              gbps(buf, [](const void* p, int64_t n) { return fsdp::detail::crc32c(p, n); }));
  std::printf("crc32c (portable)   %6.2f GB/s\n",
              gbps(buf, [](const void* p, int64_t n) { return fsdp::detail::crc32c_portable(p, n); }));
  std::printf("zlib crc32          %6.2f GB/s\n", gbps(buf, [](const void* p, int64_t n) {
                uLong c = 0;
                for (int64_t off = 0; off < n; off += 1 << 30) {
                  const auto len = static_cast<uInt>(std::min<int64_t>(n - off, 1 << 30));
                  c = crc32(c, static_cast<const Bytef*>(p) + off, len);
                }
                return static_cast<uint32_t>(c);
              }));
  return 0;
}
