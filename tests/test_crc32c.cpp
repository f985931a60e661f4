// test_crc32c: CRC-32C (src/checkpoint/crc32c.h) against published vectors and a bitwise
// reference, hardware and portable paths alike, at unaligned starts and every small length.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "checkpoint/crc32c.h"

using fsdp::detail::crc32c;
using fsdp::detail::crc32c_combine;
using fsdp::detail::crc32c_portable;

namespace {

uint32_t bitwise(const uint8_t* p, int64_t n, uint32_t crc = 0) {
  uint32_t c = ~crc;
  for (int64_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}

}  // namespace

TEST(Crc32c, KnownVectors) {
  const char* digits = "123456789";
  EXPECT_EQ(crc32c(digits, 9), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(digits, 9), 0xE3069283u);
  const std::vector<uint8_t> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c_portable(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, HardwarePortableAndBitwiseAgree) {
  std::mt19937 rng(7);
  std::vector<uint8_t> buf(4099 + 16);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (int64_t len = 0; len <= 4099; ++len) {
    const int64_t start = len % 11;  // unaligned starts
    const uint8_t* p = buf.data() + start;
    const uint32_t want = bitwise(p, len);
    ASSERT_EQ(crc32c(p, len), want) << "len " << len << " start " << start;
    ASSERT_EQ(crc32c_portable(p, len), want) << "len " << len << " start " << start;
  }
}

TEST(Crc32c, ContinuesAcrossCalls) {
  std::vector<uint8_t> buf(1000);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 31 + 7);
  const uint32_t whole = crc32c(buf.data(), 1000);
  for (int64_t cut : {0, 1, 7, 8, 333, 999, 1000}) {
    EXPECT_EQ(crc32c(buf.data() + cut, 1000 - cut, crc32c(buf.data(), cut)), whole) << cut;
    EXPECT_EQ(crc32c_portable(buf.data() + cut, 1000 - cut, crc32c_portable(buf.data(), cut)), whole);
  }
}

// A file's checksum from its chunks' (save.cpp): every cut of random data into pieces, empty
// ones included, combines to the checksum of the whole; so does a long run of zeros, whose
// length exercises the high powers of x.
TEST(Crc32c, CombineEqualsTheWhole) {
  std::mt19937 rng(5);
  std::vector<uint8_t> buf((1 << 20) + 77);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  const auto n = static_cast<int64_t>(buf.size());
  const uint32_t whole = crc32c(buf.data(), n);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> cuts{0, n};
    for (int k = 0; k < trial % 6; ++k) cuts.push_back(static_cast<int64_t>(rng() % (n + 1)));
    if (trial % 7 == 0) cuts.push_back(cuts.back());  // an empty piece
    std::sort(cuts.begin(), cuts.end());
    uint32_t combined = 0;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      const int64_t len = cuts[i + 1] - cuts[i];
      combined = crc32c_combine(combined, crc32c(buf.data() + cuts[i], len), len);
    }
    EXPECT_EQ(combined, whole) << "trial " << trial;
  }
  EXPECT_EQ(crc32c_combine(whole, 0, 0), whole);
  const std::vector<uint8_t> zeros(3 << 20, 0);
  const uint32_t z = crc32c(zeros.data(), 1 << 20);
  EXPECT_EQ(crc32c_combine(crc32c_combine(z, z, 1 << 20), z, 1 << 20), crc32c(zeros.data(), 3 << 20));
}

TEST(Crc32c, LargeBuffersAgree) {
  std::mt19937 rng(11);
  std::vector<uint8_t> buf((1 << 20) + 4099);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (int64_t len : {int64_t{3 * 1024}, int64_t{3 * 1024 + 5}, int64_t{1 << 20}, int64_t{(1 << 20) + 4093}}) {
    const uint8_t* p = buf.data() + 3;
    EXPECT_EQ(crc32c(p, len), bitwise(p, len)) << len;
  }
}
