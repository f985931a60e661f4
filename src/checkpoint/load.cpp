// Sharded load: load_checkpoint maps every saved chunk by name and element range onto this
// model's layout (see fsdp/checkpoint.h, NOTE [checkpoint format]).
#include "checkpoint/chunk_reader.h"
#include "checkpoint/layout.h"
#include "compat.h"
#include "shard_slice.h"
#include "fsdp/runtime.h"

namespace fsdp {
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

}  // namespace

using detail::check_names;
using detail::ChunkReader;
using detail::check_optimizer_params;
using detail::find_state;
using detail::model_shapes;
using detail::optimizer_kind;
using detail::OptimizerKind;
using detail::ParamState;

CheckpointInfo load_checkpoint(const std::string& path, ShardedModuleBase& model,
                               torch::optim::Optimizer* optimizer, TrainingState* state,
                               const CheckpointOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  Engine& e = *detail::engine_of(model);
  Runtime& rt = *e.runtime();
  const std::string what = cat("loading checkpoint '", path, "'");
  CheckpointInfo info;
  info.path = path;

  const std::vector<detail::FlatView> flats = e.flat_views();

  // 1. Every rank reads and checks meta.json, the model and the optimizer.
  Meta m;
  std::optional<OptimizerKind> kind;
  std::map<std::string, int64_t> entry_of;  // key() -> entry, aliases included
  std::string err = capture([&] {
    m = read_meta(path);
    info.files = static_cast<int64_t>(m.files.size());
    std::map<std::string, std::vector<int64_t>> have;
    for (size_t i = 0; i < m.entries.size(); ++i) {
      const TensorEntry& t = m.entries[i];
      entry_of[t.key()] = static_cast<int64_t>(i);
      if (t.kind == "optim") continue;
      have[t.name] = t.shape;
      for (const auto& a : t.aliases) {
        have[a] = t.shape;
        entry_of["param/" + a] = static_cast<int64_t>(i);
      }
    }
    check_names(model_shapes(e.root_module()), have, cat("checkpoint '", path, "'"));
    if (optimizer) {
      kind = optimizer_kind(*optimizer);
      check_optimizer_params(*optimizer, e);
      FSDP_CHECK(!m.optimizer.empty(), "checkpoint '", path, "' has no optimizer state; pass "
                 "nullptr as the optimizer to load the model alone");
      FSDP_CHECK(m.optimizer == kind->name, "checkpoint '", path, "' holds ", m.optimizer,
                 " state but the optimizer is ", kind->name, "; use the same optimizer type, or "
                 "pass nullptr to load the model alone");
      FSDP_CHECK(m.lrs.size() == optimizer->param_groups().size(), "checkpoint '", path,
                 "' has ", m.lrs.size(), " optimizer parameter groups but this optimizer has ",
                 optimizer->param_groups().size(), "; build the optimizer the same way");
    }
  });
  rt.check_all_ok(what, err);

  // 2. Read what this rank's shards need, one pass over the files (NOTE [one-pass load]);
  //    nothing in the model changes yet.
  std::vector<at::Tensor> shards;
  std::vector<std::unique_ptr<ParamState>> states;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  at::Tensor rng;
  err = capture([&] {
    ChunkReader reader(m);
    const int64_t s = e.shard_group()->rank();
    // Destination `flat` [shard_numel] of a unit: each parameter's part of this rank's shard from
    // entry `key(slot)` (skipped where `key` finds none); the rest (padding) is zeroed.
    auto want_flat = [&](const FlatView& u, at::Tensor flat, const auto& entry_for) {
      const int64_t begin = s * u.shard_numel;
      std::vector<std::pair<int64_t, int64_t>> covered;
      for (const auto& slot : u.params) {
        const auto sl = detail::shard_slice(begin, u.shard_numel, slot.offset, slot.numel);
        const int64_t entry = entry_for(slot);
        if (sl.empty() || entry < 0) continue;
        reader.want(entry, sl.in_param(), sl.in_param_end(), flat.narrow(0, sl.in_shard(), sl.numel()));
        covered.emplace_back(sl.in_shard(), sl.in_shard() + sl.numel());
      }
      zero_gaps(flat, covered);
      return flat;
    };
    for (const auto& u : flats) {
      shards.push_back(want_flat(u, detail::empty_mapped(u.shard_numel, at::kFloat), [&](const auto& slot) {
        return entry_of.at("param/" + slot.name);
      }));
    }
    // Optimizer state exists for a unit if any of its parameters had some; its step is their
    // largest. A field absent for some parameters is zero there.
    std::vector<std::vector<at::Tensor>> fields;  // per unit, per kind->fields
    if (kind) {
      for (const auto& u : flats) {
        std::unique_ptr<ParamState> st;
        int64_t step = 0;
        for (const auto& slot : u.params) {
          const TensorEntry& t = m.entries[entry_of.at("param/" + slot.name)];
          if (!t.optim_state) continue;
          if (!st) st = kind->make();
          step = std::max(step, t.optim_step.value_or(0));
        }
        std::vector<at::Tensor> flat_fields(kind->fields.size());
        if (st) {
          if (kind->set_step) kind->set_step(*st, step);
          for (size_t f = 0; f < kind->fields.size(); ++f) {
            auto entry_for = [&](const auto& slot) -> int64_t {
              auto it = entry_of.find(cat("optim/", kind->fields[f].name, "/", slot.name));
              return it == entry_of.end() ? -1 : it->second;
            };
            bool any = false;
            for (const auto& slot : u.params) any = any || entry_for(slot) >= 0;
            if (any) flat_fields[f] = want_flat(u, detail::empty_mapped(u.shard_numel, at::kFloat), entry_for);
          }
        }
        states.push_back(std::move(st));
        fields.push_back(std::move(flat_fields));
      }
    }
    for (const auto& b : e.root_module().named_buffers()) {
      const TensorEntry& t = m.entries[entry_of.at("buffer/" + b.key())];
      at::Tensor v = detail::empty_mapped(t.numel, t.dtype);
      reader.want(entry_of.at("buffer/" + b.key()), 0, t.numel, v);
      buffers.emplace_back(b.key(), v.view(t.shape));
    }
    info.bytes = reader.read_all();
    for (size_t i = 0; i < fields.size(); ++i) {
      for (size_t f = 0; f < fields[i].size(); ++f) {
        if (fields[i][f].defined()) {
          kind->fields[f].set(*states[i], fields[i][f].to(flats[i].param.device()));
        }
      }
    }
    if (options.rng && m.rng_file >= 0 && m.rng_world == rt.world_size()) {
      Chunk c;
      c.file = m.rng_file;
      c.offset = rt.rank() * m.rng_bytes;
      File f(m.path + "/" + m.files[m.rng_file].name, O_RDONLY);
      std::vector<uint8_t> all(static_cast<size_t>(m.rng_world * m.rng_bytes));
      f.read_at(all.data(), static_cast<int64_t>(all.size()), 0);
      FSDP_CHECK(format_checksum(m.format_version, all.data(), static_cast<int64_t>(all.size())) ==
                     m.files[m.rng_file].crc,
                 "checkpoint '", path, "': rng.bin is corrupted (", checksum_name(m.format_version),
                 " mismatch); use an earlier checkpoint");
      rng = at::from_blob(all.data() + c.offset, {m.rng_bytes}, at::kByte).clone();
    }
  });
  rt.check_all_ok(what, err);

  // 3. Commit: every rank read everything it needs.
  e.replace_shards(shards);
  if (optimizer) {
    for (size_t i = 0; i < flats.size(); ++i) {
      const auto key = compat::optimizer_state_key(flats[i].param);
      if (states[i]) {
        optimizer->state()[key] = std::move(states[i]);
      } else {
        optimizer->state().erase(key);
      }
    }
    for (size_t g = 0; g < m.lrs.size(); ++g) optimizer->param_groups()[g].options().set_lr(m.lrs[g]);
  }
  {
    torch::NoGradGuard no_grad;
    for (auto& b : e.root_module().named_buffers()) {
      for (const auto& [name, v] : buffers) {
        if (name == b.key()) b.value().copy_(v);
      }
    }
  }
  if (rng.defined()) {
    err = capture([&] { info.cuda_rng_restored = set_rng_state(rng, m.rng_cuda_bytes, rt.device()); });
    rt.check_all_ok(what + " (restoring the RNG: saved by another libtorch?)", err);
    info.rng_restored = true;
  }
  if (state) *state = m.state;
  info.seconds = seconds_since(t0);
  return info;
}

}  // namespace fsdp
