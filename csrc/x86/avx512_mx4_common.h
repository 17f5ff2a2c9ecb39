// The AVX-512 micro-kernels of the mxfp4 layout (mx4g32_n32k8_x86), shared by the AVX-512 levels:
// the exact decode of a block's e2m1 codes to the dense bf16 block (W4A16 unpack_mx4, AVX-512
// F/BW only), the e8m0 scales as fp32, and the W4A8 block GEMM over an integer core the level
// supplies (vpmaddubsw here for the avx512 level; vpdpbusd in avx512_mx4_vnni.h). Include only
// from a file compiled with at least the avx512 level's flags, inside that level's namespace
// (internal linkage).
//
// The codes sit where the u4 layouts put theirs (docs/KERNELS.md): a K step of 8 codes of the
// block's 32 columns is 128 bytes = two zmm of 16 columns, one 32-bit lane per column whose byte
// b holds code b (low nibble) and code b + 4 (high nibble). One e8m0 byte e per (K group of 32,
// column): 2^(e - 127).
//
// Decoding in registers (no value is computed: every code goes through a table):
//  - A16: a vpshufb puts bytes b0 and b1 of each lane into the low bytes of its two words
//    (and b2, b3 in a second register); vpermw then looks each word up in a 32-word table that
//    holds bf16(e2m1(i & 15)) at i: it reads the index's low 5 bits, so the fifth (the low bit of
//    the neighbouring nibble) selects the same value. The word pairs come out as (code 0, code 1),
//    (2, 3), (4, 5) (after a 4-bit shift) and (6, 7): the dense block's K pairs, in column order.
//  - A8: a vpshufb per nibble register maps code q to the unsigned byte 2 * e2m1(q) + 12 (0..24),
//    the unsigned operand of vpmaddubsw / vpdpbusd against the s8 rows; the group's exact integer
//    sum x . (2 * e2m1(q)) is that dot product minus 12 * (the row's sum over the group).
#pragma once
#include "avx512_common.h"
#include "avx2_mx4_common.h"  // Nv4Scales: nvfp4's group scales (AVX2 + F16C)

namespace moepack {
namespace x86_avx512_mx4 {
namespace {

using namespace x86_avx512;

constexpr int kMx4Group = 32;           // K values per e8m0 scale (the layout's group_size)
constexpr int kMx4PrefetchBytes = 1024; // the code stream's software prefetch distance (as the u4 kernels')

// bf16 bits of e2m1 code i & 15 at word i (32 words: vpermw's table, both halves the same).
static inline __m512i mx4_bf16_table() {
  alignas(64) static const uint16_t t[32] = {
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80,
      0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0, 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040,
      0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
  return _mm512_load_si512(t);
}

// The unsigned byte 2 * e2m1(q) + 12 of code q (vpshufb's table, every 128-bit lane the same).
static inline __m512i mx4_u8_table() {
  alignas(64) static const uint8_t t[64] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                            12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                            12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                            12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
  return _mm512_load_si512(t);
}
constexpr int kMx4U8Offset = 12;  // what mx4_u8_table adds to 2 * e2m1(q)

// vpshufb indices (per 128-bit lane): each 32-bit lane's bytes (b0, b1) / (b2, b3) to the low
// bytes of its two words, the high bytes zero.
static inline __m512i mx4_idx(int b) {
  return _mm512_set4_epi32(int(0x80008000u | (12 + b + 1) << 16 | (12 + b)), int(0x80008000u | (8 + b + 1) << 16 | (8 + b)),
                           int(0x80008000u | (4 + b + 1) << 16 | (4 + b)), int(0x80008000u | (b + 1) << 16 | b));
}
static inline __m512i mx4_idx01() { return mx4_idx(0); }
static inline __m512i mx4_idx23() { return mx4_idx(2); }

// 16 columns of one K step (zmm v) as four registers of bf16 pairs, column c at 32-bit lane c:
// p[i] = (code 2i, code 2i + 1) of each column, exact.
static inline void mx4_pairs(__m512i v, __m512i table, __m512i i01, __m512i i23, __m512i p[4]) {
  const __m512i s01 = _mm512_shuffle_epi8(v, i01), s23 = _mm512_shuffle_epi8(v, i23);
  p[0] = _mm512_permutexvar_epi16(s01, table);
  p[1] = _mm512_permutexvar_epi16(s23, table);
  p[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(s01, 4), table);
  p[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(s23, 4), table);
}

// W4A16 unpack (kHook_unpack_mx4): K [k0, k0 + kk) (multiples of 8) of one mx4 block -> the dense
// bf16_n32k2 block of the unscaled e2m1 values, exact (kMx4Bf16's bits).
static inline void unpack_mx4_avx512(const uint8_t* codes, int64_t k0, int64_t kk, uint16_t* out) {
  const __m512i table = mx4_bf16_table(), i01 = mx4_idx01(), i23 = mx4_idx23();
  for (int64_t j = k0 / 8; j < (k0 + kk) / 8; ++j) {
    const __m512i* g = reinterpret_cast<const __m512i*>(codes + j * 128);
    // the code stream 1 KiB ahead, into L2 (the tile path decodes a block once for all its rows)
    _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes + 64, _MM_HINT_T1);
    __m512i* o = reinterpret_cast<__m512i*>(out + (j * 8 - k0) / 2 * 64);  // 4 K pairs of 32 columns: 8 zmm
    for (int h = 0; h < 2; ++h) {
      __m512i p[4];
      mx4_pairs(_mm512_loadu_si512(g + h), table, i01, i23, p);
      for (int i = 0; i < 4; ++i) _mm512_storeu_si512(o + 2 * i + h, p[i]);
    }
  }
}

// fp32 2^(e - bias) of 16 e8m0 bytes (bias 127: the A16 scale; 128: the A8 one, which carries the
// factor 1/2 of the integer weights 2 * e2m1), exact: fp32 subnormals where the exponent is
// below -126 (e < 1 for bias 127, e < 2 for bias 128).
template <int Bias>
static inline __m512 mx4_scale16(const uint8_t* e) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(Bias - 127)), 23);
  // below the normal range: 2^(e - Bias) = 2^-127 >> (Bias - 127 - e) (2^-127: mantissa bit 22)
  const __m512i sub = _mm512_srlv_epi32(_mm512_set1_epi32(0x00400000), _mm512_sub_epi32(_mm512_set1_epi32(Bias - 127), v));
  const __mmask16 low = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(Bias - 126), v);
  // e = 255 (e8m0 NaN: refused at convert and open) as the codec's e8m0_pow2 gives it: a quiet NaN
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(255));
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_mask_blend_epi32(low, normal, sub), nan, _mm512_set1_epi32(0x7FC00000)));
}

// ---- the group scales of the e2m1 schemes (as avx2_mx4_common.h's, 16 columns a register) ------
// Sc::kGroup, a16(g, s0, s1) / a8(g, s0, s1): group g's fp32 scales of columns 0-15 and 16-31,
// row(g): group g's scale bytes (for a prefetch).
struct Mx4Scales16 {
  static constexpr int kGroup = kMx4Group;
  const uint8_t* scale;
  int64_t gstride;
  const uint8_t* row(int64_t g) const { return scale + g * gstride; }
  void a16(int64_t g, __m512& s0, __m512& s1) const {
    s0 = mx4_scale16<127>(row(g));
    s1 = mx4_scale16<127>(row(g) + 16);
  }
  void a8(int64_t g, __m512& s0, __m512& s1) const {
    s0 = mx4_scale16<128>(row(g));
    s1 = mx4_scale16<128>(row(g) + 16);
  }
};
// nvfp4: avx2_mx4_common.h's Nv4Scales (the fp8 decode of the e4m3 bytes, the globals' division or
// product: nv4_group_scale's bits), its 8-column registers joined in pairs.
struct Nv4Scales16 {
  static constexpr int kGroup = x86_avx2_mx4::kNv4Group;
  x86_avx2_mx4::Nv4Scales sc;
  Nv4Scales16(const uint8_t* scale, int64_t gstride, const float* global) : sc(scale, gstride, global) {}
  const uint8_t* row(int64_t g) const { return sc.scale + g * sc.gstride; }
  static void join(const __m256 t[4], __m512& s0, __m512& s1) {
    s0 = _mm512_insertf32x8(_mm512_castps256_ps512(t[0]), t[1], 1);
    s1 = _mm512_insertf32x8(_mm512_castps256_ps512(t[2]), t[3], 1);
  }
  void a16(int64_t g, __m512& s0, __m512& s1) const {
    __m256 t[4];
    sc.a16(g, t);
    join(t, s0, s1);
  }
  void a8(int64_t g, __m512& s0, __m512& s1) const {
    __m256 t[4];
    sc.a8(g, t);
    join(t, s0, s1);
  }
};

// ---- W4A8 ---------------------------------------------------------------------------------
// The integer core with vpmaddubsw (the u8 weights 0..24 x s8 rows, each i16 pair at most
// 2 x 24 x 128 and the two nibbles' pairs together 12288 in magnitude: exact) and vpmaddwd:
// acc[r][h] (16 columns each) += sum over the K steps [j0, j1) of x . (2 * e2m1(q) + 12).
template <int MR>
struct Mx4AccBw {
  void operator()(const int8_t* const* x, const uint8_t* codes, int64_t j0, int64_t j1, __m512i acc[][2]) const {
    const __m512i m4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi16(1), t = mx4_u8_table();
    for (int64_t j = j0; j < j1; ++j) {
      const __m512i* g = reinterpret_cast<const __m512i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes + 64, _MM_HINT_T0);
      __m512i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(g + h);
        lo[h] = _mm512_shuffle_epi8(t, _mm512_and_si512(v, m4));
        hi[h] = _mm512_shuffle_epi8(t, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i xl = _mm512_set1_epi32(int(load_u32(x[r] + 8 * j)));
        const __m512i xh = _mm512_set1_epi32(int(load_u32(x[r] + 8 * j + 4)));
        for (int h = 0; h < 2; ++h) {
          const __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(lo[h], xl), _mm512_maddubs_epi16(hi[h], xh));
          acc[r][h] = _mm512_add_epi32(acc[r][h], _mm512_madd_epi16(p, ones));
        }
      }
    }
  }
};

// A row's s8 sum over K [k0, k0 + kk).
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
    __m512i acc[1][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()}};
    AccT<1>{}(x + i, codes, k0 / 8, (k0 + kk) / 8, acc);
    const __m512i off = _mm512_set1_epi32(kMx4U8Offset * mx4_row_sum(x[i], k0, kk));
    _mm512_storeu_si512(out + i * 32, _mm512_sub_epi32(acc[0][0], off));
    _mm512_storeu_si512(out + i * 32 + 16, _mm512_sub_epi32(acc[0][1], off));
  }
}

// One group's epilogue of one row: c += float(acc - 12 * xs) * 2^(e - 128) (the product exact).
static inline void mx4a8_group_add(__m512 s0, __m512 s1, __m512i a0, __m512i a1, int32_t xs, __m512& c0, __m512& c1) {
  const __m512i off = _mm512_set1_epi32(kMx4U8Offset * xs);
  c0 = _mm512_add_ps(c0, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a0, off)), s0));
  c1 = _mm512_add_ps(c1, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a1, off)), s1));
}

// The fused W4A8 block GEMM (kHook_gemm_mx4a8, kHook_gemm_nv4a8; docs/SEMANTICS.md:
// int4_linear_a8_reference with w_q = 2 * e2m1(q), zero 0, the scheme's A8 scale): per group g of
// Sc in order, C += float(acc_g) * a8 scale[g, n], at the end C *= the row's activation scale.
// xsum[r * ng + g]: row r's sum over group g (the driver's A8RowSums). Acc(MR, x, codes, j0, j1,
// acc) adds the K steps [j0, j1).
template <int MR, class Acc, class Sc>
static inline void gemm_e2m1a8_tile(const int8_t* const* x, const float* rs, const uint8_t* codes, int64_t kp,
                                    const int32_t* xsum, float* C, Acc acc_fn, const Sc& sc) {
  constexpr int G = Sc::kGroup;
  const int64_t ng = (kp + G - 1) / G;
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    // the scale row of two groups ahead (one line; a column-count apart: not streamed)
    _mm_prefetch(reinterpret_cast<const char*>(g + 2 < ng ? sc.row(g + 2) : sc.row(g + 2 - ng) + 32), _MM_HINT_T0);
    __m512i acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    acc_fn(x, codes, k0 / 8, kend / 8, acc);
    __m512 s0, s1;
    sc.a8(g, s0, s1);
    for (int r = 0; r < MR; ++r) mx4a8_group_add(s0, s1, acc[r][0], acc[r][1], xsum[r * ng + g], c[r][0], c[r][1]);
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(rs[r]);
    _mm512_storeu_ps(C + r * 32, _mm512_mul_ps(c[r][0], a));
    _mm512_storeu_ps(C + r * 32 + 16, _mm512_mul_ps(c[r][1], a));
  }
}
template <int MR, class Acc>
static inline void gemm_mx4a8_tile(const int8_t* const* x, const float* rs, const uint8_t* codes, const uint8_t* scale,
                                   int64_t gstride, int64_t kp, const int32_t* xsum, float* C, Acc acc_fn) {
  gemm_e2m1a8_tile<MR>(x, rs, codes, kp, xsum, C, acc_fn, Mx4Scales16{scale, gstride});
}

// Rows in tiles of up to 4 (acc[4][2] and c[4][2] + the weights' 4 registers fit the 32 zmm).
template <template <int> class AccT, class Sc>
static inline void gemm_e2m1a8_rows(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, int64_t kp,
                                    const int32_t* xsum, float* C, const Sc& sc) {
  const int64_t ng = (kp + Sc::kGroup - 1) / Sc::kGroup;
  int i = 0;
  for (; i + 4 <= m; i += 4) gemm_e2m1a8_tile<4>(x + i, rs + i, codes, kp, xsum + i * ng, C + i * 32, AccT<4>{}, sc);
  switch (m - i) {
    case 3: gemm_e2m1a8_tile<3>(x + i, rs + i, codes, kp, xsum + i * ng, C + i * 32, AccT<3>{}, sc); break;
    case 2: gemm_e2m1a8_tile<2>(x + i, rs + i, codes, kp, xsum + i * ng, C + i * 32, AccT<2>{}, sc); break;
    case 1: gemm_e2m1a8_tile<1>(x + i, rs + i, codes, kp, xsum + i * ng, C + i * 32, AccT<1>{}, sc); break;
    default: break;
  }
}
template <template <int> class AccT>
static inline void gemm_mx4a8_rows(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                                   int64_t gstride, int64_t kp, const int32_t* xsum, float* C) {
  gemm_e2m1a8_rows<AccT>(x, rs, m, codes, kp, xsum, C, Mx4Scales16{scale, gstride});
}

// Folding the scale into the decoded weights (the many-row paths of the bf16 levels: AMX tiles,
// avx512_bf16's dense row kernel): for a code value v != 0 and e8m0 e, the bf16 bits of
// v * 2^(e - 127) are bits(v) + ((e - 127) << 7) whenever the result is a normal bf16 (e >= 2). A
// block is folded only when every scale of it lies in [kMx4FoldMinE, kMx4FoldMaxE] (|scaled
// weight| in [2^-64, 2^64]): then no product with a row value above 2^-60 in magnitude leaves
// fp32's normal range (tdpbf16ps and vdpbf16ps flush subnormals, as they do for the unscaled
// values), and the result is the contract's sum up to the fp32 summation order. Other blocks take
// the exact per-group path, which never folds a scale.
constexpr int kMx4FoldMinE = 64, kMx4FoldMaxE = 187;

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


}  // namespace
}  // namespace x86_avx512_mx4
}  // namespace moepack
