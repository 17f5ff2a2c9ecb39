// [NOTE] Software prefetch of whole lines with the hint the call's variant picks (kernel.h
// Variant::nta: T0, or the non-temporal hint), shared by the AVX2 and AVX-512 decode kernels. SSE's
// prefetch instructions: any x86 level. Internal linkage, like every kernel helper.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace moepack {
namespace x86_prefetch {
namespace {

// `lines` 64-byte lines from p on.
static inline void prefetch_lines(const char* p, int64_t lines, bool nta) {
  if (nta) {
    for (int64_t i = 0; i < lines; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_NTA);
  } else {
    for (int64_t i = 0; i < lines; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T0);
  }
}

}  // namespace
}  // namespace x86_prefetch
}  // namespace moepack
