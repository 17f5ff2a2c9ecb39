// The AVX-512 BF16 micro-kernels (vdpbf16ps) for layout bf16_n32k2_x86 with bf16 rows, shared by
// the levels that have AVX512_BF16: avx512_bf16 (moe_avx512_bf16.cpp) and amx_bf16
// (moe_amx_bf16.cpp: the rows and K tails its tiles do not cover). Include only from a file
// compiled with -mavx512bf16, inside that level's namespace (internal linkage).
#pragma once
#include "avx512_common.h"

namespace moepack {
namespace x86_avx512_bf16 {
namespace {

using namespace x86_avx512;

static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// ---- bf16 rows: vdpbf16ps ------------------------------------------------------------------
template <int MR>
static inline void gemm_bf16_tile(const uint16_t* const* x, const uint16_t* B, int64_t kp, float* C) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  for (int64_t kk = 0; kk < kp / 2; ++kk, b += 2) {
    const __m512bh w0 = as_bh(_mm512_loadu_si512(b)), w1 = as_bh(_mm512_loadu_si512(b + 1));
    for (int r = 0; r < MR; ++r) {
      const __m512bh xr = as_bh(_mm512_set1_epi32(int(load_u32(x[r] + 2 * kk))));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(C + r * 32, acc[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, acc[r][1]);
  }
}

// One row: four K pairs in flight on separate accumulators (8 chains).
static inline void gemm_bf16_row(const uint16_t* x, const uint16_t* B, int64_t kp, float* C) {
  __m512 a[4][2];
  for (int u = 0; u < 4; ++u) a[u][0] = a[u][1] = _mm512_setzero_ps();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const int64_t npairs = kp / 2;
  int64_t kk = 0;
  for (; kk + 4 <= npairs; kk += 4, b += 8) {
    prefetch_stream(b, 8);
    for (int u = 0; u < 4; ++u) {
      const __m512bh xr = as_bh(_mm512_set1_epi32(int(load_u32(x + 2 * (kk + u)))));
      a[u][0] = _mm512_dpbf16_ps(a[u][0], as_bh(_mm512_loadu_si512(b + 2 * u)), xr);
      a[u][1] = _mm512_dpbf16_ps(a[u][1], as_bh(_mm512_loadu_si512(b + 2 * u + 1)), xr);
    }
  }
  for (; kk < npairs; ++kk, b += 2) {
    const __m512bh xr = as_bh(_mm512_set1_epi32(int(load_u32(x + 2 * kk))));
    a[0][0] = _mm512_dpbf16_ps(a[0][0], as_bh(_mm512_loadu_si512(b)), xr);
    a[0][1] = _mm512_dpbf16_ps(a[0][1], as_bh(_mm512_loadu_si512(b + 1)), xr);
  }
  _mm512_storeu_ps(C, _mm512_add_ps(_mm512_add_ps(a[0][0], a[1][0]), _mm512_add_ps(a[2][0], a[3][0])));
  _mm512_storeu_ps(C + 16, _mm512_add_ps(_mm512_add_ps(a[0][1], a[1][1]), _mm512_add_ps(a[2][1], a[3][1])));
}

// C[m, 32] for one 32-column block of bf16 rows (row pointers), m <= kChunkM.
static inline void gemm_bf16_rows(const uint16_t* const* x, int m, const uint16_t* B, int64_t kp, float* C) {
  if (m == 1) return gemm_bf16_row(x[0], B, kp, C);
  int i = 0;
  for (; i + 8 <= m; i += 8) gemm_bf16_tile<8>(x + i, B, kp, C + i * 32);
  switch (m - i) {
    case 7: gemm_bf16_tile<7>(x + i, B, kp, C + i * 32); break;
    case 6: gemm_bf16_tile<6>(x + i, B, kp, C + i * 32); break;
    case 5: gemm_bf16_tile<5>(x + i, B, kp, C + i * 32); break;
    case 4: gemm_bf16_tile<4>(x + i, B, kp, C + i * 32); break;
    case 3: gemm_bf16_tile<3>(x + i, B, kp, C + i * 32); break;
    case 2: gemm_bf16_tile<2>(x + i, B, kp, C + i * 32); break;
    case 1: gemm_bf16_row(x[i], B, kp, C + i * 32); break;
    default: break;
  }
}

}  // namespace
}  // namespace x86_avx512_bf16
}  // namespace moepack
