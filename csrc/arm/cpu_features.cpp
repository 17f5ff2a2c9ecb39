// AArch64 CPU features (csrc/include/moepack/isa_gen.h: CpuFeatures, from moepack/isa_levels.py).
// Linux: the kernel's hardware capability words (getauxval AT_HWCAP / AT_HWCAP2, the bits
// <asm/hwcap.h> defines; what /proc/cpuinfo "Features" prints); macOS: sysctlbyname
// hw.optional.* (Apple's names: AdvSIMD, arm.FEAT_DotProd, arm.FEAT_I8MM, arm.FEAT_BF16). The
// OS saves the NEON registers on every AArch64 system, so no level has an "os" need. SVE is
// read for information only (cpu_flags): no level uses it. Compiled for the baseline target
// (-march=armv8-a), without any level's flags (setup.py): csrc/dispatch.cpp calls register_* of a
// level only after this says its CPU has the instructions.
#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#include <sys/types.h>
#endif

#include "moepack/kernel.h"

namespace moepack {

#if defined(__linux__)
// Bit numbers of <asm/hwcap.h> (arm64), written out: an old libc's headers may lack the newer ones.
namespace hwcap {
constexpr unsigned long kAsimd = 1ul << 1;     // HWCAP_ASIMD
constexpr unsigned long kAsimdDp = 1ul << 20;  // HWCAP_ASIMDDP
constexpr unsigned long kSve = 1ul << 22;      // HWCAP_SVE
constexpr unsigned long kI8mm = 1ul << 13;     // HWCAP2_I8MM (AT_HWCAP2)
constexpr unsigned long kBf16 = 1ul << 14;     // HWCAP2_BF16 (AT_HWCAP2)
}  // namespace hwcap
#ifndef AT_HWCAP2
#define AT_HWCAP2 26
#endif
#elif defined(__APPLE__)
static bool sysctl_flag(const char* name) {
  int v = 0;
  size_t n = sizeof(v);
  return sysctlbyname(name, &v, &n, nullptr, 0) == 0 && v != 0;
}
#endif

CpuFeatures detect_cpu_features() {
  CpuFeatures f;
#if defined(__linux__)
  const unsigned long h1 = getauxval(AT_HWCAP), h2 = getauxval(AT_HWCAP2);
  f.asimd = (h1 & hwcap::kAsimd) != 0;
  f.asimddp = (h1 & hwcap::kAsimdDp) != 0;
  f.sve = (h1 & hwcap::kSve) != 0;
  f.i8mm = (h2 & hwcap::kI8mm) != 0;
  f.bf16 = (h2 & hwcap::kBf16) != 0;
#elif defined(__APPLE__)
  f.asimd = sysctl_flag("hw.optional.AdvSIMD") || sysctl_flag("hw.optional.neon");
  f.asimddp = sysctl_flag("hw.optional.arm.FEAT_DotProd");
  f.i8mm = sysctl_flag("hw.optional.arm.FEAT_I8MM");
  f.bf16 = sysctl_flag("hw.optional.arm.FEAT_BF16");
  f.sve = false;  // no Apple CPU has SVE
#else
  // Another OS: Advanced SIMD is part of every AArch64 CPU; the optional features are not asked.
  f.asimd = true;
#endif
  return f;
}

// The implementer (MIDR_EL1 bits 31-24) is not readable from user space everywhere; the vendor
// string only steers the x86 decode-stream choice, so AArch64 reports none.
const char* cpu_vendor() { return ""; }

}  // namespace moepack
