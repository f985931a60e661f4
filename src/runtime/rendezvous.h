// rendezvous.h (internal): how the ranks of a job meet: the c10d store (a TCPStore hosted by rank
// 0, or by torchrun's agent), the join and exit barriers, and the agreements that use nothing but
// the store (Runtime::check_agreement, Runtime::check_all_ok), so they are safe before the first
// collective and cannot hang on mismatched ones.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

#include "fsdp/cluster.h"

namespace fsdp::detail {

// This rank's connection to the job's rendezvous store: rank 0 hosts a TCPStore on the master
// address (unless torchrun's agent hosts it, then every rank is a client), the others connect to
// it within `timeout`. A world of one gets an in-process store. Throws fsdp::Error naming the
// address and the fix: a port in use, an address that is not rank 0's, rank 0 unreachable.
c10::intrusive_ptr<c10d::Store> connect_store(const ClusterEnv& env,
                                              std::chrono::milliseconds timeout);

// One rank's side of the meetings on `store`. join, leave, check_agreement and check_all_ok must
// be called by every rank of the job in the same order (each agreement takes the next keys);
// every wait is bounded by `timeout`. Thread-safe: the store is, and the agreement counter is
// guarded.
class Rendezvous {
 public:
  Rendezvous(c10::intrusive_ptr<c10d::Store> store, const ClusterEnv& env,
             std::chrono::milliseconds timeout);

  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // Waits until every rank of the job arrived. With a job id, first checks that the store is
  // this job's (rank 0 records the id, the others compare). Throws fsdp::Error naming how many
  // ranks arrived, or the other job. Nothing to do in a world of one.
  void join();
  // The exit barrier: every rank arrives; rank 0, which hosts the store, waits for all of them,
  // so that the store outlives every other rank's last use of it. Returns quietly on a timeout.
  void leave();

  // See Runtime::check_agreement and Runtime::check_all_ok.
  void check_agreement(const std::string& what, const std::string& value);
  void check_all_ok(const std::string& what, const std::string& local_error);
  // check_all_ok in two halves, for work finished on another thread (an asynchronous save):
  // reserve_agreement() takes the next agreement's keys on the caller's thread, in order with
  // the other agreements; check_all_ok_reserved(id, ...) runs it later on any thread while the
  // caller's thread goes on with further agreements. It waits by polling the store, so another
  // thread's store calls are not held up behind the wait (TCPStore serializes its client), and
  // gives up with fsdp::Error once `*cancel` turns true; with `cancel` null it blocks in the
  // store as check_all_ok does (which is this with the next id).
  int64_t reserve_agreement() { return next_agreement(); }
  void check_all_ok_reserved(int64_t id, const std::string& what, const std::string& local_error,
                             const std::atomic<bool>* cancel);

 private:
  // Waits until `count_key` reached `expected` (every rank add()s 1), up to the timeout. The
  // last arrival sets `count_key + "/all"`, which the others wait for. Returns how many arrived.
  // `cancel` (not null): wait by checking the key every millisecond instead of blocking in the
  // store, and throw fsdp::Error once *cancel is true.
  int64_t arrive_and_wait(const std::string& count_key, int64_t expected, bool wait,
                          const std::atomic<bool>* cancel = nullptr);
  void check_same_job();
  int64_t next_agreement();

  const c10::intrusive_ptr<c10d::Store> store_;
  const ClusterEnv env_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;  // guards agreements_
  int64_t agreements_ = 0;
};

}  // namespace fsdp::detail
