// One pass over a checkpoint's files, each needed chunk read once into its destinations (see
// checkpoint/chunk_reader.h).
#include "checkpoint/chunk_reader.h"

#include <fcntl.h>

#include <algorithm>
#include <cstring>

#include "fsdp/error.h"

namespace fsdp::detail {

// NOTE [one-pass load]
// A load used to read each chunk whole for every parameter slice that touched it, check it with a
// table CRC-32 at ~0.5 GB/s, copy it into a slice tensor, copy that into a new shard, and copy the
// shard into the model: CPU-bound at a third of the disk's read rate. Now the loader first says
// where every element range goes, and the chunks are read in file order — sequential reads the
// kernel reads ahead of, with an explicit hint one piece ahead — each once:
//   - in place: a chunk that lies inside one destination of its own dtype (a resume on the same
//     mesh: every chunk is one parameter's part of the saving rank's shard, or of one optimizer
//     state) is read with pread straight into the destination, no copy;
//   - staged: otherwise (resharding, a chunk split over destinations, another dtype) into one
//     staging buffer reused for every such chunk, then one copy per destination;
//   - the checksum (CRC-32C from format 2, hardware, > 10 GB/s) runs on each piece of kPiece bytes
//     right after it is read, while it is in the cache;
//   - destinations are new tensors (the model changes only once every rank has read everything),
//     and first touches of new memory were most of a load's time in this VM (perf of a W = 1 load:
//     exc_page_fault under pread's copy, 20% of all samples). empty_mapped (checkpoint/common.h)
//     maps them up front: 2 MiB-aligned, MADV_HUGEPAGE (512x fewer pages where transparent huge
//     pages are enabled or madvise), MADV_POPULATE_WRITE (Linux 5.14+: all pages in one call).
//     Either hint may be refused; the reads then fault as before. Measured (medium GPT, 295 MiB,
//     W = 1, warm): the read itself 0.05 s, mapping the new memory 0.3-0.8 s — this VM's cost of
//     memory the guest never touched before, which any loader pays (bench "Checkpoint I/O"
//     reports it next to the load).
// A chunk nobody wants is not read at all (a rank of a bigger mesh reads only its part).
namespace {
constexpr int64_t kPiece = int64_t(4) << 20;
}  // namespace

ChunkReader::ChunkReader(const Meta& m) : m_(m), wants_(m.entries.size()) {}

void ChunkReader::want(int64_t entry, int64_t lo, int64_t hi, const at::Tensor& dst) {
  TORCH_INTERNAL_ASSERT(entry >= 0 && entry < static_cast<int64_t>(wants_.size()));
  TORCH_INTERNAL_ASSERT(dst.is_contiguous() && dst.device().is_cpu() && dst.numel() == hi - lo);
  if (lo >= hi) return;
  wants_[static_cast<size_t>(entry)].push_back(Want{lo, hi, dst});
}

int64_t ChunkReader::read_all() {
  struct Job {
    const Chunk* chunk;
    std::vector<const Want*> wants;
  };
  std::vector<Job> jobs;
  for (const Chunk& c : m_.chunks) {
    Job job{&c, {}};
    for (const Want& w : wants_[static_cast<size_t>(c.tensor)]) {
      if (w.lo < c.end && c.begin < w.hi) job.wants.push_back(&w);
    }
    if (!job.wants.empty()) jobs.push_back(std::move(job));
  }
  std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) {
    return std::tie(a.chunk->file, a.chunk->offset) < std::tie(b.chunk->file, b.chunk->offset);
  });
  int64_t bytes = 0;
  std::unique_ptr<File> f;
  int64_t open_file = -1;
  for (const Job& job : jobs) {
    const Chunk& c = *job.chunk;
    if (c.file != open_file) {
      f = std::make_unique<File>(m_.path + "/" + m_.files[static_cast<size_t>(c.file)].name, O_RDONLY);
      open_file = c.file;
    }
    read_chunk(c, job.wants, *f);
    bytes += (c.end - c.begin) *
             static_cast<int64_t>(c10::elementSize(m_.entries[static_cast<size_t>(c.tensor)].dtype));
  }
  return bytes;
}

void ChunkReader::read_chunk(const Chunk& c, const std::vector<const Want*>& wants, File& f) {
  const at::ScalarType dtype = m_.entries[static_cast<size_t>(c.tensor)].dtype;
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t n = (c.end - c.begin) * esize;
  const Want* only = wants.size() == 1 ? wants[0] : nullptr;
  const bool in_place = only && only->lo <= c.begin && c.end <= only->hi &&
                        only->dst.scalar_type() == dtype;
  uint8_t* to = nullptr;
  if (in_place) {
    to = static_cast<uint8_t*>(only->dst.data_ptr()) + (c.begin - only->lo) * esize;
  } else {
    if (staging_.size() < static_cast<size_t>(n)) staging_.resize(static_cast<size_t>(n));
    to = staging_.data();
  }
  uint32_t crc = 0;
  for (int64_t done = 0; done < n;) {
    const int64_t len = std::min(kPiece, n - done);
    if (done + len < n) f.prefetch(c.offset + done + len, std::min(kPiece, n - done - len));
    f.read_at(to + done, len, c.offset + done);
    crc = format_checksum(m_.format_version, to + done, len, crc);
    done += len;
  }
  verify(c, crc);
  if (in_place) return;
  for (const Want* w : wants) {
    const int64_t a = std::max(w->lo, c.begin), b = std::min(w->hi, c.end);
    const uint8_t* src = staging_.data() + (a - c.begin) * esize;
    if (w->dst.scalar_type() == dtype) {
      std::memcpy(static_cast<uint8_t*>(w->dst.data_ptr()) + (a - w->lo) * esize, src,
                  static_cast<size_t>((b - a) * esize));
    } else {
      w->dst.narrow(0, a - w->lo, b - a)
          .copy_(at::from_blob(const_cast<uint8_t*>(src), {b - a}, at::TensorOptions().dtype(dtype)));
    }
  }
}

void ChunkReader::verify(const Chunk& c, uint32_t crc) const {
  FSDP_CHECK(crc == c.crc, "checkpoint '", m_.path, "': '", m_.files[static_cast<size_t>(c.file)].name,
             "' is corrupted (", checksum_name(m_.format_version), " mismatch at byte ", c.offset,
             ", ", m_.entries[static_cast<size_t>(c.tensor)].key(), "); use an earlier checkpoint");
}

}  // namespace fsdp::detail
