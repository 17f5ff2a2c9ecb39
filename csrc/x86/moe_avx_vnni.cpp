// [NOTE] AVX-VNNI fused-MoE kernel for the int8 layout i8_n32k4_x86, ISA level `avx_vnni`: the
// VEX-encoded vpdpbusd on ymm, for CPUs that have it without AVX-512 (Alder Lake and later
// client cores; also Zen 5, where avx512_vnni ranks higher). Compiled with -mavx2 -mfma -mf16c
// -mavxvnni only; registered by dispatch.cpp after cpuid + xgetbv.
//
// One block of i8_n32k4_x86 is [Kp/4][32 columns][4] int8: per K quad 128 bytes = 4 ymm whose
// 32-bit lanes hold w[n][k..k+3], vpdpbusd's signed operand. Its unsigned operand is the row's
// 4 codes broadcast; the driver stores rows as u8 = q + 128 (MK::kI8RowsU8), so
//   acc = sum (q + 128) w = sum q w + 128 colsum[n],  and the exact result is acc - 128 colsum[n].
// 128 colsum[n] comes from the block's own codes (one more vpdpbusd of the bytes 0x80 against each
// weight vector, in the call's first pair of rows; the others reuse it; one row swaps the operands
// and needs only its own code sum: gemm_i8_row), never from the pack's stored column sums: a pack
// whose stored sums disagree with its codes gives every level the same result.
// vpdpbusd adds the four u8 x s8 products into the i32 lane without saturating (vpdpbusds is the
// saturating one); int32 wraparound cancels in the subtraction.
//
// MOEPACK_EMULATE_AVX_VNNI: tests/cpp builds this file with SIMDe's portable vpdpbusd (same
// semantics as the EVEX ymm form), so the kernel runs on AVX2 hosts without AVX-VNNI.
#if defined(MOEPACK_OMIT_LEVEL)
// setup.py found no compiler support for this level's flags: register nothing (the dispatcher
// then reports the level as a fallback).
#include "moepack/kernel.h"
namespace moepack {
void register_avx_vnni(KernelTable&) {}
}  // namespace moepack
#else
#include <immintrin.h>
#if defined(MOEPACK_EMULATE_AVX_VNNI)
#include <simde/x86/avx512/dpbusd.h>
#endif

#include <cstdint>
#include <cstring>

#include "avx2_common.h"
#include "avx2_u4_common.h"
#include "avx2_mx4_vnni.h"
#include "moepack/kernel.h"

namespace moepack {
namespace avx_vnni {
namespace {

// acc + sum over the 4 bytes of each i32 lane of u8[i] * s8[i]
static inline __m256i dpbusd(__m256i acc, __m256i u8, __m256i s8) {
#if defined(MOEPACK_EMULATE_AVX_VNNI)
  return simde_mm256_dpbusd_epi32(acc, u8, s8);
#else
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}

static inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// C = acc - sums (sums = 128 colsum, 4 ymm of 8 columns).
static inline void store_corrected(int32_t* C, const __m256i* acc, const __m256i* sums) {
  for (int v = 0; v < 4; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(C) + v, _mm256_sub_epi32(acc[v], sums[v]));
}

// Software prefetch distance for the one-row (decode) kernel, as in the AVX2 kernel.
constexpr int kPrefetchVectors = 64;

// sum_k q[k] of a row of kp codes stored as u8 = q + 128 (the driver's rows, zero codes as 0x80 up
// to kp): the bytes' u8 sum minus 128 kp (vpdpbusd of the bytes against ones, 32 at a time).
static inline int32_t u8_row_sum(const int8_t* x, int64_t kp) {
  const __m256i ones = _mm256_set1_epi8(1);
  __m256i s = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 32 <= kp; k += 32) s = dpbusd(s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)), ones);
  alignas(32) int32_t l[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), s);
  uint32_t t = 0;
  for (int i = 0; i < 8; ++i) t += uint32_t(l[i]);
  for (; k < kp; ++k) t += uint8_t(x[k]);
  return int32_t(t - (uint32_t(kp) << 7));
}

// One row: two K quads per step on separate accumulators (8 chains hide vpdpbusd's latency). The
// operands swap roles (as avx512_vnni_common.h's decode streams): the weights are the unsigned
// operand, w ^ 0x80 = w + 128 (one vpxor per weight vector instead of a second vpdpbusd), the
// row's codes the signed one, so acc = sum w q + 128 sum_k q: the correction is the row's code sum.
static inline void gemm_i8_row(const int8_t* x, const int8_t* B, int64_t kp, int32_t* C) {
  __m256i a[2][4];
  for (int v = 0; v < 4; ++v) a[0][v] = a[1][v] = _mm256_setzero_si256();
  const __m256i k80 = _mm256_set1_epi8(char(0x80));
  const __m256i* b = reinterpret_cast<const __m256i*>(B);
  const int64_t nq = kp / 4;
  int64_t kq = 0;
  for (; kq + 2 <= nq; kq += 2, b += 8) {
    _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchVectors), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchVectors + 2), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchVectors + 4), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchVectors + 6), _MM_HINT_T0);
    for (int u = 0; u < 2; ++u) {
      const __m256i xb = _mm256_xor_si256(bcast4(x + 4 * (kq + u)), k80);  // the signed codes
      for (int v = 0; v < 4; ++v) a[u][v] = dpbusd(a[u][v], _mm256_xor_si256(_mm256_loadu_si256(b + 4 * u + v), k80), xb);
    }
  }
  for (; kq < nq; ++kq, b += 4) {
    const __m256i xb = _mm256_xor_si256(bcast4(x + 4 * kq), k80);
    for (int v = 0; v < 4; ++v) a[0][v] = dpbusd(a[0][v], _mm256_xor_si256(_mm256_loadu_si256(b + v), k80), xb);
  }
  const __m256i c = _mm256_set1_epi32(int32_t(uint32_t(u8_row_sum(x, kp)) << 7));
  for (int v = 0; v < 4; ++v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(C) + v, _mm256_sub_epi32(_mm256_add_epi32(a[0][v], a[1][v]), c));
  }
}

// Two rows: 8 accumulators, each weight vector loaded once for both (kFindSums as gemm_i8_row's).
template <bool kFindSums>
static inline void gemm_i8_2(const int8_t* x, const int8_t* z, const int8_t* B, int64_t kp, __m256i* sums, int32_t* C) {
  __m256i a[4], c[4], cs[4];
  for (int v = 0; v < 4; ++v) a[v] = c[v] = cs[v] = _mm256_setzero_si256();
  const __m256i k128 = _mm256_set1_epi8(char(0x80));
  const __m256i* b = reinterpret_cast<const __m256i*>(B);
  for (int64_t kq = 0; kq < kp / 4; ++kq, b += 4) {
    const __m256i xb = bcast4(x + 4 * kq), zb = bcast4(z + 4 * kq);
    for (int v = 0; v < 4; ++v) {
      const __m256i w = _mm256_loadu_si256(b + v);
      a[v] = dpbusd(a[v], xb, w);
      c[v] = dpbusd(c[v], zb, w);
      if constexpr (kFindSums) cs[v] = dpbusd(cs[v], k128, w);
    }
  }
  if constexpr (kFindSums) {
    for (int v = 0; v < 4; ++v) sums[v] = cs[v];
  }
  store_corrected(C, a, sums);
  store_corrected(C + 32, c, sums);
}

// int4_group (W4A8) integer core: the u4 codes as vpdpbusd's unsigned operand, the s8 rows as its
// signed one (exact). One row keeps the high nibbles in their own accumulators (8 chains).
template <int MR>
struct AccVnniU4 {
  void operator()(const int8_t* const* x, const uint8_t* codes, int64_t j0, int64_t j1, __m256i acc[][4]) const {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i ah[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < 4; ++q) ah[r][q] = _mm256_setzero_si256();
    for (int64_t j = j0; j < j1; ++j) {
      const __m256i* g = reinterpret_cast<const __m256i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(g) + x86_avx2_u4::kU4PrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g) + x86_avx2_u4::kU4PrefetchBytes + 64, _MM_HINT_T0);
      for (int q = 0; q < 4; ++q) {
        const __m256i v = _mm256_loadu_si256(g + q);
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        for (int r = 0; r < MR; ++r) {
          acc[r][q] = dpbusd(acc[r][q], lo, bcast4(x[r] + 8 * j));
          if constexpr (MR == 1) {
            ah[r][q] = dpbusd(ah[r][q], hi, bcast4(x[r] + 8 * j + 4));
          } else {
            acc[r][q] = dpbusd(acc[r][q], hi, bcast4(x[r] + 8 * j + 4));
          }
        }
      }
    }
    if constexpr (MR == 1) {
      for (int q = 0; q < 4; ++q) acc[0][q] = _mm256_add_epi32(acc[0][q], ah[0][q]);
    }
  }
};

struct MK : x86_avx2::Avx2Elementwise {
  static constexpr uint32_t kHooks = Avx2Elementwise::kHooks | kHook_gemm_u4a8 | kHook_dot_u4_s8 | kHook_gemm_mx4a8 |
                                     kHook_dot_mx4_s8 | kHook_gemm_nv4a8;
  // int8 layouts: the driver stores quantized rows as u8 = q + 128 (vpdpbusd's unsigned operand).
  static constexpr bool kI8RowsU8 = true;

  // acc[m, 32] = exact int32 dot products of one 32-column int8 block (rows u8 = q + 128). The
  // first pair finds the column sums from the codes, one row needs none (the stored ones are not read).
  static void gemm_i8(const LayoutDesc&, const int8_t* const* rows, int m, const int8_t* B, int64_t kp, const int32_t*,
                      int32_t* acc) {
    if (m < 2) {
      if (m == 1) gemm_i8_row(rows[0], B, kp, acc);
      return;
    }
    __m256i sums[4];
    gemm_i8_2<true>(rows[0], rows[1], B, kp, sums, acc);
    int i = 2;
    for (; i + 2 <= m; i += 2) gemm_i8_2<false>(rows[i], rows[i + 1], B, kp, sums, acc + i * 32);
    if (i < m) gemm_i8_row(rows[i], B, kp, acc + i * 32);
  }

  // int4_group layouts (W4A8): the fused block GEMM and its integer core (avx2_u4_common.h).
  static void gemm_u4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const float* scale,
                        const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, const int32_t* xsum,
                        float* C) {
    x86_avx2_u4::gemm_u4a8_rows<AccVnniU4>(x, rs, m, codes, scale, zero, gstride, kp, G, xsum, C);
  }
  static void dot_u4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    x86_avx2_u4::dot_u4_rows<AccVnniU4>(x, m, codes, k0, kk, acc);
  }

  // mxfp4 layout (W4A8): the fused block GEMM and its exact integer core (avx2_mx4_vnni.h).
  static void gemm_mx4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                         int64_t gstride, int64_t kp, const A8Sums& xsum, float* C) {
    x86_avx2_mx4::gemm_mx4a8_rows<x86_avx2_mx4::Mx4AccVnni>(x, rs, m, codes, scale, gstride, kp, xsum.get(), C);
  }
  static void dot_mx4_s8(const int8_t* const* x, int m, const uint8_t* codes, int64_t k0, int64_t kk, int32_t* acc) {
    x86_avx2_mx4::dot_mx4_rows<x86_avx2_mx4::Mx4AccVnni>(x, m, codes, k0, kk, acc);
  }
  // nvfp4 layout (W4A8): the same block GEMM over groups of 16 with e4m3 scales (avx2_mx4_common.h).
  static bool gemm_nv4a8(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                         const float* global, int64_t gstride, int64_t kp, int64_t G, const A8Sums& xsum, float* C) {
    if (G != x86_avx2_mx4::kNv4Group || kp % 8) return false;
    x86_avx2_mx4::gemm_nv4a8_rows<x86_avx2_mx4::Mx4AccVnni>(x, rs, m, codes, scale, global, gstride, kp, xsum.get(), C);
    return true;
  }
};

#include "../kernels/moe_kernels.inc"

}  // namespace
}  // namespace avx_vnni

void register_avx_vnni(KernelTable& t) { avx_vnni::register_level<Isa::avx_vnni>(t); }

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
