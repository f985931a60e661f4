// slow_fsync.cpp: a slow disk for fault-injection tests, injected from outside the program under
// test (LD_PRELOAD), so the library carries no test switch (issue 22).
//
//   LD_PRELOAD=libfsdp_slow_fsync.so FSDP_FAULT_FSYNC_DELAY_MS=1500 fsdp-train ...
//
// makes every fsync() and fdatasync() of the process and of the ranks it starts (they inherit the
// environment) sleep that long before syncing. A checkpoint save fsyncs each file before the
// collective commit, so a test can kill a rank while the save is in flight without a race.
#include <dlfcn.h>

#include <cstdlib>
#include <ctime>

namespace {
void delay() {
  const char* ms = std::getenv("FSDP_FAULT_FSYNC_DELAY_MS");
  if (!ms) return;
  const long n = std::atol(ms);
  if (n <= 0) return;
  timespec t{n / 1000, (n % 1000) * 1000000L};
  while (nanosleep(&t, &t) != 0) {
  }
}

using SyncFn = int (*)(int);
SyncFn next(const char* name) { return reinterpret_cast<SyncFn>(dlsym(RTLD_NEXT, name)); }
}  // namespace

extern "C" int fsync(int fd) {
  static const SyncFn real = next("fsync");
  delay();
  return real(fd);
}

extern "C" int fdatasync(int fd) {
  static const SyncFn real = next("fdatasync");
  delay();
  return real(fd);
}
