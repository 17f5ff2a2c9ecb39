// [NOTE] AVX-512 VNNI fused-MoE kernel for the int8 layout i8_n32k4_x86, ISA level
// `avx512_vnni` (vpdpbusd: see gemm_i8_tile). Compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mavx512vnni -mfma -mf16c only; registered by dispatch.cpp after cpuid + xgetbv.
// Everything but the integer block GEMM (fp32 dequantization, activations, combine) is the
// shared driver plus avx512_common.h.
#if defined(MOEPACK_OMIT_LEVEL)
// setup.py found no compiler support for this level's flags: register nothing (the dispatcher
// then reports the level as a fallback).
#include "moepack/kernel.h"
namespace moepack {
void register_avx512_vnni(KernelTable&) {}
}  // namespace moepack
#else
#include "avx512_vnni_common.h"
#include "avx512_mx4_vnni.h"

namespace moepack {
namespace avx512_vnni {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_vnni;

struct MK : Avx512Base {
  // The schemes whose few-row (decode) kernels here read decode_one_stream(): Variant::streams
  // (register.inc variant_knobs).
  static constexpr uint32_t kStreamsSchemes = (1u << kScheme_int8_channel) | (1u << kScheme_int4_group) | (1u << kScheme_mxfp4);
  static constexpr uint32_t kPfSchemes = kStreamsSchemes;  // for_k_streams' prefetch distance (Variant::pf)
  static constexpr uint32_t kHooks = Avx512Base::kHooks | kHook_gemm_i8_prefetch | kHook_gemm_u4a8 | kHook_dot_u4_s8 |
                                     kHook_gemm_mx4a8 | kHook_dot_mx4_s8 | kHook_gemm_nv4a8;
  // int8 layouts: the driver stores quantized rows as u8 = q + 128 (vpdpbusd's unsigned operand).
  static constexpr bool kI8RowsU8 = true;

  // acc[m, 32] = exact int32 dot products of one 32-column int8 block (rows u8 = q + 128),
  // prefetching `next_bytes` of the worker's next block (`next`) while the tiles compute. The
  // stored column sums are not read (the kernels offset the weights: avx512_vnni_common.h).
  static void gemm_i8(const LayoutDesc&, const int8_t* const* x, int m, const int8_t* B, int64_t kp, const int32_t*,
                      int32_t* C, const char* next = nullptr, int64_t next_bytes = 0) {
    gemm_i8_vnni_rows(x, m, B, kp, C, NextLines{next, next_bytes / 64});
  }

  // One row against stage 1's gate and up blocks at once (Variant::pair; rows u8 = q + 128).
  static void gemm_i8_pair1(const int8_t* x, const int8_t* Bg, const int8_t* Bu, int64_t kp, int32_t* Cg, int32_t* Cu) {
    gemm_i8_pair_row(x, Bg, Bu, kp, Cg, Cu);
  }

  // int4_group layouts: the W4A8 fused block GEMM and its integer core, the W4A16 unpack.
  static void gemm_u4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const float* scale,
                        const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum,
                        float* C) {
    gemm_u4a8_vnni(x, rs, m, codes, scale, zero, gstride, kp, G, xsum, C);
  }
  static void dot_u4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    x86_avx512_u4::dot_u4_rows<AccVnniU4>(x, m, codes, k0, kk, acc);
  }

  // mxfp4 layout (W4A8): the fused block GEMM and its exact integer core (avx512_mx4{_common,_vnni}.h).
  static void gemm_mx4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                         int64_t gstride, int64_t kp, const A8Sums& xsum, float* C) {
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
}  // namespace avx512_vnni

void register_avx512_vnni(KernelTable& t) { avx512_vnni::register_level<Isa::avx512_vnni>(t); }

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
