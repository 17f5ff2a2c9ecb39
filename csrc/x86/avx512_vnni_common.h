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

// ---- int8 layouts (AVX512_VNNI): u8 rows x s8 weights with vpdpbusd -------------------------
// One block of i8_n32k4_x86 is [Kp/4][32 columns][4] int8: per K quad 128 bytes = 2 zmm whose
// 32-bit lanes hold w[n][k..k+3], exactly vpdpbusd's signed operand. Its unsigned operand is
// the row's 4 codes broadcast; the driver stores rows as u8 = q + 128 (MK::kI8RowsU8), so
//   acc = sum (q + 128) w = sum q w + 128 colsum[n],  and the exact result is acc - (colsum << 7).
// vpdpbusd adds the four u8 x s8 products (each |.| <= 255 * 128) into the i32 lane without
// saturating (it is vpdpbusds that saturates); int32 wraparound cancels in the subtraction.
// kRowXor: what the row's code words are XORed with before use: 0 for rows stored as u8 = q + 128,
// 0x80808080 for signed rows (q ^ 0x80 = q + 128 as u8: the same arithmetic, encoded on the fly).
template <int MR, uint32_t kRowXor = 0>
static inline void gemm_i8_tile(const int8_t* const* x, const int8_t* B, int64_t kp, const int32_t* colsum, int32_t* C) {
  __m512i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  for (int64_t kq = 0; kq < kp / 4; ++kq, b += 2) {
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 1);
    for (int r = 0; r < MR; ++r) {
      uint32_t v;
      std::memcpy(&v, x[r] + 4 * kq, 4);
      const __m512i xr = _mm512_set1_epi32(int(v ^ kRowXor));
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xr, w1);
    }
  }
  const __m512i c0 = _mm512_slli_epi32(_mm512_loadu_si512(colsum), 7);
  const __m512i c1 = _mm512_slli_epi32(_mm512_loadu_si512(colsum + 16), 7);
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_si512(C + r * 32, _mm512_sub_epi32(acc[r][0], c0));
    _mm512_storeu_si512(C + r * 32 + 16, _mm512_sub_epi32(acc[r][1], c1));
  }
}

// One row: four K quads in flight on separate accumulators (8 chains hide vpdpbusd's latency).
template <uint32_t kRowXor = 0>
static inline void gemm_i8_row(const int8_t* x, const int8_t* B, int64_t kp, const int32_t* colsum, int32_t* C) {
  __m512i a[4][2];
  for (int u = 0; u < 4; ++u) a[u][0] = a[u][1] = _mm512_setzero_si512();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const int64_t nq = kp / 4;
  int64_t kq = 0;
  for (; kq + 4 <= nq; kq += 4, b += 8) {
    prefetch_stream(b, 8);
    for (int u = 0; u < 4; ++u) {
      uint32_t v;
      std::memcpy(&v, x + 4 * (kq + u), 4);
      const __m512i xr = _mm512_set1_epi32(int(v ^ kRowXor));
      a[u][0] = _mm512_dpbusd_epi32(a[u][0], xr, _mm512_loadu_si512(b + 2 * u));
      a[u][1] = _mm512_dpbusd_epi32(a[u][1], xr, _mm512_loadu_si512(b + 2 * u + 1));
    }
  }
  for (; kq < nq; ++kq, b += 2) {
    uint32_t v;
    std::memcpy(&v, x + 4 * kq, 4);
    const __m512i xr = _mm512_set1_epi32(int(v ^ kRowXor));
    a[0][0] = _mm512_dpbusd_epi32(a[0][0], xr, _mm512_loadu_si512(b));
    a[0][1] = _mm512_dpbusd_epi32(a[0][1], xr, _mm512_loadu_si512(b + 1));
  }
  const __m512i c0 = _mm512_slli_epi32(_mm512_loadu_si512(colsum), 7);
  const __m512i c1 = _mm512_slli_epi32(_mm512_loadu_si512(colsum + 16), 7);
  const __m512i s0 = _mm512_add_epi32(_mm512_add_epi32(a[0][0], a[1][0]), _mm512_add_epi32(a[2][0], a[3][0]));
  const __m512i s1 = _mm512_add_epi32(_mm512_add_epi32(a[0][1], a[1][1]), _mm512_add_epi32(a[2][1], a[3][1]));
  _mm512_storeu_si512(C, _mm512_sub_epi32(s0, c0));
  _mm512_storeu_si512(C + 16, _mm512_sub_epi32(s1, c1));
}

// acc[m, 32] = exact int32 dot products of one 32-column block with m rows (u8 = q + 128 when
// kRowXor = 0, signed codes when kRowXor = 0x80808080), m <= 64.
template <uint32_t kRowXor = 0>
static inline void gemm_i8_vnni_rows(const int8_t* const* x, int m, const int8_t* B, int64_t kp, const int32_t* colsum,
                                     int32_t* C) {
  int i = 0;
  if (m == 1) return gemm_i8_row<kRowXor>(x[0], B, kp, colsum, C);
  for (; i + 8 <= m; i += 8) gemm_i8_tile<8, kRowXor>(x + i, B, kp, colsum, C + i * 32);
  switch (m - i) {
    case 7: gemm_i8_tile<7, kRowXor>(x + i, B, kp, colsum, C + i * 32); break;
    case 6: gemm_i8_tile<6, kRowXor>(x + i, B, kp, colsum, C + i * 32); break;
    case 5: gemm_i8_tile<5, kRowXor>(x + i, B, kp, colsum, C + i * 32); break;
    case 4: gemm_i8_tile<4, kRowXor>(x + i, B, kp, colsum, C + i * 32); break;
    case 3: gemm_i8_tile<3, kRowXor>(x + i, B, kp, colsum, C + i * 32); break;
    case 2: gemm_i8_tile<2, kRowXor>(x + i, B, kp, colsum, C + i * 32); break;
    case 1: gemm_i8_row<kRowXor>(x[i], B, kp, colsum, C + i * 32); break;
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
}  // namespace
}  // namespace x86_avx512_vnni
}  // namespace moepack
