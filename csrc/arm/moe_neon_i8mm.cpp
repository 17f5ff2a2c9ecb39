// [NOTE] Level neon_i8mm (int8 matrix multiply, SMMLA) fused-MoE kernels: int8 (i8_n16k8_arm)
// with SMMLA for pairs of rows, SDOT for an odd row; int4 and mxfp4 A8 (u4*_n16k8_arm,
// mx4g32_n16k8_arm) through the grouped-decode codecs with the SDOT integer cores (SMMLA there
// would need the nibble vectors zipped into column pairs: no fewer instructions). Compiled with -march=armv8.2-a+dotprod+i8mm
// (moepack/isa_levels.py); registered by dispatch.cpp after cpu_features.cpp finds i8mm.
//
// SMMLA multiplies a 2x8 s8 matrix (the rows: row r's 8 codes in 64-bit half r) by an 8x2 one
// given as its two columns (a weight vector of i8_n16k8_arm: columns 2j, 2j+1 x 8 K, one per
// half) and adds the 2x2 int32 product [r0.c2j, r0.c2j+1, r1.c2j, r1.c2j+1]: exact, and no
// reduction at the end.
#if defined(MOEPACK_OMIT_LEVEL)
#include "moepack/kernel.h"
namespace moepack {
void register_neon_i8mm(KernelTable&) {}
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
namespace neon_i8mm {
namespace {

using arm_neon::kBlockN;
using arm_neon::kVecs;

// Two rows of one block: 8 accumulators of 2x2.
static inline void gemm_i8_smmla2(const int8_t* x0, const int8_t* x1, const int8_t* B, int64_t kp, int32_t* acc) {
  int32x4_t a[kVecs];
  for (int32x4_t& v : a) v = vdupq_n_s32(0);
  for (int64_t ko = 0; ko < kp / 8; ++ko, B += 8 * kBlockN) {
    const int8x16_t xv = vcombine_s8(vld1_s8(x0 + 8 * ko), vld1_s8(x1 + 8 * ko));
#pragma GCC unroll 8
    for (int j = 0; j < kVecs; ++j) a[j] = vmmlaq_s32(a[j], xv, vld1q_s8(B + 16 * j));
  }
  for (int j = 0; j < kVecs; ++j) {
    vst1_s32(acc + 2 * j, vget_low_s32(a[j]));
    vst1_s32(acc + kBlockN + 2 * j, vget_high_s32(a[j]));
  }
}

struct MK : arm_neon::NeonBase {
  static constexpr uint32_t kHooks = NeonBase::kHooks;  // dot_u4_s8 / dot_mx4_s8: SDOT here

  static void gemm_i8(const LayoutDesc&, const int8_t* const* rows, int m, const int8_t* B, int64_t kp, const int32_t*,
                      int32_t* acc) {
    int i = 0;
    for (; i + 2 <= m; i += 2) gemm_i8_smmla2(rows[i], rows[i + 1], B, kp, acc + i * kBlockN);
    if (i < m) arm_neon::gemm_i8_sdot<1>(rows + i, B, kp, acc + i * kBlockN);
  }
  static void dot_u4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    arm_neon::dot_u4_sdot(x, m, codes, k0, kk, acc);
  }
  static void dot_mx4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    arm_neon::dot_mx4_sdot(x, m, codes, k0, kk, acc);
  }
};

#include "../kernels/moe_kernels.inc"

}  // namespace
}  // namespace neon_i8mm

void register_neon_i8mm(KernelTable& t) { neon_i8mm::register_level<Isa::neon_i8mm>(t); }

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
