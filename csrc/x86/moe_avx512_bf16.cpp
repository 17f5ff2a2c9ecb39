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
#include "avx512_common.h"

namespace moepack {
namespace avx512_bf16 {
namespace {

using namespace x86_avx512;

static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// ---- bf16 rows: vdpbf16ps ------------------------------------------------------------------
template <int MR>
static inline void gemm_bf16_tile(const uint16_t* const* x, const uint16_t* B, int64_t kp, float* C) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  for (int64_t kk = 0; kk < kp / 2; ++kk, b += 2) {
    const __m512bh w0 = as_bh(_mm512_loadu_si512(b)), w1 = as_bh(_mm512_loadu_si512(b + 1));
    for (int r = 0; r < MR; ++r) {
      const __m512bh xr = as_bh(_mm512_set1_epi32(int(load_u32(x[r] + 2 * kk))));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(C + r * 32, acc[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, acc[r][1]);
  }
}

// One row: four K pairs in flight on separate accumulators (8 chains).
static inline void gemm_bf16_row(const uint16_t* x, const uint16_t* B, int64_t kp, float* C) {
  __m512 a[4][2];
  for (int u = 0; u < 4; ++u) a[u][0] = a[u][1] = _mm512_setzero_ps();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const int64_t npairs = kp / 2;
  int64_t kk = 0;
  for (; kk + 4 <= npairs; kk += 4, b += 8) {
    for (int u = 0; u < 4; ++u) {
      const __m512bh xr = as_bh(_mm512_set1_epi32(int(load_u32(x + 2 * (kk + u)))));
      a[u][0] = _mm512_dpbf16_ps(a[u][0], as_bh(_mm512_loadu_si512(b + 2 * u)), xr);
      a[u][1] = _mm512_dpbf16_ps(a[u][1], as_bh(_mm512_loadu_si512(b + 2 * u + 1)), xr);
    }
  }
  for (; kk < npairs; ++kk, b += 2) {
    const __m512bh xr = as_bh(_mm512_set1_epi32(int(load_u32(x + 2 * kk))));
    a[0][0] = _mm512_dpbf16_ps(a[0][0], as_bh(_mm512_loadu_si512(b)), xr);
    a[0][1] = _mm512_dpbf16_ps(a[0][1], as_bh(_mm512_loadu_si512(b + 1)), xr);
  }
  _mm512_storeu_ps(C, _mm512_add_ps(_mm512_add_ps(a[0][0], a[1][0]), _mm512_add_ps(a[2][0], a[3][0])));
  _mm512_storeu_ps(C + 16, _mm512_add_ps(_mm512_add_ps(a[0][1], a[1][1]), _mm512_add_ps(a[2][1], a[3][1])));
}

struct MK : Avx512Base {
  static RowFormat row_format(DType d) { return d == DType::bf16 ? RowFormat::bf16 : RowFormat::f32; }

  // C[m, 32] = A[m, :kp] . B^T for one 32-column block; rows are bf16 bits or fp32 as
  // row_format(dtype) chose; m <= kChunkM.
  static void gemm(const LayoutDesc& L, RowFormat fmt, const void* const* rows, int m, const uint16_t* B, int64_t kp, float* C) {
    int i = 0;
    if (fmt == RowFormat::bf16) {
      const uint16_t* const* x = reinterpret_cast<const uint16_t* const*>(rows);
      if (m == 1) return gemm_bf16_row(x[0], B, kp, C);
      for (; i + 8 <= m; i += 8) gemm_bf16_tile<8>(x + i, B, kp, C + i * 32);
      switch (m - i) {
        case 7: gemm_bf16_tile<7>(x + i, B, kp, C + i * 32); break;
        case 6: gemm_bf16_tile<6>(x + i, B, kp, C + i * 32); break;
        case 5: gemm_bf16_tile<5>(x + i, B, kp, C + i * 32); break;
        case 4: gemm_bf16_tile<4>(x + i, B, kp, C + i * 32); break;
        case 3: gemm_bf16_tile<3>(x + i, B, kp, C + i * 32); break;
        case 2: gemm_bf16_tile<2>(x + i, B, kp, C + i * 32); break;
        case 1: gemm_bf16_row(x[i], B, kp, C + i * 32); break;
        default: break;
      }
      return;
    }
    Avx512Base::gemm(L, fmt, rows, m, B, kp, C);
  }
};

#include "../kernels/fused_moe_driver.inc"

}  // namespace
}  // namespace avx512_bf16

void register_avx512_bf16(KernelTable& t) {
  avx512_bf16::register_scheme<avx512_bf16::DenseA16<avx512_bf16::MK>>(t, kLayout_bf16_n32k2_x86, Isa::avx512_bf16);
}

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
