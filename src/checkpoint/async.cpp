// Asynchronous sharded save (fsdp/async_checkpoint.h, NOTE [async checkpoint]): staging on the
// caller's thread, the write on a background thread, the commit collective.
#include "fsdp/async_checkpoint.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <utility>

#include "checkpoint/save_phases.h"
#include "fsdp/memory.h"
#include "fsdp/runtime.h"
#include "runtime/runtime_internal.h"

namespace fsdp {

using detail::capture;
using detail::Chunk;
using detail::chunk_bytes;
using detail::chunk_data;
using detail::commit_save;
using detail::my_chunks;
using detail::OptimizerKind;
using detail::PendingSave;
using detail::plan_save;
using detail::seconds_since;
using detail::world_sum;
using detail::write_shard_image;

struct AsyncCheckpointer::Impl {
  std::optional<PendingSave> pending;
  at::Tensor staging;  // bytes, kept between saves
  std::thread writer;
  // reserve(): allocates and first-touches a staging buffer of `reserving` bytes in the
  // background into `reserved`; the next save() joins it and adopts the buffer.
  std::thread reserver;
  at::Tensor reserved;
  int64_t reserving = 0;
  std::string reserve_error;  // set by the reserver instead of `reserved`
  std::atomic<bool> written{false};
  std::atomic<bool> cancel{false};  // the destructor's: stop waiting for the other ranks
  std::string write_error;  // set by the writer thread before `written`
  // Set by the writer thread instead when the save's agreement failed: the message every rank
  // raises (the agreement failed on every rank), no collective needed.
  std::string agree_error;
  double last_blocked = 0;

  ~Impl() {
    cancel = true;  // a save whose ranks never all arrived must not hold the destructor
    join();
    (void)finish_reservation();
    detail::add_checkpoint_staging_bytes(-staging_bytes());
  }
  // The buffer staging_bytes() reports and memory_stats counts: a reservation counts at once.
  int64_t staging_bytes() const {
    return std::max(staging.defined() ? staging.numel() : 0, reserving);
  }
  void join() {
    if (writer.joinable()) writer.join();
  }
  // Waits for a reservation in progress; returns "" or why it failed (a failed one is
  // forgotten and no longer counted).
  std::string finish_reservation() {
    if (reserver.joinable()) reserver.join();
    if (reserve_error.empty()) return {};
    const int64_t counted = staging_bytes();
    reserved = at::Tensor();
    reserving = 0;
    detail::add_checkpoint_staging_bytes(staging_bytes() - counted);
    return std::exchange(reserve_error, {});
  }
  // Makes a finished reservation the staging buffer. Only while no background write runs: the
  // writer reads the staging buffer through a raw pointer.
  std::string adopt_reserved() {
    std::string error = finish_reservation();
    if (reserved.defined()) {
      const int64_t counted = staging_bytes();
      staging = std::move(reserved);
      reserved = at::Tensor();
      reserving = 0;
      detail::add_checkpoint_staging_bytes(staging_bytes() - counted);
    }
    return error;
  }
  CheckpointInfo commit() {
    join();
    PendingSave p = std::move(*pending);
    pending.reset();
    if (!agree_error.empty()) throw Error(agree_error);
    detail::TraceSpan span(detail::trace_slot(*p.rt), "checkpoint", "checkpoint commit");
    return commit_save(p, write_error);
  }
};

namespace {

// This rank's file size, and the staging it needs: whole blocks, aligned, so the writer can
// bypass the page cache (NOTE [direct writes]).
int64_t file_bytes(const PendingSave& p) {
  return p.writer ? p.layout.file_bytes[static_cast<size_t>(p.s_index)] : 0;
}

// A staging buffer of `whole` bytes, its pages touched: pinned host memory on CUDA.
at::Tensor new_staging(bool cuda, int64_t whole) {
  return cuda ? at::empty({whole}, at::TensorOptions().dtype(at::kByte).pinned_memory(true))
              : detail::empty_direct_buffer(whole);
}

// Copies this rank's file, laid out as on disk, into the staging buffer (grown if needed), so
// the writer needs nothing else. Returns the image.
uint8_t* stage(AsyncCheckpointer::Impl& m, const PendingSave& p,
               const torch::optim::Optimizer* optimizer) {
  const int64_t bytes = file_bytes(p);
  const int64_t whole = detail::direct_bytes(bytes);
  const std::string reserve_error = m.adopt_reserved();
  FSDP_CHECK(reserve_error.empty(), reserve_error);
  if (!m.staging.defined() || m.staging.numel() < whole) {
    detail::add_checkpoint_staging_bytes(whole - m.staging_bytes());
    m.staging = new_staging(p.rt->device().is_cuda(), whole);
  }
  const OptimizerKind* kind = p.kind ? &*p.kind : nullptr;
  auto* base = m.staging.data_ptr<uint8_t>();
  // The tail up to the block is written too, then cut off: no stale bytes reach the disk.
  if (whole > bytes) std::memset(base + bytes, 0, static_cast<size_t>(whole - bytes));
  for (int64_t i : my_chunks(p)) {
    const Chunk& ch = p.layout.chunks[static_cast<size_t>(i)];
    at::Tensor src = chunk_data(ch, p.layout, *p.engine, optimizer, kind);
    std::memcpy(base + ch.offset, src.data_ptr(), static_cast<size_t>(chunk_bytes(ch, p.layout)));
  }
  return base;
}

}  // namespace

AsyncCheckpointer::AsyncCheckpointer() : impl_(std::make_unique<Impl>()) {}

AsyncCheckpointer::~AsyncCheckpointer() = default;  // Impl joins the writer

void AsyncCheckpointer::save(const std::string& path, ShardedModuleBase& model,
                             const torch::optim::Optimizer* optimizer,
                             const TrainingState& state, const CheckpointOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  Impl& m = *impl_;
  if (m.pending) m.commit();
  // Only local work here: the agreement that every rank's arguments were valid and rank 0
  // made the directory runs on the writer thread (NOTE [async checkpoint]).
  m.pending = plan_save(path, model, optimizer, state, options);
  PendingSave& p = *m.pending;
  const int64_t agreement = detail::reserve_agreement(*p.rt);
  uint8_t* base = nullptr;
  detail::TraceSlot* trace = detail::trace_slot(*p.rt);
  {
    detail::TraceSpan span(trace, "checkpoint", "checkpoint staging");
    if (p.error.empty()) p.error = capture([&] { base = stage(m, p, optimizer); });
  }
  // Write in the background (NOTE [async checkpoint]): files only, no collective.
  m.written = false;
  m.write_error.clear();
  m.agree_error.clear();
  m.writer = std::thread([&m, base, agreement, trace] {
    // Below the training threads: the write waits for the disk, not for the CPU.
    ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
    detail::set_trace_thread_name("checkpoint writer");
    detail::TraceSpan span(trace, "checkpoint", "checkpoint background write");
    PendingSave& p = *m.pending;
    m.agree_error = capture([&] {
      detail::check_all_ok_reserved(*p.rt, agreement, p.what,
                                    p.error.empty() ? detail::make_partial_dir(p) : p.error,
                                    &m.cancel);
    });
    if (m.agree_error.empty()) m.write_error = write_shard_image(p, base);
    m.written = true;
  });
  m.last_blocked = seconds_since(t0);
}

void AsyncCheckpointer::reserve(ShardedModuleBase& model, const torch::optim::Optimizer* optimizer,
                                const TrainingState& state) {
  Impl& m = *impl_;
  CheckpointOptions no_rng;
  no_rng.rng = false;
  const PendingSave p = plan_save("reserve", model, optimizer, state, no_rng);
  if (!p.error.empty()) throw Error(detail::cat("AsyncCheckpointer::reserve: ", p.error));
  const int64_t whole = detail::direct_bytes(file_bytes(p));
  // One reservation at a time. The staging buffer itself is left alone: a background write
  // may be reading it; the next save() adopts the reservation once that write is committed.
  const std::string earlier = m.finish_reservation();
  FSDP_CHECK(earlier.empty(), earlier);
  if (m.staging_bytes() >= whole) return;  // the buffer, or a reservation, is big enough
  detail::add_checkpoint_staging_bytes(whole - m.staging_bytes());
  m.reserving = whole;
  m.reserved = at::Tensor();  // a smaller reservation: no write reads it
  const bool cuda = p.rt->device().is_cuda();
  m.reserver = std::thread([&m, cuda, whole] {
    ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
    m.reserve_error = capture([&] { m.reserved = new_staging(cuda, whole); });
    if (!m.reserve_error.empty()) {
      m.reserve_error = detail::cat("reserving a staging buffer of ", whole, " bytes failed: ",
                                    m.reserve_error);
    }
  });
}

std::optional<CheckpointInfo> AsyncCheckpointer::poll() {
  Impl& m = *impl_;
  if (!m.pending) return std::nullopt;
  Runtime& rt = *m.pending->rt;
  const at::Tensor done = at::full({1}, m.written ? 1 : 0, at::TensorOptions().dtype(at::kLong));
  if (world_sum(rt, done).item<int64_t>() < rt.world_size()) return std::nullopt;
  return m.commit();
}

std::optional<CheckpointInfo> AsyncCheckpointer::wait() {
  Impl& m = *impl_;
  if (!m.pending) return std::nullopt;
  return m.commit();
}

bool AsyncCheckpointer::in_flight() const { return impl_->pending.has_value(); }
const std::string& AsyncCheckpointer::in_flight_path() const {
  static const std::string none;
  return impl_->pending ? impl_->pending->path : none;
}
int64_t AsyncCheckpointer::staging_bytes() const { return impl_->staging_bytes(); }
double AsyncCheckpointer::last_blocked_seconds() const { return impl_->last_blocked; }

}  // namespace fsdp
