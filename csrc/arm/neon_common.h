// [NOTE] The NEON (Advanced SIMD, baseline ARMv8-A) pieces every ARM level's MK shares: the
// activations, the combine's axpy, the int8 row quantizer, and the level-neon micro-kernels of the
// arm layouts (fp32 FMA on widened bf16; int8 with smull + sadalp) that the better levels keep for
// what their instruction does not cover. Include only from a csrc/arm/moe_<level>.cpp, after
// <arm_neon.h>, inside nothing (it opens its own namespaces); everything has internal linkage.
//
// Blockings (moepack/layout.py, the arm family; docs/KERNELS.md "ARM"):
//   bf16_n16k4_arm  per K quad of a block, 16 columns x 4 bf16 = 8 vectors of 8 bf16; vector j
//                   holds column 2j's K quad in its low half, column 2j+1's in its high half.
//   i8_n16k8_arm    per K octet of a block, 16 columns x 8 int8 = 8 vectors of 16 bytes; vector j
//                   holds column 2j's 8 codes in its low half, column 2j+1's in its high half.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "moepack/kernel.h"
#include "moepack/numeric.h"
#include "../kernels/mk_hooks.h"
#include "neon_decode.h"

namespace moepack {
namespace arm_neon {
namespace {

constexpr int kBlockN = 16;  // every ARM kernel is written for 16-column blocks
constexpr int kVecs = kBlockN / 2;  // 128-bit vectors per K run of a block (two columns each)

static inline uint64_t load_u64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// ---- exp / sigmoid (Cephes-style, the x86 kernels' polynomial: ~1 ulp) -------------------------
static inline float32x4_t exp_ps(float32x4_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.3f)), vdupq_n_f32(88.3f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

static inline float32x4_t sigmoid_ps(float32x4_t x) {
  const float32x4_t one = vdupq_n_f32(1.0f);
  return vdivq_f32(one, vaddq_f32(one, exp_ps(vnegq_f32(x))));
}

// ---- the int8 row quantizer (docs/SEMANTICS.md §3, "The int8 row quantizer in IEEE terms") -----
// The same IEEE operations as the driver's scalar quantize_row_i8, four lanes at a time, so codes
// and scale are identical bit for bit:
//   amax  = maxNum over |v|: fmaxnm, like fmax, returns the number when one operand is NaN (a NaN
//           element is ignored; x86's maxps gets the same by operand order)
//   q     = fdiv, frintn (round to nearest, ties to even: nearbyint in the default mode), then
//           fmaxnm(q, -127) (NaN -> -127, like fmax(NaN, -127)) and fminnm(q, 127)
static inline float quantize_row_i8_neon(const float* v, int64_t n, int64_t np, int8_t* q, uint8_t flip) {
  float32x4_t m4 = vdupq_n_f32(0.0f);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) m4 = vmaxnmq_f32(m4, vabsq_f32(vld1q_f32(v + i)));
  float amax = vmaxnmvq_f32(m4);  // maxNum of the lanes (all non-NaN: the fold above ignores NaN)
  for (; i < n; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  const float scale = std::fmax(amax, 1e-7f) / 127.0f;

  const float32x4_t sc = vdupq_n_f32(scale), lo = vdupq_n_f32(-127.0f), hi = vdupq_n_f32(127.0f);
  const int8x16_t fl = vdupq_n_s8(int8_t(flip));
  i = 0;
  for (; i + 16 <= n; i += 16) {
    int32x4_t c[4];
    for (int u = 0; u < 4; ++u) {
      float32x4_t r = vrndnq_f32(vdivq_f32(vld1q_f32(v + i + 4 * u), sc));
      r = vminnmq_f32(vmaxnmq_f32(r, lo), hi);
      c[u] = vcvtq_s32_f32(r);
    }
    const int16x8_t h0 = vcombine_s16(vmovn_s32(c[0]), vmovn_s32(c[1]));
    const int16x8_t h1 = vcombine_s16(vmovn_s32(c[2]), vmovn_s32(c[3]));
    vst1q_s8(q + i, veorq_s8(vcombine_s8(vmovn_s16(h0), vmovn_s16(h1)), fl));
  }
  for (; i < n; ++i) {
    const float r = std::fmin(std::fmax(std::nearbyint(v[i] / scale), -127.0f), 127.0f);
    q[i] = int8_t(uint8_t(int8_t(int(r))) ^ flip);
  }
  for (i = n; i < np; ++i) q[i] = int8_t(flip);
  return scale;
}

// ---- level neon micro-kernels ----------------------------------------------------------------
// Horizontal sums of 4 column accumulators (4 partial lanes each) -> one vector of the 4 columns.
static inline float32x4_t hsum4(float32x4_t a, float32x4_t b, float32x4_t c, float32x4_t d) {
  return vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d));
}
static inline int32x4_t hsum4(int32x4_t a, int32x4_t b, int32x4_t c, int32x4_t d) {
  return vpaddq_s32(vpaddq_s32(a, b), vpaddq_s32(c, d));
}

// Dense, fp32 row: C[16] = x[:kp] . B^T (bf16_n16k4_arm). One accumulator per column holds its
// 4 K lanes; shll #16 widens a bf16 exactly to fp32. (Sixteen named accumulators: as an array,
// GCC 12 stored all of them to the stack on every iteration.)
static inline float32x4_t widen_lo(uint16x8_t w) { return vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(w), 16)); }
static inline float32x4_t widen_hi(uint16x8_t w) { return vreinterpretq_f32_u32(vshll_high_n_u16(w, 16)); }
static inline void gemm_f32_row(const float* x, const uint16_t* B, int64_t kp, float* C) {
  float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  float32x4_t a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
  for (int64_t kq = 0; kq < kp / 4; ++kq, B += 4 * kBlockN) {
    const float32x4_t xv = vld1q_f32(x + 4 * kq);
#define MOEPACK_NEON_F32_STEP(J, A, Z)             \
  {                                                \
    const uint16x8_t w = vld1q_u16(B + 8 * (J));   \
    A = vfmaq_f32(A, widen_lo(w), xv);             \
    Z = vfmaq_f32(Z, widen_hi(w), xv);             \
  }
    MOEPACK_NEON_F32_STEP(0, a0, a1)
    MOEPACK_NEON_F32_STEP(1, a2, a3)
    MOEPACK_NEON_F32_STEP(2, a4, a5)
    MOEPACK_NEON_F32_STEP(3, a6, a7)
    MOEPACK_NEON_F32_STEP(4, a8, a9)
    MOEPACK_NEON_F32_STEP(5, a10, a11)
    MOEPACK_NEON_F32_STEP(6, a12, a13)
    MOEPACK_NEON_F32_STEP(7, a14, a15)
#undef MOEPACK_NEON_F32_STEP
  }
  vst1q_f32(C + 0, hsum4(a0, a1, a2, a3));
  vst1q_f32(C + 4, hsum4(a4, a5, a6, a7));
  vst1q_f32(C + 8, hsum4(a8, a9, a10, a11));
  vst1q_f32(C + 12, hsum4(a12, a13, a14, a15));
}

static inline void gemm_f32(const void* const* rows, int m, const uint16_t* B, int64_t kp, float* C) {
  for (int i = 0; i < m; ++i) gemm_f32_row(static_cast<const float*>(rows[i]), B, kp, C + i * kBlockN);
}

// int8, one s8 row: acc[16] = x[:kp] . B^T (i8_n16k8_arm), exact. smull gives the 8 products of a
// column's K octet in int16 (|w x| <= 128 * 127 < 2^15), sadalp adds their pairs into 4 int32 lanes.
static inline void gemm_i8_smull_row(const int8_t* x, const int8_t* B, int64_t kp, int32_t* acc) {
  int32x4_t a[kBlockN];
  for (int32x4_t& v : a) v = vdupq_n_s32(0);
  for (int64_t ko = 0; ko < kp / 8; ++ko, B += 8 * kBlockN) {
    const int8x8_t xv = vld1_s8(x + 8 * ko);
#pragma GCC unroll 8
    for (int j = 0; j < kVecs; ++j) {
      const int8x16_t w = vld1q_s8(B + 16 * j);
      a[2 * j] = vpadalq_s16(a[2 * j], vmull_s8(vget_low_s8(w), xv));
      a[2 * j + 1] = vpadalq_s16(a[2 * j + 1], vmull_high_s8(w, vcombine_s8(xv, xv)));
    }
  }
  for (int c = 0; c < kBlockN; c += 4) vst1q_s32(acc + c, hsum4(a[c], a[c + 1], a[c + 2], a[c + 3]));
}

#if defined(__ARM_FEATURE_DOTPROD)
// ---- SDOT pieces (the levels compiled with +dotprod) ------------------------------------------
static inline int8x16_t bcast8(const int8_t* p) { return vreinterpretq_s8_u64(vdupq_n_u64(load_u64(p))); }
static inline int8x16_t bcast4(const int8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return vreinterpretq_s8_u32(vdupq_n_u32(v));
}

// int8, MR rows (1 or 2) of one block (i8_n16k8_arm), exact: one 16-byte weight vector holds
// columns 2j and 2j+1 x 8 K codes; against the row's 8 codes broadcast to both 64-bit halves SDOT
// gives the lanes (2j: k0..3, 2j: k4..7, 2j+1: k0..3, 2j+1: k4..7); addp of two such vectors gives
// 4 columns' sums. 8 accumulators per row.
template <int MR>
static inline void gemm_i8_sdot(const int8_t* const* x, const int8_t* B, int64_t kp, int32_t* acc) {
  int32x4_t a[MR][kVecs];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < kVecs; ++j) a[r][j] = vdupq_n_s32(0);
  for (int64_t ko = 0; ko < kp / 8; ++ko, B += 8 * kBlockN) {
    int8x16_t xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = bcast8(x[r] + 8 * ko);
#pragma GCC unroll 8
    for (int j = 0; j < kVecs; ++j) {
      const int8x16_t w = vld1q_s8(B + 16 * j);
      for (int r = 0; r < MR; ++r) a[r][j] = vdotq_s32(a[r][j], w, xv[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kVecs; j += 2) vst1q_s32(acc + r * kBlockN + 2 * j, vpaddq_s32(a[r][j], a[r][j + 1]));
  }
}

// int4 A8 integer core with SDOT (neon_decode.h): acc[i * 16 + n] = sum over K [k0, k0 + kk) of
// x_i[k] q[n][k], exact (k0, kk multiples of 8).
static inline void dot_u4_sdot(const int8_t* const* rows, int m, const uint8_t* codes, int64_t k0, int64_t kk,
                               int32_t* acc) {
  arm_neon_decode::dot_nib_sdot<false>(rows, m, codes, k0, kk, acc);
}
// mxfp4 A8 integer core with SDOT: the same with the weights 2 * e2m1(q) (tbl).
static inline void dot_mx4_sdot(const int8_t* const* rows, int m, const uint8_t* codes, int64_t k0, int64_t kk,
                                int32_t* acc) {
  arm_neon_decode::dot_nib_sdot<true>(rows, m, codes, k0, kk, acc);
}
#endif  // __ARM_FEATURE_DOTPROD

// The MK members every ARM level shares (a level's MK derives from it and restates kHooks).
// The decode hooks (neon_decode.h) are every level's: tbl decodes of int4, fp8 and mxfp4 codes into
// the dense bf16 block, and the smull integer cores of int4 / mxfp4 A8 (the +dotprod levels state
// the same hooks and hide dot_u4_s8 / dot_mx4_s8 with their SDOT ones).
struct NeonBase {
  static constexpr uint32_t kHooks = kHook_quantize_row_i8 | kHook_unpack_u4 | kHook_dot_u4_s8 | kHook_unpack_f8 |
                                     kHook_unpack_mx4 | kHook_dot_mx4_s8;  // csrc/kernels/mk_hooks.h
  // the 4-bit blocking the int4 and mxfp4 hooks read (every u4*_n16k8_arm layout and mx4g32_n16k8_arm)
  static constexpr const LayoutDesc* kU4Blocking = &kLayout_u4g32_n16k8_arm;
  static constexpr int kBlockN = arm_neon::kBlockN;
  static constexpr int kDenseKPack = 4;  // bf16 quads (bf16_n16k4_arm)
  static constexpr int kInt8KPack = 8;   // int8 octets (i8_n16k8_arm)
  static RowFormat row_format(DType) { return RowFormat::f32; }

  static float quantize_row_i8(const float* v, int64_t n, int64_t np, int8_t* q, uint8_t flip) {
    return quantize_row_i8_neon(v, n, np, q, flip);
  }
  static void unpack_u4(const uint8_t* codes, int64_t k0, int64_t kk, const uint8_t* z, uint16_t* out) {
    arm_neon_decode::unpack_u4(codes, k0, kk, z, out);
  }
  static void dot_u4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    arm_neon_decode::dot_nib_smull<false>(x, m, codes, k0, kk, acc);
  }
  static void unpack_f8(const uint8_t* codes, int64_t n, uint16_t* out) { arm_neon_decode::unpack_f8(codes, n, out); }
  static void unpack_mx4(const uint8_t* codes, int64_t k0, int64_t kk, uint16_t* out) {
    arm_neon_decode::unpack_mx4(codes, k0, kk, out);
  }
  static void dot_mx4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    arm_neon_decode::dot_nib_smull<true>(x, m, codes, k0, kk, acc);
  }

  // dense: fp32 rows, FMA on widened bf16 (the levels with bf16 instructions override for bf16 rows)
  static void gemm(const LayoutDesc&, RowFormat, const void* const* rows, int m, const uint16_t* B, int64_t kp, float* C) {
    gemm_f32(rows, m, B, kp, C);
  }

  static void activation(const FusedMoeArgs& a, const float* g, const float* u, int n, float* out) {
    int j = 0;
    switch (a.act) {
      case Activation::silu:
        for (; j + 4 <= n; j += 4) {
          const float32x4_t gv = vld1q_f32(g + j), uv = vld1q_f32(u + j);
          vst1q_f32(out + j, vmulq_f32(vmulq_f32(gv, sigmoid_ps(gv)), uv));
        }
        for (; j < n; ++j) out[j] = act_silu(g[j], u[j]);
        break;
      case Activation::gelu_tanh: {
        // 0.5 * (1 + tanh(z)) == sigmoid(2z)
        const float32x4_t c2 = vdupq_n_f32(2.0f * 0.7978845608028654f), c3 = vdupq_n_f32(0.044715f);
        for (; j + 4 <= n; j += 4) {
          const float32x4_t gv = vld1q_f32(g + j), uv = vld1q_f32(u + j);
          const float32x4_t inner = vfmaq_f32(gv, vmulq_f32(c3, gv), vmulq_f32(gv, gv));
          vst1q_f32(out + j, vmulq_f32(vmulq_f32(gv, sigmoid_ps(vmulq_f32(c2, inner))), uv));
        }
        for (; j < n; ++j) out[j] = act_gelu_tanh(g[j], u[j]);
        break;
      }
      case Activation::swigluoai: {
        const float32x4_t lim = vdupq_n_f32(a.limit), nlim = vdupq_n_f32(-a.limit);
        const float32x4_t alpha = vdupq_n_f32(a.alpha), one = vdupq_n_f32(1.0f);
        for (; j + 4 <= n; j += 4) {
          const float32x4_t gv = vminq_f32(vld1q_f32(g + j), lim);
          const float32x4_t uv = vmaxq_f32(vminq_f32(vld1q_f32(u + j), lim), nlim);
          const float32x4_t glu = vmulq_f32(gv, sigmoid_ps(vmulq_f32(alpha, gv)));
          vst1q_f32(out + j, vmulq_f32(vaddq_f32(uv, one), glu));
        }
        for (; j < n; ++j) out[j] = act_swigluoai(g[j], u[j], a.alpha, a.limit);
        break;
      }
      case Activation::relu2: {  // non-gated: g is the up row; vmaxq_f32 returns NaN when either operand is
        const float32x4_t zero = vdupq_n_f32(0.0f);
        for (; j + 4 <= n; j += 4) {
          const float32x4_t r = vmaxq_f32(zero, vld1q_f32(g + j));
          vst1q_f32(out + j, vmulq_f32(r, r));
        }
        for (; j < n; ++j) out[j] = act_relu2(g[j]);
        break;
      }
      case Activation::gelu:  // erf: scalar libm (exact GELU is rare in MoE models)
        for (; j < n; ++j) out[j] = act_gelu(g[j], u[j]);
        break;
    }
  }

  // dst[0, n) = c + bias (bias may be null); `stream` is not used here (plain stores).
  static void out_row(float* dst, const float* c, const float* bias, int n, bool) {
    for (int j = 0; j < n; ++j) dst[j] = bias ? c[j] + bias[j] : c[j];
  }
  static void out_fence() {}

  static void axpy(float w, const float* y, float* acc, int64_t n) {
    const float32x4_t wv = vdupq_n_f32(w);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(acc + i, vaddq_f32(vld1q_f32(acc + i), vmulq_f32(wv, vld1q_f32(y + i))));
    for (; i < n; ++i) acc[i] += w * y[i];
  }
};

}  // namespace
}  // namespace arm_neon
}  // namespace moepack
