// Sharded load: load_checkpoint maps every saved chunk by name and element range onto this
// model's layout, in the phases of checkpoint/load_phases.h (see fsdp/checkpoint.h, NOTE
// [checkpoint format]).
#include "checkpoint/load_phases.h"

#include <functional>
#include <set>

#include "base/compat.h"
#include "base/shard_slice.h"
#include "checkpoint/chunk_reader.h"
#include "engine/engine.h"
#include "fsdp/runtime.h"

namespace fsdp::detail {
namespace {

// Zeroes the elements of `flat` outside the sorted-or-not `covered` ranges [lo, hi).
void zero_gaps(at::Tensor& flat, std::vector<std::pair<int64_t, int64_t>> covered) {
  std::sort(covered.begin(), covered.end());
  int64_t pos = 0;
  covered.emplace_back(flat.numel(), flat.numel());
  for (const auto& [lo, hi] : covered) {
    if (lo > pos) flat.narrow(0, pos, lo - pos).zero_();
    pos = std::max(pos, hi);
  }
}

// Asks `reader` for each parameter's part of shard `s` of flat `u` from the entry
// `entry_for(slot)` returns (none where it returns -1) and returns the new destination, its
// other elements (padding, parameters without an entry) zeroed once read_all has run.
template <class EntryFor>
at::Tensor want_flat(ChunkReader& reader, const FlatView& u, int64_t s, const EntryFor& entry_for) {
  at::Tensor flat = empty_mapped(u.shard_numel, at::kFloat);
  const int64_t begin = s * u.shard_numel;
  std::vector<std::pair<int64_t, int64_t>> covered;
  for (const auto& slot : u.params) {
    const auto sl = shard_slice(begin, u.shard_numel, slot.offset, slot.numel);
    const int64_t entry = entry_for(slot);
    if (sl.empty() || entry < 0) continue;
    reader.want(entry, sl.in_param(), sl.in_param_end(), flat.narrow(0, sl.in_shard(), sl.numel()));
    covered.emplace_back(sl.in_shard(), sl.in_shard() + sl.numel());
  }
  zero_gaps(flat, covered);
  return flat;
}

// The optimizer state of flat `u`: a state exists if any of its parameters had some, its step is
// their largest; a field absent for some parameters is zero there. Fills `fields` (per
// kind.fields, undefined where no parameter has the field) with destinations to read into.
std::unique_ptr<ParamState> want_state(ChunkReader& reader, const PendingLoad& p, const FlatView& u,
                                       int64_t s, std::vector<at::Tensor>& fields) {
  const OptimizerKind& kind = *p.kind;
  std::unique_ptr<ParamState> st;
  int64_t step = 0;
  for (const auto& slot : u.params) {
    const TensorEntry& t = p.meta.entries[p.entry_of.at("param/" + slot.name)];
    if (!t.optim_state) continue;
    if (!st) st = kind.make();
    step = std::max(step, t.optim_step.value_or(0));
  }
  fields.assign(kind.fields.size(), at::Tensor());
  if (!st) return st;
  if (kind.set_step) kind.set_step(*st, step);
  for (size_t f = 0; f < kind.fields.size(); ++f) {
    auto entry_for = [&](const auto& slot) -> int64_t {
      auto it = p.entry_of.find(cat("optim/", kind.fields[f].name, "/", slot.name));
      return it == p.entry_of.end() ? -1 : it->second;
    };
    bool any = false;
    for (const auto& slot : u.params) any = any || entry_for(slot) >= 0;
    if (any) fields[f] = want_flat(reader, u, s, entry_for);
  }
  return st;
}

// This rank's record of rng.bin, after the whole file's checksum matched.
at::Tensor read_rng(const Meta& m, int64_t rank) {
  File f(m.path + "/" + m.files[m.rng_file].name, O_RDONLY);
  std::vector<uint8_t> all(static_cast<size_t>(m.rng_world * m.rng_bytes));
  f.read_at(all.data(), static_cast<int64_t>(all.size()), 0);
  FSDP_CHECK(format_checksum(m.format_version, all.data(), static_cast<int64_t>(all.size())) ==
                 m.files[m.rng_file].crc,
             "checkpoint '", m.path, "': rng.bin is corrupted (", checksum_name(m.format_version),
             " mismatch); use an earlier checkpoint");
  return at::from_blob(all.data() + rank * m.rng_bytes, {m.rng_bytes}, at::kByte).clone();
}

}  // namespace

PendingLoad check_load(const std::string& path, Engine& e,
                       const torch::optim::Optimizer* optimizer) {
  PendingLoad p;
  p.path = path;
  p.engine = &e;
  p.flats = e.flat_views();
  try {
    p.meta = read_meta(path);
  } catch (const Error& err) {
    throw CheckpointDamagedError(err.what());
  }
  std::map<std::string, std::vector<int64_t>> have;
  for (size_t i = 0; i < p.meta.entries.size(); ++i) {
    const TensorEntry& t = p.meta.entries[i];
    p.entry_of[t.key()] = static_cast<int64_t>(i);
    if (t.kind == "optim") continue;
    have[t.name] = t.shape;
    for (const auto& a : t.aliases) {
      have[a] = t.shape;
      p.entry_of["param/" + a] = static_cast<int64_t>(i);
    }
  }
  check_names(model_shapes(e.root_module()), have, cat("checkpoint '", path, "'"));
  if (!optimizer) return p;
  p.kind = optimizer_kind(*optimizer);
  check_optimizer_params(*optimizer, e);
  const Meta& m = p.meta;
  FSDP_CHECK(!m.optimizer.empty(), "checkpoint '", path, "' has no optimizer state; pass "
             "nullptr as the optimizer to load the model alone");
  FSDP_CHECK(m.optimizer == p.kind->name, "checkpoint '", path, "' holds ", m.optimizer,
             " state but the optimizer is ", p.kind->name, "; use the same optimizer type, or "
             "pass nullptr to load the model alone");
  FSDP_CHECK(m.lrs.size() == optimizer->param_groups().size(), "checkpoint '", path, "' has ",
             m.lrs.size(), " optimizer parameter groups but this optimizer has ",
             optimizer->param_groups().size(), "; build the optimizer the same way");
  // The optimizer entries belong to parameters this optimizer trains: state for a frozen one (or
  // one left out of the optimizer) would be dropped in silence.
  std::set<const c10::TensorImpl*> trained;
  for (const auto& g : optimizer->param_groups()) {
    for (const auto& t : g.params()) trained.insert(t.unsafeGetTensorImpl());
  }
  for (const auto& u : p.flats) {
    if (trained.count(u.param.unsafeGetTensorImpl())) continue;
    for (const auto& slot : u.params) {
      const TensorEntry& t = m.entries[static_cast<size_t>(p.entry_of.at("param/" + slot.name))];
      FSDP_CHECK(!t.optim_state, "checkpoint '", path, "' holds ", m.optimizer, " state of '",
                 slot.name, "', which this optimizer does not train (",
                 u.trainable ? "not in its parameters" : "frozen", "); train it, or pass nullptr "
                 "as the optimizer to load the model alone");
    }
  }
  return p;
}

void stage_load(PendingLoad& p, const CheckpointOptions& options) {
  Engine& e = *p.engine;
  ChunkReader reader(p.meta);
  const int64_t s = e.shard_group()->rank();
  for (const auto& u : p.flats) {
    p.shards.push_back(want_flat(reader, u, s, [&](const auto& slot) {
      return p.entry_of.at("param/" + slot.name);
    }));
  }
  std::vector<std::vector<at::Tensor>> fields(p.kind ? p.flats.size() : 0);  // per flat, per field
  for (size_t i = 0; i < fields.size(); ++i) {
    p.states.push_back(want_state(reader, p, p.flats[i], s, fields[i]));
  }
  for (const auto& b : e.root_module().named_buffers()) {
    const int64_t entry = p.entry_of.at("buffer/" + b.key());
    const TensorEntry& t = p.meta.entries[entry];
    at::Tensor v = empty_mapped(t.numel, t.dtype);
    reader.want(entry, 0, t.numel, v);
    p.buffers.emplace_back(b.key(), v.view(t.shape));
  }
  try {
    p.bytes = reader.read_all();
  } catch (const Error& err) {  // a file gone, short or corrupted since it was listed
    throw CheckpointDamagedError(err.what());
  }
  for (size_t i = 0; i < fields.size(); ++i) {
    for (size_t f = 0; f < fields[i].size(); ++f) {
      if (fields[i][f].defined()) {
        p.kind->fields[f].set(*p.states[i], fields[i][f].to(p.flats[i].param.device()));
      }
    }
  }
  Runtime& rt = *e.runtime();
  if (options.rng && p.meta.rng_file >= 0 && p.meta.rng_world == rt.world_size()) {
    try {
      p.rng = read_rng(p.meta, rt.rank());
    } catch (const Error& err) {
      throw CheckpointDamagedError(err.what());
    }
  }
}

void commit_load(PendingLoad& p, torch::optim::Optimizer* optimizer, TrainingState* state,
                 CheckpointInfo& info) {
  Engine& e = *p.engine;
  e.replace_shards(p.shards);
  if (optimizer) {
    for (size_t i = 0; i < p.flats.size(); ++i) {
      const auto key = compat::optimizer_state_key(p.flats[i].param);
      if (p.states[i]) {
        optimizer->state()[key] = std::move(p.states[i]);
      } else {
        optimizer->state().erase(key);
      }
    }
    for (size_t g = 0; g < p.meta.lrs.size(); ++g) {
      optimizer->param_groups()[g].options().set_lr(p.meta.lrs[g]);
    }
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& b : e.root_module().named_buffers()) {
      for (const auto& [name, v] : p.buffers) {
        if (name == b.key()) b.value().copy_(v);
      }
    }
  }
  if (p.rng.defined()) {
    Runtime& rt = *e.runtime();
    const std::string err = capture([&] {
      info.cuda_rng_restored = set_rng_state(p.rng, p.meta.rng_cuda_bytes, rt.device());
    });
    rt.check_all_ok(cat("loading checkpoint '", p.path, "' (restoring the RNG: saved by another "
                        "libtorch?)"), err);
    info.rng_restored = true;
  }
  if (state) *state = p.meta.state;
}

}  // namespace fsdp::detail

namespace fsdp {
namespace {

// Runs the local `fn` and makes its failure every rank's (Runtime::check_all_ok), keeping
// whether the checkpoint was damaged: a CheckpointDamagedError on any rank is one on every rank
// (a CRC mismatch is seen only by the rank that reads those bytes). Two rounds through the
// store, on every rank in the same order: other errors first, then damage.
void check_all_ok_damaged(Runtime& rt, const std::string& what, const std::function<void()>& fn) {
  std::string damage;
  const std::string other = detail::capture([&] {
    try {
      fn();
    } catch (const CheckpointDamagedError& err) {
      damage = err.what();
    }
  });
  rt.check_all_ok(what, other);
  try {
    rt.check_all_ok(what, damage);
  } catch (const CheckpointDamagedError&) {
    throw;
  } catch (const Error& err) {
    throw CheckpointDamagedError(err.what());
  }
}

}  // namespace

CheckpointInfo load_checkpoint(const std::string& path, ShardedModuleBase& model,
                               torch::optim::Optimizer* optimizer, TrainingState* state,
                               const CheckpointOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  detail::Engine& e = *detail::engine_of(model);
  Runtime& rt = *e.runtime();
  const std::string what = cat("loading checkpoint '", path, "'");
  CheckpointInfo info;
  info.path = path;
  detail::PendingLoad p;
  check_all_ok_damaged(rt, what, [&] { p = detail::check_load(path, e, optimizer); });
  info.files = static_cast<int64_t>(p.meta.files.size());
  check_all_ok_damaged(rt, what, [&] { detail::stage_load(p, options); });
  info.bytes = p.bytes;
  detail::commit_load(p, optimizer, state, info);  // every rank read everything it needs
  info.seconds = detail::seconds_since(t0);
  return info;
}

}  // namespace fsdp
