// [NOTE] Scalar fused-MoE kernels: the portable path for EVERY layout and the oracle that each
// SIMD kernel is tested against (and that is itself tested against moepack/reference.py).
// Compiled with no ISA flags. It reads weights only through the LayoutDesc numbers
// (block_n, k_pack, code_order: the generated layout_element_offset / layout_code_position), so a
// file packed for any family runs here: bf16 layouts (fp32 rows), int8 layouts (W8A8: s8 rows,
// exact int32 dot products) and int4 layouts (the portable decoders of codec_int4.inc); the
// driver does the rest.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "moepack/kernel.h"
#include "moepack/numeric.h"
#include "../kernels/mk_hooks.h"

namespace moepack {
namespace scalar {
namespace {

struct MK {
  static constexpr uint32_t kHooks = 0;  // the portable code everywhere (csrc/kernels/mk_hooks.h)
  static RowFormat row_format(DType) { return RowFormat::f32; }

  // C[m, bn] = A[m, :kp] . B^T for one packed block of bn columns; element (n, k) of the block
  // sits at layout_element_offset(L, n, k, 0) (layouts_gen.h: moepack/layout.py's formula).
  static void gemm(const LayoutDesc& L, RowFormat, const void* const* rows, int m, const uint16_t* B, int64_t kp, float* C) {
    const int bn = L.block_n;
    for (int i = 0; i < m; ++i) {
      const float* x = static_cast<const float*>(rows[i]);
      float* c = C + i * bn;
      for (int n = 0; n < bn; ++n) {
        float acc = 0.0f;
        for (int64_t k = 0; k < kp; ++k) acc += x[k] * bf16_to_f32(B[layout_element_offset(L, n, k, 0)]);
        c[n] = acc;
      }
    }
  }

  // int8 layouts: acc[m, bn] = exact int32 dot products of s8 rows with one packed block (same
  // element order as above); the column sums are not needed with signed rows.
  static void gemm_i8(const LayoutDesc& L, const int8_t* const* rows, int m, const int8_t* B, int64_t kp,
                      const int32_t*, int32_t* acc) {
    const int bn = L.block_n;
    for (int i = 0; i < m; ++i) {
      const int8_t* x = rows[i];
      int32_t* c = acc + i * bn;
      for (int n = 0; n < bn; ++n) {
        int32_t sum = 0;
        for (int64_t k = 0; k < kp; ++k) sum += int32_t(x[k]) * int32_t(B[layout_element_offset(L, n, k, 0)]);
        c[n] = sum;
      }
    }
  }

  static void activation(const FusedMoeArgs& a, const float* g, const float* u, int n, float* out) {
    switch (a.act) {
      case Activation::silu:
        for (int j = 0; j < n; ++j) out[j] = act_silu(g[j], u[j]);
        break;
      case Activation::gelu:
        for (int j = 0; j < n; ++j) out[j] = act_gelu(g[j], u[j]);
        break;
      case Activation::gelu_tanh:
        for (int j = 0; j < n; ++j) out[j] = act_gelu_tanh(g[j], u[j]);
        break;
      case Activation::swigluoai:
        for (int j = 0; j < n; ++j) out[j] = act_swigluoai(g[j], u[j], a.alpha, a.limit);
        break;
      case Activation::relu2:  // non-gated: g is the up row (the driver passes it as both)
        for (int j = 0; j < n; ++j) out[j] = act_relu2(g[j]);
        break;
    }
  }

  // dst[0, n) = c + bias (bias may be null); `stream` is not used here (plain stores).
  static void out_row(float* dst, const float* c, const float* bias, int n, bool) {
    for (int j = 0; j < n; ++j) dst[j] = bias ? c[j] + bias[j] : c[j];
  }
  static void out_fence() {}

  static void axpy(float w, const float* y, float* acc, int64_t n) {
    for (int64_t i = 0; i < n; ++i) acc[i] += w * y[i];
  }
};

#include "../kernels/moe_kernels.inc"

}  // namespace
}  // namespace scalar

// The scalar kernel reads every layout of the schemes it has through its LayoutDesc (any block_n
// up to the driver's kMaxBlockN, any k_pack), so a packed file of any family runs: its level has
// no architecture, and register_level gives it every layout.
void register_scalar(KernelTable& t) { scalar::register_level<Isa::scalar>(t); }

void register_scalar_layout(KernelTable& t, const LayoutDesc& L) { scalar::register_layout<Isa::scalar>(t, L); }

}  // namespace moepack
