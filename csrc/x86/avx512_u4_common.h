// The AVX-512 micro-kernels of the int4_group layouts (u4*_n32k8_x86), shared by the AVX-512
// levels: unpacking a block's codes to the dense bf16 block of (q - z) (W4A16, every AVX-512
// level: AVX-512 F/BW only), and the W4A8 integer core with vpmaddubsw (the avx512 level; the
// VNNI levels use avx512_vnni_common.h's). Include only from a file compiled with at least the
// avx512 level's flags, inside that level's namespace (internal linkage).
//
// A u4 block's K group (8 codes of 32 columns, 128 bytes) is two zmm: 16 columns each, one
// 32-bit lane per column whose byte j holds code j (low nibble) and code j + 4 (high nibble).
// So `v & 0x0F` gives each lane the bytes of codes 0..3 and `(v >> 4) & 0x0F` those of 4..7.
#pragma once
#include "avx512_common.h"

namespace moepack {
namespace x86_avx512_u4 {
namespace {

using namespace x86_avx512;

// Software prefetch distance of the u4 kernels' code streams: a task streams one 32-column block
// (128 bytes per K group) and the L2 streamer stops at every 4 KiB page.
constexpr int kU4PrefetchBytes = 1024;

// 4 bytes at p broadcast to every 32-bit lane, as one load (vbroadcastss m32).
static inline __m512i bcast32(const void* p) {
  return _mm512_castps_si512(_mm512_broadcastss_ps(_mm_load_ss(static_cast<const float*>(p))));
}

// bf16 bits of the integers -15..15 at word index v + 15 (32 words: vpermw's table).
static inline __m512i u4_bf16_table() {
  alignas(64) static const uint16_t t[32] = {
      0xC170, 0xC160, 0xC150, 0xC140, 0xC130, 0xC120, 0xC110, 0xC100, 0xC0E0, 0xC0C0, 0xC0A0,
      0xC080, 0xC040, 0xC000, 0xBF80, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0,
      0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000};
  return _mm512_load_si512(t);
}

// The word index offsets 15 - z[n] of one K group, in the order the unpacked words come in:
// off[h] covers columns 8h..8h+7, four words per column (the column's codes j, j+1, j+2, j+3).
static inline void u4_offsets(const uint8_t* z, __m512i off[4]) {
  const __m512i zw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(z)));  // 32 words
  const __m512i fifteen = _mm512_set1_epi16(15);
  for (int h = 0; h < 4; ++h) {
    alignas(64) uint16_t idx[32];
    for (int w = 0; w < 32; ++w) idx[w] = uint16_t(8 * h + w / 4);
    off[h] = _mm512_sub_epi16(fifteen, _mm512_permutexvar_epi16(_mm512_load_si512(idx), zw));
  }
}

// One K group of one 16-column half (zmm v, columns 8*half2..8*half2+15): four zmm of bf16 pairs,
// lanes (2c, 2c + 1) = column c's pairs (codes 0-1, 2-3) for lo, (4-5, 6-7) for hi:
//   out[0] = lo pairs of columns 0..7 of the half, out[1] = lo pairs of columns 8..15,
//   out[2] = hi pairs of columns 0..7, out[3] = hi pairs of columns 8..15.
static inline void u4_group_pairs(__m512i v, const __m512i off_a, const __m512i off_b, const __m512i table, __m512i out[4]) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i lo = _mm512_and_si512(v, m4);
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
  const __m512i l0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo));
  const __m512i l1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1));
  const __m512i h0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi));
  const __m512i h1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1));
  out[0] = _mm512_permutexvar_epi16(_mm512_add_epi16(l0, off_a), table);
  out[1] = _mm512_permutexvar_epi16(_mm512_add_epi16(l1, off_b), table);
  out[2] = _mm512_permutexvar_epi16(_mm512_add_epi16(h0, off_a), table);
  out[3] = _mm512_permutexvar_epi16(_mm512_add_epi16(h1, off_b), table);
}

// W4A16 unpack: K values [k0, k0 + kk) (multiples of 8) of one u4 block -> the dense
// bf16_n32k2 block of (q - z[n]) (exactly the portable unpack_u4's values and order).
static inline void unpack_u4_avx512(const uint8_t* codes, int64_t k0, int64_t kk, const uint8_t* z, uint16_t* out) {
  const __m512i table = u4_bf16_table();
  __m512i off[4];
  u4_offsets(z, off);
  // dword lanes of a pairs register: (column c, pair p) at 2c + p; the dense block wants each
  // pair's 16 columns contiguous: even lanes of (A, B) then odd lanes.
  alignas(64) static const int32_t even_idx[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static const int32_t odd_idx[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i ev = _mm512_load_si512(even_idx), od = _mm512_load_si512(odd_idx);
  for (int64_t j = k0 / 8; j < (k0 + kk) / 8; ++j) {
    const __m512i* g = reinterpret_cast<const __m512i*>(codes + j * 128);
    uint16_t* o = out + (j * 8 - k0) / 2 * 64;  // pair (j*8 - k0)/2 .. +3 of the output, 64 words each
    // the code stream 1 KiB ahead, into L2 (qwen3 T=512 W4A16 through tiles: 70 -> 48 ms)
    _mm_prefetch(reinterpret_cast<const char*>(g) + kU4PrefetchBytes, _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(g) + kU4PrefetchBytes + 64, _MM_HINT_T1);
    for (int half = 0; half < 2; ++half) {
      __m512i p[4];
      u4_group_pairs(_mm512_loadu_si512(g + half), off[2 * half], off[2 * half + 1], table, p);
      // p[0], p[1]: columns 16*half + 0..15, pairs 0 and 1 (interleaved); p[2], p[3]: pairs 2, 3
      __m512i* dst = reinterpret_cast<__m512i*>(o) + half;  // 16 columns of a pair = 64 bytes
      _mm512_storeu_si512(dst + 0, _mm512_permutex2var_epi32(p[0], ev, p[1]));  // pair 0
      _mm512_storeu_si512(dst + 2, _mm512_permutex2var_epi32(p[0], od, p[1]));  // pair 1
      _mm512_storeu_si512(dst + 4, _mm512_permutex2var_epi32(p[2], ev, p[3]));  // pair 2
      _mm512_storeu_si512(dst + 6, _mm512_permutex2var_epi32(p[2], od, p[3]));  // pair 3
    }
  }
}

// The grouped decode streams of the int4 kernels (gemm_u4a8_streams, gemm_u4a16_bf16_streams with
// ng = kp / G > 1 groups, ng % S == 0): the block's groups dealt to S segments of ng / S; round t
// runs begin(), then group u * (ng / S) + t of every segment u, its K steps interleaved across the
// segments (step(u, j) for K step j, each prefetched by prefetch_segment), then end(u, g) for
// each segment's group g. Each round first prefetches the next round's scale and zero rows (one
// line each, a page apart: not streamed); past the last round, the next block's first ones (32
// columns on in the same rows).
template <int S, class Begin, class Step, class End>
static inline void for_group_streams(const uint8_t* codes, const float* scale, const uint8_t* zero, int64_t gstride,
                                     int64_t kp, int64_t G, Begin&& begin, Step&& step, End&& end) {
  const int64_t rounds = kp / G / S, gj = G / 8, seg_bytes = rounds * G * 16;  // a segment's bytes of codes
  for (int64_t t = 0; t < rounds; ++t) {
    begin();
    for (int u = 0; u < S; ++u) {
      const int64_t off = t + 1 < rounds ? (u * rounds + t + 1) * gstride : u * rounds * gstride + 32;
      _mm_prefetch(reinterpret_cast<const char*>(scale + off), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scale + off + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(zero + off), _MM_HINT_T0);
    }
    for (int64_t jj = 0; jj < gj; ++jj) {
#pragma GCC unroll 4
      for (int u = 0; u < S; ++u) {
        const int64_t j = (u * rounds + t) * gj + jj;
        prefetch_segment(codes, j * 128, (u + 1) * seg_bytes, kp * 16 - seg_bytes, 2);
        step(u, j);
      }
    }
    for (int u = 0; u < S; ++u) end(u, u * rounds + t);
  }
}

// The W4A8 integer core with vpmaddubsw (u8 codes x s8 rows -> i16 pairs, exact: 2 x 15 x 128)
// and vpmaddwd: acc[r][h] (16 columns each) += the K groups [j0, j1) of the block.
template <int MR>
static inline void u4a8_acc_bw(const int8_t* const* x, const uint8_t* codes, int64_t j0, int64_t j1, __m512i acc[][2]) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi16(1);
  for (int64_t j = j0; j < j1; ++j) {
    const __m512i* g = reinterpret_cast<const __m512i*>(codes + j * 128);
    const __m512i w0 = _mm512_loadu_si512(g), w1 = _mm512_loadu_si512(g + 1);
    const __m512i l0 = _mm512_and_si512(w0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), m4);
    const __m512i l1 = _mm512_and_si512(w1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), m4);
    for (int r = 0; r < MR; ++r) {
      uint32_t a, b;
      std::memcpy(&a, x[r] + 8 * j, 4);
      std::memcpy(&b, x[r] + 8 * j + 4, 4);
      const __m512i xl = _mm512_set1_epi32(int(a)), xh = _mm512_set1_epi32(int(b));
      const __m512i p0 = _mm512_add_epi16(_mm512_maddubs_epi16(l0, xl), _mm512_maddubs_epi16(h0, xh));
      const __m512i p1 = _mm512_add_epi16(_mm512_maddubs_epi16(l1, xl), _mm512_maddubs_epi16(h1, xh));
      acc[r][0] = _mm512_add_epi32(acc[r][0], _mm512_madd_epi16(p0, ones));
      acc[r][1] = _mm512_add_epi32(acc[r][1], _mm512_madd_epi16(p1, ones));
    }
  }
}

// One group's zero points and scales of a block (columns 0-15, 16-31), and the W4A8 group
// epilogue of one row: c += float(acc - z[n] * xs) * s[n], xs = the row's code sum over the group.
struct U4GroupParams {
  __m512i z0, z1;
  __m512 s0, s1;
};
static inline U4GroupParams u4_group_params(const uint8_t* zero, const float* scale, int64_t gstride, int64_t g) {
  const uint8_t* z = zero + g * gstride;
  const float* s = scale + g * gstride;
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z))),
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z + 16))), _mm512_loadu_ps(s),
          _mm512_loadu_ps(s + 16)};
}
static inline void u4a8_group_add(const U4GroupParams& p, __m512i a0, __m512i a1, int32_t xs, __m512& c0, __m512& c1) {
  const __m512i x = _mm512_set1_epi32(xs);
  c0 = _mm512_add_ps(c0, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a0, _mm512_mullo_epi32(p.z0, x))), p.s0));
  c1 = _mm512_add_ps(c1, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a1, _mm512_mullo_epi32(p.z1, x))), p.s1));
}

// The fused W4A8 block GEMM (docs/SEMANTICS.md §3, moepack/reference.py int4_linear_a8_reference):
// per group g, C += float(acc_g - z[g, n] * sum_g(x)) * s[g, n]; at the end C *= the row's
// activation scale; sum_g(x) is xsum[r * ng + g], given (the driver's A8RowSums: summed
// once per row, not per block). Acc(MR, x, codes, j0, j1, acc) adds the K groups [j0, j1) into acc[MR][2].
template <int MR, class Acc>
static inline void gemm_u4a8_tile(const int8_t* const* x, const float* rs, const uint8_t* codes, const float* scale,
                                  const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum, float* C,
                                  Acc acc_fn) {
  const int64_t ng = (kp + G - 1) / G;
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kk = (k0 + G < kp ? k0 + G : kp) - k0;
    __m512i acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    acc_fn(x, codes, k0 / 8, (k0 + kk) / 8, acc);
    const U4GroupParams p = u4_group_params(zero, scale, gstride, g);
    for (int r = 0; r < MR; ++r) u4a8_group_add(p, acc[r][0], acc[r][1], xsum[r * ng + g], c[r][0], c[r][1]);
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 a = _mm512_set1_ps(rs[r]);
    _mm512_storeu_ps(C + r * 32, _mm512_mul_ps(c[r][0], a));
    _mm512_storeu_ps(C + r * 32 + 16, _mm512_mul_ps(c[r][1], a));
  }
}

// Rows in tiles of up to 4 (acc[4][2] + the weights' 4 registers fit the 32 zmm).
template <template <int> class AccT>
static inline void gemm_u4a8_rows(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const float* scale,
                                  const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum, float* C) {
  const int64_t ng = (kp + G - 1) / G;
  int i = 0;
  for (; i + 4 <= m; i += 4) gemm_u4a8_tile<4>(x + i, rs + i, codes, scale, zero, gstride, kp, G, xsum + i * ng, C + i * 32, AccT<4>{});
  switch (m - i) {
    case 3: gemm_u4a8_tile<3>(x + i, rs + i, codes, scale, zero, gstride, kp, G, xsum + i * ng, C + i * 32, AccT<3>{}); break;
    case 2: gemm_u4a8_tile<2>(x + i, rs + i, codes, scale, zero, gstride, kp, G, xsum + i * ng, C + i * 32, AccT<2>{}); break;
    case 1: gemm_u4a8_tile<1>(x + i, rs + i, codes, scale, zero, gstride, kp, G, xsum + i * ng, C + i * 32, AccT<1>{}); break;
    default: break;
  }
}

// The integer core as the test hook sees it (U4BlockDotFn): acc[i * 32 + n] over K [k0, k0 + kk).
template <template <int> class AccT>
static inline void dot_u4_rows(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* out) {
  for (int i = 0; i < m; ++i) {
    __m512i acc[1][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()}};
    AccT<1>{}(x + i, codes, k0 / 8, (k0 + kk) / 8, acc);
    _mm512_storeu_si512(out + i * 32, acc[0][0]);
    _mm512_storeu_si512(out + i * 32 + 16, acc[0][1]);
  }
}

template <int MR>
struct AccBw {
  void operator()(const int8_t* const* x, const uint8_t* codes, int64_t j0, int64_t j1, __m512i acc[][2]) const {
    u4a8_acc_bw<MR>(x, codes, j0, j1, acc);
  }
};

}  // namespace
}  // namespace x86_avx512_u4
}  // namespace moepack
