// Topology report (see fsdp/report.h).
#include "fsdp/report.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <iomanip>
#include <set>
#include <sstream>

#include "fsdp/error.h"

namespace fsdp {

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (bytes >= 1024.0 && i < 4) {
    bytes /= 1024.0;
    ++i;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), i == 0 ? "%.0f %s" : "%.2f %s", bytes, units[i]);
  return buf;
}

ReportOptions ReportOptions::for_strategy(const FSDPStrategy& s) {
  ReportOptions o;
  o.grad_sync = s.grad_sync();
  o.prefetch = s.forward_prefetch();
  const auto& mp = s.mixed_precision();
  o.param_dtype = mp.param_dtype.value_or(c10::kFloat);
  o.reduce_dtype = mp.reduce_dtype.value_or(o.param_dtype);
  return o;
}

TopologyReport make_topology_report(const ShardingPlan& plan, int64_t local_world_size,
                                    const std::vector<UnitInfo>& units,
                                    const ReportOptions& o) {
  FSDP_CHECK(o.grad_accum >= 1, "grad_accum ", o.grad_accum, " is invalid; use 1 or more");
  TopologyReport r;
  r.world_size = plan.layout.numel();
  r.local_world_size = local_world_size;
  r.num_nodes = r.world_size / local_world_size;
  r.strategy = plan.strategy;
  r.replicate_size = plan.replicate_size();
  r.shard_size = plan.shard_size();
  r.shard_groups = plan.layout.groups(1);
  r.replicate_groups = plan.layout.groups(0);
  for (int64_t rank = 0; rank < r.world_size; ++rank) {
    auto c = plan.layout.coordinate_of(rank);
    r.ranks.push_back({rank, c[0], c[1], rank / local_world_size, rank % local_world_size});
  }
  r.units = units;
  r.warnings = plan.warnings;
  const int64_t S = r.shard_size, R = r.replicate_size, K = o.grad_accum;
  const int64_t pb = c10::elementSize(o.param_dtype), rb = c10::elementSize(o.reduce_dtype);
  // Micro-steps that reduce-scatter, and that all-reduce across replicas (see GradSync).
  const int64_t rs_steps = o.grad_sync == GradSync::kLocal ? 1 : K;
  const int64_t ar_steps = o.grad_sync == GradSync::kEveryMicroStep ? K : 1;
  int64_t gathered_all = 0, largest = 0, second = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    const auto& u = units[i];
    // NOTE [frozen parameters]: both flats are gathered; only the trainable one is reduced and
    // has gradients and optimizer state.
    r.total_params += u.total_numel();
    r.trainable_params += u.numel;
    r.sharded.params += (u.shard_numel + u.frozen_shard_numel) * 4;
    r.sharded.grads += u.shard_numel * 4;
    r.replica.params += u.total_numel() * 4;
    r.replica.grads += u.numel * 4;
    if (u.total_numel() == 0) continue;
    const int64_t gathered = (u.padded_numel + u.frozen_padded_numel) * pb;
    gathered_all += gathered;
    if (i > 0) {
      if (gathered > largest) {
        second = largest;
        largest = gathered;
      } else if (gathered > second) {
        second = gathered;
      }
    }
    if (S > 1) {
      // Forward gathers every unit; backward gathers again what was freed after forward
      // (every unit but the root, under FULL_SHARD / HYBRID_SHARD).
      const bool regather = plan.reshard_after_forward && i > 0;
      r.comm.shard_all_gather += K * gathered * (regather ? 2 : 1);
      r.comm.frozen_all_gather += K * u.frozen_padded_numel * pb * (regather ? 2 : 1);
      r.comm.shard_reduce_scatter += rs_steps * u.padded_numel * rb;
    }
    if (R > 1) r.comm.replicate_all_reduce += ar_steps * u.shard_numel * rb;
  }
  if (o.clip && S > 1) r.comm.shard_all_reduce += 8;  // one double: the squared norm
  r.sharded.optimizer = r.sharded.grads * o.optimizer_states;
  r.replica.optimizer = r.replica.grads * o.optimizer_states;
  const int64_t root =
      units.empty() ? 0 : (units[0].padded_numel + units[0].frozen_padded_numel) * pb;
  if (S == 1 && o.param_dtype == c10::kFloat) {
    r.peak_unsharded_param_bytes = 0;  // parameters are views of the shards
  } else if (plan.reshard_after_forward) {
    r.peak_unsharded_param_bytes = root + largest + (o.prefetch ? second : 0);
  } else {
    r.peak_unsharded_param_bytes = gathered_all;  // ZeRO-2 keeps units until after backward
  }
  return r;
}

namespace {

std::string groups_line(const std::vector<std::vector<int64_t>>& groups) {
  std::string s;
  for (const auto& g : groups) {
    s += s.empty() ? "[" : "  [";
    for (size_t i = 0; i < g.size(); ++i) s += detail::cat(i ? ", " : "", g[i]);
    s += "]";
  }
  return s;
}

// How many of `groups` hold ranks of more than one node.
int64_t groups_crossing_nodes(const std::vector<std::vector<int64_t>>& groups,
                              int64_t local_world_size) {
  int64_t n = 0;
  for (const auto& g : groups) {
    std::set<int64_t> nodes;
    for (int64_t rank : g) nodes.insert(rank / local_world_size);
    n += nodes.size() > 1 ? 1 : 0;
  }
  return n;
}

// "none", "all 4" or "1 of 4".
std::string how_many(int64_t k, size_t n) {
  if (k == 0) return "none";
  if (k == static_cast<int64_t>(n)) return detail::cat("all ", n);
  return detail::cat(k, " of ", n);
}

std::string pad(const std::string& s, size_t width) {
  return s.size() >= width ? s : s + std::string(width - s.size(), ' ');
}

}  // namespace

std::string format_count(double n) {
  char buf[32];
  if (n >= 1e9) {
    std::snprintf(buf, sizeof(buf), "%.2f G", n / 1e9);
  } else if (n >= 1e6) {
    std::snprintf(buf, sizeof(buf), "%.2f M", n / 1e6);
  } else if (n >= 1e3) {
    std::snprintf(buf, sizeof(buf), "%.1f k", n / 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f", n);
  }
  return buf;
}

int64_t parse_count(const std::string& text, const char* what) {
  const char* begin = text.c_str();
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(begin, &end);
  double scale = 1;
  if (end != begin && *end != '\0' && end[1] == '\0') {
    switch (*end) {
      case 'k': case 'K': scale = 1e3; ++end; break;
      case 'M': scale = 1e6; ++end; break;
      case 'B': case 'G': scale = 1e9; ++end; break;
      case 'T': scale = 1e12; ++end; break;
      default: break;
    }
  }
  v *= scale;
  const bool number = end != begin && *end == '\0' && errno == 0 && std::isfinite(v) &&
                      text.find_first_of(" \t") == std::string::npos;
  FSDP_CHECK(number && v >= 0 && v < 9e18 && std::fabs(v - std::round(v)) < 1e-3, what, " '",
             text, "' is not a count; write it as 124475904, 124M, 6.7B, 70e9 or 1.5T");
  return static_cast<int64_t>(std::llround(v));
}

namespace {

// The mesh as a grid: rows are replicas (replicate coordinate), columns shard coordinates.
void print_grid(std::ostream& os, const TopologyReport& r) {
  const size_t w = std::max<size_t>(9, std::to_string(r.world_size).size() + 6);
  os << pad("", 14);
  for (int64_t s = 0; s < r.shard_size; ++s) os << pad(detail::cat("shard ", s), w);
  os << "\n";
  for (int64_t rep = 0; rep < r.replicate_size; ++rep) {
    os << pad(detail::cat("  replica ", rep), 14);
    std::set<int64_t> nodes;
    for (int64_t s = 0; s < r.shard_size; ++s) {
      const auto& g = r.shard_groups[rep];
      os << pad(detail::cat("rank ", g[s]), w);
      nodes.insert(g[s] / r.local_world_size);
    }
    os << (nodes.size() == 1 ? "node " : "nodes ");
    bool first = true;
    for (int64_t n : nodes) {
      os << (first ? "" : ",") << n;
      first = false;
    }
    os << "\n";
  }
}

// The groups, which of them cross nodes, and every rank's coordinates.
void print_groups(std::ostream& os, const TopologyReport& r) {
  os << "\n  shard groups (all-gather parameters, reduce-scatter gradients):\n    "
     << groups_line(r.shard_groups) << "\n";
  os << "  replicate groups (all-reduce gradient shards):\n    " << groups_line(r.replicate_groups)
     << "\n\n";
  if (r.num_nodes == 1) {
    os << "  crossing nodes: none (one node)\n\n";
  } else {
    const int64_t s = groups_crossing_nodes(r.shard_groups, r.local_world_size);
    const int64_t rc = groups_crossing_nodes(r.replicate_groups, r.local_world_size);
    os << "  crossing nodes:\n    shard groups      " << how_many(s, r.shard_groups.size())
       << (s == 0 ? " (parameter all-gathers and gradient reduce-scatters stay inside a node)"
                  : " (their parameter all-gathers and gradient reduce-scatters cross nodes)")
       << "\n    replicate groups  " << how_many(rc, r.replicate_groups.size())
       << (rc == 0 ? " (gradient all-reduces stay inside a node)"
                  : " (their gradient-shard all-reduces cross nodes)")
       << "\n\n";
  }
  os << "  rank  (replicate, shard)  node  local rank\n";
  for (const auto& p : r.ranks) {
    os << "  " << pad(std::to_string(p.rank), 6) << pad(detail::cat("(", p.replicate, ", ", p.shard, ")"), 20)
       << pad(std::to_string(p.node), 6) << p.local_rank << "\n";
  }
}

// The model's units and what each rank stores of them.
void print_units(std::ostream& os, const TopologyReport& r) {
  const int64_t frozen = r.total_params - r.trainable_params;
  os << "\n  model: " << format_count(r.total_params) << " parameters";
  if (frozen > 0) {
    os << " (" << format_count(r.trainable_params) << " trainable, " << format_count(frozen)
       << " frozen)";
  }
  os << " in " << r.units.size() << (r.units.size() == 1 ? " unit" : " units") << "; each rank stores "
     << format_count(r.sharded.params / 4) << " of them\n";
  for (const auto& u : r.units) {
    os << "    " << pad(u.name.empty() ? "(root)" : u.name, 28)
       << pad(format_count(u.total_numel()), 10) << "shard ";
    const std::string shard = format_count(u.shard_numel + u.frozen_shard_numel);
    if (u.frozen_numel == 0) {
      os << shard;
    } else {
      os << pad(shard, 10)
         << (u.numel == 0 ? "frozen" : detail::cat("frozen ", format_count(u.frozen_numel)));
    }
    if (u.construction == "built whole") {  // NOTE [deferred init]
      os << "  built whole (" << format_bytes(double(u.total_numel()) * 4) << " at once)";
    } else if (!u.construction.empty()) {
      os << "  " << u.construction;
    }
    os << "\n";
  }
}

// Communication and memory per rank.
void print_comm_and_memory(std::ostream& os, const TopologyReport& r) {
  os << "\n  communication per optimizer step, per rank (payload issued):\n";
  os << "    shard group      all-gather " << pad(format_bytes(r.comm.shard_all_gather), 12);
  if (r.comm.frozen_all_gather) {
    os << "(frozen " << format_bytes(r.comm.frozen_all_gather) << ", trainable "
       << format_bytes(r.comm.shard_all_gather - r.comm.frozen_all_gather) << ")  ";
  }
  os << "reduce-scatter " << format_bytes(r.comm.shard_reduce_scatter);
  if (r.comm.shard_all_reduce) os << "   all-reduce " << format_bytes(r.comm.shard_all_reduce);
  os << "\n    replicate group  all-reduce " << format_bytes(r.comm.replicate_all_reduce) << "\n";
  os << "\n  memory per rank      sharded      one replica\n";
  auto row = [&](const char* name, int64_t a, int64_t b) {
    os << "    " << pad(name, 17) << pad(format_bytes(a), 13) << format_bytes(b) << "\n";
  };
  row("parameters", r.sharded.params, r.replica.params);
  row("gradients", r.sharded.grads, r.replica.grads);
  row("optimizer state", r.sharded.optimizer, r.replica.optimizer);
  row("total", r.sharded.total(), r.replica.total());
  os << "    gathered parameters at peak (estimate): " << format_bytes(r.peak_unsharded_param_bytes)
     << "\n";
}

}  // namespace

std::string TopologyReport::to_text() const {
  std::ostringstream os;
  os << "fsdp topology: " << to_string(strategy) << ", world " << world_size << " = " << num_nodes
     << (num_nodes == 1 ? " node" : " nodes") << " x " << local_world_size << " ranks, mesh ("
     << replicate_size << ", " << shard_size << ") = " << replicate_size
     << (replicate_size == 1 ? " replica" : " replicas") << " x " << shard_size
     << "-way sharding\n\n";
  print_grid(os, *this);
  print_groups(os, *this);
  print_units(os, *this);
  print_comm_and_memory(os, *this);
  for (const auto& wmsg : warnings) os << "\n  warning: " << wmsg << "\n";
  return os.str();
}

std::string TopologyReport::to_json() const {
  nlohmann::ordered_json j;
  j["world_size"] = world_size;
  j["num_nodes"] = num_nodes;
  j["local_world_size"] = local_world_size;
  j["mesh"] = {replicate_size, shard_size};
  j["strategy"] = to_string(strategy);
  j["shard_groups"] = shard_groups;
  j["replicate_groups"] = replicate_groups;
  j["groups_crossing_nodes"] = {
      {"shard", groups_crossing_nodes(shard_groups, local_world_size)},
      {"replicate", groups_crossing_nodes(replicate_groups, local_world_size)}};
  auto& rs = j["ranks"] = nlohmann::ordered_json::array();
  for (const auto& p : ranks) {
    rs.push_back({{"rank", p.rank}, {"replicate", p.replicate}, {"shard", p.shard},
                  {"node", p.node}, {"local_rank", p.local_rank}});
  }
  j["total_params"] = total_params;
  j["trainable_params"] = trainable_params;
  auto& us = j["units"] = nlohmann::ordered_json::array();
  for (const auto& u : units) {
    us.push_back({{"name", u.name.empty() ? "(root)" : u.name}, {"params", u.numel},
                  {"padded_params", u.padded_numel}, {"shard_params", u.shard_numel},
                  {"frozen_params", u.frozen_numel}, {"frozen_padded_params", u.frozen_padded_numel},
                  {"frozen_shard_params", u.frozen_shard_numel}});
  }
  j["comm_bytes_per_step"] = {
      {"shard", {{"all_gather", comm.shard_all_gather},
                 {"all_gather_frozen", comm.frozen_all_gather},
                 {"reduce_scatter", comm.shard_reduce_scatter},
                 {"all_reduce", comm.shard_all_reduce}}},
      {"replicate", {{"all_reduce", comm.replicate_all_reduce}}}};
  auto mem = [](const RankMemory& m) {
    return nlohmann::ordered_json{{"params", m.params}, {"grads", m.grads},
                                  {"optimizer", m.optimizer}, {"total", m.total()}};
  };
  j["memory_bytes_per_rank"] = {{"sharded", mem(sharded)}, {"replica", mem(replica)},
                                {"peak_gathered_params", peak_unsharded_param_bytes}};
  j["warnings"] = warnings;
  return j.dump();
}

}  // namespace fsdp
