// x86 CPU features (csrc/include/moepack/isa_gen.h: CpuFeatures, from moepack/isa_levels.py): cpuid
// says what the CPU has, xgetbv what the OS saves. Compiled for the baseline target, without any
// ISA flags (setup.py), so it never executes an instruction the CPU may lack; csrc/dispatch.cpp
// calls the ISA translation units' register_* only after this says their level can run.
#include <cpuid.h>

#include <cstring>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "moepack/kernel.h"

namespace moepack {

static uint64_t read_xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

CpuFeatures detect_cpu_features() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1;
  f.fma = (c >> 12) & 1;
  f.f16c = (c >> 29) & 1;
  const bool avx = (c >> 28) & 1;
  if (osxsave && avx) {
    const uint64_t xcr0 = read_xcr0();
    f.os_avx = (xcr0 & 0x6) == 0x6;                   // SSE + AVX state
    f.os_avx512 = f.os_avx && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  }
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned max_subleaf = a;
    f.avx2 = (b >> 5) & 1;
    f.avx512f = (b >> 16) & 1;
    f.avx512dq = (b >> 17) & 1;
    f.avx512bw = (b >> 30) & 1;
    f.avx512vl = (b >> 31) & 1;
    f.avx512_vnni = (c >> 11) & 1;
    f.avx512vbmi = (c >> 1) & 1;
    f.amx_bf16 = (d >> 22) & 1;
    f.amx_tile = (d >> 24) & 1;
    f.amx_int8 = (d >> 25) & 1;
    if (max_subleaf >= 1) {  // leaf 7 subleaf 1 exists only when subleaf 0 says so
      __cpuid_count(7, 1, a, b, c, d);
      f.avx512_bf16 = (a >> 5) & 1;
      f.avx_vnni = (a >> 4) & 1;
    }
  }
  // AMX: XCR0 must enable XTILECFG and XTILEDATA (bits 17, 18), and Linux hands tile data to a
  // process only after it asks (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; once, process-wide).
  if (f.amx_tile && osxsave && avx) {
    const bool xcr0_tiles = (read_xcr0() & (uint64_t(3) << 17)) == (uint64_t(3) << 17);
#if defined(__linux__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    f.os_amx = xcr0_tiles && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    f.os_amx = false;  // no known way to ask this OS for tile data
    (void)xcr0_tiles;
#endif
  }
  return f;
}

const char* cpu_vendor() {
  static const struct Vendor {
    char s[13] = {0};
    Vendor() {
      unsigned a, b, c, d;
      if (__get_cpuid(0, &a, &b, &c, &d)) {
        std::memcpy(s, &b, 4);
        std::memcpy(s + 4, &d, 4);
        std::memcpy(s + 8, &c, 4);
      }
    }
  } v;
  return v.s;
}

}  // namespace moepack
