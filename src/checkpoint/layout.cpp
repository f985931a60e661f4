// Where a sharded model's tensors go in a checkpoint, and rebuilding shards from saved chunks (see
// checkpoint/layout.h).
#include "checkpoint/layout.h"
#include "base/shard_slice.h"

namespace fsdp::detail {

std::vector<bool> fields_present(const OptimizerKind* kind, const torch::optim::Optimizer* o,
                                 const FlatView& u) {
  std::vector<bool> present;
  if (!kind) return present;
  const ParamState* st = find_state(*o, u.param);
  for (const auto& f : kind->fields) present.push_back(st && f.get(*st).defined());
  return present;
}

namespace {

// One parameter of a flat and the entries it owns: its own and one per optimizer field.
struct Slot {
  int64_t flat;
  const FlatParamView* slot;
  int64_t param_entry;
  std::vector<int64_t> field_entries;  // -1 where absent
};

// make_layout's steps.

// 1. Entries: each parameter, each followed by its optimizer state fields that exist.
std::vector<Slot> add_entries(Layout& L, const torch::optim::Optimizer* o,
                              const OptimizerKind* kind) {
  std::vector<Slot> slots;
  for (size_t i = 0; i < L.flats.size(); ++i) {
    const FlatView& u = L.flats[i];
    const std::vector<bool> present = fields_present(kind, o, u);
    const ParamState* st = o ? find_state(*o, u.param) : nullptr;
    for (const auto& s : u.params) {
      TensorEntry t;
      t.name = s.name;
      t.kind = "param";
      t.shape = s.shape;
      t.numel = s.numel;
      t.aliases = s.aliases;
      t.optim_state = st != nullptr;
      if (st && kind->get_step) t.optim_step = kind->get_step(*st);
      Slot slot{static_cast<int64_t>(i), &s, static_cast<int64_t>(L.entries.size()), {}};
      L.entries.push_back(t);
      for (size_t f = 0; f < present.size(); ++f) {
        if (!present[f]) {
          slot.field_entries.push_back(-1);
          continue;
        }
        TensorEntry ft = t;
        ft.kind = "optim";
        ft.field = kind->fields[f].name;
        ft.aliases.clear();
        ft.optim_step.reset();
        ft.optim_state = false;
        slot.field_entries.push_back(static_cast<int64_t>(L.entries.size()));
        L.entries.push_back(ft);
      }
      slots.push_back(std::move(slot));
    }
  }
  return slots;
}

// 2. Chunks of shard file `s`: a unit's params in flat order, each followed by its state fields.
void add_shard_chunks(Layout& L, const std::vector<Slot>& slots, int64_t s) {
  int64_t offset = 0;
  for (const auto& slot : slots) {
    const FlatView& u = L.flats[static_cast<size_t>(slot.flat)];
    const int64_t lo_shard = s * u.shard_numel;
    const auto sl = shard_slice(lo_shard, u.shard_numel, slot.slot->offset, slot.slot->numel);
    if (sl.empty()) continue;
    auto add = [&](int64_t entry, int64_t field) {
      Chunk c;
      c.tensor = entry;
      c.file = s;
      c.offset = offset;
      c.begin = sl.lo - slot.slot->offset;
      c.end = sl.hi - slot.slot->offset;
      c.flat = slot.flat;
      c.shard_offset = sl.lo - lo_shard;
      c.field = field;
      offset += (sl.hi - sl.lo) * 4;
      L.chunks.push_back(c);
    };
    add(slot.param_entry, -1);
    for (size_t f = 0; f < slot.field_entries.size(); ++f) {
      if (slot.field_entries[f] >= 0) add(slot.field_entries[f], static_cast<int64_t>(f));
    }
  }
  L.file_bytes[static_cast<size_t>(s)] = offset;
}

// 3. Buffers: whole, in shard-0.bin, after its shard chunks.
void add_buffers(Layout& L, const torch::nn::Module& root) {
  for (const auto& b : root.named_buffers()) {
    TensorEntry t;
    t.name = b.key();
    t.kind = "buffer";
    t.dtype = b.value().scalar_type();
    (void)dtype_name(t.dtype);
    t.shape = b.value().sizes().vec();
    t.numel = b.value().numel();
    Chunk c;
    c.tensor = static_cast<int64_t>(L.entries.size());
    c.file = 0;
    c.offset = L.file_bytes[0];
    c.begin = 0;
    c.end = t.numel;
    L.file_bytes[0] += t.numel * static_cast<int64_t>(c10::elementSize(t.dtype));
    L.entries.push_back(t);
    L.chunks.push_back(c);
  }
}

}  // namespace

Layout make_layout(const Engine& e, const torch::optim::Optimizer* o, const OptimizerKind* kind) {
  Layout L;
  const int64_t S = e.shard_group()->size();
  L.file_bytes.assign(static_cast<size_t>(S), 0);
  L.flats = e.flat_views();
  const std::vector<Slot> slots = add_entries(L, o, kind);
  for (int64_t s = 0; s < S; ++s) add_shard_chunks(L, slots, s);
  add_buffers(L, e.root_module());
  return L;
}

std::string shard_file_name(int64_t s) { return cat("shard-", s, ".bin"); }

int64_t chunk_bytes(const Chunk& c, const Layout& L) {
  return (c.end - c.begin) *
         static_cast<int64_t>(c10::elementSize(L.entries[static_cast<size_t>(c.tensor)].dtype));
}

at::Tensor chunk_data(const Chunk& c, const Layout& L, const Engine& e,
                      const torch::optim::Optimizer* o, const OptimizerKind* kind) {
  const TensorEntry& t = L.entries[static_cast<size_t>(c.tensor)];
  if (t.kind == "buffer") {
    for (const auto& b : e.root_module().named_buffers()) {
      if (b.key() == t.name) return b.value().detach().cpu().contiguous();
    }
    TORCH_INTERNAL_ASSERT(false, "buffer ", t.name, " vanished");
  }
  const FlatView& u = L.flats[static_cast<size_t>(c.flat)];
  at::Tensor flat = c.field < 0 ? u.param.detach()
                                : kind->fields[static_cast<size_t>(c.field)].get(*find_state(*o, u.param));
  return flat.reshape({-1}).narrow(0, c.shard_offset, c.end - c.begin).cpu().contiguous();
}

at::Tensor build_flat(const Engine& e, const FlatView& u, const SliceSource& source) {
  at::Tensor shard = at::zeros({u.shard_numel}, at::TensorOptions().dtype(at::kFloat));
  const int64_t begin = e.shard_group()->rank() * u.shard_numel;
  for (const auto& s : u.params) {
    const auto sl = detail::shard_slice(begin, u.shard_numel, s.offset, s.numel);
    if (sl.empty()) continue;
    shard.narrow(0, sl.in_shard(), sl.numel())
        .copy_(source(s.name, sl.in_param(), sl.in_param_end()).to(at::kFloat));
  }
  return shard;
}

std::vector<at::Tensor> build_shards(const Engine& e, const SliceSource& source) {
  std::vector<at::Tensor> shards;
  for (const auto& u : e.flat_views()) shards.push_back(build_flat(e, u, source));
  return shards;
}

void check_names(const std::map<std::string, std::vector<int64_t>>& want,
                 const std::map<std::string, std::vector<int64_t>>& have, const std::string& what) {
  std::vector<std::string> problems;
  for (const auto& [name, shape] : want) {
    auto it = have.find(name);
    if (it == have.end()) {
      problems.push_back(cat("missing '", name, "'"));
    } else if (it->second != shape) {
      problems.push_back(cat("'", name, "' has shape ", shape_text(it->second), " but the model's is ",
                             shape_text(shape)));
    }
  }
  for (const auto& [name, shape] : have) {
    if (!want.count(name)) problems.push_back(cat("unexpected '", name, "'"));
  }
  FSDP_CHECK(problems.empty(), what, " does not match the model (", problems.size(),
             problems.size() == 1 ? " problem" : " problems", "): ", join_problems(problems),
             "; load it into the model it was saved from");
}

std::map<std::string, std::vector<int64_t>> model_shapes(torch::nn::Module& m) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().sizes().vec();
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value().sizes().vec();
  return out;
}

}  // namespace fsdp::detail
