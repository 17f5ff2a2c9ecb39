// [NOTE] What the AVX-512 kernels share (moe_avx512.cpp, moe_avx512_vnni.cpp, moe_avx512_bf16.cpp):
// the intrinsics (native, or SIMDe's portable ones under MOEPACK_EMULATE_AVX512), exp/sigmoid,
// the fp32-row GEMM that widens bf16 weights in registers, the activations and the combine's
// axpy. Include it only in a translation unit compiled with at least -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mfma -mf16c (or emulated); everything here has internal linkage, and
// needs nothing beyond AVX-512 F/BW/VL/DQ.
//
// fp32 rows (all dtypes at the avx512 level; fp32/fp16 at avx512_bf16): weights widened in
// registers (even = w << 16, odd = w & 0xffff0000, both exact fp32) and fp32 FMAs, like the
// AVX2 kernel with twice the width. Tiles (32 zmm): MR=4 x 2 x (combined even/odd) = 8
// accumulators; MR=1 splits accumulators further so that 8 FMA chains are in flight.
//
// MOEPACK_EMULATE_AVX512: tests/cpp builds these files against SIMDe, so the kernel logic runs
// on hosts without AVX-512.
#pragma once

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
// SIMDe 0.7.x has no _mm512_cvtepu8_epi16 (the int4 kernels' byte widening): two 256-bit halves.
static inline simde__m512i moepack_emu_mm512_cvtepu8_epi16(simde__m256i a) {
  simde__m512i_private r_;
  r_.m256i[0] = simde_mm256_cvtepu8_epi16(simde_mm256_castsi256_si128(a));
  r_.m256i[1] = simde_mm256_cvtepu8_epi16(simde_mm256_extracti128_si256(a, 1));
  return simde__m512i_from_private(r_);
}
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16(a) moepack_emu_mm512_cvtepu8_epi16(a)
// ... nor _mm512_cvtepu8_epi32 / _mm512_cvtepi32_ps (the int4 kernels' zero points).
static inline simde__m512i moepack_emu_mm512_cvtepu8_epi32(simde__m128i a) {
  simde__m512i_private r_;
  r_.m256i[0] = simde_mm256_cvtepu8_epi32(a);
  r_.m256i[1] = simde_mm256_cvtepu8_epi32(simde_mm_srli_si128(a, 8));
  return simde__m512i_from_private(r_);
}
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32(a) moepack_emu_mm512_cvtepu8_epi32(a)
static inline simde__m512 moepack_emu_mm512_cvtepi32_ps(simde__m512i a) {
  simde__m512i_private a_ = simde__m512i_to_private(a);
  simde__m512_private r_;
  r_.m256[0] = simde_mm256_cvtepi32_ps(a_.m256i[0]);
  r_.m256[1] = simde_mm256_cvtepi32_ps(a_.m256i[1]);
  return simde__m512_from_private(r_);
}
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps(a) moepack_emu_mm512_cvtepi32_ps(a)
// SIMDe 0.7.x aliases _mm512_madd_epi16 with the masked form's four parameters.
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
#ifndef _MM_FROUND_NO_EXC  // SIMDe aliases it only where SSE4.1 is native
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#else
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "moepack/kernel.h"
#include "moepack/numeric.h"
#include "../kernels/mk_hooks.h"
#include "quant_i8_avx2.h"
#include "prefetch.h"

namespace moepack {
namespace x86_avx512 {
namespace {

// Software prefetch of a decode stream, `lines` cache lines kStreamPrefetchBytes ahead: the decode
// kernels stream each task's block once, and the L2 streamer restarts at every 4 KiB page. `off`:
// the step's byte offset in the block; a prefetch that would pass the end of its segment
// (`seg_end`) lands `next` bytes further on instead: in the same segment of the next block, the
// one the worker's next task (the next column block, contiguous in the packed tensor) reads, so
// that its S streams start in cache rather than with S misses (the other segments of this block
// are streaming already). qwen3 shape, one token, int4 W4A16: 0.83 -> 0.68-0.76 ms.
// Prefill: the lines of the worker's next weight block (the driver passes the next task's block
// when its guided run holds one), prefetched into L2 (T1) while this block's tiles compute from
// cache, one line per K step (128 bytes of weights read from cache, ~16 dot-product cycles): about
// the machine's read rate while the cores are busy, so that weight streaming overlaps compute
// instead of stalling each block's first tile on DRAM. `lines` <= 0: nothing to prefetch.
struct NextLines {
  const char* p = nullptr;
  int64_t lines = 0;
  // The share of tile t of n (contiguous lines; the first tiles take the remainder).
  NextLines share(int t, int n) const {
    if (lines <= 0 || n <= 0) return {};
    const int64_t q = lines / n, r = lines % n, begin = t * q + (t < r ? t : r);
    return {p + 64 * begin, q + (t < r ? 1 : 0)};
  }
};
// One K step's prefetches: two lines per step while more lines remain than steps (`two`).
static inline void next_lines_step(NextLines& nl, bool two) {
  if (nl.lines > 0) {
    _mm_prefetch(nl.p, _MM_HINT_T1);
    if (two && nl.lines > 1) {
      _mm_prefetch(nl.p + 64, _MM_HINT_T1);
      nl.p += 64;
      --nl.lines;
    }
    nl.p += 64;
    --nl.lines;
  }
}

using x86_prefetch::prefetch_lines;  // (prefetch.h) the decode kernels' prefetch, T0 or non-temporal

constexpr int kStreamPrefetchBytes = 1024;
static inline void prefetch_segment(const void* block, int64_t off, int64_t seg_end, int64_t next, int lines,
                                    int64_t dist = kStreamPrefetchBytes, bool nta = false) {
  int64_t o = off + dist;
  if (o >= seg_end) o += next;
  prefetch_lines(static_cast<const char*>(block) + o, lines, nta);
}

// Decode streams: the K steps of a block split into S contiguous segments that advance together,
// so that one thread keeps S address streams in flight. Which S is faster depends on the CPU
// (decode_one_stream(), docs/KERNELS.md "Decode streams"): on Sapphire Rapids one sequential
// stream reached ~83% of the S = 4 rate (the L2 streamer stops at every 4 KiB page and one stream
// has too few misses outstanding); on Zen 4, S = 1 takes 7-24% less time than S = 4. The kernels
// instantiate both and pick per call. step(s, k) adds K step k
// (`step_bytes` of the block from k * step_bytes on, prefetched here by prefetch_segment, `lines`
// lines per step) into segment s's accumulators; the steps after S * (nsteps / S) go to segment 0.
// Callers keep one set of accumulators per segment and sum them at the end.
// The prefetch distance is the call's variant's (Variant::pf: 0 none), else kStreamPrefetchBytes.
template <int S, class Step>
static inline void for_k_streams(int64_t nsteps, const void* block, int64_t step_bytes, int lines, Step&& step) {
  const int64_t seg = nsteps / S, seg_bytes = seg * step_bytes, blk_bytes = nsteps * step_bytes;
  const int64_t dist = decode_prefetch_bytes(kStreamPrefetchBytes);
  const bool nta = current_variant().nta != 0;  // Variant::nta: the non-temporal hint
  if (dist == 0) lines = 0;
  for (int64_t kk = 0; kk < seg; ++kk) {
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      prefetch_segment(block, (s * seg + kk) * step_bytes, (s + 1) * seg_bytes, blk_bytes - seg_bytes, lines, dist, nta);
      step(s, s * seg + kk);
    }
  }
  for (int64_t k = S * seg; k < nsteps; ++k) {
    prefetch_segment(block, k * step_bytes, blk_bytes, 0, lines, dist, nta);
    step(0, k);
  }
}

static inline __m512 even_f32(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
static inline __m512 odd_f32(__m512i w, __m512i hi) { return _mm512_castsi512_ps(_mm512_and_si512(w, hi)); }

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

static inline uint32_t load_u32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
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

// The MK members every AVX-512 kernel shares (a kernel's MK derives from it and may hide
// row_format / gemm with its own).
struct Avx512Base {
  static constexpr uint32_t kHooks = kHook_quantize_row_i8;  // csrc/kernels/mk_hooks.h; an MK restates it with its own
  static constexpr int kBlockN = 32;  // every x86 kernel is written for 32-column blocks
  static constexpr int kDenseKPack = 2;  // bf16 pairs (bf16_n32k2_x86)
  static constexpr int kInt8KPack = 4;   // int8 quads (i8_n32k4_x86)
  // int4 quads of 8 codes, byte j = codes j | j + 4 << 4 (the u4*_n32k8_x86 layouts): what the u4
  // hooks read; an int4 layout of another blocking or code order is refused for these levels.
  static constexpr const LayoutDesc* kU4Blocking = &kLayout_u4g32_n32k8_x86;
  static RowFormat row_format(DType) { return RowFormat::f32; }

  static float quantize_row_i8(const float* v, int64_t n, int64_t np, int8_t* q, uint8_t flip) {
    return x86_quant::quantize_row_i8_avx2(v, n, np, q, flip);
  }

  // C[m, 32] = A[m, :kp] . B^T for one 32-column block of fp32 rows; m <= kChunkM.
  static void gemm(const LayoutDesc&, RowFormat, const void* const* rows, int m, const uint16_t* B, int64_t kp, float* C) {
    const float* const* x = reinterpret_cast<const float* const*>(rows);
    if (m == 1) return gemm_f32_row(x[0], B, kp, C);
    int i = 0;
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
          // vminps/vmaxps return the second operand when either is NaN: the value goes second
          const __m512 gv = _mm512_min_ps(lim, _mm512_loadu_ps(g + j));
          const __m512 uv = _mm512_max_ps(nlim, _mm512_min_ps(lim, _mm512_loadu_ps(u + j)));
          const __m512 glu = _mm512_mul_ps(gv, sigmoid_ps(_mm512_mul_ps(alpha, gv)));
          _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_add_ps(uv, one), glu));
        }
        for (; j < n; ++j) out[j] = act_swigluoai(g[j], u[j], a.alpha, a.limit);
        break;
      }
      case Activation::relu2: {  // non-gated: g is the up row; vmaxps(0, NaN) keeps the NaN (second operand)
        const __m512 zero = _mm512_setzero_ps();
        for (; j + 16 <= n; j += 16) {
          const __m512 r = _mm512_max_ps(zero, _mm512_loadu_ps(g + j));
          _mm512_storeu_ps(out + j, _mm512_mul_ps(r, r));
        }
        for (; j < n; ++j) out[j] = act_relu2(g[j]);
        break;
      }
      case Activation::gelu:
        for (; j < n; ++j) out[j] = act_gelu(g[j], u[j]);
        break;
    }
  }

  // dst[0, n) = c + bias (bias may be null). `stream`: with non-temporal stores where dst is
  // 64-byte aligned and n a multiple of 16 (the caller ends its stores with out_fence()).
  static void out_row(float* dst, const float* c, const float* bias, int n, bool stream) {
    int j = 0;
    if (stream && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
      for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(c + j);
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
#if defined(MOEPACK_EMULATE_AVX512)
        _mm512_storeu_ps(dst + j, v);  // SIMDe 0.7 has no 512-bit streaming store: the emulated build checks the logic
#else
        _mm512_stream_ps(dst + j, v);
#endif
      }
    }
    for (; j < n; ++j) dst[j] = bias ? c[j] + bias[j] : c[j];
  }
  static void out_fence() { _mm_sfence(); }

  static void axpy(float w, const float* y, float* acc, int64_t n) {
    const __m512 wv = _mm512_set1_ps(w);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      _mm512_storeu_ps(acc + i, _mm512_add_ps(_mm512_loadu_ps(acc + i), _mm512_mul_ps(wv, _mm512_loadu_ps(y + i))));
    }
    for (; i < n; ++i) acc[i] += w * y[i];
  }
};

}  // namespace
}  // namespace x86_avx512
}  // namespace moepack
