// fsdp-plan --calibrate (see calibrate.h).
#include "calibrate.h"

#include <unistd.h>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/optim/adamw.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <vector>

#include "fsdp/error.h"
#include "fsdp/planner.h"
#include "fsdp/process.h"
#include "fsdp/runtime_options.h"

namespace fsdp_plan {

using fsdp::cat;

void add_calibrate_flags(CLI::App& app, CalibrateOptions& o, bool& enabled) {
  const char* g = "Calibration";
  app.add_flag("--calibrate", enabled,
               "measure this machine (collectives by message size, compute rate) and write its "
               "cluster file; fsdp-train --plan and --cluster FILE use it")
      ->group(g);
  app.add_option("--devices", o.devices, "with --calibrate: ranks that time the collectives")
      ->group(g);
  app.add_option("--sizes", o.sizes, "with --calibrate: buffer sizes in MiB, e.g. 1,4,16,64")
      ->group(g);
  app.add_option("--calibrate-steps", o.steps, "with --calibrate: fsdp-train steps timed")
      ->group(g);
  app.add_option("--output", o.output,
                 "with --calibrate: the cluster file to write; default $FSDP_CLUSTER_FILE or "
                 "~/.config/fsdp/this-machine.json")
      ->group(g);
}

namespace {

// Runs `command` (a shell command line of our own making), returns its stdout; throws on failure.
std::string run(const std::string& command) {
  FILE* p = ::popen(command.c_str(), "r");
  FSDP_CHECK(p, "cannot run '", command, "'");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  FSDP_CHECK(status == 0, "'", command, "' failed (status ", status, "): ", out.substr(0, 300));
  return out;
}

std::string sibling(const std::string& self, const std::string& name) {
  const auto slash = self.rfind('/');
  const std::string path = (slash == std::string::npos ? "." : self.substr(0, slash)) + "/" + name;
  FSDP_CHECK(::access(path.c_str(), X_OK) == 0, "--calibrate needs ", path,
             "; build it (cmake --build build --target ", name, ")");
  return path;
}

// calibrate's steps.

const char* const kThreads = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 ";

// The middle value (the upper one of an even count): every measurement below is a median, since
// one run on a busy machine can be off by 2x.
double median(std::vector<double> v) {
  TORCH_INTERNAL_ASSERT(!v.empty());
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// 1. Collectives: bench_collectives' rows "all_gather/ring  MiB  ms  busbw",
//    "reduce_scatter/ring ..." and "all_reduce ..." (Gloo's own, what the engine runs for fp32)
//    as bytes -> GB/s samples per collective: the ones the engine issues on Gloo. Three runs of
//    bench_collectives (each the median of 9): one run's size-to-size drift made single
//    calibrations' bands differ by 4x here.
using BusbwSamples = std::map<fsdp::Collective, std::map<int64_t, std::vector<double>>>;
BusbwSamples measure_busbw(const CalibrateOptions& o, const std::string& self) {
  const std::map<std::string, fsdp::Collective> rows = {
      {"all_gather/ring", fsdp::Collective::kAllGather},
      {"reduce_scatter/ring", fsdp::Collective::kReduceScatter},
      {"all_reduce", fsdp::Collective::kAllReduce}};
  BusbwSamples busbw;
  std::string bench;
  for (int pass = 0; pass < 3; ++pass) {
    bench = run(kThreads + sibling(self, "bench_collectives") + " --devices " +
                std::to_string(o.devices) + " --sizes " + o.sizes + " --iters 9");
    std::istringstream in(bench);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string name;
      double mib = 0, ms = 0, gbs = 0;
      if (!(f >> name >> mib >> ms >> gbs)) continue;
      if (const auto it = rows.find(name); it != rows.end()) {
        busbw[it->second][static_cast<int64_t>(mib * 1024 * 1024)].push_back(gbs);
      }
    }
  }
  for (const auto& [name, kind] : rows) {
    FSDP_CHECK(busbw.count(kind), "bench_collectives printed no '", name, "' rows: ",
               bench.substr(0, 300));
  }
  return busbw;
}

// 2. Compute: the median of the later step times of a one-thread-per-rank run of the small GPT
//    on `batch` x `seq` tokens in all (one process: the compute rate; `devices` ranks of
//    FULL_SHARD: the collectives inside a step, step 4).
double measure_step_seconds(const CalibrateOptions& o, const std::string& self, int64_t batch,
                            int64_t seq, int64_t devices = 1, int64_t steps = 0) {
  char tmpl[] = "/tmp/fsdp-calibrate-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  FSDP_CHECK(fd >= 0, "cannot create a temporary file in /tmp");
  ::close(fd);
  run(kThreads + sibling(self, "fsdp-train") + " --model small --threads 1 --quiet --steps " +
      std::to_string(steps > 0 ? steps : o.steps) + " --global-batch " +
      std::to_string(batch) + " --seq-len " + std::to_string(seq) +
      " --warmup-steps 1 --devices " + std::to_string(devices) +
      " --strategy full_shard --metrics " + tmpl + " > /dev/null");
  std::vector<double> times;
  std::ifstream metrics(tmpl);
  std::string line;
  while (std::getline(metrics, line)) {
    times.push_back(nlohmann::json::parse(line)["step_time_s"].get<double>());
  }
  ::unlink(tmpl);
  FSDP_CHECK(!times.empty(), "fsdp-train wrote no metrics");
  return median(std::vector<double>(times.begin() + long(times.size() / 2), times.end()));
}

// 3. The update: libtorch's AdamW with fsdp-train's default options over `n` fp32 parameters in
//    eight tensors (larger than a core's caches), after the gradient's averaging division and
//    clipping (norm, scale), one thread and fsdp's default heap policy, as a rank runs it after
//    its last reduction: memory_bandwidth = update_bytes_per_parameter x n / the median time.
//    (Under glibc's own policy the optimizer's temporaries are fresh mappings each step: 27 ns
//    per parameter here against 2.2-2.9 with the policy.)
double measure_update_bandwidth(int64_t n) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  fsdp::set_heap_policy(fsdp::RuntimeOptions{}.heap);
  std::vector<torch::Tensor> params;
  for (int i = 0; i < 8; ++i) {
    params.push_back(torch::randn({n / 8}).requires_grad_());
    params.back().mutable_grad() = torch::randn({n / 8});
  }
  torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(1e-4).betas({0.9, 0.95})
                                        .eps(1e-8).weight_decay(0.01));
  std::vector<double> times;
  for (int step = 0; step < 9; ++step) {
    const auto start = std::chrono::steady_clock::now();
    {
      torch::NoGradGuard no_grad;
      double sumsq = 0;
      for (auto& p : params) {
        p.mutable_grad().div_(2.0);
        const double norm = p.grad().norm().item<double>();
        sumsq += norm * norm;
      }
      for (auto& p : params) p.mutable_grad().mul_(1.0 / (std::sqrt(sumsq) + 1e-6));
    }
    adamw.step();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  at::set_num_threads(threads);
  return fsdp::update_bytes_per_parameter(2, true, true) * double(n) /
         median(std::vector<double>(times.begin() + 3, times.end()));
}

// 4. The link of `devices` ranks. Time per size t = (n-1)/n S / busbw (all-reduce: twice), from
//    the median of each size's samples. The latency per ring step is the intercept of a
//    least-squares line through the all-gather's times (t = (n-1) a + (n-1)/n S / B), at most
//    half the smallest size's time; each collective's band then keeps the bandwidth that the
//    rest of its time implies, so small messages pay the latency and large ones the measured
//    rate. (Fitted on the two smallest sizes alone, the latency came out 0 or 1 ms run to run.)
void fit_link(const BusbwSamples& busbw, int64_t devices, fsdp::LinkSpec& link) {
  const double n = double(devices);
  // bytes -> seconds for one collective; f = (n-1)/n, or 2 (n-1)/n for an all-reduce.
  auto points = [&](fsdp::Collective kind, double f) {
    std::vector<std::pair<double, double>> p;
    for (const auto& [bytes, samples] : busbw.at(kind)) {
      p.push_back({double(bytes), f * double(bytes) / (median(samples) * 1e9)});
    }
    return p;
  };
  const double f = (n - 1) / n;
  const auto ag = points(fsdp::Collective::kAllGather, f);
  double latency = 0;
  if (ag.size() >= 2) {
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (const auto& [x, y] : ag) {
      sx += x;
      sy += y;
      sxx += x * x;
      sxy += x * y;
    }
    const double m = double(ag.size()), slope = (m * sxy - sx * sy) / (m * sxx - sx * sx);
    const double intercept = (sy - slope * sx) / m;
    latency = std::clamp(intercept / (n - 1), 0.0, 0.5 * ag.front().second / (n - 1));
  }
  link.latency_s = latency;
  auto bands = [&](const std::vector<std::pair<double, double>>& p, double steps) {
    std::vector<fsdp::BandwidthBand> out;
    for (const auto& [bytes, t] : p) {
      const double rest = std::max(t - steps * (n - 1) * latency, 0.1 * t);
      out.push_back({static_cast<int64_t>(bytes), steps * f * bytes / rest});
    }
    return out;
  };
  link.bands = bands(ag, 1);
  link.reduce_scatter_bands = bands(points(fsdp::Collective::kReduceScatter, f), 1);
  link.all_reduce_bands = bands(points(fsdp::Collective::kAllReduce, 2 * f), 2);
}

// 5. Collectives inside a training step: `devices` ranks (the density the links were measured
//    at) train the small GPT with FULL_SHARD, one sequence each, so the collectives are about
//    half the step. k = (measured step - predicted compute and update) / predicted collectives'
//    time: how many times their benchmarked time the collectives take in a step (NOTE [planner
//    cost model]).
double measure_contention(const CalibrateOptions& o, const std::string& self,
                          fsdp::ClusterSpec c, std::string& source) {
  const int64_t seq = 128;
  // Short steps with a difference taken: more of them than for the compute rate, and three runs
  // (their median step): one run caught while the machine is busy moved k by 2x.
  std::vector<double> steps;
  for (int run = 0; run < 3; ++run) {
    steps.push_back(measure_step_seconds(o, self, o.devices, seq, o.devices, 3 * o.steps));
  }
  const double step = median(steps);
  fsdp::ModelSpec small = fsdp::model_preset("small");
  small.seq_len = seq;
  c.comm_contention = 1;
  fsdp::PlanOptions po;
  po.clip = true;  // fsdp-train clips by default
  const fsdp::PlanCandidate p =
      fsdp::evaluate_candidate(small, c, po, fsdp::ShardingStrategy::kFullShard, 1, o.devices);
  const double rest = p.time.compute + p.time.update;
  const double k = (step - rest) / p.time.communication;
  FSDP_CHECK(p.time.communication > 0 && k > 0 && std::isfinite(k), "--calibrate: a ",
             o.devices, "-rank FULL_SHARD step took ", step, " s, no more than its predicted ",
             "compute and update (", rest, " s): the machine was busy while calibrating; rerun "
             "--calibrate on an idle machine");
  source = cat("measured: fsdp-train --model small --devices ", o.devices, " --strategy full_shard, ",
               o.devices, " x ", seq, " tokens, three runs' median steps ", steps[0], ", ",
               steps[1], ", ", steps[2], " s; their median = predicted compute ",
               p.time.compute, " s + update ", p.time.update, " s + k x the collectives' ",
               p.time.communication, " s");
  return k;
}

}  // namespace

int calibrate(const CalibrateOptions& o, const std::string& self) {
  FSDP_CHECK(o.devices >= 2, "--devices ", o.devices, " is too few to time collectives; use 2 or more");
  FSDP_CHECK(o.steps >= 2, "--calibrate-steps ", o.steps, " is too few; use 2 or more");
  const std::string output = o.output.empty() ? fsdp::calibrated_cluster_path() : o.output;
  const auto busbw = measure_busbw(o, self);
  const int64_t update_params = int64_t(32) << 20;
  const double bandwidth = measure_update_bandwidth(update_params);
  const int64_t batch = 8, seq = 128;
  // The middle of three runs, as for k below: one fast run set the compute rate 12% above the
  // others' and every prediction of the planner bench low.
  std::vector<double> runs;
  for (int run = 0; run < 3; ++run) runs.push_back(measure_step_seconds(o, self, batch, seq));
  const double step = median(runs);
  fsdp::ModelSpec small = fsdp::model_preset("small");
  small.seq_len = seq;
  // The one-process step is its forward and backward plus its update (clipped; one rank does not
  // average): the compute rate is the FLOPs over the rest.
  const double update = double(small.parameters()) *
                        fsdp::update_bytes_per_parameter(2, true, false) / bandwidth;
  FSDP_CHECK(step > 2 * update, "--calibrate: a one-process step of the small GPT took ", step,
             " s, little more than its optimizer update (", update, " s): the machine was busy "
             "while calibrating; rerun --calibrate on an idle machine");

  fsdp::ClusterSpec c = fsdp::cluster_preset("this-machine");
  c.description = "this machine, measured by fsdp-plan --calibrate";
  c.cores = std::max<int64_t>(1, ::sysconf(_SC_NPROCESSORS_ONLN));
  c.memory_bytes = int64_t(::sysconf(_SC_PHYS_PAGES)) * int64_t(::sysconf(_SC_PAGESIZE));
  c.peak_flops = small.flops_per_token(fsdp::Recompute::kNone) * double(batch * seq) / (step - update);
  c.flops_fraction = 1.0;
  c.memory_bandwidth = bandwidth;
  fit_link(busbw, o.devices, c.intra);
  c.inter = c.intra;
  c.ranks_per_node = o.devices;
  c.comm_ranks_per_node = o.devices;
  std::string contention_source;
  c.comm_contention = measure_contention(o, self, c, contention_source);
  c.sources = {
      {"peak_tflops", cat("measured: fsdp-train --model small, 1 process, 1 thread, ", batch, " x ",
                          seq, " tokens, three runs' median steps ", runs[0], ", ", runs[1], ", ",
                          runs[2], " s; their median less its update ", update,
                          " s (achieved rate, so fraction 1)")},
      {"memory_bandwidth_gbs",
       cat("measured: libtorch AdamW (fsdp-train's options) after averaging and clipping, ",
           update_params, " fp32 parameters, 1 thread: ",
           fsdp::update_bytes_per_parameter(2, true, true) / bandwidth * 1e9,
           " ns per parameter, taken as ", fsdp::update_bytes_per_parameter(2, true, true),
           " bytes each")},
      {"intra", cat("measured: bench_collectives --devices ", o.devices, " --sizes ", o.sizes,
                    " (three runs, median), ring all-gather, ring reduce-scatter and Gloo's "
                    "all-reduce, each its own bands; latency per ring step the intercept of a line "
                    "through the all-gather's times, bands the bandwidth of the rest of each time")},
      {"memory_gib", "sysconf: physical memory, shared by the ranks"},
      {"cores", "sysconf: online CPUs"},
      {"comm_contention", contention_source},
      {"reserve_gib", "the this-machine preset's assumption"}};
  c.validate();
  std::error_code ec;
  const auto parent = std::filesystem::path(output).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  {
    std::ofstream out(output);
    out << fsdp::cluster_to_json(c) << "\n";
    FSDP_CHECK(out, "cannot write the cluster file ", output,
               ec ? " (" + ec.message() + ")" : std::string());
  }
  std::cout << fsdp::cluster_to_json(c) << "\nfsdp-plan --calibrate: wrote " << output << "\n";
  return 0;
}

}  // namespace fsdp_plan
