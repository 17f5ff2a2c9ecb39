// [NOTE] Level neon (baseline Advanced SIMD, every AArch64 CPU) fused-MoE kernels for the arm
// layouts (moepack/layout.py, family "arm"): dense bf16_n16k4_arm with fp32 FMA on widened bf16,
// int8 i8_n16k8_arm with smull + sadalp (exact), int4 (u4*_n16k8_arm), fp8 (f8*_n16k4_arm) and
// mxfp4 (mx4g32_n16k8_arm) through the grouped-decode codecs with the NEON hooks of
// neon_decode.h (A16: tbl decode into this MK's dense block, then its gemm; A8: the smull integer
// cores). Compiled for the baseline target (no -march flags: setup.py, moepack/isa_levels.py);
// registered by dispatch.cpp after cpu_features.cpp finds asimd.
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
namespace neon {
namespace {

struct MK : arm_neon::NeonBase {
  static constexpr uint32_t kHooks = NeonBase::kHooks;

  // acc[m, 16] for one 16-column int8 block (signed rows; colsum unused).
  static void gemm_i8(const LayoutDesc&, const int8_t* const* rows, int m, const int8_t* B, int64_t kp, const int32_t*,
                      int32_t* acc) {
    for (int i = 0; i < m; ++i) arm_neon::gemm_i8_smull_row(rows[i], B, kp, acc + i * arm_neon::kBlockN);
  }
};

#include "../kernels/moe_kernels.inc"

}  // namespace
}  // namespace neon

void register_neon(KernelTable& t) { neon::register_level<Isa::neon>(t); }

}  // namespace moepack
