// Cluster descriptions for the planner: presets, cluster files, bandwidth bands (see
// fsdp/planner.h). The presets are src/planner/clusters.json, embedded at build time.
#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "fsdp/error.h"
#include "fsdp/planner.h"

namespace fsdp {

namespace planner_detail {
extern const char* const kClustersJson;  // generated from src/planner/clusters.json
}

using detail::cat;

const std::vector<BandwidthBand>& LinkSpec::bands_of(Collective c) const {
  if (c == Collective::kReduceScatter && !reduce_scatter_bands.empty()) return reduce_scatter_bands;
  if (c == Collective::kAllReduce && !all_reduce_bands.empty()) return all_reduce_bands;
  return bands;
}

double LinkSpec::busbw_at(int64_t bytes, Collective c) const {
  const auto& bands = bands_of(c);
  TORCH_INTERNAL_ASSERT(!bands.empty(), "a link without bandwidth");
  if (bands.size() == 1 || bytes <= bands.front().bytes) return bands.front().busbw;
  if (bytes >= bands.back().bytes) return bands.back().busbw;
  for (size_t i = 1; i < bands.size(); ++i) {
    if (bytes > bands[i].bytes) continue;
    const double x0 = std::log(double(bands[i - 1].bytes)), x1 = std::log(double(bands[i].bytes));
    const double t = (std::log(double(bytes)) - x0) / (x1 - x0);
    return bands[i - 1].busbw + t * (bands[i].busbw - bands[i - 1].busbw);
  }
  return bands.back().busbw;
}

namespace {
// The share of one core's rates (FLOP/s, memory bandwidth) a rank gets: on a node_shared machine
// with more ranks than cores they take turns; otherwise the whole of them.
double core_share(const ClusterSpec& c) {
  if (c.node_shared && c.cores > 0 && c.ranks_per_node > c.cores) {
    return double(c.cores) / double(c.ranks_per_node);
  }
  return 1.0;
}
}  // namespace

double ClusterSpec::rank_flops() const { return peak_flops * flops_fraction * core_share(*this); }

double ClusterSpec::rank_memory_bandwidth() const { return memory_bandwidth * core_share(*this); }

double ClusterSpec::shared_comm_exposure() const {
  if (!node_shared) return 0;
  const double k = comm_contention > 0 ? comm_contention : 1.0;
  if (cores <= 0) return k;
  const double r = double(ranks_per_node) / double(cores);
  if (r < 1) return 0;
  const int64_t measured = comm_ranks_per_node > 0 ? comm_ranks_per_node : ranks_per_node;
  const double m = std::max(1.0, double(measured) / double(cores));
  return k * r / m;
}

void ClusterSpec::validate() const {
  auto positive = [&](const char* what, double v, const char* fix) {
    FSDP_CHECK(v > 0 && std::isfinite(v), "cluster ", name, ": ", what, " ", v,
               " is invalid; ", fix);
  };
  positive("nodes", double(nodes), "give 1 or more (--nodes)");
  positive("ranks_per_node", double(ranks_per_node), "give 1 or more (--ranks-per-node)");
  positive("memory_gib", double(memory_bytes), "give the memory of one rank in GiB");
  positive("peak_tflops", peak_flops, "give one rank's peak in TFLOP/s");
  FSDP_CHECK(flops_fraction > 0 && flops_fraction <= 1, "cluster ", name, ": flops_fraction ",
             flops_fraction, " must be in (0, 1]; e.g. 0.4 for 40% of peak");
  positive("memory_bandwidth_gbs", memory_bandwidth / 1e9,
           "give one rank's achievable memory bandwidth in GB/s (a GPU's HBM, a core's stream "
           "rate; fsdp-plan --calibrate measures it)");
  FSDP_CHECK(reserve_bytes >= 0 && reserve_bytes < rank_memory(), "cluster ", name,
             ": reserve_gib must be at least 0 and below the memory of a rank");
  positive("nics_per_node", double(nics_per_node), "give the NICs of one node");
  FSDP_CHECK(cores >= 0 && comm_ranks_per_node >= 0, "cluster ", name, ": cores ", cores,
             " and comm_ranks_per_node ", comm_ranks_per_node, " must be 0 (unknown) or more");
  FSDP_CHECK(comm_contention >= 0 && std::isfinite(comm_contention), "cluster ", name,
             ": comm_contention ", comm_contention,
             " must be 0 (not measured) or more; fsdp-plan --calibrate measures it");
  for (const auto* l : {&intra, &inter}) {
    const char* which = l == &intra ? "intra" : "inter";
    FSDP_CHECK(!l->bands.empty(), "cluster ", name, ": '", which, "' has no bandwidth; give ",
               "busbw_gbs or bands");
    FSDP_CHECK(l->latency_s >= 0, "cluster ", name, ": ", which, " latency_us ",
               l->latency_s * 1e6, " is negative");
    for (const auto* bands : {&l->bands, &l->reduce_scatter_bands, &l->all_reduce_bands}) {
      const char* kind = bands == &l->bands ? "" : bands == &l->reduce_scatter_bands
                                                       ? " reduce_scatter"
                                                       : " all_reduce";
      for (size_t i = 0; i < bands->size(); ++i) {
        const BandwidthBand& b = (*bands)[i];
        FSDP_CHECK(b.busbw > 0 && std::isfinite(b.busbw) && b.bytes > 0 &&
                       (i == 0 || b.bytes > (*bands)[i - 1].bytes),
                   "cluster ", name, ": ", which, kind, " band ", i, " (", b.bytes, " bytes, ",
                   b.busbw / 1e9, " GB/s) needs a positive busbw and sizes in increasing order");
      }
    }
  }
}

namespace {

using Json = nlohmann::json;

double number(const Json& j, const char* key, const std::string& where, bool required = true,
              double fallback = 0) {
  if (!j.contains(key)) {
    FSDP_CHECK(!required, where, ": field '", key, "' is missing");
    return fallback;
  }
  FSDP_CHECK(j[key].is_number(), where, ": field '", key, "' must be a number, not ",
             j[key].dump());
  return j[key].get<double>();
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// {"busbw_gbs": X} or {"bands": [{"bytes": N, "busbw_gbs": X}, ...]}.
std::vector<BandwidthBand> parse_bands(const Json& j, const std::string& where) {
  std::vector<BandwidthBand> bands;
  if (j.contains("bands")) {
    FSDP_CHECK(j["bands"].is_array() && !j["bands"].empty(), where,
               ".bands must be a non-empty array of {\"bytes\": N, \"busbw_gbs\": X}");
    for (const auto& b : j["bands"]) {
      const std::string w = where + ".bands[]";
      FSDP_CHECK(b.is_object(), w, " must be an object");
      bands.push_back({static_cast<int64_t>(number(b, "bytes", w)), number(b, "busbw_gbs", w) * 1e9});
    }
  } else {
    bands.push_back({1, number(j, "busbw_gbs", where) * 1e9});
  }
  return bands;
}

LinkSpec parse_link(const Json& j, const std::string& where) {
  FSDP_CHECK(j.is_object(), where, " must be an object like {\"latency_us\": 5, \"busbw_gbs\": 450}");
  LinkSpec l;
  l.latency_s = number(j, "latency_us", where, false) * 1e-6;
  l.bands = parse_bands(j, where);
  // Optional: a collective's own busbw, {"busbw_gbs": X} or {"bands": [...]}.
  for (auto [key, bands] : {std::pair{"reduce_scatter", &l.reduce_scatter_bands},
                            std::pair{"all_reduce", &l.all_reduce_bands}}) {
    if (!j.contains(key)) continue;
    const std::string w = where + "." + key;
    FSDP_CHECK(j[key].is_object(), w, " must be an object like {\"busbw_gbs\": 400}");
    *bands = parse_bands(j[key], w);
  }
  return l;
}

ClusterSpec parse_cluster(const Json& j, const std::string& where) {
  FSDP_CHECK(j.is_object(), where, ": a cluster must be a JSON object");
  ClusterSpec c;
  FSDP_CHECK(j.contains("name") && j["name"].is_string(), where, ": field 'name' (a string) is missing");
  c.name = j["name"].get<std::string>();
  const std::string w = where + " (" + c.name + ")";
  if (j.contains("description") && j["description"].is_string()) c.description = j["description"];
  c.nodes = static_cast<int64_t>(number(j, "nodes", w, false, 1));
  c.ranks_per_node = static_cast<int64_t>(number(j, "ranks_per_node", w));
  c.memory_bytes = static_cast<int64_t>(number(j, "memory_gib", w) * kGiB);
  c.reserve_bytes = static_cast<int64_t>(number(j, "reserve_gib", w, false) * kGiB);
  c.peak_flops = number(j, "peak_tflops", w) * 1e12;
  c.flops_fraction = number(j, "flops_fraction", w, false, 1.0);
  FSDP_CHECK(j.contains("memory_bandwidth_gbs"), w, ": field 'memory_bandwidth_gbs' (one rank's ",
             "achievable memory bandwidth, for the optimizer step) is missing; add it, or rerun ",
             "fsdp-plan --calibrate for this machine's file");
  c.memory_bandwidth = number(j, "memory_bandwidth_gbs", w) * 1e9;
  FSDP_CHECK(j.contains("intra"), w, ": field 'intra' is missing");
  c.intra = parse_link(j["intra"], w + " intra");
  c.inter = j.contains("inter") ? parse_link(j["inter"], w + " inter") : c.intra;
  c.nics_per_node = static_cast<int64_t>(number(j, "nics_per_node", w, false, 1));
  if (j.contains("node_shared")) {
    FSDP_CHECK(j["node_shared"].is_boolean(), w, ": field 'node_shared' must be true or false");
    c.node_shared = j["node_shared"].get<bool>();
  }
  c.cores = static_cast<int64_t>(number(j, "cores", w, false, 0));
  c.comm_ranks_per_node = static_cast<int64_t>(number(j, "comm_ranks_per_node", w, false, 0));
  c.comm_contention = number(j, "comm_contention", w, false, 0);
  if (j.contains("sources") && j["sources"].is_object()) {
    for (const auto& [k, v] : j["sources"].items()) {
      if (v.is_string()) c.sources[k] = v.get<std::string>();
    }
  }
  c.validate();
  return c;
}

const Json& presets_json() {
  static const Json j = Json::parse(planner_detail::kClustersJson);
  return j;
}

}  // namespace

std::vector<std::string> cluster_preset_names() {
  std::vector<std::string> names;
  for (const auto& c : presets_json()["clusters"]) names.push_back(c["name"].get<std::string>());
  return names;
}

ClusterSpec cluster_preset(const std::string& name) {
  std::string list;
  for (const auto& c : presets_json()["clusters"]) {
    if (c["name"] == name) return parse_cluster(c, "cluster preset");
    list += (list.empty() ? "" : ", ") + c["name"].get<std::string>();
  }
  throw Error(cat("cluster '", name, "' is neither a preset (", list,
                  ") nor a cluster file; give one of those or a path to a JSON file"));
}

ClusterSpec parse_cluster_json(const std::string& text, const std::string& origin) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::parse_error& e) {
    std::string what = e.what();
    for (char& ch : what) ch = ch == '\n' ? ' ' : ch;
    throw Error(cat(origin, " is not valid JSON: ", what));
  }
  return parse_cluster(j, origin);
}

ClusterSpec read_cluster_file(const std::string& path) {
  std::ifstream in(path);
  FSDP_CHECK(in, "cluster file '", path, "' cannot be read; give a preset name or a readable file");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_cluster_json(ss.str(), "cluster file '" + path + "'");
}

ClusterSpec load_cluster(const std::string& name_or_path) {
  struct stat st {};
  const auto names = cluster_preset_names();
  if (std::find(names.begin(), names.end(), name_or_path) == names.end() &&
      ::stat(name_or_path.c_str(), &st) == 0) {
    return read_cluster_file(name_or_path);
  }
  return cluster_preset(name_or_path);
}

std::string calibrated_cluster_path() {
  const char* file = std::getenv("FSDP_CLUSTER_FILE");
  if (file && *file) return file;
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.config/fsdp/this-machine.json";
}

ClusterSpec this_machine_cluster() {
  const std::string path = calibrated_cluster_path();
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return read_cluster_file(path);
  return cluster_preset("this-machine");
}

std::string cluster_to_json(const ClusterSpec& c) {
  nlohmann::ordered_json j;
  j["name"] = c.name;
  j["description"] = c.description;
  j["ranks_per_node"] = c.ranks_per_node;
  j["nodes"] = c.nodes;
  if (c.node_shared) {
    j["node_shared"] = true;
    j["cores"] = c.cores;
    if (c.comm_ranks_per_node > 0) j["comm_ranks_per_node"] = c.comm_ranks_per_node;
    if (c.comm_contention > 0) j["comm_contention"] = c.comm_contention;
  }
  j["memory_gib"] = double(c.memory_bytes) / kGiB;
  j["reserve_gib"] = double(c.reserve_bytes) / kGiB;
  j["peak_tflops"] = c.peak_flops / 1e12;
  j["flops_fraction"] = c.flops_fraction;
  j["memory_bandwidth_gbs"] = c.memory_bandwidth / 1e9;
  auto put_bands = [](nlohmann::ordered_json& o, const std::vector<BandwidthBand>& bands) {
    if (bands.size() == 1) {
      o["busbw_gbs"] = bands[0].busbw / 1e9;
    } else {
      for (const auto& b : bands) o["bands"].push_back({{"bytes", b.bytes}, {"busbw_gbs", b.busbw / 1e9}});
    }
  };
  auto link = [&](const LinkSpec& l) {
    nlohmann::ordered_json o;
    o["latency_us"] = l.latency_s * 1e6;
    put_bands(o, l.bands);
    if (!l.reduce_scatter_bands.empty()) put_bands(o["reduce_scatter"], l.reduce_scatter_bands);
    if (!l.all_reduce_bands.empty()) put_bands(o["all_reduce"], l.all_reduce_bands);
    return o;
  };
  j["intra"] = link(c.intra);
  j["inter"] = link(c.inter);
  j["nics_per_node"] = c.nics_per_node;
  j["sources"] = c.sources;
  return j.dump(2);
}

}  // namespace fsdp
