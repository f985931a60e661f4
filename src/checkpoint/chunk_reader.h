// checkpoint/chunk_reader.h (internal): loading at the disk's speed. The loader says where each
// element range of each saved tensor must land (`want`); `read_all` then passes once over the
// checkpoint's files in file order, reads every chunk some destination needs exactly once, checks
// its checksum while the bytes are still in cache, and puts them in place: straight into the
// destination when one destination holds the whole chunk in the saved dtype (the usual resume on
// the same mesh), otherwise through one reused staging buffer and one copy per destination.
// NOTE [one-pass load] in chunk_reader.cpp says why.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/meta.h"

namespace fsdp::detail {

class ChunkReader {
 public:
  explicit ChunkReader(const Meta& m);
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;

  // Elements [lo, hi) of entry `entry` (flattened) go to `dst`: a contiguous CPU tensor of
  // hi - lo elements, of any dtype (converted when it differs from the saved one). `dst` must
  // stay alive until read_all returns. Ranges of one entry may not overlap.
  void want(int64_t entry, int64_t lo, int64_t hi, const at::Tensor& dst);

  // Reads every chunk that overlaps a wanted range, once, file by file in offset order, and
  // verifies each chunk's checksum. Throws fsdp::Error naming the file for a short read or a
  // checksum mismatch (destinations may then hold part of the data). Returns the bytes read.
  int64_t read_all();

 private:
  struct Want {
    int64_t lo, hi;
    at::Tensor dst;
  };
  void read_chunk(const Chunk& c, const std::vector<const Want*>& wants, File& f);
  void verify(const Chunk& c, uint32_t crc) const;

  const Meta& m_;
  std::vector<std::vector<Want>> wants_;  // per entry
  std::vector<uint8_t> staging_;          // reused for chunks that are not read in place
};

}  // namespace fsdp::detail
