// checkpoint/common.h (internal): what every part of the checkpoint implementation shares: turning
// an exception into a message, message helpers, mapped buffers and the generators' state; with
// file I/O (file_io.h) and meta.json (meta.h).
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

// A new contiguous CPU tensor of `numel` elements of `dtype` for a loader to read into or a save
// to stage in, its pages mapped up front (NOTE [one-pass load] in chunk_reader.cpp: 2 MiB pages
// where the kernel allows, populated with one call instead of a page fault per 4 KiB); from 2 MiB
// on it starts at a 2 MiB boundary (so at kDirectAlign). Contents are unspecified.
at::Tensor empty_mapped(int64_t numel, at::ScalarType dtype);
// `bytes` bytes starting at a kDirectAlign boundary at any size (File::write_direct's buffers):
// empty_mapped's from 2 MiB on, an aligned heap block below.
at::Tensor empty_direct_buffer(int64_t bytes);

// This rank's generator states as one byte record: the libtorch CPU generator's, then, when
// `device` is a CUDA device, that device's default CUDA generator's (its last `*cuda_bytes`
// bytes; 0 on CPU). Read under each generator's lock.
at::Tensor rng_state(const at::Device& device, int64_t* cuda_bytes);

// Restores a record of rng_state: the CPU generator always; the CUDA generator of `device` when
// the record has one (`cuda_bytes` > 0) and `device` is a CUDA device. Returns whether the CUDA
// generator was restored.
bool set_rng_state(const at::Tensor& state, int64_t cuda_bytes, const at::Device& device);

}  // namespace fsdp::detail
