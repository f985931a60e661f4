// libFuzzer target: a PyTorch distributed checkpoint's .metadata reader (src/dcp/metadata.h and
// the pickle machine under it, src/dcp/pickle.h), the code between a hostile checkpoint and any
// read of its .distcp files. The input is the .metadata's bytes. The reader may reject it only
// with fsdp::Error (fuzz_common.h); crashes, sanitizer reports and other exceptions are bugs.
// An accepted input must survive a round trip: written again by dcp_metadata_bytes (what
// export_dcp writes), it parses to the same items, chunks and storage. Seeds: one .metadata
// PyTorch 2.6 wrote (protocol 4, memo, bytes items, a PosixPath) and one of export_dcp's.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "dcp/metadata.h"
#include "fuzz_common.h"

namespace {

bool same(const fsdp::detail::DcpMetadata& a, const fsdp::detail::DcpMetadata& b) {
  if (a.items.size() != b.items.size()) return false;
  for (size_t i = 0; i < a.items.size(); ++i) {
    const auto& x = a.items[i];
    const auto& y = b.items[i];
    if (x.key != y.key || x.tensor != y.tensor || x.size != y.size ||
        x.chunks.size() != y.chunks.size() || (x.tensor && x.dtype != y.dtype)) {
      return false;
    }
    for (size_t c = 0; c < x.chunks.size(); ++c) {
      const auto& p = x.chunks[c];
      const auto& q = y.chunks[c];
      if (p.offsets != q.offsets || p.sizes != q.sizes || p.file != q.file ||
          p.offset != q.offset || p.length != q.length) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  fsdp_fuzz::expect_ok_or_fsdp_error("parse_dcp_metadata", [&] {
    const auto m = fsdp::detail::parse_dcp_metadata(bytes, "fuzz .metadata");
    const auto again = fsdp::detail::parse_dcp_metadata(fsdp::detail::dcp_metadata_bytes(m),
                                                        "rewritten .metadata");
    if (!same(m, again)) {
      std::fprintf(stderr, "a .metadata read, written and read again changed\n");
      std::abort();
    }
  });
  return 0;
}
