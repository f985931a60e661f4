// fsdp/planner.h: which strategy and mesh to use for a model on a cluster. plan_cluster() predicts,
// for every sharding strategy and every valid (replicate, shard) mesh, the memory per rank, the
// bytes per step on each class of link and the time per step (compute plus the communication the
// schedule cannot hide), then ranks the choices and says why the first one wins.
//
// The memory of parameters, gradients and optimizer state and the bytes per step are the topology
// report's (report.h): the same arithmetic fsdp-train --dry-run prints and the engine's counters
// measure, so they are exact for a model given as its units. Times come from the cost model
// (NOTE [planner cost model] in src/planner/cost_model.cpp; docs/planner.md, "The cost
// model"):
//   ring all-gather / reduce-scatter of S bytes over n ranks: (n-1) a + (n-1)/n * S / busbw
//   all-reduce: 2 (n-1) a + 2 (n-1)/n * S / busbw; busbw by message-size band and collective,
//   as nccl-tests reports it
//   compute: FLOPs per token (6N + attention, + recomputed forward) / (peak x achievable fraction)
//   update: shard parameters x optimizer bytes per parameter / memory bandwidth
// No libtorch beyond c10's dtype: the planner is cheap to build and runs in milliseconds.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/report.h"
#include "fsdp/strategy.h"
#include "fsdp/unit_info.h"

namespace fsdp {

// Activation checkpointing as the planner models it (Korthikanti et al. 2022, "Reducing Activation
// Recomputation in Large Transformer Models"): none keeps every activation, selective recomputes
// the attention core (softmax(QK^T) V), full keeps each block's input and recomputes its forward.
enum class Recompute { kNone, kSelective, kFull };
const char* to_string(Recompute r);       // "none", "selective", "full"
Recompute parse_recompute(const std::string& text);

// A decoder-only transformer. Either the shape alone (parameters derived from it: attention
// q/k/v/o, an MLP of two matrices or three when gated, norms, token embedding, optional learned
// positions, head), or `units` with the exact parameter counts of every FSDP unit (root first,
// e.g. from fsdp::plan_units on a real model), which then override the derived counts.
struct ModelSpec {
  std::string name = "model";
  int64_t layers = 0;        // transformer blocks, one FSDP unit each
  int64_t hidden = 0;        // d_model
  int64_t heads = 0;         // attention heads
  int64_t kv_heads = 0;      // key/value heads (grouped-query attention); 0 = heads
  int64_t ffn_hidden = 0;    // MLP width; 0 = 4 x hidden
  int64_t vocab = 0;
  int64_t seq_len = 0;       // tokens per sequence
  int64_t positions = 0;     // learned position embeddings (GPT-2 style); 0 = none (rotary)
  bool gated_mlp = false;    // SwiGLU (Llama): three MLP matrices instead of two
  bool biases = false;       // linear layers and norms with biases (GPT-2 style)
  bool tied_embeddings = false;  // the head reuses the token embedding
  // Attention scores kept for backward (the 5as/h term of Korthikanti's formula). False for fused
  // (flash) attention, which recomputes them.
  bool stores_attention_scores = true;
  std::vector<UnitInfo> units;  // exact units (numel, frozen_numel); empty: derived from the shape

  // Units with their trainable/frozen counts, root first (shard counts not set).
  std::vector<UnitInfo> unit_counts() const;
  int64_t parameters() const;
  // Training FLOPs per token: 6 x matmul parameters + 12 x layers x hidden x seq (attention),
  // plus the recomputed forward (full: 2N + 4 L h s; selective: 4 L h s).
  double flops_per_token(Recompute r) const;
  // Throws fsdp::Error for a shape that cannot be planned (a size < 1, heads not dividing hidden).
  void validate() const;
};

// Named model shapes: fsdp-train's tiny/small/medium and Llama 2 / 3 shapes for the published
// comparisons (see docs/planner-published.md).
std::vector<std::string> model_preset_names();
ModelSpec model_preset(const std::string& name);  // throws fsdp::Error listing the names

// The collectives the engine issues, each with its own bandwidth where a link gives one.
enum class Collective { kAllGather, kReduceScatter, kAllReduce };

// One link class. Bus bandwidth (nccl-tests' busbw: algbw x (n-1)/n for all-gather and
// reduce-scatter, x 2(n-1)/n for all-reduce) by message size: below the first band's size the
// first band's value, above the last the last's, log-linear in between. `latency_s` is the cost
// of one ring step. Like nccl-tests, each collective may have its own busbw: on a CPU a
// reduce-scatter also sums (and allocates its ring buffers) where an all-gather only copies, and
// Gloo's all-reduce is its own algorithm; an empty list takes `bands`.
struct BandwidthBand {
  int64_t bytes = 0;    // message size (the whole buffer: gathered, or reduced)
  double busbw = 0;     // bytes per second
};
struct LinkSpec {
  double latency_s = 0;
  std::vector<BandwidthBand> bands;                 // all-gather, and the default
  std::vector<BandwidthBand> reduce_scatter_bands;  // empty: bands
  std::vector<BandwidthBand> all_reduce_bands;      // empty: bands
  const std::vector<BandwidthBand>& bands_of(Collective c) const;
  double busbw_at(int64_t bytes, Collective c = Collective::kAllGather) const;
};

// A cluster of identical nodes. Inter-node bandwidth is per NIC: a group with m of its ranks on
// each node shares the node's NICs with the node's other groups, so it gets
// nics_per_node x m / ranks_per_node of them (a replicate group with one rank per node: one NIC;
// a shard ring spanning whole nodes: all of them), never more than the intra-node busbw.
struct ClusterSpec {
  std::string name = "cluster";
  std::string description;
  int64_t nodes = 1;
  int64_t ranks_per_node = 1;
  int64_t memory_bytes = 0;    // per rank
  int64_t reserve_bytes = 0;   // per rank, held by the runtime (context, communicator buffers,
                               // allocator fragmentation); subtracted before anything fits
  double peak_flops = 0;       // per rank, in the compute dtype
  double flops_fraction = 0;   // achievable fraction of peak_flops (calibrated or assumed)
  // Bytes per second one rank's streaming element-wise kernels reach (the optimizer step over
  // its shard: update_bytes_per_parameter); per core with node_shared, shared like peak_flops.
  double memory_bandwidth = 0;
  LinkSpec intra;              // between ranks of one node, per rank
  LinkSpec inter;              // between nodes, per NIC
  int64_t nics_per_node = 1;
  // A CPU machine: memory_bytes is the node's, shared by its ranks, and peak_flops is one core's;
  // a rank gets min(1, cores / ranks_per_node) cores (one thread per rank).
  bool node_shared = false;
  int64_t cores = 0;
  // node_shared: the ranks per node the links were measured with (0: ranks_per_node).
  int64_t comm_ranks_per_node = 0;
  // node_shared: how many times their benchmarked time the collectives take inside a training
  // step at that density (ranks reach them at different moments when cores are shared);
  // measured by fsdp-plan --calibrate from one training run; 0: not measured, taken as 1.
  double comm_contention = 0;
  int64_t rank_memory() const { return node_shared ? memory_bytes / ranks_per_node : memory_bytes; }
  double rank_flops() const;  // achievable FLOP/s of one rank
  double rank_memory_bandwidth() const;  // memory_bandwidth one rank gets
  // node_shared: how much of the collectives' time a step waits for (NOTE [planner cost
  // model]): 0 with a spare core (they overlap as scheduled); with r >= 1 ranks per core
  // k r / m for links measured at m ranks per core (m at least 1) and k = comm_contention;
  // k when the cores are unknown. 0 if not node_shared.
  double shared_comm_exposure() const;
  std::map<std::string, std::string> sources;  // field -> where its number comes from
  int64_t world_size() const { return nodes * ranks_per_node; }
  void validate() const;       // throws fsdp::Error naming the field, the value and the fix
};

// Presets are src/planner/clusters.json (each number with its source), built into the library.
std::vector<std::string> cluster_preset_names();
ClusterSpec cluster_preset(const std::string& name);  // throws fsdp::Error listing the names
// A cluster file (the same JSON as one preset). Throws fsdp::Error naming the file and the
// problem in one line.
ClusterSpec read_cluster_file(const std::string& path);
ClusterSpec parse_cluster_json(const std::string& text, const std::string& origin);
std::string cluster_to_json(const ClusterSpec& c);
// A preset name, or else a path to a cluster file.
ClusterSpec load_cluster(const std::string& name_or_path);
// Where `fsdp-plan --calibrate` writes this machine's measured cluster file and where
// `fsdp-train --plan` looks for it: $FSDP_CLUSTER_FILE if set, else
// $HOME/.config/fsdp/this-machine.json.
std::string calibrated_cluster_path();
// This machine: the calibrated file if it exists, else the "this-machine" preset.
ClusterSpec this_machine_cluster();

struct PlanOptions {
  int64_t micro_batch = 1;   // sequences per rank per micro-step
  int64_t grad_accum = 1;    // micro-steps per optimizer step
  c10::ScalarType param_dtype = c10::kFloat;   // gathered parameters, compute, activations
  c10::ScalarType reduce_dtype = c10::kFloat;  // gradient reduction
  int64_t optimizer_states = 2;  // fp32 states per parameter: AdamW 2, SGD with momentum 1
  Recompute recompute = Recompute::kNone;
  GradSync grad_sync = GradSync::kEveryMicroStep;
  bool prefetch = true;
  bool clip = false;          // clip_grad_norm each step (one 8-byte all-reduce)
  // Candidates to consider: empty = every strategy and every mesh.
  std::vector<ShardingStrategy> strategies;
  std::vector<int64_t> mesh;  // e.g. {-1, 8}: only this mesh (one dim may be -1)
  void validate() const;
};

// Memory per rank, bytes. states: the report's (exact); the rest estimates.
struct PlanMemory {
  int64_t params = 0, grads = 0, optimizer = 0;  // sharded state (TopologyReport::sharded)
  int64_t gathered_params = 0;   // unsharded parameters at peak (report's estimate)
  int64_t grad_buffers = 0;      // one unsharded gradient being reduced (largest unit)
  int64_t activations = 0;       // Korthikanti et al., for the micro-batch and recompute mode
  int64_t reserve = 0;           // ClusterSpec::reserve_bytes
  int64_t states() const { return params + grads + optimizer; }
  int64_t total() const { return states() + gathered_params + grad_buffers + activations + reserve; }
};

// Time per optimizer step, seconds.
struct PlanTime {
  double compute = 0;        // every micro-step's forward and backward at the achievable rate
  double communication = 0;  // every collective back to back (what overlap has to hide)
  double exposed = 0;        // step - compute - update: waiting on communication
  // After the last reduction: the optimizer step, gradient clipping and the gradient's averaging
  // over this rank's shard (update_bytes_per_parameter at ClusterSpec::memory_bandwidth).
  double update = 0;
  double step = 0;
  double exposed_fraction() const { return step > 0 ? exposed / step : 0; }
};

struct PlanCandidate {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  int64_t replicate = 1, shard = 1;
  std::string excluded;           // non-empty: not a candidate, and why
  StepComm comm;                  // payload bytes per step per rank (report.h, exact)
  int64_t intra_bytes = 0, inter_bytes = 0;  // bytes each rank sends per step, by link class
  bool shard_crosses_nodes = false, replicate_crosses_nodes = false;
  PlanMemory memory;
  int64_t capacity = 0;           // ClusterSpec::memory_bytes
  bool fits = false;
  PlanTime time;
  double tokens_per_s = 0;        // per rank
  std::string reason;             // one line: why it ranks where it does
  std::string mesh_string() const;  // "(16, 8)"
  std::string label() const;        // "HYBRID_SHARD (16, 8)"
};

struct ClusterPlan {
  ModelSpec model;
  ClusterSpec cluster;
  PlanOptions options;
  std::vector<PlanCandidate> ranked;    // fitting ones by step time, then those that do not fit
  std::vector<PlanCandidate> excluded;  // meshes that are not candidates, with the reason
  std::string recommendation;           // "HYBRID_SHARD (16, 8): ..." or why nothing fits
  // Marks `label` (e.g. the configuration a run uses) in the table with '*'.
  std::string to_text(const std::string& marked = "") const;
  std::string to_json() const;
  // A gnuplot script drawing `png`: step time (compute + exposed communication) and memory per
  // rank against the capacity, for every candidate (fsdp-plan --chart runs it).
  std::string chart_script(const std::string& png) const;
  const PlanCandidate* find(ShardingStrategy s, int64_t replicate, int64_t shard) const;
};

// Predicts every candidate and ranks them. Throws fsdp::Error for invalid input (one line).
ClusterPlan plan_cluster(const ModelSpec& model, const ClusterSpec& cluster,
                         const PlanOptions& options = {});

// The cost of one candidate, without ranking (what plan_cluster does for each).
PlanCandidate evaluate_candidate(const ModelSpec& model, const ClusterSpec& cluster,
                                 const PlanOptions& options, ShardingStrategy strategy,
                                 int64_t replicate, int64_t shard);

// Collective times on one link (ring algorithms; n ranks; `bytes` the whole buffer; busbw the
// collective's own, LinkSpec::busbw_at):
//   all_gather / reduce_scatter: (n-1) latency + (n-1)/n * bytes / busbw(bytes)
//   all_reduce: 2 (n-1) latency + 2 (n-1)/n * bytes / busbw(bytes)
double all_gather_time(const LinkSpec& link, int64_t n, int64_t bytes, double bandwidth_scale = 1);
double reduce_scatter_time(const LinkSpec& link, int64_t n, int64_t bytes,
                           double bandwidth_scale = 1);
double all_reduce_time(const LinkSpec& link, int64_t n, int64_t bytes, double bandwidth_scale = 1);

// Bytes an optimizer step moves per parameter of a rank's shard, as libtorch's (unfused)
// optimizers run it in fp32: AdamW (2 states) 22 reads and writes of 4 bytes: decay p, the two
// moments' mul_ and add_/addcmul_, the denominator's sqrt, division and epsilon into
// temporaries, addcdiv_ into p; SGD with momentum (1 state) 8; plain SGD (0) 3. Clipping adds 3
// (the norm's read, the scaling) and a gradient averaged over more than one rank 2 (its
// division after the reduction).
double update_bytes_per_parameter(int64_t optimizer_states, bool clip, bool averaged);

// Activation bytes per rank for one micro-batch (Korthikanti et al. 2022, eq. for a layer:
// s b h (34 + 5 a s / h) with 16-bit activations; 4-byte activations double it), plus the logits.
int64_t activation_bytes(const ModelSpec& model, int64_t micro_batch, Recompute recompute,
                         c10::ScalarType dtype);

// The published runs the planner is checked against (docs/planner-published.md): a markdown
// document, regenerated by `fsdp-plan --published` and compared with docs/ by a test.
std::string published_comparison();

}  // namespace fsdp
