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
// `nl`: the next block's lines this tile prefetches (NextLines).
template <int MR>
static inline void gemm_bf16_tile(const uint16_t* const* x, const uint16_t* B, int64_t kp, float* C, NextLines nl = {}) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const bool two = nl.lines > kp / 2;
  for (int64_t kk = 0; kk < kp / 2; ++kk, b += 2) {
    next_lines_step(nl, two);
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

// Few rows (decode): MR rows against S K segments streamed at once (for_k_streams), one set of
// accumulators per (row, segment), summed at the end.
template <int MR, int S>
static inline void gemm_bf16_streams(const uint16_t* const* x, const uint16_t* B, int64_t kp, float* C) {
  __m512 a[MR][S][2];
  for (int r = 0; r < MR; ++r)
    for (int u = 0; u < S; ++u) a[r][u][0] = a[r][u][1] = _mm512_setzero_ps();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  for_k_streams<S>(kp / 2, B, 128, 2, [&](int u, int64_t k) {
    const __m512bh w0 = as_bh(_mm512_loadu_si512(b + 2 * k)), w1 = as_bh(_mm512_loadu_si512(b + 2 * k + 1));
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512bh xr = as_bh(_mm512_set1_epi32(int(load_u32(x[r] + 2 * k))));
      a[r][u][0] = _mm512_dpbf16_ps(a[r][u][0], w0, xr);
      a[r][u][1] = _mm512_dpbf16_ps(a[r][u][1], w1, xr);
    }
  });
  for (int r = 0; r < MR; ++r) {
    __m512 s0 = a[r][0][0], s1 = a[r][0][1];
    for (int u = 1; u < S; ++u) {
      s0 = _mm512_add_ps(s0, a[r][u][0]);
      s1 = _mm512_add_ps(s1, a[r][u][1]);
    }
    _mm512_storeu_ps(C + r * 32, s0);
    _mm512_storeu_ps(C + r * 32 + 16, s1);
  }
}

// One bf16 row against two blocks at once (stage 1's gate and up: Variant::pair): two sequential
// streams, one K pair of each per step, each block's sums in gemm_bf16_streams<1, 1>'s order (so
// its bits); software prefetch only where the variant's pf says.
static inline void gemm_bf16_pair_row(const uint16_t* x, const uint16_t* Bg, const uint16_t* Bu, int64_t kp, float* Cg,
                                      float* Cu) {
  __m512 g0 = _mm512_setzero_ps(), g1 = g0, u0 = g0, u1 = g0;
  const __m512i* g = reinterpret_cast<const __m512i*>(Bg);
  const __m512i* u = reinterpret_cast<const __m512i*>(Bu);
  const int64_t pf = decode_prefetch_bytes(0);
  const bool nta = current_variant().nta != 0;
  for (int64_t kk = 0; kk < kp / 2; ++kk, g += 2, u += 2) {
    if (pf) {
      prefetch_lines(reinterpret_cast<const char*>(g) + pf, 2, nta);
      prefetch_lines(reinterpret_cast<const char*>(u) + pf, 2, nta);
    }
    const __m512bh xr = as_bh(_mm512_set1_epi32(int(load_u32(x + 2 * kk))));
    g0 = _mm512_dpbf16_ps(g0, as_bh(_mm512_loadu_si512(g)), xr);
    u0 = _mm512_dpbf16_ps(u0, as_bh(_mm512_loadu_si512(u)), xr);
    g1 = _mm512_dpbf16_ps(g1, as_bh(_mm512_loadu_si512(g + 1)), xr);
    u1 = _mm512_dpbf16_ps(u1, as_bh(_mm512_loadu_si512(u + 1)), xr);
  }
  _mm512_storeu_ps(Cg, g0);
  _mm512_storeu_ps(Cg + 16, g1);
  _mm512_storeu_ps(Cu, u0);
  _mm512_storeu_ps(Cu + 16, u1);
}

// The remainder row of a tiled call (m % 8 == 1): the block is in L2 after the tiles, so the 8
// accumulator chains of 4 segments win whatever decode_one_stream() says.
static inline void gemm_bf16_row(const uint16_t* x, const uint16_t* B, int64_t kp, float* C) {
  gemm_bf16_streams<1, 4>(&x, B, kp, C);
}

// C[m, 32] for one 32-column block of bf16 rows (row pointers), m <= kChunkM; the tiles prefetch
// `next` (the worker's next block) between them.
static inline void gemm_bf16_rows(const uint16_t* const* x, int m, const uint16_t* B, int64_t kp, float* C,
                                  NextLines next = {}) {
  if (m <= 4) {  // decode: one stream per block (decode_one_stream), else 4 or 2 K segments
    const bool one = decode_one_stream();
    switch (m) {
      case 1: return one ? gemm_bf16_streams<1, 1>(x, B, kp, C) : gemm_bf16_streams<1, 4>(x, B, kp, C);
      case 2: return one ? gemm_bf16_streams<2, 1>(x, B, kp, C) : gemm_bf16_streams<2, 4>(x, B, kp, C);
      case 3: return one ? gemm_bf16_streams<3, 1>(x, B, kp, C) : gemm_bf16_streams<3, 2>(x, B, kp, C);
      case 4: return one ? gemm_bf16_streams<4, 1>(x, B, kp, C) : gemm_bf16_streams<4, 2>(x, B, kp, C);
      default: break;
    }
  }
  const int tiles = (m + 7) / 8;
  int i = 0;
  for (; i + 8 <= m; i += 8) gemm_bf16_tile<8>(x + i, B, kp, C + i * 32, next.share(i / 8, tiles));
  const NextLines nl = next.share(i / 8, tiles);
  switch (m - i) {
    case 7: gemm_bf16_tile<7>(x + i, B, kp, C + i * 32, nl); break;
    case 6: gemm_bf16_tile<6>(x + i, B, kp, C + i * 32, nl); break;
    case 5: gemm_bf16_tile<5>(x + i, B, kp, C + i * 32, nl); break;
    case 4: gemm_bf16_tile<4>(x + i, B, kp, C + i * 32, nl); break;
    case 3: gemm_bf16_tile<3>(x + i, B, kp, C + i * 32, nl); break;
    case 2: gemm_bf16_tile<2>(x + i, B, kp, C + i * 32, nl); break;
    case 1: gemm_bf16_row(x[i], B, kp, C + i * 32); break;
    default: break;
  }
}

}  // namespace
}  // namespace x86_avx512_bf16
}  // namespace moepack
