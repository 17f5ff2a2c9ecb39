// Kernel selection. Compiled for the baseline target, without any ISA flags (and so never
// executes an instruction the CPU may lack): csrc/<arch>/cpu_features.cpp says what the CPU has
// and the OS saves, kIsaLevels (isa_gen.h, from moepack/isa_levels.py) what each level needs, and
// only then are the ISA translation units' register_* called.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "moepack/kernel.h"

namespace moepack {

const char* isa_name(Isa isa) { return int(isa) >= 0 && int(isa) < kNumIsa ? kIsaLevels[int(isa)].name : "?"; }

#if !MOEPACK_ARCH_KNOWN
// An architecture moepack/isa_levels.py does not list: no features, the scalar level only.
CpuFeatures detect_cpu_features() { return {}; }
const char* cpu_vendor() { return ""; }
#endif

namespace {
struct DecodeStreams {
  bool one = false;
  std::string reason, error;
};
DecodeStreams choose_decode_streams() {
  static constexpr const char* kOne = "one stream per weight block";
  static constexpr const char* kSegments = "4 K segments per weight block at once, 2 from 3 rows";
  DecodeStreams d;
  const char* vendor = cpu_vendor();
  d.one = std::strcmp(vendor, "AuthenticAMD") == 0;
  d.reason = d.one ? std::string(kOne) + " (AMD CPU; MOEPACK_DECODE_STREAMS=4 for several)"
                   : std::string(kSegments) + " (" + (*vendor ? vendor : "this CPU") + "; MOEPACK_DECODE_STREAMS=1 for one stream)";
  const char* v = std::getenv("MOEPACK_DECODE_STREAMS");
  if (v != nullptr && *v != '\0') {
    if (std::strcmp(v, "1") == 0 || std::strcmp(v, "4") == 0) {
      d.one = v[0] == '1';
      d.reason = std::string(d.one ? kOne : kSegments) + " (MOEPACK_DECODE_STREAMS=" + v + ")";
    } else {
      d.error = std::string("MOEPACK_DECODE_STREAMS='") + v +
                "' is not 1 or 4 (1: the decode kernels read each weight block as one stream; 4: as several K "
                "segments at once; unset: chosen by CPU)";
    }
  }
  return d;
}
const DecodeStreams& decode_streams() {
  static const DecodeStreams d = choose_decode_streams();
  return d;
}
int g_decode_override = -1;  // set by tests only, between kernel calls

struct Mx4A16Dot {
  bool fp32 = true;
  std::string reason, error;
};
Mx4A16Dot choose_mx4_a16_dot() {
  static constexpr const char* kF32 = "fp32 FMAs on a vpermps table";
  static constexpr const char* kBf16 = "vdpbf16ps";
  Mx4A16Dot d;
  const char* vendor = cpu_vendor();
  d.fp32 = std::strcmp(vendor, "AuthenticAMD") != 0;
  d.reason = d.fp32 ? std::string(kF32) + " (" + (*vendor ? vendor : "this CPU") + "; MOEPACK_MX4_A16_DOT=bf16 for vdpbf16ps)"
                    : std::string(kBf16) + " (AMD CPU; MOEPACK_MX4_A16_DOT=fp32 for fp32 FMAs)";
  const char* v = std::getenv("MOEPACK_MX4_A16_DOT");
  if (v != nullptr && *v != '\0') {
    if (std::strcmp(v, "fp32") == 0 || std::strcmp(v, "bf16") == 0) {
      d.fp32 = v[0] == 'f';
      d.reason = std::string(d.fp32 ? kF32 : kBf16) + " (MOEPACK_MX4_A16_DOT=" + v + ")";
    } else {
      d.error = std::string("MOEPACK_MX4_A16_DOT='") + v +
                "' is not fp32 or bf16 (the dot product of the mxfp4 W4A16 decode kernels: fp32 FMAs or vdpbf16ps; "
                "unset: chosen by CPU)";
    }
  }
  return d;
}
const Mx4A16Dot& mx4_a16_dot() {
  static const Mx4A16Dot d = choose_mx4_a16_dot();
  return d;
}
int g_mx4_dot_override = -1;  // set by tests only, between kernel calls
}  // namespace

bool decode_one_stream() {
  const int o = __atomic_load_n(&g_decode_override, __ATOMIC_RELAXED);
  if (o >= 0) return o != 0;
  const int8_t v = current_variant().streams;  // the call's variant, where it says
  return v != 0 ? v == 1 : decode_streams().one;
}

// ---- kernel variants (kernel.h Variant; docs/KERNELS.md "Variants and the tuner") ----------------
namespace {
struct VariantEntry {
  Variant v;
  bool set = false;
};
// [layout id][a16, a8][token class]; written by set_variant between calls (the tuner, moepack.open)
VariantEntry g_variants[kMaxLayoutId + 1][2][kNumTokenClasses];
const Variant kDefaultVariant{};
// initial-exec: one load from the thread pointer, no __tls_get_addr call (the kernels read it per block)
__attribute__((tls_model("initial-exec"))) thread_local const Variant* t_variant = nullptr;

bool parse_int(const char* b, const char* e, long lo, long hi, long& out) {
  if (b == e || e - b > 9) return false;
  long v = 0;
  for (const char* p = b; p < e; ++p) {
    if (*p < '0' || *p > '9') return false;
    v = v * 10 + (*p - '0');
  }
  if (v < lo || v > hi) return false;
  out = v;
  return true;
}

struct EnvVariant {
  Variant v;
  bool set = false;
  std::string error;
};
const EnvVariant& env_variant() {
  static const EnvVariant ev = [] {
    EnvVariant r;
    const char* spec = std::getenv("MOEPACK_VARIANT");
    if (spec == nullptr || *spec == '\0') return r;
    char buf[512];
    if (const char* why = parse_variant(spec, r.v, buf, sizeof(buf))) {
      r.error = std::string("MOEPACK_VARIANT: ") + why;
    } else {
      r.set = true;
    }
    return r;
  }();
  return ev;
}
}  // namespace

const char* parse_variant(const char* spec, Variant& out, char* buf, size_t buf_len) {
  Variant v;
  const char* p = spec;
  while (*p != '\0') {
    const char* end = p;
    while (*end != '\0' && *end != ',') ++end;
    const char* eq = p;
    while (eq < end && *eq != '=') ++eq;
    const std::string key(p, eq), val(eq < end ? eq + 1 : end, end);
    const char* vb = eq < end ? eq + 1 : end;
    long n = 0;
    bool ok = eq < end;
    const char* rule = "";
    if (key == "walk") {
      rule = "guided, static or stride";
      if (val == "guided") v.walk = 0;
      else if (val == "static") v.walk = 1;
      else if (val == "stride") v.walk = 2;
      else ok = false;
    } else if (key == "pair") {
      rule = "0 or 1";
      ok = ok && parse_int(vb, end, 0, 1, n);
      v.pair = int8_t(n);
    } else if (key == "streams") {
      rule = "0 (the process's choice), 1 or 4";
      ok = ok && parse_int(vb, end, 0, 4, n) && (n == 0 || n == 1 || n == 4);
      v.streams = int8_t(n);
    } else if (key == "touch") {
      rule = "0..1024 lines";
      ok = ok && parse_int(vb, end, 0, 1024, n);
      v.touch = int16_t(n);
    } else if (key == "pf") {
      rule = "-1 (the kernel's own) or 0..16384 bytes, a multiple of 64";
      if (val == "-1") n = -1;
      else ok = ok && parse_int(vb, end, 0, 16384, n) && n % 64 == 0;
      v.pf = int16_t(n);
    } else if (key == "nta") {
      rule = "0 or 1";
      ok = ok && parse_int(vb, end, 0, 1, n);
      v.nta = int8_t(n);
    } else if (key == "dot") {
      rule = "0 (the process's choice), fp32 or bf16";
      if (val == "0") v.dot = 0;
      else if (val == "fp32") v.dot = 1;
      else if (val == "bf16") v.dot = 2;
      else ok = false;
    } else if (key == "slow") {
      rule = "0..8 (tests only)";
      ok = ok && parse_int(vb, end, 0, 8, n);
      v.slow = int8_t(n);
    } else {
      std::snprintf(buf, buf_len, "'%s' in '%s' is not a variant key (walk, pair, streams, touch, pf, nta, dot, slow)",
                    key.c_str(), spec);
      return buf;
    }
    if (!ok) {
      std::snprintf(buf, buf_len, "%s='%s' in '%s': must be %s", key.c_str(), val.c_str(), spec, rule);
      return buf;
    }
    p = *end == ',' ? end + 1 : end;
  }
  out = v;
  return nullptr;
}

const char* variant_env_error() {
  const EnvVariant& e = env_variant();
  return e.error.empty() ? nullptr : e.error.c_str();
}

Variant variant_for(int32_t layout_id, int32_t act_mode, int64_t tokens) {
  const EnvVariant& e = env_variant();
  if (e.set) return e.v;
  if (layout_id < 0 || layout_id > kMaxLayoutId) return kDefaultVariant;
  const VariantEntry& entry = g_variants[layout_id][act_mode == kAct_a8 ? 1 : 0][token_class(tokens)];
  return entry.set ? entry.v : kDefaultVariant;
}

bool set_variant(int32_t layout_id, int32_t act_mode, int tclass, const Variant& v, bool clear) {
  if (layout_id < 0 || layout_id > kMaxLayoutId || tclass < 0 || tclass >= kNumTokenClasses) return false;
  if (act_mode != kAct_a16 && act_mode != kAct_a8) return false;
  VariantEntry& entry = g_variants[layout_id][act_mode == kAct_a8 ? 1 : 0][tclass];
  entry.v = clear ? kDefaultVariant : v;
  entry.set = !clear;
  return true;
}

const Variant& current_variant() { return t_variant != nullptr ? *t_variant : kDefaultVariant; }
void set_current_variant(const Variant* v) { t_variant = v; }
const char* decode_streams_reason() { return decode_streams().reason.c_str(); }
const char* decode_streams_error() { return decode_streams().error.empty() ? nullptr : decode_streams().error.c_str(); }
void set_decode_one_stream(int one) { __atomic_store_n(&g_decode_override, one < 0 ? -1 : one != 0, __ATOMIC_RELAXED); }

bool mx4_a16_fp32() {
  const int o = __atomic_load_n(&g_mx4_dot_override, __ATOMIC_RELAXED);
  if (o >= 0) return o != 0;
  const int8_t v = current_variant().dot;  // the call's variant, where it says
  return v != 0 ? v == 1 : mx4_a16_dot().fp32;
}
const char* mx4_a16_dot_reason() { return mx4_a16_dot().reason.c_str(); }
const char* mx4_a16_dot_error() { return mx4_a16_dot().error.empty() ? nullptr : mx4_a16_dot().error.c_str(); }
void set_mx4_a16_fp32(int fp32) { __atomic_store_n(&g_mx4_dot_override, fp32 < 0 ? -1 : fp32 != 0, __ATOMIC_RELAXED); }

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect_cpu_features();
  return f;
}

const char* isa_unavailable_reason(Isa isa) {
  if (int(isa) < 0 || int(isa) >= kNumIsa) return "unknown ISA";
  const IsaLevel& v = kIsaLevels[int(isa)];
  if (!v.built) return v.not_built;
  const CpuFeatures& f = cpu_features();
  for (const IsaNeed& n : v.needs) {
    if (n.reason == nullptr) break;
    for (bool CpuFeatures::*m : n.features) {
      if (m != nullptr && !(f.*m)) return n.reason;
    }
  }
  return nullptr;
}

bool isa_serves(Isa isa, const LayoutDesc& L, int32_t act_mode) {
  if (int(isa) < 0 || int(isa) >= kNumIsa) return false;
  const IsaLevel& v = kIsaLevels[int(isa)];
  if (v.family >= 0 && L.family != v.family) return false;
  if (act_mode == 0) act_mode = layout_default_act(L);
  return v.serves == 0 || ((v.serves >> (2 * L.weight_dtype + act_index(act_mode))) & 1u) != 0;
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
    if (std::strcmp(v, isa_name(Isa(i))) != 0) continue;
    if (!kIsaLevels[i].built) {  // another architecture's level: it would lower nothing (or everything)
      std::string mine;
      for (int j = 0; j < kNumIsa; ++j) {
        if (kIsaLevels[j].built) mine += std::string(mine.empty() ? "" : ", ") + isa_name(Isa(j));
      }
      throw std::invalid_argument(std::string("MOEPACK_MAX_ISA='") + v + "' is a level of another architecture (" +
                                  kIsaLevels[i].not_built + "): it can only lower this machine's levels (" + mine + ")");
    }
    return Isa(i);
  }
  throw std::invalid_argument(std::string("MOEPACK_MAX_ISA='") + v + "' is not one of " + kIsaNames +
                              " (it can only lower the ISA level moepack uses)");
}

static const KernelTable& table() {
  static const KernelTable t = [] {
    KernelTable k;
    // scalar and the levels of the architecture this build is for (MOEPACK_BUILT_ISA_LEVELS)
#define MOEPACK_REGISTER(isa) \
  if (!isa_unavailable_reason(Isa::isa)) register_##isa(k);
    MOEPACK_BUILT_ISA_LEVELS(MOEPACK_REGISTER)
#undef MOEPACK_REGISTER
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

static const char* act_name(int32_t m) { return m == kAct_a8 ? "a8" : "a16"; }

Selection select_kernel(const KernelTable& t, const char* const unavailable[kNumIsa], int32_t layout_id, Isa max_isa,
                        int32_t act_mode) {
  Selection s;
  const LayoutDesc* L = layout_find(layout_id);
  if (L == nullptr) {
    std::snprintf(s.reason, sizeof(s.reason), "layout id %d is unknown to this build", int(layout_id));
    return s;
  }
  if (act_mode == 0) act_mode = layout_default_act(*L);
  if ((act_mode != kAct_a16 && act_mode != kAct_a8) || !(L->act_modes & act_mode)) {
    std::snprintf(s.reason, sizeof(s.reason), "act_mode %d: layout %s runs with %s%s%s activations", int(act_mode),
                  L->name, (L->act_modes & kAct_a16) ? "a16" : "", (L->act_modes & kAct_a16) && (L->act_modes & kAct_a8) ? " or " : "",
                  (L->act_modes & kAct_a8) ? "a8" : "");
    return s;
  }
  const int m = act_index(act_mode);
  int best_host = -1;  // best level the host has that serves the layout (ignoring the cap)
  int missing = -1;    // best allowed, available, serving level that has no kernel
  for (int i = kNumIsa - 1; i >= 0; --i) {
    if (!isa_serves(Isa(i), *L, act_mode) || unavailable[i] != nullptr) continue;
    if (best_host < 0) best_host = i;
    if (i > int(max_isa)) continue;
    if (t.fused[layout_id][m][i] == nullptr) {
      if (missing < 0) missing = i;
      continue;
    }
    s.fn = t.fused[layout_id][m][i];
    s.isa = Isa(i);
    if (missing >= 0) {
      s.fallback = true;
      const char* why = t.refused[layout_id][m][missing];
      std::snprintf(s.reason, sizeof(s.reason), "%s: fallback: this build has no %s kernel for layout %s (%s)%s%s",
                    isa_name(s.isa), isa_name(Isa(missing)), L->name, act_name(act_mode),
                    *why ? ": its kernel file refused it: " : "", why);
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
      if (isa_serves(Isa(j), *L, act_mode)) next = j;
    }
    if (next >= 0) {
      std::snprintf(s.reason, sizeof(s.reason), "%s: best ISA of this CPU for layout %s (%s: %s)", isa_name(s.isa),
                    L->name, isa_name(Isa(next)), unavailable[next]);
    } else {
      std::snprintf(s.reason, sizeof(s.reason), "%s: best ISA of this CPU for layout %s", isa_name(s.isa), L->name);
    }
    return s;
  }
  const char* why = t.refused[layout_id][m][int(Isa::scalar)];
  std::snprintf(s.reason, sizeof(s.reason), "no kernel is registered for layout %s (%s)%s%s", L->name, act_name(act_mode),
                *why ? ": " : "", why);
  return s;
}

Selection select_fused(int32_t layout_id, Isa max_isa, int32_t act_mode) {
  // The host does not change: its reasons are worked out once (this runs on every op call).
  struct Reasons {
    const char* r[kNumIsa];
  };
  static const Reasons host = [] {
    Reasons x;
    for (int i = 0; i < kNumIsa; ++i) x.r[i] = isa_unavailable_reason(Isa(i));
    return x;
  }();
  return select_kernel(table(), host.r, layout_id, max_isa, act_mode);
}

uint8_t variant_knobs(int32_t layout_id, int32_t act_mode, Isa max_isa) {
  const LayoutDesc* L = layout_find(layout_id);
  if (L == nullptr) return 0;
  const int32_t mode = act_mode ? act_mode : layout_default_act(*L);
  const Selection sel = select_fused(layout_id, max_isa, mode);
  if (sel.fn == nullptr) return 0;
  return table().knobs[layout_id][act_index(mode)][int(sel.isa)];
}

Int8BlockGemmFn find_gemm_i8(int32_t layout_id, Isa isa) {
  if (layout_find(layout_id) == nullptr || int(isa) < 0 || int(isa) >= kNumIsa) return nullptr;
  if (isa_unavailable_reason(isa) != nullptr) return nullptr;
  return table().gemm_i8[layout_id][int(isa)];
}

U4BlockDotFn find_dot_u4(int32_t layout_id, Isa isa) {
  if (layout_find(layout_id) == nullptr || int(isa) < 0 || int(isa) >= kNumIsa) return nullptr;
  if (isa_unavailable_reason(isa) != nullptr) return nullptr;
  return table().dot_u4[layout_id][int(isa)];
}

GroupedBlockFn find_grouped_block(int32_t layout_id, Isa isa, int32_t act_mode) {
  if (layout_find(layout_id) == nullptr || int(isa) < 0 || int(isa) >= kNumIsa) return nullptr;
  if (isa_unavailable_reason(isa) != nullptr) return nullptr;
  return table().grouped_block[layout_id][act_index(act_mode)][int(isa)];
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
