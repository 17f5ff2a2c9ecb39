// [NOTE] AVX-512 (F/BW/VL/DQ) fused-MoE kernels, ISA level `avx512`: layout bf16_n32k2_x86 with
// fp32 rows for every input dtype (weights widened in registers: avx512_common.h), and the int8
// layout i8_n32k4_x86 for CPUs without AVX512_VNNI (Skylake-SP/X) with vpmaddubsw.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c only; registered by
// dispatch.cpp after cpuid + xgetbv (opmask, ZMM_Hi256, Hi16_ZMM state).
//
// int8 (see dot4): one block of i8_n32k4_x86 is [Kp/4][32 columns][4] int8, per K quad 128 bytes
// = 2 zmm whose 32-bit lanes hold w[n][k..k+3]; the row's 4 codes are broadcast to every lane.
// Without a signed x signed byte dot product, and without vpsignb at 512 bits:
//   u8 = |w|                     (vpabsb: -128 -> 0x80 = 128 as u8, exact)
//   s8 = x, negated where w < 0  (vpmovb2m + masked vpsubb; x in [-127, 127]: exact)
//   vpmaddubsw(u8, s8) = w0 x0 + w1 x1, |.| <= 2 * 128 * 127 = 32512 < 2^15: never saturates,
//   vpmaddwd(., 1) adds the pairs into i32: exact integers, no column-sum correction.
#if defined(MOEPACK_OMIT_LEVEL)
// setup.py found no compiler support for this level's flags: register nothing (the dispatcher
// then reports the level as a fallback).
#include "moepack/kernel.h"
namespace moepack {
void register_avx512(KernelTable&) {}
}  // namespace moepack
#else
#include "avx512_i8_common.h"
#include "avx512_u4_common.h"
#include "avx512_f8.h"
#include "avx512_mx4_common.h"
#include "avx512_mx4_f32.h"

namespace moepack {
namespace avx512 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_i8;

struct MK : Avx512Base {
  // The schemes whose few-row (decode) kernels here read decode_one_stream(): Variant::streams
  // (register.inc variant_knobs).
  static constexpr uint32_t kStreamsSchemes = (1u << kScheme_mxfp4) | (1u << kScheme_nvfp4);
  static constexpr uint32_t kPfSchemes = kStreamsSchemes;  // for_k_streams' prefetch distance (Variant::pf)
  static constexpr uint32_t kHooks = Avx512Base::kHooks | kHook_gemm_u4a8 | kHook_dot_u4_s8 | kHook_unpack_u4 | kHook_unpack_f8 |
                                     kHook_unpack_mx4 | kHook_gemm_mx4a16 | kHook_dot_mx4_s8 | kHook_gemm_mx4a8 |
                                     kHook_gemm_nv4a16 | kHook_gemm_nv4a8;
  // acc[m, 32] = exact int32 dot products of one 32-column int8 block (signed rows; colsum unused).
  static void gemm_i8(const LayoutDesc&, const int8_t* const* x, int m, const int8_t* B, int64_t kp, const int32_t*,
                      int32_t* C) {
    gemm_i8_signed_rows(x, m, B, kp, C);
  }

  // int4_group layouts: the W4A8 fused block GEMM and its integer core, the W4A16 unpack.
  static void gemm_u4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const float* scale,
                        const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum,
                        float* C) {
    x86_avx512_u4::gemm_u4a8_rows<x86_avx512_u4::AccBw>(x, rs, m, codes, scale, zero, gstride, kp, G, xsum, C);
  }
  static void dot_u4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    x86_avx512_u4::dot_u4_rows<x86_avx512_u4::AccBw>(x, m, codes, k0, kk, acc);
  }

  // int4_group layouts (W4A16): the unpack to dense bf16 blocks.
  static void unpack_u4(const uint8_t* codes, int64_t k0, int64_t kk, const uint8_t* z, uint16_t* out) {
    x86_avx512_u4::unpack_u4_avx512(codes, k0, kk, z, out);
  }
  // fp8_block layouts (W8A16): the exact table decode to the dense bf16 block (avx512_f8.h).
  static void unpack_f8(const uint8_t* codes, int64_t n, uint16_t* out) { x86_avx512_f8::unpack_f8_avx512(codes, n, out); }

  // mxfp4 layout (W4A16): the exact table decode of the e2m1 codes to the dense bf16 block, and a
  // few rows (this level's rows are fp32) straight from the codes with fp32 FMAs (avx512_mx4_f32.h;
  // no vdpbf16ps here, so mx4_a16_fp32() does not apply).
  static void unpack_mx4(const uint8_t* codes, int64_t k0, int64_t kk, uint16_t* out) {
    x86_avx512_mx4::unpack_mx4_avx512(codes, k0, kk, out);
  }
  using Mx4A16Memo = x86_avx512_mx4_f32::Mx4A16Rows;
  static bool gemm_mx4a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const uint8_t* scale,
                          int64_t gstride, int64_t kp, float* C, void* memo) {
    return x86_avx512_mx4_f32::gemm_mx4a16_f32(fmt, rows, m, codes, scale, gstride, kp, C, static_cast<Mx4A16Memo*>(memo));
  }

  // mxfp4 layout (W4A8): the fused block GEMM and its exact integer core (avx512_mx4{_common,_vnni}.h).
  static void gemm_mx4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                         int64_t gstride, int64_t kp, const A8Sums& xsum, float* C) {
    x86_avx512_mx4::gemm_mx4a8_rows<x86_avx512_mx4::Mx4AccBw>(x, rs, m, codes, scale, gstride, kp, xsum.get(), C);
  }
  static void dot_mx4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    x86_avx512_mx4::dot_mx4_rows<x86_avx512_mx4::Mx4AccBw>(x, m, codes, k0, kk, acc);
  }
  // nvfp4 layout (W4A16): the mxfp4 fp32-FMA kernel over groups of 16 with e4m3 scales (avx512_mx4_f32.h,
  // its rows memo), up to 4 rows; more take the grouped path (unpack_mx4, 16 K at a time).
  using Nv4A16Memo = x86_avx512_mx4_f32::Mx4A16Rows;
  static bool gemm_nv4a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const uint8_t* scale,
                          const float* global, int64_t gstride, int64_t kp, int64_t G, float* C, void* memo) {
    return x86_avx512_mx4_f32::gemm_nv4a16_f32(fmt, rows, m, codes, scale, global, gstride, kp, G, C,
                                              static_cast<Nv4A16Memo*>(memo));
  }
  // nvfp4 layout (W4A8): the mxfp4 block GEMM over groups of 16 with e4m3 scales, groups in order.
  static bool gemm_nv4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                         const float* global, int64_t gstride, int64_t kp, int64_t G, const A8Sums& xsum, float* C) {
    if (G != x86_avx512_mx4::Nv4Scales16::kGroup || kp % 8) return false;
    x86_avx512_mx4::gemm_e2m1a8_rows<x86_avx512_mx4::Mx4AccBw>(x, rs, m, codes, kp, xsum.get(), C,
                                                                   x86_avx512_mx4::Nv4Scales16(scale, gstride, global));
    return true;
  }
};

#include "../kernels/moe_kernels.inc"

}  // namespace
}  // namespace avx512

void register_avx512(KernelTable& t) { avx512::register_level<Isa::avx512>(t); }

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
