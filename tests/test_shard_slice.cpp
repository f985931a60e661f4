// test_shard_slice: the parameter-in-shard overlap (src/base/shard_slice.h) at its edges.
#include <gtest/gtest.h>

#include "base/shard_slice.h"

using fsdp::detail::shard_slice;

// Shard [10, 20) throughout.
TEST(ShardSlice, ParamEntirelyBeforeShard) {
  EXPECT_TRUE(shard_slice(10, 10, 0, 5).empty());
  EXPECT_TRUE(shard_slice(10, 10, 0, 10).empty());  // ends exactly where the shard begins
  EXPECT_EQ(shard_slice(10, 10, 0, 10).numel(), 0);
}

TEST(ShardSlice, ParamEntirelyAfterShard) {
  EXPECT_TRUE(shard_slice(10, 10, 20, 3).empty());  // starts exactly where the shard ends
  EXPECT_TRUE(shard_slice(10, 10, 25, 3).empty());
}

TEST(ShardSlice, ParamInsideShard) {
  const auto s = shard_slice(10, 10, 12, 5);
  ASSERT_FALSE(s.empty());
  EXPECT_EQ(s.numel(), 5);
  EXPECT_EQ(s.in_shard(), 2);
  EXPECT_EQ(s.in_param(), 0);
  EXPECT_EQ(s.in_param_end(), 5);
}

TEST(ShardSlice, ParamStraddlesShardStart) {
  const auto s = shard_slice(10, 10, 6, 8);  // [6, 14)
  EXPECT_EQ(s.numel(), 4);
  EXPECT_EQ(s.in_shard(), 0);
  EXPECT_EQ(s.in_param(), 4);
  EXPECT_EQ(s.in_param_end(), 8);
}

TEST(ShardSlice, ParamStraddlesShardEnd) {
  const auto s = shard_slice(10, 10, 17, 8);  // [17, 25)
  EXPECT_EQ(s.numel(), 3);
  EXPECT_EQ(s.in_shard(), 7);
  EXPECT_EQ(s.in_param(), 0);
  EXPECT_EQ(s.in_param_end(), 3);
}

TEST(ShardSlice, ParamCoversWholeShard) {
  const auto s = shard_slice(10, 10, 0, 30);
  EXPECT_EQ(s.numel(), 10);
  EXPECT_EQ(s.in_shard(), 0);
  EXPECT_EQ(s.in_param(), 10);
}

TEST(ShardSlice, ShardOfOnlyPadding) {
  // Flat buffer of 23 real elements padded to 40 over 4 ranks: the last shard [30, 40) holds
  // padding only, so the last parameter [20, 23) has nothing there.
  EXPECT_TRUE(shard_slice(30, 10, 20, 3).empty());
  EXPECT_EQ(shard_slice(20, 10, 20, 3).numel(), 3);
}

TEST(ShardSlice, EmptyParamOrShard) {
  EXPECT_TRUE(shard_slice(10, 10, 12, 0).empty());
  EXPECT_TRUE(shard_slice(10, 0, 8, 5).empty());
}
