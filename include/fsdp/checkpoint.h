// fsdp/checkpoint.h: saving and restoring training, and the weights in formats other tools read.
//
// Two kinds of checkpoint:
//   - sharded (save_checkpoint / load_checkpoint): a directory that resumes a run — parameters,
//     optimizer state, the caller's state (step, data position, free-form values) and every
//     rank's RNG. Each rank writes only what it owns, in parallel; with hybrid strategies one
//     replica writes and the others write nothing, so the bytes on disk are one copy of the state
//     whatever the number of replicas. It loads into any mesh, strategy, world size or wrap
//     policy (NOTE [checkpoint format]).
//   - full (export_full_checkpoint / import_full_checkpoint, and save_/load_full_checkpoint for
//     plain, unsharded modules): one file with every parameter and buffer under the model's own
//     names, either PyTorch's zip format (".pt": Python's torch.load returns a dict of tensors)
//     or safetensors (".safetensors"). Exports stream one unit at a time: no rank holds more than
//     one unit unsharded beyond what training already does.
//
//   fsdp::TrainingState state;
//   state.step = step;
//   state.values["sampler"] = sampler_state;                     // any UTF-8 text
//   fsdp::save_checkpoint(fsdp::checkpoint_path(dir, step), model, &optimizer, state);
//   ...
//   if (auto latest = fsdp::latest_checkpoint(dir))
//     fsdp::load_checkpoint(*latest, model, &optimizer, &state);  // any mesh
//
// NOTE [checkpoint format]
// A sharded checkpoint is a directory:
//   shard-<s>.bin  raw little-endian data written by the replica-0 member of shard index s:
//                  for each unit, the part of every parameter (and of every optimizer state
//                  tensor of that parameter) that falls in the rank's flat shard, padding left out
//   rng.bin        every rank's libtorch CPU generator state, followed on GPUs by its device's
//                  CUDA generator state (rank 0 writes it)
//   meta.json      written last: format version, strategy, mesh, world size, the caller's state,
//                  the optimizer's type and learning rates, and for every tensor (parameters,
//                  buffers, optimizer state per original parameter name) its shape, dtype and
//                  chunks: file, byte offset, element range, CRC-32C; every file's size and
//                  CRC-32C (format 2; format-1 checkpoints, with zlib's CRC-32, still load)
// The directory is written as "<path>.partial" and renamed to <path> only after every rank has
// written and fsync'ed its files and rank 0 has written meta.json, so a crash at any moment
// leaves earlier checkpoints intact; latest_checkpoint() only considers complete "step-N"
// directories, and list_checkpoints() says what every entry is and why one cannot be loaded.
// Loading maps every chunk by parameter name and element range onto the new layout, so the
// saving and loading meshes are unrelated; every size and offset read from a file
// is checked against the file before use, and every chunk's checksum is verified on read.
// The directory must be on a filesystem every rank sees (one machine, or a shared filesystem).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/error.h"
#include "fsdp/sharded.h"

namespace torch::nn {
class Module;
}

namespace fsdp {

// The caller's part of a checkpoint, saved from rank 0 and given back to every rank.
struct TrainingState {
  int64_t step = 0;                           // e.g. optimizer steps done
  std::map<std::string, std::string> values;  // free-form UTF-8 text: data position, schedule...
};

struct CheckpointOptions {
  // Save every rank's libtorch CPU generator (and, on a GPU, its device's CUDA generator), and
  // restore them on load when the world size is unchanged (with another world size generators
  // are left as they are; a GPU checkpoint loaded on CPU restores the CPU generators, a CPU one
  // loaded on GPUs leaves the CUDA generators as they are). Default true.
  bool rng = true;
};

// What a save or load did, for logs and summaries.
struct CheckpointInfo {
  std::string path;
  int64_t bytes = 0;        // save: bytes in the checkpoint; load: bytes this rank read
  double seconds = 0;       // wall time of the call on this rank
  // Save: the slowest rank's writing of its file, from opening it to its fsync (an asynchronous
  // save's background write; the call's `seconds` there runs until the commit).
  double write_seconds = 0;
  int64_t files = 0;        // files in the checkpoint
  bool rng_restored = false;       // load: the CPU generator
  bool cuda_rng_restored = false;  // load: this rank's CUDA generator too
  // Asynchronous save: files written through the page cache because their file system refused
  // O_DIRECT (AsyncCheckpointer writes around the cache where it can; the files are the same).
  int64_t page_cache_writes = 0;
};

// Writes a sharded checkpoint of `model`, `optimizer` (may be null) and `state` to directory
// `path` (its parent is created if missing; an existing checkpoint at `path` is replaced
// atomically). Collective: call on every rank with the same path. `optimizer` must be a
// torch::optim Adam, AdamW, SGD, RMSprop or Adagrad over model.parameters(). Throws fsdp::Error
// on every rank if any rank fails (disk full, unwritable directory...).
CheckpointInfo save_checkpoint(const std::string& path, ShardedModuleBase& model,
                               const torch::optim::Optimizer* optimizer,
                               const TrainingState& state = {},
                               const CheckpointOptions& options = {});

// What load_checkpoint throws, on every rank and before anything changed, when the checkpoint
// itself cannot be used: meta.json refused (every check of list_checkpoints, a future format
// version included), a file missing or short, a checksum mismatch found while reading. The model, optimizer and state are as they were, so the
// caller may load an older checkpoint instead (fsdp-train --resume-fallback does). A checkpoint
// that does not fit the model (names, shapes, optimizer type) is a plain fsdp::Error: an older
// one of the same run would not fit either.
class CheckpointDamagedError : public Error {
 public:
  using Error::Error;
};

// Restores a checkpoint written by save_checkpoint on any mesh, strategy, world size or wrap
// policy. `optimizer` (may be null: parameters only) must be of the saved type; its state is
// replaced. `state` (may be null) receives the caller's state. Collective. Throws on every rank
// — before changing anything — CheckpointDamagedError for a missing, truncated or corrupted file,
// an incomplete meta.json or a future format version, fsdp::Error for a model whose names or
// shapes differ (listing every mismatch), another optimizer type, or optimizer state of a
// parameter the optimizer does not train.
CheckpointInfo load_checkpoint(const std::string& path, ShardedModuleBase& model,
                               torch::optim::Optimizer* optimizer, TrainingState* state = nullptr,
                               const CheckpointOptions& options = {});

// "<dir>/step-<step, 8 digits>": where save_checkpoint's callers put step `step`.
std::string checkpoint_path(const std::string& dir, int64_t step);

// What an entry of a checkpoint directory is (list_checkpoints).
enum class CheckpointStatus {
  kComplete,  // meta.json valid, every file it lists present with its recorded size
  kPartial,   // "step-N.partial": a save that did not finish (a crash); never loaded
  kInvalid,   // a "step-N" directory that cannot be loaded; `reason` says why
};
const char* to_string(CheckpointStatus status);  // "complete", "partial", "invalid"

struct CheckpointEntry {
  std::string path;
  int64_t step = 0;  // N of the entry's name
  CheckpointStatus status = CheckpointStatus::kInvalid;
  std::string reason;  // kInvalid: one line naming the checkpoint, the file and the problem
};

// Every checkpoint entry of `dir` ("step-N" directories and "step-N.partial" leftovers), by
// step, oldest first; other names are not entries. Each "step-N" is checked as load_checkpoint
// checks it before reading any data — meta.json parsed and validated (format version, file
// names inside the directory, shapes, offsets and sizes) and every file present with its
// recorded size — but no CRC is computed (verify_checkpoint does that). A "step-N.old" (a re-save
// of step N that died between its two renames) is listed as step N when "step-N" itself is not
// complete: then it is the only good copy. A missing `dir` gives an empty list. Local.
std::vector<CheckpointEntry> list_checkpoints(const std::string& dir);

// The path of the newest complete entry of list_checkpoints(dir), or nullopt if there is none.
// Invalid and partial entries are skipped without a word: a program that must not resume from
// an older checkpoint than the newest one on disk (fsdp-train --resume) looks at
// list_checkpoints itself. Local.
std::optional<std::string> latest_checkpoint(const std::string& dir);

// Deletes all but the newest `keep` complete checkpoints in `dir`, partial ones left by crashes,
// and "step-N.old" copies whose "step-N" is complete. Invalid entries are never deleted: they are
// the evidence of what went wrong; nor are the entries in `damaged` (paths whose load threw
// CheckpointDamagedError: complete to the listing, which reads no data), which do not count
// among the `keep`. Local: call on one rank (e.g. rank 0) after a save.
void prune_checkpoints(const std::string& dir, int64_t keep,
                       const std::vector<std::string>& damaged = {});

// What a checkpoint holds (verify_checkpoint).
struct CheckpointSummary {
  std::string path;
  int64_t step = 0;
  int64_t format_version = 0;
  std::string strategy;       // e.g. "FULL_SHARD"
  std::vector<int64_t> mesh;  // (replicate, shard)
  int64_t world_size = 0;
  std::string optimizer;      // e.g. "adamw"; "" : none
  int64_t tensors = 0;        // parameters, buffers and optimizer states
  int64_t parameter_numel = 0;
  int64_t files = 0;          // meta.json included
  int64_t bytes = 0;          // all files, meta.json included
  bool rng = false;           // every rank's RNG state is saved
};

// Validates the checkpoint at `path` completely, without a cluster or a model: meta.json as
// list_checkpoints does, then every byte of every file against its chunks' and its own checksum.
// Throws fsdp::Error naming the file and the problem. Local; reads the whole checkpoint.
CheckpointSummary verify_checkpoint(const std::string& path);

// The step and caller state recorded in a checkpoint's meta.json (validated). Local.
TrainingState read_checkpoint_state(const std::string& path);

struct ExportOptions {
  // Only the trainable parameters (requires_grad at shard(); e.g. LoRA adapters), no frozen
  // parameters and no buffers. Default false: everything.
  bool trainable_only = false;
};

// Writes every parameter and buffer of `model` (frozen parameters too), unsharded, under the
// model's names to `file`: ".pt" (PyTorch zip format, torch.load gives a dict name -> tensor) or
// ".safetensors". Collective; rank 0 writes (atomically: "<file>.partial", then renamed).
void export_full_checkpoint(ShardedModuleBase& model, const std::string& file,
                            const ExportOptions& options = {});

// Loads a full checkpoint (".pt" from export_full_checkpoint, save_full_checkpoint or Python's
// torch.save of a state dict; or ".safetensors") into `model` on any mesh. Every rank reads the
// file. Collective; on a mismatch every rank throws, listing every missing, unexpected or
// mis-shaped entry.
void import_full_checkpoint(ShardedModuleBase& model, const std::string& file);

// The same two formats for a plain, unsharded libtorch module.
void save_full_checkpoint(torch::nn::Module& module, const std::string& file);
void load_full_checkpoint(torch::nn::Module& module, const std::string& file);

}  // namespace fsdp
