// The W8A16 decode kernel of the fp8_block layouts with vdpbf16ps, shared by the levels that have
// AVX512_BF16 (avx512_bf16, amx_bf16): the gemm_f8a16 hook (mk_hooks.h) for a few bf16 rows.
// Include only from a file compiled with -mavx512bf16, inside that level's namespace (internal
// linkage).
//
// A few bf16 rows against one f8 block without a dense intermediate: one K pair of the block's 32
// columns is 64 codes (one zmm), decoded in registers (avx512_f8.h: exact) to the two zmm of bf16
// pairs vdpbf16ps takes, each multiplied with the row's pair broadcast. Per K group the sum is
// scaled into C: C += (rows . fp8(q)) * s[g, n], as the grouped-decode path computes it (only the
// fp32 summation order differs). The block is read as S K segments at once (decode streams,
// docs/KERNELS.md), each segment whole K groups, with software prefetch.
#pragma once
#include "avx512_bf16_common.h"
#include "avx512_f8.h"

namespace moepack {
namespace x86_avx512_f8_bf16 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_bf16;
using namespace x86_avx512_f8;

constexpr int kF8A16MaxRows = 4;  // more rows: the decode to a dense block (or tiles) and the dense kernel

// One K pair (64 codes of 32 columns) of the block as the two bf16 pair registers, exact: columns
// 0-15 and 16-31, or with VBMI (kF8Vbmi) in the unpacks' order, columns (0-3, 8-11, 16-19,
// 24-27) and (4-7, 12-15, 20-23, 28-31): one shuffle less per pair; the scales are read in that
// order and C is put back in column order once per block (f8_cols).
static inline void f8_pair(const uint8_t* p, const F8Tables& T, __m512i w[2]) {
  f8_bf16_64_lanes(_mm512_loadu_si512(p), T, w);
}
// Columns in f8_pair's order <-> column order: (a, b) = the 32 values in one order -> the other.
// to_pair: a = columns 0-15, b = 16-31 -> (0-3, 8-11, 16-19, 24-27), (4-7, 12-15, 20-23, 28-31);
// else the inverse.
static inline void f8_cols(__m512& a, __m512& b, bool to_pair) {
  if constexpr (kF8Vbmi) {
    alignas(64) static const int32_t p0[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    alignas(64) static const int32_t p1[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    alignas(64) static const int32_t q0[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    alignas(64) static const int32_t q1[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    const __m512i i0 = _mm512_load_si512(to_pair ? p0 : q0), i1 = _mm512_load_si512(to_pair ? p1 : q1);
    const __m512 x = _mm512_permutex2var_ps(a, i0, b), y = _mm512_permutex2var_ps(a, i1, b);
    a = x, b = y;
  }
}

// C[MR, 32] for bf16 rows x[r] against the f8 block `codes` (kp K, groups of G with scales
// scale + g * gstride), S segments of whole groups streamed at once. False (nothing written) when
// the groups do not deal out evenly to S segments (S = 1 takes any).
template <int MR, int S>
static inline bool gemm_f8a16_streams(const uint16_t* const* x, const uint8_t* codes, const float* scale, int64_t gstride,
                                      int64_t kp, int64_t G, float* C) {
  const int64_t ng = (kp + G - 1) / G;
  const bool one_group = ng == 1;
  if (S > 1 && !one_group && (kp % G || ng % S)) return false;
  constexpr int P = S >= 2 ? 1 : 2;  // chains per (segment, row, half)
  const F8Tables T;
  __m512 a[S][MR][2][P];
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  auto clear = [&] {
    for (int u = 0; u < S; ++u)
      for (int r = 0; r < MR; ++r)
        for (int p = 0; p < P; ++p) a[u][r][0][p] = a[u][r][1][p] = _mm512_setzero_ps();
  };
  // K pair j of the block into segment u's accumulators
  auto step = [&](int u, int64_t j) {
    __m512i w[2];
    f8_pair(codes + j * 64, T, w);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = as_bh(_mm512_set1_epi32(int(load_u32(x[r] + 2 * j))));
      a[u][r][0][j % P] = _mm512_dpbf16_ps(a[u][r][0][j % P], as_bh(w[0]), xb);
      a[u][r][1][j % P] = _mm512_dpbf16_ps(a[u][r][1][j % P], as_bh(w[1]), xb);
    }
  };
  auto half = [&](int u, int r, int h) {
    __m512 t = a[u][r][h][0];
    for (int p = 1; p < P; ++p) t = _mm512_add_ps(t, a[u][r][h][p]);
    return t;
  };
  auto scale_add = [&](int r, const float* s, __m512 t0, __m512 t1) {
    __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
    f8_cols(s0, s1, true);
    c[r][0] = _mm512_fmadd_ps(t0, s0, c[r][0]);
    c[r][1] = _mm512_fmadd_ps(t1, s1, c[r][1]);
  };
  if (one_group) {  // per channel: the K pairs split into S segments, summed before the one scale
    clear();
    for_k_streams<S>(kp / 2, codes, 64, 1, step);
    for (int r = 0; r < MR; ++r) {
      __m512 t0 = half(0, r, 0), t1 = half(0, r, 1);
      for (int u = 1; u < S; ++u) t0 = _mm512_add_ps(t0, half(u, r, 0)), t1 = _mm512_add_ps(t1, half(u, r, 1));
      scale_add(r, scale, t0, t1);
    }
  } else {
    // segment u holds groups [u * rounds, (u + 1) * rounds); round t adds group u * rounds + t of
    // every segment, its K pairs interleaved across the segments (S = 1: every group in order,
    // the last one partial)
    const int64_t rounds = S > 1 ? ng / S : ng, seg_bytes = rounds * G * 32, blk_bytes = kp * 32;
    for (int64_t t = 0; t < rounds; ++t) {
      clear();
      for (int u = 0; u < S; ++u) {  // the next round's scale rows (a page apart: not streamed)
        const int64_t g = t + 1 < rounds ? u * rounds + t + 1 : u * rounds;
        const float* s = scale + g * gstride + (t + 1 < rounds ? 0 : 32);  // past the last: the next block's
        _mm_prefetch(reinterpret_cast<const char*>(s), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(s + 16), _MM_HINT_T0);
      }
      const int64_t k0 = t * G, kend = k0 + G < kp ? k0 + G : kp;  // segment 0's group; the others' are whole
      for (int64_t jj = 0; jj < (kend - k0) / 2; ++jj) {
#pragma GCC unroll 4
        for (int u = 0; u < S; ++u) {
          const int64_t j = (u * rounds + t) * (G / 2) + jj;
          prefetch_segment(codes, j * 64, S > 1 ? (u + 1) * seg_bytes : blk_bytes, S > 1 ? blk_bytes - seg_bytes : 0, 1);
          step(u, j);
        }
      }
      for (int u = 0; u < S; ++u)
        for (int r = 0; r < MR; ++r) scale_add(r, scale + (u * rounds + t) * gstride, half(u, r, 0), half(u, r, 1));
    }
  }
  for (int r = 0; r < MR; ++r) {
    f8_cols(c[r][0], c[r][1], false);
    _mm512_storeu_ps(C + r * 32, c[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, c[r][1]);
  }
  return true;
}

// C[m, 32] for m <= kF8A16MaxRows bf16 rows; false (nothing written) otherwise.
static inline bool gemm_f8a16_bf16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const float* scale,
                                   int64_t gstride, int64_t kp, int64_t G, float* C) {
  if (fmt != RowFormat::bf16 || m > kF8A16MaxRows) return false;
  const uint16_t* const* x = reinterpret_cast<const uint16_t* const*>(rows);
  if (m == 1) {
    if (decode_one_stream()) return gemm_f8a16_streams<1, 1>(x, codes, scale, gstride, kp, G, C);
    return gemm_f8a16_streams<1, 4>(x, codes, scale, gstride, kp, G, C) ||
           gemm_f8a16_streams<1, 2>(x, codes, scale, gstride, kp, G, C) || gemm_f8a16_streams<1, 1>(x, codes, scale, gstride, kp, G, C);
  }
  int i = 0;
  for (; i + 2 <= m; i += 2) {
    if (!(!decode_one_stream() && gemm_f8a16_streams<2, 2>(x + i, codes, scale, gstride, kp, G, C + i * 32)))
      gemm_f8a16_streams<2, 1>(x + i, codes, scale, gstride, kp, G, C + i * 32);
  }
  if (i < m) {
    if (!(!decode_one_stream() && gemm_f8a16_streams<1, 4>(x + i, codes, scale, gstride, kp, G, C + i * 32)))
      gemm_f8a16_streams<1, 1>(x + i, codes, scale, gstride, kp, G, C + i * 32);
  }
  return true;
}

}  // namespace
}  // namespace x86_avx512_f8_bf16
}  // namespace moepack
