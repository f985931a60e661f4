// checkpoint/crc32c.h (internal): CRC-32C (Castagnoli), the checksum of checkpoint chunks —
// hardware instructions where the CPU has them (SSE4.2, ARMv8 CRC), slicing-by-8 elsewhere.
#pragma once

#include <cstdint>

namespace fsdp::detail {

// CRC-32C of n bytes, continuing from `crc` (the result of the previous call; 0 to start), so
// crc32c(b, nb, crc32c(a, na)) == crc32c(a ++ b). Uses the fastest implementation this CPU runs.
uint32_t crc32c(const void* data, int64_t n, uint32_t crc = 0);

// The CRC-32C of A ++ B from crc32c(A), crc32c(B) and B's length n_b >= 0, without the bytes
// (NOTE [CRC combine] in crc32c.cpp): a file's checksum from its chunks' checksums.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, int64_t n_b);

// The same checksum from the portable slicing-by-8 implementation (tests compare the two).
uint32_t crc32c_portable(const void* data, int64_t n, uint32_t crc = 0);

// Whether crc32c() uses hardware instructions on this CPU (benchmarks print it).
bool crc32c_hardware();

}  // namespace fsdp::detail
