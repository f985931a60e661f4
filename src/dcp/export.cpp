// Writing a PyTorch distributed checkpoint (fsdp::export_dcp, fsdp/dcp.h): a sharded model and its
// optimizer's state.
//
// Three agreements: rank 0 makes the directory and removes an earlier .metadata (from then on the
// directory is no checkpoint); each rank of the first replica writes __<rank>_0.distcp, one
// torch.save'd box after another, and hands rank 0 a line per box through the store; rank 0
// merges them, checks the result as the reader would (every tensor tiled exactly), writes
// .metadata atomically and removes .distcp files of an earlier, wider export.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>

#include "base/shard_slice.h"
#include "checkpoint/common.h"
#include "checkpoint/file_io.h"
#include "checkpoint/layout.h"
#include "checkpoint/optimizer_state.h"
#include "dcp/metadata.h"
#include "dcp/names.h"
#include "dcp/torch_save.h"
#include "fsdp/dcp.h"
#include "fsdp/runtime.h"
#include "runtime/runtime_internal.h"

namespace fsdp::detail {

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep)) out.push_back(cur);
  if (!s.empty() && s.back() == sep) out.emplace_back();
  return out;
}

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t k = 0; k < v.size(); ++k) s += (k ? "," : "") + std::to_string(v[k]);
  return s;
}

std::vector<int64_t> ints(const std::string& s) {
  std::vector<int64_t> out;
  if (s.empty()) return out;
  for (const auto& x : split(s, ',')) out.push_back(std::stoll(x));
  return out;
}

// The path of a key in the nested state dict (planner_data): the prefix's parts, then `rest`.
std::vector<std::string> path_of(const std::string& prefix, std::vector<std::string> rest) {
  std::vector<std::string> out;
  for (const auto& p : split(prefix, '.')) {
    if (!p.empty()) out.push_back(p);
  }
  out.insert(out.end(), rest.begin(), rest.end());
  return out;
}

// One written item: a box of a tensor (or a bytes item), as a line for rank 0.
struct Written {
  DcpItem item;  // one chunk
  std::string line() const {
    const DcpChunk& c = item.chunks.at(0);
    std::string p;
    for (const auto& x : item.path) p += (p.empty() ? "" : "\x1f") + x;
    return cat(item.key, '\t', item.tensor ? dcp_dtype_name(item.dtype) : "bytes", '\t',
               join(item.size), '\t', join(c.offsets), '\t', join(c.sizes), '\t', c.file, '\t',
               c.offset, '\t', c.length, '\t', p, '\n');
  }
  static Written parse(const std::string& line) {
    const auto f = split(line, '\t');
    TORCH_INTERNAL_ASSERT(f.size() == 9, "bad DCP export line: ", line);
    Written w;
    w.item.key = f[0];
    w.item.tensor = f[1] != "bytes";
    if (w.item.tensor) w.item.dtype = dcp_dtype(f[1], "export");
    w.item.size = ints(f[2]);
    DcpChunk c;
    if (w.item.tensor) c.offsets = ints(f[3]), c.sizes = ints(f[4]);
    c.file = f[5];
    c.offset = std::stoll(f[6]);
    c.length = std::stoll(f[7]);
    w.item.chunks.push_back(c);
    if (!f[8].empty()) w.item.path = split(f[8], '\x1f');
    return w;
  }
};

class DistcpWriter {
 public:
  DistcpWriter(const std::string& dir, const std::string& name)
      : name_(name), tmp_(dir + "/" + name + ".partial"), path_(dir + "/" + name),
        file_(tmp_, O_WRONLY | O_CREAT | O_TRUNC) {}

  void tensor(const std::string& key, std::vector<std::string> path, const std::vector<int64_t>& size,
              const std::vector<int64_t>& offsets, const at::Tensor& box) {
    put(key, std::move(path), true, box.scalar_type(), size, offsets, box.sizes().vec(),
        saved_tensor_bytes(box.contiguous()));
  }
  void value(const std::string& key, std::vector<std::string> path, const std::string& pickled) {
    put(key, std::move(path), false, at::kFloat, {}, {}, {}, saved_value_bytes(pickled));
  }
  void commit() {
    file_.sync_and_close();
    FSDP_CHECK(::rename(tmp_.c_str(), path_.c_str()) == 0, "cannot rename '", tmp_, "' to '",
               path_, "': ", errno_text());
  }
  std::string lines() const {
    std::string s;
    for (const auto& w : written_) s += w.line();
    return s;
  }
  ~DistcpWriter() {
    if (!std::uncaught_exceptions()) return;
    ::unlink(tmp_.c_str());
  }

 private:
  void put(const std::string& key, std::vector<std::string> path, bool tensor, at::ScalarType dtype,
           const std::vector<int64_t>& size, const std::vector<int64_t>& offsets,
           const std::vector<int64_t>& sizes, const std::string& bytes) {
    file_.write(bytes.data(), static_cast<int64_t>(bytes.size()));
    Written w;
    w.item.key = key;
    w.item.tensor = tensor;
    w.item.dtype = dtype;
    w.item.size = size;
    w.item.path = std::move(path);
    w.item.chunks.push_back({offsets, sizes, name_, at_, static_cast<int64_t>(bytes.size())});
    at_ += static_cast<int64_t>(bytes.size());
    written_.push_back(std::move(w));
  }

  std::string name_, tmp_, path_;
  File file_;
  int64_t at_ = 0;
  std::vector<Written> written_;
};

std::string pickled_float(double v) {
  pickle::PickleWriter w;
  w.number(v);
  return w.finish();
}

// AdamW's (or Adam's) param_groups[0] as PyTorch 2.6 holds them, one bytes item per field.
void write_param_groups(DistcpWriter& out, const torch::optim::Optimizer& opt,
                        const std::vector<std::string>& param_names, const std::string& prefix) {
  const auto& g = opt.param_groups().at(0).options();
  const auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&g);
  const auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(&g);
  FSDP_CHECK(adamw || adam, "export_dcp writes the optimizer state of AdamW and Adam only");
  auto field = [&](const std::string& name, const std::string& pickled) {
    out.value(cat(prefix, "param_groups.0.", name), path_of(prefix, {"param_groups", "0", name}),
              pickled);
  };
  const auto betas = adamw ? adamw->betas() : adam->betas();
  field("lr", pickled_float(g.get_lr()));
  {
    pickle::PickleWriter w;
    w.number(std::get<0>(betas));
    w.number(std::get<1>(betas));
    w.tuple(2);
    field("betas", w.finish());
  }
  field("eps", pickled_float(adamw ? adamw->eps() : adam->eps()));
  field("weight_decay", pickled_float(adamw ? adamw->weight_decay() : adam->weight_decay()));
  for (const auto& [name, v] : std::vector<std::pair<std::string, int>>{
           {"amsgrad", (adamw ? adamw->amsgrad() : adam->amsgrad()) ? 1 : 0},
           {"foreach", -1}, {"maximize", 0}, {"capturable", 0}, {"differentiable", 0},
           {"fused", -1}}) {
    pickle::PickleWriter w;
    if (v < 0) {
      w.none();
    } else {
      w.boolean(v == 1);
    }
    field(name, w.finish());
  }
  pickle::PickleWriter w;
  w.empty_list();
  w.mark();
  for (const auto& n : param_names) w.str(n);
  w.appends();
  field("params", w.finish());
}

}  // namespace

}  // namespace fsdp::detail

namespace fsdp {

using detail::DcpItem;
using detail::Written;

void export_dcp(ShardedModuleBase& model, const std::string& dir,
                const torch::optim::Optimizer* optimizer, const DcpOptions& o) {
  detail::Engine& e = *detail::engine_of(model);
  Runtime& rt = *e.runtime();
  const std::string what = cat("exporting DCP checkpoint '", dir, "'");
  const int64_t r = rt.rank();
  const auto& members = e.shard_group()->ranks();
  const bool writes = std::find(members.begin(), members.end(), 0) != members.end();
  // The last agreement's id, reserved first (the same on every rank), keys the store's lines.
  const int64_t n = detail::reserve_agreement(rt);
  std::optional<detail::Renamer> rename;
  std::optional<detail::OptimizerKind> kind;
  std::string err = detail::capture([&] {
    rename.emplace(o.renames);
    if (optimizer) {
      kind = detail::optimizer_kind(*optimizer);
      FSDP_CHECK(kind->name == "adamw" || kind->name == "adam", what, ": optimizer state is "
                 "written for AdamW and Adam; this optimizer is ", kind->name,
                 " (export the model alone: no optimizer)");
    }
    if (r == 0) {
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      FSDP_CHECK(!ec, what, ": cannot create '", dir, "' (", ec.message(), ")");
      const std::string meta = dir + "/.metadata";
      FSDP_CHECK(::unlink(meta.c_str()) == 0 || errno == ENOENT, what, ": cannot remove the "
                 "earlier '", meta, "' (", detail::errno_text(), ")");
      detail::sync_dir(dir);
    }
  });
  rt.check_all_ok(what, err);

  std::string lines;
  err = detail::capture([&] {
    if (!writes) return;
    detail::DistcpWriter out(dir, cat("__", r, "_0.distcp"));
    const int64_t shard_rank = e.shard_group()->rank();
    std::vector<std::string> trained;  // checkpoint names of the optimizer's parameters, in order
    for (const auto& u : e.flat_views()) {
      if (u.padded == 0) continue;
      const at::Tensor shard = u.param.detach().to(at::kCPU);
      const detail::ParamState* st =
          optimizer && u.trainable ? detail::find_state(*optimizer, u.param) : nullptr;
      std::vector<at::Tensor> fields;
      if (st) {
        for (const auto& f : kind->fields) {
          const at::Tensor v = f.get(*st);
          if (f.name != "max_exp_avg_sq" && v.defined()) fields.push_back(v.detach().to(at::kCPU));
        }
      }
      const int64_t begin = shard_rank * u.shard_numel;
      for (const auto& s : u.params) {
        const std::string ck = (*rename)(s.name);
        if (ck.empty()) continue;
        if (u.trainable && optimizer) trained.push_back(ck);
        std::vector<std::string> names{ck};
        for (const auto& a : s.aliases) {
          if (const std::string x = (*rename)(a); !x.empty() && x != ck) names.push_back(x);
        }
        if (auto it = o.also_as.find(s.name); it != o.also_as.end()) {
          names.insert(names.end(), it->second.begin(), it->second.end());
        }
        const auto sl = detail::shard_slice(begin, u.shard_numel, s.offset, s.numel);
        if (sl.empty()) continue;
        int64_t pos = sl.in_param();
        for (const auto& [off, sizes] : detail::flat_range_boxes(s.shape, sl.in_param(),
                                                                 sl.in_param_end())) {
          int64_t count = 1;
          for (int64_t x : sizes) count *= x;
          const int64_t at = sl.in_shard() + (pos - sl.in_param());
          pos += count;
          const at::Tensor box = shard.narrow(0, at, count).view(sizes);
          for (const auto& name : names) {
            out.tensor(o.model_prefix + name, detail::path_of(o.model_prefix, {name}), s.shape, off,
                       box);
          }
          if (fields.size() == 2) {
            const char* fname[2] = {"exp_avg", "exp_avg_sq"};
            for (int f = 0; f < 2; ++f) {
              out.tensor(cat(o.optimizer_prefix, "state.", ck, ".", fname[f]),
                         detail::path_of(o.optimizer_prefix, {"state", ck, fname[f]}), s.shape, off,
                         fields[f].narrow(0, at, count).view(sizes));
            }
          }
        }
        if (st && sl.in_param() == 0 && kind->get_step) {
          const at::Tensor step = at::full({}, static_cast<double>(kind->get_step(*st)), at::kFloat);
          out.tensor(cat(o.optimizer_prefix, "state.", ck, ".step"),
                     detail::path_of(o.optimizer_prefix, {"state", ck, "step"}), {}, {}, step);
        }
      }
    }
    if (r == 0) {
      for (const auto& b : e.root_module().named_buffers()) {
        const std::string ck = (*rename)(b.key());
        if (ck.empty()) continue;
        const at::Tensor v = b.value().detach().to(at::kCPU).contiguous();
        out.tensor(o.model_prefix + ck, detail::path_of(o.model_prefix, {ck}), v.sizes().vec(),
                   std::vector<int64_t>(v.dim(), 0), v);
      }
      if (optimizer) write_param_groups(out, *optimizer, trained, o.optimizer_prefix);
    }
    out.commit();
    lines = out.lines();
  });
  rt.check_all_ok(what, err);

  // Rank 0 gathers every writer's lines and writes .metadata.
  auto store = detail::runtime_store(rt);
  const std::string prefix = cat("fsdp/dcp_export/", n, "/");
  if (writes && r != 0) store->set(cat(prefix, r), std::vector<uint8_t>(lines.begin(), lines.end()));
  err.clear();
  if (r == 0) {
    err = detail::capture([&] {
      std::map<std::string, DcpItem> items;
      std::set<std::string> files;
      for (int64_t w : members) {
        std::string text = lines;
        if (w != 0) {
          const auto v = store->get(cat(prefix, w));
          text.assign(v.begin(), v.end());
        }
        for (const auto& line : detail::split(text, '\n')) {
          if (line.empty()) continue;
          Written x = Written::parse(line);
          files.insert(x.item.chunks[0].file);
          auto [it, fresh] = items.emplace(x.item.key, x.item);
          if (!fresh) it->second.chunks.push_back(x.item.chunks[0]);
        }
      }
      detail::DcpMetadata m;
      for (auto& [key, item] : items) m.items.push_back(std::move(item));
      const std::string bytes = detail::dcp_metadata_bytes(m);
      // What a reader will find: every tensor tiled exactly, every chunk stored.
      detail::parse_dcp_metadata(bytes, what);
      detail::write_file_atomically(dir + "/.metadata", bytes);
      // .distcp files of an earlier export by more ranks.
      static const std::regex distcp(R"(^__[0-9]+_[0-9]+\.distcp$)");
      if (DIR* d = ::opendir(dir.c_str())) {
        std::vector<std::string> stale;
        while (dirent* ent = ::readdir(d)) {
          const std::string name = ent->d_name;
          if (std::regex_match(name, distcp) && !files.count(name)) stale.push_back(name);
        }
        ::closedir(d);
        for (const auto& s : stale) ::unlink((dir + "/" + s).c_str());
      }
    });
  }
  detail::check_all_ok_reserved(rt, n, what, err, nullptr);
}

}  // namespace fsdp
