// The W4A16 decode kernel of the int4_group layouts with vdpbf16ps, shared by the levels that
// have AVX512_BF16 (avx512_bf16, amx_bf16). Include only from a file compiled with
// -mavx512bf16, inside that level's namespace (internal linkage).
//
// A few bf16 rows (decode) against one u4 block without a dense intermediate: each K group's
// masked code bytes index a table of the codes' bf16 values (vpermw, no widening), vdpbf16ps
// multiplies them with the row's K values in the matching order, and the zero point is folded
// in once per group with the row's group sum: C += (x.q - z * sum(x)) * s. The products are
// exact; only the fp32 summation differs from the portable path (<= 1e-6 relative).
#pragma once
#include "avx512_bf16_common.h"
#include "avx512_u4_common.h"

namespace moepack {
namespace x86_avx512_u4_bf16 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_bf16;
using namespace x86_avx512_u4;

// bf16 bits of the codes 0..15 (vpermw reads the low 5 bits of each index word: a word whose
// low byte is a masked code and whose high byte is anything indexes this table exactly).
static inline __m512i u4_code_bf16_table() {
  alignas(64) static const uint16_t t[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                             0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  return _mm512_load_si512(t);
}

// A row's bf16 K values reordered inside each K group of 8 as (0, 2), (1, 3), (4, 6), (5, 7): the
// pairs the code registers below come in. And the row's sum over each group (fp32).
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

// C[MR, 32] for bf16 rows: per K group of 8 and 16-column half, the masked code bytes index the
// table directly: (v & 0x0F) gives lanes of codes (0, 2), its >> 8 codes (1, 3), the high
// nibbles (4, 6) and (5, 7); each meets the row's matching reordered pair. Per group g:
// C += (sum x.q - z[g, n] * sum_g x) * s[g, n] (the zero point folded in once per group).
template <int MR>
static inline void gemm_u4a16_bf16_tile(const uint16_t* const* xp, const float* const* gsum, const uint8_t* codes,
                                        const float* scale, const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G,
                                        float* C) {
  const __m512i table = u4_code_bf16_table(), m4 = _mm512_set1_epi8(0x0F);
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
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
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        q[h][0] = _mm512_permutexvar_epi16(lo, table);                         // codes 0, 2
        q[h][1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(lo, 8), table);   // codes 1, 3
        q[h][2] = _mm512_permutexvar_epi16(hi, table);                         // codes 4, 6
        q[h][3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(hi, 8), table);   // codes 5, 7
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
    const __m512 z0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z))));
    const __m512 z1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + 16))));
    for (int r = 0; r < MR; ++r) {
      const __m512 xs = _mm512_set1_ps(gsum[r][g]);
      const __m512 t0 = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
      const __m512 t1 = _mm512_add_ps(_mm512_add_ps(a[r][4], a[r][5]), _mm512_add_ps(a[r][6], a[r][7]));
      const __m512 d0 = _mm512_fnmadd_ps(z0, xs, t0);
      const __m512 d1 = _mm512_fnmadd_ps(z1, xs, t1);
      c[r][0] = _mm512_fmadd_ps(d0, s0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(d1, s1, c[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(C + r * 32, c[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, c[r][1]);
  }
}

constexpr int kU4A16MaxRows = 4;  // more rows: unpack once per block and run the dense kernel

// C[m, 32] for bf16 rows, m <= kU4A16MaxRows; false (nothing written) otherwise. kp <= 8192
// (the reordered rows live on the stack; longer K takes the general path).
constexpr int64_t kU4A16MaxK = 8192;
static inline bool gemm_u4a16_bf16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes,
                                   const float* scale, const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G,
                                   float* C) {
  if (fmt != RowFormat::bf16 || m > kU4A16MaxRows || kp > kU4A16MaxK) return false;
  const uint16_t* const* x = reinterpret_cast<const uint16_t* const*>(rows);
  alignas(64) uint16_t xp[kU4A16MaxRows][kU4A16MaxK];
  alignas(64) float gs[kU4A16MaxRows][kU4A16MaxK / 8];
  const uint16_t* xps[kU4A16MaxRows];
  const float* gss[kU4A16MaxRows];
  for (int i = 0; i < m; ++i) {
    u4_prepare_row(x[i], kp, G, xp[i], gs[i]);
    xps[i] = xp[i];
    gss[i] = gs[i];
  }
  int i = 0;
  for (; i + 2 <= m; i += 2) gemm_u4a16_bf16_tile<2>(xps + i, gss + i, codes, scale, zero, gstride, kp, G, C + i * 32);
  if (i < m) gemm_u4a16_bf16_tile<1>(xps + i, gss + i, codes, scale, zero, gstride, kp, G, C + i * 32);
  return true;
}

}  // namespace
}  // namespace x86_avx512_u4_bf16
}  // namespace moepack
