// The AVX2 micro-kernels of the mxfp4 layout (mx4g32_n32k8_x86), shared by the AVX2-class levels
// (moe_avx2.cpp, moe_avx_vnni.cpp): the exact decode of a block's e2m1 codes to the dense bf16
// block (W4A16 unpack_mx4, avx2), the e8m0 scales as fp32, and the W4A8 block GEMM over an
// integer core the level supplies (vpmaddubsw here; vpdpbusd in avx2_mx4_vnni.h). Include only in
// a translation unit compiled with at least -mavx2 -mfma, after <immintrin.h>, inside that
// level's namespace (internal linkage).
//
// A K step of 8 codes of the block's 32 columns is 128 bytes = 4 ymm of 8 columns, one 32-bit lane
// per column whose byte b holds code b (low nibble) and code b + 4 (high nibble), as in the u4
// layouts (avx2_u4_common.h). Decoding goes through 16-entry vpshufb tables per nibble:
//  - A16: the low and the high byte of bf16(e2m1(q)) (two tables), interleaved into words by
//    vpunpck{l,h}bw and sorted into the dense block's K pairs by vshufps;
//  - A8: the unsigned byte 2 * e2m1(q) + 12 (0..24), vpmaddubsw's / vpdpbusd's unsigned operand
//    against the s8 rows; the exact integer sum is that dot product minus 12 * the row's sum.
#pragma once

#include <cstdint>
#include <cstring>

#include "moepack/kernel.h"

namespace moepack {
namespace x86_avx2_mx4 {
namespace {

constexpr int kMx4Group = 32;            // K values per e8m0 scale
constexpr int kMx4PrefetchBytes = 1024;  // the code stream's software prefetch distance
constexpr int kMx4U8Offset = 12;         // what the A8 table adds to 2 * e2m1(q)

static inline __m256i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// vpshufb tables (both 128-bit lanes the same): bf16(e2m1(q)) low bytes, high bytes, and the A8
// byte 2 * e2m1(q) + 12.
static inline __m256i mx4_bf16_lo_table() {
  return _mm256_setr_epi8(0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0), 0x00, 0x00, char(0x80),
                          char(0xC0), 0x00, 0x40, char(0x80), char(0xC0), 0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40,
                          char(0x80), char(0xC0), 0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0));
}
static inline __m256i mx4_bf16_hi_table() {
  return _mm256_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80), char(0xBF), char(0xBF), char(0xBF),
                          char(0xC0), char(0xC0), char(0xC0), char(0xC0), 0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40,
                          char(0x80), char(0xBF), char(0xBF), char(0xBF), char(0xC0), char(0xC0), char(0xC0), char(0xC0));
}
static inline __m256i mx4_u8_table() {
  return _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11,
                          10, 9, 8, 6, 4, 0);
}

// W4A16 unpack (kHook_unpack_mx4): K [k0, k0 + kk) (multiples of 8) of one mx4 block -> the dense
// bf16_n32k2 block of the unscaled e2m1 values, exact. Per ymm (8 columns) and nibble register
// (codes b of byte b): the bf16 bytes by table, vpunpcklbw -> per 128-bit lane the words of
// columns 0, 1 (codes 0..3 each: dwords (c0 c1), (c2 c3), ...), vpunpckhbw -> columns 2, 3; vshufps
// picks the pairs (c0 c1) and (c2 c3) of the four columns in order.
static inline void unpack_mx4_avx2(const uint8_t* codes, int64_t k0, int64_t kk, uint16_t* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), tl = mx4_bf16_lo_table(), th = mx4_bf16_hi_table();
  for (int64_t j = k0 / 8; j < (k0 + kk) / 8; ++j) {
    const __m256i* g = reinterpret_cast<const __m256i*>(codes + j * 128);
    _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes + 64, _MM_HINT_T1);
    uint16_t* o = out + (j * 8 - k0) / 2 * 64;  // pairs (j*8 - k0)/2 .. +3, 64 words (32 columns) each
    for (int q = 0; q < 4; ++q) {
      const __m256i v = _mm256_loadu_si256(g + q);
      for (int half = 0; half < 2; ++half) {  // codes 0..3 (pairs 0, 1), codes 4..7 (pairs 2, 3)
        const __m256i n = half ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
        const __m256i lb = _mm256_shuffle_epi8(tl, n), hb = _mm256_shuffle_epi8(th, n);
        const __m256 u0 = _mm256_castsi256_ps(_mm256_unpacklo_epi8(lb, hb));  // columns 4l, 4l+1 of lane l
        const __m256 u1 = _mm256_castsi256_ps(_mm256_unpackhi_epi8(lb, hb));  // columns 4l+2, 4l+3
        const __m256 p0 = _mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(2, 0, 2, 0));
        const __m256 p1 = _mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 1, 3, 1));
        _mm256_storeu_ps(reinterpret_cast<float*>(o + (2 * half) * 64 + 16 * q), p0);
        _mm256_storeu_ps(reinterpret_cast<float*>(o + (2 * half + 1) * 64 + 16 * q), p1);
      }
    }
  }
}

// fp32 2^(e - Bias) of 8 e8m0 bytes, exact (fp32 subnormals below the normal range).
template <int Bias>
static inline __m256 mx4_scale8(const uint8_t* e) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(Bias - 127)), 23);
  // below the normal range: 2^(e - Bias) = 2^-127 >> (Bias - 127 - e) (2^-127: mantissa bit 22)
  const __m256i sub = _mm256_srlv_epi32(_mm256_set1_epi32(0x00400000), _mm256_sub_epi32(_mm256_set1_epi32(Bias - 127), v));
  const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(Bias - 126), v);
  // e = 255 (e8m0 NaN: refused at convert and open) as the codec's e8m0_pow2 gives it: a quiet NaN
  const __m256i nan = _mm256_cmpeq_epi32(v, _mm256_set1_epi32(255));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(_mm256_blendv_epi8(normal, sub, low), _mm256_set1_epi32(0x7FC00000), nan));
}

// ---- W4A8 ---------------------------------------------------------------------------------
// The integer core with vpmaddubsw (the u8 weights 0..24 x s8 rows: each i16 pair at most
// 2 x 24 x 128, the two nibbles' pairs together 12288 in magnitude: exact) and vpmaddwd:
// acc[r][q] (columns 8q..8q+7) += sum over the K steps [j0, j1) of x . (2 * e2m1(q) + 12).
template <int MR>
struct Mx4AccMaddubs {
  void operator()(const int8_t* const* x, const uint8_t* codes, int64_t j0, int64_t j1, __m256i acc[][4]) const {
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), t = mx4_u8_table();
    for (int64_t j = j0; j < j1; ++j) {
      const __m256i* g = reinterpret_cast<const __m256i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes + 64, _MM_HINT_T0);
      for (int q = 0; q < 4; ++q) {
        const __m256i v = _mm256_loadu_si256(g + q);
        const __m256i lo = _mm256_shuffle_epi8(t, _mm256_and_si256(v, m4));
        const __m256i hi = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        for (int r = 0; r < MR; ++r) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast32(x[r] + 8 * j)),
                                             _mm256_maddubs_epi16(hi, bcast32(x[r] + 8 * j + 4)));
          acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_madd_epi16(p, ones));
        }
      }
    }
  }
};

static inline int32_t mx4_row_sum(const int8_t* x, int64_t k0, int64_t kk) {
  int32_t s = 0;
  for (int64_t k = k0; k < k0 + kk; ++k) s += x[k];
  return s;
}

// The exact integer core as the hook states it (kHook_dot_mx4_s8): acc[i * 32 + n] = sum over K
// [k0, k0 + kk) of rows[i][k] * 2 * e2m1(q[n][k]): the offset core less 12 * the row's sum.
template <template <int> class AccT>
static inline void dot_mx4_rows(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* out) {
  for (int i = 0; i < m; ++i) {
    __m256i acc[1][4] = {{_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()}};
    AccT<1>{}(x + i, codes, k0 / 8, (k0 + kk) / 8, acc);
    const __m256i off = _mm256_set1_epi32(kMx4U8Offset * mx4_row_sum(x[i], k0, kk));
    for (int q = 0; q < 4; ++q)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * 32 + 8 * q), _mm256_sub_epi32(acc[0][q], off));
  }
}

// The fused W4A8 block GEMM (kHook_gemm_mx4a8): per group g in order, C += float(acc_g) *
// 2^(e[g, n] - 128) with acc_g = the offset core - 12 * xsum[r * ng + g]; at the end C *= the
// row's activation scale (avx512_mx4_common.h's gemm_mx4a8_tile, 8 columns a register).
template <int MR, class Acc>
static inline void gemm_mx4a8_tile(const int8_t* const* x, const float* rs, const uint8_t* codes, const uint8_t* scale,
                                   int64_t gstride, int64_t kp, const int32_t* xsum, float* C, Acc acc_fn) {
  const int64_t ng = (kp + kMx4Group - 1) / kMx4Group;
  __m256 c[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < 4; ++q) c[r][q] = _mm256_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += kMx4Group) {
    const int64_t kend = k0 + kMx4Group < kp ? k0 + kMx4Group : kp;
    __m256i acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_setzero_si256();
    acc_fn(x, codes, k0 / 8, kend / 8, acc);
    const uint8_t* e = scale + g * gstride;
    for (int q = 0; q < 4; ++q) {
      const __m256 s = mx4_scale8<128>(e + 8 * q);
      for (int r = 0; r < MR; ++r) {
        const __m256i t = _mm256_sub_epi32(acc[r][q], _mm256_set1_epi32(kMx4U8Offset * xsum[r * ng + g]));
        c[r][q] = _mm256_add_ps(c[r][q], _mm256_mul_ps(_mm256_cvtepi32_ps(t), s));
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m256 a = _mm256_set1_ps(rs[r]);
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(C + r * 32 + 8 * q, _mm256_mul_ps(c[r][q], a));
  }
}

// Rows two at a time (the accumulators and the weights fill the 16 ymm), then one.
template <template <int> class AccT>
static inline void gemm_mx4a8_rows(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                                   int64_t gstride, int64_t kp, const int32_t* xsum, float* C) {
  const int64_t ng = (kp + kMx4Group - 1) / kMx4Group;
  int i = 0;
  for (; i + 2 <= m; i += 2) gemm_mx4a8_tile<2>(x + i, rs + i, codes, scale, gstride, kp, xsum + i * ng, C + i * 32, AccT<2>{});
  if (i < m) gemm_mx4a8_tile<1>(x + i, rs + i, codes, scale, gstride, kp, xsum + i * ng, C + i * 32, AccT<1>{});
}

}  // namespace
}  // namespace x86_avx2_mx4
}  // namespace moepack
