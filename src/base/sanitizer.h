// sanitizer.h (internal): whether this build runs under a sanitizer that replaces malloc
// (AddressSanitizer or ThreadSanitizer; GCC defines __SANITIZE_*, clang has __has_feature). Their
// allocators do not use glibc's arenas: mallinfo2 sees no heap (and, racing a thread that creates
// an arena, can crash) and mallopt steers nothing. Used by process_memory and the tests.
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FSDP_SANITIZER_ALLOCATOR 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FSDP_SANITIZER_ALLOCATOR 1
#endif
#endif

namespace fsdp::detail {

#if defined(FSDP_SANITIZER_ALLOCATOR)
inline constexpr bool kSanitizerAllocator = true;
#else
inline constexpr bool kSanitizerAllocator = false;
#endif

}  // namespace fsdp::detail
