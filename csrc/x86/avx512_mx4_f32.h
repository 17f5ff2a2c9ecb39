// The W4A16 decode kernel of the mxfp4 layout with fp32 FMAs (AVX-512 F only), for a few rows: the
// one the x86 levels with the gemm_mx4a16 hook take for fp32 rows, and for bf16 rows where
// mx4_a16_fp32() (csrc/dispatch.cpp; docs/KERNELS.md "mxfp4 W4A16 decode: fp32 FMAs or
// vdpbf16ps"). Include only from a file compiled with at least the avx512 level's flags, inside
// that level's namespace (internal linkage).
//
// Each 32-bit lane of a K step's zmm is one column's 8 codes (byte b: code b in the low nibble,
// code b + 4 in the high one; avx512_mx4_common.h). vpermps reads only the low 4 bits of its index
// lane, so the lane shifted right by 4i looks nibble i up in a 16-entry table of the exact e2m1
// values as fp32 — no byte spreading — and one vfmadd231ps with the row's K value broadcast (from
// the row, bf16 rows widened to fp32 once per stage: Mx4A16Rows) adds the 16 columns' products. Per 64
// bytes of codes: 7 vpsrld, 8 vpermps, 8 FMAs (23 operations on the two 512-bit ports), where the
// vdpbf16ps kernel (avx512_mx4_bf16.h) takes 12 but 4 of them are vdpbf16ps, which issue one per
// ~2 cycles on Sapphire Rapids (an FMA: two per cycle). Each product x * e2m1(q) enters the FMA
// unrounded; per K group of 32 the fp32 sum is scaled into C exactly as the vdpbf16ps kernel does
// (C += sum * 2^(e - 127), the scale never folded into a weight). So the two kernels differ in the
// fp32 summation order and in one more way: vdpbf16ps treats subnormal bf16 inputs as 0, the FMAs
// take them as they are.
#pragma once
#include <cstdlib>
#include <memory>

#include "avx512_mx4_common.h"

namespace moepack {
namespace x86_avx512_mx4_f32 {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_mx4;

constexpr int kMx4F32MaxRows = 4;

// The worker's rows widened to fp32 once per stage (the driver's RowMemo: while a stage runs its
// rows never change, so a row's address names its content). The buffer (as many row slots of the
// stage's K as a call has needed: 11 KiB a row at K = 2880) is allocated at first use, and again
// for a longer K or more rows.
struct Mx4A16Rows {
  const void* key[kMx4F32MaxRows] = {};
  int64_t kp[kMx4F32MaxRows] = {};
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> buf;
  int64_t cap = 0;  // floats per row slot
  int slots = 0;    // row slots in buf
  // Slots 0..m-1 hold rows[0..m) at this kp (each widened unless its slot holds it already);
  // false where the buffer cannot be allocated.
  bool prepare(const uint16_t* const* rows, int m, int64_t kp_) {
    if (kp_ > cap || m > slots) {
      const int64_t c = kp_ > cap ? (kp_ + 15) / 16 * 16 : cap;  // rows 64-byte aligned
      const int n = m > slots ? m : slots;
      buf.reset(static_cast<float*>(std::aligned_alloc(64, sizeof(float) * size_t(n * c))));
      cap = buf ? c : 0;
      slots = buf ? n : 0;
      for (int i = 0; i < kMx4F32MaxRows; ++i) key[i] = nullptr;
      if (!buf) return false;
    }
    for (int i = 0; i < m; ++i) {
      if (key[i] == rows[i] && kp[i] == kp_) continue;
      float* d = row(i);
      const uint16_t* x = rows[i];
      for (int64_t k = 0; k < kp_; ++k) d[k] = bf16_to_f32(x[k]);  // exact; the compiler vectorizes it
      key[i] = rows[i];
      kp[i] = kp_;
    }
    return true;
  }
  float* row(int i) const { return buf.get() + int64_t(i) * cap; }
};

// The exact e2m1 values as fp32, code i at lane i (vpermps's table).
static inline __m512 mx4_f32_table() {
  alignas(64) static const float t[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return _mm512_load_ps(t);
}

// C[MR, 32] for fp32 rows x[r] against one e2m1 block (kp a multiple of 8; the group scales of Sc,
// avx512_mx4_common.h: mxfp4's e8m0 per 32 K, nvfp4's e4m3 and globals per 16), read as S K
// segments of whole groups at once (decode streams, as the vdpbf16ps kernel), the groups that do
// not deal out evenly (and a partial last one) after them in one stream.
template <int MR, int S, class Sc>
static inline void gemm_e2m1a16_f32_streams(const float* const* x, const uint8_t* codes, int64_t kp, const Sc& sc, float* C) {
  constexpr int kGroup = Sc::kGroup;
  const int64_t ng = (kp + kGroup - 1) / kGroup;
  const int64_t rounds = kp / kGroup / S, head = rounds * S;  // groups [0, head): S segments of `rounds`
  const int64_t seg_bytes = rounds * kGroup * 16, blk_bytes = kp * 16;
  constexpr int P = 2;  // chains per (segment, row, half): the 8 nibbles alternate between them
  static constexpr int kCode[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // nibble i of a lane holds code kCode[i]
  const __m512 table = mx4_f32_table();
  const __m512i* b = reinterpret_cast<const __m512i*>(codes);
  __m512 a[S][MR][2][P];
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  auto clear = [&](int u) {
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < P; ++p) a[u][r][0][p] = a[u][r][1][p] = _mm512_setzero_ps();
  };
  // K step j (8 K of 32 columns) into segment u's accumulators
  auto step = [&](int u, int64_t j) {
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(b + 2 * j + h);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m512 w = _mm512_permutexvar_ps(i ? _mm512_srli_epi32(v, 4 * i) : v, table);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          a[u][r][h][i % P] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r][8 * j + kCode[i]]), a[u][r][h][i % P]);
      }
    }
  };
  // group g's sums of segment u, scaled into C
  auto group_end = [&](int u, int64_t g) {
    __m512 s0, s1;
    sc.a16(g, s0, s1);
    for (int r = 0; r < MR; ++r) {
      c[r][0] = _mm512_fmadd_ps(_mm512_add_ps(a[u][r][0][0], a[u][r][0][1]), s0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(_mm512_add_ps(a[u][r][1][0], a[u][r][1][1]), s1, c[r][1]);
    }
  };
  for (int64_t t = 0; t < rounds; ++t) {
    for (int u = 0; u < S; ++u) {
      clear(u);
      // the next round's scale rows (a page apart: not streamed); past the last, the tail's first
      const int64_t gn = t + 1 < rounds ? u * rounds + t + 1 : head;
      _mm_prefetch(reinterpret_cast<const char*>(gn < ng ? sc.row(gn) : sc.row(0) + 32), _MM_HINT_T0);
    }
    for (int64_t jj = 0; jj < kGroup / 8; ++jj) {
#pragma GCC unroll 4
      for (int u = 0; u < S; ++u) {
        const int64_t j = (u * rounds + t) * (kGroup / 8) + jj;
        prefetch_segment(codes, j * 128, (u + 1) * seg_bytes, blk_bytes - seg_bytes, 2);  // past: the next block's
        step(u, j);
      }
    }
    for (int u = 0; u < S; ++u) group_end(u, u * rounds + t);
  }
  for (int64_t g = head; g < ng; ++g) {  // the rest, in one stream
    clear(0);
    const int64_t jend = (g + 1) * kGroup < kp ? (g + 1) * (kGroup / 8) : kp / 8;
    for (int64_t j = g * (kGroup / 8); j < jend; ++j) {
      prefetch_segment(codes, j * 128, blk_bytes, 0, 2);
      step(0, j);
    }
    group_end(0, g);
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(C + r * 32, c[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, c[r][1]);
  }
}

// C[m, 32] for m <= kMx4F32MaxRows rows, fp32 (used as they are) or bf16 (widened into `memo`, the
// worker's Mx4A16Rows; null: a local one, each call); false (nothing written) for other calls (kp
// not a multiple of 8, no memory for the rows). One row: 4 segments, rows two at a time: 2 (one
// stream each where decode_one_stream()); an odd last row as one row.
template <class Sc>
static inline bool gemm_e2m1a16_f32(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, int64_t kp,
                                    const Sc& sc, float* C, Mx4A16Rows* memo) {
  if ((fmt != RowFormat::bf16 && fmt != RowFormat::f32) || m > kMx4F32MaxRows || kp % 8) return false;
  const float* x[kMx4F32MaxRows];
  std::unique_ptr<Mx4A16Rows> own;
  if (fmt == RowFormat::f32) {
    for (int i = 0; i < m; ++i) x[i] = static_cast<const float*>(rows[i]);
  } else {
    if (!memo) {
      own.reset(new Mx4A16Rows);
      memo = own.get();
    }
    if (!memo->prepare(reinterpret_cast<const uint16_t* const*>(rows), m, kp)) return false;
    for (int i = 0; i < m; ++i) x[i] = memo->row(i);
  }
  const bool one = decode_one_stream();
  int i = 0;
  for (; i + 2 <= m; i += 2) {
    if (one) {
      gemm_e2m1a16_f32_streams<2, 1>(x + i, codes, kp, sc, C + i * 32);
    } else {
      gemm_e2m1a16_f32_streams<2, 2>(x + i, codes, kp, sc, C + i * 32);
    }
  }
  if (i < m) {
    if (one) {
      gemm_e2m1a16_f32_streams<1, 1>(x + i, codes, kp, sc, C + i * 32);
    } else {
      gemm_e2m1a16_f32_streams<1, 4>(x + i, codes, kp, sc, C + i * 32);
    }
  }
  return true;
}
static inline bool gemm_mx4a16_f32(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const uint8_t* scale,
                                   int64_t gstride, int64_t kp, float* C, Mx4A16Rows* memo) {
  return gemm_e2m1a16_f32(fmt, rows, m, codes, kp, Mx4Scales16{scale, gstride}, C, memo);
}
// nvfp4 (kHook_gemm_nv4a16): groups of 16 with e4m3 scales under the columns' globals; G other than
// 16 declined.
static inline bool gemm_nv4a16_f32(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes, const uint8_t* scale,
                                   const float* global, int64_t gstride, int64_t kp, int64_t G, float* C, Mx4A16Rows* memo) {
  if (G != Nv4Scales16::kGroup) return false;
  return gemm_e2m1a16_f32(fmt, rows, m, codes, kp, Nv4Scales16(scale, gstride, global), C, memo);
}

}  // namespace
}  // namespace x86_avx512_mx4_f32
}  // namespace moepack
