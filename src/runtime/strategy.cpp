// Strategy options, parsing and validation (see fsdp/strategy.h).
#include "fsdp/strategy.h"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cctype>
#include <set>

#include "fsdp/error.h"
#include "fsdp/runtime.h"
#include "runtime/strategy_internal.h"
#include "fsdp/parse_enum.h"

namespace fsdp {

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardZero2: return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

ShardingStrategy parse_sharding_strategy(const std::string& text) {
  return parse_enum(text,
                    {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                     ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
                     ShardingStrategy::kHybridShardZero2},
                    "sharding strategy", Spelling::kLoose);
}

bool is_hybrid(ShardingStrategy s) {
  return s == ShardingStrategy::kHybridShard || s == ShardingStrategy::kHybridShardZero2;
}

bool reshards_after_forward(ShardingStrategy s) {
  return s == ShardingStrategy::kFullShard || s == ShardingStrategy::kHybridShard;
}

const char* to_string(GradSync g) {
  switch (g) {
    case GradSync::kEveryMicroStep: return "every";
    case GradSync::kLocal: return "local";
    case GradSync::kReplicateOnLast: return "replicate_on_last";
  }
  return "?";
}

GradSync parse_grad_sync(const std::string& text) {
  return parse_enum(text,
                    {GradSync::kEveryMicroStep, GradSync::kLocal, GradSync::kReplicateOnLast},
                    "gradient sync mode", Spelling::kLoose);
}

const char* to_string(StateDictType t) {
  return t == StateDictType::kFull ? "full" : "sharded";
}

std::string MixedPrecision::describe() const {
  auto name = [](const std::optional<c10::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("Float");
  };
  return "param=" + name(param_dtype) + ",reduce=" + name(reduce_dtype ? reduce_dtype : param_dtype);
}

std::string WrapPolicy::demangle(const char* name) { return c10::demangle(name); }

WrapPolicy WrapPolicy::units() {
  WrapPolicy p;
  p.name_ = "units";
  p.sequential_ = false;
  return p;
}

WrapPolicy WrapPolicy::min_params(int64_t n) {
  FSDP_CHECK(n >= 1, "min_params ", n, " is invalid; use a positive parameter count");
  WrapPolicy p;
  p.name_ = detail::cat("min_params(", n, ")");
  p.min_params_ = n;
  return p;
}

bool WrapPolicy::selects(const torch::nn::Module& module, int64_t numel) const {
  if (match_) return match_(module);
  if (min_params_ > 0) return numel >= min_params_;
  return true;  // units(): every candidate (the caller only offers Unit<M> members)
}

CheckpointPolicy CheckpointPolicy::none() { return CheckpointPolicy(); }

CheckpointPolicy CheckpointPolicy::all_units() {
  CheckpointPolicy p;
  p.name_ = "all_units";
  p.all_ = true;
  return p;
}

FSDPStrategy& FSDPStrategy::sharding_strategy(const std::string& name) {
  sharding_strategy_ = parse_sharding_strategy(name);
  return *this;
}

FSDPStrategy& FSDPStrategy::device_mesh(std::vector<int64_t> shape) {
  mesh_shape_ = std::move(shape);
  mesh_.reset();
  return *this;
}

FSDPStrategy& FSDPStrategy::device_mesh(std::shared_ptr<DeviceMesh> mesh) {
  mesh_ = std::move(mesh);
  mesh_shape_ = mesh_ ? mesh_->layout().shape() : std::vector<int64_t>{};
  return *this;
}

std::string FSDPStrategy::describe() const {
  return detail::cat("strategy=", to_string(sharding_strategy_),
                     " mesh=", mesh_shape_.empty() ? "default" : MeshLayout::shape_string(mesh_shape_),
                     " backend=", to_string(runtime_.backend), " timeout_ms=", runtime_.timeout.count(),
                     " precision=", mixed_precision_.describe(),
                     " wrap=", auto_wrap_policy_.name(),
                     " prefetch=", forward_prefetch_ ? "f" : "-", backward_prefetch_ ? "b" : "-",
                     " grad_sync=", to_string(grad_sync_),
                     " state_dict=", to_string(state_dict_type_),
                     " sync_states=", sync_module_states_,
                     " activation_checkpointing=", activation_checkpointing_.name(),
                     // Only when on: the line is also in checkpoints' settings, compared on resume.
                     debug_collectives_ ? " debug_collectives=on" : "");
}

std::vector<int64_t> parse_mesh_shape(const std::string& text) {
  std::string t;
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) t += c;
  }
  if (t.size() >= 2 && t.front() == '(' && t.back() == ')') t = t.substr(1, t.size() - 2);
  std::vector<int64_t> shape;
  size_t start = 0;
  while (true) {
    size_t end = t.find(',', start);
    std::string item = t.substr(start, end == std::string::npos ? std::string::npos : end - start);
    size_t used = 0;
    long long v = 0;
    bool ok = !item.empty();
    if (ok) {
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        ok = false;
      }
    }
    FSDP_CHECK(ok && used == item.size(), "mesh '", text,
               "' does not parse; write sizes separated by commas, e.g. 2,4 or -1,4");
    shape.push_back(v);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return shape;
}

ShardingPlan plan_sharding(const FSDPStrategy& s, int64_t world_size, int64_t local_world_size) {
  FSDP_CHECK(world_size >= 1, "world size ", world_size, " is invalid");
  FSDP_CHECK(local_world_size >= 1 && world_size % local_world_size == 0, "ranks per node ",
             local_world_size, " must divide the world size ", world_size);
  const ShardingStrategy strategy = s.sharding_strategy();
  const char* name = to_string(strategy);
  ShardingPlan plan;
  plan.strategy = strategy;
  plan.reshard_after_forward = reshards_after_forward(strategy);

  const auto& mp = s.mixed_precision();
  for (const auto& t : {mp.param_dtype, mp.reduce_dtype}) {
    FSDP_CHECK(!t || *t == c10::kFloat || *t == c10::kBFloat16 || *t == c10::kHalf ||
                   *t == c10::kDouble,
               "mixed precision dtype ", c10::toString(*t),
               " is not a floating-point compute type; use bf16, fp16 or fp32");
  }
  FSDP_CHECK(s.grad_sync() != GradSync::kReplicateOnLast || is_hybrid(strategy),
             "grad_sync replicate_on_last needs a hybrid strategy (HYBRID_SHARD or "
             "HYBRID_SHARD_ZERO2) but the strategy is ", name, "; use every or local");

  std::vector<int64_t> shape = s.device_mesh();
  std::optional<MeshLayout> given;
  if (s.device_mesh_object()) {
    given = s.device_mesh_object()->layout();
    FSDP_CHECK(given->numel() == world_size, "device_mesh ", given->shape_string(), " has ",
               given->numel(), " ranks but the world has ", world_size, " processes");
  } else if (!shape.empty()) {
    given = MeshLayout::resolve(shape, world_size);
  }

  if (is_hybrid(strategy)) {
    if (!given) {
      // Shard inside a node, replicate across nodes.
      given = MeshLayout::resolve({world_size / local_world_size, local_world_size}, world_size);
    }
    FSDP_CHECK(given->ndim() == 2, name, " needs a 2-D device_mesh (replicate, shard) but got ",
               given->shape_string(), "; use (1, ", world_size, ") to shard over all ranks ",
               "(that is FULL_SHARD), or e.g. (-1, ", local_world_size, ") to shard inside nodes");
    plan.layout = *given;
  } else if (strategy == ShardingStrategy::kNoShard) {
    FSDP_CHECK(!given || given->ndim() == 1, "NO_SHARD replicates over every rank, so a 2-D "
               "device_mesh ", given ? given->shape_string() : "", " means nothing to it; drop "
               "device_mesh, or use HYBRID_SHARD to shard within groups");
    plan.layout = MeshLayout::resolve({world_size, 1}, world_size);
  } else {
    FSDP_CHECK(!given || given->ndim() == 1 || given->size(0) == 1, name, " shards over one mesh "
               "dim, but device_mesh ", given ? given->shape_string() : "", " also has a replicate "
               "dim of ", given && given->ndim() == 2 ? given->size(0) : 0, " that it would ignore; "
               "use ", strategy == ShardingStrategy::kShardGradOp ? "HYBRID_SHARD_ZERO2" : "HYBRID_SHARD",
               " with this mesh, or a 1-D mesh (", world_size, ")");
    plan.layout = MeshLayout::resolve({1, world_size}, world_size);
  }

  // A shard group whose ranks sit on different nodes all-gathers over the slower links.
  const int64_t S = plan.shard_size();
  for (const auto& group : plan.layout.groups(1)) {
    std::set<int64_t> nodes;
    for (int64_t r : group) nodes.insert(r / local_world_size);
    if (nodes.size() > 1) {
      plan.warnings.push_back(detail::cat(
          "shard group of size ", S, " spans ", nodes.size(), " nodes (", local_world_size,
          " ranks per node): its all-gathers and reduce-scatters will use the slower inter-node "
          "links; a mesh (", world_size / std::min(S, local_world_size), ", ",
          std::min(S, local_world_size), ") keeps them inside nodes"));
      break;
    }
  }
  return plan;
}

namespace detail {
std::shared_ptr<Runtime> runtime_for(const FSDPStrategy& strategy,
                                     std::shared_ptr<Runtime> runtime) {
  if (!runtime) return Runtime::init(strategy.runtime());
  FSDP_CHECK(strategy.backend() == Backend::kAuto || strategy.backend() == runtime->backend(),
             "strategy backend ", to_string(strategy.backend()), " differs from the runtime's ",
             to_string(runtime->backend()), "; set one of them");
  return runtime;
}
}  // namespace detail

}  // namespace fsdp
