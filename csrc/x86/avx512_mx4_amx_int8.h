// The W4A8 tile kernel of the mxfp4 layout for the amx_int8 level (moe_amx_int8.cpp): many s8 rows
// against one mx4 block through tdpbssd, with the per-group e8m0 scales folded into the integer
// weights where that is exact. Include only from a file compiled with the amx_int8 level's flags
// (after avx512_mx4_vnni.h), inside that level's namespace (internal linkage).
//
// The folding (docs/KERNELS.md, "A8 on AMX"): 2 * e2m1(q) is an integer in [-12, 12]. Over a K
// chunk of a block, let e_min[n] be the smallest e8m0 byte of column n among the chunk's groups.
// Where every column's bytes lie within kMx4A8MaxShift = 3 of its e_min, the weights
// (2 * e2m1(q)) << (e[g, n] - e_min[n]) are exact s8 values (|12 << 3| = 96), so one tdpbssd pass
// over the chunk gives the exact integer sum_g acc_g * 2^(e[g, n] - e_min[n]) (|.| <= 128 * 96 *
// 256 < 2^24: its float is exact too), and one fp32 scale 2^(e_min[n] - 128) per chunk gives the
// chunk's term exactly (a normal fp32 number: e_min >= kMx4A8FoldMinE) where the per-group path
// adds the groups' terms one at a time. So a folded chunk is the exact sum of its groups' terms,
// rounded once to fp32: the result differs from the per-group order only in fp32 rounding.
// Where every column folds over the whole K (one e_min per column for the block), each row group's
// integer sums accumulate in the int32 C tiles over the whole K and one epilogue ends the block
// (the sum's float then rounds once where above 2^24): one row group decodes 64-K steps into a
// small ring two steps ahead of its tile loads; more decode the block once into a per-thread buffer
// that every row group reads. Otherwise each 256-K chunk that folds is one piece.
// A chunk that does not fold is split into sub-chunks of 64 K (two groups, one tile K step),
// each folded where it fits; a sub-chunk that does not fit (or the last group of an odd count)
// takes the per-group path (Mx4AccVnni, the group's term added to C), as gemm_mx4a8_tile does.
// Terms are added to C chunk by chunk, sub-chunk by sub-chunk, group by group, in K order; the row
// scale multiplies C at the end.
#pragma once
#include <cstdlib>

#include "amx_common.h"
#include "avx512_mx4_vnni.h"

namespace moepack {
namespace x86_avx512_mx4_amx8 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_mx4;
using namespace x86_amx;

MOEPACK_AMX_DP(Mx4DpS8, _tile_dpbssd);

constexpr int64_t kMx4A8ChunkK = 256;  // K per folded chunk (8 groups; the unpacked weights: 8 KiB)
constexpr int64_t kMx4A8SubK = 64;     // K per sub-chunk of a chunk that does not fold (one tile K step)
constexpr int kMx4A8MaxShift = 3;      // 12 << 3 = 96 fits s8
// e_min >= 2: 2^(e_min - 128) is a normal fp32 number (the chunk's term exact); e_max <= 230: a
// 256-K chunk's term (|acc| < 2^22) stays below 2^125. (A piece's term is its exact sum rounded
// once, so it overflows only where that sum does.)
constexpr int kMx4A8FoldMinE = 2, kMx4A8FoldMaxE = 230;
constexpr int kMx4A8MaxRows = 64;  // the driver's chunks (kChunkM)
constexpr int kMx4A8PrefetchBytes = int(kMx4A8ChunkK) * 16;  // the code stream's prefetch distance: one chunk
constexpr int kMx4A8PrefetchL1 = 1024;  // and its distance into L1 (one 64-K step of codes)
constexpr int64_t kMx4A8Ring = 4, kMx4A8Ahead = 2;  // the one-row-group pass: 64-K steps in the ring, decoded ahead
static_assert(kMx4A8Ring > kMx4A8Ahead, "the ring must hold the step being read and the steps decoded ahead");
constexpr int64_t kMx4A8MaxK = 16384;  // longer K: the vpdpbusd path (the per-chunk plan is on the stack)

// Whether groups [g0, g0 + ng) of the block fold (every column's e8m0 bytes within
// kMx4A8MaxShift of their minimum, all in [kMx4A8FoldMinE, kMx4A8FoldMaxE]); emin: the columns'
// minimum bytes.
static inline bool mx4a8_fits(const uint8_t* scale, int64_t gstride, int64_t g0, int64_t ng, __m256i& emin) {
  __m256i lo = _mm256_set1_epi8(char(0xFF)), hi = _mm256_setzero_si256();
  for (int64_t g = g0; g < g0 + ng; ++g) {
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * gstride));
    lo = _mm256_min_epu8(lo, e);
    hi = _mm256_max_epu8(hi, e);
  }
  emin = lo;
  const __m256i span = _mm256_sub_epi8(hi, lo);  // hi >= lo: no wrap
  const __m256i ok_span = _mm256_cmpeq_epi8(_mm256_max_epu8(span, _mm256_set1_epi8(kMx4A8MaxShift)),
                                            _mm256_set1_epi8(kMx4A8MaxShift));
  const __m256i ok_lo = _mm256_cmpeq_epi8(_mm256_max_epu8(lo, _mm256_set1_epi8(kMx4A8FoldMinE)), lo);
  const __m256i ok_hi = _mm256_cmpeq_epi8(_mm256_min_epu8(hi, _mm256_set1_epi8(char(kMx4A8FoldMaxE))), hi);
  return _mm256_movemask_epi8(_mm256_and_si256(_mm256_and_si256(ok_span, ok_lo), ok_hi)) == -1;
}

// The folded s8 weights (2 * e2m1(q)) << s at byte s * 16 + q, s = 0..kMx4A8MaxShift (vpermb's
// 64-byte table: its index is 6 bits, shift and code).
static inline __m512i mx4_s8_shift_table() {
  alignas(64) static const int8_t t[64] = {0, 1, 2,  3,  4,  6,  8,  12, 0, -1, -2,  -3,  -4,  -6,  -8,  -12,
                                           0, 2, 4,  6,  8,  12, 16, 24, 0, -2, -4,  -6,  -8,  -12, -16, -24,
                                           0, 4, 8,  12, 16, 24, 32, 48, 0, -4, -8,  -12, -16, -24, -32, -48,
                                           0, 8, 16, 24, 32, 48, 64, 96, 0, -8, -16, -24, -32, -48, -64, -96};
  return _mm512_load_si512(t);
}

// vpermb indices that spread the shift bytes of 16 columns (h = 0: columns 0-15, 1: 16-31) to
// the 4 bytes of each column's 32-bit lane.
static inline __m512i mx4a8_spread(int h) {
  alignas(64) int8_t idx[64];
  for (int i = 0; i < 64; ++i) idx[i] = int8_t(16 * h + i / 4);
  return _mm512_load_si512(idx);
}

// K [k1, k1 + kk) (whole groups) of one mx4 block -> the s8 weights (2 * e2m1(q)) << (e[g, n] -
// emin[n]) in the i8_n32k4 order tdpbssd's B tiles take (per K step of 8: the low nibbles are the
// first quad of 32 columns, the high nibbles the second), at w (K step j - k1 / 8 at 256 bytes
// each). One vpermb per 64 codes looks the value up by (shift, code): the byte's nibble with its
// column's shift * 16 OR-ed in (one vpternlogd), exact for the shifts mx4a8_fits admits.
static inline void unpack_mx4_s8_folded(const uint8_t* codes, const uint8_t* scale, int64_t gstride, int64_t k1, int64_t kk,
                                        __m256i emin, int8_t* w) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), t = mx4_s8_shift_table();
  const __m512i sp0 = mx4a8_spread(0), sp1 = mx4a8_spread(1);
  for (int64_t g = k1 / kMx4Group; g < (k1 + kk) / kMx4Group; ++g) {
    // the next column block's scale bytes of this group (32 bytes on: the block a worker usually
    // takes next), into L1 while this block decodes: the block's first look at its scale rows
    // (mx4a8_fits: one line per group, gstride apart) otherwise waits on their misses
    _mm_prefetch(reinterpret_cast<const char*>(scale + g * gstride + 32), _MM_HINT_T0);
    const __m256i sh = _mm256_sub_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * gstride)), emin);
    const __m512i shz = _mm512_castsi256_si512(sh);  // the upper half is never indexed (indices < 32)
    // per column half: the column's shift * 16 in every byte of its lane (shift <= 3: no carry
    // across bytes)
    const __m512i s16[2] = {_mm512_slli_epi16(_mm512_permutexvar_epi8(sp0, shz), 4),
                            _mm512_slli_epi16(_mm512_permutexvar_epi8(sp1, shz), 4)};
    for (int64_t j = g * (kMx4Group / 8); j < (g + 1) * (kMx4Group / 8); ++j) {
      const __m512i* src = reinterpret_cast<const __m512i*>(codes + j * 128);
      // the code stream one chunk (4 KiB) ahead, into L2, spread over the decode: past the block's
      // end, the next block's (the one a worker usually takes next). A burst of the next chunk's
      // 64 lines at the chunk's start instead stalled on the fill buffers (a quarter of the
      // kernel's samples); 1 KiB ahead left the tile pass waiting for the codes. Then the same
      // lines from L2 into L1 kMx4A8PrefetchL1 ahead (one 64-K step: 2.4-2.6% on qwen3-30b-a3b
      // T=512; 2 KiB ahead 1% less), so that the decode's loads hit L1.
      _mm_prefetch(reinterpret_cast<const char*>(src) + kMx4A8PrefetchBytes, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(src) + kMx4A8PrefetchBytes + 64, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(src) + kMx4A8PrefetchL1, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(src) + kMx4A8PrefetchL1 + 64, _MM_HINT_T0);
      __m512i* dst = reinterpret_cast<__m512i*>(w + (j - k1 / 8) * 256);
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(src + h);
        // (v & 0x0F) | s16: imm 0xEA = (A & B) | C
        const __m512i lo = _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(v, m4, s16[h], 0xEA), t);
        const __m512i hi = _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), m4, s16[h], 0xEA), t);
        _mm512_store_si512(dst + h, lo);
        _mm512_store_si512(dst + 2 + h, hi);
      }
    }
  }
}

// 2^(emin[n] - 128) for columns 0-15 (s0) and 16-31 (s1); emin in [kMx4A8FoldMinE,
// kMx4A8FoldMaxE]: the scale is the normal fp32 with exponent field emin - 1.
static inline void mx4a8_fold_scales(__m256i emin, __m512& s0, __m512& s1) {
  const __m512i one = _mm512_set1_epi32(1);
  s0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(emin)), one), 23));
  s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(emin, 1)), one), 23));
}

// C[i, n] += float(acc[i, n]) * 2^(emin[n] - 128) for m rows (the folded piece's term).
static inline void mx4a8_fold_add(const int32_t* acc, int m, __m256i emin, float* C) {
  __m512 s0, s1;
  mx4a8_fold_scales(emin, s0, s1);
  for (int i = 0; i < m; ++i) {
    const int32_t* a = acc + int64_t(i) * 32;
    float* c = C + int64_t(i) * 32;
    _mm512_storeu_ps(c, _mm512_add_ps(_mm512_loadu_ps(c), _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a)), s0)));
    _mm512_storeu_ps(c + 16,
                     _mm512_add_ps(_mm512_loadu_ps(c + 16), _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + 16)), s1)));
  }
}

// C[i, n] = (0 + float(acc[i, n]) * 2^(emin[n] - 128)) * rs[i]: the whole block's one folded
// term added to the zero C, then the row scale (mx4a8_fold_add and the row scales in one pass).
static inline void mx4a8_scale_rows(const int32_t* acc, int m, __m256i emin, const float* rs, float* C) {
  __m512 s0, s1;
  mx4a8_fold_scales(emin, s0, s1);
  const __m512 zero = _mm512_setzero_ps();
  for (int i = 0; i < m; ++i) {
    const int32_t* a = acc + int64_t(i) * 32;
    float* c = C + int64_t(i) * 32;
    const __m512 r = _mm512_set1_ps(rs[i]);
    _mm512_storeu_ps(c, _mm512_mul_ps(_mm512_add_ps(zero, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a)), s0)), r));
    _mm512_storeu_ps(c + 16,
                     _mm512_mul_ps(_mm512_add_ps(zero, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + 16)), s1)), r));
  }
}

// Group g's terms of MR rows added to C (the per-group path: gemm_mx4a8_tile's values, its order).
template <int MR>
static inline void mx4a8_group_rows(const int8_t* const* x, const uint8_t* codes, const uint8_t* scale, int64_t gstride,
                                    int64_t g, int64_t ng, const int32_t* xsum, float* C) {
  __m512i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  Mx4AccVnni<MR>{}(x, codes, g * (kMx4Group / 8), (g + 1) * (kMx4Group / 8), acc);
  const uint8_t* e = scale + g * gstride;
  const __m512 s0 = mx4_scale16<128>(e), s1 = mx4_scale16<128>(e + 16);
  for (int r = 0; r < MR; ++r) {
    float* c = C + r * 32;
    __m512 c0 = _mm512_loadu_ps(c), c1 = _mm512_loadu_ps(c + 16);
    mx4a8_group_add(s0, s1, acc[r][0], acc[r][1], xsum[r * ng + g], c0, c1);
    _mm512_storeu_ps(c, c0);
    _mm512_storeu_ps(c + 16, c1);
  }
}

// Group g for m rows: 8-row tiles, the rest in one.
static inline void mx4a8_group(const int8_t* const* x, int m, const uint8_t* codes, const uint8_t* scale, int64_t gstride,
                               int64_t g, int64_t ng, const int32_t* xsum, float* C) {
  int i = 0;
  for (; i + 8 <= m; i += 8) mx4a8_group_rows<8>(x + i, codes, scale, gstride, g, ng, xsum + i * ng, C + i * 32);
  const int8_t* const* xr = x + i;
  const int32_t* xs = xsum + i * ng;
  float* c = C + i * 32;
  switch (m - i) {
    case 7: mx4a8_group_rows<7>(xr, codes, scale, gstride, g, ng, xs, c); break;
    case 6: mx4a8_group_rows<6>(xr, codes, scale, gstride, g, ng, xs, c); break;
    case 5: mx4a8_group_rows<5>(xr, codes, scale, gstride, g, ng, xs, c); break;
    case 4: mx4a8_group_rows<4>(xr, codes, scale, gstride, g, ng, xs, c); break;
    case 3: mx4a8_group_rows<3>(xr, codes, scale, gstride, g, ng, xs, c); break;
    case 2: mx4a8_group_rows<2>(xr, codes, scale, gstride, g, ng, xs, c); break;
    case 1: mx4a8_group_rows<1>(xr, codes, scale, gstride, g, ng, xs, c); break;
    default: break;
  }
}

// The decoded weights of a whole block (kp * 32 bytes), one buffer per thread, grown as needed
// (kp <= kMx4A8MaxK: at most 512 KiB); nullptr where it cannot be allocated.
static inline int8_t* mx4a8_block_buffer(int64_t kp) {
  struct Buf {
    int8_t* p = nullptr;
    int64_t cap = 0;
    ~Buf() { std::free(p); }
  };
  static thread_local Buf b;
  const int64_t need = kp * 32;  // kp % 64 == 0: a multiple of 64 bytes
  if (need > b.cap) {
    std::free(b.p);
    b.p = static_cast<int8_t*>(std::aligned_alloc(64, size_t(need)));
    b.cap = b.p ? need : 0;
  }
  return b.p;
}

// acc[m, 32] = the exact integer sums x . ((2 * e2m1(q)) << (e[g, n] - emin[n])) over the whole
// K of a block that folds over its whole K (kp % 64 == 0, kp <= kMx4A8MaxK, m <= kMx4A8MaxRows):
// one pass of tdpbssd per row group (32 rows) with its C tiles held across the whole K. The first
// row group decodes the block into w (kMx4A8Ahead 64-K tile steps ahead of the tile loads with one
// row group, one step with two, so that the decode of a later step overlaps the tile unit's work on
// this one); further row groups read the decoded block back. The row groups run in the order that starts with the tile configuration
// already loaded (a configuration load costs about a microsecond in a KVM guest).
static inline void mx4a8_whole_block(TileState& tiles, const int8_t* x0, int64_t stride, int m, const uint8_t* codes,
                                     const uint8_t* scale, int64_t gstride, int64_t kp, __m256i emin, int8_t* w,
                                     int32_t* acc) {
  const int64_t nsteps = kp / kMx4A8SubK;
  const int ngroups = (m + 31) / 32;
  const int last_rows = m - 32 * (ngroups - 1);
  const bool last_first = ngroups > 1 && tiles.loaded == last_rows;
  for (int gi = 0; gi < ngroups; ++gi) {
    const int rg = last_first ? (gi == 0 ? ngroups - 1 : gi - 1) : gi;
    const int r0 = 32 * rg, rows = m - r0 < 32 ? m - r0 : 32;
    const bool two = rows > 16, decode = gi == 0;
    tiles.group(rows);
    const char* a0 = reinterpret_cast<const char*>(x0 + int64_t(r0) * stride);
    const char* a1 = a0 + 16 * stride;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    // one row group: the decoded steps in a ring of kMx4A8Ring steps (8 KiB, stays in L1), written
    // kMx4A8Ahead steps before the tile loads read them; more: the whole block in w, reread
    const bool ring = ngroups == 1;
    const int64_t ahead = ring ? kMx4A8Ahead : 1;
    auto slot = [&](int64_t st) { return w + (ring ? st % kMx4A8Ring : st) * kMx4A8SubK * 32; };
    if (decode) {
      for (int64_t st = 0; st < ahead && st < nsteps; ++st)
        unpack_mx4_s8_folded(codes, scale, gstride, st * kMx4A8SubK, kMx4A8SubK, emin, slot(st));
      // GCC's _tile_loadd is an asm without a memory clobber: tell the compiler the tile loads
      // below read what was just stored
      asm volatile("" ::: "memory");
    }
    for (int64_t s = 0; s < nsteps; ++s) {
      if (decode && s + ahead < nsteps)
        unpack_mx4_s8_folded(codes, scale, gstride, (s + ahead) * kMx4A8SubK, kMx4A8SubK, emin, slot(s + ahead));
      asm volatile("" ::: "memory");  // the stores above before the tile loads (see the prologue)
      const char* b = reinterpret_cast<const char*>(slot(s));
      _tile_loadd(6, b, 128);
      _tile_loadd(7, b + 64, 128);
      _tile_loadd(4, a0 + s * kMx4A8SubK, stride);
      Mx4DpS8::c00();
      Mx4DpS8::c01();
      if (two) {
        _tile_loadd(5, a1 + s * kMx4A8SubK, stride);
        Mx4DpS8::c10();
        Mx4DpS8::c11();
      }
    }
    int32_t* c = acc + int64_t(r0) * 32;
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (two) {
      _tile_stored(2, c + 16 * 32, 128);
      _tile_stored(3, c + 16 * 32 + 16, 128);
    }
  }
}

// C[m, 32] of s8 rows that are one matrix (row i at x[0] + i * stride, stride >= kp), 2 <= m <=
// kMx4A8MaxRows, kp % 32 == 0, kp <= kMx4A8MaxK, some (sub-)chunk folding: the W4A8 block GEMM
// (docs/SEMANTICS.md: int4_linear_a8_reference with w_q = 2 * e2m1(q), zero 0, scale 2^(e - 128);
// the folded chunks' terms rounded once, above), C *= rs at the end. False (nothing written) for
// other calls. xsum: the rows' group sums, asked for only by the per-group path (the folded tile
// passes multiply signed weights and do not read them).
static inline bool gemm_mx4a8_amx(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                                  int64_t gstride, int64_t kp, const A8Sums& xsum, float* C) {
  if (m < 2 || m > kMx4A8MaxRows || kp % kMx4Group) return false;
  const int64_t stride = x[1] - x[0];
  if (stride < kp || x[m - 1] != x[0] + int64_t(m - 1) * stride) return false;
  const int64_t ng = kp / kMx4Group;
  if (kp > kMx4A8MaxK) return false;
  alignas(64) int32_t acc[kMx4A8MaxRows * 32];
  TileState local;
  TileState& tiles = tile_state(local);
  __m256i emin;
  const bool whole = kp % kMx4A8SubK == 0 && mx4a8_fits(scale, gstride, 0, ng, emin);
  if (whole) {
    alignas(64) int8_t wring[kMx4A8Ring * kMx4A8SubK * 32];
    if (int8_t* wb = m <= 32 ? wring : mx4a8_block_buffer(kp)) {
      // every column folds over the whole K (real checkpoints' blocks mostly do): one e_min per
      // column for the block, its integer sums accumulated in the C tiles over the whole K (exact:
      // |.| <= 128 * 96 * kp < 2^31), one epilogue (the sum's float rounds once where above 2^24)
      mx4a8_whole_block(tiles, x[0], stride, m, codes, scale, gstride, kp, emin, wb, acc);
      mx4a8_scale_rows(acc, m, emin, rs, C);
      return true;
    }
  }
  alignas(64) int8_t w[kMx4A8ChunkK / 4 * 128];
  for (int i = 0; i < m * 32; ++i) C[i] = 0.0f;
  // the folded pass over K [k1, k1 + kk) (kk a multiple of 64), its term added to C
  auto fold = [&](int64_t k1, int64_t kk, __m256i emin) {
    unpack_mx4_s8_folded(codes, scale, gstride, k1, kk, emin, w);
    tile_rows<Mx4DpS8>(tiles, reinterpret_cast<const char*>(x[0] + k1), stride, m, reinterpret_cast<const char*>(w), kk / 4,
                       false, acc);
    mx4a8_fold_add(acc, m, emin, C);
  };
  // the block's scale rows, one line each and a column count apart: every row's load issued at
  // once (the whole-chunk checks), so that their misses overlap; the checks below then hit L1
  constexpr int kMaxChunks = kMx4A8MaxK / kMx4A8ChunkK;
  const int64_t nc = (kp + kMx4A8ChunkK - 1) / kMx4A8ChunkK;
  if (nc > kMaxChunks) return false;
  __m256i cmin[kMaxChunks];
  bool cfit[kMaxChunks];
  bool any = false;
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t c0 = c * kMx4A8ChunkK, kk = kp - c0 < kMx4A8ChunkK ? kp - c0 : kMx4A8ChunkK;
    cfit[c] = mx4a8_fits(scale, gstride, c0 / kMx4Group, kk / kMx4Group, cmin[c]) && kk % kMx4A8SubK == 0;
    for (int64_t s0 = c0; !cfit[c] && !any && s0 + kMx4A8SubK <= c0 + kk; s0 += kMx4A8SubK) {
      __m256i unused;
      any = mx4a8_fits(scale, gstride, s0 / kMx4Group, kMx4A8SubK / kMx4Group, unused);
    }
    any = any || cfit[c];
  }
  // nothing folds (scales far apart, or at the extremes): the vpdpbusd path reads the block once
  // per 8 rows, as the per-group path here would, without its C round trips
  if (!any) return false;
  if (whole) {  // no buffer for the block
    // every column folds over the whole K (real checkpoints' blocks mostly do): one e_min per
    // column for the block, the chunks' integer sums accumulated in the C tiles (exact: |.| <=
    // 128 * 96 * kp < 2^31), one epilogue (the sum's float rounds once where above 2^24)
    for (int64_t c0 = 0; c0 < kp; c0 += kMx4A8ChunkK) {
      const int64_t kk = kp - c0 < kMx4A8ChunkK ? kp - c0 : kMx4A8ChunkK;
      unpack_mx4_s8_folded(codes, scale, gstride, c0, kk, emin, w);
      tile_rows<Mx4DpS8>(tiles, reinterpret_cast<const char*>(x[0] + c0), stride, m, reinterpret_cast<const char*>(w), kk / 4,
                         c0 != 0, acc);
    }
    mx4a8_fold_add(acc, m, emin, C);
  } else {
  for (int64_t c0 = 0; c0 < kp; c0 += kMx4A8ChunkK) {
    const int64_t kk = kp - c0 < kMx4A8ChunkK ? kp - c0 : kMx4A8ChunkK;
    if (cfit[c0 / kMx4A8ChunkK]) {
      fold(c0, kk, cmin[c0 / kMx4A8ChunkK]);
      continue;
    }
    for (int64_t s0 = c0; s0 < c0 + kk; s0 += kMx4A8SubK) {
      const int64_t sk = c0 + kk - s0 < kMx4A8SubK ? c0 + kk - s0 : kMx4A8SubK;
      if (sk == kMx4A8SubK && mx4a8_fits(scale, gstride, s0 / kMx4Group, sk / kMx4Group, emin)) {
        fold(s0, sk, emin);
      } else {
        // the per-group path reads the rows' group sums (u8 weights): made here, at its first group
        for (int64_t g = s0 / kMx4Group; g < (s0 + sk) / kMx4Group; ++g)
          mx4a8_group(x, m, codes, scale, gstride, g, ng, xsum.get(), C);
      }
    }
  }
  }
  for (int i = 0; i < m; ++i) {  // the row scales last
    const __m512 a = _mm512_set1_ps(rs[i]);
    float* c = C + int64_t(i) * 32;
    _mm512_storeu_ps(c, _mm512_mul_ps(_mm512_loadu_ps(c), a));
    _mm512_storeu_ps(c + 16, _mm512_mul_ps(_mm512_loadu_ps(c + 16), a));
  }
  return true;
}

}  // namespace
}  // namespace x86_avx512_mx4_amx8
}  // namespace moepack
