// The W4A16 decode kernel of the int4_group layouts with vdpbf16ps, shared by the levels that
// have AVX512_BF16 (avx512_bf16, amx_bf16). Include only from a file compiled with
// -mavx512bf16, inside that level's namespace (internal linkage).
//
// A few bf16 rows (decode) against one u4 block without a dense intermediate. Each code q
// becomes the bf16 value 1 + q/16 by placing its 4 bits in the top of the mantissa of 1.0
// (0x3F80 | q << 3): one shift and one vpternlogd (mask, or) per register of 16 code pairs, no
// table lookup. vdpbf16ps multiplies them with the row's K values in the matching order, and
// per group the bias and the zero point come out with the row's group sum:
//   sum x.(q - z) = 16 * sum x.(1 + q/16) - (16 + z) * sum x,   C += that * s.
// The products are exact; only the fp32 summation differs from the portable path.
#pragma once
#include <memory>
#include "avx512_bf16_common.h"
#include "avx512_u4_common.h"

namespace moepack {
namespace x86_avx512_u4_bf16 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_bf16;
using namespace x86_avx512_u4;

// A row's bf16 K values reordered inside each K group of 8 as (0, 2), (1, 3), (4, 6), (5, 7): the
// pairs the code registers below come in, followed by zeros up to the next multiple of 32 (xp
// holds that many: the tile decode, amx_a16_decode.h, reads whole 32-K steps). And the row's sum
// over each group (fp32).
static inline void u4_prepare_row(const uint16_t* x, int64_t kp, int64_t G, uint16_t* xp, float* gsum) {
  alignas(64) static const uint16_t perm[32] = {0,  2,  1,  3,  4,  6,  5,  7,  8,  10, 9,  11, 12, 14, 13, 15,
                                                16, 18, 17, 19, 20, 22, 21, 23, 24, 26, 25, 27, 28, 30, 29, 31};
  const __m512i pi = _mm512_load_si512(perm);
  int64_t k = 0;
  for (; k + 32 <= kp; k += 32) {
    _mm512_storeu_si512(xp + k, _mm512_permutexvar_epi16(pi, _mm512_loadu_si512(x + k)));
  }
  for (; k < kp; k += 8) {  // kp is a multiple of 8
    static const int p8[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    for (int i = 0; i < 8; ++i) xp[k + i] = x[k + p8[i]];
  }
  for (; k % 32; ++k) xp[k] = 0;
  const __m512bh ones = as_bh(_mm512_set1_epi16(0x3F80));  // bf16 1.0
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    __m512 s = _mm512_setzero_ps();
    int64_t kk = k0;
    for (; kk + 32 <= kend; kk += 32) s = _mm512_dpbf16_ps(s, as_bh(_mm512_loadu_si512(x + kk)), ones);
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, s);
    float t = 0.0f;
    for (int i = 0; i < 16; ++i) t += lanes[i];
    for (; kk < kend; ++kk) t += bf16_to_f32(x[kk]);
    gsum[g] = t;
  }
}

// C[MR, 32] for bf16 rows. A 32-bit lane of a code register holds the 8 codes of one column
// as bytes (c0 | c4 << 4, c1 | c5 << 4, c2 | c6 << 4, c3 | c7 << 4), so the pairs (0, 2), (1, 3),
// (4, 6) and (5, 7) sit at bits 0 / 16, 8 / 24, 4 / 20 and 12 / 28: shifted left 3, right 5, 1
// and 9 they land at mantissa bits 3..6 of both bf16 halves; the mask keeps them and the or
// adds 1.0's bits. Each pair register meets the row's matching reordered pair (u4_prepare_row).
template <int MR>
static inline void gemm_u4a16_bf16_tile(const uint16_t* const* xp, const float* const* gsum, const uint8_t* codes,
                                        const float* scale, const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G,
                                        float* C) {
  const __m512i mant = _mm512_set1_epi32(0x00780078), one = _mm512_set1_epi32(0x3F803F80);
  const __m512 sixteen = _mm512_set1_ps(16.0f);
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  const int64_t ng = (kp + G - 1) / G;
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    // The scale and zero rows of two groups ahead (past the last: the next block's first ones):
    // one row per group, a column-count apart, which the hardware prefetcher does not follow.
    {
      const int64_t ga = g + 2 < ng ? g + 2 : g + 2 - ng;
      const int64_t off = (g + 2 < ng ? 0 : 32) + ga * gstride;
      _mm_prefetch(reinterpret_cast<const char*>(scale + off), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scale + off + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(zero + off), _MM_HINT_T0);
    }
    __m512 a[MR][8];  // [half * 4 + code pair]: 8 independent chains hide vdpbf16ps' latency
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < 8; ++i) a[r][i] = _mm512_setzero_ps();
    for (int64_t j = k0 / 8; j < kend / 8; ++j) {
      const __m512i* blk = reinterpret_cast<const __m512i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kU4PrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kU4PrefetchBytes + 64, _MM_HINT_T0);
      __m512i q[2][4];
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(blk + h);
        const __m512i s1 = _mm512_srli_epi32(v, 1);
        q[h][0] = _mm512_ternarylogic_epi32(_mm512_slli_epi32(v, 3), mant, one, 0xEA);  // codes 0, 2
        q[h][1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(s1, 4), mant, one, 0xEA);  // codes 1, 3
        q[h][2] = _mm512_ternarylogic_epi32(s1, mant, one, 0xEA);                        // codes 4, 6
        q[h][3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 9), mant, one, 0xEA);  // codes 5, 7
      }
      for (int r = 0; r < MR; ++r) {
        const uint16_t* x = xp[r] + 8 * j;
        for (int i = 0; i < 4; ++i) {
          const __m512bh xb = as_bh(bcast32(x + 2 * i));
          a[r][i] = _mm512_dpbf16_ps(a[r][i], as_bh(q[0][i]), xb);
          a[r][4 + i] = _mm512_dpbf16_ps(a[r][4 + i], as_bh(q[1][i]), xb);
        }
      }
    }
    const __m512 s0 = _mm512_loadu_ps(scale + g * gstride), s1 = _mm512_loadu_ps(scale + g * gstride + 16);
    const uint8_t* z = zero + g * gstride;
    // 16 + z: the bias of 1 + q/16 (times 16) and the zero point, both against the group sum
    const __m512 z0 = _mm512_add_ps(
        sixteen, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z)))));
    const __m512 z1 = _mm512_add_ps(
        sixteen, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + 16)))));
    for (int r = 0; r < MR; ++r) {
      const __m512 xs = _mm512_set1_ps(gsum[r][g]);
      const __m512 t0 = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
      const __m512 t1 = _mm512_add_ps(_mm512_add_ps(a[r][4], a[r][5]), _mm512_add_ps(a[r][6], a[r][7]));
      const __m512 d0 = _mm512_fnmadd_ps(z0, xs, _mm512_mul_ps(t0, sixteen));
      const __m512 d1 = _mm512_fnmadd_ps(z1, xs, _mm512_mul_ps(t1, sixteen));
      c[r][0] = _mm512_fmadd_ps(d0, s0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(d1, s1, c[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(C + r * 32, c[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, c[r][1]);
  }
}

// One K step (8 codes of 32 columns = 128 bytes) as the 8 pair registers of 1 + q/16 (above).
static inline void u4a16_step_codes(const __m512i* blk, __m512i q[2][4]) {
  const __m512i mant = _mm512_set1_epi32(0x00780078), one = _mm512_set1_epi32(0x3F803F80);
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_loadu_si512(blk + h);
    const __m512i s1 = _mm512_srli_epi32(v, 1);
    q[h][0] = _mm512_ternarylogic_epi32(_mm512_slli_epi32(v, 3), mant, one, 0xEA);
    q[h][1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(s1, 4), mant, one, 0xEA);
    q[h][2] = _mm512_ternarylogic_epi32(s1, mant, one, 0xEA);
    q[h][3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 9), mant, one, 0xEA);
  }
}

// C += s * (16 * acc - (16 + z) * gsum) for one group of one row (acc: the group's two halves).
static inline void u4a16_group_add(const float* scale, const uint8_t* zero, int64_t off, float gsum, __m512 t0,
                                   __m512 t1, __m512& c0, __m512& c1) {
  const __m512 sixteen = _mm512_set1_ps(16.0f), xs = _mm512_set1_ps(gsum);
  const __m512 z0 = _mm512_add_ps(sixteen, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(zero + off)))));
  const __m512 z1 = _mm512_add_ps(sixteen, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(zero + off + 16)))));
  c0 = _mm512_fmadd_ps(_mm512_fnmadd_ps(z0, xs, _mm512_mul_ps(t0, sixteen)), _mm512_loadu_ps(scale + off), c0);
  c1 = _mm512_fmadd_ps(_mm512_fnmadd_ps(z1, xs, _mm512_mul_ps(t1, sixteen)), _mm512_loadu_ps(scale + off + 16), c1);
}

// Decode streams (as gemm_u4a8_streams): the block's ng groups dealt out to S segments that
// advance together, round t taking group u * (ng / S) + t of every segment u, so that one thread
// keeps S address streams in flight; each group's fp32 sum is the tile kernel's, only the order in
// which pairs and groups are added differs. One group (per channel): its K steps are split, the
// S partial sums added before the epilogue. False (nothing written) when the groups cannot be
// dealt out evenly.
template <int MR, int S>
static inline bool gemm_u4a16_bf16_streams(const uint16_t* const* xp, const float* const* gsum, const uint8_t* codes,
                                           const float* scale, const uint8_t* zero, int64_t gstride, int64_t kp,
                                           int64_t G, float* C) {
  const int64_t ng = (kp + G - 1) / G;
  if (ng > 1 && (kp % G || ng % S)) return false;
  constexpr int P = S >= 4 ? 1 : 2;  // chains per (segment, row, half): 8 or more from 2 segments, 4 with one stream
  const __m512i* b = reinterpret_cast<const __m512i*>(codes);
  __m512 a[S][MR][2][P];
  auto step = [&](int u, int64_t j) {
    __m512i q[2][4];
    u4a16_step_codes(b + 2 * j, q);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const uint16_t* x = xp[r] + 8 * j;
      for (int i = 0; i < 4; ++i) {
        const __m512bh xb = as_bh(bcast32(x + 2 * i));
        a[u][r][0][i % P] = _mm512_dpbf16_ps(a[u][r][0][i % P], as_bh(q[0][i]), xb);
        a[u][r][1][i % P] = _mm512_dpbf16_ps(a[u][r][1][i % P], as_bh(q[1][i]), xb);
      }
    }
  };
  auto clear = [&] {
    for (int u = 0; u < S; ++u)
      for (int r = 0; r < MR; ++r)
        for (int p = 0; p < P; ++p) a[u][r][0][p] = a[u][r][1][p] = _mm512_setzero_ps();
  };
  auto half = [&](int u, int r, int h) {
    __m512 t = a[u][r][h][0];
    for (int p = 1; p < P; ++p) t = _mm512_add_ps(t, a[u][r][h][p]);
    return t;
  };
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  if (ng == 1) {
    clear();
    for_k_streams<S>(kp / 8, codes, 128, 2, step);
    for (int r = 0; r < MR; ++r) {
      __m512 t0 = half(0, r, 0), t1 = half(0, r, 1);
      for (int u = 1; u < S; ++u) {
        t0 = _mm512_add_ps(t0, half(u, r, 0));
        t1 = _mm512_add_ps(t1, half(u, r, 1));
      }
      u4a16_group_add(scale, zero, 0, gsum[r][0], t0, t1, c[r][0], c[r][1]);
    }
  } else {
    for_group_streams<S>(codes, scale, zero, gstride, kp, G, clear, step, [&](int u, int64_t g) {
      for (int r = 0; r < MR; ++r)
        u4a16_group_add(scale, zero, g * gstride, gsum[r][g], half(u, r, 0), half(u, r, 1), c[r][0], c[r][1]);
    });
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(C + r * 32, c[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, c[r][1]);
  }
  return true;
}

constexpr int kU4A16MaxRows = 4;  // more rows: unpack once per block and run the dense kernel

// kp <= 16384: the reordered rows live in the memo (longer K takes the general path). 16384, not
// 8192: mixtral's w2 (K = 14336) took the general path (unpack to a dense block per group, then
// the bf16 kernel) at one row. The memo lives on the stage worker's stack: 4 x 32 KiB of rows and
// 4 x 8 KiB of group sums.
constexpr int64_t kU4A16MaxK = 16384;

// The rows of the last call, reordered and summed per K group (u4_prepare_row), kept by the
// driver per stage worker (RowMemo) so that they are prepared once per row, not once per block
// of 32 columns: a slot is reused while its row's address, kp and G match.
struct U4A16Rows {
  const void* key[kU4A16MaxRows] = {};
  int64_t kp[kU4A16MaxRows] = {}, G[kU4A16MaxRows] = {};
  alignas(64) uint16_t xp[kU4A16MaxRows][kU4A16MaxK];
  alignas(64) float gs[kU4A16MaxRows][kU4A16MaxK / 8];
  // Slots 0..m-1 hold rows[0..m) at this kp and G: each prepared unless its slot holds it already.
  void prepare(const void* const* rows, int m, int64_t kp_, int64_t G_) {
    for (int i = 0; i < m; ++i) {
      if (key[i] == rows[i] && kp[i] == kp_ && G[i] == G_) continue;
      u4_prepare_row(static_cast<const uint16_t*>(rows[i]), kp_, G_, xp[i], gs[i]);
      key[i] = rows[i];
      kp[i] = kp_;
      G[i] = G_;
    }
  }
};

// C[m, 32] for bf16 rows, m <= kU4A16MaxRows; false (nothing written) otherwise. `memo`: the
// caller's U4A16Rows for rows that do not change between calls (null: prepared here, each call).
static inline bool gemm_u4a16_bf16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes,
                                   const float* scale, const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G,
                                   float* C, U4A16Rows* memo) {
  if (fmt != RowFormat::bf16 || m > kU4A16MaxRows || kp > kU4A16MaxK) return false;
  std::unique_ptr<U4A16Rows> own;
  if (!memo) {
    own.reset(new U4A16Rows);
    memo = own.get();
  }
  memo->prepare(rows, m, kp, G);
  const uint16_t* xps[kU4A16MaxRows];
  const float* gss[kU4A16MaxRows];
  for (int i = 0; i < m; ++i) {
    xps[i] = memo->xp[i];
    gss[i] = memo->gs[i];
  }
  if (m == 1 && decode_one_stream() && gemm_u4a16_bf16_streams<1, 1>(xps, gss, codes, scale, zero, gstride, kp, G, C)) {
    return true;  // one stream per block (decode_one_stream); a partial last group takes the tile below
  }
  if (m == 1 && (gemm_u4a16_bf16_streams<1, 4>(xps, gss, codes, scale, zero, gstride, kp, G, C) ||
                 gemm_u4a16_bf16_streams<1, 2>(xps, gss, codes, scale, zero, gstride, kp, G, C))) {
    return true;
  }
  int i = 0;
  for (; i + 2 <= m; i += 2) gemm_u4a16_bf16_tile<2>(xps + i, gss + i, codes, scale, zero, gstride, kp, G, C + i * 32);
  if (i < m) gemm_u4a16_bf16_tile<1>(xps + i, gss + i, codes, scale, zero, gstride, kp, G, C + i * 32);
  return true;
}

}  // namespace
}  // namespace x86_avx512_u4_bf16
}  // namespace moepack
