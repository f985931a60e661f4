// engine.h (internal): the sharding engine behind fsdp::ShardedModule. See fsdp/sharded.h for
// the contract and NOTE [intercepting forward] / [gradient averaging].
//
// Per unit, per step (S = shard group size, R = replicate group size):
//   forward:  all-gather the fp32 (or cast) shard into `full` -> module parameters are views of
//             it -> run -> free `full`'s storage (FULL_SHARD / HYBRID_SHARD; the root stays)
//   backward: output hook: gather again, point parameter grads at views of `flat_grad`
//             AccumulateGrad post-hooks: when the unit's last gradient landed, free `full`,
//             reduce-scatter `flat_grad` (shard group) -> all-reduce the shard (replicate group)
//   end of backward (autograd final callback): wait for the reductions, divide by R*S, add to
//             the shard's .grad, free everything still gathered.
// Units run their collectives asynchronously; the next unit's all-gather is issued while the
// current one computes (prefetch), so at most two non-root units are gathered at once.
//
// NOTE [threads]: which thread runs what, and what each touches.
//   - Forward hooks (root_pre_forward, pre_forward, post_forward, root_post_forward,
//     root_abort_forward) run on the thread that calls the model's forward.
//   - Backward hooks (pre_backward, on_grad_ready, on_input_grad_ready) and finalize_backward
//     (autograd's final callback) run on the thread autograd runs that backward on: for CPU
//     tensors the thread that called backward(); for CUDA tensors autograd's worker thread of the
//     device, one per device, so the hooks of one backward still run one at a time, in graph
//     order, while the calling thread blocks in backward() until the callback has run.
//   - Hence every UnitState field, the buffer pool and the Engine's plain members (in_forward_,
//     callback_queued_, sync_, ...) are used by one thread at a time, handed over through
//     autograd's queue and the caller's wait (happens-before), without locks. A model must not
//     run forward or backward from two threads at once (true of any torch::nn::Module).
//   - MemoryTracker's counters are the one thing read from elsewhere: memory_stats() may be
//     called from another thread (a monitor) while a step runs, so they are atomics; such a read
//     is a moment's value, exact between steps.
//   - c10d completes work on its own threads; the engine only waits on WorkHandles. The
//     AsyncCheckpointer's writer thread reads its staging buffer only, never the engine.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/trace_sink.h"
#include "engine/buffer_pool.h"
#include "engine/device_streams.h"
#include "engine/flat_view.h"
#include "fsdp/sharded.h"

namespace fsdp::detail {

// Bytes of unsharded buffers (gathered parameters, unsharded gradients) alive now, and the peak.
class MemoryTracker {
 public:
  void add(int64_t bytes);
  void sub(int64_t bytes);
  int64_t now() const { return now_; }
  int64_t peak() const { return peak_; }
  void reset_peak() { peak_ = now_.load(); }

 private:
  std::atomic<int64_t> now_{0}, peak_{0};
};

// "(root)" for the root unit's empty path.
std::string display(const std::string& unit_name);

// A tensor's bytes as the engine's signed counters hold them.
inline int64_t bytes_of(const at::Tensor& t) { return static_cast<int64_t>(t.nbytes()); }

struct ParamSlot {
  std::string name;                 // first name in the model
  std::vector<std::string> aliases; // further names of the same tensor (tied weights)
  at::Tensor param;                 // the module's parameter; its data is a view of `full`
  int64_t offset = 0;
  int64_t numel = 0;
  std::vector<int64_t> shape;
  c10::ScalarType original_dtype = c10::kFloat;
  std::shared_ptr<torch::autograd::Node> grad_acc;  // kept alive: it carries our post-hook
};

enum class Phase { kSharded, kGathering, kUnsharded };

struct PendingReduce {
  WorkHandle rs, ar;
  at::Tensor input;             // unsharded gradient under reduce-scatter; dropped once done
  int64_t input_bytes = 0;
  at::Tensor output;            // the reduced shard (reduce dtype)
  bool replicate_deferred = false;  // replicate_on_last inside no_sync: accumulate, no all-reduce
};

struct UnitState {
  Engine* engine = nullptr;
  int64_t index = 0;            // 0 is the root
  std::string name;             // module path, "" for the root
  torch::nn::Module* module = nullptr;
  UnitHooks* hooks = nullptr;   // fsdp::Unit<M> units
  std::vector<ParamSlot> params;
  int64_t numel = 0, padded = 0, shard_numel = 0;
  bool trainable = true;
  at::Tensor shard;             // fp32 [n]: the optimizer's parameter
  at::Tensor full;              // param dtype [S*n]; storage freed while sharded
  bool aliased = false;         // S == 1 in fp32: `full` is `shard`, nothing to gather or free
  Phase phase = Phase::kSharded;
  WorkHandle gather;
  at::Tensor gather_src;        // the cast shard under all-gather (mixed precision)
  at::Tensor flat_grad;         // param dtype [S*n], from pre-backward to reduction
  at::Tensor partial;           // reduce dtype [n], replicate_on_last between micro-steps
  at::Tensor grad_shell;        // the next reduce output's tensor, memory-less (NOTE [gradient shells])
  int64_t grads_pending = 0;
  bool pre_backward_done = false;
  bool post_backward_done = false;
  std::optional<PendingReduce> pending;
  bool checkpointed = false;     // activation checkpointing policy selects it
  bool checkpoint_checked = false;  // its first recorded forward checked its outputs
  // NOTE [frozen parameters]: a unit's frozen parameters live in a second UnitState, `frozen`,
  // gathered and freed with this one, but freed in backward only when inputs_pending (the
  // unit's tensor arguments whose gradients are still to come) reached 0.
  UnitState* frozen = nullptr;  // the frozen flat of this unit, if it has frozen parameters
  UnitState* owner = nullptr;   // for a frozen flat: its unit
  int64_t inputs_pending = 0;
  // Trace (fsdp/trace.h): when this unit's open forward / backward event began; -1 none open.
  int64_t forward_start_ns = -1, backward_start_ns = -1;
  int64_t forward_faults = 0, backward_faults = 0;  // the thread's minor faults at those starts
};

// How collectives name a flat (CollectiveCall::what): "unit 'blocks.3'", "unit '(root)'", and
// "unit 'blocks.3' (frozen parameters)" for a unit's frozen flat.
inline std::string collective_label(const UnitState& u) {
  return "unit '" + display(u.name) + (u.owner ? "' (frozen parameters)" : "'");
}

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  Engine(std::shared_ptr<torch::nn::Module> root, FSDPStrategy strategy,
         std::shared_ptr<Runtime> runtime);
  ~Engine();
  // Validates, creates the mesh, flattens and shards, installs hooks. Needs shared_from_this.
  void build();

  void root_pre_forward();
  void root_abort_forward();
  void root_post_forward(const std::vector<at::Tensor>& outputs);
  void pre_forward(UnitState& u);
  void post_forward(UnitState& u, const std::vector<at::Tensor>& outputs);
  void pre_backward(UnitState& u);
  void on_grad_ready(UnitState& u, ParamSlot& slot);
  bool tracks_inputs(const UnitState& u) const;
  void track_inputs(UnitState& u, const std::vector<at::Tensor>& inputs);
  void on_input_grad_ready(UnitState& u);
  void finalize_backward();
  at::Tensor cast_input(const at::Tensor& t) const;
  std::optional<ActivationCheckpointOptions> checkpoint_options(UnitState& u);

  std::vector<at::Tensor> parameters() const;
  void check_optimizer(const torch::optim::Optimizer& optimizer) const;
  int64_t trainable_numel() const;
  int64_t total_numel() const;
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const;
  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }
  double clip_grad_norm(double max_norm);
  torch::OrderedDict<std::string, at::Tensor> state_dict();
  void load_state_dict(const torch::OrderedDict<std::string, at::Tensor>& dict);
  void summon(bool on);
  MemoryStats memory_stats(const torch::optim::Optimizer* optimizer) const;
  void reset_peak_memory() {
    tracker_.reset_peak();
    pool_.reset_peak();
  }
  std::vector<std::pair<std::string, CommCounters>> comm_counters() const;

  const ShardingPlan& plan() const { return plan_; }
  const std::vector<UnitInfo>& units() const { return infos_; }
  const std::shared_ptr<Runtime>& runtime() const { return runtime_; }
  const std::shared_ptr<DeviceMesh>& mesh() const { return mesh_; }
  c10::ScalarType param_dtype() const { return param_dtype_; }
  // Whether some units were built under DeferredInit (NOTE [deferred init]): no rank ever held
  // the whole model, so whole-model reads (a .pt import) are refused.
  bool built_deferred() const { return built_deferred_; }
  // For checkpoints: the module, the groups and this rank's place in them.
  torch::nn::Module& root_module() const { return *root_; }
  const std::shared_ptr<Group>& shard_group() const { return shard_group_; }
  const std::shared_ptr<Group>& replicate_group() const { return replicate_group_; }
  // Frees every gathered copy (after the shards were overwritten: the copies are stale).
  void drop_gathered() {
    for (auto& u : units_) reshard(*u);
  }
  // The unit states, root first; after the units, one state per unit with frozen parameters
  // (UnitState::owner says whose). Every state is a flat sharded tensor with named slots.
  const std::vector<std::unique_ptr<UnitState>>& unit_states() const { return units_; }
  // NOTE [flat view]: code outside the engine (checkpoints, exports) reads the flats through
  // flat_views() — layouts and shards, read only, in unit_states() order — and overwrites shards
  // only with replace_shards(), so that what the engine keeps consistent (gathered copies, the
  // optimizer's parameters, views of `full`) stays the engine's business.
  std::vector<FlatView> flat_views() const;
  // Copies `shards` (flat_views() order, fp32 [shard_numel] each, any device) into the flats'
  // shards in place — the optimizer's parameters stay the same tensors — and frees the gathered
  // copies, now stale.
  void replace_shards(const std::vector<at::Tensor>& shards);

 private:
  using ModuleMap = std::map<std::string, std::shared_ptr<torch::nn::Module>>;  // by path
  // build()'s steps, in order (engine_build.cpp).
  int64_t check_and_agree();
  void make_groups();
  ModuleMap make_units();
  void shard_units(const ModuleMap& by_path, int64_t deferred_units);
  std::unique_ptr<UnitState> make_flat(const UnitInfo& info, bool trainable, const ModuleMap& modules,
                                       const std::map<std::string, at::Tensor>& params_by_name);
  void check_requires_grad() const;
  void release_frozen(UnitState& u);
  // `presharded`: this rank's shard built under DeferredInit (NOTE [deferred init]), or undefined
  // to flatten the module's parameters and slice them here.
  void flatten_and_shard(UnitState& u, bool broadcast, const at::Tensor& presharded);
  void install_hooks(UnitState& u, const ModuleMap& modules);
  void wrap_sequential_child(UnitState& u, const ModuleMap& modules);
  void select_checkpointed_units(const ModuleMap& modules);
  void unshard(UnitState& u);
  void wait_unshard(UnitState& u);
  void reshard(UnitState& u);
  void prepare_grads(UnitState& u);
  void post_backward(UnitState& u);
  void reduce_grad(UnitState& u);
  void complete_reduce(UnitState& u);
  void settle_finished_reduces();
  void release_reduce_input(PendingReduce& p);  // its reduce-scatter is done
  UnitState* unit_after_in_forward(int64_t position) const;
  UnitState* unit_before_in_forward(const UnitState& u) const;
  void alloc_storage(at::Tensor& t);
  void free_storage(at::Tensor& t);

  std::shared_ptr<torch::nn::Module> root_;
  FSDPStrategy strategy_;
  std::shared_ptr<Runtime> runtime_;
  ShardingPlan plan_;
  std::shared_ptr<DeviceMesh> mesh_;
  std::shared_ptr<Group> shard_group_, replicate_group_;
  int64_t S_ = 1, R_ = 1, shard_rank_ = 0;
  c10::ScalarType param_dtype_ = c10::kFloat, reduce_dtype_ = c10::kFloat;
  double pre_divide_ = 1.0, post_divide_ = 1.0;
  std::vector<std::unique_ptr<UnitState>> units_;
  std::vector<UnitInfo> infos_;
  std::vector<int64_t> order_;       // units (not the root) in this forward's order
  std::vector<int64_t> prev_order_;  // the last completed forward's order
  bool in_forward_ = false;
  bool callback_queued_ = false;
  bool sync_ = true;
  bool built_deferred_ = false;
  int summoned_ = 0;
  MemoryTracker tracker_;
  // NOTE [unit events]: the runtime's trace slot (fsdp/trace.h), and the non-root unit whose
  // backward event is open: a unit's backward event ends at its post-backward or when the next
  // unit's backward begins, whichever is first (autograd may start the next unit before the
  // last gradient of this one arrives), so that one thread's events nest and never overlap.
  TraceSlot* trace_ = nullptr;
  UnitState* open_backward_ = nullptr;
  void trace_begin(int64_t& start, int64_t& faults) const;
  void trace_end(const char* what, UnitState& u, int64_t& start, int64_t faults);
  BufferPool pool_;      // NOTE [buffer pool]: gathered flats and unsharded gradients
  // NOTE [gradient pool]
  // The reduce-scatter's outputs become the shards' .grad, which the training loop frees
  // (zero_grad) before the next backward makes new ones: as mallocs of this size each was a
  // fresh mmap, page-faulted in every step (GPT-2, FULL_SHARD: ~190 MiB a step at W = 2). Their
  // own pool (not pool_: these outlive the step, and pool_'s peak is the step's working set)
  // hands the next backward the mappings the previous step's gradients used.
  BufferPool grad_pool_;
  // NOTE [gradient shells]
  // A reduced gradient is a new tensor each step, and its small objects (TensorImpl, version
  // counter, StorageImpl: ~300 bytes) outlive the step. Made in the backward, malloc carved them
  // out of the memory the backward had just freed, one every 2-6 MiB, and AdamW's state (made
  // next, blocks of a whole shard) no longer fit in the pieces: the first optimizer step grew
  // the heap instead (W = 8, 16 blocks of d 768, --heap unchanged: docs/performance.md,
  // "Construction's heap"). So the root's pre-forward makes each unit's next gradient tensor
  // (fp32, as .grad is) empty (BufferPool::shell), before the forward's activations exist, and
  // the reduce gives it its pooled memory (BufferPool::fill): reduce_grad as the reduce-scatter's
  // output, or with a bf16/fp16 reduce complete_reduce, as the fp32 copy of it (the low-precision
  // output is then a temporary). CPU runtimes with sharded gradients only.
  void make_grad_shells();
  at::Tensor take_grad_shell(UnitState& u);  // the unit's shell, given its pooled memory
  bool pooled_ = false;  // CPU runtime: the engine's large buffers come from pool_ / grad_pool_
  // A 1-D buffer of the engine's (pool_ on CPU, the device's allocator elsewhere).
  at::Tensor empty_buffer(int64_t numel, c10::ScalarType dtype);
  DeviceStreams streams_{c10::Device(c10::kCPU)};  // NOTE [CUDA streams]
  struct SequentialSwap {
    torch::nn::SequentialImpl* seq;
    size_t index;
    torch::nn::AnyModule original;
  };
  std::vector<SequentialSwap> swaps_;
};

}  // namespace fsdp::detail
