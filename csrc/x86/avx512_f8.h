// The AVX-512 (F/BW) exact e4m3fn -> bf16 decode: the unpack_f8 hook (mk_hooks.h) of the avx512,
// avx512_bf16 and amx_bf16 levels. Include only from a file compiled with at least the avx512
// level's flags (or emulated: avx512_common.h), inside that level's namespace (internal linkage).
//
// A table lookup, integer only (no MXCSR dependence): the 128 magnitudes' bf16 words (kF8Bf16,
// f8_table.h) are four zmm of 32 words. Per 32 codes, widened to words w: two vpermt2w look w's
// low 6 bits up in the lower and the upper 64 entries, bit 6 of w picks one (vptestmw + blend),
// and bit 7 (the sign) moves to bit 15 (vpternlogd). NaN codes give the table's NaN by
// construction.
#pragma once
#include "avx512_common.h"

namespace moepack {
namespace x86_avx512_f8 {
namespace {

struct F8Tables {
  __m512i t[4];  // kF8Bf16.v[32 j .. 32 j + 31], j = 0..3 (the positive codes)
  F8Tables() {
    for (int j = 0; j < 4; ++j) t[j] = _mm512_loadu_si512(kF8Bf16.v + 32 * j);
  }
};

// 32 codes (ymm bytes) -> 32 bf16 words, in order.
static inline __m512i f8_bf16_32(__m256i bytes, const F8Tables& T) {
  const __m512i w = _mm512_cvtepu8_epi16(bytes);
  const __m512i lo = _mm512_permutex2var_epi16(T.t[0], w, T.t[1]);  // index bits 0-5
  const __m512i hi = _mm512_permutex2var_epi16(T.t[2], w, T.t[3]);
  const __mmask32 up = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40));
  const __m512i v = _mm512_mask_blend_epi16(up, lo, hi);
  // v | (w << 8 & 0x8000): A | (B & C) = 0xF8
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(w, 8), _mm512_set1_epi16(int16_t(0x8000)), 0xF8);
}

// out[i] = kF8Bf16.v[codes[i]], i < n.
static inline void unpack_f8_avx512(const uint8_t* codes, int64_t n, uint16_t* out) {
  const F8Tables T;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    // the code stream 1 KiB ahead, into L2 (a slice's end: the block's next slice)
    _mm_prefetch(reinterpret_cast<const char*>(codes + i) + 1024, _MM_HINT_T1);
    const __m512i v = _mm512_loadu_si512(codes + i);
    _mm512_storeu_si512(out + i, f8_bf16_32(_mm512_castsi512_si256(v), T));
    _mm512_storeu_si512(out + i + 32, f8_bf16_32(_mm512_extracti64x4_epi64(v, 1), T));
  }
  for (; i < n; i += 32) {  // the tail: through a 32-code buffer
    const int64_t r = n - i < 32 ? n - i : 32;
    alignas(32) uint8_t c[32] = {};
    alignas(64) uint16_t o[32];
    std::memcpy(c, codes + i, size_t(r));
    _mm512_store_si512(o, f8_bf16_32(_mm256_load_si256(reinterpret_cast<const __m256i*>(c)), T));
    std::memcpy(out + i, o, size_t(r) * 2);
  }
}

}  // namespace
}  // namespace x86_avx512_f8
}  // namespace moepack
