// A checkpoint directory seen from outside a training run (see fsdp/checkpoint.h): what each
// entry is (list_checkpoints, latest_checkpoint), pruning, and full verification of one
// checkpoint (verify_checkpoint). No collectives, no model.
#include <fcntl.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/meta.h"
#include "fsdp/checkpoint.h"
#include "fsdp/error.h"

namespace fsdp {

using detail::cat;
namespace fs = std::filesystem;

namespace {

// "step-N", "step-N.partial" and "step-N.old" directories of `dir`, by step.
struct RawEntries {
  std::map<int64_t, std::string> full, partial, old;
};

RawEntries raw_entries(const std::string& dir) {
  RawEntries out;
  std::error_code ec;
  static const std::regex name("step-([0-9]{1,18})(\\.partial|\\.old)?");
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    std::smatch match;
    const std::string n = entry.path().filename().string();
    if (!std::regex_match(n, match, name) || !entry.is_directory(ec)) continue;
    const int64_t step = std::stoll(match[1].str());
    const std::string suffix = match[2].str();
    auto& into = suffix.empty() ? out.full : suffix == ".partial" ? out.partial : out.old;
    into[step] = entry.path().string();
  }
  return out;
}

CheckpointEntry check_entry(const std::string& path, int64_t step) {
  CheckpointEntry e;
  e.path = path;
  e.step = step;
  try {
    (void)detail::read_meta(path);
    e.status = CheckpointStatus::kComplete;
  } catch (const Error& err) {
    e.status = CheckpointStatus::kInvalid;
    e.reason = err.what();
  }
  return e;
}

}  // namespace

const char* to_string(CheckpointStatus status) {
  switch (status) {
    case CheckpointStatus::kComplete:
      return "complete";
    case CheckpointStatus::kPartial:
      return "partial";
    case CheckpointStatus::kInvalid:
      return "invalid";
  }
  return "?";
}

std::vector<CheckpointEntry> list_checkpoints(const std::string& dir) {
  const RawEntries raw = raw_entries(dir);
  std::vector<CheckpointEntry> out;
  std::map<int64_t, CheckpointEntry> by_step;
  for (const auto& [step, path] : raw.full) by_step[step] = check_entry(path, step);
  for (const auto& [step, path] : raw.old) {
    auto it = by_step.find(step);
    if (it != by_step.end() && it->second.status == CheckpointStatus::kComplete) continue;
    CheckpointEntry old = check_entry(path, step);
    // The moved-aside copy stands in for a missing or damaged step-N only if it is complete.
    if (it == by_step.end() || old.status == CheckpointStatus::kComplete) by_step[step] = old;
  }
  for (auto& [step, e] : by_step) {
    out.push_back(std::move(e));
    auto p = raw.partial.find(step);
    if (p != raw.partial.end()) out.push_back({p->second, step, CheckpointStatus::kPartial, ""});
  }
  for (const auto& [step, path] : raw.partial) {
    if (!by_step.count(step)) out.push_back({path, step, CheckpointStatus::kPartial, ""});
  }
  std::stable_sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    return a.step < b.step;
  });
  return out;
}

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  const auto all = list_checkpoints(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->status == CheckpointStatus::kComplete) return it->path;
  }
  return std::nullopt;
}

void prune_checkpoints(const std::string& dir, int64_t keep,
                       const std::vector<std::string>& damaged) {
  FSDP_CHECK(keep >= 1, "prune_checkpoints: keep ", keep, " must be at least 1");
  std::vector<std::string> complete;
  std::vector<std::string> keep_paths;
  for (const auto& e : list_checkpoints(dir)) {
    const bool known_damaged = std::find(damaged.begin(), damaged.end(), e.path) != damaged.end();
    if (e.status == CheckpointStatus::kComplete && !known_damaged) complete.push_back(e.path);
    if (e.status == CheckpointStatus::kInvalid || known_damaged) keep_paths.push_back(e.path);
  }
  std::error_code ec;
  const int64_t extra = static_cast<int64_t>(complete.size()) - keep;
  for (int64_t i = 0; i < extra; ++i) fs::remove_all(complete[static_cast<size_t>(i)], ec);
  keep_paths.insert(keep_paths.end(), complete.begin() + std::max<int64_t>(extra, 0),
                    complete.end());
  // Leftovers: every partial save, and every "step-N.old" that list_checkpoints did not list
  // (its step-N is complete).
  const RawEntries raw = raw_entries(dir);
  for (const auto* group : {&raw.partial, &raw.old}) {
    for (const auto& [step, path] : *group) {
      if (std::find(keep_paths.begin(), keep_paths.end(), path) == keep_paths.end()) {
        fs::remove_all(path, ec);
      }
    }
  }
}

TrainingState read_checkpoint_state(const std::string& path) {
  return detail::read_meta(path).state;
}

CheckpointSummary verify_checkpoint(const std::string& path) {
  const detail::Meta m = detail::read_meta(path);
  CheckpointSummary s;
  s.path = path;
  s.step = m.state.step;
  s.format_version = m.format_version;
  s.strategy = m.strategy;
  s.mesh = m.mesh;
  s.world_size = m.world_size;
  s.optimizer = m.optimizer;
  s.tensors = static_cast<int64_t>(m.entries.size());
  for (const auto& t : m.entries) s.parameter_numel += t.kind == "param" ? t.numel : 0;
  s.rng = m.rng_file >= 0;
  s.files = static_cast<int64_t>(m.files.size()) + 1;
  s.bytes = static_cast<int64_t>(fs::file_size(path + "/meta.json"));
  // Every file once, front to back: each chunk's CRC on its bytes, the file's CRC on all of them.
  constexpr int64_t kBlock = int64_t(8) << 20;
  std::vector<char> buf(static_cast<size_t>(kBlock));
  for (size_t f = 0; f < m.files.size(); ++f) {
    const detail::FileEntry& fe = m.files[f];
    detail::File file(path + "/" + fe.name, O_RDONLY);
    std::vector<const detail::Chunk*> chunks;
    for (const auto& c : m.chunks) {
      if (c.file == static_cast<int64_t>(f)) chunks.push_back(&c);
    }
    std::sort(chunks.begin(), chunks.end(),
              [](const detail::Chunk* a, const detail::Chunk* b) { return a->offset < b->offset; });
    uint32_t file_crc = 0;
    int64_t pos = 0;
    // Reads [pos, end) into the file's CRC and, if given, a chunk's.
    auto consume = [&](int64_t end, uint32_t* chunk_crc) {
      while (pos < end) {
        const int64_t n = std::min(kBlock, end - pos);
        file.read_at(buf.data(), n, pos);
        file_crc = detail::format_checksum(m.format_version, buf.data(), n, file_crc);
        if (chunk_crc) *chunk_crc = detail::format_checksum(m.format_version, buf.data(), n, *chunk_crc);
        pos += n;
      }
    };
    for (const detail::Chunk* c : chunks) {
      const detail::TensorEntry& t = m.entries[static_cast<size_t>(c->tensor)];
      const int64_t bytes = (c->end - c->begin) * static_cast<int64_t>(c10::elementSize(t.dtype));
      FSDP_CHECK(c->offset >= pos, "checkpoint '", path, "': meta.json gives '", fe.name,
                 "' overlapping chunks (", t.key(), " at byte ", c->offset,
                 "); the checkpoint is inconsistent");
      consume(c->offset, nullptr);
      uint32_t crc = 0;
      consume(c->offset + bytes, &crc);
      FSDP_CHECK(crc == c->crc, "checkpoint '", path, "': '", fe.name,
                 "' is corrupted (", detail::checksum_name(m.format_version),
                 " mismatch at byte ", c->offset, ", ", t.key(),
                 "); use an earlier checkpoint");
    }
    consume(fe.bytes, nullptr);
    FSDP_CHECK(file_crc == fe.crc, "checkpoint '", path, "': '", fe.name,
               "' is corrupted (its ", detail::checksum_name(m.format_version),
               " does not match meta.json's); use an earlier checkpoint");
    s.bytes += fe.bytes;
  }
  return s;
}

}  // namespace fsdp
