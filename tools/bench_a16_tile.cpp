// Bare-tile micro-benchmark of the x86 decode kernels (docs/BENCH.md "What bounds W4A16 decode"):
// one kernel call per 32-column weight block, T = 1 or 2 bf16 rows, on one thread, in two
// settings: the same block again and again (resident in L1 or L2), and a walk over many blocks
// (far more bytes than the last-level cache: every block comes from DRAM). It prints ns and
// core cycles per 128 bytes of packed weights read, and GB/s, for the bf16, int8, int4 (W4A16)
// and mxfp4 (W4A16: vdpbf16ps, and fp32 FMAs as `mx4f32`) kernels on the same harness, plus the
// latency and throughput of vdpbf16ps and the core clock (a dependent add chain). Arms alternate, best of the repetitions.
//
// Build and run (x86 with AMX-BF16; no torch, no moepack build needed):
//   g++ -O3 -std=c++20 -fno-math-errno -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq
//       -mavx512vnni -mavx512bf16 -mamx-tile -mamx-bf16 -mavx512vbmi -Wno-maybe-uninitialized
//       -Icsrc/include tools/bench_a16_tile.cpp -o /tmp/bench_a16_tile        (one command line)
// (the amx_bf16 level's flags and setup.py's -O3: at -O2 GCC leaves the int4 kernels' pair and
// accumulator arrays in memory, a different inner loop from the one the extension runs)
//   /tmp/bench_a16_tile [stream_mib=768] [reps=3] [arms: comma-separated name prefixes, default all]
// The inner loops of the kernels as compiled here: objdump -d --no-show-raw-insn /tmp/bench_a16_tile
// (each arm is a noinline function named arm_<kernel>).
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../csrc/x86/avx512_bf16_common.h"
#include "../csrc/x86/avx512_vnni_common.h"
#include "../csrc/x86/avx512_u4_bf16.h"
#include "../csrc/x86/avx512_mx4_bf16.h"
#include "../csrc/x86/avx512_mx4_f32.h"
#include "../csrc/x86/amx_a16_decode.h"

namespace moepack {
bool g_bench_one_stream = false;
bool decode_one_stream() { return g_bench_one_stream; }
}  // namespace moepack

using namespace moepack;

namespace {

double now_ns() {
  return double(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

// Core cycles per ns: a chain of dependent register-register adds retires one per cycle (an add
// of an immediate is no use: Golden Cove folds those chains at rename).
double cycles_per_ns() {
  double best = 0;
  for (int rep = 0; rep < 200; ++rep) {
    uint64_t x = 1, y = 3;
    const int64_t n = 400000;
    const double t0 = now_ns();
    for (int64_t i = 0; i < n; i += 8) {
      asm volatile(
          "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
          "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0"
          : "+r"(x)
          : "r"(y));
    }
    const double f = double(n) / (now_ns() - t0);  // the loop's own inc/cmp/jmp run alongside
    best = std::max(best, f);
  }
  return best;
}

// Cycles per instruction of `insn` ("vdpbf16ps", "vpaddd", ...) with zmm0..zmm<chains - 1> as
// independent accumulator chains (sources zmm30, zmm31): 1 chain = the latency, many = the
// reciprocal throughput. Written in asm so that the chains stay in registers.
#define CHAIN_BODY(I) I " %%zmm30, %%zmm31, %%zmm0\n\t" I " %%zmm30, %%zmm31, %%zmm1\n\t" I " %%zmm30, %%zmm31, %%zmm2\n\t" \
  I " %%zmm30, %%zmm31, %%zmm3\n\t" I " %%zmm30, %%zmm31, %%zmm4\n\t" I " %%zmm30, %%zmm31, %%zmm5\n\t"                 \
  I " %%zmm30, %%zmm31, %%zmm6\n\t" I " %%zmm30, %%zmm31, %%zmm7\n\t" I " %%zmm30, %%zmm31, %%zmm8\n\t"                 \
  I " %%zmm30, %%zmm31, %%zmm9\n\t" I " %%zmm30, %%zmm31, %%zmm10\n\t" I " %%zmm30, %%zmm31, %%zmm11\n\t"
#define CHAIN_ONE(I) I " %%zmm30, %%zmm31, %%zmm0\n\t"
#define CHAIN_CLOBBER "xmm20", "xmm21", "xmm22", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"
#define CHAIN_FN(NAME, BODY, PER)                                                     \
  __attribute__((noinline)) double NAME(double cpn) {                                 \
    asm volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n\tvpxord %%zmm31, %%zmm31, %%zmm31" ::: "xmm30", "xmm31"); \
    const int64_t n = 20000;                                                           \
    double best = 1e30;                                                                \
    for (int rep = 0; rep < 200; ++rep) {                                              \
      const double t0 = now_ns();                                                      \
      for (int64_t i = 0; i < n; ++i) asm volatile(BODY ::: CHAIN_CLOBBER, "xmm30", "xmm31"); \
      best = std::min(best, (now_ns() - t0) * cpn / double(n * (PER)));               \
    }                                                                                  \
    return best;                                                                       \
  }
CHAIN_FN(dpbf16_lat, CHAIN_ONE("vdpbf16ps") CHAIN_ONE("vdpbf16ps") CHAIN_ONE("vdpbf16ps") CHAIN_ONE("vdpbf16ps"), 4)
CHAIN_FN(dpbf16_tp, CHAIN_BODY("vdpbf16ps"), 12)
CHAIN_FN(fma_tp, CHAIN_BODY("vfmadd231ps"), 12)
CHAIN_FN(vpaddd_tp, CHAIN_BODY("vpaddd"), 12)
CHAIN_FN(vpdpbusd_tp, CHAIN_BODY("vpdpbusd"), 12)
// vdpbf16ps mixed with independent work of a known port (zmm20..23: no chains of their own):
// vpsrld (port 0 only), vpshufb (port 5 only), vpternlogd (0 or 5); cycles per vdpbf16ps.
#define MIX4(I) I "\n\t" I "\n\t" I "\n\t" I "\n\t"
CHAIN_FN(dp_shift, CHAIN_BODY("vdpbf16ps") MIX4("vpsrld $3, %%zmm30, %%zmm20") MIX4("vpsrld $3, %%zmm30, %%zmm21") MIX4("vpsrld $3, %%zmm30, %%zmm22"), 12)
CHAIN_FN(dp_shuf, CHAIN_BODY("vdpbf16ps") MIX4("vpshufb %%zmm30, %%zmm31, %%zmm20") MIX4("vpshufb %%zmm30, %%zmm31, %%zmm21") MIX4("vpshufb %%zmm30, %%zmm31, %%zmm22"), 12)
CHAIN_FN(dp_tern, CHAIN_BODY("vdpbf16ps") MIX4("vpternlogd $0xEA, %%zmm30, %%zmm31, %%zmm20") MIX4("vpternlogd $0xEA, %%zmm30, %%zmm31, %%zmm21") MIX4("vpternlogd $0xEA, %%zmm30, %%zmm31, %%zmm22"), 12)

// tdpbf16ps with `rows` A/C rows: cycles per instruction, alternating two C tiles (C0 += A4.B6,
// C1 += A4.B7, so each C tile's chain has one instruction in between), and the same with the two
// B tiles loaded before each pair: from a buffer the loop does not write (L1 hits), and from a
// buffer just written with 32 zmm stores (what a decode into tiles does).
__attribute__((noinline)) void tile_costs(double cpn) {
  alignas(64) static uint16_t bb[2][16 * 32], aa[16 * 32], rot[4][2][16 * 32];
  std::memset(bb, 0, sizeof bb);
  std::memset(rot, 0, sizeof rot);
  std::memset(aa, 0, sizeof aa);
  for (int rows : {1, 2, 4, 16}) {
    x86_amx::TileState ts;
    ts.group(rows);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(4, aa, 64);
    _tile_loadd(6, bb[0], 64);
    _tile_loadd(7, bb[1], 64);
    const int64_t n = 2000;
    double dp = 1e30, ld = 1e30, st = 1e30, st4 = 1e30, so = 1e30;
    for (int rep = 0; rep < 100; ++rep) {
      double t0 = now_ns();
      for (int64_t i = 0; i < n; ++i) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      dp = std::min(dp, (now_ns() - t0) * cpn / double(2 * n));
      t0 = now_ns();
      for (int64_t i = 0; i < n; ++i) {
        _tile_loadd(6, bb[0], 64);
        _tile_loadd(7, bb[1], 64);
        _tile_loadd(4, aa, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      ld = std::min(ld, (now_ns() - t0) * cpn / double(n));
      t0 = now_ns();
      __m512i v = _mm512_set1_epi16(0x3F80);
      for (int64_t i = 0; i < n; ++i) {
        for (int r = 0; r < 16; ++r) {
          _mm512_store_si512(bb[0] + r * 32, v);
          _mm512_store_si512(bb[1] + r * 32, v);
        }
        asm volatile("" : "+v"(v));
        _tile_loadd(6, bb[0], 64);
        _tile_loadd(7, bb[1], 64);
        _tile_loadd(4, aa, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      st = std::min(st, (now_ns() - t0) * cpn / double(n));
      t0 = now_ns();
      for (int64_t i = 0; i < n; ++i) {
        uint16_t(*b)[16 * 32] = rot[i & 3];
        for (int r = 0; r < 16; ++r) {
          _mm512_store_si512(b[0] + r * 32, v);
          _mm512_store_si512(b[1] + r * 32, v);
        }
        asm volatile("" : "+v"(v));
        _tile_loadd(6, b[0], 64);
        _tile_loadd(7, b[1], 64);
        _tile_loadd(4, aa, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      st4 = std::min(st4, (now_ns() - t0) * cpn / double(n));
      t0 = now_ns();
      for (int64_t i = 0; i < n; ++i) {
        uint16_t(*b)[16 * 32] = rot[i & 3];
        for (int r = 0; r < 16; ++r) {
          _mm512_store_si512(b[0] + r * 32, v);
          _mm512_store_si512(b[1] + r * 32, v);
        }
        asm volatile("" : "+v"(v));
      }
      so = std::min(so, (now_ns() - t0) * cpn / double(n));
    }
    std::printf("tdpbf16ps, %2d rows: %.1f cycles/insn; load B,B,A + 2 dp: %.1f cycles; 32 zmm stores + that: %.1f cycles (4 buffers in turn: %.1f); the 32 stores alone: %.1f\n",
                rows, dp, ld, st, st4, so);
  }
}

struct Problem {
  int64_t kp;
  int64_t G = 128;
  int64_t nb;  // blocks
  uint8_t* mem;  // codes of every block, contiguous
  int64_t blk_bytes;
  std::vector<float> scale;  // [ng][nb * 32]
  std::vector<uint8_t> zero, e8m0;
  int64_t ng, gstride;
};

alignas(64) uint16_t g_x[4][16384];
alignas(64) int8_t g_x8[4][16384];
alignas(64) float g_C[8 * 32];
alignas(64) int32_t g_C32[8 * 32];

using Arm = void (*)(const Problem&, int64_t b, void* memo);

// ---- arms: one block call each --------------------------------------------------------------
#define ROWS16(m) const uint16_t* xs[4] = {g_x[0], g_x[1], g_x[2], g_x[3]}
__attribute__((noinline)) void arm_bf16_s1(const Problem& p, int64_t b, void*) {
  ROWS16(1);
  x86_avx512_bf16::gemm_bf16_streams<1, 1>(xs, reinterpret_cast<const uint16_t*>(p.mem + b * p.blk_bytes), p.kp, g_C);
}
__attribute__((noinline)) void arm_bf16_s4(const Problem& p, int64_t b, void*) {
  ROWS16(1);
  x86_avx512_bf16::gemm_bf16_streams<1, 4>(xs, reinterpret_cast<const uint16_t*>(p.mem + b * p.blk_bytes), p.kp, g_C);
}
__attribute__((noinline)) void arm_i8_s1(const Problem& p, int64_t b, void*) {
  const int8_t* xs[4] = {g_x8[0], g_x8[1], g_x8[2], g_x8[3]};
  x86_avx512_vnni::gemm_i8_streams<1, 1, 0x80808080u>(xs, reinterpret_cast<const int8_t*>(p.mem + b * p.blk_bytes), p.kp, g_C32);
}
__attribute__((noinline)) void arm_i8_s4(const Problem& p, int64_t b, void*) {
  const int8_t* xs[4] = {g_x8[0], g_x8[1], g_x8[2], g_x8[3]};
  x86_avx512_vnni::gemm_i8_streams<1, 4, 0x80808080u>(xs, reinterpret_cast<const int8_t*>(p.mem + b * p.blk_bytes), p.kp, g_C32);
}
// int4 W4A16 through the hook entry (m rows; memo keeps the prepared rows as the driver does)
template <int M>
__attribute__((noinline)) void arm_u4_hook(const Problem& p, int64_t b, void* memo) {
  const void* rows[4] = {g_x[0], g_x[1], g_x[2], g_x[3]};
  x86_avx512_u4_bf16::gemm_u4a16_bf16(RowFormat::bf16, rows, M, p.mem + b * p.blk_bytes, p.scale.data() + b * 32,
                                      p.zero.data() + b * 32, p.gstride, p.kp, p.G, g_C,
                                      static_cast<x86_avx512_u4_bf16::U4A16Rows*>(memo));
}
// Experiment: one row where the groups do not deal out evenly (gpt-oss: K = 2880 = 22 groups of 128 and a
// half one): the first S * floor(whole groups / S) groups as S decode streams, the rest (at most
// S - 1 whole groups and the partial one) after them as one stream, C the sum of both parts. False
// (nothing written) when fewer than S whole groups, or when they all deal out (the streams alone).
template <int S>
static inline bool gemm_u4a16_bf16_split(const uint16_t* xp, const float* gsum, const uint8_t* codes, const float* scale,
                                         const uint8_t* zero, int64_t gstride, int64_t kp, int64_t G, float* C) {
  const int64_t ng = (kp + G - 1) / G, head = kp / G / S * S;
  if (head < S || head == ng) return false;
  if (!x86_avx512_u4_bf16::gemm_u4a16_bf16_streams<1, S>(&xp, &gsum, codes, scale, zero, gstride, head * G, G, C)) return false;
  const uint16_t* xt = xp + head * G;
  const float* gt = gsum + head;
  alignas(64) float tail[32];
  x86_avx512_u4_bf16::gemm_u4a16_bf16_tile<1>(&xt, &gt, codes + head * G * 16, scale + head * gstride, zero + head * gstride, gstride,
                          kp - head * G, G, tail);
  for (int n = 0; n < 32; n += 16) _mm512_storeu_ps(C + n, _mm512_add_ps(_mm512_loadu_ps(C + n), _mm512_load_ps(tail + n)));
  return true;
}

// one row, the groups that deal out as S streams and the rest as one (gemm_u4a16_bf16_split)
template <int S>
__attribute__((noinline)) void arm_u4_split(const Problem& p, int64_t b, void* memo_) {
  using namespace x86_avx512_u4_bf16;
  auto* memo = static_cast<U4A16Rows*>(memo_);
  const void* rows[1] = {g_x[0]};
  memo->prepare(rows, 1, p.kp, p.G);
  if (!gemm_u4a16_bf16_split<S>(memo->xp[0], memo->gs[0], p.mem + b * p.blk_bytes, p.scale.data() + b * 32,
                                p.zero.data() + b * 32, p.gstride, p.kp, p.G, g_C))
    arm_u4_hook<1>(p, b, memo_);
}
// Experiment: one row as S decode streams (gemm_u4a16_bf16_streams) with the code prefetch PF
// bytes ahead (the kernels: 1024) into L1 (T1 = 0) or L2 (T1 = 1).
template <int S, int PF, int T1>
__attribute__((noinline)) void arm_u4_pf(const Problem& p, int64_t b, void* memo_) {
  using namespace x86_avx512_u4_bf16;
  auto* memo = static_cast<U4A16Rows*>(memo_);
  const int64_t kp = p.kp, G = p.G, gstride = p.gstride, ng = kp / G;
  if (kp % G || ng % S) return arm_u4_hook<1>(p, b, memo_);
  const void* rows[1] = {g_x[0]};
  memo->prepare(rows, 1, kp, G);
  const uint16_t* xp = memo->xp[0];
  const uint8_t* codes = p.mem + b * p.blk_bytes;
  const float* scale = p.scale.data() + b * 32;
  const uint8_t* zero = p.zero.data() + b * 32;
  const int64_t rounds = ng / S, gj = G / 8, seg_bytes = rounds * G * 16, blk_bytes = kp * 16;
  const __m512i* blk = reinterpret_cast<const __m512i*>(codes);
  __m512 a[S][2], c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps();
  for (int64_t t = 0; t < rounds; ++t) {
    for (int u = 0; u < S; ++u) {
      a[u][0] = a[u][1] = _mm512_setzero_ps();
      const int64_t off = t + 1 < rounds ? (u * rounds + t + 1) * gstride : u * rounds * gstride + 32;
      _mm_prefetch(reinterpret_cast<const char*>(scale + off), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scale + off + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(zero + off), _MM_HINT_T0);
    }
    for (int64_t jj = 0; jj < gj; ++jj) {
#pragma GCC unroll 4
      for (int u = 0; u < S; ++u) {
        const int64_t j = (u * rounds + t) * gj + jj;
        int64_t o = j * 128 + PF;
        if (o >= (u + 1) * seg_bytes) o += blk_bytes - seg_bytes;
        const char* pc = reinterpret_cast<const char*>(codes) + o;
        if (T1) {
          _mm_prefetch(pc, _MM_HINT_T1);
          _mm_prefetch(pc + 64, _MM_HINT_T1);
        } else {
          _mm_prefetch(pc, _MM_HINT_T0);
          _mm_prefetch(pc + 64, _MM_HINT_T0);
        }
        __m512i q[2][4];
        u4a16_step_codes(blk + 2 * j, q);
        const uint16_t* x = xp + 8 * j;
        for (int i = 0; i < 4; ++i) {
          const __m512bh xb = as_bh(bcast32(x + 2 * i));
          a[u][0] = _mm512_dpbf16_ps(a[u][0], as_bh(q[0][i]), xb);
          a[u][1] = _mm512_dpbf16_ps(a[u][1], as_bh(q[1][i]), xb);
        }
      }
    }
    for (int u = 0; u < S; ++u) u4a16_group_add(scale, zero, (u * rounds + t) * gstride, memo->gs[0][u * rounds + t], a[u][0], a[u][1], c0, c1);
  }
  _mm512_storeu_ps(g_C, c0);
  _mm512_storeu_ps(g_C + 16, c1);
}
namespace mx4exp {
using namespace x86_avx512_mx4;
using namespace x86_amx;
using namespace x86_amx_a16_decode;
// Experiment (dropped from the extension: no gain end to end, docs/KERNELS.md "W4A16 decode
// through tiles"): mxfp4 (W4A16) decoded into B tiles with amx_a16_decode.h's pieces, the e8m0
// scale folded into the decoded weights. m bf16 rows (row i at x + i * xstride words, xstride >=
// kp), kp % 32 == 0, the block's scales within mx4_scales_fold's range; C[m, 32] = rows .
// (e2m1(q) * 2^(e - 127)) up to the fp32 summation order. False (nothing written) otherwise.
static bool gemm_mx4a16_amxdec(const uint16_t* x, int64_t xstride, int m, const uint8_t* codes, const uint8_t* scale,
                               int64_t gstride, int64_t kp, float* C) {
  if (m < 1 || m > 16 || kp % kMx4Group || kp <= 0) return false;
  if (!mx4_scales_fold(scale, gstride, kp / kMx4Group)) return false;
  DecB buf;
  TileState local;
  TileState& tiles = tile_state(local);
  tiles.group(m);
  const __m512i table = mx4_bf16_table(), i01 = mx4_idx01(), i23 = mx4_idx23();
  const __m512i mag = _mm512_set1_epi16(0x7FFF), bias = _mm512_set1_epi32(127), lo16 = _mm512_set1_epi32(0xFFFF);
  const __m512i* blk = reinterpret_cast<const __m512i*>(codes);
  _tile_zero(0);
  _tile_zero(1);
  int par = 0;
  for (int64_t g = 0; g < kp / kMx4Group; ++g) {  // one group of 32 = one tile step
    if (g + 1 < kp / kMx4Group) _mm_prefetch(reinterpret_cast<const char*>(scale + (g + 1) * gstride), _MM_HINT_T0);
    __m512i d[2];  // per column half: (e - 127) << 7 in both words of each column's lane
    for (int h = 0; h < 2; ++h) {
      const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + g * gstride + 16 * h)));
      const __m512i t = _mm512_and_si512(_mm512_slli_epi32(_mm512_sub_epi32(e, bias), 7), lo16);
      d[h] = _mm512_or_si512(t, _mm512_slli_epi32(t, 16));
    }
    uint16_t(*b)[16 * 32] = buf.w[par];
    par ^= 1;
    for (int s = 0; s < 4; ++s) {
      const int64_t j = g * 4 + s;
      prefetch_segment(codes, j * 128, kp * 16, 0, 2);
      __m512i q[2][4];
      for (int h = 0; h < 2; ++h) {
        mx4_pairs(_mm512_loadu_si512(blk + 2 * j + h), table, i01, i23, q[h]);
        for (int i = 0; i < 4; ++i) {
          const __mmask32 nz = _mm512_test_epi16_mask(q[h][i], mag);  // ±0 stays ±0
          q[h][i] = _mm512_mask_add_epi16(q[h][i], nz, q[h][i], d[h]);
        }
      }
      dec_store_step(b, s, q);
    }
    dec_tile_dp(x + g * kMx4Group, xstride * 2, b);
  }
  alignas(64) float acc[16 * 32];
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16, 128);
  for (int r = 0; r < m; ++r) {
    _mm512_storeu_ps(C + r * 32, _mm512_load_ps(acc + r * 32));
    _mm512_storeu_ps(C + r * 32 + 16, _mm512_load_ps(acc + r * 32 + 16));
  }
  return true;
}

}  // namespace mx4exp
template <int M>
__attribute__((noinline)) void arm_u4_amxdec(const Problem& p, int64_t b, void* memo) {
  const void* rows[4] = {g_x[0], g_x[1], g_x[2], g_x[3]};
  x86_amx_a16_decode::gemm_u4a16_amxdec(RowFormat::bf16, rows, M, p.mem + b * p.blk_bytes, p.scale.data() + b * 32,
                                        p.zero.data() + b * 32, p.gstride, p.kp, p.G, g_C,
                                        static_cast<x86_avx512_u4_bf16::U4A16Rows*>(memo));
}
template <int M>
__attribute__((noinline)) void arm_mx4_amxdec(const Problem& p, int64_t b, void*) {
  mx4exp::gemm_mx4a16_amxdec(g_x[0], 16384, M, p.mem + b * p.blk_bytes, p.e8m0.data() + b * 32, p.gstride, p.kp,
                                         g_C);
}
// Experiment: one row with tile steps shared between the tiles (stores, tile loads, tdpbf16ps)
// and vdpbf16ps (tile step t goes to the tiles when t % R < A), so that the vector ports work
// while the tile path waits for its stores to drain.
template <int A, int R>
__attribute__((noinline)) void arm_u4_mix(const Problem& p, int64_t b, void* memo_) {
  using namespace x86_avx512_u4_bf16;
  using namespace x86_amx_a16_decode;
  auto* memo = static_cast<U4A16Rows*>(memo_);
  const void* rows[1] = {g_x[0]};
  const int64_t kp = p.kp, G = p.G, gstride = p.gstride;
  memo->prepare(rows, 1, kp, G);
  const uint16_t* xp = memo->xp[0];
  const uint8_t* codes = p.mem + b * p.blk_bytes;
  const float* scale = p.scale.data() + b * 32;
  const uint8_t* zero = p.zero.data() + b * 32;
  const int64_t ng = (kp + G - 1) / G;
  DecB buf;
  alignas(64) float acc[32];
  x86_amx::TileState local;
  x86_amx::TileState& tiles = x86_amx::tile_state(local);
  tiles.group(1);
  __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps();
  const __m512i* blk = reinterpret_cast<const __m512i*>(codes);
  int par = 0, t = 0;
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    {
      const int64_t off = g + 1 < ng ? (g + 1) * gstride : 32;
      _mm_prefetch(reinterpret_cast<const char*>(scale + off), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scale + off + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(zero + off), _MM_HINT_T0);
    }
    _tile_zero(0);
    _tile_zero(1);
    __m512 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t kt = k0; kt < kend; kt += 32, ++t) {
      const int steps = kend - kt >= 32 ? 4 : int((kend - kt) / 8);
      if (t % R < A) {
        uint16_t(*bb)[16 * 32] = buf.w[par];
        par ^= 1;
        for (int s = 0; s < steps; ++s) {
          const int64_t j = kt / 8 + s;
          prefetch_segment(codes, j * 128, kp * 16, 0, 2);
          __m512i q[2][4];
          u4a16_step_codes(blk + 2 * j, q);
          dec_store_step(bb, s, q);
        }
        if (steps < 4) dec_zero_rows(bb, steps);
        dec_tile_dp(xp + kt, 2 * kU4A16MaxK, bb);
      } else {
        for (int s = 0; s < steps; ++s) {
          const int64_t j = kt / 8 + s;
          prefetch_segment(codes, j * 128, kp * 16, 0, 2);
          __m512i q[2][4];
          u4a16_step_codes(blk + 2 * j, q);
          const uint16_t* x = xp + 8 * j;
          for (int i = 0; i < 4; ++i) {
            const __m512bh xb = as_bh(bcast32(x + 2 * i));
            a[i] = _mm512_dpbf16_ps(a[i], as_bh(q[0][i]), xb);
            a[4 + i] = _mm512_dpbf16_ps(a[4 + i], as_bh(q[1][i]), xb);
          }
        }
      }
    }
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
    const __m512 t0 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])), _mm512_load_ps(acc));
    const __m512 t1 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[4], a[5]), _mm512_add_ps(a[6], a[7])), _mm512_load_ps(acc + 16));
    u4a16_group_add(scale, zero, g * gstride, memo->gs[0][g], t0, t1, c0, c1);
  }
  _mm512_storeu_ps(g_C, c0);
  _mm512_storeu_ps(g_C + 16, c1);
}

// The amx_bf16 level's many-row int4 path (moe_amx_bf16.cpp gemm_decoded_amx, m >= 3 today):
// each K group unpacked to a dense bf16 block, then tiles. Restated here (the .cpp is a level's
// translation unit) to put it on this harness.
MOEPACK_AMX_DP(BenchDp, _tile_dpbf16ps);
template <int M>
__attribute__((noinline)) void arm_u4_dense_amx(const Problem& p, int64_t b, void*) {
  const uint16_t* x0 = g_x[0];
  const int64_t stride = 16384, kp = p.kp, G = p.G, gstride = p.gstride;
  const uint8_t* codes = p.mem + b * p.blk_bytes;
  const float* scale = p.scale.data() + b * 32;
  const uint8_t* zero = p.zero.data() + b * 32;
  alignas(64) uint16_t w[256 * 32];
  alignas(64) float grp[4 * 32];
  float* C = g_C;
  x86_amx::TileState local;
  x86_amx::TileState& tiles = x86_amx::tile_state(local);
  for (int i = 0; i < M * 32; ++i) C[i] = 0.0f;
  for (int64_t g = 0, k0 = 0; k0 < kp; ++g, k0 += G) {
    const int64_t kend = k0 + G < kp ? k0 + G : kp;
    for (int64_t k1 = k0; k1 < kend; k1 += 256) {
      const int64_t kk = kend - k1 < 256 ? kend - k1 : 256;
      x86_avx512_u4::unpack_u4_avx512(codes, k1, kk, zero + g * gstride, w);
      const int64_t full = kk / 2 / 16 * 16;
      x86_amx::tile_rows<BenchDp>(tiles, reinterpret_cast<const char*>(x0 + k1), stride * 2, M, reinterpret_cast<const char*>(w),
                                  full, k1 != k0, grp);
    }
    const float* sc = scale + g * gstride;
    const __m512 s0 = _mm512_loadu_ps(sc), s1 = _mm512_loadu_ps(sc + 16);
    for (int i = 0; i < M; ++i) {
      float* ci = C + int64_t(i) * 32;
      const float* q = grp + int64_t(i) * 32;
      _mm512_storeu_ps(ci, _mm512_fmadd_ps(_mm512_loadu_ps(q), s0, _mm512_loadu_ps(ci)));
      _mm512_storeu_ps(ci + 16, _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), s1, _mm512_loadu_ps(ci + 16)));
    }
  }
}
template <int M>
__attribute__((noinline)) void arm_mx4_hook(const Problem& p, int64_t b, void*) {
  const void* rows[4] = {g_x[0], g_x[1], g_x[2], g_x[3]};
  x86_avx512_mx4_bf16::gemm_mx4a16_bf16(RowFormat::bf16, rows, M, p.mem + b * p.blk_bytes, p.e8m0.data() + b * 32, p.gstride,
                                        p.kp, g_C);
}


// ---- mxfp4 W4A16 with fp32 FMAs on a vpermps table (avx512_mx4_f32.h), fp32 rows ------------
alignas(64) float g_xf[4][16384];  // g_x widened
template <int M, int S>
__attribute__((noinline)) void arm_mx4_f32(const Problem& p, int64_t b, void*) {
  const float* rows[4] = {g_xf[0], g_xf[1], g_xf[2], g_xf[3]};
  x86_avx512_mx4_f32::gemm_mx4a16_f32_streams<M, S>(rows, p.mem + b * p.blk_bytes, p.e8m0.data() + b * 32, p.gstride, p.kp,
                                                   g_C);
}

struct ArmDef {
  const char* name;
  Arm fn;
  int bytes_per_k;  // weight bytes per K value of a 32-column block
  bool one_stream;
};

double run_arm(const ArmDef& a, Problem& p, int64_t nb, int64_t calls, void* memo) {
  g_bench_one_stream = a.one_stream;
  const double t0 = now_ns();
  if (nb == 1) {
    for (int64_t i = 0; i < calls; ++i) a.fn(p, 0, memo);
  } else {
    for (int64_t i = 0; i < calls; ++i) a.fn(p, i % nb, memo);
  }
  return now_ns() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t stream_mib = argc > 1 ? std::atoll(argv[1]) : 768;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 3;
  // AMX tile data: the process asks once (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
  syscall(SYS_arch_prctl, 0x1023, 18);
  x86_amx::TileScope tile_scope;  // one tile configuration for the run, as a driver worker keeps
  const double cpn = cycles_per_ns();
  std::printf("core clock (dependent add chain): %.2f GHz\n", cpn);
  std::printf("zmm cycles/insn: vdpbf16ps latency %.2f, 12 chains %.2f; vfmadd231ps 12 chains %.2f; vpdpbusd %.2f; vpaddd %.2f\n",
              dpbf16_lat(cpn), dpbf16_tp(cpn), fma_tp(cpn), vpdpbusd_tp(cpn), vpaddd_tp(cpn));
  std::printf("12 vdpbf16ps + 12 independent vpsrld (port 0): %.2f cycles per vdpbf16ps; + 12 vpshufb (port 5): %.2f; "
              "+ 12 vpternlogd (0/5): %.2f\n", dp_shift(cpn), dp_shuf(cpn), dp_tern(cpn));

  tile_costs(cpn);
  // rows: small bf16 values; int8 rows: small codes
  for (int r = 0; r < 4; ++r)
    for (int k = 0; k < 16384; ++k) {
      g_x[r][k] = uint16_t(0x3C00 + ((k * 7 + r * 13) & 0x3FF));
      g_x8[r][k] = int8_t((k * 5 + r) % 31 - 15);
      g_xf[r][k] = bf16_to_f32(g_x[r][k]);
    }
  const int64_t total = stream_mib << 20;
  // 2 MiB aligned and advised for transparent huge pages, as pack_experts places packed experts
  // (MOEPACK_HUGE_PAGES=0 here: 4 KiB pages)
  uint8_t* mem = static_cast<uint8_t*>(std::aligned_alloc(size_t(2) << 20, (size_t(total) + (size_t(2) << 20) - 1) >> 21 << 21));
  {
    const char* hp = std::getenv("MOEPACK_HUGE_PAGES");
    if (!hp || std::string(hp) != "0") madvise(mem, size_t(total), MADV_HUGEPAGE);
  }
  {
    uint64_t s = 0x9E3779B97F4A7C15ull;
    uint64_t* w = reinterpret_cast<uint64_t*>(mem);
    for (int64_t i = 0; i < total / 8; ++i) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      w[i] = s & 0x7F7F7F7F7F7F7F7Full;  // bf16 words: no NaN or Inf; int8: any
    }
  }
  {  // the tile decode against the vdpbf16ps kernels (a sanity check; tests/cpp has the tests)
    float c1[4 * 32], c2[4 * 32];
    for (int64_t kp : {1024, 2880, 1000, 8192}) {
      std::vector<float> sc(size_t((kp / 32 + 1) * 32), 0.01f);
      std::vector<uint8_t> z(sc.size(), 7), e(sc.size(), 125);
      for (size_t i = 0; i < sc.size(); ++i) sc[i] = 0.001f * float(i % 13 + 1), z[i] = uint8_t(i % 16), e[i] = uint8_t(100 + i % 50);
      for (int m = 1; m <= 4; ++m) {
        const void* rows[4] = {g_x[0], g_x[1], g_x[2], g_x[3]};
        x86_avx512_u4_bf16::U4A16Rows* mm = new x86_avx512_u4_bf16::U4A16Rows;
        x86_avx512_u4_bf16::gemm_u4a16_bf16(RowFormat::bf16, rows, m, mem, sc.data(), z.data(), 32, kp, 128, c1, nullptr);
        const bool ok = x86_amx_a16_decode::gemm_u4a16_amxdec(RowFormat::bf16, rows, m, mem, sc.data(), z.data(), 32, kp, 128, c2, mm);
        double md = 0, mx = 0;
        for (int i = 0; i < m * 32; ++i) md = std::max(md, double(std::fabs(c1[i] - c2[i]))), mx = std::max(mx, double(std::fabs(c1[i])));
        std::printf("check u4 kp=%ld m=%d: %s max|diff| %.3g of max %.3g\n", long(kp), m, ok ? "tiles" : "declined", md, mx);
        delete mm;
        if (kp % 32) continue;
        x86_avx512_mx4_bf16::gemm_mx4a16_bf16(RowFormat::bf16, rows, m, mem, e.data(), 32, kp, c1);
        const bool ok2 = mx4exp::gemm_mx4a16_amxdec(g_x[0], 16384, m, mem, e.data(), 32, kp, c2);
        md = 0, mx = 0;
        for (int i = 0; i < m * 32; ++i) md = std::max(md, double(std::fabs(c1[i] - c2[i]))), mx = std::max(mx, double(std::fabs(c1[i])));
        std::printf("check mx4 kp=%ld m=%d: %s max|diff| %.3g of max %.3g\n", long(kp), m, ok2 ? "tiles" : "declined", md, mx);
        if (m <= 2) {
          const float* fr[4] = {g_xf[0], g_xf[1], g_xf[2], g_xf[3]};
          if (m == 1) {
            x86_avx512_mx4_f32::gemm_mx4a16_f32_streams<1, 4>(fr, mem, e.data(), 32, kp, c2);
          } else {
            x86_avx512_mx4_f32::gemm_mx4a16_f32_streams<2, 2>(fr, mem, e.data(), 32, kp, c2);
          }
          md = 0;
          for (int i = 0; i < m * 32; ++i) md = std::max(md, double(std::fabs(c1[i] - c2[i])));
          std::printf("check mx4 f32 kp=%ld m=%d: max|diff| %.3g of max %.3g\n", long(kp), m, md, mx);
        }
      }
    }
  }
  const ArmDef arms[] = {
      {"bf16 S=1", arm_bf16_s1, 64, true},        {"bf16 S=4", arm_bf16_s4, 64, false},
      {"int8 S=1", arm_i8_s1, 32, true},          {"int8 S=4", arm_i8_s4, 32, false},
      {"u4a16 T=1 S=1", arm_u4_hook<1>, 16, true}, {"u4a16 T=1 S=4", arm_u4_hook<1>, 16, false},
      {"u4pf1k T=1", arm_u4_pf<4, 1024, 0>, 16, false}, {"u4pf2k T=1", arm_u4_pf<4, 2048, 0>, 16, false},
      {"u4pf4k T=1", arm_u4_pf<4, 4096, 0>, 16, false}, {"u4pf2kL2 T=1", arm_u4_pf<4, 2048, 1>, 16, false},
      {"u4pf4kL2 T=1", arm_u4_pf<4, 4096, 1>, 16, false},
      {"u4split4 T=1", arm_u4_split<4>, 16, false}, {"u4split2 T=1", arm_u4_split<2>, 16, false},
      {"u4a16 T=2", arm_u4_hook<2>, 16, false},    {"u4a16 T=4", arm_u4_hook<4>, 16, false},
      {"u4amx T=1", arm_u4_amxdec<1>, 16, false},  {"u4mix1/2 T=1", arm_u4_mix<1, 2>, 16, false},
      {"u4mix1/3 T=1", arm_u4_mix<1, 3>, 16, false}, {"u4mix2/3 T=1", arm_u4_mix<2, 3>, 16, false},  {"u4amx T=2", arm_u4_amxdec<2>, 16, false},
      {"u4amx T=4", arm_u4_amxdec<4>, 16, false},
      {"u4dense T=2", arm_u4_dense_amx<2>, 16, false}, {"u4dense T=4", arm_u4_dense_amx<4>, 16, false},
      {"mx4a16 T=1 S=1", arm_mx4_hook<1>, 16, true}, {"mx4a16 T=1 S=4", arm_mx4_hook<1>, 16, false},
      {"mx4a16 T=2", arm_mx4_hook<2>, 16, false},
      {"mx4amx T=1", arm_mx4_amxdec<1>, 16, false}, {"mx4amx T=2", arm_mx4_amxdec<2>, 16, false},
      {"mx4f32 T=1 S=4", arm_mx4_f32<1, 4>, 16, false}, {"mx4f32 T=1 S=1", arm_mx4_f32<1, 1>, 16, false},
      {"mx4f32 T=1 S=2", arm_mx4_f32<1, 2>, 16, false}, {"mx4f32 T=2 S=2", arm_mx4_f32<2, 2>, 16, false},
  };
  int narms = sizeof(arms) / sizeof(arms[0]);
  if (argc > 3) {  // keep the arms whose name starts with one of the given prefixes
    std::vector<ArmDef> keep;
    const std::string list = std::string(",") + argv[3] + ",";
    for (const ArmDef& a : arms) {
      for (size_t b = 1, e; b < list.size(); b = e + 1) {
        e = list.find(',', b);
        if (e > b && std::string(a.name).rfind(list.substr(b, e - b), 0) == 0) {
          keep.push_back(a);
          break;
        }
      }
    }
    narms = int(keep.size());
    std::copy(keep.begin(), keep.end(), const_cast<ArmDef*>(arms));
  }
  {  // the mixed arm against the hook (sanity)
    Problem p;
    p.kp = 2880, p.G = 128, p.nb = 1, p.mem = mem, p.blk_bytes = 2880 * 16, p.ng = 23, p.gstride = 32;
    p.scale.assign(23 * 32, 0.01f);
    p.zero.assign(23 * 32, 8);
    auto* mm = new x86_avx512_u4_bf16::U4A16Rows;
    float ref[32];
    arm_u4_hook<1>(p, 0, mm);
    std::memcpy(ref, g_C, sizeof ref);
    auto* mm2 = new x86_avx512_u4_bf16::U4A16Rows;
    arm_u4_mix<1, 2>(p, 0, mm2);
    double md = 0;
    for (int i = 0; i < 32; ++i) md = std::max(md, double(std::fabs(ref[i] - g_C[i])));
    std::printf("check mix1/2 vs hook: max|diff| %.3g (of %.3g)\n", md, double(std::fabs(ref[0])));
    arm_u4_split<4>(p, 0, mm2);
    md = 0;
    for (int i = 0; i < 32; ++i) md = std::max(md, double(std::fabs(ref[i] - g_C[i])));
    std::printf("check split4 vs hook: max|diff| %.3g (of %.3g)\n", md, double(std::fabs(ref[0])));
    delete mm;
    delete mm2;
  }
  auto* memo = new x86_avx512_u4_bf16::U4A16Rows;
  struct Case {
    const char* what;
    int64_t kp;
    bool stream;
  };
  const Case cases[] = {{"resident (L1-L2), K=1024", 1024, false}, {"resident (L2), K=2880", 2880, false},
                        {"streamed (DRAM), K=2880", 2880, true},  {"streamed (DRAM), K=4096", 4096, true},
                        {"streamed (DRAM), K=8192", 8192, true}};
  for (const Case& cs : cases) {
    std::printf("\n%s: ns | cycles per 128 bytes of weights, GB/s (one thread, best of %d)\n", cs.what,
                cs.stream ? reps : 5 * reps);
    std::vector<double> best(narms, 1e30);
    std::vector<Problem> probs(narms);
    for (int i = 0; i < narms; ++i) {
      Problem& p = probs[i];
      p.kp = cs.kp;
      p.blk_bytes = cs.kp * arms[i].bytes_per_k;
      p.nb = cs.stream ? total / p.blk_bytes : 1;
      p.mem = mem;
      p.ng = (cs.kp + 127) / 128;
      if (arms[i].name[0] == 'm') p.ng = cs.kp / 32;
      p.G = 128;
      p.gstride = p.nb * 32;
      p.scale.assign(size_t(p.ng * p.gstride), 0.01f);
      p.zero.assign(size_t(p.ng * p.gstride), 8);
      p.e8m0.assign(size_t(p.ng * p.gstride), 120);
    }
    for (int rep = 0; rep < (cs.stream ? reps : 5 * reps); ++rep) {
      for (int i = 0; i < narms; ++i) {
        Problem& p = probs[i];
        // resident: ~32 MiB of reads a repetition (a few ms: short enough that the best of many
        // misses the other tenants' time slices), 5x the repetitions
        const int64_t calls = cs.stream ? p.nb : std::max<int64_t>(64, (int64_t(32) << 20) / p.blk_bytes);
        if (!cs.stream) run_arm(arms[i], p, 1, 8, memo);  // warm
        const double ns = run_arm(arms[i], p, p.nb, calls, memo);
        best[i] = std::min(best[i], ns / double(calls * p.blk_bytes / 128));
      }
    }
    for (int i = 0; i < narms; ++i)
      std::printf("  %-16s %7.2f ns %7.1f cyc  %6.1f GB/s\n", arms[i].name, best[i], best[i] * cpn, 128.0 / best[i]);
  }
  std::free(mem);
  return 0;
}
