// checkpoint/crc32c.cpp: CRC-32C — SSE4.2 crc32 instructions on three interleaved lanes behind a
// runtime check (baseline flags unchanged), ARMv8 CRC when compiled in, slicing-by-8 elsewhere.
#include "checkpoint/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define FSDP_CRC32C_X86 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define FSDP_CRC32C_ARM 1
#endif

namespace fsdp::detail {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, reflected

// table[k][b]: the CRC of byte b followed by k zero bytes (slicing-by-8).
using Tables = std::array<std::array<uint32_t, 256>, 8>;

const Tables& tables() {
  static const Tables t = [] {
    Tables out{};
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      out[0][b] = c;
    }
    for (int k = 1; k < 8; ++k) {
      for (uint32_t b = 0; b < 256; ++b) out[k][b] = (out[k - 1][b] >> 8) ^ out[0][out[k - 1][b] & 0xFF];
    }
    return out;
  }();
  return t;
}

uint32_t portable(const uint8_t* p, int64_t n, uint32_t c) {
  const Tables& t = tables();
  for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0; --n) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (all this project builds on)
    w ^= c;
    c = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
        t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
  }
  for (; n > 0; --n) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return c;
}

// NOTE [3-way CRC-32C]: crc32 has a latency of 3 cycles but a throughput of 1 a cycle, so the
// hardware path checksums three lanes of kLane bytes at once and joins them: the raw CRC register
// is linear, so reg(A ++ B) = shift(reg(A), |B|) ^ reg_from_zero(B), where shift(c, L) is c run
// through L zero bytes — a 4 x 256 table for the one L we use.
constexpr int64_t kLane = 1024;

const std::array<std::array<uint32_t, 256>, 4>& lane_shift() {
  static const auto t = [] {
    std::array<std::array<uint32_t, 256>, 4> out{};
    const Tables& base = tables();
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t c = b << (8 * k);
        for (int64_t i = 0; i < kLane; ++i) c = (c >> 8) ^ base[0][c & 0xFF];
        out[k][b] = c;
      }
    }
    return out;
  }();
  return t;
}

uint32_t shift_lane(uint32_t c) {
  const auto& t = lane_shift();
  return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
}

#if FSDP_CRC32C_X86
__attribute__((target("sse4.2"))) uint32_t hardware(const uint8_t* p, int64_t n, uint32_t c) {
  for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0; --n) c = _mm_crc32_u8(c, *p++);
  for (; n >= 3 * kLane; n -= 3 * kLane, p += 3 * kLane) {  // NOTE [3-way CRC-32C]
    uint64_t a = c, b = 0, d = 0;
    for (int64_t i = 0; i < kLane; i += 8) {
      uint64_t wa, wb, wd;
      std::memcpy(&wa, p + i, 8);
      std::memcpy(&wb, p + kLane + i, 8);
      std::memcpy(&wd, p + 2 * kLane + i, 8);
      a = _mm_crc32_u64(a, wa);
      b = _mm_crc32_u64(b, wb);
      d = _mm_crc32_u64(d, wd);
    }
    c = shift_lane(shift_lane(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(d);
  }
  uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
  }
  c = static_cast<uint32_t>(c64);
  for (; n > 0; --n) c = _mm_crc32_u8(c, *p++);
  return c;
}
bool has_hardware() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#elif FSDP_CRC32C_ARM
uint32_t hardware(const uint8_t* p, int64_t n, uint32_t c) {
  for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0; --n) c = __crc32cb(c, *p++);
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = __crc32cd(c, w);
  }
  for (; n > 0; --n) c = __crc32cb(c, *p++);
  return c;
}
bool has_hardware() { return true; }
#else
uint32_t hardware(const uint8_t* p, int64_t n, uint32_t c) { return portable(p, n, c); }
bool has_hardware() { return false; }
#endif

}  // namespace

uint32_t crc32c(const void* data, int64_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  return ~(has_hardware() ? hardware(p, n, ~crc) : portable(p, n, ~crc));
}

uint32_t crc32c_portable(const void* data, int64_t n, uint32_t crc) {
  return ~portable(static_cast<const uint8_t*>(data), n, ~crc);
}

bool crc32c_hardware() { return has_hardware(); }

// NOTE [CRC combine]: appending n bytes B to A maps crc(A) to crc(A) * x^(8n) + crc(B) in GF(2)
// polynomials modulo the CRC polynomial (the pre- and post-inversions cancel between the two
// terms). In the reflected representation bit 31 is x^0. x^(8n) comes from squaring: x^(2^k)
// for each set bit of 8n, 64 multiplications at most, a few microseconds whatever n is.
namespace {

// a * b mod P, reflected.
uint32_t multiply(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) product ^= b;
    b = (b >> 1) ^ (kPoly & (0u - (b & 1u)));  // b * x
  }
  return product;
}

// x^(8 n) mod P, reflected.
uint32_t x_to_8n(int64_t n) {
  static const std::array<uint32_t, 64> squares = [] {  // squares[k] = x^(2^k) mod P
    std::array<uint32_t, 64> out{};
    out[0] = 1u << 30;  // x^1
    for (size_t k = 1; k < out.size(); ++k) out[k] = multiply(out[k - 1], out[k - 1]);
    return out;
  }();
  uint32_t p = 1u << 31;  // x^0
  const auto bits = static_cast<uint64_t>(n) << 3;
  for (size_t k = 0; k < 64; ++k) {
    if ((bits >> k) & 1u) p = multiply(squares[k], p);
  }
  return p;
}

}  // namespace

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, int64_t n_b) {
  return multiply(x_to_8n(n_b), crc_a) ^ crc_b;
}

}  // namespace fsdp::detail
