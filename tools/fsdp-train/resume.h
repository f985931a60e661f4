// What fsdp-train does with the checkpoints already in a directory: which one --resume starts
// from (choose_resume: the newest, never an older one in silence) and --check-checkpoint (an
// operator's check before a restart, without a cluster).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "fsdp/checkpoint.h"

namespace fsdp_train {

struct ResumeChoice {
  std::optional<std::string> path;  // nullopt: start fresh
  std::vector<std::string> notes;   // lines rank 0 prints: entries skipped and why, a fresh start
  // With `fallback`: the complete entries older than `path`, newest first, which --resume tries
  // in turn when loading `path` finds it damaged (fsdp::CheckpointDamagedError: a checksum only
  // reading finds); empty without it.
  std::vector<std::string> older;
};

// The checkpoint --resume continues from, given list_checkpoints(dir). Partial entries (a crash
// during a save) are ignored. The newest other entry must be complete: if it is invalid this
// throws fsdp::Error naming the entry, the file and the reason, and the two ways on (repair or
// remove it, or --resume-fallback), unless `fallback`, which skips invalid entries, each with a
// note saying why, down to the newest complete one, and lists the complete ones below it. Pure.
ResumeChoice choose_resume(const std::vector<fsdp::CheckpointEntry>& entries,
                           const std::string& dir, bool fallback);

// --check-checkpoint PATH: a checkpoint (a directory with meta.json, or named step-N) is verified
// completely (fsdp::verify_checkpoint) and described; any other directory is taken as a
// --checkpoint-dir and every entry is listed, the complete ones verified. Prints to stdout;
// returns 0 if everything checked is valid, 1 otherwise (each problem printed).
int run_check_checkpoint(const std::string& path);

}  // namespace fsdp_train
