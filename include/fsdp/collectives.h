// fsdp/collectives.h: the communication interface the sharding engine talks to.
//
// A Group is a set of ranks that run collectives together: the world, one shard group or one
// replicate group of a DeviceMesh. The engine never sees c10d or Gloo: Runtime::world() and
// Runtime::new_group() (runtime.h) build Groups on c10d (Gloo on CPU, NCCL on CUDA), as does
// DeviceMesh (mesh.h) for each dim through new_group(); make_single_process_group() below builds
// a trivial one for a world of one process.
//
// NOTE [collective contract]
// - Every member must issue the same collectives on a group in the same order, with tensors of
//   the same sizes and dtypes. A rank that skips one makes the others wait until the timeout.
// - Calls return at once with a Work handle. Inputs must stay unmodified and outputs unread until
//   wait() returns; wait() rethrows the collective's failure (a dead peer, a timeout) as
//   fsdp::Error naming the operation, the group and the collective's sequence number there.
// - Collectives on one group run one at a time, in issue order. Collectives on different groups
//   (a shard group and a replicate group) run concurrently.
// - Each group numbers its collectives 1, 2, 3, ... in issue order (Group::sequence()); errors
//   name that number and the caller's name for the data ("collective #17 (unit 'blocks.3', ...)"),
//   so two ranks' errors can be lined up. NOTE [collective check] (set_debug_collectives) compares
//   the numbered calls across the group before running them.
// - Sums only. Averaging is the caller's job: the engine divides once, on the reduced gradient
//   shard (see NOTE [gradient averaging] in sharded.h). Gloo has no ReduceOp::AVG.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

// Completion handle of an asynchronous collective.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective finished; rethrows its error. Idempotent.
  virtual void wait() = 0;
  virtual bool completed() const = 0;
};
using WorkHandle = std::shared_ptr<Work>;

// How all_gather and reduce_scatter run on a c10d group. Gloo's own flat collectives (libtorch
// 2.x) measured up to 2x slower than a ring on CPU, and libtorch 1.13's Gloo has none, so Gloo
// groups default to rings; NCCL groups use NCCL's. See bench_collectives and docs/performance.md.
enum class CollectiveAlgorithm {
  kAuto,       // NCCL: native; Gloo: kRing
  kNative,     // the backend's _allgather_base / _reduce_scatter_base (error if it has none)
  kRing,       // S-1 steps of send/recv with the neighbours: each rank sends (S-1)/S of the buffer
  kAllToAll,   // reduce-scatter as alltoall_base + a local sum (also (S-1)/S); ring all-gather
  kAllReduce,  // reduce-scatter as all-reduce + keep a slice (twice the traffic; for comparison)
};
const char* to_string(CollectiveAlgorithm a);
CollectiveAlgorithm parse_collective_algorithm(const std::string& text);

// Payload bytes issued on a group since it was created, per collective. For all-gather and
// reduce-scatter the payload is the full (unsharded) buffer; for all-reduce and broadcast, the
// tensor. On the wire a bandwidth-optimal algorithm moves (S-1)/S of that per rank for all-gather
// and reduce-scatter, and 2(S-1)/S for all-reduce.
struct CommCounters {
  int64_t all_gather_bytes = 0;
  int64_t reduce_scatter_bytes = 0;
  int64_t all_reduce_bytes = 0;
  int64_t broadcast_bytes = 0;
  int64_t calls = 0;
  int64_t total_bytes() const {
    return all_gather_bytes + reduce_scatter_bytes + all_reduce_bytes + broadcast_bytes;
  }
  CommCounters& operator+=(const CommCounters& o);
  CommCounters operator-(const CommCounters& o) const;
};

// One collective as issued on a group: what its errors and the desync check name.
struct CollectiveCall {
  int64_t sequence = 0;  // 1 for the group's first collective, then one more per call
  const char* op = "";   // "all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier"
  std::string what;      // the caller's name for the data, e.g. "unit 'blocks.3'"; may be empty
  int64_t numel = 0;     // elements of the full buffer: all-gather output, reduce-scatter input
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t root = -1;     // broadcast: the source's group rank
  // "all_gather of unit 'blocks.3' (4096 Float elements)": what the call is, without its number.
  std::string summary() const;
  // "collective #17 (unit 'blocks.3', 4096 Float elements)".
  std::string describe() const;
};

// Groups are not thread-safe: issue a group's collectives from one thread at a time (the engine
// does). Work handles may be waited on from any thread.
class Group {
 public:
  // `ranks`: the members' global ranks in group-rank order; `kind`: what the group is for, used
  // to label metrics ("world", "shard", "replicate").
  Group(std::vector<int64_t> ranks, int64_t rank, std::string kind);
  virtual ~Group() = default;
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int64_t rank() const { return rank_; }  // this process's rank in the group
  int64_t size() const { return static_cast<int64_t>(ranks_.size()); }
  const std::vector<int64_t>& ranks() const { return ranks_; }
  const std::string& kind() const { return kind_; }
  std::string describe() const;  // "shard group [0, 1, 2, 3]"

  // `what` names the data in errors and in the desync check (CollectiveCall::what), e.g.
  // "unit 'blocks.3'"; empty is fine.
  //
  // output (size() * n elements) <- every member's input (n elements), member i's at
  // [i*n, (i+1)*n).
  WorkHandle all_gather(at::Tensor output, at::Tensor input, std::string what = {});
  // output (n) <- sum over members of their input's chunk rank() (input has size() * n elements).
  WorkHandle reduce_scatter(at::Tensor output, at::Tensor input, std::string what = {});
  // tensor <- sum over members, in place. Starts only after `after` (if given) completed: this
  // chains a replicate-group all-reduce behind a shard-group reduce-scatter without blocking.
  WorkHandle all_reduce(at::Tensor tensor, WorkHandle after = nullptr, std::string what = {});
  // tensor <- the tensor of group rank `root`.
  WorkHandle broadcast(at::Tensor tensor, int64_t root, std::string what = {});
  // Returns when every member called it.
  void barrier();

  CommCounters counters() const;
  // Collectives issued on this group so far (the last one's CollectiveCall::sequence).
  int64_t sequence() const;

  // NOTE [collective check]: while on, every collective first publishes its CollectiveCall
  // (number, operation, `what`, size, dtype, root) in the rendezvous store and reads every
  // member's; if they differ, it throws fsdp::Error on every member, naming the first member
  // that differs from group rank 0 and both calls, instead of running a collective that would
  // hang, abort or, with equal sizes, exchange the wrong data. If a member does not publish its
  // call within the runtime's timeout, the error says which one. Every member must switch it on
  // at the same point of its collective order (FSDPStrategy::debug_collectives does, in
  // fsdp::shard). Costs a store round trip per member per collective (docs/concepts.md,
  // "Desynchronised ranks"). Groups without a store (one process) have nothing to compare and
  // ignore it.
  void set_debug_collectives(bool on);
  bool debug_collectives() const;

 protected:
  virtual WorkHandle run_all_gather(at::Tensor output, at::Tensor input,
                                    const CollectiveCall& call) = 0;
  virtual WorkHandle run_reduce_scatter(at::Tensor output, at::Tensor input,
                                        const CollectiveCall& call) = 0;
  virtual WorkHandle run_all_reduce(at::Tensor tensor, WorkHandle after,
                                    const CollectiveCall& call) = 0;
  virtual WorkHandle run_broadcast(at::Tensor tensor, int64_t root,
                                   const CollectiveCall& call) = 0;
  virtual void run_barrier(const CollectiveCall& call) = 0;
  // With debug_collectives on: compares `call` across the group (see above) before the run_*
  // hook runs. Default: nothing to compare with.
  virtual void check_call(const CollectiveCall& call);

 private:
  // Numbers the call and, with debug_collectives on, checks it (check_call).
  CollectiveCall next_call(const char* op, std::string what, const at::Tensor& buffer,
                           int64_t root = -1);
  std::vector<int64_t> ranks_;
  int64_t rank_;
  std::string kind_;
  struct Counters;
  std::shared_ptr<Counters> counters_;
};

// A finished Work, for operations that complete synchronously.
WorkHandle completed_work();

// The group of a one-process world: every collective is a local copy.
std::shared_ptr<Group> make_single_process_group(int64_t global_rank, std::string kind);

}  // namespace fsdp
