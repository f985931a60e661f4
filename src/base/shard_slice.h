// shard_slice.h (internal): the one piece of arithmetic every flat-layout consumer needs — which
// part of a parameter, stored at [offset, offset + numel) of its unit's flat buffer, falls inside
// one rank's shard [shard_begin, shard_begin + shard_numel). Used by the engine's state dicts and
// by checkpoint save, load and export.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fsdp::detail {

// The overlap of a parameter with a shard, in flat-buffer coordinates [lo, hi). Empty when the
// parameter lies wholly before or after the shard, or when the overlap falls in padding.
struct ShardSlice {
  int64_t shard_begin = 0;   // flat index of the shard's first element
  int64_t param_offset = 0;  // flat index of the parameter's first element
  int64_t lo = 0, hi = 0;    // the overlap; lo >= hi means none

  bool empty() const { return lo >= hi; }
  int64_t numel() const { return empty() ? 0 : hi - lo; }
  // Where the overlap starts inside the shard, and inside the flattened parameter.
  int64_t in_shard() const { return lo - shard_begin; }
  int64_t in_param() const { return lo - param_offset; }
  // One past the overlap's end inside the flattened parameter.
  int64_t in_param_end() const { return hi - param_offset; }
};

// Elements per rank when `numel` elements are sharded over `shards` ranks: ceil(numel / shards),
// the last rank's part padded (fsdp::UnitInfo::shard_numel).
inline int64_t shard_numel_of(int64_t numel, int64_t shards) { return (numel + shards - 1) / shards; }

// The part of the parameter [param_offset, param_offset + param_numel) that lies in the shard
// [shard_begin, shard_begin + shard_numel). Both ranges are half-open; any may be empty.
inline ShardSlice shard_slice(int64_t shard_begin, int64_t shard_numel, int64_t param_offset,
                              int64_t param_numel) {
  ShardSlice s;
  s.shard_begin = shard_begin;
  s.param_offset = param_offset;
  s.lo = std::max(shard_begin, param_offset);
  s.hi = std::min(shard_begin + shard_numel, param_offset + param_numel);
  return s;
}

}  // namespace fsdp::detail
