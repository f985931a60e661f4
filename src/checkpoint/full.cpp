// Full checkpoints: export_full_checkpoint / import_full_checkpoint for sharded models and
// save_/load_full_checkpoint for plain modules, in either format (see full_format.h).
#include "checkpoint/full_format.h"
#include "checkpoint/layout.h"
#include "fsdp/runtime.h"

namespace fsdp::detail {

FullFormat full_format(const std::string& file) {
  auto ends = [&](const std::string& x) {
    return file.size() > x.size() && file.compare(file.size() - x.size(), x.size(), x) == 0;
  };
  if (ends(".pt") || ends(".pth")) return FullFormat::kPt;
  if (ends(".safetensors")) return FullFormat::kSafetensors;
  throw Error(cat("full checkpoint '", file, "' must end in .pt (PyTorch's format) or "
                  ".safetensors"));
}

namespace {

std::unique_ptr<FullWriter> make_writer(const std::string& path, FullFormat format,
                                        const std::vector<FullEntry>& entries) {
  if (format == FullFormat::kPt) return make_pt_writer(path, entries);
  return make_safetensors_writer(path, entries);
}

void rename_into_place(const std::string& tmp, const std::string& file) {
  FSDP_CHECK(::rename(tmp.c_str(), file.c_str()) == 0, "cannot rename '", tmp, "' to '", file,
             "': ", errno_text());
  sync_dir(parent_dir(file));
}

std::unique_ptr<FullReader> open_full(const std::string& file) {
  const FullFormat format = full_format(file);
  struct stat st {};
  FSDP_CHECK(::stat(file.c_str(), &st) == 0 && S_ISREG(st.st_mode), "full checkpoint '", file,
             "' cannot be read (", errno_text(), "); give a file written by export_full_checkpoint");
  if (format == FullFormat::kPt) return make_pt_reader(file);
  return make_safetensors_reader(file);
}

}  // namespace

}  // namespace fsdp::detail

namespace fsdp {

using detail::build_shards;
using detail::check_names;
using detail::full_format;
using detail::FullEntry;
using detail::FullFormat;
using detail::FullReader;
using detail::FullWriter;
using detail::model_shapes;
using detail::open_full;
using detail::make_writer;
using detail::rename_into_place;

void export_full_checkpoint(ShardedModuleBase& model, const std::string& file,
                            const ExportOptions& options) {
  detail::Engine& e = *detail::engine_of(model);
  Runtime& rt = *e.runtime();
  const std::string what = cat("exporting '", file, "'");
  const bool lead = rt.rank() == 0;
  // Rank 0's shard group gathers unit by unit; rank 0 writes.
  const auto& members = e.shard_group()->ranks();
  const bool gathers = std::find(members.begin(), members.end(), 0) != members.end();
  std::vector<FullEntry> entries;
  std::unique_ptr<FullWriter> writer;
  const std::string tmp = file + ".partial";
  std::string err = detail::capture([&] {
    const FullFormat format = full_format(file);
    for (const auto& u : e.flat_views()) {
      if (options.trainable_only && !u.trainable) continue;
      for (const auto& s : u.params) {
        entries.push_back({s.name, at::kFloat, s.shape});
        for (const auto& a : s.aliases) entries.push_back({a, at::kFloat, s.shape});
      }
    }
    for (const auto& b : e.root_module().named_buffers()) {
      if (options.trainable_only) break;
      entries.push_back({b.key(), b.value().scalar_type(), b.value().sizes().vec()});
      (void)detail::dtype_name(b.value().scalar_type());
    }
    if (lead) writer = make_writer(tmp, format, entries);
  });
  rt.check_all_ok(what, err);
  // A write error on rank 0 must not strand the others in a gather: keep gathering, fail after.
  err.clear();
  if (gathers) {
    torch::NoGradGuard no_grad;
    for (const auto& u : e.flat_views()) {
      if (u.padded == 0 || (options.trainable_only && !u.trainable)) continue;
      at::Tensor full = at::empty({u.padded}, u.param.options().requires_grad(false));
      e.shard_group()->all_gather(full, u.param.detach())->wait();
      if (!lead || !err.empty()) continue;
      err = detail::capture([&] {
        at::Tensor cpu = full.cpu();
        for (const auto& s : u.params) {
          at::Tensor v = cpu.narrow(0, s.offset, s.numel).contiguous();
          for (size_t k = 0; k <= s.aliases.size(); ++k) writer->write(v);
        }
      });
    }
  }
  if (lead && err.empty()) {
    err = detail::capture([&] {
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

void import_full_checkpoint(ShardedModuleBase& model, const std::string& file) {
  detail::Engine& e = *detail::engine_of(model);
  Runtime& rt = *e.runtime();
  std::vector<at::Tensor> shards;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  std::string err = detail::capture([&] {
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
  e.replace_shards(shards);
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
  for (const auto& en : entries) (void)detail::dtype_name(en.dtype);
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
