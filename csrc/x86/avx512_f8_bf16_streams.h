// The few-row W8A16 kernel's body (avx512_f8_bf16.h), stamped once per decode: included (no
// include guard) with F8S_NAME (the function), F8S_TABLES / F8S_PAIR (the decode of one K pair:
// avx512_f8.h's word or byte tables) and F8S_BYTES (the byte tables' column order) defined; the
// byte copy inside a target pragma where the level is not compiled with AVX512_VBMI.

// C[MR, 32] for bf16 rows x[r] against the f8 block `codes` (kp K, groups of G with scales
// scale + g * gstride), S segments of whole groups streamed at once. False (nothing written) when
// the groups do not deal out evenly to S segments (S = 1 takes any).
template <int MR, int S>
static inline bool F8S_NAME(const uint16_t* const* x, const uint8_t* codes, const float* scale, int64_t gstride,
                                      int64_t kp, int64_t G, float* C) {
  const int64_t ng = (kp + G - 1) / G;
  const bool one_group = ng == 1;
  if (S > 1 && !one_group && (kp % G || ng % S)) return false;
  constexpr int P = S >= 2 ? 1 : 2;  // chains per (segment, row, half)
  const F8S_TABLES T;
  __m512 a[S][MR][2][P];
  __m512 c[MR][2];
  for (int r = 0; r < MR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  auto clear = [&] {
    for (int u = 0; u < S; ++u)
      for (int r = 0; r < MR; ++r)
        for (int p = 0; p < P; ++p) a[u][r][0][p] = a[u][r][1][p] = _mm512_setzero_ps();
  };
  // K pair j of the block into segment u's accumulators
  auto step = [&](int u, int64_t j) {
    __m512i w[2];
    F8S_PAIR(codes + j * 64, T, w);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = as_bh(_mm512_set1_epi32(int(load_u32(x[r] + 2 * j))));
      a[u][r][0][j % P] = _mm512_dpbf16_ps(a[u][r][0][j % P], as_bh(w[0]), xb);
      a[u][r][1][j % P] = _mm512_dpbf16_ps(a[u][r][1][j % P], as_bh(w[1]), xb);
    }
  };
  auto half = [&](int u, int r, int h) {
    __m512 t = a[u][r][h][0];
    for (int p = 1; p < P; ++p) t = _mm512_add_ps(t, a[u][r][h][p]);
    return t;
  };
  auto scale_add = [&](int r, const float* s, __m512 t0, __m512 t1) {
    __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
    f8_cols<F8S_BYTES>(s0, s1, true);
    c[r][0] = _mm512_fmadd_ps(t0, s0, c[r][0]);
    c[r][1] = _mm512_fmadd_ps(t1, s1, c[r][1]);
  };
  if (one_group) {  // per channel: the K pairs split into S segments, summed before the one scale
    clear();
    // for_k_streams (avx512_common.h), written out: its step must inline into this copy's target
    const int64_t nsteps = kp / 2, seg = nsteps / S, seg_bytes = seg * 64, blk_bytes = nsteps * 64;
    for (int64_t kk = 0; kk < seg; ++kk) {
#pragma GCC unroll 8
      for (int u = 0; u < S; ++u) {
        prefetch_segment(codes, (u * seg + kk) * 64, (u + 1) * seg_bytes, blk_bytes - seg_bytes, 1);
        step(u, u * seg + kk);
      }
    }
    for (int64_t k = S * seg; k < nsteps; ++k) {
      prefetch_segment(codes, k * 64, blk_bytes, 0, 1);
      step(0, k);
    }
    for (int r = 0; r < MR; ++r) {
      __m512 t0 = half(0, r, 0), t1 = half(0, r, 1);
      for (int u = 1; u < S; ++u) t0 = _mm512_add_ps(t0, half(u, r, 0)), t1 = _mm512_add_ps(t1, half(u, r, 1));
      scale_add(r, scale, t0, t1);
    }
  } else {
    // segment u holds groups [u * rounds, (u + 1) * rounds); round t adds group u * rounds + t of
    // every segment, its K pairs interleaved across the segments (S = 1: every group in order,
    // the last one partial)
    const int64_t rounds = S > 1 ? ng / S : ng, seg_bytes = rounds * G * 32, blk_bytes = kp * 32;
    for (int64_t t = 0; t < rounds; ++t) {
      clear();
      for (int u = 0; u < S; ++u) {  // the next round's scale rows (a page apart: not streamed)
        const int64_t g = t + 1 < rounds ? u * rounds + t + 1 : u * rounds;
        const float* s = scale + g * gstride + (t + 1 < rounds ? 0 : 32);  // past the last: the next block's
        _mm_prefetch(reinterpret_cast<const char*>(s), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(s + 16), _MM_HINT_T0);
      }
      const int64_t k0 = t * G, kend = k0 + G < kp ? k0 + G : kp;  // segment 0's group; the others' are whole
      for (int64_t jj = 0; jj < (kend - k0) / 2; ++jj) {
#pragma GCC unroll 4
        for (int u = 0; u < S; ++u) {
          const int64_t j = (u * rounds + t) * (G / 2) + jj;
          prefetch_segment(codes, j * 64, S > 1 ? (u + 1) * seg_bytes : blk_bytes, S > 1 ? blk_bytes - seg_bytes : 0, 1);
          step(u, j);
        }
      }
      for (int u = 0; u < S; ++u)
        for (int r = 0; r < MR; ++r) scale_add(r, scale + (u * rounds + t) * gstride, half(u, r, 0), half(u, r, 1));
    }
  }
  for (int r = 0; r < MR; ++r) {
    f8_cols<F8S_BYTES>(c[r][0], c[r][1], false);
    _mm512_storeu_ps(C + r * 32, c[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, c[r][1]);
  }
  return true;
}

