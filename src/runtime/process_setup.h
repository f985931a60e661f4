// process_setup.h (internal): the scoped process-global effect, glog's level while a rank
// connects to its rendezvous store (NOTE [process-global state] in fsdp/process.h).
#pragma once

namespace fsdp::detail {

// c10d logs every retry of a failing connection through glog (a line a second, after a "Logging
// before InitGoogleLogging" banner), and the error we throw already carries the reason: glog
// stays quiet (FATAL only) while any QuietGlog lives. Scopes may overlap across threads: the
// level in effect before the first is restored when the last ends (NOTE [quiet glog] in
// process_setup.cpp). A no-op where libtorch does not log via glog.
class QuietGlog {
 public:
  QuietGlog();
  ~QuietGlog();
  QuietGlog(const QuietGlog&) = delete;
  QuietGlog& operator=(const QuietGlog&) = delete;
};
// glog's FLAGS_minloglevel in this process, or nullptr where libtorch does not use glog.
int* glog_min_level();

}  // namespace fsdp::detail
