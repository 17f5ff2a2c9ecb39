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
// Two copies of the kernel (avx512_f8_bf16_streams.h): the word tables and the byte tables
// (AVX512_VBMI: compiled for it, run where the level has it or the CPU does: f8_pair_bytes).
#pragma once
#include "avx512_bf16_common.h"
#include "avx512_f8.h"

#include <cstdlib>

namespace moepack {
namespace x86_avx512_f8_bf16 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_bf16;
using namespace x86_avx512_f8;

constexpr int kF8A16MaxRows = 4;  // more rows: the decode to a dense block (or tiles) and the dense kernel

// One K pair (64 codes of 32 columns) of the block as the two bf16 pair registers, exact: with
// the word tables columns 0-15 and 16-31; with the byte tables (AVX512_VBMI) in the unpacks'
// order, columns (0-3, 8-11, 16-19, 24-27) and (4-7, 12-15, 20-23, 28-31): one shuffle less per
// pair; the scales are read in that order and C is put back in column order once per block
// (f8_cols<true>).
// Columns in the pair order <-> column order: (a, b) = the 32 values in one order -> the other.
// to_pair: a = columns 0-15, b = 16-31 -> (0-3, 8-11, 16-19, 24-27), (4-7, 12-15, 20-23, 28-31);
// else the inverse. The word tables' order is the column order.
template <bool Bytes>
static inline void f8_cols(__m512& a, __m512& b, bool to_pair) {
  if constexpr (Bytes) {
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
// the groups do not deal out evenly to S segments (S = 1 takes any). gemm_f8a16_streams_w: the
// word tables; gemm_f8a16_streams_b: the byte tables, compiled for AVX512_VBMI.
#define F8S_NAME gemm_f8a16_streams_w
#define F8S_TABLES F8WordTables
#define F8S_PAIR(p, T, w) f8w_bf16_64(_mm512_loadu_si512(p), T, w)
#define F8S_BYTES false
#include "avx512_f8_bf16_streams.h"
#undef F8S_NAME
#undef F8S_TABLES
#undef F8S_PAIR
#undef F8S_BYTES
#ifdef MOEPACK_F8_HAVE_BYTES
#ifndef __AVX512VBMI__
#pragma GCC push_options
#pragma GCC target("avx512vbmi")
#define MOEPACK_F8_VBMI_REGION
#endif
#define F8S_NAME gemm_f8a16_streams_b
#define F8S_TABLES F8ByteTables
#define F8S_PAIR(p, T, w) f8b_bf16_64_lanes(_mm512_loadu_si512(p), T, w)
#define F8S_BYTES true
#include "avx512_f8_bf16_streams.h"
#undef F8S_NAME
#undef F8S_TABLES
#undef F8S_PAIR
#undef F8S_BYTES
#ifdef MOEPACK_F8_VBMI_REGION
#pragma GCC pop_options
#undef MOEPACK_F8_VBMI_REGION
#endif
#endif

// Which copy runs: the byte tables where the level is compiled with AVX512_VBMI (amx_bf16), or
// where the CPU has it (cpu_features(): a Zen 4 on the avx512_bf16 level) unless
// MOEPACK_F8_WORD_TABLES is set (read once: the word copy on a VBMI CPU, for tests and
// measurements); else the word tables.
static inline bool f8_pair_bytes() {
  if constexpr (kF8Vbmi) {
    return true;
  } else {
#ifdef MOEPACK_F8_HAVE_BYTES
    static const bool bytes = cpu_features().avx512vbmi && std::getenv("MOEPACK_F8_WORD_TABLES") == nullptr;
    return bytes;
#else
    return false;
#endif
  }
}
template <int MR, int S>
static inline bool gemm_f8a16_streams(bool bytes, const uint16_t* const* x, const uint8_t* codes, const float* scale,
                                      int64_t gstride, int64_t kp, int64_t G, float* C) {
#ifdef MOEPACK_F8_HAVE_BYTES
  if (bytes) return gemm_f8a16_streams_b<MR, S>(x, codes, scale, gstride, kp, G, C);
#endif
  if constexpr (!kF8Vbmi) return gemm_f8a16_streams_w<MR, S>(x, codes, scale, gstride, kp, G, C);
  return false;
}

// A K that the groups do not deal out evenly to S segments (gpt-oss: K 2880 = 22.5 groups of 128):
// the largest multiple of S whole groups streamed as S segments, the rest (whole groups and a
// partial last one) after it in one stream, added to C. False (nothing written): fewer than S
// whole groups, or nothing left over (the plain call takes those).
template <int MR, int S>
static inline bool gemm_f8a16_split(bool b, const uint16_t* const* x, const uint8_t* codes, const float* scale,
                                    int64_t gstride, int64_t kp, int64_t G, float* C) {
  const int64_t head = kp / G / S * S;  // whole groups, a multiple of S
  if (head < S || head * G == kp) return false;
  if (!gemm_f8a16_streams<MR, S>(b, x, codes, scale, gstride, head * G, G, C)) return false;
  const uint16_t* xt[MR];
  for (int r = 0; r < MR; ++r) xt[r] = x[r] + head * G;
  alignas(64) float tail[MR * 32];
  gemm_f8a16_streams<MR, 1>(b, xt, codes + head * G * 32, scale + head * gstride, gstride, kp - head * G, G, tail);
  for (int i = 0; i < MR * 32; ++i) C[i] += tail[i];
  return true;
}

// C[m, 32] for m <= kF8A16MaxRows bf16 rows; false (nothing written) otherwise.
static inline bool gemm_f8a16_bf16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const float* scale,
                                   int64_t gstride, int64_t kp, int64_t G, float* C) {
  if (fmt != RowFormat::bf16 || m > kF8A16MaxRows) return false;
  const uint16_t* const* x = reinterpret_cast<const uint16_t* const*>(rows);
  const bool b = f8_pair_bytes();
  if (m == 1) {
    if (decode_one_stream()) return gemm_f8a16_streams<1, 1>(b, x, codes, scale, gstride, kp, G, C);
    return gemm_f8a16_streams<1, 4>(b, x, codes, scale, gstride, kp, G, C) ||
           gemm_f8a16_streams<1, 2>(b, x, codes, scale, gstride, kp, G, C) || gemm_f8a16_split<1, 4>(b, x, codes, scale, gstride, kp, G, C) ||
           gemm_f8a16_split<1, 2>(b, x, codes, scale, gstride, kp, G, C) || gemm_f8a16_streams<1, 1>(b, x, codes, scale, gstride, kp, G, C);
  }
  int i = 0;
  for (; i + 2 <= m; i += 2) {
    if (!(!decode_one_stream() && (gemm_f8a16_streams<2, 2>(b, x + i, codes, scale, gstride, kp, G, C + i * 32) ||
                                   gemm_f8a16_split<2, 2>(b, x + i, codes, scale, gstride, kp, G, C + i * 32))))
      gemm_f8a16_streams<2, 1>(b, x + i, codes, scale, gstride, kp, G, C + i * 32);
  }
  if (i < m) {
    if (!(!decode_one_stream() && (gemm_f8a16_streams<1, 4>(b, x + i, codes, scale, gstride, kp, G, C + i * 32) ||
                                   gemm_f8a16_split<1, 4>(b, x + i, codes, scale, gstride, kp, G, C + i * 32))))
      gemm_f8a16_streams<1, 1>(b, x + i, codes, scale, gstride, kp, G, C + i * 32);
  }
  return true;
}

}  // namespace
}  // namespace x86_avx512_f8_bf16
}  // namespace moepack
