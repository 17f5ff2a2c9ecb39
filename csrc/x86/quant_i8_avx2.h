// [NOTE] The int8 kernels' per-row activation quantizer on AVX2 (SEMANTICS.md §3): the same IEEE
// operations as the driver's scalar quantize_row_i8, eight lanes at a time, so codes and scale
// are identical bit for bit (tests/cpp: test_i8_quantizer):
//   amax  = max |v|  (NaN ignored: vmaxps returns its second operand when either is NaN, and the
//                     running maximum is that operand, like fmax)
//   scale = fmax(amax, 1e-7) / 127                      (scalar, as in the driver)
//   q     = clamp(round_half_even(v / scale), -127, 127) (vdivps, vroundps nearest, then
//                     vmaxps(q, -127) with -127 as the SECOND operand, which vmaxps returns when
//                     q is NaN: a NaN quotient becomes -127, like fmin(fmax(NaN, -127), 127).
//                     Keep that operand order.)
// Include after the intrinsics of a translation unit compiled with AVX2 (or SIMDe's aliases);
// internal linkage.
#pragma once

#include <cmath>
#include <cstdint>

namespace moepack {
namespace x86_quant {
namespace {

static inline float quantize_row_i8_avx2(const float* v, int64_t n, int64_t np, int8_t* q, uint8_t flip) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), absmask), m8);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  float amax = 0.0f;
  for (const float l : lanes) amax = std::fmax(amax, l);
  for (; i < n; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  const float scale = std::fmax(amax, 1e-7f) / 127.0f;

  const __m256 sc = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i fl = _mm256_set1_epi8(static_cast<char>(flip));
  // packs leave dwords in the order c0[0..3] c1[0..3] c2[0..3] c3[0..3] | c0[4..7] ... per lane
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i c[4];
    for (int u = 0; u < 4; ++u) {
      __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v + i + 8 * u), sc),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
      c[u] = _mm256_cvtps_epi32(r);
    }
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    b = _mm256_permutevar8x32_epi32(b, order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_xor_si256(b, fl));
  }
  for (; i < n; ++i) {
    const float r = std::fmin(std::fmax(std::nearbyint(v[i] / scale), -127.0f), 127.0f);
    q[i] = int8_t(uint8_t(int8_t(int(r))) ^ flip);
  }
  for (i = n; i < np; ++i) q[i] = int8_t(flip);
  return scale;
}

}  // namespace
}  // namespace x86_quant
}  // namespace moepack
