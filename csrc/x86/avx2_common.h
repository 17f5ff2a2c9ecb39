// [NOTE] AVX2 + FMA element-wise pieces shared by the AVX2-level kernels (moe_avx2.cpp,
// moe_avx_vnni.cpp): exp/sigmoid, the activations and the combine's axpy. Not a general header:
// include it only in a translation unit compiled with (at least) -mavx2 -mfma, after
// <immintrin.h>; everything here has internal linkage.
#pragma once

#include <cmath>
#include <cstdint>

#include "moepack/kernel.h"
#include "moepack/numeric.h"
#include "../kernels/mk_hooks.h"
#include "quant_i8_avx2.h"

namespace moepack {
namespace x86_avx2 {
namespace {

// exp(x) for x in [-87.3, 88.3] (clamped), Cephes-style: 2^n * p(r), ~1 ulp.
static inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 sigmoid_ps(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// The MK members every AVX2-level kernel shares (a kernel's MK derives from it).
struct Avx2Elementwise {
  static constexpr uint32_t kHooks = kHook_quantize_row_i8;  // csrc/kernels/mk_hooks.h; an MK restates it with its own
  static constexpr int kBlockN = 32;  // every x86 kernel is written for 32-column blocks
  static constexpr int kDenseKPack = 2;  // bf16 pairs (bf16_n32k2_x86)
  static constexpr int kInt8KPack = 4;   // int8 quads (i8_n32k4_x86)
  // int4 quads of 8 codes, byte j = codes j | j + 4 << 4 (the u4*_n32k8_x86 layouts): what the u4
  // hooks read; an int4 layout of another blocking or code order is refused for these levels.
  static constexpr const LayoutDesc* kU4Blocking = &kLayout_u4g32_n32k8_x86;
  static float quantize_row_i8(const float* v, int64_t n, int64_t np, int8_t* q, uint8_t flip) {
    return x86_quant::quantize_row_i8_avx2(v, n, np, q, flip);
  }

  static void activation(const FusedMoeArgs& a, const float* g, const float* u, int n, float* out) {
    int j = 0;
    switch (a.act) {
      case Activation::silu:
        for (; j + 8 <= n; j += 8) {
          const __m256 gv = _mm256_loadu_ps(g + j), uv = _mm256_loadu_ps(u + j);
          _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid_ps(gv)), uv));
        }
        for (; j < n; ++j) out[j] = act_silu(g[j], u[j]);
        break;
      case Activation::gelu_tanh: {
        // 0.5 * (1 + tanh(z)) == sigmoid(2z)
        const __m256 c2 = _mm256_set1_ps(2.0f * 0.7978845608028654f), c3 = _mm256_set1_ps(0.044715f);
        for (; j + 8 <= n; j += 8) {
          const __m256 gv = _mm256_loadu_ps(g + j), uv = _mm256_loadu_ps(u + j);
          const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(c3, gv), _mm256_mul_ps(gv, gv), gv);
          _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid_ps(_mm256_mul_ps(c2, inner))), uv));
        }
        for (; j < n; ++j) out[j] = act_gelu_tanh(g[j], u[j]);
        break;
      }
      case Activation::swigluoai: {
        const __m256 lim = _mm256_set1_ps(a.limit), nlim = _mm256_set1_ps(-a.limit);
        const __m256 alpha = _mm256_set1_ps(a.alpha), one = _mm256_set1_ps(1.0f);
        for (; j + 8 <= n; j += 8) {
          // vminps/vmaxps return the second operand when either is NaN: the value goes second
          const __m256 gv = _mm256_min_ps(lim, _mm256_loadu_ps(g + j));
          const __m256 uv = _mm256_max_ps(nlim, _mm256_min_ps(lim, _mm256_loadu_ps(u + j)));
          const __m256 glu = _mm256_mul_ps(gv, sigmoid_ps(_mm256_mul_ps(alpha, gv)));
          _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_add_ps(uv, one), glu));
        }
        for (; j < n; ++j) out[j] = act_swigluoai(g[j], u[j], a.alpha, a.limit);
        break;
      }
      case Activation::relu2: {  // non-gated: g is the up row; vmaxps(0, NaN) keeps the NaN (second operand)
        const __m256 zero = _mm256_setzero_ps();
        for (; j + 8 <= n; j += 8) {
          const __m256 r = _mm256_max_ps(zero, _mm256_loadu_ps(g + j));
          _mm256_storeu_ps(out + j, _mm256_mul_ps(r, r));
        }
        for (; j < n; ++j) out[j] = act_relu2(g[j]);
        break;
      }
      case Activation::gelu:  // erf: scalar libm (exact GELU is rare in MoE models)
        for (; j < n; ++j) out[j] = act_gelu(g[j], u[j]);
        break;
    }
  }

  // dst[0, n) = c + bias (bias may be null). `stream`: with non-temporal stores where dst is
  // 32-byte aligned and n a multiple of 8 (the caller ends its stores with out_fence()).
  static void out_row(float* dst, const float* c, const float* bias, int n, bool stream) {
    int j = 0;
    if (stream && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
      for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(c + j);
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
        _mm256_stream_ps(dst + j, v);
      }
    }
    for (; j < n; ++j) dst[j] = bias ? c[j] + bias[j] : c[j];
  }
  static void out_fence() { _mm_sfence(); }

  static void axpy(float w, const float* y, float* acc, int64_t n) {
    const __m256 wv = _mm256_set1_ps(w);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(acc + i, _mm256_add_ps(_mm256_loadu_ps(acc + i), _mm256_mul_ps(wv, _mm256_loadu_ps(y + i))));
    }
    for (; i < n; ++i) acc[i] += w * y[i];
  }
};

}  // namespace
}  // namespace x86_avx2
}  // namespace moepack
