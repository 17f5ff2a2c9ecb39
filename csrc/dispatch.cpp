// CPU feature detection and kernel selection. Compiled for the baseline target, without any
// ISA flags (and so never executes an instruction the CPU may lack): it asks cpuid what the CPU
// has and xgetbv what the OS saves, and only then calls the ISA translation units' register_*.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "moepack/kernel.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define MOEPACK_X86 1
#endif

namespace moepack {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx_vnni: return "avx_vnni";
    case Isa::avx512: return "avx512";
    case Isa::avx512_vnni: return "avx512_vnni";
    case Isa::avx512_bf16: return "avx512_bf16";
  }
  return "?";
}

#ifdef MOEPACK_X86
static uint64_t read_xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}
#endif

static CpuFeatures detect() {
  CpuFeatures f;
#ifdef MOEPACK_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1;
  f.fma = (c >> 12) & 1;
  f.f16c = (c >> 29) & 1;
  const bool avx = (c >> 28) & 1;
  if (osxsave && avx) {
    const uint64_t xcr0 = read_xcr0();
    f.os_avx = (xcr0 & 0x6) == 0x6;             // SSE + AVX state
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
    f.avx512vnni = (c >> 11) & 1;
    if (max_subleaf >= 1) {  // leaf 7 subleaf 1 exists only when subleaf 0 says so
      __cpuid_count(7, 1, a, b, c, d);
      f.avx512bf16 = (a >> 5) & 1;
      f.avx_vnni = (a >> 4) & 1;
    }
  }
#endif
  return f;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

const char* isa_unavailable_reason(Isa isa) {
#ifndef MOEPACK_X86
  if (isa != Isa::scalar) return "not an x86 CPU";
#endif
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case Isa::scalar: return nullptr;
    case Isa::avx2:
      if (!(f.avx2 && f.fma && f.f16c)) return "the CPU lacks AVX2/FMA/F16C";
      if (!f.os_avx) return "the OS does not enable AVX state (XCR0)";
      return nullptr;
    case Isa::avx_vnni:
      if (!f.avx_vnni) return "the CPU lacks AVX-VNNI";
      return isa_unavailable_reason(Isa::avx2);
    case Isa::avx512:
      if (!(f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq)) return "the CPU lacks AVX-512 F/BW/VL/DQ";
      if (!f.os_avx512) return "the OS does not enable AVX-512 state (XCR0 opmask/ZMM)";
      return isa_unavailable_reason(Isa::avx2);
    case Isa::avx512_vnni:
      if (!f.avx512vnni) return "the CPU lacks AVX512_VNNI";
      return isa_unavailable_reason(Isa::avx512);
    case Isa::avx512_bf16:
      if (!f.avx512bf16) return "the CPU lacks AVX512_BF16";
      return isa_unavailable_reason(Isa::avx512);
  }
  return "unknown ISA";
}

bool isa_serves(Isa isa, const LayoutDesc& L) {
  if (L.family != kFamily_x86) return isa == Isa::scalar;
  switch (isa) {
    case Isa::avx_vnni:
    case Isa::avx512_vnni: return L.weight_dtype == kWeight_i8;
    case Isa::avx512_bf16: return L.weight_dtype == kWeight_bf16;
    default: return true;
  }
}

Isa host_isa() {
  for (int i = kNumIsa - 1; i > 0; --i) {
    if (!isa_unavailable_reason(Isa(i))) return Isa(i);
  }
  return Isa::scalar;
}

Isa env_max_isa() {
  const char* v = std::getenv("MOEPACK_MAX_ISA");
  if (v == nullptr || *v == '\0') return host_isa();
  for (int i = 0; i < kNumIsa; ++i) {
    if (std::strcmp(v, isa_name(Isa(i))) == 0) return Isa(i);
  }
  throw std::invalid_argument(std::string("MOEPACK_MAX_ISA='") + v +
                              "' is not one of scalar, avx2, avx_vnni, avx512, avx512_vnni, avx512_bf16 (it can only "
                              "lower the ISA level moepack uses)");
}

static const KernelTable& table() {
  static const KernelTable t = [] {
    KernelTable k;
    register_scalar(k);
#ifdef MOEPACK_X86
    if (!isa_unavailable_reason(Isa::avx2)) register_avx2(k);
    if (!isa_unavailable_reason(Isa::avx_vnni)) register_avx_vnni(k);
    if (!isa_unavailable_reason(Isa::avx512)) register_avx512(k);
    if (!isa_unavailable_reason(Isa::avx512_vnni)) register_avx512_vnni(k);
    if (!isa_unavailable_reason(Isa::avx512_bf16)) register_avx512_bf16(k);
#endif
    return k;
  }();
  return t;
}

const LayoutDesc* layout_find(int32_t id) {
  for (const LayoutDesc& L : kLayouts) {
    if (L.id == id) return &L;
  }
  return nullptr;
}

Selection select_kernel(const KernelTable& t, const char* const unavailable[kNumIsa], int32_t layout_id, Isa max_isa) {
  Selection s;
  const LayoutDesc* L = layout_find(layout_id);
  if (L == nullptr) {
    std::snprintf(s.reason, sizeof(s.reason), "layout id %d is unknown to this build", int(layout_id));
    return s;
  }
  int best_host = -1;  // best level the host has that serves the layout (ignoring the cap)
  int missing = -1;    // best allowed, available, serving level that has no kernel
  for (int i = kNumIsa - 1; i >= 0; --i) {
    if (!isa_serves(Isa(i), *L) || unavailable[i] != nullptr) continue;
    if (best_host < 0) best_host = i;
    if (i > int(max_isa)) continue;
    if (t.fused[layout_id][i] == nullptr) {
      if (missing < 0) missing = i;
      continue;
    }
    s.fn = t.fused[layout_id][i];
    s.isa = Isa(i);
    if (missing >= 0) {
      s.fallback = true;
      std::snprintf(s.reason, sizeof(s.reason), "%s: fallback: this build has no %s kernel for layout %s", isa_name(s.isa),
                    isa_name(Isa(missing)), L->name);
      return s;
    }
    if (i < best_host) {
      std::snprintf(s.reason, sizeof(s.reason), "%s: MOEPACK_MAX_ISA=%s lowers the CPU's %s for layout %s",
                    isa_name(s.isa), isa_name(max_isa), isa_name(Isa(best_host)), L->name);
      return s;
    }
    // Best for this CPU: name the next level up that would serve the layout, and why not.
    int next = -1;
    for (int j = i + 1; j < kNumIsa && next < 0; ++j) {
      if (isa_serves(Isa(j), *L)) next = j;
    }
    if (next >= 0) {
      std::snprintf(s.reason, sizeof(s.reason), "%s: best ISA of this CPU for layout %s (%s: %s)", isa_name(s.isa),
                    L->name, isa_name(Isa(next)), unavailable[next]);
    } else {
      std::snprintf(s.reason, sizeof(s.reason), "%s: best ISA of this CPU for layout %s", isa_name(s.isa), L->name);
    }
    return s;
  }
  const char* why = t.refused[layout_id][int(Isa::scalar)];
  std::snprintf(s.reason, sizeof(s.reason), "no kernel is registered for layout %s%s%s", L->name, why ? ": " : "",
                why ? why : "");
  return s;
}

Selection select_fused(int32_t layout_id, Isa max_isa) {
  // The host does not change: its reasons are worked out once (this runs on every op call).
  struct Reasons {
    const char* r[kNumIsa];
  };
  static const Reasons host = [] {
    Reasons x;
    for (int i = 0; i < kNumIsa; ++i) x.r[i] = isa_unavailable_reason(Isa(i));
    return x;
  }();
  return select_kernel(table(), host.r, layout_id, max_isa);
}

Int8BlockGemmFn find_gemm_i8(int32_t layout_id, Isa isa) {
  if (layout_find(layout_id) == nullptr || int(isa) < 0 || int(isa) >= kNumIsa) return nullptr;
  if (isa_unavailable_reason(isa) != nullptr) return nullptr;
  return table().gemm_i8[layout_id][int(isa)];
}

const char* fused_moe_check_routing(const FusedMoeArgs& a, char* buf, size_t n) {
  const int64_t slots = a.tokens * a.topk;
  const int64_t eg = a.expert_map ? a.num_global_experts : a.num_experts;
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t id = a.topk_ids[i];
    if (id < 0 || id >= eg) {
      std::snprintf(buf, n, "topk_ids[%lld, %lld] = %d is out of range: expert ids must be in [0, %lld)",
                    (long long)(i / a.topk), (long long)(i % a.topk), int(id), (long long)eg);
      return buf;
    }
  }
  if (a.expert_map) {
    for (int64_t g = 0; g < a.num_global_experts; ++g) {
      const int32_t l = a.expert_map[g];
      if (l < -1 || l >= a.num_experts) {
        std::snprintf(buf, n, "expert_map[%lld] = %d is out of range: must be -1 (not local) or in [0, %lld)",
                      (long long)g, int(l), (long long)a.num_experts);
        return buf;
      }
    }
  }
  return nullptr;
}

}  // namespace moepack
