// The W4A16 tile kernel of the mxfp4 layout for the amx_bf16 level (moe_amx_bf16.cpp): many bf16
// rows against one mx4 block through tdpbf16ps over the whole K at once. Include only from a file
// compiled with the amx_bf16 level's flags, inside that level's namespace (internal linkage).
//
// The per-group scale is folded into the decoded weights where that is exact and changes nothing
// the tiles see: for a code value v != 0 and e8m0 e, bf16 bits of v * 2^(e - 127) are bits(v) +
// ((e - 127) << 7) whenever the result is a normal bf16 (e >= 2). The kernel takes a block only
// when every scale of it lies in [kMx4FoldMinE, kMx4FoldMaxE] (|scaled weight| in [2^-64, 2^64]):
// then no product with a row value above 2^-60 in magnitude leaves fp32's normal range (the tiles
// flush subnormals, as they do for the unscaled values), and the result is the contract's sum up
// to the fp32 summation order. Any other block (extreme scales: the exact per-group path, which
// never folds a scale) and K not a multiple of 32 are left to the grouped-decode path (false).
#pragma once
#include "amx_common.h"
#include "avx512_mx4_common.h"

namespace moepack {
namespace x86_avx512_mx4_amx {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_mx4;
using namespace x86_amx;

MOEPACK_AMX_DP(Mx4DpBf16, _tile_dpbf16ps);

constexpr int64_t kMx4TileStepK = 256;  // K decoded per tile pass (16 KiB of bf16)
constexpr int kMx4TileMaxRows = 64;

// C[m, 32] = rows . (e2m1(q) * 2^(e - 127)) for bf16 rows that are one matrix (row i at x[0] +
// i * stride, stride >= kp), 2 <= m <= kMx4TileMaxRows, kp % 32 == 0 and scales that fold; false
// (nothing written) otherwise.
static inline bool gemm_mx4a16_amx(const uint16_t* const* x, int m, const uint8_t* codes, const uint8_t* scale,
                                   int64_t gstride, int64_t kp, float* C) {
  if (m < 2 || m > kMx4TileMaxRows || kp % kMx4Group) return false;
  const int64_t stride = x[1] - x[0];
  if (stride < kp || x[m - 1] != x[0] + int64_t(m - 1) * stride) return false;
  if (!mx4_scales_fold(scale, gstride, kp / kMx4Group)) return false;
  alignas(64) uint16_t w[kMx4TileStepK * 32];
  TileState local;
  TileState& tiles = tile_state(local);
  for (int64_t k1 = 0; k1 < kp; k1 += kMx4TileStepK) {
    const int64_t kk = kp - k1 < kMx4TileStepK ? kp - k1 : kMx4TileStepK;  // whole groups: kk / 2 pairs, a multiple of 16
    unpack_mx4_scaled(codes, scale, gstride, k1, kk, w);
    tile_rows<Mx4DpBf16>(tiles, reinterpret_cast<const char*>(x[0] + k1), stride * 2, m, reinterpret_cast<const char*>(w),
                         kk / 2, k1 != 0, C);
  }
  return true;
}

}  // namespace
}  // namespace x86_avx512_mx4_amx
}  // namespace moepack
