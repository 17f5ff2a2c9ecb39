// The W4A8 integer core of the mxfp4 layout with the VEX vpdpbusd on ymm, for the avx_vnni level
// (moe_avx_vnni.cpp). Include only in a translation unit compiled with -mavx2 -mfma -mavxvnni (or
// with MOEPACK_EMULATE_AVX_VNNI: SIMDe's portable vpdpbusd, same semantics), after <immintrin.h>
// and avx2_mx4_common.h, inside that level's namespace (internal linkage).
//
// vpdpbusd takes the decoded weights 2 * e2m1(q) + 12 (0..24) as its unsigned operand and the
// row's 4 s8 codes broadcast as its signed one, adding the four products of a lane into its int32
// without saturating: exact (avx2_mx4_common.h subtracts 12 * the row's group sum).
#pragma once
#if defined(MOEPACK_EMULATE_AVX_VNNI)
#include <simde/x86/avx512/dpbusd.h>
#endif
#include "avx2_mx4_common.h"

namespace moepack {
namespace x86_avx2_mx4 {
namespace {

static inline __m256i mx4_dpbusd(__m256i acc, __m256i u8, __m256i s8) {
#if defined(MOEPACK_EMULATE_AVX_VNNI)
  return simde_mm256_dpbusd_epi32(acc, u8, s8);
#else
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}

// acc[r][q] (columns 8q..8q+7) += sum over the K steps [j0, j1) of x . (2 * e2m1(q) + 12); one row
// keeps the high nibbles in their own accumulators (8 chains).
template <int MR>
struct Mx4AccVnni {
  void operator()(const int8_t* const* x, const uint8_t* codes, int64_t j0, int64_t j1, __m256i acc[][4]) const {
    const __m256i m4 = _mm256_set1_epi8(0x0F), t = mx4_u8_table();
    __m256i ah[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < 4; ++q) ah[r][q] = _mm256_setzero_si256();
    for (int64_t j = j0; j < j1; ++j) {
      const __m256i* g = reinterpret_cast<const __m256i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes + 64, _MM_HINT_T0);
      for (int q = 0; q < 4; ++q) {
        const __m256i v = _mm256_loadu_si256(g + q);
        const __m256i lo = _mm256_shuffle_epi8(t, _mm256_and_si256(v, m4));
        const __m256i hi = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        for (int r = 0; r < MR; ++r) {
          acc[r][q] = mx4_dpbusd(acc[r][q], lo, bcast32(x[r] + 8 * j));
          if constexpr (MR == 1) {
            ah[r][q] = mx4_dpbusd(ah[r][q], hi, bcast32(x[r] + 8 * j + 4));
          } else {
            acc[r][q] = mx4_dpbusd(acc[r][q], hi, bcast32(x[r] + 8 * j + 4));
          }
        }
      }
    }
    if constexpr (MR == 1) {
      for (int q = 0; q < 4; ++q) acc[0][q] = _mm256_add_epi32(acc[0][q], ah[0][q]);
    }
  }
};

}  // namespace
}  // namespace x86_avx2_mx4
}  // namespace moepack
