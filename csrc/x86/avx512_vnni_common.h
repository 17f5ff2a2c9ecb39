// The AVX-512 VNNI micro-kernels (vpdpbusd) for layout i8_n32k4_x86, shared by the levels that
// have AVX512_VNNI: avx512_vnni (moe_avx512_vnni.cpp: rows stored as u8) and amx_int8
// (moe_amx_int8.cpp: signed rows, for chunks too short for tiles). Include only from a file
// compiled with -mavx512vnni, inside that level's namespace (internal linkage).
#pragma once
#include <cstring>

#include "avx512_common.h"

namespace moepack {
namespace x86_avx512_vnni {
namespace {

using namespace x86_avx512;

// ---- int8 layouts (AVX512_VNNI): vpdpbusd, u8 x s8 ------------------------------------------
// One block of i8_n32k4_x86 is [Kp/4][32 columns][4] int8: per K quad 128 bytes = 2 zmm whose
// 32-bit lanes hold w[n][k..k+3]; the row's 4 codes are broadcast to every lane. vpdpbusd takes
// one unsigned and one signed operand, and both codes are signed, so one of them gets an offset of
// 128. These kernels offset the weights: u = w ^ 0x80 = w + 128 as u8 (one vpxord per weight
// vector, shared by the tile's rows, on a port the dot products leave free), the rows are the
// signed operand, and
//   acc = sum (w + 128) q = sum q w + 128 sum_k q[k],  so the exact result is acc - 128 rowsum.
// The correction is the row's own code sum (i8_row_sum, kp / 64 steps per row): nothing of the
// pack's stored column sums (w13_colsum, w2_colsum) is read, so a pack whose stored sums disagree
// with its codes gives every level the same exact products (docs/KERNELS.md "int8 column sums").
// vpdpbusd adds the four u8 x s8 products (each |.| <= 255 * 128) into the i32 lane without
// saturating (it is vpdpbusds that saturates); int32 wraparound cancels in the subtraction.
// kRowXor: how the rows are stored: 0 for u8 = q + 128 (MK::kI8RowsU8: the avx512_vnni level),
// 0x80808080 for signed codes (amx_int8); each code word is XORed with kRowXor ^ 0x80808080 to give
// the signed codes (nothing for signed rows).
// `nl`: the next block's lines this tile prefetches (NextLines).
//
// u8 rows (kRowXor = 0) with 8 or more rows take gemm_i8_tile_u8 instead: the rows are the
// unsigned operand as stored and the weights the signed operand as packed,
//   acc = sum (q + 128) w = sum q w + 128 colsum(w),
// and colsum(w) of the block's 32 columns is computed from the codes once per call (i8_col_sums,
// 2 vpdpbusd per K quad, shared by all the call's rows). Per K quad and MR rows that leaves MR
// vpbroadcastd loads (load ports only) beside the 2 MR dot products, where gemm_i8_tile also
// needs 2 weight XORs and, per row, a scalar XOR and a broadcast from a general register (both
// on the vector ports the dot products use). Bare-tile bench (tools/bench_tile_i8.cpp, kp =
// 2048, 32 rows, one thread, L2-resident blocks, under load): 421-448 -> 624-646 GOP/s
// against a vpdpbusd peak of 945-971, 0.81-0.83 core cycles per vpdpbusd against 0.54
// (docs/BENCH.md "Prefill without AMX").

// vpdpbusd with its accumulator tied to one register. GCC 12 compiled the intrinsic in the MR = 8
// tile into a register copy before and after each dot product, and spilled accumulators to the
// stack; the asm keeps each accumulator in place. (The emulated build keeps the intrinsic.)
static inline __m512i dpbusd(__m512i acc, __m512i u8v, __m512i s8v) {
#if defined(MOEPACK_EMULATE_AVX512)
  return _mm512_dpbusd_epi32(acc, u8v, s8v);
#else
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8v), "v"(s8v));
  return acc;
#endif
}

// 128 colsum(w) of one block's 32 columns (two halves), from its codes: vpdpbusd of ones (u8)
// against the signed weights, four chains.
static inline void i8_col_sums128(const int8_t* B, int64_t kp, __m512i& c0, __m512i& c1) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const int64_t nq = kp / 4;
  int64_t kq = 0;
  for (; kq + 2 <= nq; kq += 2, b += 4) {
    a0 = dpbusd(a0, ones, _mm512_loadu_si512(b));
    a1 = dpbusd(a1, ones, _mm512_loadu_si512(b + 1));
    a2 = dpbusd(a2, ones, _mm512_loadu_si512(b + 2));
    a3 = dpbusd(a3, ones, _mm512_loadu_si512(b + 3));
  }
  if (kq < nq) {
    a0 = dpbusd(a0, ones, _mm512_loadu_si512(b));
    a1 = dpbusd(a1, ones, _mm512_loadu_si512(b + 1));
  }
  c0 = _mm512_slli_epi32(_mm512_add_epi32(a0, a2), 7);
  c1 = _mm512_slli_epi32(_mm512_add_epi32(a1, a3), 7);
}

// MR u8 rows (u8 = q + 128) against one block: C = acc - 128 colsum (c0, c1 from i8_col_sums128).
template <int MR>
static inline void gemm_i8_tile_u8(const int8_t* const* x, const int8_t* B, int64_t kp, int32_t* C, __m512i c0,
                                   __m512i c1, NextLines nl = {}) {
  __m512i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const bool two = nl.lines > kp / 4;
  for (int64_t kq = 0; kq < kp / 4; ++kq, b += 2) {
    next_lines_step(nl, two);
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 1);
    for (int r = 0; r < MR; ++r) {
      const __m512i xr = _mm512_set1_epi32(int(load_u32(x[r] + 4 * kq)));  // the row's 4 u8 codes
      acc[r][0] = dpbusd(acc[r][0], xr, w0);
      acc[r][1] = dpbusd(acc[r][1], xr, w1);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_si512(C + r * 32, _mm512_sub_epi32(acc[r][0], c0));
    _mm512_storeu_si512(C + r * 32 + 16, _mm512_sub_epi32(acc[r][1], c1));
  }
}

// m >= kU8MinRows u8 rows: tiles of at most kU8TileRows rows, split evenly (13 rows: 6 + 7), so
// every tile has 6..12 rows (24 accumulators + 2 weight vectors + 1 broadcast of the 32 registers).
// The column sums cost kp / 2 vpdpbusd per call, 1/m of the rows' own: with 5..7 rows that made
// the call slower than gemm_i8_tile (bare tile, kp 2048: 5 rows 333-355 GOP/s against 380-403),
// with 8 about even, from 12 well ahead (docs/BENCH.md "Prefill without AMX"), so fewer than 8
// u8 rows keep gemm_i8_tile.
constexpr int kU8TileRows = 12;
constexpr int kU8MinRows = 8;
static inline void gemm_i8_u8_rows(const int8_t* const* x, int m, const int8_t* B, int64_t kp, int32_t* C,
                                   NextLines next) {
  __m512i c0, c1;
  i8_col_sums128(B, kp, c0, c1);
  const int tiles = (m + kU8TileRows - 1) / kU8TileRows;
  for (int t = 0, i = 0; t < tiles; ++t) {
    const int mr = (m - i) / (tiles - t);  // the later tiles take the remainder's extra rows
    const NextLines nl = next.share(t, tiles);
    const int8_t* const* xt = x + i;
    int32_t* Ct = C + i * 32;
    switch (mr) {
      case 12: gemm_i8_tile_u8<12>(xt, B, kp, Ct, c0, c1, nl); break;
      case 11: gemm_i8_tile_u8<11>(xt, B, kp, Ct, c0, c1, nl); break;
      case 10: gemm_i8_tile_u8<10>(xt, B, kp, Ct, c0, c1, nl); break;
      case 9: gemm_i8_tile_u8<9>(xt, B, kp, Ct, c0, c1, nl); break;
      case 8: gemm_i8_tile_u8<8>(xt, B, kp, Ct, c0, c1, nl); break;
      case 7: gemm_i8_tile_u8<7>(xt, B, kp, Ct, c0, c1, nl); break;
      default: gemm_i8_tile_u8<6>(xt, B, kp, Ct, c0, c1, nl); break;  // mr == 6 (m >= 8 gives 6..12)
    }
    i += mr;
  }
}

// sum_k q[k] of a row of kp codes (zero codes up to kp, stored like the others): vpdpbusd of the
// bytes against ones, 64 at a time, the tail one byte at a time (u8 rows: their u8 sum - 128 kp).
template <uint32_t kRowXor>
static inline int32_t i8_row_sum(const int8_t* x, int64_t kp) {
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i s = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 64 <= kp; k += 64) {
    const __m512i v = _mm512_loadu_si512(x + k);
    s = kRowXor ? _mm512_dpbusd_epi32(s, ones, v) : _mm512_dpbusd_epi32(s, v, ones);  // s8 sum : u8 sum
  }
  alignas(64) int32_t l[16];
  _mm512_store_si512(l, s);
  uint32_t t = 0;
  for (int i = 0; i < 16; ++i) t += uint32_t(l[i]);
  for (; k < kp; ++k) t += kRowXor ? uint32_t(int32_t(x[k])) : uint32_t(uint8_t(x[k]));
  return int32_t(kRowXor ? t : t - (uint32_t(kp) << 7));
}

// C[r] = acc[r] - 128 rowsum(x[r]) for one row's two column halves.
template <uint32_t kRowXor>
static inline void i8_store_row(int32_t* C, __m512i s0, __m512i s1, const int8_t* x, int64_t kp) {
  const __m512i c = _mm512_set1_epi32(int32_t(uint32_t(i8_row_sum<kRowXor>(x, kp)) << 7));
  _mm512_storeu_si512(C, _mm512_sub_epi32(s0, c));
  _mm512_storeu_si512(C + 16, _mm512_sub_epi32(s1, c));
}

template <int MR, uint32_t kRowXor = 0>
static inline void gemm_i8_tile(const int8_t* const* x, const int8_t* B, int64_t kp, int32_t* C, NextLines nl = {}) {
  __m512i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const __m512i k80 = _mm512_set1_epi8(char(0x80));
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const bool two = nl.lines > kp / 4;
  for (int64_t kq = 0; kq < kp / 4; ++kq, b += 2) {
    next_lines_step(nl, two);
    const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(b), k80);
    const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(b + 1), k80);
    for (int r = 0; r < MR; ++r) {
      uint32_t v;
      std::memcpy(&v, x[r] + 4 * kq, 4);
      const __m512i xr = _mm512_set1_epi32(int(v ^ kRowXor ^ 0x80808080u));  // the signed codes
      acc[r][0] = dpbusd(acc[r][0], w0, xr);
      acc[r][1] = dpbusd(acc[r][1], w1, xr);
    }
  }
  for (int r = 0; r < MR; ++r) i8_store_row<kRowXor>(C + r * 32, acc[r][0], acc[r][1], x[r], kp);
}

// Few rows (decode): MR rows against S K segments streamed at once (for_k_streams).
template <int MR, int S, uint32_t kRowXor = 0>
static inline void gemm_i8_streams(const int8_t* const* x, const int8_t* B, int64_t kp, int32_t* C) {
  __m512i a[MR][S][2];
  for (int u = 0; u < S; ++u)
    for (int r = 0; r < MR; ++r) a[r][u][0] = a[r][u][1] = _mm512_setzero_si512();
  const __m512i k80 = _mm512_set1_epi8(char(0x80));
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  for_k_streams<S>(kp / 4, B, 128, 2, [&](int u, int64_t k) {
    const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(b + 2 * k), k80);
    const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(b + 2 * k + 1), k80);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      uint32_t v;
      std::memcpy(&v, x[r] + 4 * k, 4);
      const __m512i xr = _mm512_set1_epi32(int(v ^ kRowXor ^ 0x80808080u));
      a[r][u][0] = dpbusd(a[r][u][0], w0, xr);
      a[r][u][1] = dpbusd(a[r][u][1], w1, xr);
    }
  });
  for (int r = 0; r < MR; ++r) {
    __m512i s0 = a[r][0][0], s1 = a[r][0][1];
    for (int u = 1; u < S; ++u) {
      s0 = _mm512_add_epi32(s0, a[r][u][0]);
      s1 = _mm512_add_epi32(s1, a[r][u][1]);
    }
    i8_store_row<kRowXor>(C + r * 32, s0, s1, x[r], kp);
  }
}

template <uint32_t kRowXor = 0>
static inline void gemm_i8_row(const int8_t* x, const int8_t* B, int64_t kp, int32_t* C) {
  gemm_i8_streams<1, 4, kRowXor>(&x, B, kp, C);
}

// One row against two blocks at once (stage 1's gate and up: Variant::pair), the way vLLM's int8
// decode reads them (its tinygemm_kernel_vnni: the gate and up blocks of one column block as two
// sequential streams, one K quad of each per step, no software prefetch unless the variant's pf
// says): 4 accumulator chains. Exact int32 sums: the same as gemm_i8_streams on each block.
template <uint32_t kRowXor = 0>
static inline void gemm_i8_pair_row(const int8_t* x, const int8_t* Bg, const int8_t* Bu, int64_t kp, int32_t* Cg,
                                    int32_t* Cu) {
  __m512i g0 = _mm512_setzero_si512(), g1 = g0, u0 = g0, u1 = g0;
  const __m512i k80 = _mm512_set1_epi8(char(0x80));
  const __m512i* g = reinterpret_cast<const __m512i*>(Bg);
  const __m512i* u = reinterpret_cast<const __m512i*>(Bu);
  const int64_t pf = decode_prefetch_bytes(0);
  const bool nta = current_variant().nta != 0;
  for (int64_t kq = 0; kq < kp / 4; ++kq, g += 2, u += 2) {
    if (pf) {
      prefetch_lines(reinterpret_cast<const char*>(g) + pf, 2, nta);
      prefetch_lines(reinterpret_cast<const char*>(u) + pf, 2, nta);
    }
    uint32_t v;
    std::memcpy(&v, x + 4 * kq, 4);
    const __m512i xr = _mm512_set1_epi32(int(v ^ kRowXor ^ 0x80808080u));  // the signed codes
    g0 = dpbusd(g0, _mm512_xor_si512(_mm512_loadu_si512(g), k80), xr);
    u0 = dpbusd(u0, _mm512_xor_si512(_mm512_loadu_si512(u), k80), xr);
    g1 = dpbusd(g1, _mm512_xor_si512(_mm512_loadu_si512(g + 1), k80), xr);
    u1 = dpbusd(u1, _mm512_xor_si512(_mm512_loadu_si512(u + 1), k80), xr);
  }
  i8_store_row<kRowXor>(Cg, g0, g1, x, kp);
  i8_store_row<kRowXor>(Cu, u0, u1, x, kp);
}

// acc[m, 32] = exact int32 dot products of one 32-column block with m rows (u8 = q + 128 when
// kRowXor = 0, signed codes when kRowXor = 0x80808080), m <= 64.
template <uint32_t kRowXor = 0>
static inline void gemm_i8_vnni_rows(const int8_t* const* x, int m, const int8_t* B, int64_t kp, int32_t* C,
                                     NextLines next = {}) {
  if (m <= 4) {  // decode: one stream per block (decode_one_stream), else 4 or 2 K segments
    const bool one = decode_one_stream();
    switch (m) {
      case 1: return one ? gemm_i8_streams<1, 1, kRowXor>(x, B, kp, C) : gemm_i8_streams<1, 4, kRowXor>(x, B, kp, C);
      case 2: return one ? gemm_i8_streams<2, 1, kRowXor>(x, B, kp, C) : gemm_i8_streams<2, 4, kRowXor>(x, B, kp, C);
      case 3: return one ? gemm_i8_streams<3, 1, kRowXor>(x, B, kp, C) : gemm_i8_streams<3, 2, kRowXor>(x, B, kp, C);
      case 4: return one ? gemm_i8_streams<4, 1, kRowXor>(x, B, kp, C) : gemm_i8_streams<4, 2, kRowXor>(x, B, kp, C);
      default: break;
    }
  }
  if constexpr (kRowXor == 0) {
    if (m >= kU8MinRows) return gemm_i8_u8_rows(x, m, B, kp, C, next);
  }
  const int tiles = (m + 7) / 8;
  int i = 0;
  for (; i + 8 <= m; i += 8) gemm_i8_tile<8, kRowXor>(x + i, B, kp, C + i * 32, next.share(i / 8, tiles));
  const NextLines nl = next.share(i / 8, tiles);
  switch (m - i) {
    case 7: gemm_i8_tile<7, kRowXor>(x + i, B, kp, C + i * 32, nl); break;
    case 6: gemm_i8_tile<6, kRowXor>(x + i, B, kp, C + i * 32, nl); break;
    case 5: gemm_i8_tile<5, kRowXor>(x + i, B, kp, C + i * 32, nl); break;
    case 4: gemm_i8_tile<4, kRowXor>(x + i, B, kp, C + i * 32, nl); break;
    case 3: gemm_i8_tile<3, kRowXor>(x + i, B, kp, C + i * 32, nl); break;
    case 2: gemm_i8_tile<2, kRowXor>(x + i, B, kp, C + i * 32, nl); break;
    case 1: gemm_i8_row<kRowXor>(x[i], B, kp, C + i * 32); break;
    default: break;
  }
}

}  // namespace
}  // namespace x86_avx512_vnni
}  // namespace moepack

// ---- int4_group layouts (W4A8): u4 codes as vpdpbusd's unsigned operand, s8 rows ----------------
// (avx512_u4_common.h: the block layout, the fused epilogue; this is the integer core.)
#include "avx512_u4_common.h"
namespace moepack {
namespace x86_avx512_vnni {
namespace {
template <int MR>
struct AccVnniU4 {
  void operator()(const int8_t* const* x, const uint8_t* codes, int64_t j0, int64_t j1, __m512i acc[][2]) const {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i ah[MR][2];  // the high nibbles' own accumulators (two chains per column half)
    for (int r = 0; r < MR; ++r) ah[r][0] = ah[r][1] = _mm512_setzero_si512();
    for (int64_t j = j0; j < j1; ++j) {
      const __m512i* g = reinterpret_cast<const __m512i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(g) + x86_avx512_u4::kU4PrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g) + x86_avx512_u4::kU4PrefetchBytes + 64, _MM_HINT_T0);
      const __m512i w0 = _mm512_loadu_si512(g), w1 = _mm512_loadu_si512(g + 1);
      const __m512i l0 = _mm512_and_si512(w0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), m4);
      const __m512i l1 = _mm512_and_si512(w1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), m4);
      for (int r = 0; r < MR; ++r) {
        const __m512i xl = x86_avx512_u4::bcast32(x[r] + 8 * j), xh = x86_avx512_u4::bcast32(x[r] + 8 * j + 4);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], l0, xl);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], l1, xl);
        ah[r][0] = _mm512_dpbusd_epi32(ah[r][0], h0, xh);
        ah[r][1] = _mm512_dpbusd_epi32(ah[r][1], h1, xh);
      }
    }
    for (int r = 0; r < MR; ++r) {
      acc[r][0] = _mm512_add_epi32(acc[r][0], ah[r][0]);
      acc[r][1] = _mm512_add_epi32(acc[r][1], ah[r][1]);
    }
  }
};

// Few rows (decode): one block's K groups in S segments streamed at once (S address streams per
// thread, like gemm_i8_streams). The block's ng groups are dealt out as rounds: round t takes
// group s * (ng / S) + t of every segment s, each group's integer acc stays exact (the same
// vpdpbusd sums as AccVnniU4's) and its epilogue is u4a8_group_add's; only the order in which
// the groups' fp32 terms are added differs from gemm_u4a8_tile's. One group (per channel): its K
// steps are split instead and the S integer partial sums added exactly. False (nothing written)
// when the groups cannot be dealt out evenly (ng % S, or a partial last group).
template <int MR, int S>
static inline bool gemm_u4a8_streams(const int8_t* const* x, const float* rs, const uint8_t* codes, const float* scale,
                                     const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum, float* C) {
  const int64_t ng = (kp + G - 1) / G;
  if (ng > 1 && (kp % G || ng % S)) return false;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i* b = reinterpret_cast<const __m512i*>(codes);
  __m512i a[S][MR][2];
  auto step = [&](int u, int64_t j) {
    const __m512i w0 = _mm512_loadu_si512(b + 2 * j), w1 = _mm512_loadu_si512(b + 2 * j + 1);
    const __m512i l0 = _mm512_and_si512(w0, m4), h0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), m4);
    const __m512i l1 = _mm512_and_si512(w1, m4), h1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), m4);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512i xl = x86_avx512_u4::bcast32(x[r] + 8 * j), xh = x86_avx512_u4::bcast32(x[r] + 8 * j + 4);
      a[u][r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[u][r][0], l0, xl), h0, xh);
      a[u][r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[u][r][1], l1, xl), h1, xh);
    }
  };
  auto clear = [&] {
    for (int u = 0; u < S; ++u)
      for (int r = 0; r < MR; ++r) a[u][r][0] = a[u][r][1] = _mm512_setzero_si512();
  };
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  if (ng == 1) {
    clear();
    for_k_streams<S>(kp / 8, codes, 128, 2, step);
    const x86_avx512_u4::U4GroupParams p = x86_avx512_u4::u4_group_params(zero, scale, gstride, 0);
    for (int r = 0; r < MR; ++r) {
      __m512i s0 = a[0][r][0], s1 = a[0][r][1];
      for (int u = 1; u < S; ++u) {
        s0 = _mm512_add_epi32(s0, a[u][r][0]);
        s1 = _mm512_add_epi32(s1, a[u][r][1]);
      }
      x86_avx512_u4::u4a8_group_add(p, s0, s1, xsum[r], c[r][0], c[r][1]);
    }
  } else {
    x86_avx512_u4::for_group_streams<S>(codes, scale, zero, gstride, kp, G, clear, step, [&](int u, int64_t g) {
      const x86_avx512_u4::U4GroupParams p = x86_avx512_u4::u4_group_params(zero, scale, gstride, g);
      for (int r = 0; r < MR; ++r) x86_avx512_u4::u4a8_group_add(p, a[u][r][0], a[u][r][1], xsum[r * ng + g], c[r][0], c[r][1]);
    });
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 s = _mm512_set1_ps(rs[r]);
    _mm512_storeu_ps(C + r * 32, _mm512_mul_ps(c[r][0], s));
    _mm512_storeu_ps(C + r * 32 + 16, _mm512_mul_ps(c[r][1], s));
  }
  return true;
}

// The W4A8 block GEMM of the VNNI levels: decode rows through the streams where the groups deal
// out evenly, everything else through gemm_u4a8_tile with AccVnniU4.
static inline void gemm_u4a8_vnni(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const float* scale,
                                  const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum, float* C) {
  if (decode_one_stream() && ((m == 1 && gemm_u4a8_streams<1, 1>(x, rs, codes, scale, zero, gstride, kp, G, xsum, C)) ||
                              (m == 2 && gemm_u4a8_streams<2, 1>(x, rs, codes, scale, zero, gstride, kp, G, xsum, C)))) {
    return;  // one stream per block (decode_one_stream); a partial last group takes the tile below
  }
  if (m == 1 && (gemm_u4a8_streams<1, 4>(x, rs, codes, scale, zero, gstride, kp, G, xsum, C) ||
                 gemm_u4a8_streams<1, 2>(x, rs, codes, scale, zero, gstride, kp, G, xsum, C))) {
    return;
  }
  if (m == 2 && (gemm_u4a8_streams<2, 4>(x, rs, codes, scale, zero, gstride, kp, G, xsum, C) ||
                 gemm_u4a8_streams<2, 2>(x, rs, codes, scale, zero, gstride, kp, G, xsum, C))) {
    return;
  }
  x86_avx512_u4::gemm_u4a8_rows<AccVnniU4>(x, rs, m, codes, scale, zero, gstride, kp, G, xsum, C);
}
}  // namespace
}  // namespace x86_avx512_vnni
}  // namespace moepack
