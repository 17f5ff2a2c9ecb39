// The W4A16 decode kernel of the mxfp4 layout with vdpbf16ps, shared by the levels that have
// AVX512_BF16 (avx512_bf16, amx_bf16): the gemm_mx4a16 hook (mk_hooks.h) for a few bf16 rows.
// Include only from a file compiled with -mavx512bf16 (or emulated), inside that level's
// namespace (internal linkage).
//
// A few bf16 rows against one mx4 block without a dense intermediate: each K step's codes (two
// zmm) are decoded in registers to the exact bf16 pairs (code 2i, code 2i + 1) of every column
// (avx512_mx4_common.h: one vpshufb per two pairs and one vpermw per pair), so the row's K values
// are used in their own order: pair i of the step meets the row's 32-bit word 4j + i broadcast.
// Per K group of 32 the fp32 dot product is scaled into C, C += (rows . e2m1(q_g)) * 2^(e - 127),
// an exact product in fp32 (the e8m0 scale is never folded into a bf16 weight). The block is read
// as S K segments of whole groups at once (decode streams, docs/KERNELS.md), the groups that do
// not deal out evenly (and a partial last one) after them in one stream, with software prefetch.
#pragma once
#include "avx512_bf16_common.h"
#include "avx512_mx4_common.h"

namespace moepack {
namespace x86_avx512_mx4_bf16 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_bf16;
using namespace x86_avx512_mx4;

constexpr int kMx4A16MaxRows = 4;  // more rows: the decode to a dense block (or tiles) and the dense kernel

// C[MR, 32] for bf16 rows x[r] against one mx4 block (kp K, e8m0 scale rows scale + g * gstride).
template <int MR, int S>
static inline void gemm_mx4a16_streams(const uint16_t* const* x, const uint8_t* codes, const uint8_t* scale, int64_t gstride,
                                       int64_t kp, float* C) {
  const int64_t ng = (kp + kMx4Group - 1) / kMx4Group;
  const int64_t rounds = kp / kMx4Group / S, head = rounds * S;  // groups [0, head): S segments of `rounds`
  const int64_t seg_bytes = rounds * kMx4Group * 16, blk_bytes = kp * 16;
  constexpr int P = S >= 4 ? 1 : 2;  // chains per (segment, row, half): 8 or more in flight
  const __m512i table = mx4_bf16_table(), i01 = mx4_idx01(), i23 = mx4_idx23();
  const __m512i* b = reinterpret_cast<const __m512i*>(codes);
  __m512 a[S][MR][2][P];
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  auto clear = [&](int u) {
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < P; ++p) a[u][r][0][p] = a[u][r][1][p] = _mm512_setzero_ps();
  };
  // K step j (8 K of 32 columns) into segment u's accumulators
  auto step = [&](int u, int64_t j) {
    __m512i w[2][4];
    mx4_pairs(_mm512_loadu_si512(b + 2 * j), table, i01, i23, w[0]);
    mx4_pairs(_mm512_loadu_si512(b + 2 * j + 1), table, i01, i23, w[1]);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const uint16_t* xr = x[r] + 8 * j;
      for (int i = 0; i < 4; ++i) {
        const __m512bh xb = as_bh(_mm512_set1_epi32(int(load_u32(xr + 2 * i))));
        a[u][r][0][i % P] = _mm512_dpbf16_ps(a[u][r][0][i % P], as_bh(w[0][i]), xb);
        a[u][r][1][i % P] = _mm512_dpbf16_ps(a[u][r][1][i % P], as_bh(w[1][i]), xb);
      }
    }
  };
  // group g's sums of segment u, scaled into C
  auto group_end = [&](int u, int64_t g) {
    const uint8_t* e = scale + g * gstride;
    const __m512 s0 = mx4_scale16<127>(e), s1 = mx4_scale16<127>(e + 16);
    for (int r = 0; r < MR; ++r) {
      __m512 t0 = a[u][r][0][0], t1 = a[u][r][1][0];
      for (int p = 1; p < P; ++p) t0 = _mm512_add_ps(t0, a[u][r][0][p]), t1 = _mm512_add_ps(t1, a[u][r][1][p]);
      c[r][0] = _mm512_fmadd_ps(t0, s0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(t1, s1, c[r][1]);
    }
  };
  for (int64_t t = 0; t < rounds; ++t) {
    for (int u = 0; u < S; ++u) {
      clear(u);
      // the next round's scale rows (a page apart: not streamed); past the last, the tail's first
      const int64_t gn = t + 1 < rounds ? u * rounds + t + 1 : head;
      _mm_prefetch(reinterpret_cast<const char*>(scale + (gn < ng ? gn * gstride : 32)), _MM_HINT_T0);
    }
    for (int64_t jj = 0; jj < kMx4Group / 8; ++jj) {
#pragma GCC unroll 4
      for (int u = 0; u < S; ++u) {
        const int64_t j = (u * rounds + t) * (kMx4Group / 8) + jj;
        prefetch_segment(codes, j * 128, (u + 1) * seg_bytes, blk_bytes - seg_bytes, 2);  // past: the next block's
        step(u, j);
      }
    }
    for (int u = 0; u < S; ++u) group_end(u, u * rounds + t);
  }
  for (int64_t g = head, k0 = head * kMx4Group; k0 < kp; ++g, k0 += kMx4Group) {  // the rest, in one stream
    const int64_t kend = k0 + kMx4Group < kp ? k0 + kMx4Group : kp;
    clear(0);
    for (int64_t j = k0 / 8; j < kend / 8; ++j) {
      prefetch_segment(codes, j * 128, blk_bytes, 0, 2);
      step(0, j);
    }
    group_end(0, g);
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(C + r * 32, c[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, c[r][1]);
  }
}

// C[m, 32] for m <= kMx4A16MaxRows bf16 rows (kHook_gemm_mx4a16); false (nothing written)
// otherwise. One row: 4 segments (or one stream where decode_one_stream()); rows two at a time
// with 2 segments, an odd last row as one row.
static inline bool gemm_mx4a16_bf16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes,
                                    const uint8_t* scale, int64_t gstride, int64_t kp, float* C) {
  if (fmt != RowFormat::bf16 || m > kMx4A16MaxRows) return false;
  const uint16_t* const* x = reinterpret_cast<const uint16_t* const*>(rows);
  const bool one = decode_one_stream();
  int i = 0;
  for (; i + 2 <= m; i += 2) {
    if (one) {
      gemm_mx4a16_streams<2, 1>(x + i, codes, scale, gstride, kp, C + i * 32);
    } else {
      gemm_mx4a16_streams<2, 2>(x + i, codes, scale, gstride, kp, C + i * 32);
    }
  }
  if (i < m) {
    if (one) {
      gemm_mx4a16_streams<1, 1>(x + i, codes, scale, gstride, kp, C + i * 32);
    } else {
      gemm_mx4a16_streams<1, 4>(x + i, codes, scale, gstride, kp, C + i * 32);
    }
  }
  return true;
}

}  // namespace
}  // namespace x86_avx512_mx4_bf16
}  // namespace moepack
