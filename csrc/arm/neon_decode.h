// [NOTE] The NEON decode hooks of every ARM level (csrc/kernels/mk_hooks.h signatures): int4 A16
// (unpack_u4), fp8 A16 (unpack_f8), mxfp4 A16 (unpack_mx4) into the arm dense bf16 block, and the
// exact integer cores of int4 A8 and mxfp4 A8 (dot_u4_s8, dot_mx4_s8) with smull (level neon) or
// SDOT (the +dotprod levels). Included by neon_common.h only (after <arm_neon.h>, outside any
// namespace); everything has internal linkage.
//
// Blockings read (moepack/layout.py, the arm family; docs/KERNELS.md "ARM"):
//   u4*_n16k8_arm, mx4g32_n16k8_arm  per K octet of a block, 64 bytes = 4 vectors of 16 bytes;
//                   vector v holds columns 4v..4v+3, 4 bytes each, byte j of a column holding its
//                   codes j (low nibble) and j + 4 (high nibble).
//   bf16_n16k4_arm  (the dense block) per K quad, 16 columns x 4 bf16; element (n, j) at n * 4 + j.
//                   So the 16 nibbles of `& 0x0f` of vector v, in byte order, are elements
//                   16v..16v+15 of K quad 2o of the dense block, those of `>> 4` the same elements
//                   of quad 2o + 1: no shuffle between the codes and the decoded block.
//   f8*_n16k4_arm   blocked like the dense block, one byte per code: element-wise, in place order.
// Every decode is a table lookup (tbl) of exact values: bf16 bits as a low-byte and a high-byte
// table, looked up with the same index and stored interleaved by st2 (little-endian bf16), so the
// decoded block equals the codecs' tables (kU4Bf16, kF8Bf16, kMx4Bf16) bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "../kernels/f8_table.h"  // kF8Bf16

namespace moepack {
namespace arm_neon_decode {
namespace {

// bf16 bits of the integer x, |x| <= 15 (exact: at most 4 significant bits).
constexpr uint16_t bf16_of_small_int(int x) {
  if (x == 0) return 0;
  const int a = x < 0 ? -x : x;
  int e = 0;
  while ((1 << (e + 1)) <= a) ++e;
  return uint16_t((x < 0 ? 0x8000 : 0) | ((127 + e) << 7) | ((a - (1 << e)) << (7 - e)));
}
// bf16 bits of e2m1(q), q = 0..15 (bit 3 the sign, bits 2-1 the exponent with bias 1, bit 0 the
// mantissa): +-0, 0.5, 1, 1.5, 2, 3, 4, 6.
constexpr uint16_t bf16_of_e2m1(int q) {
  const int m = q & 7, E = m >> 1, M = m & 1;
  const uint16_t mag = E == 0 ? uint16_t(M ? 126 << 7 : 0) : uint16_t(((126 + E) << 7) | (M << 6));
  return uint16_t((q & 8 ? 0x8000 : 0) | mag);
}

struct Tables {
  uint8_t f8_lo[128] = {}, f8_hi[128] = {};  // kF8Bf16.v[c], c = 0..127 (the sign is bit 7 of c: bit 15)
  uint8_t u4_lo[32] = {}, u4_hi[32] = {};    // bf16 of i - 15, i = 0..30 (index q + 15 - z)
  uint8_t mx4_lo[16] = {}, mx4_hi[16] = {};  // bf16 of e2m1(q)
  int8_t mx4_i8[16] = {};                    // 2 * e2m1(q): -12..12
  constexpr Tables() {
    for (int c = 0; c < 128; ++c) {
      f8_lo[c] = uint8_t(kF8Bf16.v[c] & 0xFF);
      f8_hi[c] = uint8_t(kF8Bf16.v[c] >> 8);
    }
    for (int i = 0; i < 31; ++i) {
      u4_lo[i] = uint8_t(bf16_of_small_int(i - 15) & 0xFF);
      u4_hi[i] = uint8_t(bf16_of_small_int(i - 15) >> 8);
    }
    for (int q = 0; q < 16; ++q) {
      mx4_lo[q] = uint8_t(bf16_of_e2m1(q) & 0xFF);
      mx4_hi[q] = uint8_t(bf16_of_e2m1(q) >> 8);
      const int m = q & 7, v2 = (m >> 1) == 0 ? (m & 1) : ((2 + (m & 1)) << ((m >> 1) - 1));  // 2 * |e2m1|
      mx4_i8[q] = int8_t(q & 8 ? -v2 : v2);
    }
  }
};
constexpr Tables kTables{};
// The sign-magnitude split is exact: every code's entry is its magnitude's with bit 15 set.
constexpr bool f8_table_is_sign_magnitude() {
  for (int c = 0; c < 128; ++c) {
    if (kF8Bf16.v[c + 128] != (kF8Bf16.v[c] | 0x8000)) return false;
  }
  return true;
}
static_assert(f8_table_is_sign_magnitude(), "kF8Bf16: the code with bit 7 set is the bf16 with bit 15 set");
static_assert(bf16_of_e2m1(1) == 0x3F00 && bf16_of_e2m1(7) == 0x40C0 && bf16_of_e2m1(15) == 0xC0C0 &&
                  kTables.mx4_i8[7] == 12 && kTables.mx4_i8[13] == -6 && kTables.mx4_i8[8] == 0,
              "e2m1: 0.5, 6, -6; 2 * e2m1: 12, -6, 0");
static_assert(bf16_of_small_int(-15) == 0xC170 && bf16_of_small_int(3) == 0x4040, "bf16 of -15, 3");

constexpr int kBlockN = 16;

static inline void store_bf16(uint16_t* out, uint8x16_t lo, uint8x16_t hi) {
  uint8x16x2_t r;
  r.val[0] = lo;
  r.val[1] = hi;
  vst2q_u8(reinterpret_cast<uint8_t*>(out), r);  // element i = lo[i] | hi[i] << 8
}

// fp8: out[i] = kF8Bf16.v[codes[i]], i < n. Per 16 codes: the magnitude (and #0x7f) looks up the
// 128-entry byte tables (tbl over 64 bytes for 0..63, tbx over the next 64 for 64..127: the index
// minus 64 wraps above 63 for the small ones, which tbx leaves alone), bsl puts the code's sign bit
// into the high byte, st2 interleaves.
static inline void unpack_f8(const uint8_t* codes, int64_t n, uint16_t* out) {
  const uint8x16x4_t L0 = vld1q_u8_x4(kTables.f8_lo), L1 = vld1q_u8_x4(kTables.f8_lo + 64);
  const uint8x16x4_t H0 = vld1q_u8_x4(kTables.f8_hi), H1 = vld1q_u8_x4(kTables.f8_hi + 64);
  const uint8x16_t m7f = vdupq_n_u8(0x7F), c64 = vdupq_n_u8(64), sign = vdupq_n_u8(0x80);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const uint8x16_t c = vld1q_u8(codes + i);
    const uint8x16_t mag = vandq_u8(c, m7f), mag2 = vsubq_u8(mag, c64);
    const uint8x16_t lo = vqtbx4q_u8(vqtbl4q_u8(L0, mag), L1, mag2);
    const uint8x16_t hi = vqtbx4q_u8(vqtbl4q_u8(H0, mag), H1, mag2);
    store_bf16(out + i, lo, vbslq_u8(sign, c, hi));
  }
  for (; i < n; ++i) out[i] = kF8Bf16.v[codes[i]];
}

// int4 A16: K [k0, k0 + kk) (multiples of 8) of one u4*_n16k8_arm block -> the dense block of
// (q - z[n]): index q + (15 - z[n]) (0..30) into the 32-entry byte tables (tbl over two vectors).
static inline void unpack_u4(const uint8_t* codes, int64_t k0, int64_t kk, const uint8_t* z, uint16_t* out) {
  const uint8x16x2_t TL = vld1q_u8_x2(kTables.u4_lo), TH = vld1q_u8_x2(kTables.u4_hi);
  const uint8x16_t lo4 = vdupq_n_u8(0x0F);
  // off[v] byte b: 15 - z[4v + b / 4] (the zero point of byte b's column)
  const uint8x16_t zoff = vsubq_u8(vdupq_n_u8(15), vld1q_u8(z));
  static constexpr uint8_t kSpread[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
  const uint8x16_t spread = vld1q_u8(kSpread);
  uint8x16_t off[4];
  for (int v = 0; v < 4; ++v) off[v] = vqtbl1q_u8(zoff, vaddq_u8(spread, vdupq_n_u8(uint8_t(4 * v))));
  const uint8_t* c = codes + k0 * (kBlockN / 2);  // 64 bytes per K octet
  for (int64_t k = 0; k < kk; k += 8, c += 4 * kBlockN, out += 8 * kBlockN) {
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const uint8x16_t w = vld1q_u8(c + 16 * v);
      const uint8x16_t il = vaddq_u8(vandq_u8(w, lo4), off[v]), ih = vaddq_u8(vshrq_n_u8(w, 4), off[v]);
      store_bf16(out + 16 * v, vqtbl2q_u8(TL, il), vqtbl2q_u8(TH, il));
      store_bf16(out + 4 * kBlockN + 16 * v, vqtbl2q_u8(TL, ih), vqtbl2q_u8(TH, ih));
    }
  }
}

// mxfp4 A16: K [k0, k0 + kk) (multiples of 8) of one mx4g32_n16k8_arm block -> the dense block of
// the unscaled e2m1(q) (the scale is applied to the group's fp32 sums by the codec).
static inline void unpack_mx4(const uint8_t* codes, int64_t k0, int64_t kk, uint16_t* out) {
  const uint8x16_t TL = vld1q_u8(kTables.mx4_lo), TH = vld1q_u8(kTables.mx4_hi);
  const uint8x16_t lo4 = vdupq_n_u8(0x0F);
  const uint8_t* c = codes + k0 * (kBlockN / 2);
  for (int64_t k = 0; k < kk; k += 8, c += 4 * kBlockN, out += 8 * kBlockN) {
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const uint8x16_t w = vld1q_u8(c + 16 * v);
      const uint8x16_t il = vandq_u8(w, lo4), ih = vshrq_n_u8(w, 4);
      store_bf16(out + 16 * v, vqtbl1q_u8(TL, il), vqtbl1q_u8(TH, il));
      store_bf16(out + 4 * kBlockN + 16 * v, vqtbl1q_u8(TL, ih), vqtbl1q_u8(TH, ih));
    }
  }
}

static inline int8x16_t bcast4(const int8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return vreinterpretq_s8_u32(vdupq_n_u32(v));
}

// The integer weights of a code vector: u4: the nibbles (0..15); mxfp4: 2 * e2m1 of them (tbl).
template <bool kMx4>
static inline void nibble_weights(uint8x16_t w, int8x16_t tab, int8x16_t& lo, int8x16_t& hi) {
  const uint8x16_t il = vandq_u8(w, vdupq_n_u8(0x0F)), ih = vshrq_n_u8(w, 4);
  if constexpr (kMx4) {
    lo = vqtbl1q_s8(tab, il);
    hi = vqtbl1q_s8(tab, ih);
  } else {
    lo = vreinterpretq_s8_u8(il);
    hi = vreinterpretq_s8_u8(ih);
  }
}

// The A8 integer core of a 4-bit arm block, MR rows (1 or 2) sharing one decode, level neon (no
// SDOT): smull of each half of a weight vector with the row's K quad broadcast, smlal adds the
// other nibble's products (|x q| <= 128 * 15: two fit int16), sadalp adds pairs into int32.
// acc[i * 16 + n] = sum over K [k0, k0 + kk) of x_i[k] * weight(q[n][k]), exact.
template <bool kMx4, int MR>
static inline void dot_nib_smull_rows(const int8_t* const* rows, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
  const int8x16_t tab = vld1q_s8(kTables.mx4_i8);
  int32x4_t a[MR][8];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 8; ++j) a[r][j] = vdupq_n_s32(0);
  const uint8_t* c = codes + k0 * (kBlockN / 2);
  for (int64_t k = k0; k < k0 + kk; k += 8, c += 4 * kBlockN) {
    int8x16_t xl[MR], xh[MR];
    for (int r = 0; r < MR; ++r) xl[r] = bcast4(rows[r] + k), xh[r] = bcast4(rows[r] + k + 4);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      int8x16_t lo, hi;
      nibble_weights<kMx4>(vld1q_u8(c + 16 * v), tab, lo, hi);
      for (int r = 0; r < MR; ++r) {
        int16x8_t p0 = vmull_s8(vget_low_s8(lo), vget_low_s8(xl[r]));
        p0 = vmlal_s8(p0, vget_low_s8(hi), vget_low_s8(xh[r]));
        int16x8_t p1 = vmull_high_s8(lo, xl[r]);
        p1 = vmlal_high_s8(p1, hi, xh[r]);
        a[r][2 * v] = vpadalq_s16(a[r][2 * v], p0);  // columns 4v, 4v + 1: two partial sums each
        a[r][2 * v + 1] = vpadalq_s16(a[r][2 * v + 1], p1);  // columns 4v + 2, 4v + 3
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) vst1q_s32(acc + r * kBlockN + 4 * v, vpaddq_s32(a[r][2 * v], a[r][2 * v + 1]));
}
template <bool kMx4>
static inline void dot_nib_smull(const int8_t* const* rows, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
  int i = 0;
  for (; i + 2 <= m; i += 2) dot_nib_smull_rows<kMx4, 2>(rows + i, codes, k0, kk, acc + i * kBlockN);
  if (i < m) dot_nib_smull_rows<kMx4, 1>(rows + i, codes, k0, kk, acc + i * kBlockN);
}

#if defined(__ARM_FEATURE_DOTPROD)
// The same with SDOT: vector v's `& 0x0f` weights are 4 columns' K k..k+3 (one 32-bit lane each),
// the `>> 4` weights their k+4..k+7, against the row's x[k..k+3] and x[k+4..k+7] broadcast.
template <bool kMx4, int MR>
static inline void dot_nib_sdot_rows(const int8_t* const* rows, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
  const int8x16_t tab = vld1q_s8(kTables.mx4_i8);
  int32x4_t a[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) a[r][v] = vdupq_n_s32(0);
  const uint8_t* c = codes + k0 * (kBlockN / 2);
  for (int64_t k = k0; k < k0 + kk; k += 8, c += 4 * kBlockN) {
    int8x16_t xl[MR], xh[MR];
    for (int r = 0; r < MR; ++r) xl[r] = bcast4(rows[r] + k), xh[r] = bcast4(rows[r] + k + 4);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      int8x16_t lo, hi;
      nibble_weights<kMx4>(vld1q_u8(c + 16 * v), tab, lo, hi);
      for (int r = 0; r < MR; ++r) {
        a[r][v] = vdotq_s32(a[r][v], lo, xl[r]);
        a[r][v] = vdotq_s32(a[r][v], hi, xh[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) vst1q_s32(acc + r * kBlockN + 4 * v, a[r][v]);
}
template <bool kMx4>
static inline void dot_nib_sdot(const int8_t* const* rows, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
  int i = 0;
  for (; i + 2 <= m; i += 2) dot_nib_sdot_rows<kMx4, 2>(rows + i, codes, k0, kk, acc + i * kBlockN);
  if (i < m) dot_nib_sdot_rows<kMx4, 1>(rows + i, codes, k0, kk, acc + i * kBlockN);
}
#endif  // __ARM_FEATURE_DOTPROD

}  // namespace
}  // namespace arm_neon_decode
}  // namespace moepack
