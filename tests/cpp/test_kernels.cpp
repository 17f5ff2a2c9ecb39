// Torch-free test of the fused-MoE kernels: every ISA kernel this binary can run against the
// scalar kernel (SEMANTICS.md §4), and the scalar kernel against a naive double-precision
// reference written from SEMANTICS.md §2 (the driver is shared by every ISA, so SIMD-vs-scalar
// alone cannot see a driver bug).
//
// Kernels: scalar (oracle), and for each level L of the host's architecture (moepack/isa_levels.py):
// L (csrc/<arch>/moe_L.cpp built natively, run only when the CPU and OS have the level) and, for
// the levels the list says how to emulate, L-emu (the same file against SIMDe's portable
// intrinsics: runs on any CPU of the architecture, or any with the level it was built over).
// Each kernel runs on the layouts its level serves (isa_serves).
//
// The tests live in parts included below inside one anonymous namespace (kt_*.inc: common helpers,
// one dense problem, misc checks, int8, int4, fp8, mxfp4, the mxfp4 hooks, the grouped-decode seam);
// main() runs them.
//
// Build and run: python tests/cpp/build.py --run   (options: -v prints every case)
// Last line: "N passed, M failed"; exit status 1 when anything failed.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <array>
#include <vector>
#if defined(__x86_64__)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr (kt_fp8.inc)
#endif

#include "moepack/kernel.h"
#include "moepack/numeric.h"
#include "../../csrc/kernels/mk_hooks.h"

// The kernel objects this binary links (moe_L.cpp natively, through SIMDe, and natively again as
// register_L_native): tests/cpp/linked.cpp, compiled per binary by tests/cpp/build.py.
#include "linked.h"

using namespace moepack;

namespace {

// The layouts the tests run every level on: the family of the architecture this binary is built
// for (tests/cpp/build.py builds one architecture; moepack/layout.py). The tests of one blocking's
// rules (kt_misc, kt_seam) name x86 layouts and run on any architecture (scalar and the table).
#if defined(__aarch64__)
const LayoutDesc& kTDense = kLayout_bf16_n16k4_arm;
const LayoutDesc& kTI8 = kLayout_i8_n16k8_arm;
const LayoutDesc& kTU4g32 = kLayout_u4g32_n16k8_arm;
const LayoutDesc& kTU4g128 = kLayout_u4g128_n16k8_arm;
const LayoutDesc& kTU4ch = kLayout_u4ch_n16k8_arm;
const LayoutDesc& kTF8g128 = kLayout_f8g128_n16k4_arm;
const LayoutDesc& kTF8ch = kLayout_f8ch_n16k4_arm;
#else
const LayoutDesc& kTDense = kLayout_bf16_n32k2_x86;
const LayoutDesc& kTI8 = kLayout_i8_n32k4_x86;
const LayoutDesc& kTU4g32 = kLayout_u4g32_n32k8_x86;
const LayoutDesc& kTU4g128 = kLayout_u4g128_n32k8_x86;
const LayoutDesc& kTU4ch = kLayout_u4ch_n32k8_x86;
const LayoutDesc& kTF8g128 = kLayout_f8g128_n32k2_x86;
const LayoutDesc& kTF8ch = kLayout_f8ch_n32k2_x86;
#endif
// --quick (the ARM run under qemu-user, tests/engine/test_arm_cross.py, where each check costs
// ~10x its native time): every 5th case of the big dense loop (every 25th at T = 67), the
// past-2-MiB case at a small I, the variant matrix on every 9th case
// and the SIMD levels only, one past-2-MiB case, one activation dtype per int4 mode, fewer K and
// row counts for the x86 mxfp4 blocking (scalar only there). Every level, layout, activation and
// dtype still runs; the native x86 run keeps the whole matrix for the shared C++ (driver, scalar).
bool g_quick = false;
// --emulated-only (tests/engine/test_cpp_kernels.py's emulated test; the native binary runs the
// rest): only the SIMDe-emulated levels are tested, scalar is their oracle only (its own checks
// against the naive reference and its variants are the native binary's).
bool g_emulated_only = false;

#include "kt_common.inc"
#include "kt_problem.inc"
#include "kt_misc.inc"
#include "kt_int8.inc"
#include "kt_int4.inc"
#include "kt_fp8.inc"
#include "kt_mx4.inc"
#include "kt_mx4_simd.inc"
#include "kt_mx4_arm.inc"
#include "kt_nvfp4.inc"
#include "kt_seam.inc"
#include "kt_nan.inc"

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-v") == 0) g_verbose = true;
    if (std::strcmp(argv[i], "--quick") == 0) g_quick = true;
    if (std::strcmp(argv[i], "--emulated-only") == 0) g_emulated_only = true;
    if (std::strcmp(argv[i], "--levels") == 0) {  // what cpu_features.cpp finds: one line per level
      for (int l = 0; l < kNumIsa; ++l) {
        const char* why = isa_unavailable_reason(Isa(l));
        std::printf("level %s: %s\n", isa_name(Isa(l)), why ? why : "available");
      }
      return 0;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  timed("collect_kernels", [&] { collect_kernels(); });
  timed("test_pack", [&] { test_pack(); });
  timed("test_routing_check", [&] { test_routing_check(); });
  timed("test_empty", [&] { test_empty(); });
  timed("test_select", [&] { test_select(); });
  timed("test_register_refusals", [&] { test_register_refusals(); });
  timed("test_registration", [&] { test_registration(runnable_registrars()); });
  timed("test_decode_streams", [&] { test_decode_streams(); });
  timed("test_i8", [&] {
    const std::vector<I8Kernel> i8 = collect_i8_kernels();
    test_i8_quantizer();
    test_i8_accumulators(i8);
    test_i8_fused(i8);
  });
  timed("test_u4", [&] { test_u4(runnable_registrars()); });
  timed("test_u4_seam", [&] { test_u4_seam(); });
  timed("test_f8_decode", [&] { test_f8_decode(runnable_registrars()); });
  timed("test_f8_fused", [&] { test_f8_fused(runnable_registrars()); });
  timed("test_mx4_tables", [&] { test_mx4_tables(); });
  timed("test_mx4_block", [&] { test_mx4_block(runnable_registrars()); });
  timed("test_mx4_blockings", [&] { test_mx4_blockings(); });
  timed("test_mx4_fused", [&] { test_mx4_fused(runnable_registrars()); });
  timed("test_mx4_simd", [&] { test_mx4_simd(runnable_registrars()); });
  timed("test_mx4_arm", [&] { test_mx4_arm(runnable_registrars()); });
  timed("test_nv4_tables", [&] { test_nv4_tables(); });
  timed("test_nv4_block", [&] { test_nv4_block(runnable_registrars()); });
  timed("test_nv4_fused", [&] { test_nv4_fused(runnable_registrars()); });
  timed("test_nv4_hooks", [&] { test_nv4_hooks(runnable_registrars()); });
  timed("test_swiglu_nan", [&] { test_swiglu_nan(); });

  const Activation acts[5] = {Activation::silu, Activation::gelu, Activation::gelu_tanh, Activation::swigluoai,
                              Activation::relu2};
  const DType dts[3] = {DType::f32, DType::bf16, DType::f16};
  struct Shape {
    int H, I;
  };
  // H, I not multiples of 32; Kp(H)/2 = 100, 47, 65, 34 K pairs (every remainder of the 4-pair unroll)
  const Shape shapes[4] = {{200, 88}, {93, 40}, {130, 176}, {68, 20}};
  uint64_t seed = 1000;
  int variant = 0;
  timed("dense cases", [&] {
    for (const Shape& s : shapes) {
      for (int T : {1, 3, 67}) {
        const int E = 5;
        // every k x bias
        for (const Activation act : acts) {
          for (const DType dt : dts) {
            const int ks[3] = {1, 2, E};
            const int nk = 3;
            for (int ki = 0; ki < nk; ++ki) {
              for (int bias = 0; bias < 2; ++bias) {
                ++variant;
                // --quick: every 5th case, and every 25th of T = 67 (~94% of the loop's work;
                // "dense > 64 rows" runs every activation and dtype on many rows). 25: prime to 3
                // and 1 mod 4, so T = 67 still cycles through par and the expert_map.
                if (g_quick && variant % (T > 64 ? 25 : 5) != 0) continue;
                Case c;
                c.T = T;
                c.H = s.H;
                c.I = s.I;
                c.E = E;
                c.k = ks[ki];
                c.act = act;
                c.dt = dt;
                c.bias = bias != 0;
                c.emap = variant % 4 == 1;
                if (c.emap && c.k == E) c.k = E + 3;  // k = E_global: every expert, 3 of them remote
                c.par = variant % 3;
                c.x_pad = variant % 5 == 2 ? 7 : 0;
                if (act == Activation::swigluoai && variant % 2) {
                  c.alpha = 1.702f;
                  c.limit = 1.25f;  // the clamps bite (h ~ N(0, 1.5^2))
                }
                if (act == Activation::silu && variant % 2) c.silu_limit = 1.25f;  // DeepSeek-V4's clamped SwiGLU
                c.seed = seed++;
                run_case(c);
              }
            }
          }
        }
      }
    }
  });
  // Every expert with exactly 4 rows (T = 4, k = E): the 4-row decode streams of every kernel.
  timed("dense 4-row cases", [&] {
    for (const Shape& sh : shapes) {
      for (const DType dt : dts) {
        ++variant;
        Case c{4, sh.H, sh.I, 5, 5, Activation::silu, dt, variant % 2 == 0, false, variant % 3, 0};
        c.seed = seed++;
        run_case(c);
      }
    }
  });
  // An expert with > 64 rows (several row chunks per expert), T*k = 300 over 3 experts.
  timed("dense > 64 rows", [&] {
    for (const Activation act : acts) {
      for (const DType dt : dts) {
        ++variant;
        Case c{150, 93, 40, 3, 2, act, dt, variant % 2 == 0, false, variant % 3, 0};
        if (act == Activation::swigluoai) c.limit = 1.25f;
        if (act == Activation::silu) c.silu_limit = 0.75f;
        c.seed = seed++;
        run_case(c);
      }
    }
  });
  // Past 2 MiB of stage 2 outputs (fused_moe_driver.inc kStreamYBytes): y written with
  // non-temporal stores (MK::out_row's streamed branch; SIMDe's stores under emulation). 500 x 4
  // slots x Np 544 x 4 bytes = 4.4 MB; with the expert_map 5 of 8 experts are local (~2.7 MB).
  timed("dense past 2 MiB", [&] {
    for (int emap = 0; emap < 2; ++emap) {
      ++variant;
      if (g_quick && emap == 0) continue;  // --quick: the expert_map case alone (2.7 MB; each was ~9% of the ARM run)
      // y's size is rows x H, the work rows x H x I: --quick's I = 8 keeps y past 2 MiB at a fifth of
      // the work (at I = 40 this one case was ~40% of the ARM run under qemu)
      Case c{500, 520, g_quick ? 8 : 40, 5, 4, Activation::silu, DType::bf16, true, emap != 0, 1, 0};
      c.seed = seed++;
      run_case(c);
    }
  });
  // Row-count coverage of the GEMM tiles: bf16 rows run MR=8 tiles (remainders 1..7, m==1 has
  // its own path), fp32 rows MR=4 (remainders 1..3).
  {
    bool rem8[8] = {}, rem4[4] = {};
    for (const auto& [m, n] : g_rows_bf16) rem8[m % 8] = true;
    for (const auto& [m, n] : g_rows_f32) rem4[m % 4] = true;
    bool all8 = true, all4 = true;
    for (bool b : rem8) all8 &= b;
    for (bool b : rem4) all4 &= b;
    check(all8 && g_rows_bf16.count(1) && g_rows_bf16.count(64), "bf16 GEMM row counts cover m=1, m=64 and every m %% 8");
    check(all4 && g_rows_f32.count(1) && g_rows_f32.count(64), "fp32 GEMM row counts cover m=1, m=64 and every m %% 4");
  }

  timed("test_hooks_run", [&] { test_hooks_run(runnable_registrars()); });

  std::printf("\nmax errors (rel = ||got - ref|| / ||ref||, worst = max|got - ref| / max|ref|):\n");
  std::printf("  %-24s %6s %12s %12s %10s\n", "kernel/dtype", "cases", "max rel", "max worst", "bit-diff");
  for (const auto& [key, s] : g_stats) {
    std::printf("  %-24s %6d %12.3g %12.3g %7d/%d\n", key.c_str(), s.cases, s.max_rel, s.max_worst, s.differing_cases,
                s.cases);
  }
  std::printf("comparisons above the base tolerance (bf16/f16: accepted only within the flip allowance): %d\n",
              g_allowance_used);
  std::printf("section time:");
  for (const auto& [k, sec] : g_section_seconds) std::printf(" %s %.2fs", k.c_str(), sec);
  std::printf("\n");
  std::printf("kernel time:");
  for (const auto& [k, sec] : g_kernel_seconds) std::printf(" %s %.2fs", k.c_str(), sec);
  std::printf("; total %.1fs\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
