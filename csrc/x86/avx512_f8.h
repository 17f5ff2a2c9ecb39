// The AVX-512 (F/BW) exact e4m3fn -> bf16 decode: the unpack_f8 hook (mk_hooks.h) of the avx512,
// avx512_bf16 and amx_bf16 levels. Include only from a file compiled with at least the avx512
// level's flags (or emulated: avx512_common.h), inside that level's namespace (internal linkage).
//
// A table lookup, integer only (no MXCSR dependence), so NaN codes give the table's NaN by
// construction. AVX-512 F/BW: the 128 magnitudes' bf16 words (kF8Bf16, f8_table.h) are four zmm
// of 32 words; per 32 codes, widened to words w, two vpermt2w look w's low 6 bits up in the lower
// and the upper 64 entries, bit 6 of w picks one (vptestmw + blend), and bit 7 (the sign) moves
// to bit 15 (vpternlogd). Where the file is compiled with AVX512_VBMI: byte tables (below); where
// not, the byte tables are still defined (a target pragma) for avx512_f8_bf16.h's run-time choice.
#pragma once
#include "avx512_common.h"

namespace moepack {
namespace x86_avx512_f8 {
namespace {

// The word tables (AVX-512 F/BW): per 32 codes widened to words w, two vpermt2w look w's low 6
// bits up in the lower and the upper 64 entries, bit 6 of w picks one (vptestmw + blend), and
// bit 7 (the sign) moves to bit 15 (vpternlogd).
struct F8WordTables {
  __m512i t[4];  // kF8Bf16.v[32 j .. 32 j + 31], j = 0..3 (the positive codes)
  F8WordTables() {
    for (int j = 0; j < 4; ++j) t[j] = _mm512_loadu_si512(kF8Bf16.v + 32 * j);
  }
};
// 32 codes (ymm bytes) -> 32 bf16 words, in order.
static inline __m512i f8w_bf16_32(__m256i bytes, const F8WordTables& T) {
  const __m512i w = _mm512_cvtepu8_epi16(bytes);
  const __m512i lo = _mm512_permutex2var_epi16(T.t[0], w, T.t[1]);  // index bits 0-5
  const __m512i hi = _mm512_permutex2var_epi16(T.t[2], w, T.t[3]);
  const __mmask32 up = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40));
  const __m512i v = _mm512_mask_blend_epi16(up, lo, hi);
  // v | (w << 8 & 0x8000): A | (B & C) = 0xF8
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(w, 8), _mm512_set1_epi16(int16_t(0x8000)), 0xF8);
}
// 64 codes -> 64 bf16 words, in order (out[0]: codes 0-31, out[1]: 32-63).
static inline void f8w_bf16_64(__m512i v, const F8WordTables& T, __m512i out[2]) {
  out[0] = f8w_bf16_32(_mm512_castsi512_si256(v), T);
  out[1] = f8w_bf16_32(_mm512_extracti64x4_epi64(v, 1), T);
}

#if !defined(MOEPACK_EMULATE_AVX512)
// The byte tables (AVX512_VBMI): a byte-table lookup of the low and the high byte of the 128
// magnitudes' bf16 words (vpermt2b indexes 128 bytes by bits 0-6 of each code: the sign is
// ignored), the sign or-ed into the high byte (vpternlogd), and the bytes interleaved into words
// (vpunpcklbw / vpunpckhbw, which work within 128-bit lanes: the codes are first permuted
// (vpermb) so that the words come out in order). 5 shuffles per 64 codes, where the word tables
// take 8 (and the widening): ~1.6x the decode rate (docs/KERNELS.md). Where the file is not
// compiled with AVX512_VBMI (the avx512_bf16 level) these functions alone are (a target pragma),
// for the few-row kernel's copy that runs where the CPU has VBMI (avx512_f8_bf16.h).
#define MOEPACK_F8_HAVE_BYTES 1
#ifndef __AVX512VBMI__
#pragma GCC push_options
#pragma GCC target("avx512vbmi")
#define MOEPACK_F8_VBMI_REGION
#endif
struct F8ByteTables {
  __m512i lo0, lo1, hi0, hi1, perm;
  F8ByteTables() {
    alignas(64) uint8_t lo[128], hi[128], p[64];
    for (int i = 0; i < 128; ++i) lo[i] = uint8_t(kF8Bf16.v[i] & 0xFF), hi[i] = uint8_t(kF8Bf16.v[i] >> 8);
    // lane j of the unpacks: bytes 16 j .. 16 j + 7 -> words 8 j .. (low), 16 j + 8 .. -> words 32 + 8 j .. (high)
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 8; ++i) p[16 * j + i] = uint8_t(8 * j + i), p[16 * j + 8 + i] = uint8_t(32 + 8 * j + i);
    lo0 = _mm512_load_si512(lo), lo1 = _mm512_load_si512(lo + 64);
    hi0 = _mm512_load_si512(hi), hi1 = _mm512_load_si512(hi + 64);
    perm = _mm512_load_si512(p);
  }
};
// 64 codes -> 64 bf16 words in the unpacks' order: out[0] holds the words of codes 16 j .. 16 j + 7
// and out[1] those of 16 j + 8 .. 16 j + 15 in 128-bit lane j (each 32-bit lane: two consecutive
// codes, as they were paired). The few-row kernel takes them so and reorders its sums once.
static inline void f8b_bf16_64_lanes(__m512i c, const F8ByteTables& T, __m512i out[2]) {
  const __m512i lo = _mm512_permutex2var_epi8(T.lo0, c, T.lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(T.hi0, c, T.hi1), c, _mm512_set1_epi8(char(0x80)), 0xF8);
  out[0] = _mm512_unpacklo_epi8(lo, hi);
  out[1] = _mm512_unpackhi_epi8(lo, hi);
}
// 64 codes -> 64 bf16 words, in order (out[0]: codes 0-31, out[1]: 32-63).
static inline void f8b_bf16_64(__m512i v, const F8ByteTables& T, __m512i out[2]) {
  f8b_bf16_64_lanes(_mm512_permutexvar_epi8(T.perm, v), T, out);
}
#ifdef MOEPACK_F8_VBMI_REGION
#pragma GCC pop_options
#undef MOEPACK_F8_VBMI_REGION
#endif
#endif

// The level's own decode: the byte tables where the file is compiled with AVX512_VBMI (the
// amx_bf16 level requires it), else the word tables.
#if defined(__AVX512VBMI__) && !defined(MOEPACK_EMULATE_AVX512)
constexpr bool kF8Vbmi = true;
using F8Tables = F8ByteTables;
static inline void f8_bf16_64(__m512i v, const F8Tables& T, __m512i out[2]) { f8b_bf16_64(v, T, out); }
#else
constexpr bool kF8Vbmi = false;
using F8Tables = F8WordTables;
static inline void f8_bf16_64(__m512i v, const F8Tables& T, __m512i out[2]) { f8w_bf16_64(v, T, out); }
#endif

// out[i] = kF8Bf16.v[codes[i]], i < n.
static inline void unpack_f8_avx512(const uint8_t* codes, int64_t n, uint16_t* out) {
  const F8Tables T;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    // the code stream 1 KiB ahead, into L2 (a slice's end: the block's next slice)
    _mm_prefetch(reinterpret_cast<const char*>(codes + i) + 1024, _MM_HINT_T1);
    __m512i w[2];
    f8_bf16_64(_mm512_loadu_si512(codes + i), T, w);
    _mm512_storeu_si512(out + i, w[0]);
    _mm512_storeu_si512(out + i + 32, w[1]);
  }
  if (i < n) {  // the tail: through a 64-code buffer
    alignas(64) uint8_t c[64] = {};
    alignas(64) uint16_t o[64];
    std::memcpy(c, codes + i, size_t(n - i));
    __m512i w[2];
    f8_bf16_64(_mm512_load_si512(c), T, w);
    _mm512_store_si512(o, w[0]);
    _mm512_store_si512(o + 32, w[1]);
    std::memcpy(out + i, o, size_t(n - i) * 2);
  }
}

}  // namespace
}  // namespace x86_avx512_f8
}  // namespace moepack
