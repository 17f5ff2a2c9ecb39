// The W4A8 integer core of the mxfp4 layout with vpdpbusd, shared by the levels that have
// AVX512_VNNI (avx512_vnni, amx_int8). Include only from a file compiled with -mavx512vnni (or
// emulated), inside that level's namespace (internal linkage).
//
// vpdpbusd takes the decoded weights 2 * e2m1(q) + 12 (0..24, avx512_mx4_common.h) as its unsigned
// operand and the row's 4 s8 codes broadcast as its signed one; the four products of a lane are
// added into its int32 without saturation, so acc is exact and the group's integer sum is
// acc - 12 * (the row's group sum).
#pragma once
#include "avx512_mx4_common.h"

namespace moepack {
namespace x86_avx512_mx4 {
namespace {

template <int MR>
struct Mx4AccVnni {
  void operator()(const int8_t* const* x, const uint8_t* codes, int64_t j0, int64_t j1, __m512i acc[][2]) const {
    const __m512i m4 = _mm512_set1_epi8(0x0F), t = mx4_u8_table();
    constexpr int H = MR <= 4 ? MR : 1;  // up to 4 rows the high nibbles have their own accumulators (2 chains per half)
    __m512i ah[H][2];
    for (int r = 0; r < H; ++r) ah[r][0] = ah[r][1] = _mm512_setzero_si512();
    for (int64_t j = j0; j < j1; ++j) {
      const __m512i* g = reinterpret_cast<const __m512i*>(codes + j * 128);
      _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g) + kMx4PrefetchBytes + 64, _MM_HINT_T0);
      __m512i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(g + h);
        lo[h] = _mm512_shuffle_epi8(t, _mm512_and_si512(v, m4));
        hi[h] = _mm512_shuffle_epi8(t, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i xl = _mm512_set1_epi32(int(load_u32(x[r] + 8 * j)));
        const __m512i xh = _mm512_set1_epi32(int(load_u32(x[r] + 8 * j + 4)));
        for (int h = 0; h < 2; ++h) {
          if constexpr (MR <= 4) {
            acc[r][h] = _mm512_dpbusd_epi32(acc[r][h], lo[h], xl);
            ah[r][h] = _mm512_dpbusd_epi32(ah[r][h], hi[h], xh);
          } else {  // 16 chains already
            acc[r][h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][h], lo[h], xl), hi[h], xh);
          }
        }
      }
    }
    if constexpr (MR <= 4) {
      for (int r = 0; r < MR; ++r) {
        acc[r][0] = _mm512_add_epi32(acc[r][0], ah[r][0]);
        acc[r][1] = _mm512_add_epi32(acc[r][1], ah[r][1]);
      }
    }
  }
};

// Few rows (decode): the block's whole groups in S segments streamed at once (S address streams
// per thread, as gemm_u4a8_streams), round t adding group u * rounds + t of every segment u; the
// groups after the last whole round (and a partial last group) follow in one stream. Each
// group's integer sum is exact (Mx4AccVnni's); only the order in which the groups' fp32 terms
// are added to C differs from gemm_mx4a8_tile's.
template <int MR, int S>
static inline void gemm_mx4a8_streams(const int8_t* const* x, const float* rs, const uint8_t* codes, const uint8_t* scale,
                                      int64_t gstride, int64_t kp, const int32_t* xsum, float* C) {
  const int64_t ng = (kp + kMx4Group - 1) / kMx4Group;
  const int64_t rounds = kp / kMx4Group / S, head = rounds * S;  // groups [0, head): S segments of `rounds`
  const __m512i m4 = _mm512_set1_epi8(0x0F), t8 = mx4_u8_table();
  const __m512i* b = reinterpret_cast<const __m512i*>(codes);
  const int64_t seg_bytes = rounds * kMx4Group * 16, blk_bytes = kp * 16;
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  __m512i a[S][MR][2];
  auto step = [&](int u, int64_t j) {
    __m512i lo[2], hi[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(b + 2 * j + h);
      lo[h] = _mm512_shuffle_epi8(t8, _mm512_and_si512(v, m4));
      hi[h] = _mm512_shuffle_epi8(t8, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512i xl = _mm512_set1_epi32(int(load_u32(x[r] + 8 * j)));
      const __m512i xh = _mm512_set1_epi32(int(load_u32(x[r] + 8 * j + 4)));
      for (int h = 0; h < 2; ++h) a[u][r][h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a[u][r][h], lo[h], xl), hi[h], xh);
    }
  };
  auto group_end = [&](int u, int64_t g) {
    const uint8_t* e = scale + g * gstride;
    const __m512 s0 = mx4_scale16<128>(e), s1 = mx4_scale16<128>(e + 16);
    for (int r = 0; r < MR; ++r) mx4a8_group_add(s0, s1, a[u][r][0], a[u][r][1], xsum[r * ng + g], c[r][0], c[r][1]);
  };
  for (int64_t t = 0; t < rounds; ++t) {
    for (int u = 0; u < S; ++u) {
      for (int r = 0; r < MR; ++r) a[u][r][0] = a[u][r][1] = _mm512_setzero_si512();
      // the next round's scale rows (a page apart: not streamed); past the last, the tail's first
      const int64_t gn = t + 1 < rounds ? u * rounds + t + 1 : head;
      _mm_prefetch(reinterpret_cast<const char*>(scale + (gn < ng ? gn * gstride : 32)), _MM_HINT_T0);
    }
    for (int64_t jj = 0; jj < kMx4Group / 8; ++jj) {
#pragma GCC unroll 4
      for (int u = 0; u < S; ++u) {
        const int64_t j = (u * rounds + t) * (kMx4Group / 8) + jj;
        prefetch_segment(codes, j * 128, (u + 1) * seg_bytes, blk_bytes - seg_bytes, 2);  // past: the next block's
        step(u, j);
      }
    }
    for (int u = 0; u < S; ++u) group_end(u, u * rounds + t);
  }
  for (int64_t g = head, k0 = head * kMx4Group; k0 < kp; ++g, k0 += kMx4Group) {  // the rest, in one stream
    const int64_t kend = k0 + kMx4Group < kp ? k0 + kMx4Group : kp;
    for (int r = 0; r < MR; ++r) a[0][r][0] = a[0][r][1] = _mm512_setzero_si512();
    for (int64_t j = k0 / 8; j < kend / 8; ++j) {
      prefetch_segment(codes, j * 128, blk_bytes, 0, 2);
      step(0, j);
    }
    group_end(0, g);
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 s = _mm512_set1_ps(rs[r]);
    _mm512_storeu_ps(C + r * 32, _mm512_mul_ps(c[r][0], s));
    _mm512_storeu_ps(C + r * 32 + 16, _mm512_mul_ps(c[r][1], s));
  }
}

// Many rows (prefill): tiles of 8 rows (16 accumulators: each group's codes decoded once per 8
// rows), the rest in one tile of 1..7; groups of Sc in order.
template <class Sc>
static inline void gemm_e2m1a8_vnni_rows(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, int64_t kp,
                                         const int32_t* xsum, float* C, const Sc& sc) {
  const int64_t ng = (kp + Sc::kGroup - 1) / Sc::kGroup;
  int i = 0;
  for (; i + 8 <= m; i += 8) gemm_e2m1a8_tile<8>(x + i, rs + i, codes, kp, xsum + i * ng, C + i * 32, Mx4AccVnni<8>{}, sc);
  const int8_t* const* xr = x + i;
  const float* r = rs + i;
  const int32_t* xs = xsum + i * ng;
  float* c = C + i * 32;
  switch (m - i) {
    case 7: gemm_e2m1a8_tile<7>(xr, r, codes, kp, xs, c, Mx4AccVnni<7>{}, sc); break;
    case 6: gemm_e2m1a8_tile<6>(xr, r, codes, kp, xs, c, Mx4AccVnni<6>{}, sc); break;
    case 5: gemm_e2m1a8_tile<5>(xr, r, codes, kp, xs, c, Mx4AccVnni<5>{}, sc); break;
    case 4: gemm_e2m1a8_tile<4>(xr, r, codes, kp, xs, c, Mx4AccVnni<4>{}, sc); break;
    case 3: gemm_e2m1a8_tile<3>(xr, r, codes, kp, xs, c, Mx4AccVnni<3>{}, sc); break;
    case 2: gemm_e2m1a8_tile<2>(xr, r, codes, kp, xs, c, Mx4AccVnni<2>{}, sc); break;
    case 1: gemm_e2m1a8_tile<1>(xr, r, codes, kp, xs, c, Mx4AccVnni<1>{}, sc); break;
    default: break;
  }
}
static inline void gemm_mx4a8_vnni_rows(const int8_t* const* x, const float* rs, int m, const uint8_t* codes,
                                        const uint8_t* scale, int64_t gstride, int64_t kp, const int32_t* xsum, float* C) {
  gemm_e2m1a8_vnni_rows(x, rs, m, codes, kp, xsum, C, Mx4Scales16{scale, gstride});
}
// nvfp4's (kHook_gemm_nv4a8): every row count through the tiles, groups of 16 in order (the
// grouped path's order; the decode streams would reorder the groups).
static inline void gemm_nv4a8_vnni(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                                   const float* global, int64_t gstride, int64_t kp, const int32_t* xsum, float* C) {
  gemm_e2m1a8_vnni_rows(x, rs, m, codes, kp, xsum, C, Nv4Scales16(scale, gstride, global));
}

// The W4A8 block GEMM of the VNNI levels (kHook_gemm_mx4a8): one or two rows through the decode
// streams (one stream where decode_one_stream(), else 4 or 2 segments), more through
// gemm_mx4a8_vnni_rows.
static inline void gemm_mx4a8_vnni(const int8_t* const* x, const float* rs, int m, const uint8_t* codes, const uint8_t* scale,
                                   int64_t gstride, int64_t kp, const int32_t* xsum, float* C) {
  if (m == 1) {
    return decode_one_stream() ? gemm_mx4a8_streams<1, 1>(x, rs, codes, scale, gstride, kp, xsum, C)
                               : gemm_mx4a8_streams<1, 4>(x, rs, codes, scale, gstride, kp, xsum, C);
  }
  if (m == 2) {
    return decode_one_stream() ? gemm_mx4a8_streams<2, 1>(x, rs, codes, scale, gstride, kp, xsum, C)
                               : gemm_mx4a8_streams<2, 2>(x, rs, codes, scale, gstride, kp, xsum, C);
  }
  gemm_mx4a8_vnni_rows(x, rs, m, codes, scale, gstride, kp, xsum, C);
}

}  // namespace
}  // namespace x86_avx512_mx4
}  // namespace moepack
