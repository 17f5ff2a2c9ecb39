// The AVX-512 BW int8 micro-kernels for layout i8_n32k4_x86 with SIGNED rows (no VNNI; the
// sign trick of moe_avx512.cpp's header comment), shared by the levels that have AVX-512 BW:
// avx512 (moe_avx512.cpp) and amx_int8 (moe_amx_int8.cpp: the rows and K tails its tiles do not
// cover). Include only inside that level's namespace (internal linkage).
#pragma once
#include "avx512_common.h"

namespace moepack {
namespace x86_avx512_i8 {
namespace {

using namespace x86_avx512;

static inline __m512i dot4(__m512i aw, __mmask64 neg, __m512i xb, __m512i ones) {
  const __m512i sx = _mm512_mask_sub_epi8(xb, neg, _mm512_setzero_si512(), xb);
  return _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), ones);
}

static inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(int(load_u32(p))); }

template <int MR>
static inline void gemm_i8_tile(const int8_t* const* x, const int8_t* B, int64_t kp, int32_t* C) {
  const __m512i ones = _mm512_set1_epi16(1);
  __m512i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  for (int64_t kq = 0; kq < kp / 4; ++kq, b += 2) {
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 1);
    const __m512i aw0 = _mm512_abs_epi8(w0), aw1 = _mm512_abs_epi8(w1);
    const __mmask64 n0 = _mm512_movepi8_mask(w0), n1 = _mm512_movepi8_mask(w1);
    for (int r = 0; r < MR; ++r) {
      const __m512i xr = bcast4(x[r] + 4 * kq);
      acc[r][0] = _mm512_add_epi32(acc[r][0], dot4(aw0, n0, xr, ones));
      acc[r][1] = _mm512_add_epi32(acc[r][1], dot4(aw1, n1, xr, ones));
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_si512(C + r * 32, acc[r][0]);
    _mm512_storeu_si512(C + r * 32 + 16, acc[r][1]);
  }
}

// One row: two K quads per step on separate accumulators (4 chains).
static inline void gemm_i8_row(const int8_t* x, const int8_t* B, int64_t kp, int32_t* C) {
  const __m512i ones = _mm512_set1_epi16(1);
  __m512i a[2][2];
  for (int u = 0; u < 2; ++u) a[u][0] = a[u][1] = _mm512_setzero_si512();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const int64_t nq = kp / 4;
  int64_t kq = 0;
  for (; kq + 2 <= nq; kq += 2, b += 4) {
    for (int u = 0; u < 2; ++u) {
      const __m512i xr = bcast4(x + 4 * (kq + u));
      const __m512i w0 = _mm512_loadu_si512(b + 2 * u), w1 = _mm512_loadu_si512(b + 2 * u + 1);
      a[u][0] = _mm512_add_epi32(a[u][0], dot4(_mm512_abs_epi8(w0), _mm512_movepi8_mask(w0), xr, ones));
      a[u][1] = _mm512_add_epi32(a[u][1], dot4(_mm512_abs_epi8(w1), _mm512_movepi8_mask(w1), xr, ones));
    }
  }
  for (; kq < nq; ++kq, b += 2) {
    const __m512i xr = bcast4(x + 4 * kq);
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 1);
    a[0][0] = _mm512_add_epi32(a[0][0], dot4(_mm512_abs_epi8(w0), _mm512_movepi8_mask(w0), xr, ones));
    a[0][1] = _mm512_add_epi32(a[0][1], dot4(_mm512_abs_epi8(w1), _mm512_movepi8_mask(w1), xr, ones));
  }
  _mm512_storeu_si512(C, _mm512_add_epi32(a[0][0], a[1][0]));
  _mm512_storeu_si512(C + 16, _mm512_add_epi32(a[0][1], a[1][1]));
}

// acc[m, 32] = exact int32 dot products of one 32-column int8 block with m signed rows.
static inline void gemm_i8_signed_rows(const int8_t* const* x, int m, const int8_t* B, int64_t kp, int32_t* C) {
  if (m == 1) return gemm_i8_row(x[0], B, kp, C);
  int i = 0;
  for (; i + 4 <= m; i += 4) gemm_i8_tile<4>(x + i, B, kp, C + i * 32);
  switch (m - i) {
    case 3: gemm_i8_tile<3>(x + i, B, kp, C + i * 32); break;
    case 2: gemm_i8_tile<2>(x + i, B, kp, C + i * 32); break;
    case 1: gemm_i8_row(x[i], B, kp, C + i * 32); break;
    default: break;
  }
}

}  // namespace
}  // namespace x86_avx512_i8
}  // namespace moepack
