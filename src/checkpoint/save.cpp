// Sharded save: save_checkpoint and its three phases (see checkpoint/save_phases.h, NOTE
// [checkpoint format] in fsdp/checkpoint.h).
#include <sys/stat.h>

#include "checkpoint/crc32c.h"
#include "checkpoint/save_phases.h"
#include "fsdp/runtime.h"
#include "runtime/runtime_internal.h"

namespace fsdp::detail {

namespace fs = std::filesystem;

// 1a. Local: validate, then the layout, this rank's role and its RNG state.
PendingSave plan_save(const std::string& path, ShardedModuleBase& model,
                      const torch::optim::Optimizer* optimizer, const TrainingState& state,
                      const CheckpointOptions& options) {
  PendingSave p;
  p.t0 = std::chrono::steady_clock::now();
  p.engine = detail::engine_of(model);
  Engine& e = *p.engine;
  p.rt = e.runtime().get();
  p.path = path;
  p.what = cat("saving checkpoint '", path, "'");
  p.partial = path + ".partial";
  p.error = capture([&] {
    FSDP_CHECK(!path.empty(), "save_checkpoint: the path is empty");
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
  });
  if (!p.error.empty()) return p;
  p.layout = make_layout(e, optimizer, p.kind ? &*p.kind : nullptr);
  p.s_index = e.shard_group()->rank();
  p.writer = e.replicate_group()->rank() == 0;
  const auto chunks = static_cast<int64_t>(p.layout.chunks.size());
  p.crcs = at::zeros({chunks + e.shard_group()->size()}, at::TensorOptions().dtype(at::kLong));
  if (options.rng) p.rng = rng_state(p.rt->device(), &p.rng_cuda_bytes);
  return p;
}

// 1b. Rank 0 creates "<path>.partial" (a leftover of an interrupted save removed first).
std::string make_partial_dir(const PendingSave& p) {
  return capture([&] {
    if (p.rt->rank() != 0) return;
    std::error_code ec;
    fs::create_directories(parent_dir(p.path), ec);
    FSDP_CHECK(!ec, "cannot create the directory '", parent_dir(p.path), "': ", ec.message(),
               "; choose a writable place");
    fs::remove_all(p.partial, ec);
    FSDP_CHECK(!ec, "cannot remove the leftover '", p.partial, "': ", ec.message());
    FSDP_CHECK(::mkdir(p.partial.c_str(), 0755) == 0, "cannot create '", p.partial, "': ",
               errno_text(), "; check that the directory is writable");
  });
}

PendingSave prepare_save(const std::string& path, ShardedModuleBase& model,
                         const torch::optim::Optimizer* optimizer, const TrainingState& state,
                         const CheckpointOptions& options) {
  PendingSave p = plan_save(path, model, optimizer, state, options);
  p.rt->check_all_ok(p.what, p.error.empty() ? make_partial_dir(p) : p.error);
  return p;
}

std::vector<int64_t> my_chunks(const PendingSave& p) {
  std::vector<int64_t> out;
  if (!p.writer) return out;
  for (size_t i = 0; i < p.layout.chunks.size(); ++i) {
    if (p.layout.chunks[i].file == p.s_index) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

namespace {

void check_sees_partial(const PendingSave& p) {
  struct stat st {};
  FSDP_CHECK(::stat(p.partial.c_str(), &st) == 0, "rank ", p.rt->rank(), " cannot see '",
             p.partial, "', which rank 0 created; every rank must see the same checkpoint "
             "directory (use a shared filesystem on several nodes)");
}

// Records chunk `i`'s CRC (n bytes at `data`) and continues the file's from it: each byte is
// checksummed once (NOTE [CRC combine] in checkpoint/crc32c.cpp).
void record_crc(PendingSave& p, int64_t i, const void* data, int64_t n, uint32_t& file_crc) {
  static_assert(kCheckpointFormatVersion == 2, "format 2 checksums are CRC-32C");
  const uint32_t crc = crc32c(data, n);
  p.crcs.data_ptr<int64_t>()[i] = crc;
  file_crc = crc32c_combine(file_crc, crc, n);
}

void record_file_crc(PendingSave& p, uint32_t file_crc) {
  p.crcs.data_ptr<int64_t>()[static_cast<int64_t>(p.layout.chunks.size()) + p.s_index] = file_crc;
}

}  // namespace

// 2. The writer of each shard index writes its file from `bytes(chunk)` (the chunk's data,
// layout.chunks[chunk] long) and fsyncs it. Local: no collective, no model access unless
// `bytes` reads the model. Returns "" or the error message.
std::string write_shard_file(PendingSave& p,
                             const std::function<const void*(int64_t chunk)>& bytes) {
  return capture([&] {
    check_sees_partial(p);
    if (!p.writer) return;
    const auto t0 = std::chrono::steady_clock::now();
    File f(p.partial + "/" + shard_file_name(p.s_index), O_WRONLY | O_CREAT | O_TRUNC);
    uint32_t file_crc = 0;
    for (int64_t i : my_chunks(p)) {
      const int64_t n = chunk_bytes(p.layout.chunks[static_cast<size_t>(i)], p.layout);
      const void* data = bytes(i);
      record_crc(p, i, data, n, file_crc);
      f.write(data, n);
    }
    record_file_crc(p, file_crc);
    f.sync_and_close();
    p.write_s = seconds_since(t0);
  });
}

// 2, from the file's image (AsyncCheckpointer's staging buffer; see save_phases.h).
std::string write_shard_image(PendingSave& p, const uint8_t* image) {
  return capture([&] {
    check_sees_partial(p);
    if (!p.writer) return;
    const auto t0 = std::chrono::steady_clock::now();
    uint32_t file_crc = 0;
    int64_t end = 0;
    for (int64_t i : my_chunks(p)) {
      const Chunk& ch = p.layout.chunks[static_cast<size_t>(i)];
      const int64_t n = chunk_bytes(ch, p.layout);
      TORCH_INTERNAL_ASSERT(ch.offset == end, "chunks of a shard file lie back to back");
      record_crc(p, i, image + ch.offset, n, file_crc);
      end += n;
    }
    record_file_crc(p, file_crc);
    File f(p.partial + "/" + shard_file_name(p.s_index), O_WRONLY | O_CREAT | O_TRUNC);
    p.page_cache_write = !f.write_direct(image, end);
    f.sync_and_close();
    p.write_s = seconds_since(t0);
  });
}

at::Tensor world_sum(Runtime& rt, const at::Tensor& t) {
  if (rt.world_size() == 1) return t;
  at::Tensor d = t.to(rt.device());
  rt.world()->all_reduce(d)->wait();
  return d.cpu();
}
namespace {

// Every rank's `mine`, concatenated in rank order, gathered on the runtime's device.
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
                      {checksum_key(kCheckpointFormatVersion),
                       static_cast<uint32_t>(c[chunks + static_cast<int64_t>(s)])}});
    total_bytes += L.file_bytes[s];
  }
  if (rng.defined()) {
    const int64_t n = rng.numel();
    jfiles.push_back({{"name", "rng.bin"}, {"bytes", n}, {checksum_key(kCheckpointFormatVersion),
                      format_checksum(kCheckpointFormatVersion, rng.data_ptr(), n)}});
    meta["rng"] = {{"file", "rng.bin"}, {"world_size", rt.world_size()},
                   {"bytes_per_rank", n / rt.world_size()},
                   {"cuda_bytes_per_rank", p.rng_cuda_bytes}};
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
         {"end", ch.end},
         {checksum_key(kCheckpointFormatVersion), static_cast<uint32_t>(c[i])}});
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

}  // namespace

CheckpointInfo commit_save(PendingSave& p, const std::string& write_error) {
  Runtime& rt = *p.rt;
  rt.check_all_ok(p.what, write_error);
  // The CRCs and, in the same all-reduce, how many ranks wrote through the page cache and each
  // rank's write time (microseconds, in its own slot).
  at::Tensor write_us = at::zeros({rt.world_size()}, p.crcs.options());
  write_us.data_ptr<int64_t>()[rt.rank()] = static_cast<int64_t>(p.write_s * 1e6);
  const at::Tensor summed = world_sum(
      rt, at::cat({p.crcs, at::full({1}, p.page_cache_write ? 1 : 0, p.crcs.options()), write_us}));
  const at::Tensor crcs = summed.narrow(0, 0, p.crcs.numel());
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
  info.page_cache_writes = summed.data_ptr<int64_t>()[p.crcs.numel()];
  info.write_seconds =
      double(summed.narrow(0, p.crcs.numel() + 1, rt.world_size()).max().item<int64_t>()) / 1e6;
  return info;
}

}  // namespace fsdp::detail

namespace fsdp {

using detail::commit_save;
using detail::OptimizerKind;
using detail::PendingSave;
using detail::prepare_save;
using detail::chunk_data;
using detail::write_shard_file;

std::string checkpoint_path(const std::string& dir, int64_t step) {
  FSDP_CHECK(step >= 0, "checkpoint step ", step, " is negative");
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08lld", static_cast<long long>(step));
  return (std::filesystem::path(dir) / name).string();
}

CheckpointInfo save_checkpoint(const std::string& path, ShardedModuleBase& model,
                               const torch::optim::Optimizer* optimizer,
                               const TrainingState& state, const CheckpointOptions& options) {
  detail::TraceSpan all(detail::trace_slot(*model.runtime()), "checkpoint", "checkpoint save");
  PendingSave p = prepare_save(path, model, optimizer, state, options);
  const OptimizerKind* kind = p.kind ? &*p.kind : nullptr;
  at::Tensor current;  // the chunk being written, alive until the next one
  detail::TraceSpan write(detail::trace_slot(*p.rt), "checkpoint", "checkpoint write");
  const std::string err = write_shard_file(p, [&](int64_t i) {
    current = chunk_data(p.layout.chunks[static_cast<size_t>(i)], p.layout, *p.engine,
                         optimizer, kind);
    return static_cast<const void*>(current.data_ptr());
  });
  write.end();
  detail::TraceSpan commit(detail::trace_slot(*p.rt), "checkpoint", "checkpoint commit");
  return commit_save(p, err);
}

}  // namespace fsdp
