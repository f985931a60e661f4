// Group front end: argument checks and byte counters shared by every backend, plus the
// single-process group (see fsdp/collectives.h).
#include "fsdp/collectives.h"

#include <ATen/ATen.h>

#include <atomic>

#include "fsdp/error.h"
#include "fsdp/parse_enum.h"

namespace fsdp {

const char* to_string(CollectiveAlgorithm a) {
  switch (a) {
    case CollectiveAlgorithm::kAuto: return "auto";
    case CollectiveAlgorithm::kNative: return "native";
    case CollectiveAlgorithm::kRing: return "ring";
    case CollectiveAlgorithm::kAllToAll: return "alltoall";
    case CollectiveAlgorithm::kAllReduce: return "allreduce";
  }
  return "?";
}

CollectiveAlgorithm parse_collective_algorithm(const std::string& text) {
  // The algorithm applies to all-gather and reduce-scatter alike: the message names both.
  return parse_enum(text,
                    {CollectiveAlgorithm::kAuto, CollectiveAlgorithm::kNative,
                     CollectiveAlgorithm::kRing, CollectiveAlgorithm::kAllToAll,
                     CollectiveAlgorithm::kAllReduce},
                    "all-gather/reduce-scatter algorithm");
}

CommCounters& CommCounters::operator+=(const CommCounters& o) {
  all_gather_bytes += o.all_gather_bytes;
  reduce_scatter_bytes += o.reduce_scatter_bytes;
  all_reduce_bytes += o.all_reduce_bytes;
  broadcast_bytes += o.broadcast_bytes;
  calls += o.calls;
  return *this;
}

CommCounters CommCounters::operator-(const CommCounters& o) const {
  CommCounters d = *this;
  d.all_gather_bytes -= o.all_gather_bytes;
  d.reduce_scatter_bytes -= o.reduce_scatter_bytes;
  d.all_reduce_bytes -= o.all_reduce_bytes;
  d.broadcast_bytes -= o.broadcast_bytes;
  d.calls -= o.calls;
  return d;
}

std::string CollectiveCall::summary() const {
  std::string s = op;
  if (root >= 0) s += detail::cat(" from group rank ", root);
  if (!what.empty()) s += " of " + what;
  if (dtype != c10::ScalarType::Undefined) {
    s += detail::cat(" (", numel, " ", c10::toString(dtype), " elements)");
  }
  return s;
}

std::string CollectiveCall::describe() const {
  std::string s = detail::cat("collective #", sequence);
  std::string details = what;
  if (dtype != c10::ScalarType::Undefined) {
    details += detail::cat(details.empty() ? "" : ", ", numel, " ", c10::toString(dtype),
                           " elements");
  }
  return details.empty() ? s : s + " (" + details + ")";
}

struct Group::Counters {
  std::atomic<int64_t> all_gather{0}, reduce_scatter{0}, all_reduce{0}, broadcast{0}, calls{0};
  std::atomic<int64_t> sequence{0};
  std::atomic<bool> debug{false};
};

Group::Group(std::vector<int64_t> ranks, int64_t rank, std::string kind)
    : ranks_(std::move(ranks)), rank_(rank), kind_(std::move(kind)),
      counters_(std::make_shared<Counters>()) {
  TORCH_INTERNAL_ASSERT(rank_ >= 0 && rank_ < size(), "group rank ", rank_, " out of range");
}

std::string Group::describe() const {
  std::string s = kind_ + " group [";
  for (size_t i = 0; i < ranks_.size(); ++i) s += detail::cat(i ? ", " : "", ranks_[i]);
  return s + "]";
}

namespace {
int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

void check_buffer(const at::Tensor& t, const char* op, const char* what) {
  FSDP_CHECK(t.defined(), op, ": ", what, " is undefined");
  FSDP_CHECK(t.is_contiguous(), op, ": ", what, " must be contiguous; call .contiguous() first");
}
}  // namespace

CollectiveCall Group::next_call(const char* op, std::string what, const at::Tensor& buffer,
                                int64_t root) {
  CollectiveCall call;
  call.sequence = ++counters_->sequence;
  call.op = op;
  call.what = std::move(what);
  call.root = root;
  if (buffer.defined()) {
    call.numel = buffer.numel();
    call.dtype = buffer.scalar_type();
  }
  if (counters_->debug) check_call(call);
  return call;
}

void Group::check_call(const CollectiveCall&) {}

int64_t Group::sequence() const { return counters_->sequence; }
void Group::set_debug_collectives(bool on) { counters_->debug = on; }
bool Group::debug_collectives() const { return counters_->debug; }

WorkHandle Group::all_gather(at::Tensor output, at::Tensor input, std::string what) {
  check_buffer(output, "all_gather", "output");
  check_buffer(input, "all_gather", "input");
  FSDP_CHECK(output.numel() == input.numel() * size(), "all_gather on the ", describe(),
             ": output has ", output.numel(), " elements but needs ", size(), " x ",
             input.numel());
  FSDP_CHECK(output.scalar_type() == input.scalar_type(), "all_gather: output dtype ",
             output.scalar_type(), " differs from input dtype ", input.scalar_type());
  const CollectiveCall call = next_call("all_gather", std::move(what), output);
  counters_->all_gather += nbytes(output);
  counters_->calls += 1;
  return run_all_gather(std::move(output), std::move(input), call);
}

WorkHandle Group::reduce_scatter(at::Tensor output, at::Tensor input, std::string what) {
  check_buffer(output, "reduce_scatter", "output");
  check_buffer(input, "reduce_scatter", "input");
  FSDP_CHECK(input.numel() == output.numel() * size(), "reduce_scatter on the ", describe(),
             ": input has ", input.numel(), " elements but needs ", size(), " x ",
             output.numel());
  FSDP_CHECK(output.scalar_type() == input.scalar_type(), "reduce_scatter: output dtype ",
             output.scalar_type(), " differs from input dtype ", input.scalar_type());
  const CollectiveCall call = next_call("reduce_scatter", std::move(what), input);
  counters_->reduce_scatter += nbytes(input);
  counters_->calls += 1;
  return run_reduce_scatter(std::move(output), std::move(input), call);
}

WorkHandle Group::all_reduce(at::Tensor tensor, WorkHandle after, std::string what) {
  check_buffer(tensor, "all_reduce", "tensor");
  const CollectiveCall call = next_call("all_reduce", std::move(what), tensor);
  counters_->all_reduce += nbytes(tensor);
  counters_->calls += 1;
  return run_all_reduce(std::move(tensor), std::move(after), call);
}

WorkHandle Group::broadcast(at::Tensor tensor, int64_t root, std::string what) {
  check_buffer(tensor, "broadcast", "tensor");
  FSDP_CHECK(root >= 0 && root < size(), "broadcast root ", root, " is not a rank of the ",
             describe());
  const CollectiveCall call = next_call("broadcast", std::move(what), tensor, root);
  counters_->broadcast += nbytes(tensor);
  counters_->calls += 1;
  return run_broadcast(std::move(tensor), root, call);
}

void Group::barrier() { run_barrier(next_call("barrier", {}, at::Tensor())); }

CommCounters Group::counters() const {
  CommCounters c;
  c.all_gather_bytes = counters_->all_gather;
  c.reduce_scatter_bytes = counters_->reduce_scatter;
  c.all_reduce_bytes = counters_->all_reduce;
  c.broadcast_bytes = counters_->broadcast;
  c.calls = counters_->calls;
  return c;
}

namespace {

class DoneWork final : public Work {
 public:
  void wait() override {}
  bool completed() const override { return true; }
};

class SingleProcessGroup final : public Group {
 public:
  SingleProcessGroup(int64_t global_rank, std::string kind)
      : Group({global_rank}, 0, std::move(kind)) {}

 protected:
  WorkHandle run_all_gather(at::Tensor output, at::Tensor input, const CollectiveCall&) override {
    if (!output.is_same(input)) output.copy_(input);
    return completed_work();
  }
  WorkHandle run_reduce_scatter(at::Tensor output, at::Tensor input,
                                const CollectiveCall&) override {
    if (!output.is_same(input)) output.copy_(input);
    return completed_work();
  }
  WorkHandle run_all_reduce(at::Tensor, WorkHandle after, const CollectiveCall&) override {
    if (after) after->wait();
    return completed_work();
  }
  WorkHandle run_broadcast(at::Tensor, int64_t, const CollectiveCall&) override {
    return completed_work();
  }
  void run_barrier(const CollectiveCall&) override {}
};

}  // namespace

WorkHandle completed_work() {
  static const WorkHandle done = std::make_shared<DoneWork>();
  return done;
}

std::shared_ptr<Group> make_single_process_group(int64_t global_rank, std::string kind) {
  return std::make_shared<SingleProcessGroup>(global_rank, std::move(kind));
}

}  // namespace fsdp
