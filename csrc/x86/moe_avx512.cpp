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
#include "avx512_common.h"

namespace moepack {
namespace avx512 {
namespace {

using namespace x86_avx512;

static inline __m512i dot4(__m512i aw, __mmask64 neg, __m512i xb, __m512i ones) {
  const __m512i sx = _mm512_mask_sub_epi8(xb, neg, _mm512_setzero_si512(), xb);
  return _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sx), ones);
}

static inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(int(load_u32(p))); }

template <int MR>
static inline void gemm_i8_tile(const int8_t* const* x, const int8_t* B, int64_t kp, int32_t* C) {
  const __m512i ones = _mm512_set1_epi16(1);
  __m512i acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  for (int64_t kq = 0; kq < kp / 4; ++kq, b += 2) {
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 1);
    const __m512i aw0 = _mm512_abs_epi8(w0), aw1 = _mm512_abs_epi8(w1);
    const __mmask64 n0 = _mm512_movepi8_mask(w0), n1 = _mm512_movepi8_mask(w1);
    for (int r = 0; r < MR; ++r) {
      const __m512i xr = bcast4(x[r] + 4 * kq);
      acc[r][0] = _mm512_add_epi32(acc[r][0], dot4(aw0, n0, xr, ones));
      acc[r][1] = _mm512_add_epi32(acc[r][1], dot4(aw1, n1, xr, ones));
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_si512(C + r * 32, acc[r][0]);
    _mm512_storeu_si512(C + r * 32 + 16, acc[r][1]);
  }
}

// One row: two K quads per step on separate accumulators (4 chains).
static inline void gemm_i8_row(const int8_t* x, const int8_t* B, int64_t kp, int32_t* C) {
  const __m512i ones = _mm512_set1_epi16(1);
  __m512i a[2][2];
  for (int u = 0; u < 2; ++u) a[u][0] = a[u][1] = _mm512_setzero_si512();
  const __m512i* b = reinterpret_cast<const __m512i*>(B);
  const int64_t nq = kp / 4;
  int64_t kq = 0;
  for (; kq + 2 <= nq; kq += 2, b += 4) {
    for (int u = 0; u < 2; ++u) {
      const __m512i xr = bcast4(x + 4 * (kq + u));
      const __m512i w0 = _mm512_loadu_si512(b + 2 * u), w1 = _mm512_loadu_si512(b + 2 * u + 1);
      a[u][0] = _mm512_add_epi32(a[u][0], dot4(_mm512_abs_epi8(w0), _mm512_movepi8_mask(w0), xr, ones));
      a[u][1] = _mm512_add_epi32(a[u][1], dot4(_mm512_abs_epi8(w1), _mm512_movepi8_mask(w1), xr, ones));
    }
  }
  for (; kq < nq; ++kq, b += 2) {
    const __m512i xr = bcast4(x + 4 * kq);
    const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 1);
    a[0][0] = _mm512_add_epi32(a[0][0], dot4(_mm512_abs_epi8(w0), _mm512_movepi8_mask(w0), xr, ones));
    a[0][1] = _mm512_add_epi32(a[0][1], dot4(_mm512_abs_epi8(w1), _mm512_movepi8_mask(w1), xr, ones));
  }
  _mm512_storeu_si512(C, _mm512_add_epi32(a[0][0], a[1][0]));
  _mm512_storeu_si512(C + 16, _mm512_add_epi32(a[0][1], a[1][1]));
}

struct MK : Avx512Base {
  // acc[m, 32] = exact int32 dot products of one 32-column int8 block (signed rows; colsum unused).
  static void gemm_i8(const LayoutDesc&, const int8_t* const* x, int m, const int8_t* B, int64_t kp, const int32_t*,
                      int32_t* C) {
    if (m == 1) return gemm_i8_row(x[0], B, kp, C);
    int i = 0;
    for (; i + 4 <= m; i += 4) gemm_i8_tile<4>(x + i, B, kp, C + i * 32);
    switch (m - i) {
      case 3: gemm_i8_tile<3>(x + i, B, kp, C + i * 32); break;
      case 2: gemm_i8_tile<2>(x + i, B, kp, C + i * 32); break;
      case 1: gemm_i8_row(x[i], B, kp, C + i * 32); break;
      default: break;
    }
  }
};

#include "../kernels/fused_moe_driver.inc"

}  // namespace
}  // namespace avx512

void register_avx512(KernelTable& t) {
  using avx512::MK;
  avx512::register_scheme<avx512::DenseA16<MK>>(t, kLayout_bf16_n32k2_x86, Isa::avx512);
  avx512::register_scheme<avx512::Int8A8<MK>>(t, kLayout_i8_n32k4_x86, Isa::avx512);
}

}  // namespace moepack
#endif  // MOEPACK_OMIT_LEVEL
