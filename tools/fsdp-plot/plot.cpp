// Loss-curve plots with gnuplot (see plot.h).
#include "plot.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fsdp/error.h"

namespace fsdp_plot {

using fsdp::cat;

LossCurve read_metrics(const std::string& path) {
  std::ifstream in(path);
  FSDP_CHECK(in, "cannot read metrics file '", path, "': ", std::strerror(errno));
  LossCurve c;
  const size_t slash = path.rfind('/');
  c.label = slash == std::string::npos ? path : path.substr(slash + 1);
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw fsdp::Error(cat(path, " line ", n, " is not JSON (", e.what(),
                            "); give files written by fsdp-train --metrics"));
    }
    // fsdp-train --val-data lines ({"step", "val_loss"}) are not training steps.
    if (j.is_object() && j.contains("val_loss") && !j.contains("loss")) continue;
    FSDP_CHECK(j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
                   j.contains("loss") && j["loss"].is_number(),
               path, " line ", n,
               " has no integer \"step\" and numeric \"loss\"; give files "
               "written by fsdp-train --metrics");
    c.steps.push_back(j["step"].get<int64_t>());
    c.losses.push_back(j["loss"].get<double>());
  }
  FSDP_CHECK(!c.steps.empty(), "metrics file '", path,
             "' has no steps; did the run finish a step?");
  return c;
}

std::string find_gnuplot() {
  const char* path = std::getenv("PATH");
  const std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = dirs.substr(start, end - start);
    const std::string candidate = (dir.empty() ? "." : dir) + "/gnuplot";
    struct stat st {};
    if (::stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
    start = end + 1;
  }
  return "";
}

std::string gnuplot_quoted(const std::string& s) {
  std::string out = "'";
  for (char ch : s) {
    out += ch == '\'' ? std::string("''")
           : ch == '\n' || ch == '\r' ? std::string(" ")
                                      : std::string(1, ch);
  }
  return out + "'";
}

std::string png_terminal(int width, int height, const std::string& png) {
  const std::string size = cat(" size ", width, ",", height, " noenhanced");
  // gnuplot-nox has pngcairo (anti-aliased) and the libgd png terminal; prefer the former.
  return cat("if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) { set terminal pngcairo", size,
             " } else { set terminal png", size, " }\nset output ", gnuplot_quoted(png), "\n");
}

namespace {

std::string script_for(const std::vector<LossCurve>& curves, const std::string& png,
                       const std::string& title) {
  std::ostringstream os;
  os << png_terminal(1000, 600, png) << "set title " << gnuplot_quoted(title) << "\n"
     << "set xlabel 'optimizer step'\nset ylabel 'loss (mean over the global batch)'\n"
     << "set grid\nset key top right\n";
  char buf[64];
  for (size_t i = 0; i < curves.size(); ++i) {
    os << "$run" << i << " << EOD\n";
    for (size_t k = 0; k < curves[i].steps.size(); ++k) {
      std::snprintf(buf, sizeof(buf), "%lld %.9g\n", static_cast<long long>(curves[i].steps[k]),
                    curves[i].losses[k]);
      os << buf;
    }
    os << "EOD\n";
  }
  os << "plot ";
  for (size_t i = 0; i < curves.size(); ++i) {
    os << (i ? ", " : "") << "$run" << i << " using 1:2 with lines linewidth 2 title "
       << gnuplot_quoted(curves[i].label);
  }
  os << "\nunset output\n";
  return os.str();
}

// Runs gnuplot on `script_path`; returns its exit status and collects its output.
int run_gnuplot(const std::string& gnuplot, const std::string& script_path, std::string* output) {
  int fds[2];
  FSDP_CHECK(::pipe(fds) == 0, "cannot run gnuplot: pipe failed: ", std::strerror(errno));
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::close(fds[1]);
    ::execl(gnuplot.c_str(), "gnuplot", script_path.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    throw fsdp::Error(cat("cannot run gnuplot: fork failed: ", std::strerror(errno)));
  }
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0) output->append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

// The most telling line of gnuplot's output: the first that mentions an error.
std::string first_error_line(const std::string& output) {
  std::istringstream in(output);
  std::string line, first;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t^") == std::string::npos) continue;
    if (first.empty()) first = line;
    if (line.find("rror") != std::string::npos) return line;
  }
  return first;
}

}  // namespace

void plot_losses(const std::vector<LossCurve>& curves, const std::string& png,
                 const std::string& title) {
  FSDP_CHECK(!curves.empty(), "nothing to plot: no loss curves given");
  run_gnuplot_script(script_for(curves, png, title), png);
}

void run_gnuplot_script(const std::string& script, const std::string& png) {
  const std::string gnuplot = find_gnuplot();
  FSDP_CHECK(!gnuplot.empty(), "gnuplot is not in PATH, so ", png,
             " cannot be drawn; install it "
             "(apt-get install gnuplot-nox, or make setup)");
  char tmpl[] = "/tmp/fsdp-plot-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  FSDP_CHECK(fd >= 0, "cannot create a temporary gnuplot script in /tmp: ", std::strerror(errno));
  const std::string script_path = tmpl;
  const bool written =
      ::write(fd, script.data(), script.size()) == static_cast<ssize_t>(script.size());
  ::close(fd);
  std::string output;
  int status = 0;
  if (written) status = run_gnuplot(gnuplot, script_path, &output);
  ::unlink(script_path.c_str());
  FSDP_CHECK(written, "cannot write the temporary gnuplot script ", script_path);
  FSDP_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "gnuplot failed to draw ", png, ": ",
             first_error_line(output));
  struct stat st {};
  FSDP_CHECK(::stat(png.c_str(), &st) == 0 && st.st_size > 0, "gnuplot exited without writing ",
             png, (output.empty() ? "" : ": "), first_error_line(output));
}

}  // namespace fsdp_plot
