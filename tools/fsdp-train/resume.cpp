// --resume's choice of checkpoint and --check-checkpoint (see resume.h).
#include "resume.h"

#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <regex>

#include "fsdp/error.h"
#include "fsdp/report.h"

namespace fsdp_train {

using fsdp::cat;

namespace {

std::string name_of(const std::string& path) {
  return std::filesystem::path(path).filename().string();
}

}  // namespace

ResumeChoice choose_resume(const std::vector<fsdp::CheckpointEntry>& entries,
                           const std::string& dir, bool fallback) {
  ResumeChoice choice;
  int64_t skipped = 0;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (it->status == fsdp::CheckpointStatus::kPartial) continue;  // a crash mid-save: by design
    if (it->status == fsdp::CheckpointStatus::kComplete) {
      choice.path = it->path;
      for (auto o = std::next(it); fallback && o != entries.rend(); ++o) {
        if (o->status == fsdp::CheckpointStatus::kComplete) choice.older.push_back(o->path);
      }
      return choice;
    }
    if (!fallback) {
      std::string older = "none: it would start fresh";
      for (auto o = std::next(it); o != entries.rend(); ++o) {
        if (o->status == fsdp::CheckpointStatus::kComplete) {
          older = name_of(o->path);
          break;
        }
      }
      throw fsdp::Error(cat("--resume: the newest checkpoint in ", dir, ", ", name_of(it->path),
                            ", cannot be loaded: ", it->reason, ". Repair or remove ", it->path,
                            ", or add --resume-fallback to resume from the newest valid one (",
                            older, ")"));
    }
    ++skipped;
    choice.notes.push_back(cat("fsdp-train: --resume-fallback: skipping ", it->path, ": ",
                               it->reason));
  }
  choice.notes.push_back(
      skipped == 0
          ? cat("fsdp-train: --resume: no checkpoint in ", dir, " yet; starting fresh")
          : cat("fsdp-train: --resume-fallback: no valid checkpoint left in ", dir,
                " after skipping ", skipped, "; starting fresh"));
  return choice;
}

namespace {

std::string mesh_text(const std::vector<int64_t>& mesh) {
  std::string s = "(";
  for (size_t i = 0; i < mesh.size(); ++i) s += cat(i ? ", " : "", mesh[i]);
  return s + ")";
}

// Verifies one checkpoint; prints what it holds or why it is invalid. True if valid.
bool check_one(const std::string& path, const std::string& label) {
  try {
    const fsdp::CheckpointSummary s = fsdp::verify_checkpoint(path);
    std::printf("%s: valid (meta.json complete, every file's size and %s checked)\n", label.c_str(),
                s.format_version >= 2 ? "CRC-32C" : "CRC-32");
    std::printf("  step %lld, format %lld, %s on mesh %s, world %lld, optimizer %s, RNG %s\n",
                static_cast<long long>(s.step), static_cast<long long>(s.format_version),
                s.strategy.c_str(), mesh_text(s.mesh).c_str(),
                static_cast<long long>(s.world_size),
                s.optimizer.empty() ? "none" : s.optimizer.c_str(), s.rng ? "saved" : "not saved");
    std::printf("  %lld tensors (%s parameters), %lld files, %s\n",
                static_cast<long long>(s.tensors),
                fsdp::format_count(double(s.parameter_numel)).c_str(),
                static_cast<long long>(s.files), fsdp::format_bytes(double(s.bytes)).c_str());
    return true;
  } catch (const fsdp::Error& e) {
    std::printf("%s: INVALID: %s\n", label.c_str(), e.what());
    return false;
  }
}

}  // namespace

int run_check_checkpoint(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    std::printf("fsdp-train --check-checkpoint: '%s' is not a directory; give a checkpoint "
                "(DIR/step-NNNNNNNN) or a --checkpoint-dir\n", path.c_str());
    return 1;
  }
  static const std::regex step_name("step-[0-9]{1,18}(\\.old)?");
  std::filesystem::path normal = std::filesystem::path(path).lexically_normal();
  if (!normal.has_filename()) normal = normal.parent_path();  // "DIR/step-1/"
  const std::string name = normal.filename().string();
  const bool single = ::stat((path + "/meta.json").c_str(), &st) == 0 ||
                      std::regex_match(name, step_name);
  if (single) return check_one(path, path) ? 0 : 1;
  const auto entries = fsdp::list_checkpoints(path);
  if (entries.empty()) {
    std::printf("%s: no checkpoint (no step-NNNNNNNN entry)\n", path.c_str());
    return 1;
  }
  bool ok = true;
  for (const auto& e : entries) {
    if (e.status == fsdp::CheckpointStatus::kPartial) {
      std::printf("%s: partial (a save that did not finish; --resume ignores it, the next save "
                  "removes it)\n", e.path.c_str());
    } else if (e.status == fsdp::CheckpointStatus::kInvalid) {
      std::printf("%s: INVALID: %s\n", e.path.c_str(), e.reason.c_str());
      ok = false;
    } else {
      ok = check_one(e.path, e.path) && ok;
    }
  }
  return ok ? 0 : 1;
}

}  // namespace fsdp_train
