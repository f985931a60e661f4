// fsdp/collectives.h: the communication interface the sharding engine talks to.
//
// A Group is a set of ranks that run collectives together: the world, one shard group or one
// replicate group of a DeviceMesh. The engine never sees c10d or Gloo; make_group() in
// runtime.h builds Groups on c10d (Gloo on CPU, NCCL on CUDA), make_single_process_group() a
// trivial one for a world of one process.
//
// NOTE [collective contract]
// - Every member must issue the same collectives on a group in the same order, with tensors of
//   the same sizes and dtypes. A rank that skips one makes the others wait until the timeout.
// - Calls return at once with a Work handle. Inputs must stay unmodified and outputs unread until
//   wait() returns; wait() rethrows the collective's failure (a dead peer, a timeout) as
//   fsdp::Error naming the operation and the group.
// - Collectives on one group run one at a time, in issue order. Collectives on different groups
//   (a shard group and a replicate group) run concurrently.
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
// groups default to rings; NCCL groups use NCCL's. See bench_collectives and README Performance.
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

  // output (size() * n elements) <- every member's input (n elements), member i's at [i*n, (i+1)*n).
  WorkHandle all_gather(at::Tensor output, at::Tensor input);
  // output (n) <- sum over members of their input's chunk rank() (input has size() * n elements).
  WorkHandle reduce_scatter(at::Tensor output, at::Tensor input);
  // tensor <- sum over members, in place. Starts only after `after` (if given) completed: this
  // chains a replicate-group all-reduce behind a shard-group reduce-scatter without blocking.
  WorkHandle all_reduce(at::Tensor tensor, WorkHandle after = nullptr);
  // tensor <- the tensor of group rank `root`.
  WorkHandle broadcast(at::Tensor tensor, int64_t root);
  // Returns when every member called it.
  void barrier();

  CommCounters counters() const;

 protected:
  virtual WorkHandle run_all_gather(at::Tensor output, at::Tensor input) = 0;
  virtual WorkHandle run_reduce_scatter(at::Tensor output, at::Tensor input) = 0;
  virtual WorkHandle run_all_reduce(at::Tensor tensor, WorkHandle after) = 0;
  virtual WorkHandle run_broadcast(at::Tensor tensor, int64_t root) = 0;
  virtual void run_barrier() = 0;

 private:
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
