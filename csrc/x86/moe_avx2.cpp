// [NOTE] AVX2 + FMA (+ F16C) fused-MoE kernels for layouts bf16_n32k2_x86 and i8_n32k4_x86
// (int8: see MK::dot4).
// Compiled with -mavx2 -mfma -mf16c only; registered by dispatch.cpp after cpuid + xgetbv.
//
// Weights: one packed block is [Kp/2][32 columns][2] bf16, i.e. per K pair 128 bytes =
// 4 ymm of 8 (k, k+1) pairs. A pair word w holds element k in its low half, k+1 in its high
// half, so   even = w << 16   and   odd = w & 0xffff0000   are both exact fp32 values: the bf16
// to fp32 conversion costs two integer ops and no shuffles.
// Activations: fp32 rows (broadcast one value per FMA).
//
// Register tiles (16 ymm): MR=1 keeps 8 accumulators (4 even + 4 odd, 8 independent FMA
// chains: enough to hide the 4-cycle latency at M=1 where we stream from memory);
// MR=2 keeps 2 x 4 accumulators, 4 broadcasts and 3 temporaries = 15 registers.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "moepack/kernel.h"
#include "moepack/numeric.h"
#include "avx2_common.h"
#include "prefetch.h"
#include "avx2_u4_common.h"
#include "avx2_f8.h"
#include "avx2_mx4_common.h"

namespace moepack {
namespace avx2 {
namespace {

static inline __m256 even_f32(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline __m256 odd_f32(__m256i w, __m256i hi_mask) { return _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask)); }

struct MK : x86_avx2::Avx2Elementwise {
  static constexpr uint32_t kHooks = Avx2Elementwise::kHooks | kHook_gemm_u4a8 | kHook_dot_u4_s8 | kHook_unpack_u4 | kHook_gemm_u4a16 |
                                     kHook_unpack_f8 | kHook_unpack_mx4 | kHook_dot_mx4_s8 | kHook_gemm_mx4a8 |
                                     kHook_gemm_nv4a16 | kHook_gemm_nv4a8;
  static RowFormat row_format(DType) { return RowFormat::f32; }

  // Variant knobs these kernels read (register.inc variant_knobs): the decode prefetch distance
  // (Variant::pf) in the one-row bf16 and int8 kernels.
  static constexpr uint32_t kPfSchemes = (1u << kScheme_dense) | (1u << kScheme_int8_channel);

  // One row, K pairs [k0, k1) of one block into the 8 accumulators acc (in and out): gemm1 is one
  // range, the two-block kernel alternates ranges of the two blocks (the same FMAs in the same order
  // per accumulator, so the same bits). pf: software prefetch distance in bytes (0: none).
  static inline void gemm1_range(const float* x, const uint16_t* B, int64_t k0, int64_t k1, __m256* acc, int64_t pf,
                                 bool nta) {
    const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
    __m256 ae0 = acc[0], ae1 = acc[1], ae2 = acc[2], ae3 = acc[3];
    __m256 ao0 = acc[4], ao1 = acc[5], ao2 = acc[6], ao3 = acc[7];
    const __m256i* b = reinterpret_cast<const __m256i*>(B) + 4 * k0;
    for (int64_t kk = k0; kk < k1; ++kk, b += 4) {
      if (pf) x86_prefetch::prefetch_lines(reinterpret_cast<const char*>(b) + pf, 2, nta);
      const __m256 x0 = _mm256_broadcast_ss(x + 2 * kk), x1 = _mm256_broadcast_ss(x + 2 * kk + 1);
      __m256i w0 = _mm256_loadu_si256(b + 0), w1 = _mm256_loadu_si256(b + 1);
      __m256i w2 = _mm256_loadu_si256(b + 2), w3 = _mm256_loadu_si256(b + 3);
      ae0 = _mm256_fmadd_ps(even_f32(w0), x0, ae0);
      ao0 = _mm256_fmadd_ps(odd_f32(w0, hi), x1, ao0);
      ae1 = _mm256_fmadd_ps(even_f32(w1), x0, ae1);
      ao1 = _mm256_fmadd_ps(odd_f32(w1, hi), x1, ao1);
      ae2 = _mm256_fmadd_ps(even_f32(w2), x0, ae2);
      ao2 = _mm256_fmadd_ps(odd_f32(w2, hi), x1, ao2);
      ae3 = _mm256_fmadd_ps(even_f32(w3), x0, ae3);
      ao3 = _mm256_fmadd_ps(odd_f32(w3, hi), x1, ao3);
    }
    acc[0] = ae0, acc[1] = ae1, acc[2] = ae2, acc[3] = ae3;
    acc[4] = ao0, acc[5] = ao1, acc[6] = ao2, acc[7] = ao3;
  }
  static inline void gemm1_store(const __m256* acc, float* C) {
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(C + 8 * j, _mm256_add_ps(acc[j], acc[4 + j]));
  }
  // K pairs per range of the two-block kernel: 32 (4 KiB of each block at a time).
  static constexpr int64_t kPairRangeK2 = 32;
  // One row against two blocks (stage 1's gate and up: Variant::pair), ranges alternating.
  static bool gemm_pair1(RowFormat, const void* row, const uint16_t* Bg, const uint16_t* Bu, int64_t kp, float* Cg, float* Cu) {
    const float* x = static_cast<const float*>(row);  // this level's rows are fp32
    const int64_t pf = decode_prefetch_bytes(0);
    const bool nta = current_variant().nta != 0;
    __m256 ag[8], au[8];
    for (int j = 0; j < 8; ++j) ag[j] = au[j] = _mm256_setzero_ps();
    for (int64_t k0 = 0; k0 < kp / 2; k0 += kPairRangeK2) {
      const int64_t k1 = k0 + kPairRangeK2 < kp / 2 ? k0 + kPairRangeK2 : kp / 2;
      gemm1_range(x, Bg, k0, k1, ag, pf, nta);
      gemm1_range(x, Bu, k0, k1, au, pf, nta);
    }
    gemm1_store(ag, Cg);
    gemm1_store(au, Cu);
    return true;
  }

  // One row, one block: the whole K as one range (pf 0, the default here: no software prefetch).
  static void gemm1(const float* x, const uint16_t* B, int64_t kp, float* C) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    gemm1_range(x, B, 0, kp / 2, acc, decode_prefetch_bytes(0), current_variant().nta != 0);
    gemm1_store(acc, C);
  }

  static void gemm2(const float* x, const float* z, const uint16_t* B, int64_t kp, float* C) {
    const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const __m256i* b = reinterpret_cast<const __m256i*>(B);
    for (int64_t kk = 0; kk < kp / 2; ++kk, b += 4) {
      const __m256 x0 = _mm256_broadcast_ss(x + 2 * kk), x1 = _mm256_broadcast_ss(x + 2 * kk + 1);
      const __m256 z0 = _mm256_broadcast_ss(z + 2 * kk), z1 = _mm256_broadcast_ss(z + 2 * kk + 1);
#define MOEPACK_AVX2_STEP(V, ACC_X, ACC_Z)               \
  {                                                      \
    const __m256i w = _mm256_loadu_si256(b + V);         \
    const __m256 e = even_f32(w), o = odd_f32(w, hi);    \
    ACC_X = _mm256_fmadd_ps(e, x0, ACC_X);               \
    ACC_Z = _mm256_fmadd_ps(e, z0, ACC_Z);               \
    ACC_X = _mm256_fmadd_ps(o, x1, ACC_X);               \
    ACC_Z = _mm256_fmadd_ps(o, z1, ACC_Z);               \
  }
      MOEPACK_AVX2_STEP(0, a0, c0)
      MOEPACK_AVX2_STEP(1, a1, c1)
      MOEPACK_AVX2_STEP(2, a2, c2)
      MOEPACK_AVX2_STEP(3, a3, c3)
#undef MOEPACK_AVX2_STEP
    }
    _mm256_storeu_ps(C + 0, a0);
    _mm256_storeu_ps(C + 8, a1);
    _mm256_storeu_ps(C + 16, a2);
    _mm256_storeu_ps(C + 24, a3);
    _mm256_storeu_ps(C + 32, c0);
    _mm256_storeu_ps(C + 40, c1);
    _mm256_storeu_ps(C + 48, c2);
    _mm256_storeu_ps(C + 56, c3);
  }

  // C[m, 32] = A[m, :kp] . B^T for one 32-column block.
  static void gemm(const LayoutDesc&, RowFormat, const void* const* rows, int m, const uint16_t* B, int64_t kp, float* C) {
    int i = 0;
    for (; i + 2 <= m; i += 2) {
      gemm2(static_cast<const float*>(rows[i]), static_cast<const float*>(rows[i + 1]), B, kp, C + i * 32);
    }
    if (i < m) gemm1(static_cast<const float*>(rows[i]), B, kp, C + i * 32);
  }

  // ---- int8 layouts (i8_n32k4_x86): one block is [Kp/4][32 columns][4] int8, per K quad 128
  // bytes = 4 ymm whose 32-bit lanes hold w[n][k..k+3]; the row's 4 codes x[k..k+3] are
  // broadcast to every lane. AVX2 has no signed x signed byte dot product, so:
  //   u8 = |w|          (vpabsb: -128 -> 0x80 = 128 as u8, exact)
  //   s8 = x with the sign of w   (vpsignb: x in [-127, 127], so negation is exact; 0 where w = 0)
  //   vpmaddubsw(u8, s8) = |w0| sx0 + |w1| sx1 = w0 x0 + w1 x1, at most 2 * 128 * 127 = 32512 <
  //   2^15 in magnitude: it never saturates;  vpmaddwd(., 1) adds the pairs into i32.
  // Exact integers, no column-sum correction. (The other assignment, u8 = |x| and sign(w, x),
  // breaks on w = -128, a code compressed-tensors' symmetric int8 can produce.)
  static inline __m256i dot4(__m256i w, __m256i xb, __m256i ones) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xb, w)), ones);
  }
  // One-row (decode) kernel: software prefetch 64 ymm = 2 KiB ahead in the block stream (measured
  // ~+10% GB/s at M = 1 on Zen 3; past a block's end it touches the next task's block).
  static constexpr int kPrefetchVectors = 64;
  static inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }

  static void gemm_i8_1(const int8_t* x, const int8_t* B, int64_t kp, int32_t* C) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    const __m256i* b = reinterpret_cast<const __m256i*>(B);
    const int64_t pf = decode_prefetch_bytes(kPrefetchVectors * 32);  // Variant::pf, else 2 KiB
    const bool nta = current_variant().nta != 0;
    for (int64_t kq = 0; kq < kp / 4; ++kq, b += 4) {
      if (pf) x86_prefetch::prefetch_lines(reinterpret_cast<const char*>(b) + pf, 2, nta);
      const __m256i xb = bcast4(x + 4 * kq);
      a0 = _mm256_add_epi32(a0, dot4(_mm256_loadu_si256(b + 0), xb, ones));
      a1 = _mm256_add_epi32(a1, dot4(_mm256_loadu_si256(b + 1), xb, ones));
      a2 = _mm256_add_epi32(a2, dot4(_mm256_loadu_si256(b + 2), xb, ones));
      a3 = _mm256_add_epi32(a3, dot4(_mm256_loadu_si256(b + 3), xb, ones));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + 0), a0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + 8), a1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + 16), a2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(C + 24), a3);
  }

  // One row against two blocks at once (stage 1's gate and up: Variant::pair), as vLLM's int8
  // decode reads them: two sequential streams, one K quad of each per step, 8 accumulators. The
  // int32 sums are exact, so the same as gemm_i8_1 on each block.
  static void gemm_i8_pair1(const int8_t* x, const int8_t* Bg, const int8_t* Bu, int64_t kp, int32_t* Cg, int32_t* Cu) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    __m256i c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const __m256i* g = reinterpret_cast<const __m256i*>(Bg);
    const __m256i* u = reinterpret_cast<const __m256i*>(Bu);
    const int64_t pf = decode_prefetch_bytes(0);  // none unless the variant says: two streams for the prefetchers
    const bool nta = current_variant().nta != 0;
    for (int64_t kq = 0; kq < kp / 4; ++kq, g += 4, u += 4) {
      if (pf) {
        x86_prefetch::prefetch_lines(reinterpret_cast<const char*>(g) + pf, 2, nta);
        x86_prefetch::prefetch_lines(reinterpret_cast<const char*>(u) + pf, 2, nta);
      }
      const __m256i xb = bcast4(x + 4 * kq);
      a0 = _mm256_add_epi32(a0, dot4(_mm256_loadu_si256(g + 0), xb, ones));
      c0 = _mm256_add_epi32(c0, dot4(_mm256_loadu_si256(u + 0), xb, ones));
      a1 = _mm256_add_epi32(a1, dot4(_mm256_loadu_si256(g + 1), xb, ones));
      c1 = _mm256_add_epi32(c1, dot4(_mm256_loadu_si256(u + 1), xb, ones));
      a2 = _mm256_add_epi32(a2, dot4(_mm256_loadu_si256(g + 2), xb, ones));
      c2 = _mm256_add_epi32(c2, dot4(_mm256_loadu_si256(u + 2), xb, ones));
      a3 = _mm256_add_epi32(a3, dot4(_mm256_loadu_si256(g + 3), xb, ones));
      c3 = _mm256_add_epi32(c3, dot4(_mm256_loadu_si256(u + 3), xb, ones));
    }
    __m256i* og = reinterpret_cast<__m256i*>(Cg);
    __m256i* ou = reinterpret_cast<__m256i*>(Cu);
    _mm256_storeu_si256(og + 0, a0);
    _mm256_storeu_si256(og + 1, a1);
    _mm256_storeu_si256(og + 2, a2);
    _mm256_storeu_si256(og + 3, a3);
    _mm256_storeu_si256(ou + 0, c0);
    _mm256_storeu_si256(ou + 1, c1);
    _mm256_storeu_si256(ou + 2, c2);
    _mm256_storeu_si256(ou + 3, c3);
  }

  // Two rows: 8 accumulators, |w| computed once per weight vector for both rows.
  static void gemm_i8_2(const int8_t* x, const int8_t* z, const int8_t* B, int64_t kp, int32_t* C) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    __m256i c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    const __m256i* b = reinterpret_cast<const __m256i*>(B);
    for (int64_t kq = 0; kq < kp / 4; ++kq, b += 4) {
      const __m256i xb = bcast4(x + 4 * kq), zb = bcast4(z + 4 * kq);
#define MOEPACK_AVX2_I8STEP(V, ACC_X, ACC_Z)                                                          \
  {                                                                                                  \
    const __m256i w = _mm256_loadu_si256(b + V), aw = _mm256_abs_epi8(w);                            \
    ACC_X = _mm256_add_epi32(ACC_X, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, w)), ones)); \
    ACC_Z = _mm256_add_epi32(ACC_Z, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(zb, w)), ones)); \
  }
      MOEPACK_AVX2_I8STEP(0, a0, c0)
      MOEPACK_AVX2_I8STEP(1, a1, c1)
      MOEPACK_AVX2_I8STEP(2, a2, c2)
      MOEPACK_AVX2_I8STEP(3, a3, c3)
#undef MOEPACK_AVX2_I8STEP
    }
    __m256i* o = reinterpret_cast<__m256i*>(C);
    _mm256_storeu_si256(o + 0, a0);
    _mm256_storeu_si256(o + 1, a1);
    _mm256_storeu_si256(o + 2, a2);
    _mm256_storeu_si256(o + 3, a3);
    _mm256_storeu_si256(o + 4, c0);
    _mm256_storeu_si256(o + 5, c1);
    _mm256_storeu_si256(o + 6, c2);
    _mm256_storeu_si256(o + 7, c3);
  }

  // ---- int4_group layouts (avx2_u4_common.h): W4A8 with vpmaddubsw; W4A16 with fp32 rows, one
  // row straight from the codes, more rows through the SIMD unpack to dense bf16 blocks.
  static void gemm_u4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const float* scale,
                        const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum,
                        float* C) {
    x86_avx2_u4::gemm_u4a8_rows<x86_avx2_u4::AccMaddubsU4>(x, rs, m, codes, scale, zero, gstride, kp, G, xsum, C);
  }
  static void dot_u4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    x86_avx2_u4::dot_u4_rows<x86_avx2_u4::AccMaddubsU4>(x, m, codes, k0, kk, acc);
  }
  static void unpack_u4(const uint8_t* codes, int64_t k0, int64_t kk, const uint8_t* z, uint16_t* out) {
    x86_avx2_u4::unpack_u4_avx2(codes, k0, kk, z, out);
  }
  // (The RowMemo argument is unused: one fp32 row is read straight from the codes.)
  static bool gemm_u4a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const float* scale,
                         const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, float* C, void*) {
    if (fmt != RowFormat::f32 || m != 1) return false;
    x86_avx2_u4::gemm_u4a16_f32_row(static_cast<const float*>(rows[0]), codes, scale, zero, gstride, kp, G, C);
    return true;
  }

  // fp8_block layouts (W8A16): the exact F16C decode to the dense bf16 block (avx2_f8.h).
  static void unpack_f8(const uint8_t* codes, int64_t n, uint16_t* out) { x86_avx2_f8::unpack_f8_avx2(codes, n, out); }

  // mxfp4 layout (W4A16): the exact table decode of the e2m1 codes to the dense bf16 block.
  static void unpack_mx4(const uint8_t* codes, int64_t k0, int64_t kk, uint16_t* out) {
    x86_avx2_mx4::unpack_mx4_avx2(codes, k0, kk, out);
  }

  // mxfp4 layout (W4A8): the fused block GEMM and its exact integer core (avx2_mx4_common.h).
  static void gemm_mx4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                         int64_t gstride, int64_t kp, const A8Sums& xsum, float* C) {
    x86_avx2_mx4::gemm_mx4a8_rows<x86_avx2_mx4::Mx4AccMaddubs>(x, rs, m, codes, scale, gstride, kp, xsum.get(), C);
  }
  static void dot_mx4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    x86_avx2_mx4::dot_mx4_rows<x86_avx2_mx4::Mx4AccMaddubs>(x, m, codes, k0, kk, acc);
  }

  // nvfp4 layout (avx2_mx4_common.h: mxfp4's e2m1 decode, groups of 16, e4m3 scales under the
  // columns' globals): W4A16, 1-4 fp32 rows straight from the codes, more rows on the block decoded
  // once per K slice with the group scales applied inside the K loop; W4A8, the fused block GEMM over
  // the mxfp4 integer core.
  static constexpr int kNv4A16FewRows = 4;
  static bool gemm_nv4a16(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const uint8_t* scale,
                          const float* global, int64_t gstride, int64_t kp, int64_t G, float* C, void*) {
    if (fmt != RowFormat::f32 || G != x86_avx2_mx4::kNv4Group || kp % 8) return false;
    const float* const* x = reinterpret_cast<const float* const*>(rows);
    const x86_avx2_mx4::Nv4Scales sc(scale, gstride, global);
    if (m <= kNv4A16FewRows) {
      x86_avx2_mx4::gemm_e2m1a16_f32_rows(x, m, codes, kp, sc, C);
    } else {
      x86_avx2_mx4::gemm_e2m1a16_f32_many(x, m, codes, kp, sc, C);
    }
    return true;
  }
  static bool gemm_nv4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                         const float* global, int64_t gstride, int64_t kp, int64_t G, const A8Sums& xsum, float* C) {
    if (G != x86_avx2_mx4::kNv4Group || kp % 8) return false;
    x86_avx2_mx4::gemm_nv4a8_rows<x86_avx2_mx4::Mx4AccMaddubs>(x, rs, m, codes, scale, global, gstride, kp, xsum.get(), C);
    return true;
  }

  // acc[m, 32] for one 32-column int8 block (signed rows; colsum unused).
  static void gemm_i8(const LayoutDesc&, const int8_t* const* rows, int m, const int8_t* B, int64_t kp, const int32_t*,
                      int32_t* acc) {
    int i = 0;
    for (; i + 2 <= m; i += 2) gemm_i8_2(rows[i], rows[i + 1], B, kp, acc + i * 32);
    if (i < m) gemm_i8_1(rows[i], B, kp, acc + i * 32);
  }
};

#include "../kernels/moe_kernels.inc"

}  // namespace
}  // namespace avx2

void register_avx2(KernelTable& t) { avx2::register_level<Isa::avx2>(t); }

}  // namespace moepack
