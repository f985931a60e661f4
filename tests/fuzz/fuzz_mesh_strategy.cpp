// libFuzzer target: the mesh and strategy string parsers (parse_mesh_shape,
// parse_sharding_strategy, parse_grad_sync, parse_backend, parse_collective_algorithm), and a
// parsed mesh resolved against worlds of 1..16 ranks (MeshLayout::resolve, plan_sharding).
// Input: "STRATEGY\nMESH\n..." lines; the first byte also picks the world size.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fsdp/collectives.h"
#include "fsdp/mesh.h"
#include "fsdp/runtime.h"
#include "fsdp/strategy.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const auto nl = input.find('\n');
  const std::string strategy = input.substr(0, nl);
  const std::string mesh = nl == std::string::npos ? input : input.substr(nl + 1);
  using fsdp_fuzz::expect_ok_or_fsdp_error;
  expect_ok_or_fsdp_error("parse_sharding_strategy", [&] { fsdp::parse_sharding_strategy(strategy); });
  expect_ok_or_fsdp_error("parse_grad_sync", [&] { fsdp::parse_grad_sync(strategy); });
  expect_ok_or_fsdp_error("parse_backend", [&] { fsdp::parse_backend(strategy); });
  expect_ok_or_fsdp_error("parse_collective_algorithm",
                          [&] { fsdp::parse_collective_algorithm(strategy); });
  expect_ok_or_fsdp_error("parse_mesh_shape", [&] {
    auto shape = fsdp::parse_mesh_shape(mesh);
    const int64_t world = size ? 1 + data[0] % 16 : 4;
    expect_ok_or_fsdp_error("MeshLayout::resolve", [&] { fsdp::MeshLayout::resolve(shape, world); });
    expect_ok_or_fsdp_error("plan_sharding", [&] {
      fsdp::FSDPStrategy s;
      s.sharding_strategy(strategy).device_mesh(shape);
      fsdp::plan_sharding(s, world, 1 + (size > 1 ? data[1] % world : 0));
    });
  });
  return 0;
}
