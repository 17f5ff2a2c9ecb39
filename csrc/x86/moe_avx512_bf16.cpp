// [NOTE] AVX-512 BF16 fused-MoE kernel for layout bf16_n32k2_x86, ISA level `avx512_bf16`.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c only;
// registered by dispatch.cpp after cpuid + xgetbv.
//
// Weights: one packed block is [Kp/2][32 columns][2] bf16: per K pair 128 bytes = 2 zmm of 16
// (k, k+1) pairs, exactly the operand `vdpbf16ps` takes.
//  * bf16 inputs: activations stay bf16 (row format bf16); a K pair of one row is one 32-bit
//    word, broadcast to 16 lanes, and   acc += vdpbf16ps(B, A)   does 2 FMAs per lane. All
//    operands are exact bf16 values, so this equals fp32 FMAs (up to order and the
//    instruction's denormal flushing).
//  * fp32 / fp16 inputs: fp32 rows and the widening GEMM of avx512_common.h.
// Register tile: MR=8 rows x 2 zmm = 16 accumulators (+2 B, broadcasts from memory); MR=1 keeps
// four K pairs in flight (8 chains).
#if defined(MOEPACK_OMIT_LEVEL)
// setup.py found no compiler support for this level's flags: register nothing (the dispatcher
// then reports the level as a fallback).
#include "moepack/kernel.h"
namespace moepack {
void register_avx512_bf16(KernelTable&) {}
}  // namespace moepack
#else
#include "avx512_bf16_common.h"
#include "avx512_u4_bf16.h"
#include "avx512_f8.h"
#include "avx512_f8_bf16.h"
#include "avx512_mx4_bf16.h"
#include "avx512_mx4_f32.h"

namespace moepack {
namespace avx512_bf16 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_bf16;

struct MK : Avx512Base {
  // The schemes whose few-row (decode) kernels here read decode_one_stream(): Variant::streams
  // (register.inc variant_knobs).
  static constexpr uint32_t kStreamsSchemes = (1u << kScheme_dense) | (1u << kScheme_int4_group) | (1u << kScheme_fp8_block) | (1u << kScheme_mxfp4) |
                                               (1u << kScheme_nvfp4);
  static constexpr uint32_t kPfSchemes = kStreamsSchemes;  // for_k_streams' prefetch distance (Variant::pf)
  static constexpr uint32_t kDotSchemes = 1u << kScheme_mxfp4;  // mx4_a16_fp32(): Variant::dot
  static constexpr uint32_t kHooks = Avx512Base::kHooks | kHook_gemm_prefetch | kHook_unpack_u4 | kHook_gemm_u4a16 | kHook_unpack_f8 |
                                     kHook_gemm_f8a16 | kHook_unpack_mx4 | kHook_gemm_mx4a16 | kHook_gemm_nv4a16;
  static RowFormat row_format(DType d) { return d == DType::bf16 ? RowFormat::bf16 : RowFormat::f32; }

  // C[m, 32] = A[m, :kp] . B^T for one 32-column block; rows are bf16 bits or fp32 as
  // row_format(dtype) chose; m <= kChunkM. bf16 rows prefetch `next_bytes` of the worker's next
  // block (`next`) while the tiles compute.
  static void gemm(const LayoutDesc& L, RowFormat fmt, const void* const* rows, int m, const uint16_t* B, int64_t kp, float* C,
                   const char* next = nullptr, int64_t next_bytes = 0) {
    if (fmt == RowFormat::bf16)
      return gemm_bf16_rows(reinterpret_cast<const uint16_t* const*>(rows), m, B, kp, C, NextLines{next, next_bytes / 64});
    Avx512Base::gemm(L, fmt, rows, m, B, kp, C);
  }

  // One bf16 row against stage 1's gate and up blocks at once (Variant::pair); fp32 rows: not here.
  static bool gemm_pair1(RowFormat fmt, const void* row, const uint16_t* Bg, const uint16_t* Bu, int64_t kp, float* Cg,
                         float* Cu) {
    if (fmt != RowFormat::bf16) return false;
    x86_avx512_bf16::gemm_bf16_pair_row(static_cast<const uint16_t*>(row), Bg, Bu, kp, Cg, Cu);
    return true;
  }

  // int4_group layouts (W4A16): the unpack to dense bf16 blocks, and few bf16 rows straight from the codes (avx512_u4_bf16.h).
  static void unpack_u4(const uint8_t* codes, int64_t k0, int64_t kk, const uint8_t* z, uint16_t* out) {
    x86_avx512_u4::unpack_u4_avx512(codes, k0, kk, z, out);
  }
  // fp8_block layouts (W8A16): the exact table decode to the dense bf16 block (avx512_f8.h).
  static void unpack_f8(const uint8_t* codes, int64_t n, uint16_t* out) { x86_avx512_f8::unpack_f8_avx512(codes, n, out); }
  // ... and few bf16 rows straight from the codes (avx512_f8_bf16.h).
  static bool gemm_f8a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const float* scale,
                         int64_t gstride, int64_t kp, int64_t G, float* C) {
    return x86_avx512_f8_bf16::gemm_f8a16_bf16(fmt, rows, m, codes, scale, gstride, kp, G, C);
  }
  using U4A16Memo = x86_avx512_u4_bf16::U4A16Rows;
  static bool gemm_u4a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const float* scale,
                         const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, float* C, void* memo) {
    return x86_avx512_u4_bf16::gemm_u4a16_bf16(fmt, rows, m, codes, scale, zero, gstride, kp, G, C,
                                               static_cast<U4A16Memo*>(memo));
  }

  // mxfp4 layout (W4A16): the exact table decode to the dense bf16 block (avx512_mx4_common.h), few
  // rows straight from the codes (avx512_mx4_f32.h's fp32 FMAs for fp32 rows, and for bf16 rows
  // where mx4_a16_fp32(); else avx512_mx4_bf16.h's vdpbf16ps), more bf16 rows through the dense row
  // kernel over the whole K with the scales folded into the decoded weights where that is exact
  // (mx4_scales_fold); other blocks take the grouped path (unpack_mx4, 32 K at a time, the scale
  // after). Without the folded path, T=512 gpt-oss-20b took 3x the dense kernel's time here.
  static void unpack_mx4(const uint8_t* codes, int64_t k0, int64_t kk, uint16_t* out) {
    x86_avx512_mx4::unpack_mx4_avx512(codes, k0, kk, out);
  }
  using Mx4A16Memo = x86_avx512_mx4_f32::Mx4A16Rows;
  static bool gemm_mx4a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const uint8_t* scale,
                          int64_t gstride, int64_t kp, float* C, void* memo) {
    // fp32 rows: always fp32 FMAs (no vdpbf16ps for them); bf16 rows: the process's choice
    if ((fmt == RowFormat::f32 || mx4_a16_fp32()) &&
        x86_avx512_mx4_f32::gemm_mx4a16_f32(fmt, rows, m, codes, scale, gstride, kp, C, static_cast<Mx4A16Memo*>(memo))) {
      return true;
    }
    if (x86_avx512_mx4_bf16::gemm_mx4a16_bf16(fmt, rows, m, codes, scale, gstride, kp, C)) return true;
    constexpr int kRowsMax = 64;  // the driver's kChunkM (engine_state.inc, included after MK)
    if (fmt != RowFormat::bf16 || m > kRowsMax || kp % x86_avx512_mx4::kMx4Group ||
        !x86_avx512_mx4::mx4_scales_fold(scale, gstride, kp / x86_avx512_mx4::kMx4Group))
      return false;
    constexpr int64_t kStepK = 256;  // K decoded per pass: 16 KiB of bf16, L1-resident while the rows stream
    alignas(64) uint16_t w[kStepK * 32];
    alignas(64) float part[kRowsMax * 32];
    const uint16_t* const* x = reinterpret_cast<const uint16_t* const*>(rows);
    const uint16_t* xk[kRowsMax];
    for (int64_t k1 = 0; k1 < kp; k1 += kStepK) {
      const int64_t kk = kp - k1 < kStepK ? kp - k1 : kStepK;  // whole groups of 32
      x86_avx512_mx4::unpack_mx4_scaled(codes, scale, gstride, k1, kk, w);
      for (int i = 0; i < m; ++i) xk[i] = x[i] + k1;
      gemm_bf16_rows(xk, m, w, kk, k1 == 0 ? C : part);
      if (k1 != 0) {
        for (int i = 0; i < m * 32; i += 16)
          _mm512_storeu_ps(C + i, _mm512_add_ps(_mm512_loadu_ps(C + i), _mm512_loadu_ps(part + i)));
      }
    }
    return true;
  }
  // nvfp4 layout (W4A16): the mxfp4 fp32-FMA kernel over groups of 16 with e4m3 scales (avx512_mx4_f32.h,
  // its rows memo), up to 4 rows; more take the grouped path (unpack_mx4, 16 K at a time).
  using Nv4A16Memo = x86_avx512_mx4_f32::Mx4A16Rows;
  static bool gemm_nv4a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const uint8_t* scale,
                          const float* global, int64_t gstride, int64_t kp, int64_t G, float* C, void* memo) {
    return x86_avx512_mx4_f32::gemm_nv4a16_f32(fmt, rows, m, codes, scale, global, gstride, kp, G, C,
                                              static_cast<Nv4A16Memo*>(memo));
  }
};

#include "../kernels/moe_kernels.inc"

}  // namespace
}  // namespace avx512_bf16

void register_avx512_bf16(KernelTable& t) { avx512_bf16::register_level<Isa::avx512_bf16>(t); }

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
