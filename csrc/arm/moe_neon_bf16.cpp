// [NOTE] Level neon_bf16 (BF16: BFMMLA, BFDOT) fused-MoE kernels: dense bf16_n16k4_arm with bf16
// rows (an activation dtype of bf16: the rows are exact in bf16) by BFMMLA for pairs of rows and
// BFDOT for an odd row; fp32 rows (f32 / f16 activations) keep level neon's FMA on widened bf16,
// since rounding them to bf16 would change the product. int4 A16 (u4*_n16k8_arm), fp8
// (f8*_n16k4_arm) and mxfp4 A16 (mx4g32_n16k8_arm) run through the grouped-decode codecs: the tbl
// decode hooks (neon_decode.h) into this MK's dense block, then this gemm (mxfp4: the unscaled
// e2m1 values, the 2^(e - 127) applied to each group's fp32 sums).
// Compiled with -march=armv8.2-a+bf16 (moepack/isa_levels.py); registered by dispatch.cpp after
// cpu_features.cpp finds bf16.
//
// BFMMLA multiplies a 2x4 bf16 matrix (row r's 4 values in 64-bit half r) by a 4x2 one given as
// its two columns (a weight vector of bf16_n16k4_arm: columns 2j, 2j+1 x 4 K) and adds the 2x2
// fp32 product [r0.c2j, r0.c2j+1, r1.c2j, r1.c2j+1]. BFDOT adds the products of bf16 pairs into
// fp32 lanes: against one row's 4 values broadcast to both halves it gives (2j: k0..1, 2j: k2..3,
// 2j+1: k0..1, 2j+1: k2..3), added pairwise at the end. Without FEAT_EBF16 both round their
// intermediate sums to odd and flush subnormal inputs and outputs (the Arm ARM's BFDotAdd), which
// is why they are compared with scalar under the fp32 tolerance, not bit for bit.
#if defined(MOEPACK_OMIT_LEVEL)
#include "moepack/kernel.h"
namespace moepack {
void register_neon_bf16(KernelTable&) {}
}  // namespace moepack
#else
#include <arm_neon.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "moepack/kernel.h"
#include "moepack/numeric.h"
#include "neon_common.h"

namespace moepack {
namespace neon_bf16 {
namespace {

using arm_neon::kBlockN;
using arm_neon::kVecs;

static inline bfloat16x8_t as_bf(uint16x8_t v) { return vreinterpretq_bf16_u16(v); }

// Two bf16 rows of one block: 8 accumulators of 2x2.
static inline void gemm_bf16_mmla2(const uint16_t* x0, const uint16_t* x1, const uint16_t* B, int64_t kp, float* C) {
  float32x4_t a[kVecs];
  for (float32x4_t& v : a) v = vdupq_n_f32(0.0f);
  for (int64_t kq = 0; kq < kp / 4; ++kq, B += 4 * kBlockN) {
    const bfloat16x8_t xv = as_bf(vcombine_u16(vld1_u16(x0 + 4 * kq), vld1_u16(x1 + 4 * kq)));
#pragma GCC unroll 8
    for (int j = 0; j < kVecs; ++j) a[j] = vbfmmlaq_f32(a[j], xv, as_bf(vld1q_u16(B + 8 * j)));
  }
  for (int j = 0; j < kVecs; ++j) {
    vst1_f32(C + 2 * j, vget_low_f32(a[j]));
    vst1_f32(C + kBlockN + 2 * j, vget_high_f32(a[j]));
  }
}

// One bf16 row: BFDOT, 8 accumulators.
static inline void gemm_bf16_dot1(const uint16_t* x, const uint16_t* B, int64_t kp, float* C) {
  float32x4_t a[kVecs];
  for (float32x4_t& v : a) v = vdupq_n_f32(0.0f);
  for (int64_t kq = 0; kq < kp / 4; ++kq, B += 4 * kBlockN) {
    const bfloat16x8_t xv = vreinterpretq_bf16_u64(vdupq_n_u64(arm_neon::load_u64(x + 4 * kq)));
#pragma GCC unroll 8
    for (int j = 0; j < kVecs; ++j) a[j] = vbfdotq_f32(a[j], as_bf(vld1q_u16(B + 8 * j)), xv);
  }
  for (int j = 0; j < kVecs; j += 2) vst1q_f32(C + 2 * j, vpaddq_f32(a[j], a[j + 1]));
}

struct MK : arm_neon::NeonBase {
  static constexpr uint32_t kHooks = NeonBase::kHooks;
  static RowFormat row_format(DType d) { return d == DType::bf16 ? RowFormat::bf16 : RowFormat::f32; }

  static void gemm(const LayoutDesc&, RowFormat fmt, const void* const* rows, int m, const uint16_t* B, int64_t kp,
                   float* C) {
    if (fmt != RowFormat::bf16) return arm_neon::gemm_f32(rows, m, B, kp, C);
    const uint16_t* const* x = reinterpret_cast<const uint16_t* const*>(rows);
    int i = 0;
    for (; i + 2 <= m; i += 2) gemm_bf16_mmla2(x[i], x[i + 1], B, kp, C + i * kBlockN);
    if (i < m) gemm_bf16_dot1(x[i], B, kp, C + i * kBlockN);
  }
};

#include "../kernels/moe_kernels.inc"

}  // namespace
}  // namespace neon_bf16

void register_neon_bf16(KernelTable& t) { neon_bf16::register_level<Isa::neon_bf16>(t); }

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
