// mapped_tensor.h (internal): CPU tensors in anonymous mappings of their own, outside malloc.
//
// NOTE [mapped shards]
// The parameter shards are the longest-lived large blocks of a CPU rank. From malloc they land
// in the heap between blocks that construction frees right after (a unit's whole values, the
// flat they were sliced from), which pins that freed memory: the heap cannot give it back in one
// piece and training cannot reuse it in one piece (measured: deferred construction of 16 blocks
// of d 768 at W = 8 left 285-312 MiB freed but kept, and the training peak 765 MiB against
// eager's 643). In their own mappings they pin nothing, and at the end of construction the
// whole freed heap goes back (NOTE [construction's heap] in engine_build.cpp).
#pragma once

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "fsdp/error.h"

namespace fsdp::detail {

namespace mapped_detail {
struct Mapping {
  void* ptr;
  size_t bytes;
};
inline void unmap(void* ctx) {
  auto* m = static_cast<Mapping*>(ctx);
  ::munmap(m->ptr, m->bytes);
  delete m;
}
}  // namespace mapped_detail

// `numel` zeros of `dtype` on the CPU, in a private anonymous mapping (pages appear on first
// write), freed with munmap when the last tensor using them dies.
inline at::Tensor mapped_zeros(int64_t numel, c10::ScalarType dtype) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  const size_t mapped = bytes > 0 ? bytes : 1;
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  FSDP_CHECK(p != MAP_FAILED, "cannot map ", mapped, " bytes for a parameter shard (",
             std::strerror(errno), ")");
  auto* ctx = new mapped_detail::Mapping{p, mapped};
  at::DataPtr data(p, ctx, &mapped_detail::unmap, at::Device(at::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, {numel}, {1});
}

// Whether `t`'s memory is a mapped_zeros mapping.
inline bool is_mapped(const at::Tensor& t) {
  return t.defined() && t.has_storage() &&
         t.storage().data_ptr().get_deleter() == &mapped_detail::unmap;
}

}  // namespace fsdp::detail
