// Groups on c10d (see c10d_group.h). Gloo: one worker thread per group, with the reduce-scatter
// and all-gather fallbacks for backends without flat collectives (Gloo in libtorch 1.13,
// docs/platform.md): rings over send/recv, which move (S-1)/S of the buffer per rank like the
// native ones. NCCL: NCCL's own collectives, issued at once (NOTE [NCCL groups]).
#include "comm/c10d_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/collective_check.h"
#include "fsdp/error.h"

namespace fsdp::detail {
namespace {

// "all_gather on the shard group [0, 1] failed at collective #5 (unit 'blocks.0', 4096 Float
// elements)": the first words are what tests and the two-hosts test look for.
std::string failed(const Group& g, const CollectiveCall& call) {
  return cat(call.op, " on the ", g.describe(), " failed at ", call.describe());
}

// The CollectiveCheck of a group made with a check store, or none.
std::unique_ptr<CollectiveCheck> make_check(c10::intrusive_ptr<c10d::Store> store,
                                            std::chrono::milliseconds timeout) {
  if (!store) return nullptr;
  return std::make_unique<CollectiveCheck>(std::move(store), timeout);
}

// Payload bytes of a call, as the group's counters count them (fsdp/collectives.h).
int64_t payload_bytes(const CollectiveCall& call) {
  if (call.dtype == c10::ScalarType::Undefined) return 0;
  return call.numel * static_cast<int64_t>(c10::elementSize(call.dtype));
}

class TaskWork final : public Work {
 public:
  // `trace`: where a wait that blocks is recorded, as "wait <op> <what>" (exposed communication).
  TaskWork(TraceSlot* trace, const CollectiveCall* call) : trace_(trace) {
    if (trace_ && trace_->on() && call) label_ = cat(call->op, " ", call->what);
  }
  void wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!done_) {
      TraceSpan span(label_.empty() ? nullptr : trace_, "wait", "wait", label_);
      cv_.wait(lock, [&] { return done_; });
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool completed() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  TraceSlot* trace_;
  std::string label_;
};

// Runs tasks one at a time, in submission order, on its own thread.
class Worker {
 public:
  // `name`: the thread's track in traces ("comm: shard group").
  Worker(TraceSlot* trace, std::string name)
      : trace_(trace), thread_([this, name = std::move(name)] {
          set_trace_thread_name(name);
          loop();
        }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  WorkHandle submit(std::function<void()> fn, const CollectiveCall* call = nullptr) {
    auto work = std::make_shared<TaskWork>(trace_, call);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (count_ == ring_.size()) grow();
      ring_[(head_ + count_) % ring_.size()] = Task{std::move(fn), work};
      ++count_;
    }
    cv_.notify_one();
    return work;
  }

 private:
  void loop() {
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || count_ > 0; });
        if (count_ == 0) return;  // stop_ and drained
        task = std::move(ring_[head_]);
        head_ = (head_ + 1) % ring_.size();
        --count_;
      }
      std::exception_ptr error;
      try {
        task.first();
      } catch (...) {
        error = std::current_exception();
      }
      task.first = nullptr;  // release the task's tensors before signalling completion
      task.second->finish(error);
    }
  }

  using Task = std::pair<std::function<void()>, std::shared_ptr<TaskWork>>;
  // Doubles when full (under mu_), keeping the order.
  void grow() {
    std::vector<Task> bigger(ring_.size() * 2);
    for (size_t i = 0; i < count_; ++i) bigger[i] = std::move(ring_[(head_ + i) % ring_.size()]);
    ring_ = std::move(bigger);
    head_ = 0;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  // The queue: a ring that only grows. A std::deque allocated a new 480-byte chunk every 10
  // submissions and freed the old one, so a small block made during a backward outlived it
  // (NOTE [gradient shells] in src/engine/engine.h says why that matters).
  std::vector<Task> ring_ = std::vector<Task>(16);
  size_t head_ = 0, count_ = 0;
  bool stop_ = false;
  TraceSlot* trace_;
  std::thread thread_;  // last: starts after the members above exist
};

class C10dGroup final : public Group {
 public:
  C10dGroup(c10::intrusive_ptr<compat::C10dBackend> backend, std::vector<int64_t> ranks,
            int64_t rank, std::string kind, bool flat, CollectiveAlgorithm algorithm,
            std::unique_ptr<CollectiveCheck> check, std::shared_ptr<TraceSlot> trace)
      : Group(std::move(ranks), rank, std::move(kind)), backend_(std::move(backend)),
        flat_(flat), algorithm_(algorithm), check_(std::move(check)), trace_(std::move(trace)),
        worker_(trace_.get(), "comm: " + this->kind() + " group") {
    if (algorithm_ == CollectiveAlgorithm::kAuto) algorithm_ = CollectiveAlgorithm::kRing;
    FSDP_CHECK(algorithm_ != CollectiveAlgorithm::kNative || flat_,
               "collective algorithm 'native' was requested but the ", backend_->getBackendName(),
               " backend of this libtorch has no _allgather_base / _reduce_scatter_base; use auto, "
               "ring or alltoall");
  }

 protected:
  void check_call(const CollectiveCall& call) override {
    if (check_) check_->verify(*this, call);
  }

  WorkHandle run_all_gather(at::Tensor output, at::Tensor input,
                            const CollectiveCall& call) override {
    return submit(call, [this, output, input]() mutable {
      gather_into(transport(output), transport(input));
    });
  }

  WorkHandle run_reduce_scatter(at::Tensor output, at::Tensor input,
                                const CollectiveCall& call) override {
    return submit(call, [this, output, input]() mutable {
      // A dtype the backend cannot sum (bf16 on Gloo) takes the ring, whose sums are local.
      const auto algorithm = native(input) ? algorithm_ : CollectiveAlgorithm::kRing;
      switch (algorithm) {
        case CollectiveAlgorithm::kNative: {
          c10d::ReduceScatterOptions opts;
          opts.reduceOp = c10d::ReduceOp::SUM;
          backend_->_reduce_scatter_base(output, input, opts)->wait();
          return;
        }
        case CollectiveAlgorithm::kRing: return ring_reduce_scatter(output, input);
        case CollectiveAlgorithm::kAllToAll: return alltoall_reduce_scatter(output, input);
        case CollectiveAlgorithm::kAllReduce: {
          at::Tensor copy = input.clone();
          std::vector<at::Tensor> ts{copy};
          backend_->allreduce(ts)->wait();
          output.view({-1}).copy_(copy.view({-1}).chunk(size())[rank()]);
          return;
        }
        case CollectiveAlgorithm::kAuto: break;
      }
      TORCH_INTERNAL_ASSERT(false, "unresolved reduce-scatter algorithm");
    });
  }

  WorkHandle run_all_reduce(at::Tensor tensor, WorkHandle after,
                            const CollectiveCall& call) override {
    return submit(call, [this, tensor, after]() mutable {
      if (after) after->wait();
      if (native(tensor)) {
        std::vector<at::Tensor> ts{tensor};
        backend_->allreduce(ts)->wait();
        return;
      }
      ring_all_reduce(tensor);
    });
  }

  WorkHandle run_broadcast(at::Tensor tensor, int64_t root, const CollectiveCall& call) override {
    return submit(call, [this, tensor, root]() mutable {
      std::vector<at::Tensor> ts{transport(tensor)};
      c10d::BroadcastOptions opts;
      opts.rootRank = static_cast<int>(root);
      backend_->broadcast(ts, opts)->wait();
    });
  }

  void run_barrier(const CollectiveCall& call) override {
    submit(call, [this] { backend_->barrier()->wait(); })->wait();
  }

 private:
  // Whether the backend handles this dtype itself. Gloo (1.13 and 2.x) rejects bf16
  // ("Invalid scalar type"); NCCL takes everything we use.
  bool native(const at::Tensor& t) const {
    return t.scalar_type() != at::kBFloat16 || backend_->getBackendName() != "gloo";
  }
  // The tensor as the backend can move it: its bytes under a same-sized dtype the backend knows
  // (Gloo has no int16, so bf16 travels as fp16 bit patterns). Only for collectives that move
  // data without arithmetic, so no value is ever interpreted in the stand-in dtype.
  at::Tensor transport(const at::Tensor& t) const {
    return native(t) ? t : t.view(at::kHalf);
  }
  void gather_into(at::Tensor output, at::Tensor input) {
    if (algorithm_ == CollectiveAlgorithm::kNative && native(input)) {
      backend_->_allgather_base(output, input)->wait();
      return;
    }
    // Not Gloo's list-form allgather (1.13's fallback): it stages through a flat copy, and the
    // ring measured 1.6-3.9x faster (bench_collectives, 4 ranks, 4-64 MiB).
    ring_all_gather(output, input);
  }

  // Ring all-gather over send/recv: at step t rank r forwards chunk (r-t) mod S to rank r+1 and
  // receives chunk (r-t-1) mod S from rank r-1 straight into the output. S-1 steps, (S-1)/S of
  // the buffer per rank, no staging copies.
  void ring_all_gather(at::Tensor& output, at::Tensor& input) {
    const int64_t S = size(), r = rank();
    auto chunks = output.view({-1}).chunk(S);
    chunks[r].copy_(input.view({-1}));
    if (S == 1) return;
    for (int64_t t = 0; t < S - 1; ++t) {
      ring_step(chunks[((r - t) % S + S) % S], chunks[((r - t - 1) % S + S) % S],
                static_cast<int>(t));
    }
  }

  // Runs `fn` on the group's worker. With a trace on, the run is an event on the worker's track
  // ("all_gather unit 'block3'", category "collective") with the op, group, what, payload bytes
  // and collective number, and how long it queued behind the group's earlier collectives.
  WorkHandle submit(const CollectiveCall& call, std::function<void()> fn) {
    const bool traced = trace_ && trace_->on();
    const int64_t issued = traced ? trace_->now() : 0;
    return worker_.submit(
        [this, what = failed(*this, call), fn = std::move(fn), traced, issued,
         op = call.op, label = traced ? call.what : std::string(), bytes = payload_bytes(call),
         number = call.sequence] {
          TraceSpan span(traced ? trace_.get() : nullptr, "collective", op, label);
          if (span.active()) {
            span.arg("op", op).arg("group", kind()).arg("what", label).arg("bytes", double(bytes))
                .arg("collective", double(number))
                .arg("queued_us", double(trace_->now() - issued) / 1e3);
          }
          try {
            fn();
          } catch (const Error&) {
            throw;
          } catch (const std::exception& e) {
            throw Error(detail::cat(what, ": ", error_message(e),
                                    " (a peer rank probably exited or timed out; see its output)"));
          }
        },
        &call);
  }

  // Ring reduce-scatter over send/recv. At step t (0..S-2) rank r sends its running sum of chunk
  // (r-t-1) mod S to rank r+1 and receives chunk (r-t-2) mod S from rank r-1, adding its own
  // contribution. After S-1 steps it holds the full sum of chunk r. Each rank sends (S-1)/S of the
  // buffer, like a ring all-reduce's first half. NOTE [ring buffers]
  //
  // NOTE [ring buffers]
  // The ring allocates nothing per call: step 0 sends straight from the input's chunk, the running
  // sum lives in the output (the sum of step t is what step t+1 sends), and what arrives lands in
  // one staging buffer that the group keeps (its worker runs one collective at a time). The ring
  // runs in segments of at most kRingSegmentBytes per chunk, so that buffer stays small whatever
  // the unit's size. Fresh buffers per call were the largest source of FULL_SHARD's page faults
  // on GPT-2: a 38.6 M-parameter root unit made two 77 MiB mallocs, each a fresh mmap that the
  // kernel zero-fills on first touch, every step (docs/performance.md).
  static constexpr int64_t kRingSegmentBytes = int64_t{8} << 20;

  void ring_reduce_scatter(at::Tensor& output, at::Tensor& input) {
    const int64_t S = size(), r = rank();
    at::Tensor in = input.view({-1});
    const int64_t n = output.numel();
    TORCH_INTERNAL_ASSERT(in.numel() == n * S, "reduce-scatter input of ", in.numel(),
                          " elements for ", S, " outputs of ", n);
    if (S == 1) {
      output.view({-1}).copy_(in);
      return;
    }
    // The running sum must not overwrite this rank's own chunk before the last step reads it:
    // an output inside the input (an in-place reduce-scatter) sums into a scratch copy instead.
    at::Tensor out = output.view({-1});
    const bool aliased = overlaps(out, in);
    at::Tensor sum = aliased ? at::empty_like(out) : out;
    const int64_t seg = std::max<int64_t>(1, kRingSegmentBytes / in.element_size());
    at::Tensor staging = staging_for(std::min(seg, n), in.scalar_type());
    int tag = 0;
    for (int64_t a = 0; a < n; a += seg) {
      const int64_t len = std::min(seg, n - a);
      auto piece = [&](int64_t c) { return in.narrow(0, c * n + a, len); };
      at::Tensor acc = sum.narrow(0, a, len), got = staging.narrow(0, 0, len);
      for (int64_t t = 0; t < S - 1; ++t) {
        ring_step(t == 0 ? piece((r + S - 1) % S) : acc, got, tag++);
        at::add_out(acc, got, piece(((r - t - 2) % S + S) % S));
      }
    }
    if (aliased) out.copy_(sum);
  }

  // Ring all-reduce in place: a ring reduce-scatter, then a ring all-gather, over the tensor's
  // S nearly equal chunks, in segments of at most kRingSegmentBytes per chunk. At reduce step t
  // rank r sends chunk (r-t) mod S and adds what arrives into chunk (r-t-1) mod S; after S-1
  // steps it holds the whole sum of chunk (r+1) mod S, which the all-gather passes on around the
  // ring (step t: send chunk (r+1-t), receive chunk (r-t) in place). Each sum is made on one
  // rank and copied to the others, so every rank ends with the same bits; the sums are local,
  // in the tensor's dtype. For what Gloo cannot sum (bf16); nothing is allocated per call
  // (NOTE [ring buffers]), where the padded copies it replaces took the tensor's size twice.
  void ring_all_reduce(const at::Tensor& tensor) {
    const int64_t S = size(), r = rank();
    if (S == 1) return;
    at::Tensor flat = tensor.view({-1});
    const int64_t n = flat.numel(), base = n / S, extra = n % S;
    auto begin_of = [&](int64_t c) { return c * base + std::min(c, extra); };
    auto size_of = [&](int64_t c) { return base + (c < extra ? 1 : 0); };
    auto mod = [&](int64_t c) { return ((c % S) + S) % S; };
    const int64_t seg = std::max<int64_t>(1, kRingSegmentBytes / flat.element_size());
    const int64_t longest = size_of(0);
    if (longest == 0) return;
    at::Tensor staging = staging_for(std::min(seg, longest), flat.scalar_type());
    int tag = 0;
    for (int64_t a = 0; a < longest; a += seg) {
      auto piece = [&](int64_t c) {
        const int64_t len = std::clamp<int64_t>(size_of(c) - a, 0, seg);
        return flat.narrow(0, begin_of(c) + std::min(a, size_of(c)), len);
      };
      for (int64_t t = 0; t < S - 1; ++t) {
        at::Tensor into = piece(mod(r - t - 1));
        at::Tensor got = staging.narrow(0, 0, into.numel());
        ring_step(piece(mod(r - t)), got, tag++);
        into.add_(got);
      }
      for (int64_t t = 0; t < S - 1; ++t) {
        ring_step(piece(mod(r + 1 - t)), piece(mod(r - t)), tag++);
      }
    }
  }

  // One step of every ring: sends `out` to the next rank and receives `in` from the previous
  // one under `tag`. An empty side sends or takes nothing (the all-reduce's short chunks), which
  // its peer knows from the same sizes.
  void ring_step(const at::Tensor& out, const at::Tensor& in, int tag) {
    const int next = static_cast<int>((rank() + 1) % size());
    const int prev = static_cast<int>((rank() + size() - 1) % size());
    std::vector<at::Tensor> s{transport(out)}, q{transport(in)};
    c10::intrusive_ptr<c10d::Work> sw, rw;
    if (out.numel() > 0) sw = backend_->send(s, next, tag);
    if (in.numel() > 0) rw = backend_->recv(q, prev, tag);
    if (rw) rw->wait();
    if (sw) sw->wait();
  }

  static bool overlaps(const at::Tensor& a, const at::Tensor& b) {
    if (!a.storage().is_alias_of(b.storage())) return false;
    const auto* a0 = static_cast<const char*>(a.data_ptr());
    const auto* b0 = static_cast<const char*>(b.data_ptr());
    return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
  }

  // The group's receive buffer: `numel` elements of `dtype`, grown when a call needs more.
  at::Tensor staging_for(int64_t numel, c10::ScalarType dtype) {
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    if (!staging_.defined() || staging_.numel() < bytes) {
      staging_ = at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
    }
    return staging_.narrow(0, 0, bytes).view(dtype);
  }

  void alltoall_reduce_scatter(at::Tensor& output, at::Tensor& input) {
    const int64_t S = size();
    at::Tensor in = input.view({-1});
    at::Tensor received = at::empty_like(in);
    std::vector<int64_t> counts(S, output.numel());
    backend_->alltoall_base(received, in, counts, counts)->wait();
    at::Tensor out = output.view({-1});
    at::sum_out(out, received.view({S, -1}), {0});
  }

  c10::intrusive_ptr<compat::C10dBackend> backend_;
  bool flat_;
  CollectiveAlgorithm algorithm_;
  std::unique_ptr<CollectiveCheck> check_;  // none: set_debug_collectives has no effect
  at::Tensor staging_;  // NOTE [ring buffers]: used by the worker thread only
  std::shared_ptr<TraceSlot> trace_;  // may be null: no trace
  Worker worker_;  // last: joined first, while the members it uses still exist
};

// A c10d Work as ours: wait() has the c10d semantics of the backend (NCCL: the caller's current
// CUDA stream waits for the collective, the CPU does not), and a failure becomes fsdp::Error.
class C10dWork final : public Work {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, std::string what)
      : work_(std::move(work)), what_(std::move(what)) {}
  void wait() override {
    try {
      work_->wait();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(detail::cat(what_, ": ", error_message(e),
                              " (a peer rank probably exited or timed out; see its output)"));
    }
  }
  bool completed() const override { return work_->isCompleted(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
};

// NOTE [NCCL groups]
// An NCCL group issues every collective at once, on the calling thread: NCCL is asynchronous
// itself and runs a group's collectives one at a time, in issue order, on the group's own CUDA
// stream, after the work queued on the caller's current stream (c10d makes its stream wait for
// the caller's). Work::wait() makes the *waiting* thread's current stream wait for the
// collective; the CPU goes on. c10d keeps the input and output tensors alive for the allocator
// (record_stream on its stream) until the collective finishes. All-gather and reduce-scatter are
// NCCL's own flat collectives (_allgather_base / _reduce_scatter_base): no ring, no worker
// thread, and bf16 is reduced natively. Callers must not issue on one group from two threads at
// the same time.
class NcclGroup final : public Group {
 public:
  NcclGroup(c10::intrusive_ptr<compat::C10dBackend> backend, std::vector<int64_t> ranks,
            int64_t rank, std::string kind, CollectiveAlgorithm algorithm,
            std::unique_ptr<CollectiveCheck> check)
      : Group(std::move(ranks), rank, std::move(kind)), backend_(std::move(backend)),
        check_(std::move(check)) {
    FSDP_CHECK(algorithm == CollectiveAlgorithm::kAuto || algorithm == CollectiveAlgorithm::kNative,
               "collective algorithm '", to_string(algorithm), "' is for Gloo groups; NCCL groups "
               "use NCCL's own all-gather and reduce-scatter: use auto or native");
  }

 protected:
  void check_call(const CollectiveCall& call) override {
    if (check_) check_->verify(*this, call);
  }
  WorkHandle run_all_gather(at::Tensor output, at::Tensor input,
                            const CollectiveCall& call) override {
    return issue(call, [&] { return backend_->_allgather_base(output, input); });
  }
  WorkHandle run_reduce_scatter(at::Tensor output, at::Tensor input,
                                const CollectiveCall& call) override {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return issue(call, [&] { return backend_->_reduce_scatter_base(output, input, opts); });
  }
  WorkHandle run_all_reduce(at::Tensor tensor, WorkHandle after,
                            const CollectiveCall& call) override {
    if (after) after->wait();  // a stream dependency, not a CPU wait (NOTE [NCCL groups])
    std::vector<at::Tensor> ts{tensor};
    return issue(call, [&] { return backend_->allreduce(ts); });
  }
  WorkHandle run_broadcast(at::Tensor tensor, int64_t root, const CollectiveCall& call) override {
    std::vector<at::Tensor> ts{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = static_cast<int>(root);
    return issue(call, [&] { return backend_->broadcast(ts, opts); });
  }
  void run_barrier(const CollectiveCall& call) override {
    // On this thread's current device (Runtime::init set it to cuda:<LOCAL_RANK>); c10d would
    // otherwise guess the device from the global rank.
    c10d::BarrierOptions opts;
    opts.device_ids = {compat::current_cuda_device()};
    issue(call, [&] { return backend_->barrier(opts); })->wait();
  }

 private:
  template <typename Fn>
  WorkHandle issue(const CollectiveCall& call, Fn&& fn) {
    const std::string what = failed(*this, call);
    try {
      return std::make_shared<C10dWork>(fn(), what);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(detail::cat(what, ": ", error_message(e)));
    }
  }

  c10::intrusive_ptr<compat::C10dBackend> backend_;
  std::unique_ptr<CollectiveCheck> check_;  // none: set_debug_collectives has no effect
};

}  // namespace

std::shared_ptr<Group> make_c10d_group(c10::intrusive_ptr<compat::C10dBackend> backend,
                                       std::vector<int64_t> ranks, int64_t rank, std::string kind,
                                       bool has_flat_collectives, bool is_nccl,
                                       CollectiveAlgorithm algorithm,
                                       c10::intrusive_ptr<c10d::Store> check_store,
                                       std::chrono::milliseconds timeout,
                                       std::shared_ptr<TraceSlot> trace) {
  auto check = make_check(std::move(check_store), timeout);
  if (is_nccl) {
    TORCH_INTERNAL_ASSERT(has_flat_collectives, "NCCL always has flat collectives");
    return std::make_shared<NcclGroup>(std::move(backend), std::move(ranks), rank, std::move(kind),
                                       algorithm, std::move(check));
  }
  return std::make_shared<C10dGroup>(std::move(backend), std::move(ranks), rank, std::move(kind),
                                     has_flat_collectives, algorithm, std::move(check),
                                     std::move(trace));
}

}  // namespace fsdp::detail
