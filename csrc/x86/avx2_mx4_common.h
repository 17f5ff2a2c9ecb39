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
#include "avx2_f8.h"

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

// The e2m1 decode both W4A16 kernels share: one nibble register n (every byte a code 0..15) -> the
// bf16 words of e2m1 of its bytes in byte order, per 128-bit lane: w0 of bytes 0..7 (vpunpcklbw:
// the lane's first two columns), w1 of bytes 8..15 (vpunpckhbw: its last two), through the low- and
// high-byte tables.
static inline void mx4_bf16_words(__m256i n, __m256i tl, __m256i th, __m256i& w0, __m256i& w1) {
  const __m256i lb = _mm256_shuffle_epi8(tl, n), hb = _mm256_shuffle_epi8(th, n);
  w0 = _mm256_unpacklo_epi8(lb, hb);
  w1 = _mm256_unpackhi_epi8(lb, hb);
}

// W4A16 unpack (kHook_unpack_mx4): K [k0, k0 + kk) (multiples of 8) of one mx4 block -> the dense
// bf16_n32k2 block of the unscaled e2m1 values, exact. Per ymm (8 columns) and nibble register
// (codes b of byte b): mx4_bf16_words -> per 128-bit lane the words of columns 0, 1 (codes 0..3
// each: dwords (c0 c1), (c2 c3), ...) and of columns 2, 3; vshufps picks the pairs (c0 c1) and
// (c2 c3) of the four columns in order.
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
        __m256i w0, w1;
        mx4_bf16_words(n, tl, th, w0, w1);
        const __m256 u0 = _mm256_castsi256_ps(w0);  // columns 4l, 4l+1 of lane l
        const __m256 u1 = _mm256_castsi256_ps(w1);  // columns 4l+2, 4l+3
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

// ---- the group scales of the e2m1 schemes --------------------------------------------------
// A scale policy Sc gives the block kernels below their K group (Sc::kGroup) and each group's fp32
// scales of the block's 32 columns: a16(g, s) (W4A16: the factor of the group's fp32 sums) and
// a8(g, s) (W4A8: the factor of float(acc_g), the integer weights being 2 * e2m1), s[q] = columns
// 8q..8q+7.

// mxfp4: e8m0 bytes e per (32 K, column): 2^(e - 127), A8 2^(e - 128) (codec_mx4.inc e8m0_pow2).
struct Mx4Scales {
  static constexpr int kGroup = kMx4Group;
  const uint8_t* scale;
  int64_t gstride;
  void a16(int64_t g, __m256 s[4]) const {
    for (int q = 0; q < 4; ++q) s[q] = mx4_scale8<127>(scale + g * gstride + 8 * q);
  }
  void a8(int64_t g, __m256 s[4]) const {
    for (int q = 0; q < 4; ++q) s[q] = mx4_scale8<128>(scale + g * gstride + 8 * q);
  }
};

// nvfp4: e4m3fn bytes c per (16 K, column) and the columns' fp32 globals gl: s = fp32(e4m3(c) / g)
// for g > 0, fp32(e4m3(c) * -g) else, as codec_nvfp4.inc's nv4_group_scale rounds it (one IEEE
// division or product: the same bits); A8: s * 0.5 (the codec's scale_a8). e4m3(c) comes exactly
// from the fp8 decode (avx2_f8.h f8_f32_16). The block's globals are read once: where all are > 0
// (compressed-tensors) no product is made, where none is (ModelOpt) no division.
constexpr int kNv4Group = 16;
struct Nv4Scales {
  static constexpr int kGroup = kNv4Group;
  const uint8_t* scale;
  int64_t gstride;
  __m256 gdiv[4], gmul[4], pos[4];  // per 8 columns: g where g > 0 (else 1), -g, the mask g > 0
  int mode;                          // 0: every g > 0; 1: none; 2: mixed
  Nv4Scales(const uint8_t* s, int64_t gs, const float* gl) : scale(s), gstride(gs) {
    int npos = 0;
    for (int q = 0; q < 4; ++q) {
      const __m256 g = _mm256_loadu_ps(gl + 8 * q);
      pos[q] = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GT_OQ);
      gdiv[q] = _mm256_blendv_ps(_mm256_set1_ps(1.0f), g, pos[q]);
      gmul[q] = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f));
      npos += __builtin_popcount(unsigned(_mm256_movemask_ps(pos[q])));
    }
    mode = npos == 32 ? 0 : npos == 0 ? 1 : 2;
  }
  void a16(int64_t g, __m256 s[4]) const {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * gstride));
    x86_avx2_f8::f8_f32_16(_mm256_castsi256_si128(c), s[0], s[1]);
    x86_avx2_f8::f8_f32_16(_mm256_extracti128_si256(c, 1), s[2], s[3]);
    for (int q = 0; q < 4; ++q) {
      if (mode == 0) {
        s[q] = _mm256_div_ps(s[q], gdiv[q]);
      } else if (mode == 1) {
        s[q] = _mm256_mul_ps(s[q], gmul[q]);
      } else {
        s[q] = _mm256_blendv_ps(_mm256_mul_ps(s[q], gmul[q]), _mm256_div_ps(s[q], gdiv[q]), pos[q]);
      }
    }
  }
  void a8(int64_t g, __m256 s[4]) const {
    a16(g, s);
    for (int q = 0; q < 4; ++q) s[q] = _mm256_mul_ps(s[q], _mm256_set1_ps(0.5f));
  }
};

// ---- W4A16, one fp32 row, straight from the codes ------------------------------------------
// Each column's 4 code bytes are first reordered to (0, 2, 1, 3) (vpshufb), so that mx4_bf16_words
// makes dwords (code k, code k + 2) of one column: their low words (<< 16) are codes (0, 1) of two
// columns in turn, their high words (& 0xffff0000) codes (2, 3), each an exact fp32, and the row's
// K values (x0, x1) resp. (x2, x3) are one 8-byte broadcast each: no shuffle of weights or row.
// An accumulator lane pair (2i, 2i + 1) belongs to one column; per group, vhaddps of the two
// accumulators of 8 columns gives their sums in column order, and C += sum * s (fp32 FMA).
static inline __m256i mx4_f32_order() {
  return _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15, 0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14,
                          13, 15);
}
static inline __m256 bcast_pair(const float* p) { return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p))); }

// C[32] = sum over the K groups g of Sc (kp a multiple of 8; a partial last group is one) of
// (x . e2m1(q_g)) * s[g, n], for one fp32 row x.
template <class Sc>
static inline void gemm_e2m1a16_f32_row(const float* x, const uint8_t* codes, int64_t kp, const Sc& sc, float* C) {
  constexpr int G = Sc::kGroup;
  const __m256i m4 = _mm256_set1_epi8(0x0F), tl = mx4_bf16_lo_table(), th = mx4_bf16_hi_table(), ord = mx4_f32_order();
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  __m256 c[4];
  for (int q = 0; q < 4; ++q) c[q] = _mm256_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    __m256 a[4][2];
    for (int q = 0; q < 4; ++q) a[q][0] = a[q][1] = _mm256_setzero_ps();
    for (int64_t j = k0 / 8; j < kend / 8; ++j) {
      const __m256i* blk = reinterpret_cast<const __m256i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kMx4PrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kMx4PrefetchBytes + 64, _MM_HINT_T0);
      const float* xj = x + 8 * j;
      for (int q = 0; q < 4; ++q) {
        const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256(blk + q), ord);
        for (int half = 0; half < 2; ++half) {  // codes 0..3, then 4..7
          const __m256i n = half ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
          __m256i w0, w1;
          mx4_bf16_words(n, tl, th, w0, w1);
          const __m256 xe = bcast_pair(xj + 4 * half), xo = bcast_pair(xj + 4 * half + 2);
          a[q][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), xe, a[q][0]);
          a[q][1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), xe, a[q][1]);
          a[q][0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w0, hi)), xo, a[q][0]);
          a[q][1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w1, hi)), xo, a[q][1]);
        }
      }
    }
    __m256 s[4];
    sc.a16(g, s);
    for (int q = 0; q < 4; ++q) c[q] = _mm256_fmadd_ps(_mm256_hadd_ps(a[q][0], a[q][1]), s[q], c[q]);
  }
  for (int q = 0; q < 4; ++q) _mm256_storeu_ps(C + 8 * q, c[q]);
}

// MR fp32 rows (2..4) against one block, straight from the codes: per group and per 8 columns q,
// the group's K steps decoded once (as gemm_e2m1a16_f32_row) and multiplied into each row's two
// accumulators; per group C[r] += hadd(acc) * s in memory (the rows' 2 * MR accumulators, the
// decode's registers and the scales fill the 16 ymm).
template <int MR, class Sc>
static inline void gemm_e2m1a16_f32_tile(const float* const* x, const uint8_t* codes, int64_t kp, const Sc& sc, float* C) {
  constexpr int G = Sc::kGroup;
  const __m256i m4 = _mm256_set1_epi8(0x0F), tl = mx4_bf16_lo_table(), th = mx4_bf16_hi_table(), ord = mx4_f32_order();
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  for (int i = 0; i < MR * 32; ++i) C[i] = 0.0f;
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    __m256 s[4];
    sc.a16(g, s);
    for (int q = 0; q < 4; ++q) {
      __m256 a[MR][2];
      for (int r = 0; r < MR; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
      for (int64_t j = k0 / 8; j < kend / 8; ++j) {
        const __m256i* blk = reinterpret_cast<const __m256i*>(codes + j * 128);
        if (q == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(blk) + kMx4PrefetchBytes, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(blk) + kMx4PrefetchBytes + 64, _MM_HINT_T0);
        }
        const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256(blk + q), ord);
        for (int half = 0; half < 2; ++half) {
          const __m256i n = half ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
          __m256i w0, w1;
          mx4_bf16_words(n, tl, th, w0, w1);
          const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
          const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, hi)), o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, hi));
          for (int r = 0; r < MR; ++r) {
            const float* xj = x[r] + 8 * j + 4 * half;
            const __m256 xe = bcast_pair(xj), xo = bcast_pair(xj + 2);
            a[r][0] = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(e0, xe, a[r][0]));
            a[r][1] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, a[r][1]));
          }
        }
      }
      for (int r = 0; r < MR; ++r) {
        float* c = C + r * 32 + 8 * q;
        _mm256_storeu_ps(c, _mm256_fmadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), s[q], _mm256_loadu_ps(c)));
      }
    }
  }
}

// C[m, 32] for m <= 4 fp32 rows: one row by gemm_e2m1a16_f32_row, 2-4 as one tile.
template <class Sc>
static inline void gemm_e2m1a16_f32_rows(const float* const* x, int m, const uint8_t* codes, int64_t kp, const Sc& sc, float* C) {
  switch (m) {
    case 1: gemm_e2m1a16_f32_row(x[0], codes, kp, sc, C); break;
    case 2: gemm_e2m1a16_f32_tile<2>(x, codes, kp, sc, C); break;
    case 3: gemm_e2m1a16_f32_tile<3>(x, codes, kp, sc, C); break;
    case 4: gemm_e2m1a16_f32_tile<4>(x, codes, kp, sc, C); break;
    default: break;
  }
}

// ---- W4A16, many fp32 rows: the block decoded once per K slice, the scale inside the K loop ----
// For more rows than the tiles above take: a K slice of the block (kE2m1SliceK K, whole groups) is
// decoded once by unpack_mx4_avx2 into the dense bf16_n32k2 block (exact, 16 KiB) and its groups'
// fp32 scales (Sc::a16) into a small table; every row of the call then runs against it in tiles of
// MR rows x 16 columns: per group the partial sums p = x . e2m1(q_g) stay in registers (one FMA
// chain per 8 columns: the K pair's even then odd weight, as the dense gemm2), and one FMA per 8
// columns adds p * s to C in memory. The grouped-decode path's operations per group, without its
// per-group stores and scale loop; its decode serves every row of the call as the grouped path's
// does. A row tile's slice (4 rows x 1 KiB) stays in L1 across the two column halves.
constexpr int64_t kE2m1SliceK = 256;  // K per decoded slice: 128 pairs x 64 bf16 words = 16 KiB
constexpr int kE2m1TileRows = 4;      // MR: 2 * MR accumulators + 4 weights + 2 row values <= 16 ymm

// MR rows (x[r] + k1: the slice's first K) x the 16 columns 16h..16h+15 of the decoded slice w
// (kk K, a multiple of 8), groups of G (the last one may be partial); sg[gi * 32 + n]: group gi's
// fp32 scales. C[r * 32 + n] += the slice's groups, in order.
template <int MR, int G>
static inline void gemm_e2m1a16_slice_tile(const float* const* x, int64_t k1, int64_t kk, const uint16_t* w, const float* sg,
                                           int h, float* C) {
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  const float* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = x[r] + k1;
  for (int64_t gk = 0, gi = 0; gk < kk; gk += G, ++gi) {
    const int64_t gend = gk + G < kk ? gk + G : kk;
    __m256 p[MR][2];
    for (int r = 0; r < MR; ++r) p[r][0] = p[r][1] = _mm256_setzero_ps();
    for (int64_t k = gk; k < gend; k += 2) {
      const __m256i* b = reinterpret_cast<const __m256i*>(w + k / 2 * 64) + 2 * h;
      const __m256i w0 = _mm256_load_si256(b), w1 = _mm256_load_si256(b + 1);
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, hi));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, hi));
      for (int r = 0; r < MR; ++r) {
        const __m256 x0 = _mm256_broadcast_ss(xr[r] + k), x1 = _mm256_broadcast_ss(xr[r] + k + 1);
        p[r][0] = _mm256_fmadd_ps(o0, x1, _mm256_fmadd_ps(e0, x0, p[r][0]));
        p[r][1] = _mm256_fmadd_ps(o1, x1, _mm256_fmadd_ps(e1, x0, p[r][1]));
      }
    }
    const float* s = sg + gi * 32 + 16 * h;
    const __m256 s0 = _mm256_load_ps(s), s1 = _mm256_load_ps(s + 8);
    for (int r = 0; r < MR; ++r) {
      float* c = C + r * 32 + 16 * h;
      _mm256_storeu_ps(c, _mm256_fmadd_ps(p[r][0], s0, _mm256_loadu_ps(c)));
      _mm256_storeu_ps(c + 8, _mm256_fmadd_ps(p[r][1], s1, _mm256_loadu_ps(c + 8)));
    }
  }
}

template <int MR, int G>
static inline void gemm_e2m1a16_slice_rows(const float* const* x, int64_t k1, int64_t kk, const uint16_t* w, const float* sg,
                                           float* C) {
  for (int h = 0; h < 2; ++h) gemm_e2m1a16_slice_tile<MR, G>(x, k1, kk, w, sg, h, C);
}

// C[m, 32] for any m fp32 rows (kp a multiple of 8), the slices in K order.
template <class Sc>
static inline void gemm_e2m1a16_f32_many(const float* const* x, int m, const uint8_t* codes, int64_t kp, const Sc& sc, float* C) {
  constexpr int G = Sc::kGroup;
  static_assert(kE2m1SliceK % G == 0, "a slice is whole groups");
  alignas(64) uint16_t w[kE2m1SliceK * 32];
  alignas(64) float sg[kE2m1SliceK / G * 32];
  for (int i = 0; i < m * 32; ++i) C[i] = 0.0f;
  for (int64_t k1 = 0; k1 < kp; k1 += kE2m1SliceK) {
    const int64_t kk = kp - k1 < kE2m1SliceK ? kp - k1 : kE2m1SliceK;
    unpack_mx4_avx2(codes, k1, kk, w);
    for (int64_t gi = 0; gi * G < kk; ++gi) {
      __m256 s[4];
      sc.a16(k1 / G + gi, s);
      for (int q = 0; q < 4; ++q) _mm256_store_ps(sg + gi * 32 + 8 * q, s[q]);
    }
    int i = 0;
    for (; i + kE2m1TileRows <= m; i += kE2m1TileRows) gemm_e2m1a16_slice_rows<kE2m1TileRows, G>(x + i, k1, kk, w, sg, C + i * 32);
    switch (m - i) {
      case 1: gemm_e2m1a16_slice_rows<1, G>(x + i, k1, kk, w, sg, C + i * 32); break;
      case 2: gemm_e2m1a16_slice_rows<2, G>(x + i, k1, kk, w, sg, C + i * 32); break;
      case 3: gemm_e2m1a16_slice_rows<3, G>(x + i, k1, kk, w, sg, C + i * 32); break;
      default: break;
    }
  }
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

// The fused W4A8 block GEMM (kHook_gemm_mx4a8, kHook_gemm_nv4a8): per group g of Sc in order,
// C += float(acc_g) * a8 scale[g, n] with acc_g = the offset core - 12 * xsum[r * ng + g]; at the end
// C *= the row's activation scale (avx512_mx4_common.h's gemm_mx4a8_tile, 8 columns a register):
// the grouped-decode path's order and operations.
template <int MR, class Acc, class Sc>
static inline void gemm_e2m1a8_tile(const int8_t* const* x, const float* rs, const uint8_t* codes, int64_t kp,
                                    const int32_t* xsum, float* C, Acc acc_fn, const Sc& sc) {
  constexpr int G = Sc::kGroup;
  const int64_t ng = (kp + G - 1) / G;
  __m256 c[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < 4; ++q) c[r][q] = _mm256_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    __m256i acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_setzero_si256();
    acc_fn(x, codes, k0 / 8, kend / 8, acc);
    __m256 s[4];
    sc.a8(g, s);
    for (int q = 0; q < 4; ++q) {
      for (int r = 0; r < MR; ++r) {
        const __m256i t = _mm256_sub_epi32(acc[r][q], _mm256_set1_epi32(kMx4U8Offset * xsum[r * ng + g]));
        c[r][q] = _mm256_add_ps(c[r][q], _mm256_mul_ps(_mm256_cvtepi32_ps(t), s[q]));
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m256 a = _mm256_set1_ps(rs[r]);
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(C + r * 32 + 8 * q, _mm256_mul_ps(c[r][q], a));
  }
}

// Rows two at a time (the accumulators and the weights fill the 16 ymm), then one.
template <template <int> class AccT, class Sc>
static inline void gemm_e2m1a8_rows(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, int64_t kp,
                                    const int32_t* xsum, float* C, const Sc& sc) {
  const int64_t ng = (kp + Sc::kGroup - 1) / Sc::kGroup;
  int i = 0;
  for (; i + 2 <= m; i += 2) gemm_e2m1a8_tile<2>(x + i, rs + i, codes, kp, xsum + i * ng, C + i * 32, AccT<2>{}, sc);
  if (i < m) gemm_e2m1a8_tile<1>(x + i, rs + i, codes, kp, xsum + i * ng, C + i * 32, AccT<1>{}, sc);
}
template <template <int> class AccT>
static inline void gemm_mx4a8_rows(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                                   int64_t gstride, int64_t kp, const int32_t* xsum, float* C) {
  gemm_e2m1a8_rows<AccT>(x, rs, m, codes, kp, xsum, C, Mx4Scales{scale, gstride});
}
// nvfp4's (kHook_gemm_nv4a8): groups of 16, e4m3 scales under the columns' globals.
template <template <int> class AccT>
static inline void gemm_nv4a8_rows(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                                   const float* global, int64_t gstride, int64_t kp, const int32_t* xsum, float* C) {
  gemm_e2m1a8_rows<AccT>(x, rs, m, codes, kp, xsum, C, Nv4Scales(scale, gstride, global));
}

}  // namespace
}  // namespace x86_avx2_mx4
}  // namespace moepack
