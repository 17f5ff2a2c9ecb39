// W4A16 decode through AMX tiles for the amx_bf16 level (moe_amx_bf16.cpp): a few bf16 rows
// (decode, 1..kAmxDecMaxRows) against one int4_group block, the codes decoded in
// registers and stored as B tiles into a 2 KiB buffer in L1, the dot products taken by
// tdpbf16ps. Include only from a file compiled with the amx_bf16 level's flags, inside that
// level's namespace (internal linkage). docs/KERNELS.md "W4A16 decode through tiles".
//
// Why: the vdpbf16ps decode kernels (avx512_u4_bf16.h, avx512_mx4_bf16.h) issue 8 vdpbf16ps per
// 128 bytes of codes and row, and a vdpbf16ps zmm issues one per ~2 cycles here, 4 times slower
// than vpaddd or vfmadd231ps (measured: tools/bench_a16_tile.cpp), so one row's decode runs at
// the rate of its dot products (~29 cycles per 128 code bytes, ~16 GB/s a core with the block in
// L2), not of the reads, and each further row adds ~17 cycles. A tile dot product does a
// 16-pair x 16-column step for all rows at once, off the vector ports, which are left to the
// decode and the stores (which cost about what the dot products did: one row stays on
// vdpbf16ps, docs/KERNELS.md "W4A16 decode through tiles").
//
// B tile layout: a B row is one K pair of 16 columns, one 32-bit lane per column, which is what
// the decode registers hold already: u4a16_step_codes' register (h, i) of K step j is the pair
// (8j + p_i, 8j + p_i + 2) (p = 0, 1, 4, 5) of columns 16h..16h+15, so with the rows reordered as
// u4_prepare_row does (pair i of step j = reordered words 8j + 2i, 8j + 2i + 1), K step j's pair i
// is B row 4 (j % 4) + i and A column pair 4 (j % 4) + i. Four K steps (32 K) fill a B tile pair (columns
// 0-15 and 16-31), the buffer alternates between two such pairs so that the stores of the next
// step need not wait for the tile loads of the last.
//
// int4: C tiles per K group (G a multiple of 32), stored after the group and scaled into C with
// the group-sum epilogue of the vdpbf16ps kernel: C += s * (16 * acc - (16 + z) * gsum).
// mxfp4 (two rows, scales folded into the decoded weights) was built the same way and dropped: no
// gain end to end (docs/KERNELS.md "W4A16 decode through tiles"); it lives on as an experiment
// arm of tools/bench_a16_tile.cpp, which uses this file's pieces.
#pragma once
#include "amx_common.h"
#include "avx512_u4_bf16.h"

namespace moepack {
namespace x86_amx_a16_decode {
namespace {

using namespace x86_avx512;
using namespace x86_avx512_bf16;
using namespace x86_avx512_u4;
using namespace x86_avx512_u4_bf16;
using namespace x86_amx;

constexpr int kAmxDecMaxRows = 4;  // the row memo's rows (U4A16Rows); more rows: gemm_u4a16_amx (one unpack)
static_assert(kAmxDecMaxRows <= kU4A16MaxRows, "the tile decode reads its rows from the row memo");

// Two B tile pairs (columns 0-15 and 16-31 of 16 K pairs each, 64 bytes a row), alternating.
struct alignas(64) DecB {
  uint16_t w[2][2][16 * 32];
};

// Stores the 8 pair registers of one K step (s = step % 4) into tile pair b: B rows 4s + i.
static inline void dec_store_step(uint16_t (*b)[16 * 32], int s, const __m512i q[2][4]) {
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) _mm512_store_si512(b[h] + (4 * s + i) * 32, q[h][i]);
}
// B rows 4s.. 15 of tile pair b zeroed (a tile step with fewer than 4 K steps).
static inline void dec_zero_rows(uint16_t (*b)[16 * 32], int s) {
  for (int h = 0; h < 2; ++h)
    for (int r = 4 * s; r < 16; ++r) _mm512_store_si512(b[h] + r * 32, _mm512_setzero_si512());
}

// One tile step: C0 += A . B(columns 0-15), C1 += A . B(16-31), A = the rows' 16 K pairs at a
// (row_bytes apart), B = tile pair b.
static inline void dec_tile_dp(const uint16_t* a, int64_t row_bytes, uint16_t (*b)[16 * 32]) {
  // GCC's _tile_loadd is an asm without a memory clobber: tell the compiler that the tile loads
  // read the B rows just stored (no instruction)
  asm volatile("" ::: "memory");
  _tile_loadd(6, b[0], 64);
  _tile_loadd(7, b[1], 64);
  _tile_loadd(4, a, row_bytes);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
}

// int4_group (W4A16), m rows prepared by u4_prepare_row at xp (row i at xp + i * xstride words,
// zero from kp to the next multiple of 32), group sums gs[i]; C[m, 32]. False (nothing written)
// unless 1 <= m <= kAmxDecMaxRows and the groups are whole tile steps (G % 32 == 0, or one group).
static inline bool gemm_u4a16_amxdec_rows(const uint16_t* xp, int64_t xstride, const float* const* gs, int m,
                                          const uint8_t* codes, const float* scale, const uint8_t* zero, int64_t gstride,
                                          int64_t kp, int64_t G, float* C) {
  const int64_t ng = (kp + G - 1) / G;
  if (m < 1 || m > kAmxDecMaxRows || (ng > 1 && G % 32)) return false;
  DecB buf;
  alignas(64) float acc[kAmxDecMaxRows * 32];
  TileState local;
  TileState& tiles = tile_state(local);
  tiles.group(m);  // 1..16 rows: one A tile of m rows
  const int64_t row_bytes = xstride * 2;
  __m512 c[kAmxDecMaxRows][2];
  for (int r = 0; r < kAmxDecMaxRows; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  const __m512i* blk = reinterpret_cast<const __m512i*>(codes);
  int par = 0;
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    {  // the scale and zero rows of the next group (past the last: the next block's first)
      const int64_t off = g + 1 < ng ? (g + 1) * gstride : 32;
      _mm_prefetch(reinterpret_cast<const char*>(scale + off), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scale + off + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(zero + off), _MM_HINT_T0);
    }
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kt = k0; kt < kend; kt += 32) {
      const int steps = kend - kt >= 32 ? 4 : int((kend - kt) / 8);
      uint16_t(*b)[16 * 32] = buf.w[par];
      par ^= 1;
      for (int s = 0; s < steps; ++s) {
        const int64_t j = kt / 8 + s;
        prefetch_segment(codes, j * 128, kp * 16, 0, 2);  // past the end: the next block's start
        __m512i q[2][4];
        u4a16_step_codes(blk + 2 * j, q);
        dec_store_step(b, s, q);
      }
      if (steps < 4) dec_zero_rows(b, steps);
      dec_tile_dp(xp + kt, row_bytes, b);
    }
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
    for (int r = 0; r < m; ++r)
      u4a16_group_add(scale, zero, g * gstride, gs[r][g], _mm512_load_ps(acc + r * 32), _mm512_load_ps(acc + r * 32 + 16),
                      c[r][0], c[r][1]);
  }
  for (int r = 0; r < m; ++r) {
    _mm512_storeu_ps(C + r * 32, c[r][0]);
    _mm512_storeu_ps(C + r * 32 + 16, c[r][1]);
  }
  return true;
}

// The gemm_u4a16 hook's few-row path through tiles: the rows prepared once per row in the memo
// (as gemm_u4a16_bf16 does; u4_prepare_row pads them with zeros to a multiple of 32). False (nothing written) where
// gemm_u4a16_amxdec_rows is, or for rows the memo cannot hold (not bf16, kp > kU4A16MaxK).
static inline bool gemm_u4a16_amxdec(RowFormat fmt, const void* const* rows, int m, const uint8_t* codes,
                                     const float* scale, const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G,
                                     float* C, U4A16Rows* memo) {
  const int64_t ng = (kp + G - 1) / G;
  if (fmt != RowFormat::bf16 || m < 1 || m > kAmxDecMaxRows || kp > kU4A16MaxK || (ng > 1 && G % 32)) return false;
  std::unique_ptr<U4A16Rows> own;
  if (!memo) {
    own.reset(new U4A16Rows);
    memo = own.get();
  }
  memo->prepare(rows, m, kp, G);
  const float* gss[kAmxDecMaxRows];
  for (int i = 0; i < m; ++i) gss[i] = memo->gs[i];
  return gemm_u4a16_amxdec_rows(memo->xp[0], kU4A16MaxK, gss, m, codes, scale, zero, gstride, kp, G, C);
}

}  // namespace
}  // namespace x86_amx_a16_decode
}  // namespace moepack
