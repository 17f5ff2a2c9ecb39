// [NOTE] AVX-512 (F/BW/VL/DQ + BF16) fused-MoE kernels for layout bf16_n32k2_x86, and (when the
// CPU also has AVX512_VNNI) for the int8 layout i8_n32k4_x86 (vpdpbusd: see gemm_i8_tile).
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni -mfma -mf16c only;
// registered by dispatch.cpp after cpuid + xgetbv (opmask, ZMM_Hi256, Hi16_ZMM state).
//
// Weights: one packed block is [Kp/2][32 columns][2] bf16: per K pair 128 bytes = 2 zmm of 16
// (k, k+1) pairs, exactly the operand `vdpbf16ps` takes.
//  * bf16 inputs: activations stay bf16 (row format bf16); a K pair of one row is one 32-bit
//    word, broadcast to 16 lanes, and   acc += vdpbf16ps(B, A)   does 2 FMAs per lane. All
//    operands are exact bf16 values, so this equals fp32 FMAs (up to order and the
//    instruction's denormal flushing).
//  * fp32 / fp16 inputs: fp32 rows; weights widened in registers (even = w << 16,
//    odd = w & 0xffff0000) and fp32 FMAs, like the AVX2 kernel with twice the width.
// Register tiles (32 zmm): bf16 path MR=8 rows x 2 zmm = 16 accumulators (+2 B, broadcasts
// from memory); fp32 path MR=4 x 2 x (combined even/odd) = 8 accumulators; MR=1 paths split
// accumulators further so that 8 FMA chains are in flight (latency 4, 2 ports).
//
// MOEPACK_EMULATE_AVX512: tests/cpp builds this same file against SIMDe's portable
// implementations of the intrinsics, so the kernel logic runs on hosts without AVX-512.
#if defined(MOEPACK_EMULATE_AVX512)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
// SIMDe 0.7.x (Debian libsimde-dev) has no _mm512_cvtps_epi32: without this shim the name binds
// to GCC's native intrinsic, which does not compile without -mavx512f. Two 256-bit halves
// (current rounding mode, like the instruction); replaces SIMDe's alias where a newer one has it.
static inline simde__m512i moepack_emu_mm512_cvtps_epi32(simde__m512 a) {
  simde__m512_private a_ = simde__m512_to_private(a);
  simde__m512i_private r_;
  r_.m256i[0] = simde_mm256_cvtps_epi32(a_.m256[0]);
  r_.m256i[1] = simde_mm256_cvtps_epi32(a_.m256[1]);
  return simde__m512i_from_private(r_);
}
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32(a) moepack_emu_mm512_cvtps_epi32(a)
#ifndef _MM_FROUND_NO_EXC  // SIMDe aliases it only where SSE4.1 is native
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#else
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "moepack/kernel.h"
#include "moepack/numeric.h"

namespace moepack {
namespace avx512 {
namespace {

static inline __m512 even_f32(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
static inline __m512 odd_f32(__m512i w, __m512i hi) { return _mm512_castsi512_ps(_mm512_and_si512(w, hi)); }
static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

static inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 sigmoid_ps(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

static inline uint32_t load_u32(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

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

// ---- fp32 rows: widen weights in registers ---------------------------------------------------
template <int MR>
static inline void gemm_f32_tile(const float* const* x, const uint16_t* B, int64_t kp, float* C) {
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  for (int64_t kk = 0; kk < kp / 2; ++kk, b += 2) {
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 1);
    const __m512 e0 = even_f32(w0), o0 = odd_f32(w0, hi), e1 = even_f32(w1), o1 = odd_f32(w1, hi);
    for (int r = 0; r < MR; ++r) {
      const __m512 x0 = _mm512_set1_ps(x[r][2 * kk]), x1 = _mm512_set1_ps(x[r][2 * kk + 1]);
      acc[r][0] = _mm512_fmadd_ps(e0, x0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(e1, x0, acc[r][1]);
      acc[r][0] = _mm512_fmadd_ps(o0, x1, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(o1, x1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(C + r * 32, acc[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, acc[r][1]);
  }
}

static inline void gemm_f32_row(const float* x, const uint16_t* B, int64_t kp, float* C) {
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  __m512 a[2][4];
  for (int u = 0; u < 2; ++u)
    for (int v = 0; v < 4; ++v) a[u][v] = _mm512_setzero_ps();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const int64_t npairs = kp / 2;
  int64_t kk = 0;
  for (; kk + 2 <= npairs; kk += 2, b += 4) {
    for (int u = 0; u < 2; ++u) {
      const __m512i w0 = _mm512_loadu_si512(b + 2 * u), w1 = _mm512_loadu_si512(b + 2 * u + 1);
      const __m512 x0 = _mm512_set1_ps(x[2 * (kk + u)]), x1 = _mm512_set1_ps(x[2 * (kk + u) + 1]);
      a[u][0] = _mm512_fmadd_ps(even_f32(w0), x0, a[u][0]);
      a[u][1] = _mm512_fmadd_ps(odd_f32(w0, hi), x1, a[u][1]);
      a[u][2] = _mm512_fmadd_ps(even_f32(w1), x0, a[u][2]);
      a[u][3] = _mm512_fmadd_ps(odd_f32(w1, hi), x1, a[u][3]);
    }
  }
  for (; kk < npairs; ++kk, b += 2) {
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 1);
    const __m512 x0 = _mm512_set1_ps(x[2 * kk]), x1 = _mm512_set1_ps(x[2 * kk + 1]);
    a[0][0] = _mm512_fmadd_ps(even_f32(w0), x0, a[0][0]);
    a[0][1] = _mm512_fmadd_ps(odd_f32(w0, hi), x1, a[0][1]);
    a[0][2] = _mm512_fmadd_ps(even_f32(w1), x0, a[0][2]);
    a[0][3] = _mm512_fmadd_ps(odd_f32(w1, hi), x1, a[0][3]);
  }
  _mm512_storeu_ps(C, _mm512_add_ps(_mm512_add_ps(a[0][0], a[0][1]), _mm512_add_ps(a[1][0], a[1][1])));
  _mm512_storeu_ps(C + 16, _mm512_add_ps(_mm512_add_ps(a[0][2], a[0][3]), _mm512_add_ps(a[1][2], a[1][3])));
}

// ---- int8 layouts (AVX512_VNNI): u8 rows x s8 weights with vpdpbusd -------------------------
// One block of i8_n32k4_x86 is [Kp/4][32 columns][4] int8: per K quad 128 bytes = 2 zmm whose
// 32-bit lanes hold w[n][k..k+3], exactly vpdpbusd's signed operand. Its unsigned operand is
// the row's 4 codes broadcast; the driver stores rows as u8 = q + 128 (MK::kI8RowsU8), so
//   acc = sum (q + 128) w = sum q w + 128 colsum[n],  and the exact result is acc - (colsum << 7).
// vpdpbusd adds the four u8 x s8 products (each |.| <= 255 * 128) into the i32 lane without
// saturating (it is vpdpbusds that saturates); int32 wraparound cancels in the subtraction.
template <int MR>
static inline void gemm_i8_tile(const int8_t* const* x, const int8_t* B, int64_t kp, const int32_t* colsum, int32_t* C) {
  __m512i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  for (int64_t kq = 0; kq < kp / 4; ++kq, b += 2) {
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 1);
    for (int r = 0; r < MR; ++r) {
      int32_t v;
      std::memcpy(&v, x[r] + 4 * kq, 4);
      const __m512i xr = _mm512_set1_epi32(v);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xr, w1);
    }
  }
  const __m512i c0 = _mm512_slli_epi32(_mm512_loadu_si512(colsum), 7);
  const __m512i c1 = _mm512_slli_epi32(_mm512_loadu_si512(colsum + 16), 7);
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_si512(C + r * 32, _mm512_sub_epi32(acc[r][0], c0));
    _mm512_storeu_si512(C + r * 32 + 16, _mm512_sub_epi32(acc[r][1], c1));
  }
}

// One row: four K quads in flight on separate accumulators (8 chains hide vpdpbusd's latency).
static inline void gemm_i8_row(const int8_t* x, const int8_t* B, int64_t kp, const int32_t* colsum, int32_t* C) {
  __m512i a[4][2];
  for (int u = 0; u < 4; ++u) a[u][0] = a[u][1] = _mm512_setzero_si512();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const int64_t nq = kp / 4;
  int64_t kq = 0;
  for (; kq + 4 <= nq; kq += 4, b += 8) {
    for (int u = 0; u < 4; ++u) {
      int32_t v;
      std::memcpy(&v, x + 4 * (kq + u), 4);
      const __m512i xr = _mm512_set1_epi32(v);
      a[u][0] = _mm512_dpbusd_epi32(a[u][0], xr, _mm512_loadu_si512(b + 2 * u));
      a[u][1] = _mm512_dpbusd_epi32(a[u][1], xr, _mm512_loadu_si512(b + 2 * u + 1));
    }
  }
  for (; kq < nq; ++kq, b += 2) {
    int32_t v;
    std::memcpy(&v, x + 4 * kq, 4);
    const __m512i xr = _mm512_set1_epi32(v);
    a[0][0] = _mm512_dpbusd_epi32(a[0][0], xr, _mm512_loadu_si512(b));
    a[0][1] = _mm512_dpbusd_epi32(a[0][1], xr, _mm512_loadu_si512(b + 1));
  }
  const __m512i c0 = _mm512_slli_epi32(_mm512_loadu_si512(colsum), 7);
  const __m512i c1 = _mm512_slli_epi32(_mm512_loadu_si512(colsum + 16), 7);
  const __m512i s0 = _mm512_add_epi32(_mm512_add_epi32(a[0][0], a[1][0]), _mm512_add_epi32(a[2][0], a[3][0]));
  const __m512i s1 = _mm512_add_epi32(_mm512_add_epi32(a[0][1], a[1][1]), _mm512_add_epi32(a[2][1], a[3][1]));
  _mm512_storeu_si512(C, _mm512_sub_epi32(s0, c0));
  _mm512_storeu_si512(C + 16, _mm512_sub_epi32(s1, c1));
}

struct MK {
  static RowFormat row_format(DType d) { return d == DType::bf16 ? RowFormat::bf16 : RowFormat::f32; }

  // int8 layouts: the driver stores quantized rows as u8 = q + 128 (vpdpbusd's unsigned operand).
  static constexpr bool kI8RowsU8 = true;

  // acc[m, 32] = exact int32 dot products of one 32-column int8 block (rows u8 = q + 128).
  static void gemm_i8(const LayoutDesc&, const int8_t* const* x, int m, const int8_t* B, int64_t kp, const int32_t* colsum,
                      int32_t* C) {
    int i = 0;
    if (m == 1) return gemm_i8_row(x[0], B, kp, colsum, C);
    for (; i + 8 <= m; i += 8) gemm_i8_tile<8>(x + i, B, kp, colsum, C + i * 32);
    switch (m - i) {
      case 7: gemm_i8_tile<7>(x + i, B, kp, colsum, C + i * 32); break;
      case 6: gemm_i8_tile<6>(x + i, B, kp, colsum, C + i * 32); break;
      case 5: gemm_i8_tile<5>(x + i, B, kp, colsum, C + i * 32); break;
      case 4: gemm_i8_tile<4>(x + i, B, kp, colsum, C + i * 32); break;
      case 3: gemm_i8_tile<3>(x + i, B, kp, colsum, C + i * 32); break;
      case 2: gemm_i8_tile<2>(x + i, B, kp, colsum, C + i * 32); break;
      case 1: gemm_i8_row(x[i], B, kp, colsum, C + i * 32); break;
      default: break;
    }
  }

  // C[m, 32] = A[m, :kp] . B^T for one 32-column block; rows are bf16 bits or fp32 as
  // row_format(dtype) chose; m <= kChunkM.
  static void gemm(const LayoutDesc&, RowFormat fmt, const void* const* rows, int m, const uint16_t* B, int64_t kp, float* C) {
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
    const float* const* x = reinterpret_cast<const float* const*>(rows);
    if (m == 1) return gemm_f32_row(x[0], B, kp, C);
    for (; i + 4 <= m; i += 4) gemm_f32_tile<4>(x + i, B, kp, C + i * 32);
    switch (m - i) {
      case 3: gemm_f32_tile<3>(x + i, B, kp, C + i * 32); break;
      case 2: gemm_f32_tile<2>(x + i, B, kp, C + i * 32); break;
      case 1: gemm_f32_row(x[i], B, kp, C + i * 32); break;
      default: break;
    }
  }

  static void activation(const FusedMoeArgs& a, const float* g, const float* u, int n, float* out) {
    int j = 0;
    switch (a.act) {
      case Activation::silu:
        for (; j + 16 <= n; j += 16) {
          const __m512 gv = _mm512_loadu_ps(g + j), uv = _mm512_loadu_ps(u + j);
          _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid_ps(gv)), uv));
        }
        for (; j < n; ++j) out[j] = act_silu(g[j], u[j]);
        break;
      case Activation::gelu_tanh: {
        const __m512 c2 = _mm512_set1_ps(2.0f * 0.7978845608028654f), c3 = _mm512_set1_ps(0.044715f);
        for (; j + 16 <= n; j += 16) {
          const __m512 gv = _mm512_loadu_ps(g + j), uv = _mm512_loadu_ps(u + j);
          const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(c3, gv), _mm512_mul_ps(gv, gv), gv);
          _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid_ps(_mm512_mul_ps(c2, inner))), uv));
        }
        for (; j < n; ++j) out[j] = act_gelu_tanh(g[j], u[j]);
        break;
      }
      case Activation::swigluoai: {
        const __m512 lim = _mm512_set1_ps(a.limit), nlim = _mm512_set1_ps(-a.limit);
        const __m512 alpha = _mm512_set1_ps(a.alpha), one = _mm512_set1_ps(1.0f);
        for (; j + 16 <= n; j += 16) {
          const __m512 gv = _mm512_min_ps(_mm512_loadu_ps(g + j), lim);
          const __m512 uv = _mm512_max_ps(_mm512_min_ps(_mm512_loadu_ps(u + j), lim), nlim);
          const __m512 glu = _mm512_mul_ps(gv, sigmoid_ps(_mm512_mul_ps(alpha, gv)));
          _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_add_ps(uv, one), glu));
        }
        for (; j < n; ++j) out[j] = act_swigluoai(g[j], u[j], a.alpha, a.limit);
        break;
      }
      case Activation::gelu:
        for (; j < n; ++j) out[j] = act_gelu(g[j], u[j]);
        break;
    }
  }

  static void axpy(float w, const float* y, float* acc, int64_t n) {
    const __m512 wv = _mm512_set1_ps(w);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), _mm512_mul_ps(wv, _mm512_loadu_ps(y + i))));
    }
    for (; i < n; ++i) acc[i] += w * y[i];
  }
};

#include "../kernels/fused_moe_driver.inc"

}  // namespace
}  // namespace avx512

void register_avx512(KernelTable& t) {
  t.fused[kLayoutId_bf16_n32k2_x86][int(Isa::avx512)] = avx512::fused_moe;
  // int8 (vpdpbusd) only where the CPU has AVX512_VNNI; SIMDe emulates it everywhere.
#if defined(MOEPACK_EMULATE_AVX512)
  const bool vnni = true;
#else
  const bool vnni = cpu_features().avx512vnni;
#endif
  if (vnni) {
    t.fused[kLayoutId_i8_n32k4_x86][int(Isa::avx512)] = avx512::fused_moe_i8<>;
    t.gemm_i8[kLayoutId_i8_n32k4_x86][int(Isa::avx512)] = avx512::gemm_i8_block<>;
  }
}

}  // namespace moepack
