// NOTE [complete manifest]: the entries of meta.json together are the whole state a resume needs
// (see meta.h). parse_meta checks each entry on its own (kind, dtype, shape, chunks inside the
// tensor and its file, covering the tensor once); check_manifest checks the entries against
// each other, so that an entry removed or doubled, by an editor or by bit rot that leaves the
// JSON valid, is refused instead of resetting a parameter's optimizer state in silence:
// - no (kind, name, field) twice, and no name (aliases included) both a parameter and a buffer;
// - every optimizer entry belongs to a listed parameter marked optim_state, has its shape and a
//   field the optimizer type stores;
// - every parameter marked optim_state has each field its optimizer type always stores (AdamW:
//   exp_avg, exp_avg_sq) and its step count; a field stored only with an option (amsgrad's
//   max_exp_avg_sq, SGD's momentum_buffer) is there for every such parameter or for none;
// - the RNG section holds world_size ranks (or the checkpoint says it holds none: "rng": null);
// - every byte of every shard file belongs to exactly one chunk: save writes the chunks back to
//   back, so a gap is an entry that is gone and an overlap an entry or chunk that moved.
// Pure; thread-safe.
#include <algorithm>
#include <map>
#include <set>

#include "checkpoint/meta.h"

namespace fsdp::detail {

const std::vector<SavedOptimizer>& saved_optimizers() {
  static const std::vector<SavedOptimizer> kinds = {
      {"adamw", {"exp_avg", "exp_avg_sq"}, {"max_exp_avg_sq"}, true},
      {"adam", {"exp_avg", "exp_avg_sq"}, {"max_exp_avg_sq"}, true},
      {"rmsprop", {"square_avg"}, {"momentum_buffer", "grad_avg"}, true},
      {"adagrad", {"sum"}, {}, true},
      {"sgd", {}, {"momentum_buffer"}, false},
  };
  return kinds;
}

namespace {

const SavedOptimizer* saved_optimizer(const std::string& type) {
  for (const auto& k : saved_optimizers()) {
    if (k.type == type) return &k;
  }
  return nullptr;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += cat(i ? ", " : "", shape[i]);
  return s + "]";
}

// The optimizer state: entries against the parameters they belong to.
void check_optimizer_entries(const Meta& m, const std::string& where) {
  std::map<std::string, const TensorEntry*> params;  // by name
  for (const auto& t : m.entries) {
    if (t.kind == "param") params[t.name] = &t;
  }
  const SavedOptimizer* kind = m.optimizer.empty() ? nullptr : saved_optimizer(m.optimizer);
  FSDP_CHECK(m.optimizer.empty() || kind, where, " holds state of optimizer '", m.optimizer,
             "', which this fsdp.cpp does not know; the file is corrupted");
  std::map<std::string, std::set<std::string>> fields_of;  // parameter -> its fields
  for (const auto& t : m.entries) {
    if (t.kind != "optim") continue;
    auto p = params.find(t.name);
    FSDP_CHECK(p != params.end(), where, " has optimizer state '", t.field, "' of '", t.name,
               "' but no parameter '", t.name, "'; the checkpoint is inconsistent");
    FSDP_CHECK(kind, where, " has optimizer state '", t.field, "' of '", t.name,
               "' but no optimizer; the checkpoint is inconsistent");
    FSDP_CHECK(p->second->optim_state, where, " has optimizer state '", t.field, "' of '", t.name,
               "', whose parameter entry says it has none; the checkpoint is inconsistent");
    const bool known =
        std::count(kind->required.begin(), kind->required.end(), t.field) +
            std::count(kind->optional.begin(), kind->optional.end(), t.field) > 0;
    FSDP_CHECK(known, where, " has optimizer state '", t.field, "' of '", t.name, "', a field ",
               m.optimizer, " does not store; the checkpoint is inconsistent");
    FSDP_CHECK(t.shape == p->second->shape, where, " has optimizer state '", t.field, "' of '",
               t.name, "' of shape ", shape_text(t.shape), " but the parameter's shape is ",
               shape_text(p->second->shape), "; the checkpoint is inconsistent");
    fields_of[t.name].insert(t.field);
  }
  // Optional fields: present for every parameter with state, or for none.
  std::map<std::string, std::string> optional_seen;  // field -> a parameter that has it
  for (const auto& [name, fields] : fields_of) {
    for (const auto& f : fields) optional_seen.emplace(f, name);
  }
  for (const auto& t : m.entries) {
    if (t.kind != "param") continue;
    if (!t.optim_state) {
      FSDP_CHECK(!t.optim_step, where, " gives '", t.name, "' an optimizer step but no optimizer "
                 "state; the checkpoint is inconsistent");
      continue;
    }
    FSDP_CHECK(kind, where, " marks '", t.name, "' as having optimizer state but names no "
               "optimizer; the checkpoint is inconsistent");
    FSDP_CHECK(!kind->step || t.optim_step, where, " has no optimizer step of '", t.name, "' (",
               m.optimizer, " state has one); the checkpoint is incomplete: use an earlier one");
    FSDP_CHECK(kind->step || !t.optim_step, where, " gives '", t.name, "' an optimizer step, "
               "which ", m.optimizer, " state does not have; the checkpoint is inconsistent");
    const auto& have = fields_of[t.name];
    for (const std::string& f : kind->required) {
      FSDP_CHECK(have.count(f), where, " has no '", f, "' of '", t.name, "' (every parameter with ",
                 m.optimizer, " state has one); the checkpoint is incomplete: use an earlier one");
    }
    for (const std::string& f : kind->optional) {
      auto seen = optional_seen.find(f);
      FSDP_CHECK(seen == optional_seen.end() || have.count(f), where, " has no '", f, "' of '",
                 t.name, "' although '", seen == optional_seen.end() ? "" : seen->second,
                 "' has one; the checkpoint is incomplete: use an earlier one");
    }
  }
}

// Every byte of each shard file in exactly one chunk (rng.bin has no chunks).
void check_files_tiled(const Meta& m, const std::string& where) {
  std::vector<std::vector<const Chunk*>> by_file(m.files.size());
  for (const auto& c : m.chunks) by_file[static_cast<size_t>(c.file)].push_back(&c);
  for (size_t f = 0; f < m.files.size(); ++f) {
    if (static_cast<int64_t>(f) == m.rng_file) continue;
    auto& chunks = by_file[f];
    std::sort(chunks.begin(), chunks.end(),
              [](const Chunk* a, const Chunk* b) { return a->offset < b->offset; });
    int64_t pos = 0;
    const std::string& file = m.files[f].name;
    for (const Chunk* c : chunks) {
      const TensorEntry& t = m.entries[static_cast<size_t>(c->tensor)];
      FSDP_CHECK(c->offset >= pos, where, " puts ", t.key(), " at byte ", c->offset, " of '", file,
                 "', inside the chunk before it; the checkpoint is inconsistent");
      FSDP_CHECK(c->offset == pos, where, ": bytes ", pos, "-", c->offset, " of '", file,
                 "' belong to no tensor (an entry or chunk is missing); the checkpoint is "
                 "incomplete: use an earlier one");
      pos += (c->end - c->begin) * static_cast<int64_t>(c10::elementSize(t.dtype));
    }
    FSDP_CHECK(pos == m.files[f].bytes, where, ": bytes ", pos, "-", m.files[f].bytes, " of '",
               file, "' belong to no tensor (an entry or chunk is missing); the checkpoint is "
               "incomplete: use an earlier one");
  }
}

}  // namespace

void check_manifest(const Meta& m, const std::string& where) {
  std::set<std::string> keys, names;
  for (const auto& t : m.entries) {
    FSDP_CHECK(keys.insert(t.key()).second, where, " lists ", t.key(), " twice; the checkpoint is "
               "inconsistent");
    if (t.kind == "optim") continue;
    FSDP_CHECK(names.insert(t.name).second, where, " lists '", t.name, "' twice (as a ", t.kind,
               " and under another kind or as an alias); the checkpoint is inconsistent");
    for (const auto& a : t.aliases) {
      FSDP_CHECK(names.insert(a).second, where, " lists '", a, "' twice (an alias of '", t.name,
                 "' and a tensor of its own); the checkpoint is inconsistent");
    }
  }
  check_optimizer_entries(m, where);  // the RNG's world: parse_rng
  check_files_tiled(m, where);
}

}  // namespace fsdp::detail
