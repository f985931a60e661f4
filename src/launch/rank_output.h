// The supervisor's view of its ranks' stderr: lines every rank writes are shown once, naming the
// ranks (NOTE [rank output]). Internal to the launcher (src/launch/supervisor.cpp); self-contained, so
// that it can be read and tested on its own.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/error.h"
#include "base/unique_fd.h"

namespace fsdp::detail {

// Writes `text` to stderr with one write(2) where it fits, so lines of several processes sharing
// the terminal never interleave.
void write_text(const std::string& text);
void write_line(const std::string& line);

// NOTE [rank output]: when a job fails, every rank usually prints the same error line, and a
// user of 8 ranks would read it 8 times. The supervisor therefore carries each rank's stderr (a
// pipe, or a pseudo-terminal when its own stderr is a terminal, so that a rank still sees one
// and draws its progress bar) and forwards it line by line: a complete line waits up to `hold`
// (LaunchOptions::output_hold, 1 s by default) for the same line from the other ranks of this
// node, and identical lines leave as one that names the ranks ("... [ranks 0-3]"). A line that names its own rank ("rank 2: lost rank 3") matches
// the same line of another rank naming that one, and leaves as "ranks 1-2: lost rank 3". Lines
// that differ, and lines of one rank, are forwarded unchanged, each rank's in its own order; text
// that is not a complete line (a progress bar redrawn with "\r", a prompt) leaves at once.
// Standard output is not touched.
class RankOutput {
 public:
  RankOutput(const std::vector<int64_t>& ranks, std::chrono::milliseconds hold)
      : hold_(hold), tty_(::isatty(2) == 1) {
    streams_.resize(ranks.size());
    for (size_t i = 0; i < ranks.size(); ++i) {
      Stream& s = streams_[i];
      s.rank = ranks[i];
      if (!(tty_ && open_pty(s)) && !open_pipe(s)) {
        // streams_ is destroyed on the way out, closing the earlier ranks' descriptors.
        throw Error(detail::cat("could not create the output channel of rank ", s.rank, ": ",
                                std::strerror(errno)));
      }
    }
  }
  RankOutput(const RankOutput&) = delete;
  RankOutput& operator=(const RankOutput&) = delete;

  // The descriptor that becomes stderr of the i-th rank (dup2 it in the child, before exec).
  int child_fd(size_t i) const { return streams_[i].child_fd.get(); }
  // After the i-th rank was forked: the supervisor's copy of its end is closed, so that the
  // rank's exit ends the stream.
  void started(size_t i) { streams_[i].child_fd.reset(); }

  // Waits up to `timeout` for output, forwards what is due.
  void pump(std::chrono::milliseconds timeout) {
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (!streams_[i].read_fd.valid()) continue;
      fds.push_back({streams_[i].read_fd.get(), POLLIN, 0});
      which.push_back(i);
    }
    if (fds.empty()) {
      std::this_thread::sleep_for(timeout);
    } else if (::poll(fds.data(), fds.size(), static_cast<int>(timeout.count())) > 0) {
      for (size_t k = 0; k < fds.size(); ++k) {
        if (fds[k].revents != 0) read_from(which[k]);
      }
    }
    for (size_t i = 0; i < streams_.size(); ++i) {
      if (!streams_[i].partial.empty()) take_lines(i);  // text that waited long enough
    }
    release(false);
  }

  // After every rank has exited: reads what they left (a stream that a rank's own child still
  // holds open is not waited for) and forwards everything.
  void finish() {
    for (int round = 0; round < 100; ++round) {
      std::vector<pollfd> fds;
      std::vector<size_t> which;
      for (size_t i = 0; i < streams_.size(); ++i) {
        if (streams_[i].read_fd.valid()) {
          fds.push_back({streams_[i].read_fd.get(), POLLIN, 0});
          which.push_back(i);
        }
      }
      if (fds.empty() || ::poll(fds.data(), fds.size(), 20) <= 0) break;
      for (size_t k = 0; k < fds.size(); ++k) {
        if (fds[k].revents != 0) read_from(which[k]);
      }
    }
    for (size_t i = 0; i < streams_.size(); ++i) {
      Stream& s = streams_[i];
      s.read_fd.reset();
      s.closed = true;
      if (!s.partial.empty()) {  // a last line without its newline
        s.partial += '\n';
        take_lines(i);
      } else if (s.mid_line) {  // e.g. a progress bar: what follows starts on a line of its own
        write_text("\n");
        s.mid_line = false;
      }
    }
    release(true);
  }

 private:
  struct Stream {
    int64_t rank = 0;
    UniqueFd read_fd;   // the supervisor's end
    UniqueFd child_fd;  // the rank's end (stderr), until started()
    bool closed = false;
    bool mid_line = false;  // the start of the current line was already forwarded
    std::string partial;    // text after the last newline
    std::chrono::steady_clock::time_point partial_since{};
  };
  struct Line {
    std::string key;   // the text, with the rank it names replaced by kRankMark
    std::string text;  // as the first rank wrote it
    bool names_rank = false;
    std::vector<int64_t> ranks;  // indices into streams_
    std::chrono::steady_clock::time_point first{};
  };
  static constexpr char kRankMark = '\x01';

  static bool open_pipe(Stream& s) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return false;
    s.read_fd.reset(fds[0]);
    s.child_fd.reset(fds[1]);
    ::fcntl(s.read_fd.get(), F_SETFL, O_NONBLOCK);
    return true;
  }

  static bool open_pty(Stream& s) {
    UniqueFd master(::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC));
    if (!master.valid()) return false;
    char name[128];
    UniqueFd slave;
    if (::grantpt(master.get()) == 0 && ::unlockpt(master.get()) == 0 &&
        ::ptsname_r(master.get(), name, sizeof(name)) == 0) {
      slave.reset(::open(name, O_RDWR | O_NOCTTY | O_CLOEXEC));
    }
    if (!slave.valid()) return false;
    termios t{};
    if (::tcgetattr(slave.get(), &t) == 0) {
      ::cfmakeraw(&t);  // no "\n" -> "\r\n": the bytes arrive as the rank wrote them
      ::tcsetattr(slave.get(), TCSANOW, &t);
    }
    winsize size{};
    if (::ioctl(2, TIOCGWINSZ, &size) == 0) ::ioctl(slave.get(), TIOCSWINSZ, &size);
    ::fcntl(master.get(), F_SETFL, O_NONBLOCK);
    s.read_fd = std::move(master);
    s.child_fd = std::move(slave);
    return true;
  }

  void read_from(size_t i) {
    Stream& s = streams_[i];
    char buf[65536];
    for (;;) {
      const ssize_t n = ::read(s.read_fd.get(), buf, sizeof(buf));
      if (n > 0) {
        if (s.partial.empty()) s.partial_since = std::chrono::steady_clock::now();
        s.partial.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) break;
      // EOF, or EIO: a pseudo-terminal whose rank side is closed.
      s.read_fd.reset();
      s.closed = true;
      break;
    }
    take_lines(i);
  }

  // Moves the complete lines of stream i into the queue; forwards text that must not wait.
  void take_lines(size_t i) {
    Stream& s = streams_[i];
    size_t begin = 0;
    for (size_t nl; (nl = s.partial.find('\n', begin)) != std::string::npos; begin = nl + 1) {
      if (s.mid_line) {  // the rest of a line already begun on the terminal
        write_text(s.partial.substr(begin, nl + 1 - begin));
        s.mid_line = false;
      } else {
        queue(i, s.partial.substr(begin, nl - begin));
      }
    }
    s.partial.erase(0, begin);
    if (begin > 0) s.partial_since = std::chrono::steady_clock::now();
    const bool urgent = s.partial.find('\r') != std::string::npos || s.mid_line ||
                        std::chrono::steady_clock::now() - s.partial_since >= hold_;
    if (!s.partial.empty() && urgent) {
      release_through(i);  // the rank's earlier lines first
      write_text(s.partial);
      s.partial.clear();
      s.mid_line = true;
    }
  }

  void queue(size_t i, std::string text) {
    const int64_t rank = streams_[i].rank;
    std::string key = text;
    bool names_rank = false;
    const std::string word = detail::cat("rank ", rank);
    for (size_t at = key.find(word); at != std::string::npos; at = key.find(word, at + 1)) {
      const size_t end = at + word.size();
      const bool starts = at == 0 || !std::isalnum(static_cast<unsigned char>(key[at - 1]));
      const bool ends = end == key.size() || !std::isdigit(static_cast<unsigned char>(key[end]));
      if (starts && ends) {
        key.replace(at, word.size(), std::string(1, kRankMark));
        names_rank = true;
        break;
      }
    }
    // Join the same line of other ranks, where every rank's lines keep their order: in place
    // when this rank has no later line queued, else moved behind everything when its ranks have
    // no later line queued.
    auto has = [](const Line& l, int64_t r) {
      return std::find(l.ranks.begin(), l.ranks.end(), r) != l.ranks.end();
    };
    const int64_t me = static_cast<int64_t>(i);
    for (size_t k = hold_.count() > 0 ? pending_.size() : 0; k-- > 0;) {  // hold 0: never merged
      if (pending_[k].key != key || has(pending_[k], me)) continue;
      bool mine_later = false, theirs_later = false;
      for (size_t later = k + 1; later < pending_.size(); ++later) {
        mine_later = mine_later || has(pending_[later], me);
        for (int64_t r : pending_[k].ranks) theirs_later = theirs_later || has(pending_[later], r);
      }
      if (!mine_later) {
        pending_[k].ranks.push_back(me);
        return;
      }
      if (!theirs_later) {
        Line moved = std::move(pending_[k]);
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(k));
        moved.ranks.push_back(me);
        pending_.push_back(std::move(moved));
        return;
      }
    }
    Line line;
    line.key = std::move(key);
    line.text = std::move(text);
    line.names_rank = names_rank;
    line.ranks = {static_cast<int64_t>(i)};
    line.first = std::chrono::steady_clock::now();
    pending_.push_back(std::move(line));
  }

  // A line is due when every rank of this node wrote it (or can write nothing more), or `hold`
  // passed; lines leave in the order they first arrived.
  void release(bool all) {
    const auto now = std::chrono::steady_clock::now();
    while (!pending_.empty()) {
      const Line& line = pending_.front();
      bool complete = true;
      for (size_t i = 0; i < streams_.size() && complete; ++i) {
        complete = streams_[i].closed ||
                   std::find(line.ranks.begin(), line.ranks.end(), i) != line.ranks.end();
      }
      if (!all && !complete && now - line.first < hold_) return;
      write_text(render(line) + "\n");
      pending_.pop_front();
    }
  }

  // Forwards the queue up to the last line of stream i.
  void release_through(size_t i) {
    size_t last = 0;
    bool found = false;
    for (size_t k = 0; k < pending_.size(); ++k) {
      if (std::find(pending_[k].ranks.begin(), pending_[k].ranks.end(), i) !=
          pending_[k].ranks.end()) {
        last = k;
        found = true;
      }
    }
    if (!found) return;
    for (size_t k = 0; k <= last; ++k) {
      write_text(render(pending_.front()) + "\n");
      pending_.pop_front();
    }
  }

  std::string render(const Line& line) const {
    if (line.ranks.size() == 1) return line.text;
    std::vector<int64_t> ranks;
    for (int64_t i : line.ranks) ranks.push_back(streams_[i].rank);
    std::sort(ranks.begin(), ranks.end());
    std::string list;
    for (size_t a = 0; a < ranks.size();) {
      size_t b = a;
      while (b + 1 < ranks.size() && ranks[b + 1] == ranks[b] + 1) ++b;
      list += detail::cat(list.empty() ? "" : ",", ranks[a]);
      if (b > a) list += detail::cat(b == a + 1 ? "," : "-", ranks[b]);
      a = b + 1;
    }
    if (!line.names_rank) return detail::cat(line.text, " [ranks ", list, "]");
    std::string text = line.key;
    text.replace(text.find(kRankMark), 1, "ranks " + list);
    return text;
  }

  std::chrono::milliseconds hold_;
  bool tty_;
  std::vector<Stream> streams_;
  std::deque<Line> pending_;
};

}  // namespace fsdp::detail
