// fsdp/async_checkpoint.h: sharded checkpoints written in the background while training goes on.
//
//   fsdp::AsyncCheckpointer saver;
//   for (int64_t step = 1; step <= steps; ++step) {
//     train_one_step();
//     saver.poll();                                  // commits a finished save; cheap otherwise
//     if (step % every == 0)
//       saver.save(fsdp::checkpoint_path(dir, step), model, &optimizer, {step});
//   }
//   saver.wait();                                    // the last save is complete on disk
//
// NOTE [async checkpoint]
// save() blocks training only while it checks its arguments on this rank and copies this rank's
// part of the checkpoint (the shards it writes, their optimizer state, the caller's state and
// the RNG state) into a staging buffer that is kept and reused by the next save (on CUDA, pinned
// host memory); it waits for no other rank. A background thread then agrees with the other
// ranks' through the rendezvous store that every rank's arguments were valid and rank 0 made
// "<path>.partial", writes the rank's shard file from the buffer, computing the CRCs, and fsyncs
// it; it runs no collective of the process groups and touches neither the model nor the
// optimizer, so training goes on at once.
// The commit — CRCs and RNG states collected, meta.json written by rank 0, the directory
// renamed into place — is collective and runs on the caller's thread inside poll(), wait() or
// the next save(), once every rank's background write has finished. Until then the checkpoint
// is "<path>.partial": a crash or kill -9 of any rank at any moment leaves every earlier
// checkpoint intact and latest_checkpoint() pointing to the newest committed one. At most one
// save is in flight: save() first waits for and commits the previous one. A failed background
// write (disk full, directory removed, read-only filesystem), and arguments any rank refused
// (what save_checkpoint refuses at once), are raised as fsdp::Error on every rank by the
// poll(), wait() or save() that would have committed the save; nothing is committed then.
// The files are exactly those of save_checkpoint (NOTE [checkpoint format]); load_checkpoint
// reads them.
// The first save allocates the staging buffer, and touching new memory is what made it block
// 0.02-0.38 s on this project's VM where later saves block ~0.01 s: reserve() allocates it on a
// background thread ahead of time (fsdp-train calls it after the first step), so every save
// blocks only for the copy.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "fsdp/checkpoint.h"

namespace fsdp {

class AsyncCheckpointer {
 public:
  AsyncCheckpointer();
  // Joins the background write if one runs, without committing it: the checkpoint stays
  // "<path>.partial" (call wait() first to commit it). A background thread still waiting for
  // ranks that never started the same save stops waiting and writes nothing. Never throws.
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Starts saving `model`, `optimizer` (may be null) and `state` to directory `path`, as
  // save_checkpoint does, and returns once this rank's data is staged (NOTE [async checkpoint]).
  // Commits a save still in flight first (as wait() does). Collective: every rank, same path, at
  // the same point of training. Throws fsdp::Error on every rank for a failure of the previous
  // save; what save_checkpoint refuses (on any rank) is raised for this save by the poll(),
  // wait() or save() that commits it, on every rank (NOTE [async checkpoint]).
  void save(const std::string& path, ShardedModuleBase& model,
            const torch::optim::Optimizer* optimizer, const TrainingState& state = {},
            const CheckpointOptions& options = {});

  // Commits the save in flight if every rank's background write has finished, and returns what
  // it wrote; returns nullopt at once when nothing is in flight (no communication) or some rank
  // is still writing (one small collective). Collective while a save is in flight: call it on
  // every rank at the same point (e.g. after every step). Throws fsdp::Error on every rank if a
  // background write failed.
  std::optional<CheckpointInfo> poll();

  // Waits for every rank's background write and commits the save in flight; returns what it
  // wrote, or nullopt if nothing was in flight. Collective when a save is in flight. Throws
  // fsdp::Error on every rank if a background write failed.
  std::optional<CheckpointInfo> wait();

  // Allocates and touches, on a background thread, the staging buffer a save of `model`,
  // `optimizer` and `state` needs, and returns at once; the next save() adopts it (waiting for
  // the allocation if it has not finished). Call it once the optimizer has its state (after the
  // first step): what a save needs beyond the reservation is allocated by that save. Local: no
  // collective, any rank may call it or not, also while a save is in flight (its write keeps
  // its buffer; the next save adopts the new one). One reservation at a time: a second waits
  // for the first. staging_bytes() and memory_stats count the reservation at once. Throws fsdp::Error for arguments save_checkpoint refuses; a failed
  // allocation is raised by the next save() (on every rank, as a refused argument) or reserve().
  void reserve(ShardedModuleBase& model, const torch::optim::Optimizer* optimizer,
               const TrainingState& state = {});

  // Whether a save was started and not yet committed (the same on every rank).
  bool in_flight() const;
  // Path of the save in flight ("" if none).
  const std::string& in_flight_path() const;
  // Bytes of the staging buffer this rank keeps between saves (0 before the first save or
  // reserve()).
  int64_t staging_bytes() const;
  // Seconds the last save() blocked the caller: staging, plus committing a previous save.
  double last_blocked_seconds() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp
