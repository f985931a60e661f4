// Sharded and full checkpoints (see fsdp/checkpoint.h, NOTE [checkpoint format]).
#include "fsdp/checkpoint.h"
#include "fsdp/async_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <caffe2/serialize/inline_container.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/optim.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <unordered_map>

#include "checkpoint_io.h"
#include "checkpoint_meta.h"
#include "compat.h"
#include "engine.h"
#include "fsdp/error.h"
#include "fsdp/memory.h"

namespace fsdp {

using detail::cat;
using detail::checked_numel;
using detail::Chunk;
using detail::crc32_of;
using detail::dtype_from_name;
using detail::dtype_name;
using detail::Engine;
using detail::errno_text;
using detail::File;
using detail::get_field;
using detail::json;
using detail::kCheckpointFormatName;
using detail::kCheckpointFormatVersion;
using detail::kMaxMetaBytes;
using detail::Meta;
using detail::parent_dir;
using detail::read_meta;
using detail::sync_dir;
using detail::TensorEntry;
using detail::UnitState;
using detail::write_file_atomically;
namespace fs = std::filesystem;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// ---------------------------------------------------------------------------------------------
// Messages

std::string shape_text(const std::vector<int64_t>& shape) {
  return cat(c10::IntArrayRef(shape));
}

// Joins up to 20 problems, then "and N more".
std::string join_problems(const std::vector<std::string>& problems) {
  std::string s;
  for (size_t i = 0; i < problems.size() && i < 20; ++i) s += (i ? "; " : "") + problems[i];
  if (problems.size() > 20) s += cat("; and ", problems.size() - 20, " more");
  return s;
}

// ---------------------------------------------------------------------------------------------
// Optimizer state, per type. Element-wise state tensors have the shape of the flat shard; the
// step count is one number per shard.

using ParamState = torch::optim::OptimizerParamState;

struct StateField {
  std::string name;
  std::function<at::Tensor(const ParamState&)> get;
  std::function<void(ParamState&, const at::Tensor&)> set;
};

struct OptimizerKind {
  std::string name;
  std::vector<StateField> fields;
  std::function<std::unique_ptr<ParamState>()> make;
  std::function<int64_t(const ParamState&)> get_step;  // null: no step count
  std::function<void(ParamState&, int64_t)> set_step;
};

#define FSDP_FIELD(State, f)                                                  \
  StateField {                                                                \
    #f, [](const ParamState& s) { return static_cast<const State&>(s).f(); }, \
        [](ParamState& s, const at::Tensor& v) { static_cast<State&>(s).f(v); } \
  }

template <class State>
OptimizerKind kind_with_step(std::string name, std::vector<StateField> fields) {
  OptimizerKind k;
  k.name = std::move(name);
  k.fields = std::move(fields);
  k.make = [] { return std::make_unique<State>(); };
  k.get_step = [](const ParamState& s) { return static_cast<const State&>(s).step(); };
  k.set_step = [](ParamState& s, int64_t v) { static_cast<State&>(s).step(v); };
  return k;
}

OptimizerKind optimizer_kind(const torch::optim::Optimizer& o) {
  namespace optim = torch::optim;
  if (dynamic_cast<const optim::AdamW*>(&o)) {
    return kind_with_step<optim::AdamWParamState>(
        "adamw", {FSDP_FIELD(optim::AdamWParamState, exp_avg),
                  FSDP_FIELD(optim::AdamWParamState, exp_avg_sq),
                  FSDP_FIELD(optim::AdamWParamState, max_exp_avg_sq)});
  }
  if (dynamic_cast<const optim::Adam*>(&o)) {
    return kind_with_step<optim::AdamParamState>(
        "adam", {FSDP_FIELD(optim::AdamParamState, exp_avg),
                 FSDP_FIELD(optim::AdamParamState, exp_avg_sq),
                 FSDP_FIELD(optim::AdamParamState, max_exp_avg_sq)});
  }
  if (dynamic_cast<const optim::RMSprop*>(&o)) {
    return kind_with_step<optim::RMSpropParamState>(
        "rmsprop", {FSDP_FIELD(optim::RMSpropParamState, square_avg),
                    FSDP_FIELD(optim::RMSpropParamState, momentum_buffer),
                    FSDP_FIELD(optim::RMSpropParamState, grad_avg)});
  }
  if (dynamic_cast<const optim::Adagrad*>(&o)) {
    return kind_with_step<optim::AdagradParamState>(
        "adagrad", {FSDP_FIELD(optim::AdagradParamState, sum)});
  }
  if (dynamic_cast<const optim::SGD*>(&o)) {
    OptimizerKind k;
    k.name = "sgd";
    k.fields = {FSDP_FIELD(optim::SGDParamState, momentum_buffer)};
    k.make = [] { return std::make_unique<optim::SGDParamState>(); };
    return k;
  }
  throw Error("checkpoints support the torch::optim optimizers Adam, AdamW, SGD, RMSprop and "
              "Adagrad; this optimizer is none of them (LBFGS keeps history that is not per "
              "element); pass nullptr to save the model alone");
}
#undef FSDP_FIELD

const ParamState* find_state(const torch::optim::Optimizer& o, const at::Tensor& p) {
  auto it = o.state().find(compat::optimizer_state_key(p));
  return it == o.state().end() ? nullptr : it->second.get();
}

// Every optimizer parameter must be one of the model's trainable shards.
void check_optimizer_params(const torch::optim::Optimizer& o, const Engine& e) {
  e.check_optimizer(o);
}

// ---------------------------------------------------------------------------------------------
// The layout of a sharded checkpoint for the saving engine (identical on every rank).

struct Layout {
  std::vector<TensorEntry> entries;
  std::vector<Chunk> chunks;
  std::vector<int64_t> file_bytes;  // per shard index
};

// Which optimizer state fields exist (defined) for the shard of `u`, per kind.fields index.
std::vector<bool> fields_present(const OptimizerKind* kind, const torch::optim::Optimizer* o,
                                 const UnitState& u) {
  std::vector<bool> present;
  if (!kind) return present;
  const ParamState* st = find_state(*o, u.shard);
  for (const auto& f : kind->fields) present.push_back(st && f.get(*st).defined());
  return present;
}

Layout make_layout(const Engine& e, const torch::optim::Optimizer* o, const OptimizerKind* kind) {
  Layout L;
  const int64_t S = e.shard_group()->size();
  L.file_bytes.assign(static_cast<size_t>(S), 0);
  struct Slot {
    const UnitState* unit;
    const detail::ParamSlot* slot;
    int64_t param_entry;
    std::vector<int64_t> field_entries;  // -1 where absent
  };
  std::vector<Slot> slots;
  for (const auto& u : e.unit_states()) {
    const std::vector<bool> present = fields_present(kind, o, *u);
    const ParamState* st = o ? find_state(*o, u->shard) : nullptr;
    for (const auto& s : u->params) {
      TensorEntry t;
      t.name = s.name;
      t.kind = "param";
      t.shape = s.shape;
      t.numel = s.numel;
      t.aliases = s.aliases;
      t.optim_state = st != nullptr;
      if (st && kind->get_step) t.optim_step = kind->get_step(*st);
      Slot slot{u.get(), &s, static_cast<int64_t>(L.entries.size()), {}};
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
  // Chunks, file by file: a unit's params in flat order, each followed by its state fields.
  for (int64_t s = 0; s < S; ++s) {
    int64_t offset = 0;
    for (const auto& slot : slots) {
      const UnitState& u = *slot.unit;
      const int64_t lo_shard = s * u.shard_numel, hi_shard = lo_shard + u.shard_numel;
      const int64_t lo = std::max(lo_shard, slot.slot->offset);
      const int64_t hi = std::min(hi_shard, slot.slot->offset + slot.slot->numel);
      if (lo >= hi) continue;
      auto add = [&](int64_t entry, int64_t field) {
        Chunk c;
        c.tensor = entry;
        c.file = s;
        c.offset = offset;
        c.begin = lo - slot.slot->offset;
        c.end = hi - slot.slot->offset;
        c.unit = &u;
        c.shard_offset = lo - lo_shard;
        c.field = field;
        offset += (hi - lo) * 4;
        L.chunks.push_back(c);
      };
      add(slot.param_entry, -1);
      for (size_t f = 0; f < slot.field_entries.size(); ++f) {
        if (slot.field_entries[f] >= 0) add(slot.field_entries[f], static_cast<int64_t>(f));
      }
    }
    L.file_bytes[static_cast<size_t>(s)] = offset;
  }
  // Buffers: whole, in shard-0.bin.
  for (const auto& b : e.root_module().named_buffers()) {
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
  return L;
}

std::string shard_file_name(int64_t s) { return cat("shard-", s, ".bin"); }

// The size of chunk `c` in its file.
int64_t chunk_bytes(const Chunk& c, const Layout& L) {
  return (c.end - c.begin) *
         static_cast<int64_t>(c10::elementSize(L.entries[static_cast<size_t>(c.tensor)].dtype));
}

// The bytes of chunk `c` on its writer.
at::Tensor chunk_data(const Chunk& c, const Layout& L, const Engine& e,
                      const torch::optim::Optimizer* o, const OptimizerKind* kind) {
  const TensorEntry& t = L.entries[static_cast<size_t>(c.tensor)];
  if (t.kind == "buffer") {
    for (const auto& b : e.root_module().named_buffers()) {
      if (b.key() == t.name) return b.value().detach().cpu().contiguous();
    }
    TORCH_INTERNAL_ASSERT(false, "buffer ", t.name, " vanished");
  }
  at::Tensor flat = c.field < 0 ? c.unit->shard.detach()
                                : kind->fields[static_cast<size_t>(c.field)].get(*find_state(*o, c.unit->shard));
  return flat.reshape({-1}).narrow(0, c.shard_offset, c.end - c.begin).cpu().contiguous();
}

// ---------------------------------------------------------------------------------------------
// RNG

at::Tensor cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// ---------------------------------------------------------------------------------------------
// Reading (meta.json: checkpoint_meta.cpp).

// Reads chunk `c` of meta `m` (whole, verifying its CRC) as a 1-D tensor of its dtype.
at::Tensor read_chunk(const Meta& m, const Chunk& c, std::map<int64_t, std::unique_ptr<File>>& open) {
  const TensorEntry& t = m.entries[static_cast<size_t>(c.tensor)];
  auto& f = open[c.file];
  const std::string name = m.files[static_cast<size_t>(c.file)].name;
  if (!f) f = std::make_unique<File>(m.path + "/" + name, O_RDONLY);
  at::Tensor out = at::empty({c.end - c.begin}, at::TensorOptions().dtype(t.dtype));
  const int64_t n = out.numel() * static_cast<int64_t>(out.element_size());
  f->read_at(out.data_ptr(), n, c.offset);
  FSDP_CHECK(crc32_of(out.data_ptr(), n) == c.crc, "checkpoint '", m.path, "': '", name,
             "' is corrupted (CRC-32 mismatch at byte ", c.offset, ", ", t.key(),
             "); use an earlier checkpoint");
  return out;
}

// ---------------------------------------------------------------------------------------------
// Loading into the engine's layout: names, shapes, and the shards a rank needs.

// The values a loader needs: (name, element range) -> tensor. Implemented per format.
using SliceSource = std::function<at::Tensor(const std::string& name, int64_t lo, int64_t hi)>;

// New fp32 shards for every unit of `e`, from `source` (parameters only).
std::vector<at::Tensor> build_shards(const Engine& e, const SliceSource& source) {
  std::vector<at::Tensor> shards;
  for (const auto& u : e.unit_states()) {
    at::Tensor shard = at::zeros({u->shard_numel}, at::TensorOptions().dtype(at::kFloat));
    const int64_t begin = e.shard_group()->rank() * u->shard_numel, end = begin + u->shard_numel;
    for (const auto& s : u->params) {
      const int64_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + s.numel);
      if (lo >= hi) continue;
      shard.narrow(0, lo - begin, hi - lo)
          .copy_(source(s.name, lo - s.offset, hi - s.offset).to(at::kFloat));
    }
    shards.push_back(shard);
  }
  return shards;
}

// Copies new shards into the model and frees stale gathered copies.
void commit_shards(Engine& e, const std::vector<at::Tensor>& shards) {
  torch::NoGradGuard no_grad;
  const auto& units = e.unit_states();
  for (size_t i = 0; i < units.size(); ++i) {
    units[i]->shard.detach().copy_(shards[i].to(units[i]->shard.device()));
  }
  e.drop_gathered();
}

// Names and shapes of what the model has against what a file has; every mismatch, in one line.
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

// Runs `fn` and turns its exception into a message ("" on success).
std::string capture(const std::function<void()>& fn) {
  try {
    fn();
    return "";
  } catch (const std::exception& e) {
    return error_message(e);
  }
}

}  // namespace

// =============================================================================================
// Sharded checkpoints

std::string checkpoint_path(const std::string& dir, int64_t step) {
  FSDP_CHECK(step >= 0, "checkpoint step ", step, " is negative");
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08lld", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

namespace {

// A sharded save between its phases (NOTE [async checkpoint] in fsdp/async_checkpoint.h):
// prepare_save (collective), write_shard_file (local, any thread), commit_save (collective).
struct PendingSave {
  std::string path, partial, what;
  Runtime* rt = nullptr;
  std::shared_ptr<Engine> engine;  // keeps the chunks' unit pointers valid
  Layout layout;
  std::optional<OptimizerKind> kind;
  std::vector<double> lrs;
  std::string meta_state;
  int64_t s_index = 0;
  bool writer = false;
  at::Tensor crcs;  // per chunk its CRC, then per file its CRC (summed over ranks at commit)
  at::Tensor rng;   // this rank's generator state at the save
  std::chrono::steady_clock::time_point t0;
};

// 1. Validate (pure, every rank) and prepare the directory (rank 0). Store only.
PendingSave prepare_save(const std::string& path, FullyShardedModule& model,
                         const torch::optim::Optimizer* optimizer, const TrainingState& state,
                         const CheckpointOptions& options) {
  PendingSave p;
  p.t0 = std::chrono::steady_clock::now();
  p.engine = detail::engine_of(model);
  Engine& e = *p.engine;
  p.rt = e.runtime().get();
  Runtime& rt = *p.rt;
  p.path = path;
  p.what = cat("saving checkpoint '", path, "'");
  FSDP_CHECK(!path.empty(), "save_checkpoint: the path is empty");
  p.partial = path + ".partial";
  std::string err = capture([&] {
    if (optimizer) {
      p.kind = optimizer_kind(*optimizer);
      check_optimizer_params(*optimizer, e);
      for (const auto& g : optimizer->param_groups()) p.lrs.push_back(g.options().get_lr());
    }
    json s;
    s["step"] = state.step;
    s["values"] = json::object();
    for (const auto& [k, v] : state.values) s["values"][k] = v;
    try {
      p.meta_state = s.dump();
    } catch (const json::exception&) {
      throw Error("TrainingState values must be UTF-8 text; encode binary data (e.g. as hex)");
    }
    if (rt.rank() == 0) {
      std::error_code ec;
      fs::create_directories(parent_dir(path), ec);
      FSDP_CHECK(!ec, "cannot create the directory '", parent_dir(path), "': ", ec.message(),
                 "; choose a writable place");
      fs::remove_all(p.partial, ec);
      FSDP_CHECK(!ec, "cannot remove the leftover '", p.partial, "': ", ec.message());
      FSDP_CHECK(::mkdir(p.partial.c_str(), 0755) == 0, "cannot create '", p.partial, "': ",
                 errno_text(), "; check that the directory is writable");
    }
  });
  rt.check_all_ok(p.what, err);
  p.layout = make_layout(e, optimizer, p.kind ? &*p.kind : nullptr);
  p.s_index = e.shard_group()->rank();
  p.writer = e.replicate_group()->rank() == 0;
  const auto chunks = static_cast<int64_t>(p.layout.chunks.size());
  p.crcs = at::zeros({chunks + e.shard_group()->size()}, at::TensorOptions().dtype(at::kLong));
  if (options.rng) p.rng = cpu_rng_state().contiguous().clone();
  return p;
}

// The chunks of the file this rank writes (none unless it is its shard index's writer), in
// file order.
std::vector<int64_t> my_chunks(const PendingSave& p) {
  std::vector<int64_t> out;
  if (!p.writer) return out;
  for (size_t i = 0; i < p.layout.chunks.size(); ++i) {
    if (p.layout.chunks[i].file == p.s_index) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

// 2. The writer of each shard index writes its file from `bytes(chunk)` (the chunk's data,
// layout.chunks[chunk] long) and fsyncs it. Local: no collective, no model access unless
// `bytes` reads the model. Returns "" or the error message.
std::string write_shard_file(PendingSave& p,
                             const std::function<const void*(int64_t chunk)>& bytes) {
  return capture([&] {
    struct stat st {};
    FSDP_CHECK(::stat(p.partial.c_str(), &st) == 0, "rank ", p.rt->rank(), " cannot see '",
               p.partial, "', which rank 0 created; every rank must see the same checkpoint "
               "directory (use a shared filesystem on several nodes)");
    if (!p.writer) return;
    File f(p.partial + "/" + shard_file_name(p.s_index), O_WRONLY | O_CREAT | O_TRUNC);
    auto* c = p.crcs.data_ptr<int64_t>();
    uint32_t file_crc = 0;
    for (int64_t i : my_chunks(p)) {
      const Chunk& ch = p.layout.chunks[static_cast<size_t>(i)];
      const int64_t n = chunk_bytes(ch, p.layout);
      const void* data = bytes(i);
      const uint32_t crc = crc32_of(data, n);
      c[i] = crc;
      file_crc = static_cast<uint32_t>(::crc32_combine(file_crc, crc, static_cast<z_off_t>(n)));
      f.write(data, n);
    }
    c[static_cast<int64_t>(p.layout.chunks.size()) + p.s_index] = file_crc;
    f.sync_and_close();
  });
}

// Sums (or, for all_gather, concatenates) a small CPU tensor over the world on the runtime's
// device: ProcessGroupNCCL takes device tensors only.
at::Tensor world_sum(Runtime& rt, const at::Tensor& t) {
  if (rt.world_size() == 1) return t;
  at::Tensor d = t.to(rt.device());
  rt.world()->all_reduce(d)->wait();
  return d.cpu();
}
at::Tensor world_gather(Runtime& rt, const at::Tensor& mine) {
  if (rt.world_size() == 1) return mine.clone();
  at::Tensor d = mine.to(rt.device());
  at::Tensor all = at::empty({rt.world_size() * mine.numel()}, d.options());
  rt.world()->all_gather(all, d)->wait();
  return all.cpu();
}

// 4a. meta.json (NOTE [checkpoint format]) for a save whose files are written.
json save_meta(const PendingSave& p, const at::Tensor& crcs, const at::Tensor& rng,
               int64_t& total_bytes) {
  const Engine& e = *p.engine;
  const Runtime& rt = *p.rt;
  const Layout& L = p.layout;
  const auto chunks = static_cast<int64_t>(L.chunks.size());
  json meta;
  meta["format"] = kCheckpointFormatName;
  meta["format_version"] = kCheckpointFormatVersion;
  meta["world_size"] = rt.world_size();
  meta["strategy"] = to_string(e.plan().strategy);
  meta["mesh"] = {e.plan().replicate_size(), e.plan().shard_size()};
  meta["state"] = json::parse(p.meta_state);
  meta["optimizer"] = p.kind ? json{{"type", p.kind->name}, {"lr", p.lrs}} : json(nullptr);
  json jfiles = json::array();
  const auto* c = crcs.data_ptr<int64_t>();
  for (size_t s = 0; s < L.file_bytes.size(); ++s) {
    jfiles.push_back({{"name", shard_file_name(static_cast<int64_t>(s))},
                      {"bytes", L.file_bytes[s]},
                      {"crc32", static_cast<uint32_t>(c[chunks + static_cast<int64_t>(s)])}});
    total_bytes += L.file_bytes[s];
  }
  if (rng.defined()) {
    const int64_t n = rng.numel();
    jfiles.push_back({{"name", "rng.bin"}, {"bytes", n}, {"crc32", crc32_of(rng.data_ptr(), n)}});
    meta["rng"] = {{"file", "rng.bin"}, {"world_size", rt.world_size()},
                   {"bytes_per_rank", n / rt.world_size()}};
    total_bytes += n;
  } else {
    meta["rng"] = nullptr;
  }
  meta["files"] = jfiles;
  std::vector<json> by_entry(L.entries.size());
  for (size_t i = 0; i < L.entries.size(); ++i) {
    const TensorEntry& t = L.entries[i];
    json jt;
    jt["name"] = t.name;
    jt["kind"] = t.kind;
    if (t.kind == "optim") jt["field"] = t.field;
    jt["dtype"] = dtype_name(t.dtype);
    jt["shape"] = t.shape;
    if (!t.aliases.empty()) jt["aliases"] = t.aliases;
    if (t.kind == "param") {
      jt["optim_state"] = t.optim_state;
      jt["optim_step"] = t.optim_step ? json(*t.optim_step) : json(nullptr);
    }
    jt["chunks"] = json::array();
    by_entry[i] = jt;
  }
  for (int64_t i = 0; i < chunks; ++i) {
    const Chunk& ch = L.chunks[static_cast<size_t>(i)];
    by_entry[static_cast<size_t>(ch.tensor)]["chunks"].push_back(
        {{"file", shard_file_name(ch.file)}, {"offset", ch.offset}, {"begin", ch.begin},
         {"end", ch.end}, {"crc32", static_cast<uint32_t>(c[i])}});
  }
  json tensors = json::array();
  for (auto& jt : by_entry) tensors.push_back(std::move(jt));
  meta["tensors"] = std::move(tensors);
  return meta;
}

// 4b. Rank 0 moves the finished directory into place. An existing checkpoint at the path (a
// re-save of the same step) is moved aside first and removed after.
void rename_checkpoint_into_place(const std::string& partial, const std::string& path) {
  sync_dir(partial);
  std::error_code ec;
  const std::string old = path + ".old";
  fs::remove_all(old, ec);
  const bool replace = fs::exists(path);
  if (replace) {
    FSDP_CHECK(::rename(path.c_str(), old.c_str()) == 0, "cannot move the existing '", path,
               "' aside: ", errno_text());
  }
  FSDP_CHECK(::rename(partial.c_str(), path.c_str()) == 0, "cannot rename '", partial, "' to '",
             path, "': ", errno_text());
  sync_dir(parent_dir(path));
  if (replace) fs::remove_all(old, ec);
}

// 3 and 4. Every rank reports how its write went (a failure anywhere stops the save on every
// rank); the CRCs and every rank's RNG state are collected; rank 0 writes rng.bin and meta.json
// and renames the directory into place. Collective.
CheckpointInfo commit_save(PendingSave& p, const std::string& write_error) {
  Runtime& rt = *p.rt;
  rt.check_all_ok(p.what, write_error);
  const at::Tensor crcs = world_sum(rt, p.crcs);
  const at::Tensor rng = p.rng.defined() ? world_gather(rt, p.rng) : at::Tensor();
  int64_t total_bytes = 0, files = 0;
  std::string err = capture([&] {
    if (rt.rank() != 0) return;
    if (rng.defined()) {
      File f(p.partial + "/rng.bin", O_WRONLY | O_CREAT | O_TRUNC);
      f.write(rng.data_ptr(), rng.numel());
      f.sync_and_close();
    }
    json meta = save_meta(p, crcs, rng, total_bytes);
    files = static_cast<int64_t>(meta["files"].size()) + 1;
    const std::string text = meta.dump(1);
    write_file_atomically(p.partial + "/meta.json", text);
    total_bytes += static_cast<int64_t>(text.size());
    rename_checkpoint_into_place(p.partial, p.path);
  });
  rt.check_all_ok(p.what, err);
  CheckpointInfo info;
  info.path = p.path;
  info.bytes = total_bytes;
  info.files = files;
  info.seconds = seconds_since(p.t0);
  return info;
}

}  // namespace

CheckpointInfo save_checkpoint(const std::string& path, FullyShardedModule& model,
                               const torch::optim::Optimizer* optimizer,
                               const TrainingState& state, const CheckpointOptions& options) {
  PendingSave p = prepare_save(path, model, optimizer, state, options);
  const OptimizerKind* kind = p.kind ? &*p.kind : nullptr;
  at::Tensor current;  // the chunk being written, alive until the next one
  const std::string err = write_shard_file(p, [&](int64_t i) {
    current = chunk_data(p.layout.chunks[static_cast<size_t>(i)], p.layout, *p.engine,
                         optimizer, kind);
    return static_cast<const void*>(current.data_ptr());
  });
  return commit_save(p, err);
}

// ---------------------------------------------------------------------------------------------
// Asynchronous save (fsdp/async_checkpoint.h, NOTE [async checkpoint])

struct AsyncCheckpointer::Impl {
  std::optional<PendingSave> pending;
  at::Tensor staging;  // bytes, kept between saves
  std::thread writer;
  std::atomic<bool> written{false};
  std::string write_error;  // set by the writer thread before `written`
  std::string pending_path;
  double last_blocked = 0;

  ~Impl() {
    if (writer.joinable()) writer.join();
    detail::add_checkpoint_staging_bytes(-staging_bytes());
  }
  int64_t staging_bytes() const { return staging.defined() ? staging.numel() : 0; }
  void join() {
    if (writer.joinable()) writer.join();
  }
  CheckpointInfo commit() {
    join();
    PendingSave p = std::move(*pending);
    pending.reset();
    pending_path.clear();
    return commit_save(p, write_error);
  }
};

AsyncCheckpointer::AsyncCheckpointer() : impl_(std::make_unique<Impl>()) {}

AsyncCheckpointer::~AsyncCheckpointer() = default;  // Impl joins the writer

void AsyncCheckpointer::save(const std::string& path, FullyShardedModule& model,
                             const torch::optim::Optimizer* optimizer,
                             const TrainingState& state, const CheckpointOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  Impl& m = *impl_;
  if (m.pending) m.commit();
  m.pending = prepare_save(path, model, optimizer, state, options);
  m.pending_path = path;
  PendingSave& p = *m.pending;
  // Stage this rank's file, laid out as on disk, so the writer needs nothing else.
  const std::vector<int64_t> mine = my_chunks(p);
  const int64_t bytes = p.writer ? p.layout.file_bytes[static_cast<size_t>(p.s_index)] : 0;
  if (!m.staging.defined() || m.staging.numel() < bytes) {
    detail::add_checkpoint_staging_bytes(bytes - m.staging_bytes());
    m.staging = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(
                                       p.rt->device().is_cuda()));
  }
  const OptimizerKind* kind = p.kind ? &*p.kind : nullptr;
  auto* base = m.staging.data_ptr<uint8_t>();
  for (int64_t i : mine) {
    const Chunk& ch = p.layout.chunks[static_cast<size_t>(i)];
    at::Tensor src = chunk_data(ch, p.layout, *p.engine, optimizer, kind);
    std::memcpy(base + ch.offset, src.data_ptr(), static_cast<size_t>(chunk_bytes(ch, p.layout)));
  }
  // Write in the background (NOTE [async checkpoint]): files only, no collective.
  m.written = false;
  m.write_error.clear();
  m.writer = std::thread([&m, base] {
    // Below the training threads: the write waits for the disk, not for the CPU.
    ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
    m.write_error = write_shard_file(*m.pending, [&](int64_t i) -> const void* {
      return base + m.pending->layout.chunks[static_cast<size_t>(i)].offset;
    });
    m.written = true;
  });
  m.last_blocked = seconds_since(t0);
}

std::optional<CheckpointInfo> AsyncCheckpointer::poll() {
  Impl& m = *impl_;
  if (!m.pending) return std::nullopt;
  Runtime& rt = *m.pending->rt;
  const at::Tensor done = at::full({1}, m.written ? 1 : 0, at::TensorOptions().dtype(at::kLong));
  if (world_sum(rt, done).item<int64_t>() < rt.world_size()) return std::nullopt;
  return m.commit();
}

std::optional<CheckpointInfo> AsyncCheckpointer::wait() {
  Impl& m = *impl_;
  if (!m.pending) return std::nullopt;
  return m.commit();
}

bool AsyncCheckpointer::in_flight() const { return impl_->pending.has_value(); }
const std::string& AsyncCheckpointer::in_flight_path() const { return impl_->pending_path; }
int64_t AsyncCheckpointer::staging_bytes() const { return impl_->staging_bytes(); }
double AsyncCheckpointer::last_blocked_seconds() const { return impl_->last_blocked; }

CheckpointInfo load_checkpoint(const std::string& path, FullyShardedModule& model,
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
          const int64_t begin = s * u->shard_numel, end = begin + u->shard_numel;
          for (const auto& f : kind->fields) {
            at::Tensor flat;
            for (const auto& slot : u->params) {
              auto it = entry_of.find(cat("optim/", f.name, "/", slot.name));
              if (it == entry_of.end()) continue;
              if (!flat.defined()) flat = at::zeros({u->shard_numel}, at::kFloat);
              const int64_t lo = std::max(begin, slot.offset), hi = std::min(end, slot.offset + slot.numel);
              if (lo >= hi) continue;
              flat.narrow(0, lo - begin, hi - lo).copy_(slice(it->second, lo - slot.offset, hi - slot.offset));
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
      FSDP_CHECK(crc32_of(all.data(), static_cast<int64_t>(all.size())) == m.files[m.rng_file].crc,
                 "checkpoint '", path, "': rng.bin is corrupted (CRC-32 mismatch); use an "
                 "earlier checkpoint");
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

// =============================================================================================
// Full checkpoints

namespace {

enum class FullFormat { kPt, kSafetensors };

FullFormat full_format(const std::string& file) {
  auto ends = [&](const std::string& x) {
    return file.size() > x.size() && file.compare(file.size() - x.size(), x.size(), x) == 0;
  };
  if (ends(".pt") || ends(".pth")) return FullFormat::kPt;
  if (ends(".safetensors")) return FullFormat::kSafetensors;
  throw Error(cat("full checkpoint '", file, "' must end in .pt (PyTorch's format) or "
                  ".safetensors"));
}

struct FullEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t bytes() const {
    return checked_numel(shape, name) * static_cast<int64_t>(c10::elementSize(dtype));
  }
};

// Writes entries in order: begin() once, then data for each entry in the same order.
class FullWriter {
 public:
  virtual ~FullWriter() = default;
  virtual void write(const at::Tensor& contiguous_cpu) = 0;
  virtual void finish() = 0;
};

class SafetensorsWriter final : public FullWriter {
 public:
  SafetensorsWriter(const std::string& path, const std::vector<FullEntry>& entries)
      : file_(path, O_WRONLY | O_CREAT | O_TRUNC) {
    json header;
    header["__metadata__"] = {{"format", "pt"}, {"producer", "fsdp.cpp"}};
    int64_t offset = 0;
    for (const auto& e : entries) {
      const int64_t n = e.bytes();
      header[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape},
                        {"data_offsets", {offset, offset + n}}};
      offset += n;
    }
    std::string text = header.dump();
    text.resize((text.size() + 7) / 8 * 8, ' ');  // data starts 8-byte aligned
    uint64_t len = text.size();
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(len >> (8 * i));
    file_.write(le, 8);
    file_.write(text.data(), static_cast<int64_t>(text.size()));
  }
  void write(const at::Tensor& t) override {
    file_.write(t.data_ptr(), t.numel() * static_cast<int64_t>(t.element_size()));
  }
  void finish() override { file_.sync_and_close(); }

 private:
  File file_;
};

// PyTorch's zip format as torch.save writes it: data.pkl (a dict name -> tensor whose storages
// are persistent ids "0", "1", ...), then one record data/<id> per tensor. The pickle is made
// first from placeholder tensors (right shapes, no memory), so tensors can be written one by one.
// The zip writer's destructor finishes an unfinished archive, so its sink never throws: the
// first error is kept, later writes are dropped, and write()/finish() report it (issue 21).
class PtWriter final : public FullWriter {
 public:
  PtWriter(const std::string& path, const std::vector<FullEntry>& entries)
      : file_(path, O_WRONLY | O_CREAT | O_TRUNC), zip_([this](const void* data, size_t n) {
          if (error_.empty()) error_ = capture([&] { file_.write(data, static_cast<int64_t>(n)); });
          return n;
        }) {
    c10::Dict<std::string, at::Tensor> dict;
    std::unordered_map<const c10::TensorImpl*, std::string> ids;
    std::vector<at::Tensor> placeholders;
    for (size_t i = 0; i < entries.size(); ++i) {
      const auto& e = entries[i];
      c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(e.bytes()),
                           at::DataPtr(nullptr, at::Device(at::kCPU)), nullptr, false);
      at::Tensor t = at::empty({0}, at::TensorOptions().dtype(e.dtype));
      t.set_(storage, 0, e.shape, c10::contiguous_strides(e.shape));
      ids[t.unsafeGetTensorImpl()] = std::to_string(i);
      placeholders.push_back(t);
      dict.insert(e.name, t);
    }
    std::string pickle;
    torch::jit::Pickler pickler(
        [&](const char* data, size_t n) { pickle.append(data, n); }, nullptr, nullptr, nullptr,
        [&](const at::Tensor& t) { return ids.at(t.unsafeGetTensorImpl()); },
        /*tag_aggregates=*/false);
    pickler.protocol();
    pickler.pushIValue(dict);
    pickler.stop();
    zip_.writeRecord("data.pkl", pickle.data(), pickle.size());
    zip_.writeRecord("byteorder", "little", 6);
    FSDP_CHECK(error_.empty(), error_);
  }
  void write(const at::Tensor& t) override {
    zip_.writeRecord(cat("data/", next_++), t.data_ptr(),
                     static_cast<size_t>(t.numel()) * t.element_size());
    FSDP_CHECK(error_.empty(), error_);
  }
  void finish() override {
    zip_.writeEndOfFile();
    FSDP_CHECK(error_.empty(), error_);
    file_.sync_and_close();
  }

 private:
  File file_;  // before zip_: its destructor writes into file_
  std::string error_;
  caffe2::serialize::PyTorchStreamWriter zip_;
  int64_t next_ = 0;
};

std::unique_ptr<FullWriter> make_writer(const std::string& path, FullFormat format,
                                        const std::vector<FullEntry>& entries) {
  if (format == FullFormat::kPt) return std::make_unique<PtWriter>(path, entries);
  return std::make_unique<SafetensorsWriter>(path, entries);
}

void rename_into_place(const std::string& tmp, const std::string& file) {
  FSDP_CHECK(::rename(tmp.c_str(), file.c_str()) == 0, "cannot rename '", tmp, "' to '", file,
             "': ", errno_text());
  sync_dir(parent_dir(file));
}

// A full checkpoint opened for reading: names, shapes and slices.
class FullReader {
 public:
  virtual ~FullReader() = default;
  std::map<std::string, std::vector<int64_t>> shapes;
  // Elements [lo, hi) of the flattened tensor `name`, in its stored dtype.
  virtual at::Tensor slice(const std::string& name, int64_t lo, int64_t hi) = 0;
};

class PtReader final : public FullReader {
 public:
  explicit PtReader(const std::string& path) {
    File f(path, O_RDONLY);
    std::vector<char> data(static_cast<size_t>(f.size()));
    if (!data.empty()) f.read_at(data.data(), static_cast<int64_t>(data.size()), 0);
    c10::IValue v;
    try {
      v = torch::jit::pickle_load(data);
    } catch (const std::exception& e) {
      throw Error(cat("'", path, "' is not a readable PyTorch file (", error_message(e), ")"));
    }
    FSDP_CHECK(v.isGenericDict(), "'", path, "' holds a ", v.tagKind(), ", not a dict of "
               "tensors; save a state dict (name -> tensor)");
    for (const auto& kv : v.toGenericDict()) {
      FSDP_CHECK(kv.key().isString() && kv.value().isTensor(), "'", path, "' has an entry that "
                 "is not name -> tensor; save a state dict");
      at::Tensor t = kv.value().toTensor();
      shapes[kv.key().toStringRef()] = t.sizes().vec();
      tensors_[kv.key().toStringRef()] = t.contiguous().view({-1});
    }
  }
  at::Tensor slice(const std::string& name, int64_t lo, int64_t hi) override {
    return tensors_.at(name).narrow(0, lo, hi - lo);
  }

 private:
  std::map<std::string, at::Tensor> tensors_;
};

class SafetensorsReader final : public FullReader {
 public:
  explicit SafetensorsReader(const std::string& path) : path_(path), file_(path, O_RDONLY) {
    const int64_t size = file_.size();
    FSDP_CHECK(size >= 8, "'", path, "' is not a safetensors file (", size, " bytes)");
    unsigned char le[8];
    file_.read_at(le, 8, 0);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | le[i];
    FSDP_CHECK(n <= static_cast<uint64_t>(std::min<int64_t>(size - 8, kMaxMetaBytes)), "'", path,
               "' has a header length of ", n, " bytes, beyond the file; it is not a valid "
               "safetensors file");
    std::string text(static_cast<size_t>(n), '\0');
    file_.read_at(text.data(), static_cast<int64_t>(n), 8);
    data_start_ = 8 + static_cast<int64_t>(n);
    const int64_t data_size = size - data_start_;
    json h = json::parse(text, nullptr, false);
    FSDP_CHECK(!h.is_discarded() && h.is_object(), "'", path, "' has an invalid safetensors "
               "header (not a JSON object)");
    for (const auto& [name, t] : h.items()) {
      if (name == "__metadata__") continue;
      const std::string w = cat("'", path, "' tensor '", name, "'");
      auto dtype = dtype_from_name(get_field<std::string>(t, "dtype", w));
      FSDP_CHECK(dtype, w, " has a dtype this reader does not know");
      auto shape = get_field<std::vector<int64_t>>(t, "shape", w);
      auto off = get_field<std::vector<int64_t>>(t, "data_offsets", w);
      const int64_t numel = checked_numel(shape, w);
      FSDP_CHECK(off.size() == 2 && off[0] >= 0 && off[0] <= off[1] && off[1] <= data_size &&
                     off[1] - off[0] == numel * static_cast<int64_t>(c10::elementSize(*dtype)),
                 w, " has data offsets outside the file or of the wrong size; the file is "
                 "corrupted");
      shapes[name] = shape;
      info_[name] = {*dtype, off[0]};
    }
  }
  at::Tensor slice(const std::string& name, int64_t lo, int64_t hi) override {
    const auto& [dtype, offset] = info_.at(name);
    at::Tensor out = at::empty({hi - lo}, at::TensorOptions().dtype(dtype));
    const auto elem = static_cast<int64_t>(c10::elementSize(dtype));
    file_.read_at(out.data_ptr(), (hi - lo) * elem, data_start_ + offset + lo * elem);
    return out;
  }

 private:
  std::string path_;
  File file_;
  int64_t data_start_ = 0;
  std::map<std::string, std::pair<at::ScalarType, int64_t>> info_;
};

std::unique_ptr<FullReader> open_full(const std::string& file) {
  const FullFormat format = full_format(file);
  struct stat st {};
  FSDP_CHECK(::stat(file.c_str(), &st) == 0 && S_ISREG(st.st_mode), "full checkpoint '", file,
             "' cannot be read (", errno_text(), "); give a file written by export_full_checkpoint");
  if (format == FullFormat::kPt) return std::make_unique<PtReader>(file);
  return std::make_unique<SafetensorsReader>(file);
}

}  // namespace

void export_full_checkpoint(FullyShardedModule& model, const std::string& file,
                            const ExportOptions& options) {
  Engine& e = *detail::engine_of(model);
  Runtime& rt = *e.runtime();
  const std::string what = cat("exporting '", file, "'");
  const bool lead = rt.rank() == 0;
  // Rank 0's shard group gathers unit by unit; rank 0 writes.
  const auto& members = e.shard_group()->ranks();
  const bool gathers = std::find(members.begin(), members.end(), 0) != members.end();
  std::vector<FullEntry> entries;
  std::unique_ptr<FullWriter> writer;
  const std::string tmp = file + ".partial";
  std::string err = capture([&] {
    const FullFormat format = full_format(file);
    for (const auto& u : e.unit_states()) {
      if (options.trainable_only && !u->trainable) continue;
      for (const auto& s : u->params) {
        entries.push_back({s.name, at::kFloat, s.shape});
        for (const auto& a : s.aliases) entries.push_back({a, at::kFloat, s.shape});
      }
    }
    for (const auto& b : e.root_module().named_buffers()) {
      if (options.trainable_only) break;
      entries.push_back({b.key(), b.value().scalar_type(), b.value().sizes().vec()});
      (void)dtype_name(b.value().scalar_type());
    }
    if (lead) writer = make_writer(tmp, format, entries);
  });
  rt.check_all_ok(what, err);
  // A write error on rank 0 must not strand the others in a gather: keep gathering, fail after.
  err.clear();
  if (gathers) {
    torch::NoGradGuard no_grad;
    for (const auto& u : e.unit_states()) {
      if (u->padded == 0 || (options.trainable_only && !u->trainable)) continue;
      at::Tensor full = at::empty({u->padded}, u->shard.options().requires_grad(false));
      e.shard_group()->all_gather(full, u->shard.detach())->wait();
      if (!lead || !err.empty()) continue;
      err = capture([&] {
        at::Tensor cpu = full.cpu();
        for (const auto& s : u->params) {
          at::Tensor v = cpu.narrow(0, s.offset, s.numel).contiguous();
          for (size_t k = 0; k <= s.aliases.size(); ++k) writer->write(v);
        }
      });
    }
  }
  if (lead && err.empty()) {
    err = capture([&] {
      for (const auto& b : e.root_module().named_buffers()) {
        if (!options.trainable_only) writer->write(b.value().detach().cpu().contiguous());
      }
      writer->finish();
      writer.reset();
      rename_into_place(tmp, file);
    });
  }
  if (lead && !err.empty()) ::unlink(tmp.c_str());
  rt.check_all_ok(what, err);
}

void import_full_checkpoint(FullyShardedModule& model, const std::string& file) {
  Engine& e = *detail::engine_of(model);
  Runtime& rt = *e.runtime();
  std::vector<at::Tensor> shards;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  std::string err = capture([&] {
    FSDP_CHECK(!e.built_deferred() || full_format(file) != FullFormat::kPt, "importing '", file,
               "': a .pt file is read whole on every rank, but this model was built under "
               "fsdp::DeferredInit so that no rank holds it whole; convert it to .safetensors "
               "(read as each rank's byte ranges) where it fits once, e.g. "
               "fsdp::save_full_checkpoint(module, \"model.safetensors\") of the loaded module");
    auto reader = open_full(file);
    check_names(model_shapes(e.root_module()), reader->shapes, cat("full checkpoint '", file, "'"));
    shards = build_shards(e, [&](const std::string& name, int64_t lo, int64_t hi) {
      return reader->slice(name, lo, hi);
    });
    for (const auto& b : e.root_module().named_buffers()) {
      buffers.emplace_back(b.key(), reader->slice(b.key(), 0, b.value().numel()).view(b.value().sizes()));
    }
  });
  rt.check_all_ok(cat("importing '", file, "'"), err);
  commit_shards(e, shards);
  torch::NoGradGuard no_grad;
  for (auto& b : e.root_module().named_buffers()) {
    for (const auto& [name, v] : buffers) {
      if (name == b.key()) b.value().copy_(v);
    }
  }
}

void save_full_checkpoint(torch::nn::Module& module, const std::string& file) {
  const FullFormat format = full_format(file);
  std::vector<FullEntry> entries;
  std::vector<at::Tensor> values;
  for (const auto& p : module.named_parameters()) {
    entries.push_back({p.key(), p.value().scalar_type(), p.value().sizes().vec()});
    values.push_back(p.value());
  }
  for (const auto& b : module.named_buffers()) {
    entries.push_back({b.key(), b.value().scalar_type(), b.value().sizes().vec()});
    values.push_back(b.value());
  }
  for (const auto& en : entries) (void)dtype_name(en.dtype);
  const std::string tmp = file + ".partial";
  try {
    auto writer = make_writer(tmp, format, entries);
    for (const auto& v : values) writer->write(v.detach().cpu().contiguous());
    writer->finish();
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  rename_into_place(tmp, file);
}

void load_full_checkpoint(torch::nn::Module& module, const std::string& file) {
  auto reader = open_full(file);
  check_names(model_shapes(module), reader->shapes, cat("full checkpoint '", file, "'"));
  torch::NoGradGuard no_grad;
  auto load = [&](const std::string& name, at::Tensor& dst) {
    dst.copy_(reader->slice(name, 0, dst.numel()).view(dst.sizes()));
  };
  for (auto& p : module.named_parameters()) load(p.key(), p.value());
  for (auto& b : module.named_buffers()) load(b.key(), b.value());
}

}  // namespace fsdp
