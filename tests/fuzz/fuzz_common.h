// Shared by the libFuzzer targets (docs/testing.md): the oracle. A parser may reject its input
// only with fsdp::Error (the project's one-line usage error); any other exception escaping it
// (std::out_of_range from a stoll, std::length_error, bad_alloc, ...) is a bug, reported by
// aborting so libFuzzer saves the input. Crashes, sanitizer reports and timeouts are bugs too.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <typeinfo>

#include "fsdp/error.h"

namespace fsdp_fuzz {

template <typename F>
void expect_ok_or_fsdp_error(const char* what, F&& f) {
  try {
    f();
  } catch (const fsdp::Error&) {
    // A usage error with a message: the intended way to reject input.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s threw %s instead of fsdp::Error: %s\n", what, typeid(e).name(),
                 e.what());
    std::abort();
  }
}

}  // namespace fsdp_fuzz
