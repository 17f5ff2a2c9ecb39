// The W4A16 tile kernel of the mxfp4 layout for the amx_bf16 level (moe_amx_bf16.cpp): many bf16
// rows against one mx4 block through tdpbf16ps over the whole K at once. Include only from a file
// compiled with the amx_bf16 level's flags, inside that level's namespace (internal linkage).
//
// The per-group scale is folded into the decoded weights where that is exact and changes nothing
// the tiles see: for a code value v != 0 and e8m0 e, bf16 bits of v * 2^(e - 127) are bits(v) +
// ((e - 127) << 7) whenever the result is a normal bf16 (e >= 2). The kernel takes a block only
// when every scale of it lies in [kMx4FoldMinE, kMx4FoldMaxE] (|scaled weight| in [2^-64, 2^64]):
// then no product with a row value above 2^-60 in magnitude leaves fp32's normal range (the tiles
// flush subnormals, as they do for the unscaled values), and the result is the contract's sum up
// to the fp32 summation order. Any other block (extreme scales: the exact per-group path, which
// never folds a scale) and K not a multiple of 32 are left to the grouped-decode path (false).
#pragma once
#include "amx_common.h"
#include "avx512_mx4_common.h"

namespace moepack {
namespace x86_avx512_mx4_amx {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_mx4;
using namespace x86_amx;

MOEPACK_AMX_DP(Mx4DpBf16, _tile_dpbf16ps);

constexpr int kMx4FoldMinE = 64, kMx4FoldMaxE = 187;
constexpr int64_t kMx4TileStepK = 256;  // K decoded per tile pass (16 KiB of bf16)
constexpr int kMx4TileMaxRows = 64;

// Whether every e8m0 scale of the block's ng groups lies in [kMx4FoldMinE, kMx4FoldMaxE].
static inline bool mx4_scales_fold(const uint8_t* scale, int64_t gstride, int64_t ng) {
  __m256i lo = _mm256_set1_epi8(char(0xFF)), hi = _mm256_setzero_si256();
  for (int64_t g = 0; g < ng; ++g) {
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * gstride));
    lo = _mm256_min_epu8(lo, e);
    hi = _mm256_max_epu8(hi, e);
  }
  alignas(32) uint8_t l[32], h[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), hi);
  for (int i = 0; i < 32; ++i)
    if (l[i] < kMx4FoldMinE || h[i] > kMx4FoldMaxE) return false;
  return true;
}

// K [k0, k0 + kk) (whole groups) of one mx4 block -> the dense bf16_n32k2 block of the scaled
// values e2m1(q) * 2^(e - 127), exact for the scales mx4_scales_fold admits: each nonzero word's
// exponent field gets e - 127 added (±0 stays).
static inline void unpack_mx4_scaled(const uint8_t* codes, const uint8_t* scale, int64_t gstride, int64_t k0, int64_t kk,
                                     uint16_t* out) {
  const __m512i table = mx4_bf16_table(), i01 = mx4_idx01(), i23 = mx4_idx23();
  const __m512i mag = _mm512_set1_epi16(0x7FFF), bias = _mm512_set1_epi32(127), lo16 = _mm512_set1_epi32(0xFFFF);
  for (int64_t g = k0 / kMx4Group; g < (k0 + kk) / kMx4Group; ++g) {
    __m512i d[2];  // per column half: (e - 127) << 7 in both words of each column's lane
    for (int h = 0; h < 2; ++h) {
      const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + g * gstride + 16 * h)));
      const __m512i t = _mm512_and_si512(_mm512_slli_epi32(_mm512_sub_epi32(e, bias), 7), lo16);
      d[h] = _mm512_or_si512(t, _mm512_slli_epi32(t, 16));
    }
    for (int64_t j = g * (kMx4Group / 8); j < (g + 1) * (kMx4Group / 8); ++j) {
      const __m512i* src = reinterpret_cast<const __m512i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(src) + kMx4PrefetchBytes, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(src) + kMx4PrefetchBytes + 64, _MM_HINT_T1);
      __m512i* o = reinterpret_cast<__m512i*>(out + (j * 8 - k0) / 2 * 64);
      for (int h = 0; h < 2; ++h) {
        __m512i p[4];
        mx4_pairs(_mm512_loadu_si512(src + h), table, i01, i23, p);
        for (int i = 0; i < 4; ++i) {
          const __mmask32 nz = _mm512_test_epi16_mask(p[i], mag);
          _mm512_storeu_si512(o + 2 * i + h, _mm512_mask_add_epi16(p[i], nz, p[i], d[h]));
        }
      }
    }
  }
}

// C[m, 32] = rows . (e2m1(q) * 2^(e - 127)) for bf16 rows that are one matrix (row i at x[0] +
// i * stride, stride >= kp), 2 <= m <= kMx4TileMaxRows, kp % 32 == 0 and scales that fold; false
// (nothing written) otherwise.
static inline bool gemm_mx4a16_amx(const uint16_t* const* x, int m, const uint8_t* codes, const uint8_t* scale,
                                   int64_t gstride, int64_t kp, float* C) {
  if (m < 2 || m > kMx4TileMaxRows || kp % kMx4Group) return false;
  const int64_t stride = x[1] - x[0];
  if (stride < kp || x[m - 1] != x[0] + int64_t(m - 1) * stride) return false;
  if (!mx4_scales_fold(scale, gstride, kp / kMx4Group)) return false;
  alignas(64) uint16_t w[kMx4TileStepK * 32];
  TileState local;
  TileState& tiles = tile_state(local);
  for (int64_t k1 = 0; k1 < kp; k1 += kMx4TileStepK) {
    const int64_t kk = kp - k1 < kMx4TileStepK ? kp - k1 : kMx4TileStepK;  // whole groups: kk / 2 pairs, a multiple of 16
    unpack_mx4_scaled(codes, scale, gstride, k1, kk, w);
    tile_rows<Mx4DpBf16>(tiles, reinterpret_cast<const char*>(x[0] + k1), stride * 2, m, reinterpret_cast<const char*>(w),
                         kk / 2, k1 != 0, C);
  }
  return true;
}

}  // namespace
}  // namespace x86_avx512_mx4_amx
}  // namespace moepack
