// device_streams.h (internal): the CUDA streams of the sharding engine. On CPU every call here
// does nothing.
//
// NOTE [CUDA streams]
// Parameter all-gathers are issued from the engine's own "gather" stream, as PyTorch FSDP does:
// the gather stream first waits for what the compute (current) stream has queued so far (the
// optimizer's update of the shards), then allocates the unsharded buffer, casts the shard for
// mixed precision and issues the all-gather, all on the gather stream, so none of it queues
// behind the compute stream's later work: unit k+1's gather overlaps unit k's compute. NCCL runs
// the collective on its own stream after the gather stream's work; Work::wait() makes the compute
// stream wait for it (no host blocking). The unsharded buffer is then recorded as used by the
// compute stream (record_stream), so when the engine frees it from the host, the caching
// allocator reuses the memory only after the compute stream's work on it has run. Gradient
// reduce-scatters are issued from the compute stream, after the gradients they reduce; ProcessGroupNCCL
// records their inputs and outputs on its stream, and complete_reduce waits before reading.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>

#if defined(FSDP_WITH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fsdp::detail {

class DeviceStreams {
 public:
  explicit DeviceStreams(c10::Device device) : device_(device) {
#if defined(FSDP_WITH_CUDA)
    if (device_.is_cuda()) gather_.emplace(c10::cuda::getStreamFromPool(false, device_.index()));
#endif
  }

  // While alive, the gather stream is current; it first waits for the compute stream's work.
  class GatherScope {
   public:
    explicit GatherScope(const DeviceStreams& s) {
#if defined(FSDP_WITH_CUDA)
      if (!s.gather_) return;
      at::cuda::CUDAEvent queued;
      queued.record(c10::cuda::getCurrentCUDAStream(s.device_.index()));
      queued.block(*s.gather_);
      guard_.emplace(*s.gather_);
#else
      (void)s;
#endif
    }
    GatherScope(const GatherScope&) = delete;
    GatherScope& operator=(const GatherScope&) = delete;

   private:
#if defined(FSDP_WITH_CUDA)
    std::optional<c10::cuda::CUDAStreamGuard> guard_;
#endif
  };
  GatherScope gather_scope() const { return GatherScope(*this); }

  // `t` (allocated on the gather stream) is used by the current stream from now on.
  void used_on_current_stream(const at::Tensor& t) const {
#if defined(FSDP_WITH_CUDA)
    if (gather_ && t.defined() && t.storage().nbytes() > 0) {
      t.record_stream(c10::cuda::getCurrentCUDAStream(device_.index()));
    }
#else
    (void)t;
#endif
  }

 private:
  c10::Device device_;
#if defined(FSDP_WITH_CUDA)
  std::optional<c10::cuda::CUDAStream> gather_;
#endif
};

}  // namespace fsdp::detail
