// checkpoint/common.h (internal): what every part of the checkpoint implementation shares: turning
// an exception into a message, message helpers, the CPU generator's state, and the fsdp::detail
// names the checkpoint files use (file I/O, meta.json, the engine).
#pragma once

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <torch/optim.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/meta.h"
#include "engine.h"
#include "fsdp/checkpoint.h"
#include "fsdp/error.h"

namespace fsdp::detail {

// Seconds from `t` to now.
double seconds_since(std::chrono::steady_clock::time_point t);

// "[2, 3]".
std::string shape_text(const std::vector<int64_t>& shape);

// Joins up to 20 problems, then "and N more".
std::string join_problems(const std::vector<std::string>& problems);

// Runs `fn` and turns its exception into a message ("" on success).
std::string capture(const std::function<void()>& fn);

// The libtorch CPU generator's state, and setting it (under the generator's lock).
at::Tensor cpu_rng_state();
void set_cpu_rng_state(const at::Tensor& state);

}  // namespace fsdp::detail

namespace fsdp {

using detail::cat;
using detail::checked_numel;
using detail::Chunk;
using detail::crc32_of;
using detail::dtype_from_name;
using detail::dtype_name;
using detail::Engine;
using detail::errno_text;
using detail::File;
using detail::get_field;
using detail::json;
using detail::kCheckpointFormatName;
using detail::kCheckpointFormatVersion;
using detail::kMaxMetaBytes;
using detail::Meta;
using detail::parent_dir;
using detail::read_meta;
using detail::sync_dir;
using detail::TensorEntry;
using detail::FlatView;
using detail::write_file_atomically;

using detail::capture;
using detail::checksum_key;
using detail::checksum_name;
using detail::format_checksum;
using detail::cpu_rng_state;
using detail::join_problems;
using detail::seconds_since;
using detail::set_cpu_rng_state;
using detail::shape_text;
namespace fs = std::filesystem;

}  // namespace fsdp
