// The AVX2 micro-kernels of the int4_group layouts (u4*_n32k8_x86), shared by the AVX2-class
// levels (moe_avx2.cpp, moe_avx_vnni.cpp): the W4A8 fused block GEMM over an integer core the
// level supplies (vpmaddubsw on avx2, vpdpbusd on avx_vnni), and, for avx2, the W4A16 kernels
// with fp32 rows: a decode kernel straight from the codes and the SIMD unpack to dense bf16
// blocks for more rows. Include only in a translation unit compiled with at least -mavx2 -mfma,
// after <immintrin.h>, inside that level's namespace (internal linkage).
//
// A u4 block's K group of 8 codes of 32 columns is 128 bytes = 4 ymm of 8 columns, one 32-bit lane
// per column whose byte j holds code j (low nibble) and code j + 4 (high nibble): `v & 0x0F`
// gives each lane the u8 codes 0..3, `(v >> 4) & 0x0F` codes 4..7 (docs/KERNELS.md).
#pragma once

#include <cstdint>
#include <cstring>

#include "moepack/kernel.h"

namespace moepack {
namespace x86_avx2_u4 {
namespace {

constexpr int kU4PrefetchBytes = 1024;  // as the AVX-512 u4 kernels: the block's code stream

static inline __m256i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The W4A8 integer core with vpmaddubsw (u4 codes as the unsigned operand, s8 rows; each i16
// pair at most 2 x 15 x 128, the sum of the low- and high-nibble pairs at most 7680: exact) and
// vpmaddwd: acc[r][q] (columns 8q..8q+7) += the K groups [j0, j1) of the block.
template <int MR>
struct AccMaddubsU4 {
  void operator()(const int8_t* const* x, const uint8_t* codes, int64_t j0, int64_t j1, __m256i acc[][4]) const {
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t j = j0; j < j1; ++j) {
      const __m256i* g = reinterpret_cast<const __m256i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(g) + kU4PrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g) + kU4PrefetchBytes + 64, _MM_HINT_T0);
      for (int q = 0; q < 4; ++q) {
        const __m256i v = _mm256_loadu_si256(g + q);
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        for (int r = 0; r < MR; ++r) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast32(x[r] + 8 * j)),
                                             _mm256_maddubs_epi16(hi, bcast32(x[r] + 8 * j + 4)));
          acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_madd_epi16(p, ones));
        }
      }
    }
  }
};

// The fused W4A8 block GEMM (docs/SEMANTICS.md §3, moepack/reference.py int4_linear_a8_reference):
// per group g, C += float(acc_g - z[g, n] * sum_g(x)) * s[g, n]; at the end C *= the row's
// activation scale; sum_g(x) is xsum[r * ng + g], given (the driver's A8RowSums: summed
// once per row, not per block). Acc(x, codes, j0, j1, acc) adds the K groups [j0, j1) into acc[MR][4].
template <int MR, class Acc>
static inline void gemm_u4a8_tile(const int8_t* const* x, const float* rs, const uint8_t* codes, const float* scale,
                                  const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum, float* C,
                                  Acc acc_fn) {
  const int64_t ng = (kp + G - 1) / G;
  __m256 c[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < 4; ++q) c[r][q] = _mm256_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kk = (k0 + G < kp ? k0 + G : kp) - k0;
    __m256i acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_setzero_si256();
    acc_fn(x, codes, k0 / 8, (k0 + kk) / 8, acc);
    const uint8_t* z = zero + g * gstride;
    const float* s = scale + g * gstride;
    for (int r = 0; r < MR; ++r) {
      const __m256i xs = _mm256_set1_epi32(xsum[r * ng + g]);
      for (int q = 0; q < 4; ++q) {
        const __m256i zq = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + 8 * q)));
        const __m256i t = _mm256_sub_epi32(acc[r][q], _mm256_mullo_epi32(zq, xs));
        c[r][q] = _mm256_add_ps(c[r][q], _mm256_mul_ps(_mm256_cvtepi32_ps(t), _mm256_loadu_ps(s + 8 * q)));
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m256 a = _mm256_set1_ps(rs[r]);
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(C + r * 32 + 8 * q, _mm256_mul_ps(c[r][q], a));
  }
}

// Rows two at a time (the accumulators and the row broadcasts fill the 16 ymm), then one.
template <template <int> class AccT>
static inline void gemm_u4a8_rows(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const float* scale,
                                  const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum, float* C) {
  const int64_t ng = (kp + G - 1) / G;
  int i = 0;
  for (; i + 2 <= m; i += 2) gemm_u4a8_tile<2>(x + i, rs + i, codes, scale, zero, gstride, kp, G, xsum + i * ng, C + i * 32, AccT<2>{});
  if (i < m) gemm_u4a8_tile<1>(x + i, rs + i, codes, scale, zero, gstride, kp, G, xsum + i * ng, C + i * 32, AccT<1>{});
}

// The integer core as the test hook sees it (U4BlockDotFn): acc[i * 32 + n] over K [k0, k0 + kk).
template <template <int> class AccT>
static inline void dot_u4_rows(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* out) {
  for (int i = 0; i < m; ++i) {
    __m256i acc[1][4] = {{_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()}};
    AccT<1>{}(x + i, codes, k0 / 8, (k0 + kk) / 8, acc);
    for (int q = 0; q < 4; ++q) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * 32 + 8 * q), acc[0][q]);
  }
}

// ---- W4A16 with fp32 rows (avx2) -------------------------------------------------------------

// The 8 codes of one K group of 8 columns (ymm v) minus their zero points (zq: the 8 columns'
// zero points as int32) as exact fp32, in K order: code b (b < 4) is byte b's low nibble, code 4 + b its
// high nibble.
static inline void u4_codes_f32(__m256i v, __m256i zq, __m256 out[8]) {
  const __m256i m4 = _mm256_set1_epi32(0x0F);
  for (int b = 0; b < 4; ++b) {
    out[b] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 8 * b), m4), zq));
    out[4 + b] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 8 * b + 4), m4), zq));
  }
}

// One fp32 row (decode) against one u4 block without a dense intermediate: per K group the exact
// (q - z) as fp32 (u4_codes_f32), FMAs with the row's K values broadcast, two accumulators per 8
// columns (low and high nibbles: 8 FMA chains), the group's scale applied once per group:
// C += (x . (q - z)) * s[g, n]. (Folding z in afterwards with the row's group sum, as the
// AVX-512 decode kernel does for bf16 rows, loses ~1e-6 of an fp32 row to cancellation.)
static inline void gemm_u4a16_f32_row(const float* x, const uint8_t* codes, const float* scale, const uint8_t* zero,
                                      int64_t gstride, int64_t kp, int64_t G, float* C) {
  __m256 c[4];
  for (int q = 0; q < 4; ++q) c[q] = _mm256_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    const uint8_t* z = zero + g * gstride;
    __m256i zq[4];
    for (int q = 0; q < 4; ++q) zq[q] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + 8 * q)));
    __m256 a[4][2];
    for (int q = 0; q < 4; ++q) a[q][0] = a[q][1] = _mm256_setzero_ps();
    for (int64_t j = k0 / 8; j < kend / 8; ++j) {
      const __m256i* blk = reinterpret_cast<const __m256i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kU4PrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kU4PrefetchBytes + 64, _MM_HINT_T0);
      const float* xj = x + 8 * j;
      for (int q = 0; q < 4; ++q) {
        __m256 w[8];
        u4_codes_f32(_mm256_loadu_si256(blk + q), zq[q], w);
        for (int b = 0; b < 4; ++b) {
          a[q][0] = _mm256_fmadd_ps(w[b], _mm256_broadcast_ss(xj + b), a[q][0]);
          a[q][1] = _mm256_fmadd_ps(w[4 + b], _mm256_broadcast_ss(xj + 4 + b), a[q][1]);
        }
      }
    }
    const float* s = scale + g * gstride;
    for (int q = 0; q < 4; ++q) c[q] = _mm256_fmadd_ps(_mm256_add_ps(a[q][0], a[q][1]), _mm256_loadu_ps(s + 8 * q), c[q]);
  }
  for (int q = 0; q < 4; ++q) _mm256_storeu_ps(C + 8 * q, c[q]);
}

// W4A16 unpack: K values [k0, k0 + kk) (multiples of 8) of one u4 block -> the dense bf16_n32k2
// block of (q - z[n]) (exactly the portable unpack_u4's values and order): (q - z) is an integer
// in -15..15, so its fp32 conversion is exact and its bf16 bits are the top half of the fp32's;
// a pair word (k, k + 1) of a column is (f32(d_k) >> 16) | (f32(d_k+1) & 0xffff0000).
static inline void unpack_u4_avx2(const uint8_t* codes, int64_t k0, int64_t kk, const uint8_t* z, uint16_t* out) {
  const __m256i m4 = _mm256_set1_epi32(0x0F), hi = _mm256_set1_epi32(int(0xffff0000u));
  __m256i zq[4];
  for (int q = 0; q < 4; ++q) zq[q] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(z + 8 * q)));
  for (int64_t j = k0 / 8; j < (k0 + kk) / 8; ++j) {
    const __m256i* g = reinterpret_cast<const __m256i*>(codes + j * 128);
    uint16_t* o = out + (j * 8 - k0) / 2 * 64;  // pairs (j*8 - k0)/2 .. +3, 64 words (32 columns) each
    for (int q = 0; q < 4; ++q) {
      const __m256i v = _mm256_loadu_si256(g + q);
      __m256i d[8];  // fp32 bits of (code k - z), k = 0..7 of the group, columns 8q..8q+7
      for (int b = 0; b < 4; ++b) {
        d[b] = _mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 8 * b), m4), zq[q])));
        d[4 + b] = _mm256_castps_si256(
            _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 8 * b + 4), m4), zq[q])));
      }
      for (int p = 0; p < 4; ++p) {
        const __m256i w = _mm256_or_si256(_mm256_srli_epi32(d[2 * p], 16), _mm256_and_si256(d[2 * p + 1], hi));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + p * 64 + 16 * q), w);
      }
    }
  }
}

}  // namespace
}  // namespace x86_avx2_u4
}  // namespace moepack
