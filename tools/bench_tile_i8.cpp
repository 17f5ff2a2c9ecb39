// Bare-tile bench of the avx512_vnni int8 block GEMM (csrc/x86/avx512_vnni_common.h), one thread,
// on weight blocks that stay in L2: what the micro-kernel reaches without the rest of a fused call
// (row quantization, the epilogue, threading, DRAM), against the dot-product instruction's limit.
// Per shape, two paths:
//   u8 rows     gemm_i8_vnni_rows<0>: the avx512_vnni level's path (from 8 rows: rows u8 = q + 128
//               as stored, signed weights, 128 colsum(w) subtracted, tiles of 6..12 rows; 5..7
//               rows: the XOR tile; 1..4 rows: the decode streams)
//   signed rows gemm_i8_vnni_rows<0x80808080>: the tiles amx_int8 runs on its short chunks (weights
//               XORed to u8, signed rows, 8-row tiles), the avx512_vnni level's algorithm before
// and the limit: 16 independent vpdpbusd zmm chains (what `moepack info --probe` calls vpdpbusd_zmm).
// Reported per path: GOP/s (2 ops per multiply-add, m x 32 x kp multiply-adds per block), core
// cycles per useful vpdpbusd (m x kp / 2 per block; the u8 path also issues kp / 2 for the column
// sums) and the % of the peak's GOP/s. Core cycles come from the clock measured by a chain of
// dependent 1-cycle adds (no performance counters needed, so it works in a VM; the TSC does not
// tick at the core clock). Both paths are checked against each other (exact int32).
// Build and run (docs/BENCH.md "Prefill without AMX"):
//   F="-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c"
//   g++ -O3 -std=c++20 $F -Icsrc/include -Icsrc/x86 tools/bench_tile_i8.cpp -o /tmp/bench_tile_i8
//   /tmp/bench_tile_i8 [kp=2048] [rows=1,4,8,12,16,32,64] [blocks=4]
// Timings: the best of many short passes, the paths, the peak and the clock alternating, so that a
// loaded machine still gives comparable numbers (a pass another process interrupted is not the
// best; the figures are still only comparable with each other).
#include "avx512_vnni_common.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace moepack {
bool decode_one_stream() { return false; }  // the 4-segment decode streams (cpu_features.cpp decides in moepack)
}  // namespace moepack

using namespace moepack;
using Clock = std::chrono::steady_clock;

// Seconds per vpdpbusd of 16 independent chains: the best of `reps` passes.
static double peak_seconds_per_dot(int reps) {
  double best = 1e9;
  const long n = 200000;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = Clock::now();
    for (long i = 0; i < n; ++i) {
      __asm__ volatile(
          "vpdpbusd %%zmm0,%%zmm1,%%zmm16\n vpdpbusd %%zmm0,%%zmm1,%%zmm17\n vpdpbusd %%zmm0,%%zmm1,%%zmm18\n"
          "vpdpbusd %%zmm0,%%zmm1,%%zmm19\n vpdpbusd %%zmm0,%%zmm1,%%zmm20\n vpdpbusd %%zmm0,%%zmm1,%%zmm21\n"
          "vpdpbusd %%zmm0,%%zmm1,%%zmm22\n vpdpbusd %%zmm0,%%zmm1,%%zmm23\n vpdpbusd %%zmm0,%%zmm1,%%zmm24\n"
          "vpdpbusd %%zmm0,%%zmm1,%%zmm25\n vpdpbusd %%zmm0,%%zmm1,%%zmm26\n vpdpbusd %%zmm0,%%zmm1,%%zmm27\n"
          "vpdpbusd %%zmm0,%%zmm1,%%zmm28\n vpdpbusd %%zmm0,%%zmm1,%%zmm29\n vpdpbusd %%zmm0,%%zmm1,%%zmm30\n"
          "vpdpbusd %%zmm0,%%zmm1,%%zmm31\n" ::: "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22",
          "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31");
    }
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best / (16.0 * n);
}

// The core clock (Hz): 32 dependent adds per step, one cycle each; the best of `reps` passes.
static double core_hz(int reps) {
  double best = 1e9;
  const long n = 200000;
  for (int rep = 0; rep < reps; ++rep) {
    uint64_t v = 1;
    const auto t0 = Clock::now();
    for (long i = 0; i < n; ++i) {
      __asm__ volatile(
          "add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n"
          "add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n"
          "add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n"
          "add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n add %0,%0\n"
          : "+r"(v));
    }
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return 32.0 * n / best;
}

// The timed passes, outside main: GCC optimizes main as code run once, and there it left the
// tiles' per-step prefetch helper out of line (a call per K quad), which the extension inlines.
template <uint32_t kRowXor>
__attribute__((noinline)) static double time_blocks(const int8_t* const* x, int m, const int8_t* B, int64_t kp, int nblk,
                                                    int32_t* C) {
  const auto t0 = Clock::now();
  for (int b = 0; b < nblk; ++b) x86_avx512_vnni::gemm_i8_vnni_rows<kRowXor>(x, m, B + size_t(b) * kp * 32, kp, C);
  return std::chrono::duration<double>(Clock::now() - t0).count() / nblk;
}

int main(int argc, char** argv) {
  const int64_t kp = argc > 1 ? atoll(argv[1]) : 2048;
  std::vector<int> ms;
  for (const char* p = argc > 2 ? argv[2] : "1,4,8,12,16,32,64"; *p;) {
    ms.push_back(atoi(p));
    while (*p && *p != ',') ++p;
    if (*p) ++p;
  }
  const int nblk = argc > 3 ? atoi(argv[3]) : 4;
  if (kp <= 0 || kp % 4) {
    fprintf(stderr, "kp=%lld: K (padded) must be a positive multiple of 4 (one vpdpbusd K quad)\n", (long long)kp);
    return 2;
  }
  if (nblk <= 0) {
    fprintf(stderr, "blocks=%d: the number of weight blocks must be positive\n", nblk);
    return 2;
  }
  std::vector<int8_t> B(size_t(nblk) * kp * 32);
  for (auto& v : B) v = int8_t(rand());
  double peak_s = 1e9, hz = 0;  // refined between the shapes: the best seen so far
  for (int i = 0; i < 10; ++i) peak_s = std::min(peak_s, peak_seconds_per_dot(2)), hz = std::max(hz, core_hz(2));
  for (int m : ms) {
    if (m < 1 || m > 64) {
      fprintf(stderr, "rows=%d: 1..64 (the driver's chunk)\n", m);
      return 2;
    }
    std::vector<int8_t> U(size_t(m) * kp), S(size_t(m) * kp);  // u8 rows, and the same codes signed
    for (size_t i = 0; i < U.size(); ++i) {
      U[i] = int8_t(rand());
      S[i] = int8_t(uint8_t(U[i]) ^ 0x80);
    }
    std::vector<const int8_t*> xu(m), xs(m);
    for (int i = 0; i < m; ++i) xu[i] = U.data() + size_t(i) * kp, xs[i] = S.data() + size_t(i) * kp;
    std::vector<int32_t> Cu(size_t(m) * 32), Cs(size_t(m) * 32);
    double best[2] = {1e9, 1e9};
    for (int rep = 0; rep < 200; ++rep) {
      best[0] = std::min(best[0], time_blocks<0>(xu.data(), m, B.data(), kp, nblk, Cu.data()));
      best[1] = std::min(best[1], time_blocks<0x80808080u>(xs.data(), m, B.data(), kp, nblk, Cs.data()));
      if (rep == 0 && std::memcmp(Cu.data(), Cs.data(), Cu.size() * 4) != 0) {
        fprintf(stderr, "rows=%d kp=%lld: the two paths' int32 results differ\n", m, (long long)kp);
        return 1;
      }
      if (rep % 50 == 49) peak_s = std::min(peak_s, peak_seconds_per_dot(1)), hz = std::max(hz, core_hz(1));
    }
    const double dots = double(m) * kp / 2;  // useful vpdpbusd per block: m rows x 2 halves x kp / 4 quads
    const double ops = 2.0 * m * 32 * kp;
    printf("kp=%lld rows=%2d:", (long long)kp, m);
    const char* names[2] = {"u8 rows", "signed rows"};
    for (int v = 0; v < 2; ++v)
      printf("  %s %6.1f GOP/s, %5.2f cycles/vpdpbusd, %3.0f%% of peak%s", names[v], ops / best[v] * 1e-9,
             best[v] * hz / dots, 100.0 * peak_s * dots / best[v], v == 0 ? ";" : "");
    printf("\n");
  }
  printf("peak: vpdpbusd zmm, 16 chains: %.0f GOP/s = %.2f cycles/vpdpbusd at a %.2f GHz core clock (one thread)\n",
         128.0 / peak_s * 1e-9, peak_s * hz, hz * 1e-9);
  return 0;
}
