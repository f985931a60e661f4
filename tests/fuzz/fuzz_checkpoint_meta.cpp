// libFuzzer target: a sharded checkpoint's meta.json reader (src/checkpoint/meta.h), the code
// that stands between a damaged or hostile checkpoint directory and every read of tensor data.
// Input: one mode byte, then the meta.json text. Mode bit 0 set: every file meta.json lists
// exists with the size it records (so the fuzzer reaches the tensor and chunk checks); clear:
// the files of the seed checkpoints exist with their real sizes and no other file does. The
// reader may reject the input only with fsdp::Error (fuzz_common.h); crashes, sanitizer reports
// and other exceptions are bugs. Nothing is read from or written to disk.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "checkpoint/meta.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return -1;
  const bool recorded_sizes = (data[0] & 1) != 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  // The files of tests/fuzz/corpus/fuzz_checkpoint_meta's checkpoints.
  std::map<std::string, int64_t> sizes = {
      {"shard-0.bin", 32976}, {"shard-1.bin", 32976}, {"rng.bin", 10112}};
  if (recorded_sizes) {
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("files") && j["files"].is_array()) {
      for (const auto& f : j["files"]) {
        if (f.is_object() && f.contains("name") && f["name"].is_string() && f.contains("bytes") &&
            f["bytes"].is_number_integer()) {
          sizes[f["name"].get<std::string>()] = f["bytes"].get<int64_t>();
        }
      }
    }
  }
  fsdp_fuzz::expect_ok_or_fsdp_error("checkpoint meta.json reader", [&] {
    fsdp::detail::parse_meta(text, "ck/step-00000001", [&](const std::string& name) {
      auto it = sizes.find(name);
      return it == sizes.end() ? int64_t(-1) : it->second;
    });
  });
  return 0;
}
