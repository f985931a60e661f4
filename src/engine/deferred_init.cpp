// Deferred construction: units shard themselves as they are built (NOTE [deferred init] in
// fsdp/deferred_init.h), and fsdp::shard() checks and adopts their shards.
#include "fsdp/deferred_init.h"

#include <sys/mman.h>
#include <unistd.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <set>
#include <unordered_set>
#include <vector>

#include "base/shard_slice.h"
#include "engine/deferred_init_internal.h"
#include "runtime/strategy_internal.h"
#include "base/mapped_tensor.h"
#include "fsdp/error.h"

namespace fsdp {
namespace detail {

// One parameter of a deferred flat: where it sits in the flat and what it was when sliced.
struct DeferredParam {
  std::string name;  // relative to the unit
  at::Tensor param;  // the module's parameter; its data points into the placeholder
  int64_t offset = 0, numel = 0;
  int64_t version = 0;  // its version counter once it pointed into the placeholder
  bool requires_grad = true;
};

// One flat of a unit (trainable or frozen), laid out as Engine::make_flat lays it out: the
// parameters in named_parameters() order, a tied tensor once (under its first name).
struct DeferredFlat {
  std::vector<std::string> names;  // every name in order, tied ones too (as plan_units lists them)
  std::vector<DeferredParam> params;  // distinct tensors
  int64_t numel = 0;
  at::Tensor shard;  // fp32 [ceil(numel / S)] on the runtime's device
  uint64_t checksum = 0;
};

struct DeferredUnit {
  DeferredFlat flats[2];  // [0] trainable, [1] frozen
  int64_t shard_size = 1, shard_rank = 0;
  at::Tensor placeholder;  // fp32, zero pages: every parameter of the unit views it
};

struct DeferredAccess {
  static std::shared_ptr<DeferredUnit>& of(UnitHooks& hooks) { return hooks.fsdp_deferred_; }
};

namespace {

// A 64-bit checksum of `bytes` bytes (four independent multiply-xor lanes: several GB/s, far
// below the cost of the initialisers it follows). Not cryptographic: it tells ranks that built
// different values apart.
uint64_t checksum_bytes(const void* data, size_t bytes, uint64_t seed) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ULL;
  uint64_t lane[4] = {seed ^ 0x1, seed ^ 0x2, seed ^ 0x3, seed ^ 0x4};
  const auto* p = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      lane[l] = (lane[l] ^ w) * kMul;
      lane[l] ^= lane[l] >> 29;
    }
  }
  for (; i < bytes; ++i) lane[0] = (lane[0] ^ p[i]) * kMul;
  uint64_t h = bytes;
  for (uint64_t l : lane) {
    h = (h ^ l) * kMul;
    h ^= h >> 32;
  }
  return h;
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// `numel` fp32 zeros that cost no memory until written: an anonymous private mapping (reads map
// the kernel's shared zero page).
at::Tensor zero_placeholder(int64_t numel) {
  const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  FSDP_CHECK(p != MAP_FAILED, "fsdp::DeferredInit: cannot map ", bytes, " bytes of address space "
             "for a unit's placeholder (", std::strerror(errno), "); raise ulimit -v");
  return at::from_blob(p, {numel}, [bytes](void* q) { ::munmap(q, bytes); },
                       at::TensorOptions().dtype(at::kFloat));
}

// The first element of placeholder `t` that is not zero, or -1. Only pages the process touched
// are read (mincore): reading an untouched page of an anonymous mapping would give it memory on
// kernels that do not map the shared zero page (measured here: reading 1 GiB of a fresh mapping
// made it 1 GiB of RssAnon), which is what deferred init exists to avoid.
int64_t first_nonzero(const at::Tensor& t) {
  const auto* base = static_cast<const unsigned char*>(t.data_ptr());
  const size_t bytes = static_cast<size_t>(t.numel()) * sizeof(float);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  if (::mincore(const_cast<unsigned char*>(base), bytes, resident.data()) != 0) {
    throw Error(cat("fsdp::DeferredInit: mincore on a unit's placeholder failed (",
                    std::strerror(errno), ")"));
  }
  for (size_t pg = 0; pg < resident.size(); ++pg) {
    if (!(resident[pg] & 1)) continue;  // never touched: still zero
    const size_t end = std::min(bytes, (pg + 1) * page);
    for (size_t b = pg * page; b < end; b += sizeof(uint32_t)) {
      uint32_t v;
      std::memcpy(&v, base + b, sizeof v);
      if (v != 0) return static_cast<int64_t>(b / sizeof(float));
    }
  }
  return -1;
}

thread_local DeferredInit::State* current = nullptr;

}  // namespace
}  // namespace detail

struct DeferredInit::State {
  FSDPStrategy strategy;
  std::shared_ptr<Runtime> runtime;
  ShardingPlan plan;
  int64_t shard_size = 1, shard_rank = 0;
  bool active = false;
  Stats stats;
};

DeferredInit::DeferredInit(FSDPStrategy strategy, std::shared_ptr<Runtime> runtime) {
  FSDP_CHECK(detail::current == nullptr, "fsdp::DeferredInit: another one is active on this "
             "thread; finish it (fsdp::shard(net, init)) before starting the next");
  auto s = std::make_shared<State>();
  s->runtime = detail::runtime_for(strategy, std::move(runtime));
  s->plan = plan_sharding(strategy, s->runtime->world_size(), s->runtime->env().local_world_size);
  s->strategy = std::move(strategy);
  s->shard_size = s->plan.shard_size();
  s->shard_rank = s->plan.layout.coordinate_of(s->runtime->rank()).back();
  s->active = true;
  state_ = std::move(s);
  detail::current = state_.get();
}

DeferredInit::~DeferredInit() { finish(); }

void DeferredInit::finish() {
  if (!state_->active) return;
  state_->active = false;
  if (detail::current == state_.get()) detail::current = nullptr;
}

bool DeferredInit::active() const { return state_->active; }
const FSDPStrategy& DeferredInit::strategy() const { return state_->strategy; }
const std::shared_ptr<Runtime>& DeferredInit::runtime() const { return state_->runtime; }
const ShardingPlan& DeferredInit::plan() const { return state_->plan; }
int64_t DeferredInit::shard_rank() const { return state_->shard_rank; }
const DeferredInit::Stats& DeferredInit::stats() const { return state_->stats; }

namespace detail {

void deferred_unit_not_sharded() {
  throw Error("an fsdp::Unit built under fsdp::DeferredInit ran its forward before fsdp::shard(): "
              "its parameters are placeholders holding only this rank's shard; call the model "
              "returned by fsdp::shard(net, init)");
}

namespace {

// deferred_unit_built's steps.

// 1. The unit's own parameters (those of units built inside it, inner fsdp::Unit members, stay
//    theirs), laid out in two flats, trainable [0] and frozen [1]; tied parameters once.
std::shared_ptr<DeferredUnit> collect_params(torch::nn::Module& module,
                                             const DeferredInit::State& ctx) {
  std::unordered_set<const c10::TensorImpl*> inner;
  for (const auto& child : module.modules(/*include_self=*/false)) {
    auto* h = dynamic_cast<UnitHooks*>(child.get());
    if (!h || !DeferredAccess::of(*h)) continue;
    for (const auto& flat : DeferredAccess::of(*h)->flats) {
      for (const auto& p : flat.params) inner.insert(p.param.unsafeGetTensorImpl());
    }
  }
  auto unit = std::make_shared<DeferredUnit>();
  unit->shard_size = ctx.shard_size;
  unit->shard_rank = ctx.shard_rank;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = p.value();
    if (inner.count(t.unsafeGetTensorImpl())) continue;
    DeferredFlat& flat = unit->flats[t.requires_grad() ? 0 : 1];
    flat.names.push_back(p.key());
    if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;  // tied: laid out once
    FSDP_CHECK(t.scalar_type() == at::kFloat, "parameter '", p.key(), "' of ", module.name(),
               " built under fsdp::DeferredInit has dtype ", t.scalar_type(), " but fsdp keeps "
               "fp32 master shards; build the model in fp32 and use mixed_precision for bf16/fp16");
    FSDP_CHECK(t.device().is_cpu(), "parameter '", p.key(), "' of ", module.name(), " was built "
               "on ", t.device().str(), " under fsdp::DeferredInit; build on the CPU (the shards "
               "move to the runtime's device)");
    DeferredParam dp;
    dp.name = p.key();
    dp.param = t;
    dp.offset = flat.numel;
    dp.numel = t.numel();
    dp.requires_grad = t.requires_grad();
    flat.numel += dp.numel;
    flat.params.push_back(std::move(dp));
  }
  return unit;
}

// 2. This rank's part of each flat, straight from the parameters (no whole flat is made), and a
//    checksum of the values every rank must share. Returns the shards' bytes.
int64_t slice_shards(DeferredUnit& unit, const DeferredInit::State& ctx) {
  const int64_t S = ctx.shard_size;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(ctx.runtime->device());
  int64_t shard_bytes = 0;
  for (auto& flat : unit.flats) {
    const int64_t shard_numel = shard_numel_of(flat.numel, S);
    const int64_t begin = ctx.shard_rank * shard_numel;
    // NOTE [mapped shards]
    flat.shard = f32.device().is_cpu() ? mapped_zeros(shard_numel, at::kFloat)
                                       : at::zeros({shard_numel}, f32);
    shard_bytes += shard_numel * 4;
    uint64_t h = 0;
    for (const auto& dp : flat.params) {
      at::Tensor src = dp.param.detach().contiguous().view({-1});
      h = checksum_bytes(src.data_ptr(), static_cast<size_t>(dp.numel) * 4, h);
      const auto sl = shard_slice(begin, shard_numel, dp.offset, dp.numel);
      if (!sl.empty()) {
        flat.shard.narrow(0, sl.in_shard(), sl.numel()).copy_(src.narrow(0, sl.in_param(), sl.numel()));
      }
    }
    flat.checksum = h;
  }
  return shard_bytes;
}

// 3. The whole values go: the parameters now view zero pages (shapes intact, no memory).
void drop_whole_values(DeferredUnit& unit, int64_t total) {
  unit.placeholder = zero_placeholder(total);
  int64_t base = 0;
  for (auto& flat : unit.flats) {
    for (auto& dp : flat.params) {
      dp.param.set_data(
          unit.placeholder.narrow(0, base + dp.offset, dp.numel).view(dp.param.sizes()));
      dp.version = dp.param._version();
    }
    base += flat.numel;
  }
}

}  // namespace

bool deferred_unit_built(torch::nn::Module& module, UnitHooks& hooks) {
  DeferredInit::State* ctx = current;
  if (ctx == nullptr || !ctx->active) return false;
  const auto start = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  auto unit = collect_params(module, *ctx);
  if (unit->flats[0].params.empty() && unit->flats[1].params.empty()) return false;
  const int64_t total = unit->flats[0].numel + unit->flats[1].numel;
  const int64_t shard_bytes = slice_shards(*unit, *ctx);
  drop_whole_values(*unit, total);
  DeferredAccess::of(hooks) = std::move(unit);
  auto& st = ctx->stats;
  st.units += 1;
  st.unit_bytes += total * 4;
  st.largest_unit_bytes = std::max(st.largest_unit_bytes, total * 4);
  st.shard_bytes += shard_bytes;
  st.slice_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return true;
}

// ---------------------------------------------------------------------------------------------
// Adoption by fsdp::shard()

int64_t DeferredShards::count(torch::nn::Module& root) {
  int64_t n = 0;
  if (auto* h = dynamic_cast<UnitHooks*>(&root); h && DeferredAccess::of(*h)) ++n;
  for (const auto& m : root.modules(/*include_self=*/false)) {
    auto* h = dynamic_cast<UnitHooks*>(m.get());
    if (h && DeferredAccess::of(*h)) ++n;
  }
  return n;
}

namespace {

// Throws fsdp::Error if parameter `dp` of the unit at `path` changed after the unit was built.
void check_unchanged(const std::string& path, const DeferredParam& dp, const DeferredUnit& unit,
                     const std::map<std::string, at::Tensor>& params_by_name) {
  const std::string name = path + "." + dp.name;
  const std::string fix = "do it in the unit's own constructor, or build without DeferredInit";
  auto now = params_by_name.find(name);
  FSDP_CHECK(now != params_by_name.end() &&
                 now->second.unsafeGetTensorImpl() == dp.param.unsafeGetTensorImpl(),
             "parameter '", name, "' was replaced after its unit was built under "
             "fsdp::DeferredInit (e.g. tied to another module's weight by a parent constructor), "
             "so its shard holds the old values; ", fix, " (tied weights belong in one unit, e.g. "
             "both in the root)");
  FSDP_CHECK(dp.param.storage().unsafeGetStorageImpl() ==
                 unit.placeholder.storage().unsafeGetStorageImpl(),
             "parameter '", name, "' got new data after its unit was built under "
             "fsdp::DeferredInit (set_data, or the model moved with .to()), which its shard does "
             "not have; move the model only after fsdp::shard(), or ", fix);
  FSDP_CHECK(dp.param._version() == dp.version, "parameter '", name, "' was modified in place "
             "after its unit was built under fsdp::DeferredInit (e.g. re-initialised by a parent "
             "constructor), a change its shard would silently lose; ", fix);
  FSDP_CHECK(dp.param.requires_grad() == dp.requires_grad, "requires_grad of parameter '", name,
             "' changed to ", dp.param.requires_grad() ? "true" : "false", " after its unit was "
             "built under fsdp::DeferredInit, which laid it out as ",
             dp.requires_grad ? "trainable" : "frozen", "; ", fix);
}

// Throws if any byte of the unit's placeholder was written (through .data(), which has a
// version counter of its own, or a raw pointer), naming the parameter.
void check_placeholder_untouched(const std::string& path, const DeferredUnit& unit) {
  const int64_t pos = first_nonzero(unit.placeholder);
  if (pos < 0) return;
  int64_t base = 0;
  for (const auto& flat : unit.flats) {
    for (const auto& dp : flat.params) {
      if (pos >= base + dp.offset && pos < base + dp.offset + dp.numel) {
        throw Error(cat("parameter '", path, ".", dp.name, "' was written after its unit was "
                        "built under fsdp::DeferredInit (through .data() or a raw pointer), a "
                        "change its shard would silently lose; do it in the unit's own "
                        "constructor, or build without DeferredInit"));
      }
    }
    base += flat.numel;
  }
  TORCH_INTERNAL_ASSERT(false, "placeholder byte outside every parameter");
}

void check_layout(const std::string& path, const DeferredFlat& flat,
                  const std::vector<std::string>& planned, bool trainable) {
  std::vector<std::string> built;
  for (const auto& n : flat.names) built.push_back(path + "." + n);
  if (built == planned) return;
  size_t i = 0;
  while (i < built.size() && i < planned.size() && built[i] == planned[i]) ++i;
  throw Error(cat("unit '", path, "' built under fsdp::DeferredInit has ", built.size(), " ",
                  trainable ? "trainable" : "frozen", " parameter names but fsdp::shard() plans ",
                  planned.size(), ", first differing at '",
                  i < built.size() ? built[i] : std::string("(none)"), "' vs '",
                  i < planned.size() ? planned[i] : std::string("(none)"), "' (a parameter "
                  "registered into the unit after it was built?); register parameters in the "
                  "unit's own constructor, or build without DeferredInit"));
}

}  // namespace

DeferredShards::DeferredShards(torch::nn::Module& root, const std::vector<UnitInfo>& infos,
                               const std::string& policy_name, int64_t shard_size,
                               int64_t shard_rank, Runtime& runtime) {
  std::string error;
  try {
    if (auto* h = dynamic_cast<UnitHooks*>(&root); h && DeferredAccess::of(*h)) {
      throw Error(cat("the root module (", root.name(), ") is an fsdp::Unit built under "
                      "fsdp::DeferredInit; the root is never a unit: make it a plain module"));
    }
    std::map<std::string, const UnitInfo*> planned;
    for (const auto& info : infos) planned[info.name] = &info;
    std::map<std::string, at::Tensor> params_by_name;
    for (const auto& p : root.named_parameters()) params_by_name[p.key()] = p.value();
    for (const auto& m : root.named_modules("", /*include_self=*/false)) {
      auto* hooks = dynamic_cast<UnitHooks*>(m.value().get());
      if (!hooks || !DeferredAccess::of(*hooks)) continue;
      const std::string& path = m.key();
      const DeferredUnit& unit = *DeferredAccess::of(*hooks);
      auto info = planned.find(path);
      FSDP_CHECK(info != planned.end(), "unit '", path, "' (", m.value()->name(), ") was built "
                 "sharded under fsdp::DeferredInit but the wrap policy ", policy_name, " does "
                 "not make it an fsdp unit, so its parameters would join a unit whose values no "
                 "rank holds; use a policy that selects every fsdp::Unit (WrapPolicy::units(), "
                 "the default), or build without DeferredInit");
      FSDP_CHECK(unit.shard_size == shard_size && unit.shard_rank == shard_rank, "unit '", path,
                 "' was built under fsdp::DeferredInit for shard index ", unit.shard_rank,
                 " of ", unit.shard_size, " but fsdp::shard() places this rank at ", shard_rank,
                 " of ", shard_size, "; shard with the DeferredInit it was built under "
                 "(fsdp::shard(net, init))");
      for (const auto& flat : unit.flats) {
        for (const auto& dp : flat.params) check_unchanged(path, dp, unit, params_by_name);
      }
      check_placeholder_untouched(path, unit);
      check_layout(path, unit.flats[0], info->second->params, true);
      check_layout(path, unit.flats[1], info->second->frozen_params, false);
      index_[m.value().get()] = adopted_.size();
      adopted_.push_back({path, hooks, DeferredAccess::of(*hooks)});
    }
  } catch (const std::exception& e) {
    error = error_message(e);
  }
  runtime.check_all_ok("fsdp::shard of a model built under fsdp::DeferredInit", error);

  // Every rank must have built the same values: one comparison of all checksums, and only if
  // that fails one per unit, to name the first unit that differs.
  auto sums = [](const DeferredUnit& u) {
    return hex(u.flats[0].checksum) + hex(u.flats[1].checksum);
  };
  std::string all;
  for (const auto& a : adopted_) all += a.path + ":" + sums(*a.unit) + ";";
  const std::string what = "values of the units built under fsdp::DeferredInit";
  try {
    runtime.check_agreement(what, hex(checksum_bytes(all.data(), all.size(), 0)));
    return;
  } catch (const Error&) {
  }
  for (const auto& a : adopted_) {
    try {
      runtime.check_agreement("checksum of unit '" + a.path + "'", sums(*a.unit));
    } catch (const Error& e) {
      throw Error(cat("ranks built different values for unit '", a.path, "' under "
                      "fsdp::DeferredInit (", e.what(), "); seed every rank alike "
                      "(torch::manual_seed) before building and keep initialisation "
                      "deterministic"));
    }
  }
  TORCH_INTERNAL_ASSERT(false, "checksum lists differ but every unit agrees");
}

at::Tensor DeferredShards::shard(const torch::nn::Module* module, bool trainable) const {
  auto it = index_.find(module);
  if (it == index_.end()) return at::Tensor();
  return adopted_[it->second].unit->flats[trainable ? 0 : 1].shard;
}

void DeferredShards::release() {
  for (auto& a : adopted_) DeferredAccess::of(*a.hooks).reset();
  adopted_.clear();
  index_.clear();
}

}  // namespace detail
}  // namespace fsdp
