// Sharded load: load_checkpoint maps every saved chunk by name and element range onto this
// model's layout (see fsdp/checkpoint.h, NOTE [checkpoint format]).
#include "checkpoint/layout.h"
#include "compat.h"
#include "shard_slice.h"
#include "fsdp/runtime.h"

namespace fsdp {

using detail::build_shards;
using detail::check_names;
using detail::check_optimizer_params;
using detail::commit_shards;
using detail::find_state;
using detail::model_shapes;
using detail::optimizer_kind;
using detail::OptimizerKind;
using detail::ParamState;
using detail::read_chunk;

CheckpointInfo load_checkpoint(const std::string& path, ShardedModuleBase& model,
                               torch::optim::Optimizer* optimizer, TrainingState* state,
                               const CheckpointOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  Engine& e = *detail::engine_of(model);
  Runtime& rt = *e.runtime();
  const std::string what = cat("loading checkpoint '", path, "'");
  CheckpointInfo info;
  info.path = path;

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

  // 2. Read what this rank's shards need (nothing in the model changes yet).
  std::vector<at::Tensor> shards;
  std::vector<std::unique_ptr<ParamState>> states;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  at::Tensor rng;
  err = capture([&] {
    std::map<int64_t, std::unique_ptr<File>> open;
    std::map<int64_t, std::vector<const Chunk*>> chunks_of;
    for (const auto& c : m.chunks) chunks_of[c.tensor].push_back(&c);
    auto slice = [&](int64_t entry, int64_t lo, int64_t hi) {
      at::Tensor out = at::empty({hi - lo}, at::TensorOptions().dtype(m.entries[entry].dtype));
      for (const Chunk* c : chunks_of[entry]) {
        const int64_t a = std::max(lo, c->begin), b = std::min(hi, c->end);
        if (a >= b) continue;
        at::Tensor data = read_chunk(m, *c, open);
        info.bytes += data.numel() * static_cast<int64_t>(data.element_size());
        out.narrow(0, a - lo, b - a).copy_(data.narrow(0, a - c->begin, b - a));
      }
      return out;
    };
    shards = build_shards(e, [&](const std::string& name, int64_t lo, int64_t hi) {
      return slice(entry_of.at("param/" + name), lo, hi);
    });
    const int64_t s = e.shard_group()->rank();
    if (kind) {
      for (const auto& u : e.unit_states()) {
        // State exists if any of the unit's parameters had some; its step is their largest.
        std::unique_ptr<ParamState> st;
        int64_t step = 0;
        for (const auto& slot : u->params) {
          const TensorEntry& t = m.entries[entry_of.at("param/" + slot.name)];
          if (!t.optim_state) continue;
          if (!st) st = kind->make();
          step = std::max(step, t.optim_step.value_or(0));
        }
        if (st) {
          if (kind->set_step) kind->set_step(*st, step);
          const int64_t begin = s * u->shard_numel;
          for (const auto& f : kind->fields) {
            at::Tensor flat;
            for (const auto& slot : u->params) {
              auto it = entry_of.find(cat("optim/", f.name, "/", slot.name));
              if (it == entry_of.end()) continue;
              if (!flat.defined()) flat = at::zeros({u->shard_numel}, at::kFloat);
              const auto sl = detail::shard_slice(begin, u->shard_numel, slot.offset, slot.numel);
              if (sl.empty()) continue;
              flat.narrow(0, sl.in_shard(), sl.numel())
                  .copy_(slice(it->second, sl.in_param(), sl.in_param_end()));
            }
            if (flat.defined()) f.set(*st, flat.to(u->shard.device()));
          }
        }
        states.push_back(std::move(st));
      }
    }
    for (const auto& b : e.root_module().named_buffers()) {
      const int64_t entry = entry_of.at("buffer/" + b.key());
      buffers.emplace_back(b.key(), slice(entry, 0, m.entries[entry].numel)
                                        .view(m.entries[entry].shape));
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
  commit_shards(e, shards);
  if (optimizer) {
    const auto& units = e.unit_states();
    for (size_t i = 0; i < units.size(); ++i) {
      const auto key = compat::optimizer_state_key(units[i]->shard);
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
    err = capture([&] { set_cpu_rng_state(rng); });
    rt.check_all_ok(what + " (restoring the RNG: saved by another libtorch?)", err);
    info.rng_restored = true;
  }
  if (state) *state = m.state;
  info.seconds = seconds_since(t0);
  return info;
}

}  // namespace fsdp
