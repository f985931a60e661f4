// unique_fd.h (internal): UniqueFd, a file descriptor closed when its owner goes out of scope
// (RAII, like std::unique_ptr). Not thread-safe per object; distinct objects may be used from
// different threads.
#pragma once

#include <unistd.h>

#include <utility>

namespace fsdp::detail {

// Owns one descriptor (or none: -1). Closing ignores errors; where a close can lose data (a file
// written), call release() and check ::close yourself (checkpoint/file_io.cpp's File does).
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership without closing.
  int release() { return std::exchange(fd_, -1); }
  // Closes the descriptor held, if any, and takes `fd`.
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace fsdp::detail
