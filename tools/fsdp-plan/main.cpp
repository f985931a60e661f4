// fsdp-plan: which sharding strategy and mesh to use for a model on a cluster. Predicts memory
// per rank, bytes per link class and step time for every strategy and mesh, ranks them and says
// why the first wins (fsdp/planner.h). Starts no process and needs no GPU: it runs in
// milliseconds.
//
//   fsdp-plan --model llama2-70b --cluster h100-sxm-8x400g --nodes 64 --precision bf16
//     --recompute full
//   fsdp-plan --cluster this-machine --ranks-per-node 4 --model small --json
//   fsdp-plan --calibrate --devices 4      (measures this machine, writes its cluster file)
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "calibrate.h"
#include "fsdp/error.h"
#include "fsdp/planner.h"
#include "plot.h"

namespace {

int fail(int code, const std::string& message) {
  std::string line = message;
  for (char& c : line) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  std::fflush(stdout);
  std::fprintf(stderr, "fsdp-plan: error: %s\n", line.c_str());
  return code;
}

struct Flags {
  std::string cluster = "this-machine";
  int64_t nodes = 0, ranks_per_node = 0;
  std::string model = "small";
  int64_t layers = 0, d_model = 0, heads = 0, kv_heads = -1, ffn = 0, vocab = 0, seq_len = 0;
  std::string params = "0";  // a count as people write one (fsdp::parse_count): 70e9, 6.7B
  int64_t micro_batch = 1, grad_accum = 1;
  std::string precision = "fp32", reduce = "";
  std::string optimizer = "adamw";
  std::string recompute = "none";
  std::vector<std::string> strategies;
  std::string mesh;
  std::string grad_sync = "every";
  std::string prefetch = "on";
  bool clip = false;
  bool json = false, list = false, published = false;
  std::string chart;
  fsdp_plan::CalibrateOptions calibrate;
  bool do_calibrate = false;
};

c10::ScalarType parse_dtype(const std::string& flag, const std::string& v) {
  if (v == "fp32") return c10::kFloat;
  if (v == "bf16") return c10::kBFloat16;
  if (v == "fp16") return c10::kHalf;
  throw fsdp::Error(fsdp::cat(flag, " '", v, "' is unknown; use fp32, bf16 or fp16"));
}

fsdp::ModelSpec model_from(const Flags& f) {
  fsdp::ModelSpec m = fsdp::model_preset(f.model);
  auto set = [](int64_t v, int64_t& field) {
    if (v != 0) field = v;
  };
  set(f.layers, m.layers);
  set(f.d_model, m.hidden);
  set(f.heads, m.heads);
  set(f.ffn, m.ffn_hidden);
  set(f.vocab, m.vocab);
  set(f.seq_len, m.seq_len);
  if (f.kv_heads >= 0) m.kv_heads = f.kv_heads;
  const int64_t params = fsdp::parse_count(f.params, "--params");
  if (f.layers || f.d_model || f.heads || f.vocab || params) m.name = "custom";
  m.validate();
  if (params != 0) {
    // A generic transformer by parameter count: the root as the shape gives it, the rest split
    // evenly over the blocks.
    auto units = m.unit_counts();
    const int64_t blocks = params - units[0].numel;
    FSDP_CHECK(blocks >= m.layers, "--params ", f.params, " is smaller than the embeddings and ",
               "head alone (", units[0].numel, "); give more parameters or a smaller --vocab/--d-model");
    for (size_t i = 1; i < units.size(); ++i) {
      units[i].numel = blocks / m.layers + (int64_t(i) <= blocks % m.layers ? 1 : 0);
    }
    m.units = units;
  }
  return m;
}

fsdp::PlanOptions options_from(const Flags& f) {
  fsdp::PlanOptions o;
  o.micro_batch = f.micro_batch;
  o.grad_accum = f.grad_accum;
  o.param_dtype = parse_dtype("--precision", f.precision);
  o.reduce_dtype = f.reduce.empty() ? o.param_dtype : parse_dtype("--reduce-dtype", f.reduce);
  if (f.optimizer == "adamw") {
    o.optimizer_states = 2;
  } else if (f.optimizer == "sgd") {
    o.optimizer_states = 1;
  } else {
    throw fsdp::Error("--optimizer '" + f.optimizer + "' is unknown; use adamw or sgd (momentum)");
  }
  o.recompute = fsdp::parse_recompute(f.recompute);
  for (const auto& s : f.strategies) o.strategies.push_back(fsdp::parse_sharding_strategy(s));
  if (!f.mesh.empty()) o.mesh = fsdp::parse_mesh_shape(f.mesh);
  o.grad_sync = fsdp::parse_grad_sync(f.grad_sync);
  FSDP_CHECK(f.prefetch == "on" || f.prefetch == "off", "--prefetch '", f.prefetch,
             "' is unknown; use on or off");
  o.prefetch = f.prefetch == "on";
  o.clip = f.clip;
  return o;
}

std::string list_text() {
  std::string s = "cluster presets (src/planner/clusters.json):\n";
  for (const auto& n : fsdp::cluster_preset_names()) {
    const auto c = fsdp::cluster_preset(n);
    s += "  " + n + ": " + c.description + "\n";
    for (const auto& [k, v] : c.sources) s += "      " + k + ": " + v + "\n";
  }
  s += "model presets:\n";
  for (const auto& n : fsdp::model_preset_names()) {
    const auto m = fsdp::model_preset(n);
    s += fsdp::cat("  ", n, ": ", fsdp::format_count(double(m.parameters())),
                           " parameters, ", m.layers, " blocks, d ", m.hidden, ", ", m.heads,
                           " heads, seq ", m.seq_len, ", vocab ", m.vocab, "\n");
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{"fsdp-plan: which FSDP strategy and mesh for a model on a cluster: predicted memory\n"
               "per rank, bytes per link and step time for every choice, ranked, with the reason."};
  app.add_option("--cluster", f.cluster, "cluster preset or cluster file (JSON, see --list)");
  app.add_option("--nodes", f.nodes, "nodes, overriding the cluster's; 0 = the cluster's");
  app.add_option("--ranks-per-node", f.ranks_per_node,
                 "ranks (GPUs, processes) per node, overriding the cluster's; 0 = the cluster's");
  app.add_option("--model", f.model, "model preset (see --list)");
  app.add_option("--layers", f.layers, "transformer blocks, overriding the preset's; 0 = preset's");
  app.add_option("--d-model", f.d_model, "hidden size, overriding the preset's; 0 = preset's");
  app.add_option("--heads", f.heads, "attention heads, overriding the preset's; 0 = preset's");
  app.add_option("--kv-heads", f.kv_heads, "key/value heads (GQA); -1 = preset's, 0 = heads");
  app.add_option("--ffn", f.ffn, "MLP width, overriding the preset's; 0 = preset's");
  app.add_option("--vocab", f.vocab, "vocabulary size, overriding the preset's; 0 = preset's");
  app.add_option("--seq-len", f.seq_len, "tokens per sequence, overriding the preset's; 0 = preset's");
  app.add_option("--params", f.params,
                 "total parameters (124M, 6.7B, 70e9, ...): blocks sized to reach it (a generic "
                 "transformer); 0 = from the shape");
  app.add_option("--micro-batch", f.micro_batch, "sequences per rank per micro-step");
  app.add_option("--grad-accum", f.grad_accum, "micro-steps per optimizer step");
  app.add_option("--precision", f.precision, "gathered parameter and compute dtype: fp32, bf16, fp16");
  app.add_option("--reduce-dtype", f.reduce, "gradient reduction dtype; default: --precision's");
  app.add_option("--optimizer", f.optimizer, "adamw (2 states per parameter) or sgd (momentum, 1)");
  app.add_option("--recompute", f.recompute,
                 "activation checkpointing: none, selective (attention) or full");
  app.add_option("--strategy", f.strategies,
                 "only these strategies (repeatable): full_shard, shard_grad_op, no_shard, "
                 "hybrid_shard, hybrid_shard_zero2; default all");
  app.add_option("--mesh", f.mesh, "only this mesh, e.g. -1,8 (one dim may be -1); default all");
  app.add_option("--grad-sync", f.grad_sync, "every, local or replicate_on_last (see fsdp-train)");
  app.add_option("--prefetch", f.prefetch, "on or off: all-gather the next unit while computing");
  app.add_flag("--clip", f.clip, "clip the gradient norm each step (one 8-byte all-reduce)");
  app.add_flag("--json", f.json, "print the plan as one JSON object");
  app.add_option("--chart", f.chart, "also draw step time and memory per choice into this PNG");
  app.add_flag("--list", f.list, "list the cluster presets (with each number's source) and models");
  app.add_flag("--published", f.published,
               "print the comparison with published runs (docs/planner-published.md)");
  fsdp_plan::add_calibrate_flags(app, f.calibrate, f.do_calibrate);
  // Every option shows its default in --help (docs/planner.md's table is tested against it).
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_expected_min() > 0) opt->capture_default_str();
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(2, std::string(e.what()) + " (see fsdp-plan --help)");
  }
  try {
    if (f.list) {
      std::cout << list_text();
      return 0;
    }
    if (f.published) {
      std::cout << fsdp::published_comparison();
      return 0;
    }
    if (f.do_calibrate) return fsdp_plan::calibrate(f.calibrate, argv[0]);
    fsdp::ClusterSpec cluster = fsdp::load_cluster(f.cluster);
    FSDP_CHECK(f.nodes >= 0, "--nodes ", f.nodes, " is negative; give the node count, or 0 ",
               "for the cluster's");
    FSDP_CHECK(f.ranks_per_node >= 0, "--ranks-per-node ", f.ranks_per_node, " is negative; give ",
               "the ranks of a node, or 0 for the cluster's");
    if (f.nodes) cluster.nodes = f.nodes;
    if (f.ranks_per_node) cluster.ranks_per_node = f.ranks_per_node;
    const fsdp::ModelSpec model = model_from(f);
    const fsdp::PlanOptions options = options_from(f);
    const fsdp::ClusterPlan plan = fsdp::plan_cluster(model, cluster, options);
    if (f.json) {
      std::cout << plan.to_json() << "\n";
    } else {
      std::cout << plan.to_text();
    }
    if (!f.chart.empty()) {
      fsdp_plot::run_gnuplot_script(plan.chart_script(f.chart), f.chart);
      if (!f.json) std::cout << "  chart: " << f.chart << "\n";
    }
  } catch (const std::exception& e) {
    return fail(2, fsdp::error_message(e));
  }
  return 0;
}
