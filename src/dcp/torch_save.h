// dcp/torch_save.h (internal): the bytes of one DCP item — torch.save's zip format holding one
// tensor (a chunk) or one plain value (a bytes item) — read from a range of a .distcp file and
// written for one.
//
// torch.save writes a zip (stored, not compressed) of <archive>/data.pkl, byteorder, version and
// one data/<key> record per storage; for a tensor, data.pkl is
//   torch._utils._rebuild_tensor_v2(persistent_id(('storage', torch.<Type>Storage, key, 'cpu',
//                                                  numel)), offset, size, stride, False, OrderedDict())
// which the reader interprets (never calling anything; pickle.h).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "checkpoint/file_io.h"
#include "dcp/pickle.h"

namespace fsdp::detail {

// The tensor torch.save wrote at bytes [offset, offset + length) of `f`; `what` names the item in
// errors. Its dtype must be `dtype` and its shape `sizes`.
at::Tensor read_saved_tensor(const File& f, int64_t offset, int64_t length, at::ScalarType dtype,
                             const std::vector<int64_t>& sizes, const std::string& what);

// A bytes item: torch.save of a plain value (numbers, strings, tuples, lists, dicts, None), or raw
// bytes a state dict held as io.BytesIO (then value is null and raw holds them).
struct SavedValue {
  std::string raw;
  std::unique_ptr<pickle::Pickle> value;
};
SavedValue read_saved_value(const File& f, int64_t offset, int64_t length, const std::string& what);

// torch.save(t) of a contiguous CPU tensor, as bytes.
std::string saved_tensor_bytes(const at::Tensor& t);

// torch.save of the value `pickled` (the bytes of a PickleWriter), as bytes.
std::string saved_value_bytes(const std::string& pickled);

}  // namespace fsdp::detail
