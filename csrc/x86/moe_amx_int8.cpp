// [NOTE] AMX-INT8 fused-MoE kernel for layout i8_n32k4_x86 (W8A8), ISA level `amx_int8`
// (docs/KERNELS.md). Compiled with the avx512_vnni level's flags plus -mamx-tile -mamx-int8 -mavx512vbmi;
// registered by dispatch.cpp only where cpuid, XCR0 and the kernel's permission
// (csrc/x86/cpu_features.cpp) say tiles can be used.
//
// tdpbssd multiplies signed by signed bytes into exact int32, so rows stay the canonical s8
// codes (no u8 offset, no column-sum correction). The packed block is [Kp/4][32 columns][4]
// int8: 16 consecutive K quads of 16 columns are 16 rows of 64 bytes at a stride of 128, a B
// tile in the quad-interleaved order tdpbssd takes, loaded straight from the packed weights.
// The driver keeps a chunk's rows consecutive (MK::kContiguousRows; x codes are quantized once
// per token and copied to their positions), so 16 rows x 64 codes are one A tile at a stride of
// Kp bytes. Tiles: C 2x2 (32 rows x 32 columns of int32), A 2, B 2; per 16 K quads 4 loads and
// 4 tdpbssd. Calls of fewer rows (decode) use the VNNI kernel on the signed rows (the weights are
// its unsigned operand, w ^ 0x80, and the rows' code sums its correction: avx512_vnni_common.h); the quads after the last whole 16 the
// AVX-512 BW signed-row kernel (avx512_i8_common.h). Every result is the exact integer dot product.
#if defined(MOEPACK_OMIT_LEVEL)
// setup.py found no compiler support for this level's flags: register nothing (the dispatcher
// then reports the level as a fallback).
#include "moepack/kernel.h"
namespace moepack {
void register_amx_int8(KernelTable&) {}
}  // namespace moepack
#else
#include "amx_common.h"
#include "avx512_i8_common.h"
#include "avx512_vnni_common.h"
#include "avx512_mx4_vnni.h"
#include "avx512_mx4_amx_int8.h"

namespace moepack {
namespace amx_int8 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_i8;
using namespace x86_avx512_vnni;
using namespace x86_amx;

constexpr int kAmxMinRows = 4;  // fewer rows: the vector kernel streams the block as well
constexpr int kMaxRows = 64;    // the driver's chunks (kChunkM); more rows go in pieces

MOEPACK_AMX_DP(DpS8, _tile_dpbssd);

// acc[m, 32] = exact int32 dot products, A = m s8 rows of kp codes at `x`, one every `stride` bytes.
static void gemm_amx(const int8_t* x, int64_t stride, int m, const int8_t* B, int64_t kp, int32_t* acc) {
  const int64_t nq = kp / 4, full = nq / 16 * 16;
  tile_block<DpS8>(reinterpret_cast<const char*>(x), stride, m, reinterpret_cast<const char*>(B), full, acc);
  if (full < nq) {  // the last K quads: vector kernel on the rows' tails, added
    const int8_t* xs[kMaxRows];
    alignas(64) int32_t tail[kMaxRows * 32];
    for (int i = 0; i < m; ++i) xs[i] = x + int64_t(i) * stride + 4 * full;
    gemm_i8_signed_rows(xs, m, B + full * 128, (nq - full) * 4, tail);
    for (int i = 0; i < m * 32; ++i) acc[i] += tail[i];
  }
}

MOEPACK_AMX_DP(DpS8U8, _tile_dpbsud);

// W4A8 with tiles (docs/KERNELS.md): per K step (<= kU4TileStepK values of one group) the block's
// codes are unpacked to the i8_n32k4 order as u8 (0..15: a K group's low nibbles are its first
// quad, its high nibbles the second; two ANDs and a shift per 128 bytes) and multiplied by
// tdpbsud (s8 rows x u8 codes, exact int32) against the rows at their own stride; K quads after
// the last whole 16 go to the vpdpbusd core. Per group, the zero point is folded in with the rows'
// code sums and the scale applied, C += float(acc - z[g, n] * sum_g(x)) * s[g, n], and C *= the
// row's activation scale at the end: gemm_u4a8_tile's values, in its order. False (nothing
// written) for rows that are not one matrix, more than kMaxRows, or groups tiles cannot hold
// (a group size that is not a multiple of 64).
constexpr int64_t kU4TileStepK = 256;
static bool gemm_u4a8_amx(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const float* scale,
                          const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum, float* C) {
  const int64_t ng = (kp + G - 1) / G;
  const int64_t stride = x[1] - x[0];
  if (m > kMaxRows || (G != kp && G % 64) || stride < kp || x[m - 1] != x[0] + int64_t(m - 1) * stride) return false;
  alignas(64) uint8_t w[kU4TileStepK / 4 * 128];
  alignas(64) int32_t acc[kMaxRows * 32];
  alignas(64) int32_t tail[kMaxRows * 32];
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  TileState local;
  TileState& tiles = tile_state(local);
  for (int i = 0; i < m * 32; ++i) C[i] = 0.0f;
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    for (int64_t k1 = k0; k1 < kend; k1 += kU4TileStepK) {
      const int64_t kk = kend - k1 < kU4TileStepK ? kend - k1 : kU4TileStepK;
      for (int64_t j = k1 / 8; j < (k1 + kk) / 8; ++j) {
        const __m512i* src = reinterpret_cast<const __m512i*>(codes + j * 128);
        __m512i* dst = reinterpret_cast<__m512i*>(w + (j - k1 / 8) * 256);
        // the code stream 1 KiB ahead, into L2 (qwen3 T=512: 65 -> 55 ms; 4 and 8 KiB ahead ~57)
        _mm_prefetch(reinterpret_cast<const char*>(src) + x86_avx512_u4::kU4PrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(src) + x86_avx512_u4::kU4PrefetchBytes + 64, _MM_HINT_T1);
        const __m512i v0 = _mm512_loadu_si512(src), v1 = _mm512_loadu_si512(src + 1);
        _mm512_store_si512(dst, _mm512_and_si512(v0, m4));
        _mm512_store_si512(dst + 1, _mm512_and_si512(v1, m4));
        _mm512_store_si512(dst + 2, _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4));
        _mm512_store_si512(dst + 3, _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4));
      }
      const int64_t nq = kk / 4, full = nq / 16 * 16;
      tile_rows<DpS8U8>(tiles, reinterpret_cast<const char*>(x[0] + k1), stride, m, reinterpret_cast<const char*>(w), full,
                        k1 != k0, acc);
      if (full < nq) {  // the K quads after the last whole 16 (a partial last group)
        x86_avx512_u4::dot_u4_rows<AccVnniU4>(x, m, codes, k1 + full * 4, kk - full * 4, tail);
        for (int i = 0; i < m * 32; ++i) acc[i] += tail[i];
      }
    }
    const x86_avx512_u4::U4GroupParams p = x86_avx512_u4::u4_group_params(zero, scale, gstride, g);
    for (int i = 0; i < m; ++i) {
      const int32_t* a = acc + int64_t(i) * 32;
      float* ci = C + int64_t(i) * 32;
      __m512 c0 = _mm512_loadu_ps(ci), c1 = _mm512_loadu_ps(ci + 16);
      x86_avx512_u4::u4a8_group_add(p, _mm512_loadu_si512(a), _mm512_loadu_si512(a + 16),
                                    xsum[i * ng + g], c0, c1);
      _mm512_storeu_ps(ci, c0);
      _mm512_storeu_ps(ci + 16, c1);
    }
  }
  for (int i = 0; i < m; ++i) {
    const __m512 a = _mm512_set1_ps(rs[i]);
    _mm512_storeu_ps(C + int64_t(i) * 32, _mm512_mul_ps(_mm512_loadu_ps(C + int64_t(i) * 32), a));
    _mm512_storeu_ps(C + int64_t(i) * 32 + 16, _mm512_mul_ps(_mm512_loadu_ps(C + int64_t(i) * 32 + 16), a));
  }
  return true;
}

struct MK : Avx512Base {
  // The schemes whose few-row (decode) kernels here read decode_one_stream(): Variant::streams
  // (register.inc variant_knobs).
  static constexpr uint32_t kStreamsSchemes = (1u << kScheme_int8_channel) | (1u << kScheme_int4_group) | (1u << kScheme_mxfp4);
  static constexpr uint32_t kPfSchemes = kStreamsSchemes;  // for_k_streams' prefetch distance (Variant::pf)
  static constexpr uint32_t kHooks = Avx512Base::kHooks | kHook_gemm_u4a8 | kHook_dot_u4_s8 | kHook_gemm_mx4a8 |
                                     kHook_dot_mx4_s8 | kHook_gemm_nv4a8;
  static constexpr bool kContiguousRows = true;  // the driver keeps a chunk's rows consecutive
  using WorkerScope = TileScope;  // one tile configuration per driver worker (amx_common.h)

  // One row against stage 1's gate and up blocks at once (Variant::pair; signed rows).
  static void gemm_i8_pair1(const int8_t* x, const int8_t* Bg, const int8_t* Bu, int64_t kp, int32_t* Cg, int32_t* Cu) {
    gemm_i8_pair_row<0x80808080u>(x, Bg, Bu, kp, Cg, Cu);
  }

  // acc[m, 32] = exact int32 dot products of one 32-column int8 block (signed rows; no kernel
  // reads the stored column sums).
  static void gemm_i8(const LayoutDesc&, const int8_t* const* x, int m, const int8_t* B, int64_t kp, const int32_t*,
                      int32_t* acc) {
    // Tiles need the rows as one matrix (one row every `stride` >= kp bytes): the driver's promise,
    // checked so that a caller that breaks it (the gemm_i8_block test hook passes any rows) gets
    // the vector kernel.
    for (int r0 = 0; r0 < m; r0 += kMaxRows) {
      const int mm = m - r0 < kMaxRows ? m - r0 : kMaxRows;
      const int8_t* const* xr = x + r0;
      int32_t* out = acc + int64_t(r0) * 32;
      const int64_t stride = mm > 1 ? xr[1] - xr[0] : 0;
      if (mm < kAmxMinRows || stride < kp || xr[mm - 1] != xr[0] + int64_t(mm - 1) * stride) {
        gemm_i8_vnni_rows<0x80808080u>(xr, mm, B, kp, out);  // signed rows
      } else {
        gemm_amx(xr[0], stride, mm, B, kp, out);
      }
    }
  }

  // int4_group layouts: the W4A8 fused block GEMM (tiles for chunks of kAmxMinRows+ rows as one
  // matrix, else vpdpbusd) and its integer core (vpdpbusd).
  static void gemm_u4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const float* scale,
                        const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum, float* C) {
    if (m >= kAmxMinRows && gemm_u4a8_amx(x, rs, m, codes, scale, zero, gstride, kp, G, xsum, C)) return;
    gemm_u4a8_vnni(x, rs, m, codes, scale, zero, gstride, kp, G, xsum, C);
  }
  static void dot_u4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    x86_avx512_u4::dot_u4_rows<AccVnniU4>(x, m, codes, k0, kk, acc);
  }

  // mxfp4 layout (W4A8): the fused block GEMM (tiles with the scales folded into the integer weights
  // where exact, for chunks of kAmxMinRows+ rows as one matrix: avx512_mx4_amx_int8.h; else
  // vpdpbusd) and its exact integer core (avx512_mx4{_common,_vnni}.h).
  static void gemm_mx4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                         int64_t gstride, int64_t kp, const A8Sums& xsum, float* C) {
    if (m >= kAmxMinRows && x86_avx512_mx4_amx8::gemm_mx4a8_amx(x, rs, m, codes, scale, gstride, kp, xsum, C)) return;
    x86_avx512_mx4::gemm_mx4a8_vnni(x, rs, m, codes, scale, gstride, kp, xsum.get(), C);
  }
  static void dot_mx4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    x86_avx512_mx4::dot_mx4_rows<x86_avx512_mx4::Mx4AccVnni>(x, m, codes, k0, kk, acc);
  }
  // nvfp4 layout (W4A8): the mxfp4 block GEMM over groups of 16 with e4m3 scales, groups in order.
  static bool gemm_nv4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                         const float* global, int64_t gstride, int64_t kp, int64_t G, const A8Sums& xsum, float* C) {
    if (G != x86_avx512_mx4::Nv4Scales16::kGroup || kp % 8) return false;
    x86_avx512_mx4::gemm_nv4a8_vnni(x, rs, m, codes, scale, global, gstride, kp, xsum.get(), C);
    return true;
  }
};

#include "../kernels/moe_kernels.inc"

}  // namespace
}  // namespace amx_int8

void register_amx_int8(KernelTable& t) { amx_int8::register_level<Isa::amx_int8>(t); }

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
