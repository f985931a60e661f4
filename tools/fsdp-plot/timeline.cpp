// One training step per rank as a Gantt chart (see timeline.h).
#include "timeline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>

#include "fsdp/error.h"
#include "plot.h"

namespace fsdp_plot {

using fsdp::cat;

namespace {

std::string base_name(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// Milliseconds with three significant digits or more: "12.3", "0.512", "1234".
std::string ms(double us) {
  const double v = us / 1e3;
  char buf[32];
  std::snprintf(buf, sizeof(buf),
                v >= 100  ? "%.0f"
                : v >= 10 ? "%.1f"
                : v >= 1  ? "%.2f"
                          : "%.3f",
                v);
  return buf;
}

std::string number(double v, const char* format) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

std::string percent(double f) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.1f%%", 100 * f);
  return buf;
}

std::string bytes(double b) {
  char buf[32];
  if (b >= 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", b / (1024.0 * 1024 * 1024));
  } else {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", b / (1024.0 * 1024));
  }
  return buf;
}

}  // namespace

double RankStep::exposed_fraction() const {
  return duration_us() > 0 ? exposed_us / duration_us() : 0;
}

namespace {

// The categories a box is colored by, in legend order.
struct Category {
  const char* key;
  const char* color;
  const char* legend;
};
constexpr Category kCategories[] = {
    {"compute", "#4477aa", "compute"},
    {"collective", "#228833", "collective (comm thread)"},
    {"wait", "#ee6677", "wait = exposed communication"},
    {"optimizer", "#ccbb44", "optimizer (update)"},
    {"data/loss/eval", "#66ccee", "data, loss, eval"},
    {"checkpoint", "#aa3377", "checkpoint"},
    {"step", "#dddddd", "step"},
    {"rest", "#bbbbbb", "rest of the step (data, loss, gaps)"},  // the measured bar's
    {"other", "#999999", "other"},
};

size_t category_of(const std::string& cat) {
  const std::string key = cat == "data" || cat == "loss" || cat == "eval" ? "data/loss/eval" : cat;
  const size_t n = sizeof(kCategories) / sizeof(kCategories[0]);
  for (size_t i = 0; i < n; ++i) {
    if (key == kCategories[i].key) return i;
  }
  return n - 1;  // other
}

// A rank's step, measured on its training thread (see RankStep).
RankStep measure(const Trace& trace, const TraceSpan& step) {
  RankStep r;
  r.rank = step.pid;
  r.start_us = step.start_us;
  r.end_us = step.end_us;
  struct Clipped {
    double start, end;
    const std::string* cat;
  };
  std::vector<Clipped> spans;
  for (const auto& s : trace.spans) {
    if (s.pid != step.pid || s.tid != step.tid || s.cat == "step") continue;
    const double a = std::max(s.start_us, step.start_us), b = std::min(s.end_us, step.end_us);
    if (b > a) spans.push_back({a, b, &s.cat});
  }
  std::sort(spans.begin(), spans.end(), [](const Clipped& x, const Clipped& y) {
    return x.start != y.start ? x.start < y.start : x.end > y.end;
  });
  struct Open {
    double end, self;
    const std::string* cat;
    bool in_wait;
  };
  std::vector<Open> open;
  auto close = [&] {
    const Open& o = open.back();
    const double self = std::max(0.0, o.self);
    if (!o.in_wait && *o.cat == "compute") r.compute_us += self;
    if (!o.in_wait && *o.cat == "optimizer") r.update_us += self;
    open.pop_back();
  };
  for (const auto& s : spans) {
    while (!open.empty() && open.back().end <= s.start + kTraceEpsUs) close();
    const bool parent_wait = !open.empty() && open.back().in_wait;
    if (!open.empty()) open.back().self -= s.end - s.start;
    if (*s.cat == "wait" && !parent_wait) r.exposed_us += s.end - s.start;
    open.push_back({s.end, s.end - s.start, s.cat, parent_wait || *s.cat == "wait"});
  }
  while (!open.empty()) close();
  for (const auto& [rank, sample] : trace.rss) {
    if (rank == step.pid && sample.first >= step.start_us - kTraceEpsUs &&
        sample.first <= step.end_us + kTraceEpsUs) {
      r.peak_rss_bytes = std::max(r.peak_rss_bytes, sample.second);
    }
  }
  return r;
}

struct Row {
  std::string label;
  int64_t pid, tid;
};

// The rows of one rank: its training thread, its comm threads by name, then any other thread
// with a span in [w0, w1]; comm threads are shown even when idle.
std::vector<Row> rows_of(const Trace& trace, const TraceSpan& step, double w0, double w1,
                         bool with_exposed, double exposed) {
  const int64_t pid = step.pid;
  std::map<int64_t, std::string> names;
  for (const auto& [key, name] : trace.thread_names) {
    if (key.first == pid) names[key.second] = name;
  }
  std::set<int64_t> tids;
  for (const auto& [tid, name] : names) {
    if (name.rfind("comm", 0) == 0) tids.insert(tid);
  }
  for (const auto& s : trace.spans) {
    if (s.pid == pid && s.end_us > w0 && s.start_us < w1) tids.insert(s.tid);
  }
  tids.erase(step.tid);
  const auto name_of = [&](int64_t tid) {
    const auto it = names.find(tid);
    return it != names.end() ? it->second : cat("thread ", tid);
  };
  std::vector<int64_t> order(tids.begin(), tids.end());
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const bool ca = name_of(a).rfind("comm", 0) == 0, cb = name_of(b).rfind("comm", 0) == 0;
    return ca != cb ? ca : name_of(a) < name_of(b);
  });
  const auto it = names.find(step.tid);
  std::vector<Row> rows{{cat("rank ", pid, " ", it != names.end() ? it->second : "training",
                             with_exposed ? cat(" (", percent(exposed), " exposed)") : ""),
                         pid, step.tid}};
  for (int64_t tid : order) rows.push_back({cat("rank ", pid, " ", name_of(tid)), pid, tid});
  return rows;
}

// A gnuplot data line cannot hold a double quote inside its quoted text.
std::string label_text(std::string s) {
  std::replace(s.begin(), s.end(), '"', '\'');
  return "\"" + s + "\"";
}

struct Chart {
  std::ostringstream labels;
  std::vector<std::pair<int, std::string>> box_lines;  // (depth, line): outer ones drawn first
  std::set<size_t> categories;
  double x_max = 1e-9;    // ms
  double plot_px = 1000;  // the plot area's width, for which labels fit
};

// A box with `label` where it fits, else `short_label`.
void add_box(Chart& c, int depth, double x0, double x1, double y, size_t category,
             const std::string& label, const std::string& short_label) {
  const double h = std::max(0.2, 0.8 * std::pow(0.72, depth));
  char buf[160];
  std::snprintf(buf, sizeof(buf), "%.6f %.6f %.4f %.4f 0x%s\n", x0, x1, y - h / 2, y + h / 2,
                kCategories[category].color + 1);
  c.box_lines.push_back({depth, buf});
  c.categories.insert(category);
  // About 6 pixels a character at font size 8.
  const double px = (x1 - x0) / c.x_max * c.plot_px;
  const std::string text = px >= 6.0 * double(label.size() + 1)         ? label
                           : px >= 6.0 * double(short_label.size() + 1) ? short_label
                                                                        : "";
  if (!text.empty()) {
    std::snprintf(buf, sizeof(buf), "%.6f %.4f ", (x0 + x1) / 2, y);
    c.labels << buf << label_text(text) << "\n";
  }
}

}  // namespace

TimelineSummary plot_timeline(const Trace& trace, const TimelineOptions& options,
                              const std::string& png) {
  TimelineSummary summary;
  run_gnuplot_script(timeline_script(trace, options, png, &summary), png);
  return summary;
}

std::string timeline_script(const Trace& trace, const TimelineOptions& options,
                            const std::string& png, TimelineSummary* summary_out) {
  const std::vector<int64_t> steps = trace.steps();
  const int64_t step = options.step ? *options.step : steps[steps.size() / 2];
  FSDP_CHECK(std::binary_search(steps.begin(), steps.end(), step), "trace file '", trace.path,
             "' has no step ", step, "; its traced steps: ", step_ranges(steps));
  std::map<int64_t, const TraceSpan*> step_of;  // rank -> its span of `step` (the first)
  for (const auto& s : trace.spans) {
    if (s.cat == "step" && s.step == step) step_of.emplace(s.pid, &s);
  }
  double w0 = 1e300, w1 = -1e300;
  TimelineSummary summary;
  summary.step = step;
  std::set<int64_t> missing;
  for (const auto& s : trace.spans) {
    if (!step_of.count(s.pid)) missing.insert(s.pid);
  }
  summary.missing_ranks.assign(missing.begin(), missing.end());
  for (const auto& [rank, s] : step_of) {
    w0 = std::min(w0, s->start_us);
    w1 = std::max(w1, s->end_us);
    summary.ranks.push_back(measure(trace, *s));
  }
  const bool many = summary.ranks.size() > 32;  // exposed % in the row labels, not the title
  std::vector<Row> rows;
  std::vector<double> rank_separators;  // after this many rows
  for (size_t i = 0; i < summary.ranks.size(); ++i) {
    const auto& r = summary.ranks[i];
    for (auto& row : rows_of(trace, *step_of.at(r.rank), w0, w1, many, r.exposed_fraction())) {
      rows.push_back(std::move(row));
    }
    if (i + 1 < summary.ranks.size()) rank_separators.push_back(double(rows.size()));
  }
  summary.rows = rows.size();

  const RankStep& first = summary.ranks.front();  // rank 0 in a whole trace
  const double plan_ms =
      options.plan
          ? 1e3 * (options.plan->compute_s + options.plan->exposed_s + options.plan->update_s)
          : 0;
  const double measured_ms = (first.compute_us + first.exposed_us + first.update_us) / 1e3;
  Chart c;
  c.x_max = std::max({(w1 - w0) / 1e3, plan_ms, 1e-3}) * 1.01;  // a step of 0 us: still a range
  const int width = 1400;
  c.plot_px = width - 330;
  const double base = options.plan ? 2.5 : 0;  // the plan's two rows below the threads
  const auto y_of = [&](size_t row) { return base + double(rows.size() - 1 - row); };

  for (size_t i = 0; i < rows.size(); ++i) {
    std::vector<const TraceSpan*> spans;
    for (const auto& s : trace.spans) {
      if (s.pid == rows[i].pid && s.tid == rows[i].tid && s.end_us > w0 && s.start_us < w1) {
        spans.push_back(&s);
      }
    }
    std::sort(spans.begin(), spans.end(), [](const TraceSpan* a, const TraceSpan* b) {
      return a->start_us != b->start_us ? a->start_us < b->start_us : a->end_us > b->end_us;
    });
    for (size_t k = 0; k < spans.size(); ++k) {
      const TraceSpan& s = *spans[k];
      // A leaf (nothing drawn inside it) gets its name where the name fits, else its last word
      // ("block3" of "forward block3"): the color says what the box does.
      const bool leaf = k + 1 == spans.size() || spans[k + 1]->start_us >= s.end_us - kTraceEpsUs;
      const std::string label = leaf && s.cat != "step" ? s.name : "";
      add_box(c, s.depth, (std::max(s.start_us, w0) - w0) / 1e3,
              (std::min(s.end_us, w1) - w0) / 1e3, y_of(i), category_of(s.cat), label,
              label.substr(label.rfind(' ') + 1));
    }
  }
  std::vector<std::pair<std::string, double>> ytics;
  for (size_t i = 0; i < rows.size(); ++i) ytics.push_back({rows[i].label, y_of(i)});
  if (options.plan) {
    // Consecutive bars in ms: compute, exposed communication, update, and (measured) the rest.
    const auto bars = [&](double y, std::vector<double> v) {
      const size_t cats[] = {category_of("compute"), category_of("wait"), category_of("optimizer"),
                             category_of("rest")};
      const char* names[] = {"compute ", "exposed ", "update ", "rest "};
      double x = 0;
      for (size_t k = 0; k < v.size(); ++k) {
        const std::string value = ms(v[k] * 1e3);
        if (v[k] > 0) add_box(c, 1, x, x + v[k], y, cats[k], cat(names[k], value, " ms"), value);
        x += v[k];
      }
    };
    const auto& p = *options.plan;
    bars(1, {p.compute_s * 1e3, p.exposed_s * 1e3, p.update_s * 1e3});
    bars(0, {first.compute_us / 1e3, first.exposed_us / 1e3, first.update_us / 1e3,
             std::max(0.0, first.duration_us() / 1e3 - measured_ms)});
    ytics.push_back({cat("plan predicted: ", ms(plan_ms * 1e3), " ms"), 1});
    ytics.push_back({cat("rank ", first.rank, " measured: ", ms(first.duration_us()), " ms"), 0});
  }

  // The title: the step, the run, each rank's exposed communication.
  std::vector<std::string> title;
  title.push_back(!options.title.empty() ? options.title
                                         : cat("step ", step, " of ", base_name(trace.path),
                                               " (traced steps ", step_ranges(steps), ")",
                                               trace.complete ? "" : ", an incomplete trace"));
  const RankStep* slowest = &summary.ranks.front();
  for (const auto& r : summary.ranks) {
    if (r.duration_us() > slowest->duration_us()) slowest = &r;
  }
  std::string run = trace.strategy.empty() ? "strategy not recorded" : trace.strategy;
  if (trace.mesh.size() == 2) {
    run += cat(", mesh ", trace.mesh[0], " x ", trace.mesh[1], " (replicate x shard)");
  }
  run += cat(", ", summary.ranks.size(), summary.ranks.size() == 1 ? " rank" : " ranks");
  if (trace.world_size > int64_t(summary.ranks.size())) run += cat(" of ", trace.world_size);
  title.push_back(
      cat(run, "; slowest rank ", slowest->rank, ": ", ms(slowest->duration_us()), " ms"));
  const std::string exposed = "exposed communication (waits / step): ";
  if (!many) {
    std::string line = exposed;
    for (size_t i = 0; i < summary.ranks.size(); ++i) {
      if (i > 0 && i % 8 == 0) {
        title.push_back(line + ",");
        line.clear();
      }
      line += cat(i % 8 ? ", " : "", "rank ", summary.ranks[i].rank, " ",
                  percent(summary.ranks[i].exposed_fraction()));
    }
    title.push_back(line);
  } else {
    const auto [lo, hi] = std::minmax_element(summary.ranks.begin(), summary.ranks.end(),
                                              [](const RankStep& a, const RankStep& b) {
                                                return a.exposed_fraction() < b.exposed_fraction();
                                              });
    double sum = 0;
    for (const auto& r : summary.ranks) sum += r.exposed_fraction();
    title.push_back(cat(exposed, "mean ", percent(sum / double(summary.ranks.size())), ", least ",
                        percent(lo->exposed_fraction()), " (rank ", lo->rank, "), most ",
                        percent(hi->exposed_fraction()), " (rank ", hi->rank, ")"));
  }

  const double n_rows = double(rows.size()) + base;
  const int height = std::max(480, static_cast<int>(180 + 16 * title.size() + 30 * n_rows));
  std::ostringstream os;
  os << png_terminal(width, height, png) << "set title ";
  for (size_t i = 0; i < title.size(); ++i)
    os << (i ? ".\"\\n\"." : "") << gnuplot_quoted(title[i]);
  os << "\nset xlabel "
     << gnuplot_quoted(cat("ms from the step's earliest start over ranks",
                           trace.clock_uncertainty_us > 0
                               ? cat(" (ranks' clocks aligned to rank 0's within +/-",
                                     number(trace.clock_uncertainty_us, "%.0f"), " us)")
                               : ""))
     << "\nset xrange [0:" << c.x_max << "]\nset yrange [-0.6:" << n_rows - 0.4 << "]\n"
     << "set grid x\nset ytics nomirror scale 0 (";
  for (size_t i = 0; i < ytics.size(); ++i) {
    std::string label;  // a tic label is a format: '%' must be "%%"
    for (char ch : ytics[i].first) label += ch == '%' ? std::string("%%") : std::string(1, ch);
    os << (i ? ", " : "") << gnuplot_quoted(label) << " " << ytics[i].second;
  }
  os << ")\nset key below horizontal\nset style fill solid 1.0 border lc rgb '#505050'\n";
  int arrow = 0;
  for (double after : rank_separators) {
    os << "set arrow " << ++arrow << " from graph 0, first " << y_of(size_t(after)) + 0.5
       << " to graph 1, first " << y_of(size_t(after)) + 0.5 << " nohead lc rgb '#888888' dt 3\n";
  }
  if (options.plan) {
    os << "set arrow " << ++arrow << " from graph 0, first " << base - 0.75 << " to graph 1, first "
       << base - 0.75 << " nohead lc rgb '#000000'\n";
  }
  std::stable_sort(c.box_lines.begin(), c.box_lines.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  os << "$boxes << EOD\n";
  for (const auto& [depth, line] : c.box_lines) os << line;
  os << "EOD\n$labels << EOD\n" << c.labels.str() << "EOD\n";
  os << "plot $boxes using (($1+$2)/2):(($3+$4)/2):1:2:3:4:5 with boxxyerror fc rgb variable "
        "notitle";
  if (!c.labels.str().empty()) os << ", $labels using 1:2:3 with labels font ',8' notitle";
  for (size_t k : c.categories) {
    os << ", keyentry with boxes fc rgb '" << kCategories[k].color << "' title "
       << gnuplot_quoted(kCategories[k].legend);
  }
  os << "\nunset output\n";
  *summary_out = std::move(summary);
  return os.str();
}

std::string describe(const TimelineSummary& summary, const std::optional<PlanTimes>& plan) {
  std::ostringstream os;
  for (const auto& r : summary.ranks) {
    const double rest = r.duration_us() - r.compute_us - r.exposed_us - r.update_us;
    os << "  rank " << r.rank << ": step " << ms(r.duration_us()) << " ms = compute "
       << ms(r.compute_us) << " + exposed communication " << ms(r.exposed_us) << " ("
       << percent(r.exposed_fraction()) << ") + update " << ms(r.update_us) << " + rest "
       << ms(std::max(0.0, rest)) << " ms";
    if (r.peak_rss_bytes > 0) os << "; peak RSS " << bytes(r.peak_rss_bytes);
    os << "\n";
  }
  if (!summary.missing_ranks.empty()) {
    os << "  not drawn: rank";
    if (summary.missing_ranks.size() > 1) os << "s";
    for (size_t i = 0; i < summary.missing_ranks.size(); ++i) {
      os << (i ? ", " : " ") << summary.missing_ranks[i];
    }
    os << ": no step " << summary.step << " in the trace\n";
  }
  if (plan) {
    os << "  plan " << plan->label << ": compute " << ms(plan->compute_s * 1e6)
       << " + exposed communication " << ms(plan->exposed_s * 1e6) << " + update "
       << ms(plan->update_s * 1e6) << " ms (predicted)\n";
  }
  return os.str();
}

}  // namespace fsdp_plot
