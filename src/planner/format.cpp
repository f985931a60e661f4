// The plan for people (table), for programs (JSON) and as a picture (gnuplot script).
#include <nlohmann/json.hpp>

#include <cstdio>
#include <sstream>

#include "fsdp/error.h"
#include "fsdp/planner.h"

namespace fsdp {

using detail::cat;

namespace {

std::string seconds(double s) {
  char buf[32];
  if (s >= 1) {
    std::snprintf(buf, sizeof(buf), "%.2f s", s);
  } else if (s >= 1e-3) {
    std::snprintf(buf, sizeof(buf), "%.1f ms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f us", s * 1e6);
  }
  return buf;
}

std::string pad(const std::string& s, size_t w) {
  return s.size() >= w ? s + " " : s + std::string(w - s.size(), ' ');
}

std::string dtype_name(c10::ScalarType t) {
  return t == c10::kBFloat16 ? "bf16" : t == c10::kHalf ? "fp16" : t == c10::kFloat ? "fp32" : "fp64";
}

}  // namespace

std::string ClusterPlan::to_text(const std::string& marked) const {
  std::ostringstream os;
  const auto& c = cluster;
  const auto& o = options;
  char buf[160];
  std::snprintf(buf, sizeof(buf), "%.3g TFLOP/s x %.2f", c.peak_flops / 1e12, c.flops_fraction);
  os << "fsdp-plan: model " << model.name << " (" << format_count(double(model.parameters()))
     << " parameters, " << model.layers << " blocks, d " << model.hidden << ", seq "
     << model.seq_len << ") on " << c.name << ": " << c.nodes << (c.nodes == 1 ? " node" : " nodes")
     << " x " << c.ranks_per_node << " ranks = " << c.world_size() << " ranks, "
     << format_bytes(double(c.rank_memory())) << " and " << buf << " per rank\n"
     << "  micro-batch " << o.micro_batch << " x " << model.seq_len << " tokens, grad accum "
     << o.grad_accum << ", params " << dtype_name(o.param_dtype) << ", reduce "
     << dtype_name(o.reduce_dtype) << ", optimizer states " << o.optimizer_states
     << ", recompute " << to_string(o.recompute) << ", prefetch " << (o.prefetch ? "on" : "off")
     << "\n\n";
  os << "  " << pad("#", 4) << pad("strategy", 20) << pad("mesh", 11) << pad("memory/rank", 12)
     << pad("fits", 6) << pad("compute", 10) << pad("exposed comm", 17) << pad("update", 10)
     << pad("step", 10)
     << pad("tok/s/rank", 11) << pad("intra/rank", 12) << "inter/rank\n";
  int i = 0;
  for (const auto& p : ranked) {
    ++i;
    const bool mark = !marked.empty() && p.label() == marked;
    std::snprintf(buf, sizeof(buf), "%s (%.0f%%)", seconds(p.time.exposed).c_str(),
                  100 * p.time.exposed_fraction());
    os << (mark ? "* " : "  ") << pad(std::to_string(i), 4) << pad(to_string(p.strategy), 20)
       << pad(p.mesh_string(), 11) << pad(format_bytes(double(p.memory.total())), 12)
       << pad(p.fits ? "yes" : "no", 6) << pad(seconds(p.time.compute), 10) << pad(buf, 17)
       << pad(seconds(p.time.update), 10) << pad(seconds(p.time.step), 10) << pad(format_count(p.tokens_per_s), 11)
       << pad(format_bytes(double(p.intra_bytes)), 12) << format_bytes(double(p.inter_bytes))
       << "\n";
  }
  if (!marked.empty()) os << "  (* = " << marked << ", the configuration of this run)\n";
  if (!excluded.empty()) {
    os << "\n  not candidates:\n";
    for (const auto& e : excluded) os << "    " << pad(e.label(), 32) << e.excluded << "\n";
  }
  const auto& b = ranked.front();
  os << "\n  memory per rank of " << b.label() << ": parameters " << format_bytes(double(b.memory.params))
     << ", gradients " << format_bytes(double(b.memory.grads)) << ", optimizer "
     << format_bytes(double(b.memory.optimizer)) << ", gathered parameters "
     << format_bytes(double(b.memory.gathered_params)) << ", gradient buffers "
     << format_bytes(double(b.memory.grad_buffers)) << ", activations "
     << format_bytes(double(b.memory.activations)) << ", runtime reserve "
     << format_bytes(double(b.memory.reserve)) << "; capacity " << format_bytes(double(b.capacity))
     << "\n";
  os << "\nrecommendation: " << recommendation << "\n";
  return os.str();
}

std::string ClusterPlan::to_json() const {
  nlohmann::ordered_json j;
  j["model"] = {{"name", model.name},         {"parameters", model.parameters()},
                {"layers", model.layers},     {"hidden", model.hidden},
                {"heads", model.heads},       {"seq_len", model.seq_len},
                {"vocab", model.vocab},
                {"flops_per_token", model.flops_per_token(options.recompute)}};
  j["cluster"] = nlohmann::ordered_json::parse(cluster_to_json(cluster));
  j["options"] = {{"micro_batch", options.micro_batch},
                  {"grad_accum", options.grad_accum},
                  {"param_dtype", dtype_name(options.param_dtype)},
                  {"reduce_dtype", dtype_name(options.reduce_dtype)},
                  {"optimizer_states", options.optimizer_states},
                  {"recompute", to_string(options.recompute)},
                  {"grad_sync", to_string(options.grad_sync)},
                  {"prefetch", options.prefetch},
                  {"clip", options.clip}};
  auto& rs = j["candidates"] = nlohmann::ordered_json::array();
  int rank = 0;
  for (const auto& p : ranked) {
    nlohmann::ordered_json c;
    c["rank"] = ++rank;
    c["strategy"] = to_string(p.strategy);
    c["mesh"] = {p.replicate, p.shard};
    c["fits"] = p.fits;
    c["memory_bytes"] = {{"params", p.memory.params},
                         {"grads", p.memory.grads},
                         {"optimizer", p.memory.optimizer},
                         {"sharded_state", p.memory.states()},
                         {"gathered_params", p.memory.gathered_params},
                         {"grad_buffers", p.memory.grad_buffers},
                         {"activations", p.memory.activations},
                         {"reserve", p.memory.reserve},
                         {"total", p.memory.total()},
                         {"capacity", p.capacity}};
    c["comm_bytes_per_step"] = {
        {"shard", {{"all_gather", p.comm.shard_all_gather},
                   {"reduce_scatter", p.comm.shard_reduce_scatter},
                   {"all_reduce", p.comm.shard_all_reduce},
                   {"total", p.comm.shard_all_gather + p.comm.shard_reduce_scatter +
                                 p.comm.shard_all_reduce}}},
        {"replicate", {{"all_reduce", p.comm.replicate_all_reduce}}}};
    c["sent_bytes_per_step"] = {{"intra_node", p.intra_bytes}, {"inter_node", p.inter_bytes}};
    c["crosses_nodes"] = {{"shard", p.shard_crosses_nodes}, {"replicate", p.replicate_crosses_nodes}};
    c["time_s"] = {{"compute", p.time.compute},
                   {"communication", p.time.communication},
                   {"exposed", p.time.exposed},
                   {"update", p.time.update},
                   {"step", p.time.step}};
    c["exposed_fraction"] = p.time.exposed_fraction();
    c["tokens_per_s_per_rank"] = p.tokens_per_s;
    c["reason"] = p.reason;
    rs.push_back(c);
  }
  auto& ex = j["excluded"] = nlohmann::ordered_json::array();
  for (const auto& e : excluded) {
    ex.push_back({{"strategy", to_string(e.strategy)}, {"mesh", {e.replicate, e.shard}},
                  {"reason", e.excluded}});
  }
  j["recommendation"] = recommendation;
  return j.dump();
}

std::string ClusterPlan::chart_script(const std::string& png) const {
  auto quoted = [](const std::string& s) {
    std::string out = "'";
    for (char ch : s) out += ch == '\'' ? std::string("''") : std::string(1, ch);
    return out + "'";
  };
  std::ostringstream os;
  const size_t n = ranked.size();
  const int height = 260 + 26 * static_cast<int>(n);
  os << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo size 1200," << height
     << " noenhanced } else { set terminal png size 1200," << height << " noenhanced }\n"
     << "set output " << quoted(png) << "\n"
     << "set multiplot layout 1,2 title "
     << quoted(cat("fsdp-plan: ", model.name, " on ", cluster.nodes, " x ", cluster.ranks_per_node,
                   " ", cluster.name, " (best first)"))
     << "\nset style data histograms\nset style histogram rowstacked\n"
     << "set style fill solid 0.8 border -1\nset boxwidth 0.7\nset grid x\n"
     << "set yrange [-0.5:" << n << "-0.5]\nset key above\n";
  os << "$d << EOD\n";
  char buf[256];
  for (size_t i = 0; i < n; ++i) {
    const auto& p = ranked[i];
    // The best on top: y counts down from n - 1.
    std::snprintf(buf, sizeof(buf), "%zu \"%s\" %.6g %.6g %.6g %d %.6g\n", n - 1 - i,
                  p.label().c_str(), p.time.compute, p.time.exposed,
                  double(p.memory.total()) / (1024.0 * 1024 * 1024), p.fits ? 1 : 0,
                  p.time.update);
    os << buf;
  }
  os << "EOD\n";
  const double cap = double(cluster.rank_memory()) / (1024.0 * 1024 * 1024);
  os << "set xlabel 'seconds per optimizer step'\nset ytics nomirror\n"
     << "plot $d using ($3/2):1:($3/2):(0.35):ytic(2) with boxxyerror lc rgb '#4477aa' title 'compute', "
     << "$d using ($3+$4/2):1:($4/2):(0.35) with boxxyerror lc rgb '#ee6677' title 'exposed communication', "
     << "$d using ($3+$4+$7/2):1:($7/2):(0.35) with boxxyerror lc rgb '#ccbb44' title 'update (optimizer)'\n"
     << "set xlabel 'GiB per rank (predicted)'\nset format y ''\n"
     << "set arrow 1 from " << cap << ",-0.5 to " << cap << "," << n
     << "-0.5 nohead lw 2 dt 2 lc rgb 'black'\n"
     << "plot $d using ($5/2):1:($5/2):(0.35) with boxxyerror lc rgb '#228833' title "
     << quoted(cat("memory (capacity ", format_bytes(double(cluster.rank_memory())), ": dashed)"))
     << "\nunset multiplot\nunset output\n";
  return os.str();
}

}  // namespace fsdp
