// Reading a PyTorch distributed checkpoint into a sharded model on any mesh (fsdp::import_dcp,
// fsdp/dcp.h).
//
// Every rank parses .metadata and matches its keys to the model's names (the same answer on every
// rank), then reads only the chunks whose boxes meet its own shards' element ranges: a chunk is
// read whole (its torch.save'd bytes) and the runs of its box that fall in the shard are copied.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "base/compat.h"
#include "checkpoint/common.h"
#include "checkpoint/file_io.h"
#include "checkpoint/layout.h"
#include "checkpoint/optimizer_state.h"
#include "dcp/metadata.h"
#include "dcp/names.h"
#include "dcp/torch_save.h"
#include "fsdp/dcp.h"
#include "fsdp/runtime.h"

namespace fsdp::detail {

namespace {

using pickle::Value;
using Kind = Value::Kind;

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// Reads element ranges of checkpoint tensors, chunk by chunk, from the .distcp files.
class DcpReader {
 public:
  explicit DcpReader(const std::string& dir) : dir_(dir) {}

  // Elements [lo, hi) of `it` flattened, in its dtype; those at or past its end are zeros (a
  // model tensor with more rows than the checkpoint's).
  at::Tensor slice(const DcpItem& it, int64_t lo, int64_t hi) {
    at::Tensor out = at::zeros({hi - lo}, at::TensorOptions().dtype(it.dtype));
    const int64_t end = std::min(hi, numel_of(it.size));
    if (lo >= end) return out;
    const size_t d = it.size.size();
    std::vector<int64_t> stride(d, 1);
    for (size_t k = d; k-- > 1;) stride[k - 1] = stride[k] * it.size[k];
    for (const auto& c : it.chunks) {
      const int64_t n = numel_of(c.sizes);
      if (n == 0) continue;
      int64_t first = 0, last = 0;
      for (size_t k = 0; k < d; ++k) {
        first += c.offsets[k] * stride[k];
        last += (c.offsets[k] + c.sizes[k] - 1) * stride[k];
      }
      if (last < lo || first >= end) continue;
      const int64_t run = d == 0 ? 1 : c.sizes[d - 1];
      const int64_t runs = n / run;
      at::Tensor data;
      for (int64_t r = 0; r < runs; ++r) {
        // The run's flat start: its leading indices (r in the box's leading sizes) by stride.
        int64_t start = d == 0 ? 0 : c.offsets[d - 1], rest = r;
        for (size_t k = d - (d > 0 ? 1 : 0); k-- > 0;) {
          start += (c.offsets[k] + rest % c.sizes[k]) * stride[k];
          rest /= c.sizes[k];
        }
        const int64_t a = std::max(start, lo), b = std::min(start + run, end);
        if (a >= b) continue;
        if (!data.defined()) data = load(it, c).reshape({-1});
        out.narrow(0, a - lo, b - a).copy_(data.narrow(0, r * run + (a - start), b - a));
      }
    }
    return out;
  }

  // A whole (small) tensor: a step count.
  at::Tensor whole(const DcpItem& it) { return slice(it, 0, numel_of(it.size)).view(it.size); }

  SavedValue value(const DcpItem& it) {
    const DcpChunk& c = it.chunks.at(0);
    bytes_ += c.length;
    return read_saved_value(file(c.file), c.offset, c.length,
                            cat("DCP checkpoint '", dir_, "': '", it.key, "' in ", c.file));
  }

  int64_t bytes() const { return bytes_; }

 private:
  const File& file(const std::string& name) {
    auto& f = files_[name];
    if (!f) f = std::make_unique<File>(dir_ + "/" + name, O_RDONLY);
    return *f;
  }
  at::Tensor load(const DcpItem& it, const DcpChunk& c) {
    bytes_ += c.length;
    return read_saved_tensor(file(c.file), c.offset, c.length, it.dtype, c.sizes,
                             cat("DCP checkpoint '", dir_, "': the chunk of '", it.key, "' at ",
                                 shape_text(c.offsets), " in ", c.file));
  }

  std::string dir_;
  std::map<std::string, std::unique_ptr<File>> files_;
  int64_t bytes_ = 0;
};

// Which checkpoint item each model tensor and optimizer field reads, after every check.
struct Match {
  std::map<std::string, const DcpItem*> model;                     // model name -> item
  std::map<std::pair<std::string, std::string>, const DcpItem*> optim;  // (name, field) -> item
  std::vector<const DcpItem*> param_groups;
};

struct ModelTensor {
  std::vector<int64_t> shape;
  bool trainable = true;
};

Match match(const DcpMetadata& m, Engine& e, bool with_optimizer, const DcpOptions& o,
            const std::string& what, DcpImportInfo& info) {
  // The model's names: each flat parameter under its first name (aliases lead to it), buffers.
  std::map<std::string, ModelTensor> model;
  std::map<std::string, std::string> primary;
  for (const auto& u : e.flat_views()) {
    for (const auto& s : u.params) {
      model[s.name] = {s.shape, u.trainable};
      primary[s.name] = s.name;
      for (const auto& a : s.aliases) primary[a] = s.name;
    }
  }
  for (const auto& b : e.root_module().named_buffers()) {
    model[b.key()] = {b.value().sizes().vec(), false};
    primary[b.key()] = b.key();
  }
  const Renamer rename(o.renames);
  auto model_name = [&](const std::string& key) -> std::pair<std::string, std::string> {
    const std::string renamed = rename(strip_wrappers(key));
    auto p = primary.find(renamed);
    return {renamed, p == primary.end() ? std::string() : p->second};
  };
  std::vector<std::string> problems;
  auto shape_fits = [&](const std::string& name, const DcpItem& it, const std::string& as) {
    const auto& want = model.at(name).shape;
    if (it.size == want) return;
    auto real = o.real_rows.find(name);
    const bool padded = real != o.real_rows.end() && it.size.size() == want.size() &&
                        !want.empty() &&
                        std::equal(want.begin() + 1, want.end(), it.size.begin() + 1) &&
                        it.size[0] >= real->second && it.size[0] < want[0];
    if (padded) {
      if (as == "model") {
        info.notes.push_back(cat("'", it.key, "' has ", it.size[0], " rows and the model ",
                                 want[0], ": rows ", it.size[0], "..", want[0] - 1,
                                 " are padding, set to zero"));
      }
      return;
    }
    problems.push_back(cat("'", it.key, "' ", as == "model" ? "" : cat("(", as, ") "), "has shape ",
                           shape_text(it.size), " but the model's '", name, "' has ",
                           shape_text(want)));
  };
  Match out;
  int64_t ignored_optim = 0;
  std::vector<std::string> ignored, dropped;
  for (const auto& it : m.items) {
    if (auto ok = optimizer_state_key(it.key)) {
      if (!with_optimizer) {
        ++ignored_optim;
        continue;
      }
      const auto [renamed, name] = model_name(ok->fqn);
      if (renamed.empty()) continue;
      if (name.empty()) {
        problems.push_back(cat("optimizer state '", it.key, "' (of '", renamed,
                               "') belongs to no parameter of the model"));
        continue;
      }
      if (ok->field == "max_exp_avg_sq") {
        problems.push_back(cat("'", it.key, "' is AMSGrad state, which fsdp's AdamW does not use"));
        continue;
      }
      const bool step = ok->field == "step";
      FSDP_CHECK(it.tensor || !step, what, ": '", it.key, "' is not a tensor");
      if (!step) shape_fits(name, it, ok->field);
      out.optim[{name, ok->field}] = &it;
      continue;
    }
    if (param_group_key(it.key)) {
      if (with_optimizer) out.param_groups.push_back(&it);
      continue;
    }
    if (!it.tensor) {
      ignored.push_back(it.key);
      continue;
    }
    const auto [renamed, name] = model_name(it.key);
    if (renamed.empty()) {
      dropped.push_back(it.key);
      continue;
    }
    if (name.empty()) {
      problems.push_back(renamed == it.key
                             ? cat("'", it.key, "' is no parameter or buffer of the model")
                             : cat("'", it.key, "' (as '", renamed,
                                   "') is no parameter or buffer of the model"));
      continue;
    }
    if (auto prev = out.model.find(name); prev != out.model.end()) {
      if (prev->second->size != it.size) {
        problems.push_back(cat("'", it.key, "' and '", prev->second->key, "' both give '", name,
                               "' but their shapes differ"));
      } else {
        info.notes.push_back(cat("'", it.key, "' is the model's '", name, "' as '",
                                 prev->second->key, "' is (tied weights): read once"));
      }
      continue;
    }
    shape_fits(name, it, "model");
    if (it.dtype != at::kFloat) {
      info.notes.push_back(cat("'", it.key, "' is ", dcp_dtype_name(it.dtype),
                               ", converted to float32"));
    }
    out.model[name] = &it;
  }
  for (const auto& [name, t] : model) {
    if (!out.model.count(name)) problems.push_back(cat("the model's '", name, "' is missing"));
  }
  if (with_optimizer) {
    if (out.optim.empty()) {
      problems.push_back("it holds no optimizer state (no state.<fqn>.exp_avg); load the model "
                         "alone (fsdp-train: without --init-from-optimizer)");
    } else {
      for (const auto& [name, t] : model) {
        if (!t.trainable) continue;
        for (const char* f : {"exp_avg", "exp_avg_sq", "step"}) {
          if (!out.optim.count({name, f})) {
            problems.push_back(cat("the optimizer state '", f, "' of '", name, "' is missing"));
          }
        }
      }
    }
  }
  if (!problems.empty()) {
    bool names = false, shapes = false;
    for (const auto& p : problems) {
      (p.find(" has shape ") != std::string::npos ? shapes : names) = true;
    }
    throw Error(cat(what, " does not match the model (", problems.size(),
                    problems.size() == 1 ? " problem" : " problems", "): ",
                    join_problems(problems),
                    names ? "; map names with --dcp-rename 'REGEX=REPLACEMENT' "
                            "(DcpOptions::renames; a rule that maps a name to nothing skips it)"
                          : "",
                    shapes ? "; build the model with the checkpoint's shapes" : ""));
  }
  info.tensors = static_cast<int64_t>(out.model.size());
  if (!dropped.empty()) {
    info.notes.push_back(cat(dropped.size(), " tensors skipped by a rule (", dropped.front(),
                             dropped.size() > 1 ? ", ..." : "", ")"));
  }
  if (!ignored.empty()) {
    info.notes.push_back(cat(ignored.size(), " non-tensor items left out (", ignored.front(),
                             ignored.size() > 1 ? ", ..." : "", ")"));
  }
  if (ignored_optim > 0) {
    info.notes.push_back(cat(ignored_optim, " optimizer state tensors left out (the model alone "
                             "was asked for)"));
  }
  return out;
}

// One param_groups field's value as a number (a float or an int), or a tuple of them.
std::vector<double> numbers(const Value* v, const std::string& what) {
  if (v && (v->is(Kind::kTuple) || v->is(Kind::kList))) {
    std::vector<double> out;
    for (const Value* x : v->items) out.push_back(pickle::as_number(x, what));
    return out;
  }
  if (v && v->is(Kind::kBool)) return {v->b ? 1.0 : 0.0};
  return {pickle::as_number(v, what)};
}

// The checkpoint's param_groups against the optimizer's options: every problem in one line.
void check_param_groups(const std::vector<const DcpItem*>& items, DcpReader& rd,
                        const torch::optim::Optimizer& opt, const std::string& what,
                        DcpImportInfo& info) {
  // field -> the values the checkpoint's groups hold
  std::map<std::string, std::vector<std::vector<double>>> have;
  auto take = [&](const std::string& field, const Value* v, const std::string& w) {
    if (v && v->is(Kind::kNone)) return;
    if (field == "lr" || field == "betas" || field == "eps" || field == "weight_decay" ||
        field == "amsgrad" || field == "maximize") {
      have[field].push_back(numbers(v, w));
    }
  };
  for (const DcpItem* it : items) {
    const std::string w = cat(what, ": '", it->key, "'");
    SavedValue sv = rd.value(*it);
    FSDP_CHECK(sv.value, w, " is not a torch.save'd value");
    const auto pg = *param_group_key(it->key);
    if (pg.group >= 0) {
      take(pg.field, &sv.value->root(), w);
      continue;
    }
    const Value& list = sv.value->root();
    FSDP_CHECK(list.is(Kind::kList), w, " is ", list.describe(), " where a list was expected");
    for (const Value* g : list.items) {
      FSDP_CHECK(g->is(Kind::kDict), w, " holds ", g->describe(), " where a dict was expected");
      for (size_t k = 0; k + 1 < g->items.size(); k += 2) {
        if (g->items[k]->is(Kind::kStr)) take(g->items[k]->s, g->items[k + 1], w);
      }
    }
  }
  if (have.empty()) {
    info.notes.push_back("the checkpoint has no param_groups to check the optimizer against");
    return;
  }
  const auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(
      &opt.param_groups().at(0).options());
  const auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(
      &opt.param_groups().at(0).options());
  FSDP_CHECK(adamw || adam, what, ": the optimizer is neither AdamW nor Adam");
  auto betas = adamw ? adamw->betas() : adam->betas();
  std::map<std::string, std::vector<double>> ours = {
      {"betas", {std::get<0>(betas), std::get<1>(betas)}},
      {"eps", {adamw ? adamw->eps() : adam->eps()}},
      {"weight_decay", {adamw ? adamw->weight_decay() : adam->weight_decay()}},
      {"amsgrad", {(adamw ? adamw->amsgrad() : adam->amsgrad()) ? 1.0 : 0.0}},
      {"maximize", {0.0}}};
  std::vector<std::string> problems;
  auto text = [](const std::vector<double>& v) {
    std::string s;
    for (double x : v) s += (s.empty() ? "" : ", ") + cat(x);
    return v.size() == 1 ? s : "(" + s + ")";
  };
  for (const auto& [field, want] : ours) {
    for (const auto& v : have[field]) {
      bool same = v.size() == want.size();
      for (size_t k = 0; same && k < v.size(); ++k) {
        same = std::abs(v[k] - want[k]) <= 1e-12 * std::max(1.0, std::abs(want[k]));
      }
      if (!same) {
        problems.push_back(cat(field, " is ", text(v), " there and ", text(want), " here"));
        break;
      }
    }
  }
  FSDP_CHECK(problems.empty(), what, ": its optimizer settings differ from this optimizer's (",
             join_problems(problems), "); use the same settings (fsdp-train: --beta1, --beta2, "
             "--adam-eps, --weight-decay) or load the model alone");
  if (!have["lr"].empty()) info.checkpoint_lr = have["lr"].front().front();
}

}  // namespace

}  // namespace fsdp::detail

namespace fsdp {

using detail::DcpItem;
using detail::DcpReader;

bool is_dcp_checkpoint(const std::string& dir) {
  struct stat st {};
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) &&
         ::stat((dir + "/.metadata").c_str(), &st) == 0;
}

DcpImportInfo import_dcp(ShardedModuleBase& model, const std::string& dir,
                         torch::optim::Optimizer* optimizer, const DcpOptions& options) {
  detail::Engine& e = *detail::engine_of(model);
  Runtime& rt = *e.runtime();
  const std::string what = cat("DCP checkpoint '", dir, "'");
  DcpImportInfo info;
  std::vector<at::Tensor> shards;
  std::vector<std::unique_ptr<detail::ParamState>> states;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  std::string err = detail::capture([&] {
    FSDP_CHECK(!options.optimizer || optimizer, what, ": DcpOptions::optimizer asks for the "
               "optimizer's state but no optimizer was given");
    FSDP_CHECK(is_dcp_checkpoint(dir), what, " is not a DCP checkpoint: it has no .metadata (a "
               "save that did not finish leaves none); give the directory "
               "torch.distributed.checkpoint.save wrote");
    const detail::DcpMetadata m = detail::parse_dcp_metadata(
        detail::read_text(dir + "/.metadata", int64_t{1} << 30), cat(what, "'s .metadata"));
    detail::check_dcp_files(m, dir);
    const bool with_opt = options.optimizer;
    detail::Match mt = detail::match(m, e, with_opt, options, what, info);
    DcpReader rd(dir);
    std::optional<detail::OptimizerKind> kind;
    if (with_opt) {
      kind = detail::optimizer_kind(*optimizer);
      FSDP_CHECK(kind->name == "adamw" || kind->name == "adam", what, ": optimizer state is read "
                 "for AdamW and Adam; this optimizer is ", kind->name);
      detail::check_optimizer_params(*optimizer, e);
      detail::check_param_groups(mt.param_groups, rd, *optimizer, what, info);
    }
    shards = detail::build_shards(e, [&](const std::string& name, int64_t lo, int64_t hi) {
      return rd.slice(*mt.model.at(name), lo, hi);
    });
    for (const auto& b : e.root_module().named_buffers()) {
      buffers.emplace_back(b.key(), rd.whole(*mt.model.at(b.key())));
    }
    if (with_opt) {
      const auto flats = e.flat_views();
      std::set<int64_t> steps;
      for (const auto& u : flats) {
        if (!u.trainable || u.padded == 0) {
          states.emplace_back();
          continue;
        }
        auto st = kind->make();
        int64_t step = 0;
        for (const auto& s : u.params) {
          const at::Tensor t = rd.whole(*mt.optim.at({s.name, "step"}));
          FSDP_CHECK(t.numel() == 1, what, ": the step of '", s.name, "' has ", t.numel(),
                     " elements");
          const double v = t.to(at::kDouble).item<double>();
          FSDP_CHECK(v >= 0 && v < 1e15 && v == std::floor(v), what, ": the step of '", s.name,
                     "' is ", v);
          step = std::max(step, static_cast<int64_t>(v));
          steps.insert(static_cast<int64_t>(v));
        }
        kind->set_step(*st, step);
        for (const auto& f : kind->fields) {
          if (f.name == "max_exp_avg_sq") continue;
          const at::Tensor flat = detail::build_flat(
              e, u, [&](const std::string& name, int64_t lo, int64_t hi) {
                return rd.slice(*mt.optim.at({name, f.name}), lo, hi);
              });
          f.set(*st, flat.to(u.param.device()));
        }
        states.push_back(std::move(st));
      }
      info.optimizer_step = steps.empty() ? 0 : *steps.rbegin();
      if (steps.size() > 1) {
        info.notes.push_back(cat("the parameters' optimizer steps differ (", *steps.begin(), " to ",
                                 *steps.rbegin(), "); each unit takes the largest of its own"));
      }
    }
    info.bytes_read = rd.bytes();
  });
  rt.check_all_ok(cat("importing ", what), err);
  e.replace_shards(shards);
  if (options.optimizer) {
    const auto flats = e.flat_views();
    for (size_t i = 0; i < flats.size(); ++i) {
      if (!states[i]) continue;
      optimizer->state()[compat::optimizer_state_key(flats[i].param)] = std::move(states[i]);
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& b : e.root_module().named_buffers()) {
    for (const auto& [name, v] : buffers) {
      if (name == b.key()) b.value().copy_(v);
    }
  }
  return info;
}

}  // namespace fsdp
