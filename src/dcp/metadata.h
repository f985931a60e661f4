// dcp/metadata.h (internal): a PyTorch distributed checkpoint's `.metadata`, read and written.
//
// The file is a pickled torch.distributed.checkpoint.metadata.Metadata: for every flattened key
// ("model.transformer.wte.weight", "optim.state.<fqn>.exp_avg", "optim.param_groups.0.lr"),
// either a tensor (dtype, size, and the N-d chunks that tile it) or a bytes item (any other
// value, torch.save'd); planner_data, the key's path in the nested state dict; storage_data,
// where each chunk's bytes are (file, offset, length). PyTorch 2.6's classes and their pickled
// form (NEWOBJ + BUILD of each dataclass's __dict__; TensorProperties' tuple state; torch.Size
// and the dtype as globals) are written down in docs/dcp.md.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {

struct DcpChunk {
  std::vector<int64_t> offsets, sizes;  // a box in the tensor (empty for bytes items)
  std::string file;                     // relative to the checkpoint directory
  int64_t offset = 0, length = 0;       // of its torch.save'd bytes in `file`
};

struct DcpItem {
  std::string key;
  bool tensor = false;
  at::ScalarType dtype = at::kFloat;  // tensors
  std::vector<int64_t> size;          // tensors
  std::vector<DcpChunk> chunks;       // tensors: the tiling boxes; bytes items: one, no box
  std::vector<std::string> path;      // planner_data (empty where absent); ints as decimal text
};

struct DcpMetadata {
  std::vector<DcpItem> items;
  const DcpItem* find(const std::string& key) const;
};

// Parses `.metadata`'s bytes; `what` names it in errors. Checks that every tensor's chunks lie
// inside it and tile it exactly (no overlap, no gap), and that every chunk has its storage.
DcpMetadata parse_dcp_metadata(const std::string& bytes, const std::string& what);

// Every chunk's file exists in `dir` and is long enough; fsdp::Error naming the first that is not.
void check_dcp_files(const DcpMetadata& m, const std::string& dir);

// The pickled Metadata of `m`, as PyTorch 2.6's pickle.load reads it.
std::string dcp_metadata_bytes(const DcpMetadata& m);

// PyTorch's name of a dtype ("float32") and back; fsdp::Error for one DCP tensors here cannot be.
std::string dcp_dtype_name(at::ScalarType t);
at::ScalarType dcp_dtype(const std::string& torch_name, const std::string& what);

// The boxes whose union is elements [lo, hi) of a row-major tensor of `shape` (at most
// 2 * (dims - 1) + 1 of them: a partial row, whole rows, a partial row for two dimensions).
std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> flat_range_boxes(
    const std::vector<int64_t>& shape, int64_t lo, int64_t hi);

}  // namespace fsdp::detail
