// [NOTE] Level neon_dotprod (ARMv8.2 dot product, SDOT) fused-MoE kernels: int8 (i8_n16k8_arm)
// with SDOT, two rows at a time (neon_common.h gemm_i8_sdot), and the int4 and mxfp4 A8 paths
// (u4*_n16k8_arm, mx4g32_n16k8_arm) through the grouped-decode codecs with the SDOT integer cores
// (neon_decode.h: the nibbles, or 2 * e2m1 of them by tbl). Compiled with
// -march=armv8.2-a+dotprod (moepack/isa_levels.py); registered by dispatch.cpp after
// cpu_features.cpp finds asimddp.
#if defined(MOEPACK_OMIT_LEVEL)
// setup.py found no compiler support for this level's flags: register nothing (the dispatcher
// then reports the level as a fallback).
#include "moepack/kernel.h"
namespace moepack {
void register_neon_dotprod(KernelTable&) {}
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
namespace neon_dotprod {
namespace {

struct MK : arm_neon::NeonBase {
  static constexpr uint32_t kHooks = NeonBase::kHooks;  // dot_u4_s8 / dot_mx4_s8: SDOT here

  static void gemm_i8(const LayoutDesc&, const int8_t* const* rows, int m, const int8_t* B, int64_t kp, const int32_t*,
                      int32_t* acc) {
    int i = 0;
    for (; i + 2 <= m; i += 2) arm_neon::gemm_i8_sdot<2>(rows + i, B, kp, acc + i * kBlockN);
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
}  // namespace neon_dotprod

void register_neon_dotprod(KernelTable& t) { neon_dotprod::register_level<Isa::neon_dotprod>(t); }

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
