// checkpoint/full_format.h (internal): full (unsharded) checkpoint files, one interface for the
// two formats: ".pt" (PyTorch's zip format, pt.cpp) and ".safetensors" (safetensors.cpp). A
// writer takes every entry's name, dtype and shape first, then the tensors in order; a reader
// gives names, shapes and element ranges.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/common.h"

namespace fsdp::detail {

enum class FullFormat { kPt, kSafetensors };

// The format of `file` by its suffix (.pt, .pth, .safetensors); fsdp::Error for any other.
FullFormat full_format(const std::string& file);

struct FullEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t bytes() const {
    return checked_numel(shape, name) * static_cast<int64_t>(c10::elementSize(dtype));
  }
};

// Writes entries in order: begin() once, then data for each entry in the same order.
class FullWriter {
 public:
  virtual ~FullWriter() = default;
  virtual void write(const at::Tensor& contiguous_cpu) = 0;
  virtual void finish() = 0;
};

// A full checkpoint opened for reading: names, shapes and slices.
class FullReader {
 public:
  virtual ~FullReader() = default;
  std::map<std::string, std::vector<int64_t>> shapes;
  // Elements [lo, hi) of the flattened tensor `name`, in its stored dtype.
  virtual at::Tensor slice(const std::string& name, int64_t lo, int64_t hi) = 0;
};

std::unique_ptr<FullWriter> make_pt_writer(const std::string& path,
                                           const std::vector<FullEntry>& entries);
std::unique_ptr<FullWriter> make_safetensors_writer(const std::string& path,
                                                    const std::vector<FullEntry>& entries);
std::unique_ptr<FullReader> make_pt_reader(const std::string& path);
std::unique_ptr<FullReader> make_safetensors_reader(const std::string& path);

}  // namespace fsdp::detail
