// The AVX2 + F16C exact e4m3fn -> bf16 decode (the avx2 level's unpack_f8 hook, mk_hooks.h), and
// the same decode to fp32 (f8_f32_16: nvfp4's e4m3 group scales, avx2_mx4_common.h Nv4Scales).
// Include only from a file compiled with -mavx2 -mfma -mf16c, after <immintrin.h>, inside that
// level's namespace (internal linkage).
//
// An e4m3fn code s.eeee.mmm read as the fp16 bit pattern s.0eeee.mmm0000000 (magnitude << 7, sign
// << 8) is the code's value times 2^-8: fp16's 5-bit exponent (bias 15) holds e4m3's 4-bit one
// (bias 7) with 8 to spare, and e4m3's subnormals (e = 0: m 2^-9) are fp16 subnormals (m 2^-17)
// that vcvtph2ps converts exactly to normal fp32 (docs/KERNELS.md: checked on the reference
// machine, MXCSR.DAZ set or not). Times 256 (exact, normal fp32 in and out, so FTZ / DAZ cannot
// touch it), the fp32's upper half is the exact bf16 (its lower 16 bits are 0). The magnitude
// 0x7F (NaN in e4m3fn, 480 read as fp16) is replaced by the sign | 0x7FC0 of the table.
#pragma once
#include <cstdint>
#include <cstring>

namespace moepack {
namespace x86_avx2_f8 {
namespace {

// 16 codes widened to words w -> the fp16 bits of each code's value times 2^-8 (the magnitude 0x7F,
// NaN in e4m3fn, reads as 480 * 2^-8: the callers replace it); mag and sign: w's magnitude and its
// sign moved to bit 15. Shared by the bf16 decode below and the fp32 scale decode.
static inline __m256i f8_fp16_bits(__m256i w, __m256i& mag, __m256i& sign) {
  mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7F));
  sign = _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(int16_t(0x8000)));
  return _mm256_or_si256(_mm256_slli_epi16(mag, 7), sign);
}
// The 16 fp16 words h of f8_fp16_bits -> their exact fp32 values times 256 (the codes' values; NaN
// codes still 480): f0 codes 0-7, f1 codes 8-15.
static inline void f8_fp16_f32(__m256i h, __m256& f0, __m256& f1) {
  const __m256 k256 = _mm256_set1_ps(256.0f);
  f0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k256);
  f1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k256);
}

// 16 codes (xmm bytes) -> 16 bf16 words, in order.
static inline __m256i f8_bf16_16(__m128i bytes) {
  __m256i mag, sign;
  const __m256i h = f8_fp16_bits(_mm256_cvtepu8_epi16(bytes), mag, sign);  // fp16 bits: value * 2^-8
  __m256 f0, f1;
  f8_fp16_f32(h, f0, f1);
  // the upper halves, in order: packus interleaves 128-bit lanes, permute4x64 (0, 2, 1, 3) restores them
  const __m256i b = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(f0), 16), _mm256_srli_epi32(_mm256_castps_si256(f1), 16)),
      0xD8);
  const __m256i nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F));
  return _mm256_blendv_epi8(b, _mm256_or_si256(sign, _mm256_set1_epi16(0x7FC0)), nan);
}

// The exact fp32 of 8 e4m3fn codes in an fp32 vector f of f8_fp16_f32 (e4m3_f32, f8_table.h):
// |f| = 480 only for the NaN magnitude (448 is e4m3fn's largest), which becomes the table's quiet
// NaN of its sign.
static inline __m256 f8_f32_fix_nan(__m256 f) {
  const __m256 sgn = _mm256_set1_ps(-0.0f);
  const __m256 nan = _mm256_cmp_ps(_mm256_andnot_ps(sgn, f), _mm256_set1_ps(480.0f), _CMP_EQ_OQ);
  const __m256 q = _mm256_or_ps(_mm256_and_ps(f, sgn), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)));
  return _mm256_blendv_ps(f, q, nan);
}
// 16 codes (xmm bytes) -> their exact fp32 values (e4m3_f32), f0 codes 0-7, f1 codes 8-15.
static inline void f8_f32_16(__m128i bytes, __m256& f0, __m256& f1) {
  __m256i mag, sign;
  f8_fp16_f32(f8_fp16_bits(_mm256_cvtepu8_epi16(bytes), mag, sign), f0, f1);
  f0 = f8_f32_fix_nan(f0);
  f1 = f8_f32_fix_nan(f1);
}

// out[i] = kF8Bf16.v[codes[i]], i < n.
static inline void unpack_f8_avx2(const uint8_t* codes, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), f8_bf16_16(_mm256_castsi256_si128(v)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i + 16), f8_bf16_16(_mm256_extracti128_si256(v, 1)));
  }
  for (; i < n; i += 16) {  // the tail: through a 16-code buffer
    const int64_t r = n - i < 16 ? n - i : 16;
    alignas(16) uint8_t c[16] = {};
    alignas(32) uint16_t o[16];
    std::memcpy(c, codes + i, size_t(r));
    _mm256_store_si256(reinterpret_cast<__m256i*>(o), f8_bf16_16(_mm_load_si128(reinterpret_cast<const __m128i*>(c))));
    std::memcpy(out + i, o, size_t(r) * 2);
  }
}

}  // namespace
}  // namespace x86_avx2_f8
}  // namespace moepack
