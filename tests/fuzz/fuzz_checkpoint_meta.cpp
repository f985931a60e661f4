// libFuzzer target: a sharded checkpoint's meta.json reader (src/checkpoint/meta.h), the code
// that stands between a damaged or hostile checkpoint directory and every read of tensor data.
// Input: one mode byte, then the meta.json text. Mode bit 0 set: every file meta.json lists
// exists with the size it records (so the fuzzer reaches the tensor and chunk checks); clear:
// the files of the seed checkpoints exist with their real sizes and no other file does. The
// reader may reject the input only with fsdp::Error (fuzz_common.h); crashes, sanitizer reports
// and other exceptions are bugs. Mode bit 1 set (with bit 0), and the input accepted: the
// manifest mutation test (tests/manifest_mutations.h) on it — every edit of one entry (removed,
// doubled, reshaped, a chunk shifted or moved to another file, a rank dropped from the RNG),
// against the files the input records, must be refused; one accepted aborts, naming it. The
// seeds mutation_*.json are real fsdp-train checkpoints (W = 2 FULL_SHARD, HYBRID_SHARD (2, 2)).
// Nothing is read from or written to disk.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "checkpoint/meta.h"
#include "fuzz_common.h"
#include "manifest_mutations.h"

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
  const auto file_size = [&](const std::string& name) {
    auto it = sizes.find(name);
    return it == sizes.end() ? int64_t(-1) : it->second;
  };
  bool accepted = false;
  fsdp_fuzz::expect_ok_or_fsdp_error("checkpoint meta.json reader", [&] {
    fsdp::detail::parse_meta(text, "ck/step-00000001", file_size);
    accepted = true;
  });
  if (!accepted || (data[0] & 3) != 3) return 0;
  for (const auto& m : fsdp::testing::manifest_mutations(nlohmann::ordered_json::parse(text))) {
    bool refused = false;
    fsdp_fuzz::expect_ok_or_fsdp_error("checkpoint meta.json reader", [&] {
      try {
        fsdp::detail::parse_meta(m.meta.dump(), "ck/step-00000001", file_size);
      } catch (const fsdp::Error&) {
        refused = true;
        throw;
      }
    });
    if (!refused) {
      std::fprintf(stderr, "manifest mutation accepted: %s\n", m.what.c_str());
      std::abort();
    }
  }
  return 0;
}
