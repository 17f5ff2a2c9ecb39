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
#include <thread>
#include <array>
#include <vector>

#include "moepack/kernel.h"
#include "moepack/numeric.h"
#include "../../csrc/kernels/mk_hooks.h"

// tests/cpp/build.py defines MOEPACK_TEST_REGISTRARS(X): one X(label, register function, level,
// level the host needs to run it) per kernel object it links (moe_L.cpp natively, through SIMDe,
// and natively again with -Dregister_L=register_L_native), from moepack/isa_levels.py.
#ifndef MOEPACK_TEST_REGISTRARS
#error "build with tests/cpp/build.py: it defines MOEPACK_TEST_REGISTRARS(X), the kernel objects it links"
#endif

namespace moepack {
#define MOEPACK_DECLARE_LINKED(label, fn, level, host) void fn(KernelTable& t);
MOEPACK_TEST_REGISTRARS(MOEPACK_DECLARE_LINKED)
#undef MOEPACK_DECLARE_LINKED
}  // namespace moepack

using namespace moepack;

namespace {

// ---- bookkeeping ---------------------------------------------------------------------------
int g_pass = 0, g_fail = 0;
bool g_verbose = false;

void check(bool ok, const char* fmt, ...) {
  if (ok) {
    ++g_pass;
  } else {
    ++g_fail;
  }
  if (!ok || g_verbose) {
    std::printf("%s ", ok ? "ok  " : "FAIL");
    va_list ap;
    va_start(ap, fmt);
    std::vprintf(fmt, ap);
    va_end(ap);
    std::printf("\n");
    std::fflush(stdout);
  }
}

const char* dtype_name(DType d) { return d == DType::f32 ? "f32" : d == DType::bf16 ? "bf16" : "f16"; }
const char* act_name(Activation a) {
  switch (a) {
    case Activation::silu: return "silu";
    case Activation::gelu: return "gelu";
    case Activation::gelu_tanh: return "gelu_tanh";
    case Activation::swigluoai: return "swigluoai";
  }
  return "?";
}

// Tolerances (relative norm ||out - ref|| / ||ref||).
constexpr double kTolSimdF32 = 1e-6;     // SIMD vs scalar, fp32 outputs (SEMANTICS §4)
constexpr double kTolSimdHalf = 2e-3;    // SIMD vs scalar, bf16/fp16 outputs
constexpr double kTolRefF32 = 1e-5;      // scalar vs naive double reference, fp32
constexpr double kTolRefHalf = 2e-3;     // scalar vs naive double reference, bf16/fp16
// bf16/fp16: the intermediate is rounded to the activation dtype, and a value within an fp32
// ulp of a rounding tie flips by one bf16/fp16 ulp between two correct kernels. With few rows
// (T = 1, k = 1) one such flip of a large intermediate moves the whole output by up to ~2^-7
// relative, so half-dtype cases also accept up to kFlips times the largest single-flip effect
// (computed by the reference from the case's own data: max over slots s and columns i of
// |w_s| * ulp(a_si) * ||w2[e_s][:, i]|| / ||out||). For T = 67 this allowance is far below the
// base tolerance.
constexpr double kFlips = 2.0;

struct ErrStat {
  double max_rel = 0, max_worst = 0;  // worst = max |a - b| / max |b|
  int cases = 0;
  int differing_cases = 0;  // cases with any bit difference
};
std::map<std::string, ErrStat> g_stats;
std::map<std::string, double> g_kernel_seconds;
int g_allowance_used = 0;  // comparisons above the base tolerance (accepted or not)

// ---- kernels under test ----------------------------------------------------------------------
struct Kernel {
  std::string name;
  FusedMoeFn fn;
};

// Every kernel object linked into this binary that this CPU can run: name, register function, level.
struct Registrar {
  std::string name;
  void (*reg)(KernelTable&);
  Isa isa;
};

std::vector<Registrar> find_registrars() {
  struct Linked {
    Registrar r;
    Isa host;  // an emulated object runs native code of this level around the emulated instructions
  };
  const std::vector<Linked> linked = {
#define MOEPACK_LINKED(label, fn, level, host) {{label, fn, Isa::level}, Isa::host},
      MOEPACK_TEST_REGISTRARS(MOEPACK_LINKED)
#undef MOEPACK_LINKED
  };
  std::vector<Registrar> out;
  for (const Linked& l : linked) {
    if (const char* why = isa_unavailable_reason(l.host)) {
      std::printf("note: %s kernel not run: it needs %s and %s\n", l.r.name.c_str(), isa_name(l.host), why);
    } else {
      out.push_back(l.r);
    }
  }
  return out;
}

const std::vector<Registrar>& runnable_registrars() {
  static const std::vector<Registrar> v = find_registrars();
  return v;
}

std::vector<Kernel> g_simd;  // everything but scalar (bf16 layout)
FusedMoeFn g_scalar = nullptr;

void collect_kernels() {
  const int L = kLayoutId_bf16_n32k2_x86;
  {
    KernelTable t;
    register_scalar(t);
    g_scalar = t.fused[L][0][int(Isa::scalar)];
  }
  for (const Registrar& r : runnable_registrars()) {
    KernelTable t;
    r.reg(t);
    if (t.fused[L][0][int(r.isa)]) g_simd.push_back({r.name, t.fused[L][0][int(r.isa)]});
    check(isa_serves(r.isa, kLayout_bf16_n32k2_x86, kAct_a16) == (t.fused[L][0][int(r.isa)] != nullptr),
          "%s registers a bf16 kernel exactly when its level serves bf16 layouts", r.name.c_str());
  }
  std::printf("kernels:");
  for (const Kernel& k : g_simd) std::printf(" %s", k.name.c_str());
  std::printf("  (each vs scalar)\n");
}

// ---- parallel-for variants -------------------------------------------------------------------
// 0: serial (run = nullptr); 1: two parts run one after the other; 2: two parts on two threads.
void run_split_seq(void*, int64_t n, ParallelBody body, void* ctx) {
  const int64_t mid = n / 2;
  if (mid > 0) body(ctx, 0, mid);
  body(ctx, mid, n);
}
void run_threads2(void*, int64_t n, ParallelBody body, void* ctx) {
  const int64_t mid = n / 2;
  if (mid == 0) {
    body(ctx, 0, n);
    return;
  }
  std::thread th(body, ctx, mid, n);
  body(ctx, 0, mid);
  th.join();
}
Parallel make_parallel(int mode) {
  Parallel p;
  if (mode == 1) {
    p.run = run_split_seq;
    p.num_threads = 3;
  } else if (mode == 2) {
    p.run = run_threads2;
    p.num_threads = 2;
  }
  return p;
}
const char* par_name(int mode) { return mode == 0 ? "serial" : mode == 1 ? "split2" : "threads2"; }

// ---- dtype helpers ---------------------------------------------------------------------------
float round_to(DType d, float v) {
  if (d == DType::bf16) return round_bf16(v);
  if (d == DType::f16) return round_f16(v);
  return v;
}
float load_elem(DType d, const void* p, int64_t i) {
  if (d == DType::f32) return static_cast<const float*>(p)[i];
  const uint16_t v = static_cast<const uint16_t*>(p)[i];
  return d == DType::bf16 ? bf16_to_f32(v) : f16_to_f32(v);
}
void store_elem(DType d, void* p, int64_t i, float v) {
  if (d == DType::f32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = d == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
  }
}
size_t elem_size(DType d) { return d == DType::f32 ? 4 : 2; }

// ---- one problem -----------------------------------------------------------------------------
struct Case {
  int T, H, I, E, k;
  Activation act;
  DType dt;
  bool bias;
  bool emap;  // expert_map with -1 entries (E_global = E + 3)
  int par;
  int x_pad;  // x_stride = H + x_pad
  float alpha = 1.702f, limit = 7.0f;
  uint64_t seed = 1;
};

std::string case_name(const Case& c) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "T=%d H=%d I=%d E=%d k=%d %s %s%s%s %s%s", c.T, c.H, c.I, c.E, c.k,
                act_name(c.act), dtype_name(c.dt), c.bias ? " bias" : "", c.emap ? " emap" : "", par_name(c.par),
                c.x_pad ? " xpad" : "");
  std::string s = buf;
  if (c.act == Activation::swigluoai) {
    std::snprintf(buf, sizeof(buf), " alpha=%g limit=%g", c.alpha, c.limit);
    s += buf;
  }
  return s;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct Problem {
  Case c;
  const LayoutDesc* L = &kLayout_bf16_n32k2_x86;
  int Eg, Ip, Kp, Np;
  int64_t x_stride;
  bool inter;
  std::vector<float> w13c, w2c, b13c, b2c;  // canonical [E][2I][H], [E][H][I], [E][2I], [E][H]
  std::vector<uint16_t> w13p, w2p;          // packed
  std::vector<float> b13p, b2p;             // packed row order [E][2Ip], [E][Np]
  std::vector<uint8_t> x;                   // [T][x_stride] in dtype
  std::vector<float> tw;
  std::vector<int32_t> ids, emap;
};

void build(Problem& p, const Case& c) {
  p.c = c;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.05f, 1.0f);
  const int E = c.E, H = c.H, I = c.I;
  p.Ip = int(round_up(I, p.L->i_align));
  p.Kp = int(round_up(H, p.L->k_pack));
  p.Np = int(round_up(H, p.L->block_n));
  p.inter = c.act == Activation::swigluoai;
  p.x_stride = H + c.x_pad;
  const int Ip = p.Ip, Kp = p.Kp, Np = p.Np;

  // canonical weights, bf16-valued; h ~ N(0, 1.5^2) so the activations see their curved parts
  p.w13c.resize(size_t(E) * 2 * I * H);
  p.w2c.resize(size_t(E) * H * I);
  const float s13 = 1.5f / std::sqrt(float(H)), s2 = 1.0f / std::sqrt(float(I));
  for (float& v : p.w13c) v = round_bf16(nd(rng) * s13);
  for (float& v : p.w2c) v = round_bf16(nd(rng) * s2);
  if (c.bias) {
    p.b13c.resize(size_t(E) * 2 * I);
    p.b2c.resize(size_t(E) * H);
    for (float& v : p.b13c) v = 0.5f * nd(rng);
    for (float& v : p.b2c) v = 0.1f * nd(rng);
  }

  // padded canonical matrices -> packed. Non-interleaved: gate rows [0, I) at [0, I), up rows
  // [I, 2I) at [Ip, Ip + I). Interleaved (swigluoai): pairs stay in place, padding pairs at the end.
  auto packed_row = [&](int r) { return p.inter ? r : (r < I ? r : Ip + (r - I)); };
  p.w13p.assign(size_t(E) * 2 * Ip * Kp, 0xffff);
  p.w2p.assign(size_t(E) * Np * Ip, 0xffff);
  std::vector<float> pad13(size_t(2) * Ip * H), pad2(size_t(H) * Ip);
  std::vector<uint16_t> bits;
  for (int e = 0; e < E; ++e) {
    std::fill(pad13.begin(), pad13.end(), 0.0f);
    for (int r = 0; r < 2 * I; ++r)
      std::memcpy(&pad13[size_t(packed_row(r)) * H], &p.w13c[(size_t(e) * 2 * I + r) * H], size_t(H) * 4);
    std::fill(pad2.begin(), pad2.end(), 0.0f);
    for (int n = 0; n < H; ++n)
      std::memcpy(&pad2[size_t(n) * Ip], &p.w2c[(size_t(e) * H + n) * I], size_t(I) * 4);
    // pack from fp32 for odd experts, from bf16 bits for even ones (same bytes: values are bf16)
    if (e % 2 == 0) {
      bits.resize(pad13.size());
      for (size_t i = 0; i < pad13.size(); ++i) bits[i] = f32_to_bf16(pad13[i]);
      pack_matrix_bf16(bits.data(), DType::bf16, 2 * Ip, H, 2 * Ip, Kp, *p.L, &p.w13p[size_t(e) * 2 * Ip * Kp]);
      bits.resize(pad2.size());
      for (size_t i = 0; i < pad2.size(); ++i) bits[i] = f32_to_bf16(pad2[i]);
      pack_matrix_bf16(bits.data(), DType::bf16, H, Ip, Np, Ip, *p.L, &p.w2p[size_t(e) * Np * Ip]);
    } else {
      pack_matrix_bf16(pad13.data(), DType::f32, 2 * Ip, H, 2 * Ip, Kp, *p.L, &p.w13p[size_t(e) * 2 * Ip * Kp]);
      pack_matrix_bf16(pad2.data(), DType::f32, H, Ip, Np, Ip, *p.L, &p.w2p[size_t(e) * Np * Ip]);
    }
  }
  if (c.bias) {
    p.b13p.assign(size_t(E) * 2 * Ip, 0.0f);
    p.b2p.assign(size_t(E) * Np, 0.0f);
    for (int e = 0; e < E; ++e) {
      for (int r = 0; r < 2 * I; ++r) p.b13p[size_t(e) * 2 * Ip + packed_row(r)] = p.b13c[size_t(e) * 2 * I + r];
      for (int n = 0; n < H; ++n) p.b2p[size_t(e) * Np + n] = p.b2c[size_t(e) * H + n];
    }
  }

  // activations x ~ N(0, 1) in dtype; the row padding (x_stride > H) holds NaN: never read
  p.x.resize(size_t(c.T) * p.x_stride * elem_size(c.dt));
  for (int t = 0; t < c.T; ++t) {
    for (int64_t h = 0; h < p.x_stride; ++h) {
      store_elem(c.dt, p.x.data(), t * p.x_stride + h, h < H ? nd(rng) : NAN);
    }
  }

  // routing: k distinct global experts per token, weights in (0.05, 1)
  p.Eg = c.emap ? E + 3 : E;
  if (c.emap) {
    std::vector<int32_t> g(p.Eg);
    for (int i = 0; i < p.Eg; ++i) g[i] = i;
    std::shuffle(g.begin(), g.end(), rng);
    p.emap.assign(p.Eg, -1);
    for (int l = 0; l < E; ++l) p.emap[g[l]] = l;  // E globals are local (shuffled), 3 are not
  }
  p.ids.resize(size_t(c.T) * c.k);
  p.tw.resize(size_t(c.T) * c.k);
  std::vector<int32_t> perm(p.Eg);
  for (int t = 0; t < c.T; ++t) {
    for (int i = 0; i < p.Eg; ++i) perm[i] = i;
    for (int j = 0; j < c.k; ++j) {
      std::uniform_int_distribution<int> pick(j, p.Eg - 1);
      std::swap(perm[j], perm[pick(rng)]);
      p.ids[size_t(t) * c.k + j] = perm[j];
      p.tw[size_t(t) * c.k + j] = ud(rng);
    }
  }
}

// The fields every hand-built call below sets alike: contiguous input rows x [T, H] of dtype dt,
// T x k routed slots over E experts (all local), the layout and its padded intermediate.
FusedMoeArgs call_args(const void* x, DType dt, int T, int H, const float* tw, const int32_t* ids, int k, int E, int Ip,
                       const LayoutDesc& L) {
  FusedMoeArgs a;
  a.x = x;
  a.x_stride = H;
  a.dtype = dt;
  a.tokens = T;
  a.hidden = H;
  a.topk_weights = tw;
  a.topk_ids = ids;
  a.topk = k;
  a.num_global_experts = E;
  a.num_experts = E;
  a.inter_padded = Ip;
  a.layout = &L;
  return a;
}

FusedMoeArgs make_args(const Problem& p, void* out) {
  const Case& c = p.c;
  FusedMoeArgs a;
  a.x = p.x.data();
  a.x_stride = p.x_stride;
  a.out = out;
  a.dtype = c.dt;
  a.tokens = c.T;
  a.hidden = c.H;
  a.w13.t[0] = p.w13p.data();
  a.w2.t[0] = p.w2p.data();
  a.interleaved = p.inter;
  a.b13 = c.bias ? p.b13p.data() : nullptr;
  a.b2 = c.bias ? p.b2p.data() : nullptr;
  a.topk_weights = p.tw.data();
  a.topk_ids = p.ids.data();
  a.topk = c.k;
  a.expert_map = c.emap ? p.emap.data() : nullptr;
  a.num_global_experts = p.Eg;
  a.num_experts = c.E;
  a.inter_padded = p.Ip;
  a.layout = p.L;
  a.act = c.act;
  a.alpha = c.alpha;
  a.limit = c.limit;
  a.par = make_parallel(c.par);
  return a;
}

// Naive reference in double from the canonical (unpadded, unpacked) weights, with the
// SEMANTICS §2 rounding points: fp32 h, activation in fp32, intermediate rounded to the
// activation dtype, fp32 y, combine in slot order, one cast.
double ulp_of(DType d, float v) {
  if (d == DType::f32 || v == 0.0f) return 0.0;
  int ex;
  std::frexp(v, &ex);  // |v| in [2^(ex-1), 2^ex)
  return d == DType::bf16 ? std::ldexp(1.0, ex - 8) : std::ldexp(1.0, std::max(ex - 11, -24));
}

// `flip` (out): the largest output change (2-norm) one intermediate flip by one ulp can cause.
std::vector<float> reference(const Problem& p, double& flip) {
  const Case& c = p.c;
  const int H = c.H, I = c.I;
  std::vector<double> colnorm(size_t(c.E) * I, 0.0);  // ||w2[e][:, i]||
  for (int e = 0; e < c.E; ++e)
    for (int n = 0; n < H; ++n)
      for (int i = 0; i < I; ++i) colnorm[size_t(e) * I + i] += double(p.w2c[(size_t(e) * H + n) * I + i]) * p.w2c[(size_t(e) * H + n) * I + i];
  for (double& v : colnorm) v = std::sqrt(v);
  flip = 0.0;
  std::vector<float> out(size_t(c.T) * H);
  std::vector<float> xf(H), h(2 * I), act(I);
  std::vector<double> acc(H);
  for (int t = 0; t < c.T; ++t) {
    for (int i = 0; i < H; ++i) xf[i] = load_elem(c.dt, p.x.data(), t * p.x_stride + i);
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j < c.k; ++j) {
      const int g = p.ids[size_t(t) * c.k + j];
      const int e = c.emap ? p.emap[g] : g;
      if (e < 0) continue;
      for (int r = 0; r < 2 * I; ++r) {
        double s = 0;
        const float* w = &p.w13c[(size_t(e) * 2 * I + r) * H];
        for (int i = 0; i < H; ++i) s += double(xf[i]) * double(w[i]);
        h[r] = float(s) + (c.bias ? p.b13c[size_t(e) * 2 * I + r] : 0.0f);
      }
      for (int i = 0; i < I; ++i) {
        const float gt = p.inter ? h[2 * i] : h[i], up = p.inter ? h[2 * i + 1] : h[I + i];
        float a = 0;
        switch (c.act) {
          case Activation::silu: a = act_silu(gt, up); break;
          case Activation::gelu: a = act_gelu(gt, up); break;
          case Activation::gelu_tanh: a = act_gelu_tanh(gt, up); break;
          case Activation::swigluoai: a = act_swigluoai(gt, up, c.alpha, c.limit); break;
        }
        act[i] = round_to(c.dt, a);
      }
      const float wt = p.tw[size_t(t) * c.k + j];
      for (int i = 0; i < I; ++i) flip = std::max(flip, double(wt) * ulp_of(c.dt, act[i]) * colnorm[size_t(e) * I + i]);
      for (int n = 0; n < H; ++n) {
        double s = 0;
        const float* w = &p.w2c[(size_t(e) * H + n) * I];
        for (int i = 0; i < I; ++i) s += double(act[i]) * double(w[i]);
        const float y = float(s) + (c.bias ? p.b2c[size_t(e) * H + n] : 0.0f);
        acc[n] += double(wt) * double(y);
      }
    }
    for (int n = 0; n < H; ++n) out[size_t(t) * H + n] = round_to(c.dt, float(acc[n]));
  }
  return out;
}

// Runs one kernel into a NaN-poisoned buffer with a guard tail; returns the output as fp32.
// `ok` false (and `why` set) when an element was not written or the guard was touched.
constexpr int kGuard = 64;
std::vector<float> run_kernel(const Problem& p, FusedMoeFn fn, const std::string& kname, bool& ok, std::string& why) {
  const Case& c = p.c;
  const size_t n = size_t(c.T) * c.H, es = elem_size(c.dt);
  std::vector<uint8_t> buf((n + kGuard) * es);
  // poison: quiet NaN with a payload (fp32 0x7fc0dead, bf16 0x7fc5, f16 0x7e05)
  for (size_t i = 0; i < n + kGuard; ++i) {
    if (es == 4) {
      const uint32_t v = 0x7fc0deadu;
      std::memcpy(&buf[i * 4], &v, 4);
    } else {
      const uint16_t v = c.dt == DType::bf16 ? 0x7fc5 : 0x7e05;
      std::memcpy(&buf[i * 2], &v, 2);
    }
  }
  const std::vector<uint8_t> guard_before(buf.begin() + n * es, buf.end());
  FusedMoeArgs a = make_args(p, buf.data());
  char msg[256];
  if (const char* bad = fused_moe_check_routing(a, msg, sizeof(msg))) {
    ok = false;
    why = std::string("routing rejected: ") + bad;
    return {};
  }
  const auto t0 = std::chrono::steady_clock::now();
  fn(a);
  g_kernel_seconds[kname] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<float> out(n);
  size_t nan_count = 0, first_nan = 0;
  for (size_t i = 0; i < n; ++i) {
    out[i] = load_elem(c.dt, buf.data(), int64_t(i));
    if (std::isnan(out[i]) && nan_count++ == 0) first_nan = i;
  }
  ok = true;
  if (nan_count) {
    ok = false;
    char b[160];
    std::snprintf(b, sizeof(b), "%zu output elements not written / NaN (first at t=%zu h=%zu)", nan_count,
                  first_nan / c.H, first_nan % c.H);
    why = b;
  }
  if (std::memcmp(guard_before.data(), buf.data() + n * es, guard_before.size()) != 0) {
    ok = false;
    why += (why.empty() ? "" : "; ");
    why += "wrote past out[T, H]";
  }
  return out;
}

struct Cmp {
  double rel, worst, norm;
  size_t ndiff;
  size_t worst_i;
};
Cmp compare(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0, maxdiff = 0, maxref = 0;
  size_t ndiff = 0, wi = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(got[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * ref[i];
    if (got[i] != ref[i]) ++ndiff;
    if (std::fabs(d) > maxdiff) {
      maxdiff = std::fabs(d);
      wi = i;
    }
    maxref = std::fmax(maxref, std::fabs(double(ref[i])));
  }
  Cmp c;
  c.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  c.worst = maxref > 0 ? maxdiff / maxref : maxdiff;
  c.norm = std::sqrt(den);
  c.ndiff = ndiff;
  c.worst_i = wi;
  return c;
}

void record(const std::string& key, const Cmp& m) {
  ErrStat& s = g_stats[key];
  s.max_rel = std::fmax(s.max_rel, m.rel);
  s.max_worst = std::fmax(s.max_worst, m.worst);
  s.cases++;
  if (m.ndiff) s.differing_cases++;
}

// GEMM row-count coverage (row chunks per task, per row format): which tile remainders ran.
std::map<int, int> g_rows_bf16, g_rows_f32;
void note_row_counts(const Problem& p) {
  std::vector<int> cnt(p.c.E, 0);
  for (int32_t g : p.ids) {
    const int e = p.c.emap ? p.emap[g] : g;
    if (e >= 0) cnt[e]++;
  }
  for (int n : cnt) {
    for (int r = 0; r < n; r += 64) {
      const int m = n - r < 64 ? n - r : 64;
      (p.c.dt == DType::bf16 ? g_rows_bf16 : g_rows_f32)[m]++;
    }
  }
}

// Decode-sized calls (T <= 4 tokens: at most 4 rows per expert, the stream kernels) run under
// both decode-stream choices (set_decode_one_stream: several K segments, one stream); larger
// calls once, under the process's own choice.
std::vector<int> decode_stream_modes(int T) { return T <= 4 ? std::vector<int>{0, 1} : std::vector<int>{-1}; }
std::string stream_mode_suffix(int one) { return one < 0 ? "" : one ? " [1 stream]" : " [K segments]"; }

// The decode-stream choice: the test override and back; without MOEPACK_DECODE_STREAMS the
// process's choice is the vendor rule (AMD: one stream).
void test_decode_streams() {
  set_decode_one_stream(1);
  const bool forced_one = decode_one_stream();
  set_decode_one_stream(0);
  const bool forced_many = !decode_one_stream();
  set_decode_one_stream(-1);
  check(forced_one && forced_many, "set_decode_one_stream(1 / 0) forces one stream / K segments");
  const char* env = std::getenv("MOEPACK_DECODE_STREAMS");
  if (env == nullptr || *env == '\0') {
    const bool amd = std::strcmp(cpu_vendor(), "AuthenticAMD") == 0;
    check(decode_one_stream() == amd && decode_streams_error() == nullptr,
          "decode streams by vendor '%s': %s (%s)", cpu_vendor(), decode_one_stream() ? "one" : "several",
          decode_streams_reason());
  }
}

void run_case(const Case& c) {
  Problem p;
  build(p, c);
  note_row_counts(p);
  const std::string name = case_name(c);
  const bool half = c.dt != DType::f32;

  bool ok;
  std::string why;
  const std::vector<float> scal = run_kernel(p, g_scalar, "scalar", ok, why);
  if (!ok) {
    check(false, "scalar %s: %s", name.c_str(), why.c_str());
    return;
  }
  double flip = 0.0;
  const std::vector<float> ref = reference(p, flip);
  // tolerance allowance for intermediate rounding flips (bf16/fp16 only; see kFlips)
  const double allow = half ? kFlips * flip / std::max(compare(ref, ref).norm, 1e-30) : 0.0;
  {
    const Cmp m = compare(scal, ref);
    record(std::string("scalar vs naive/") + dtype_name(c.dt), m);
    const double tol = half ? std::max(kTolRefHalf, allow) : kTolRefF32;
    if (m.rel > (half ? kTolRefHalf : kTolRefF32)) g_allowance_used++;
    check(m.rel <= tol, "scalar vs naive  %s: rel %.3g (tol %.2g) worst %.3g at t=%zu h=%zu (%g vs %g)", name.c_str(),
          m.rel, tol, m.worst, m.worst_i / c.H, m.worst_i % c.H, scal.empty() ? 0.0 : scal[m.worst_i],
          ref.empty() ? 0.0 : ref[m.worst_i]);
  }
  for (const Kernel& k : g_simd) {
    for (const int one : decode_stream_modes(c.T)) {
      set_decode_one_stream(one);
      const std::vector<float> got = run_kernel(p, k.fn, k.name, ok, why);
      set_decode_one_stream(-1);
      const std::string kn = k.name + stream_mode_suffix(one);
      if (!ok) {
        check(false, "%-10s %s: %s", kn.c_str(), name.c_str(), why.c_str());
        continue;
      }
      const Cmp m = compare(got, scal);
      record(k.name + "/" + dtype_name(c.dt), m);
      const double tol = half ? std::max(kTolSimdHalf, allow) : kTolSimdF32;
      if (m.rel > (half ? kTolSimdHalf : kTolSimdF32)) g_allowance_used++;
      check(m.rel <= tol, "%-10s %s: rel %.3g (tol %.2g) worst %.3g at t=%zu h=%zu (%g vs scalar %g), %zu/%zu differ",
            kn.c_str(), name.c_str(), m.rel, tol, m.worst, m.worst_i / c.H, m.worst_i % c.H,
            got.empty() ? 0.0 : got[m.worst_i], scal.empty() ? 0.0 : scal[m.worst_i], m.ndiff, got.size());
    }
  }
}

// ---- pack_matrix_bf16 against the layout formula ---------------------------------------------
void test_pack() {
  const LayoutDesc& L = kLayout_bf16_n32k2_x86;
  check(L.block_n == 32 && L.k_pack == 2, "layout bf16_n32k2_x86 is block_n 32, k_pack 2 (got %d, %d)", L.block_n,
        L.k_pack);
  // 35 rows (a full and a partial block), 5 columns (odd K: padded to 6); values 1..175 are exact
  // in bf16 and f16.
  const int n = 35, k = 5, np = 64, kp = 6;
  std::vector<float> f(n * k);
  std::vector<uint16_t> b(n * k), h(n * k);
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k; ++c) {
      f[r * k + c] = float(1 + r * k + c);
      b[r * k + c] = f32_to_bf16(f[r * k + c]);
      h[r * k + c] = f32_to_f16(f[r * k + c]);
    }
  std::vector<uint16_t> d32(np * kp, 0xabcd), d16(np * kp, 0xabcd), dh(np * kp, 0xabcd);
  pack_matrix_bf16(f.data(), DType::f32, n, k, np, kp, L, d32.data());
  pack_matrix_bf16(b.data(), DType::bf16, n, k, np, kp, L, d16.data());
  pack_matrix_bf16(h.data(), DType::f16, n, k, np, kp, L, dh.data());
  std::vector<int> expect(np * kp, 0);  // 0 = padding
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k; ++c) expect[(r / 32) * 32 * kp + (c / 2) * 64 + (r % 32) * 2 + c % 2] = 1 + r * k + c;
  int bad = 0, first = -1;
  for (int i = 0; i < np * kp; ++i) {
    const uint16_t want = expect[i] ? f32_to_bf16(float(expect[i])) : 0;
    if (d32[i] != want) {
      if (bad++ == 0) first = i;
    }
  }
  check(bad == 0, "pack_matrix_bf16 35x5 -> [64, 6] matches (n/32)*32*Kp + (k/2)*64 + (n%%32)*2 + k%%2, zero padding "
        "(%d wrong, first at %d: 0x%04x)", bad, first, first >= 0 ? d32[first] : 0);
  check(d16 == d32, "pack_matrix_bf16: bf16 source packs to the same bytes as fp32");
  check(dh == d32, "pack_matrix_bf16: f16 source packs to the same bytes as fp32");

  // fp32 -> bf16 is round-to-nearest-even: 1 + 2^-8 -> 1.0, 1 + 3*2^-8 -> 1 + 2^-6, -(1 + 2^-8 + 2^-20) -> -(1 + 2^-7)
  const float v[4] = {1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8),
                      -(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0.0f};
  std::vector<uint16_t> d(32 * 4, 0xabcd);
  pack_matrix_bf16(v, DType::f32, 1, 4, 32, 4, L, d.data());
  check(d[0] == 0x3f80 && d[1] == 0x3f82 && d[64] == 0xbf81 && d[65] == 0 && d[2] == 0,
        "pack_matrix_bf16 rounds fp32 to nearest even (got %04x %04x %04x)", d[0], d[1], d[64]);
}

// ---- routing validation ----------------------------------------------------------------------
void test_routing_check() {
  Case c{3, 40, 20, 4, 2, Activation::silu, DType::f32, false, true, 0, 0};
  Problem p;
  build(p, c);
  char buf[256];
  FusedMoeArgs a = make_args(p, nullptr);
  check(fused_moe_check_routing(a, buf, sizeof(buf)) == nullptr, "check_routing accepts a valid expert_map with -1");
  p.ids[3] = p.Eg;
  a = make_args(p, nullptr);
  const char* m = fused_moe_check_routing(a, buf, sizeof(buf));
  check(m && std::strstr(m, "topk_ids[1, 1]"), "check_routing rejects id == E_global: %s", m ? m : "(accepted)");
  p.ids[3] = -1;
  a = make_args(p, nullptr);
  m = fused_moe_check_routing(a, buf, sizeof(buf));
  check(m != nullptr, "check_routing rejects id -1: %s", m ? m : "(accepted)");
  p.ids[3] = 0;
  p.emap[2] = -2;
  a = make_args(p, nullptr);
  m = fused_moe_check_routing(a, buf, sizeof(buf));
  check(m && std::strstr(m, "expert_map[2]"), "check_routing rejects expert_map -2: %s", m ? m : "(accepted)");
  p.emap[2] = c.E;
  a = make_args(p, nullptr);
  m = fused_moe_check_routing(a, buf, sizeof(buf));
  check(m && std::strstr(m, "expert_map[2]"), "check_routing rejects expert_map == E: %s", m ? m : "(accepted)");
}

// T = 0: nothing to do, nothing to touch.
void test_empty() {
  Case c{0, 93, 40, 5, 2, Activation::silu, DType::bf16, true, false, 1, 0};
  Problem p;
  build(p, c);
  std::vector<Kernel> all = g_simd;
  all.insert(all.begin(), Kernel{"scalar", g_scalar});
  for (const Kernel& k : all) {
    uint16_t guard[kGuard];
    std::fill(guard, guard + kGuard, 0x7fc5);
    FusedMoeArgs a = make_args(p, guard);
    k.fn(a);
    bool same = true;
    for (uint16_t g : guard) same &= g == 0x7fc5;
    check(same, "%-10s T=0 runs and writes nothing", k.name.c_str());
  }
}

// ---- kernel selection for CPUs this host is not -------------------------------------------------
// select_kernel on simulated CPUs (which levels they have) and tables (which kernels a build
// has): the best level that serves the layout, the cap, and the fallback flag.
void dummy_kernel(const FusedMoeArgs&) {}

void test_select() {
  const char* kNo = "not on this simulated CPU";
  struct Cpu {
    const char* name;
    std::vector<Isa> has;
    Isa bf16, i8;  // expected choice with the full table and no cap
  };
  const std::vector<Cpu> cpus = {
      {"zen3", {Isa::avx2}, Isa::avx2, Isa::avx2},
      {"alder-lake", {Isa::avx2, Isa::avx_vnni}, Isa::avx2, Isa::avx_vnni},
      {"skylake-sp", {Isa::avx2, Isa::avx512}, Isa::avx512, Isa::avx512},
      {"ice-lake", {Isa::avx2, Isa::avx512, Isa::avx512_vnni}, Isa::avx512, Isa::avx512_vnni},
      {"sapphire-rapids", {Isa::avx2, Isa::avx512, Isa::avx512_vnni, Isa::avx512_bf16}, Isa::avx512_bf16, Isa::avx512_vnni},
      {"sapphire-rapids+amx", {Isa::avx2, Isa::avx_vnni, Isa::avx512, Isa::avx512_vnni, Isa::avx512_bf16, Isa::amx_bf16},
       Isa::amx_bf16, Isa::avx512_vnni},
      {"zen5", {Isa::avx2, Isa::avx_vnni, Isa::avx512, Isa::avx512_vnni, Isa::avx512_bf16}, Isa::avx512_bf16,
       Isa::avx512_vnni},
      {"no-simd", {}, Isa::scalar, Isa::scalar},
  };
  KernelTable full;
  for (const LayoutDesc& L : kLayouts)
    for (int i = 0; i < kNumIsa; ++i)
      for (int m = 0; m < kNumActModes; ++m) {
        if (isa_serves(Isa(i), L, m ? kAct_a8 : kAct_a16)) full.fused[L.id][m][i] = dummy_kernel;
      }
  auto unavailable_of = [&](const Cpu& c, const char** u) {
    for (int i = 0; i < kNumIsa; ++i) u[i] = kNo;
    u[0] = nullptr;
    for (Isa i : c.has) u[int(i)] = nullptr;
  };
  for (const Cpu& c : cpus) {
    const char* u[kNumIsa];
    unavailable_of(c, u);
    const Selection b = select_kernel(full, u, kLayoutId_bf16_n32k2_x86, Isa(kNumIsa - 1));
    const Selection q = select_kernel(full, u, kLayoutId_i8_n32k4_x86, Isa(kNumIsa - 1));
    check(b.fn && b.isa == c.bf16 && !b.fallback && std::strstr(b.reason, "best ISA of this CPU for layout bf16_n32k2_x86"),
          "select %-15s bf16 -> %s (%s)", c.name, isa_name(b.isa), b.reason);
    check(q.fn && q.isa == c.i8 && !q.fallback && std::strstr(q.reason, "best ISA of this CPU for layout i8_n32k4_x86"),
          "select %-15s int8 -> %s (%s)", c.name, isa_name(q.isa), q.reason);
    // every cap: the best serving level at or below it; "lowers" exactly when below the uncapped choice
    for (int cap = 0; cap < kNumIsa; ++cap) {
      for (const LayoutDesc* L : {&kLayout_bf16_n32k2_x86, &kLayout_i8_n32k4_x86}) {
        int want = 0;
        for (int i = cap; i > 0 && want == 0; --i)
          if (u[i] == nullptr && isa_serves(Isa(i), *L, 0)) want = i;
        const Selection s = select_kernel(full, u, L->id, Isa(cap));
        const Isa top = L == &kLayout_bf16_n32k2_x86 ? c.bf16 : c.i8;
        const bool lowered = want < int(top);
        check(int(s.isa) == want && !s.fallback && (std::strstr(s.reason, "lowers the CPU's") != nullptr) == lowered,
              "select %-15s %s cap %s -> %s (%s)", c.name, L->name, isa_name(Isa(cap)), isa_name(s.isa), s.reason);
      }
    }
  }
  // A build without the avx512 int8 kernel on Skylake-SP: avx2, flagged as a fallback.
  KernelTable partial = full;
  partial.fused[kLayoutId_i8_n32k4_x86][act_index(kAct_a8)][int(Isa::avx512)] = nullptr;
  const char* u[kNumIsa];
  unavailable_of(cpus[2], u);
  const Selection f = select_kernel(partial, u, kLayoutId_i8_n32k4_x86, Isa(kNumIsa - 1));
  check(f.isa == Isa::avx2 && f.fallback &&
            std::strcmp(f.reason, "avx2: fallback: this build has no avx512 kernel for layout i8_n32k4_x86 (a8)") == 0,
        "select skylake-sp without an avx512 int8 kernel -> %s (%s)", isa_name(f.isa), f.reason);
  // ... and capped to avx2 it is no fallback
  const Selection g = select_kernel(partial, u, kLayoutId_i8_n32k4_x86, Isa::avx2);
  check(g.isa == Isa::avx2 && !g.fallback, "select skylake-sp capped to avx2 is not a fallback (%s)", g.reason);
  // unknown layout id, and a table with nothing for the layout
  const Selection x = select_kernel(full, u, 99, Isa(kNumIsa - 1));
  check(x.fn == nullptr && std::strstr(x.reason, "layout id 99 is unknown"), "select unknown layout (%s)", x.reason);
  const KernelTable empty;
  const Selection y = select_kernel(empty, u, kLayoutId_bf16_n32k2_x86, Isa(kNumIsa - 1));
  check(y.fn == nullptr && std::strstr(y.reason, "no kernel is registered for layout bf16_n32k2_x86"),
        "select with an empty table (%s)", y.reason);
}

// ---- int8 layout i8_n32k4_x86 (W8A8) -----------------------------------------------------------
// (1) every ISA's int32 block accumulators == exact int64 dot products, bitwise (SEMANTICS §4:
// integer dot products identical); the VNNI kernels (avx_vnni, avx512_vnni: vpdpbusd) see u8 rows
// and subtract 128 x the column sums. (2) the whole fused kernel vs scalar on awkward shapes.
// Their outputs differ only where an activation computed by another exp moves an intermediate
// across an int8 code boundary (tests/reference/tolerances.py: "flips"), so (2) bounds the
// difference loosely (a wrong column-sum correction or scale is an O(1) error) and counts
// bitwise-equal results.
struct I8Kernel {
  std::string name;
  FusedMoeFn fused;
  Int8BlockGemmFn gemm;
};

std::vector<I8Kernel> collect_i8_kernels() {
  const int L = kLayoutId_i8_n32k4_x86;
  std::vector<I8Kernel> out;
  auto add = [&](const std::string& name, void (*reg)(KernelTable&), Isa isa) {
    KernelTable t;
    reg(t);
    const bool has = t.fused[L][act_index(kAct_a8)][int(isa)] && t.gemm_i8[L][int(isa)];
    check(has == isa_serves(isa, kLayout_i8_n32k4_x86, kAct_a8), "%s registers an int8 kernel exactly when its level serves int8",
          name.c_str());
    if (has) out.push_back({name, t.fused[L][act_index(kAct_a8)][int(isa)], t.gemm_i8[L][int(isa)]});
  };
  add("scalar", register_scalar, Isa::scalar);
  for (const Registrar& r : runnable_registrars()) add(r.name, r.reg, r.isa);
  std::printf("int8 kernels:");
  for (const I8Kernel& k : out) std::printf(" %s", k.name.c_str());
  std::printf("\n");
  return out;
}

// Every ISA's per-row activation quantizer == the scalar one, bit for bit (codes, padding codes
// and scale), on rows with exact ties (amax = 127 makes scale 1, so k + 0.5 is a tie), NaN, +-inf,
// -0, denormals, all-zero rows, and lengths around the 8- and 32-lane steps, both encodings.
// The driver's registrar (fused_moe_driver.inc: register_scheme) over a toy MK written for
// 32-column blocks: it refuses a layout whose blocks its buffers or MK cannot hold, or of
// another scheme, records why in the table, and registers the right one.
namespace regtest {
namespace {
struct MK {
  static constexpr uint32_t kHooks = 0;
  static constexpr int kBlockN = 32;
  static constexpr int kDenseKPack = 2;
  static RowFormat row_format(DType) { return RowFormat::f32; }
  static void gemm(const LayoutDesc&, RowFormat, const void* const*, int, const uint16_t*, int64_t, float*) {}
  static void gemm_i8(const LayoutDesc&, const int8_t* const*, int, const int8_t*, int64_t, const int32_t*, int32_t*) {}
  static void activation(const FusedMoeArgs&, const float*, const float*, int, float*) {}
  static void axpy(float, const float*, float*, int64_t) {}
};
#include "../../csrc/kernels/fused_moe_driver.inc"
}  // namespace
}  // namespace regtest

void test_register_refusals() {
  using S = regtest::DenseA16<regtest::MK>;
  struct Case {
    const char* what;
    LayoutDesc L;
    bool registers;
    const char* why;
  };
  LayoutDesc wide = kLayout_bf16_n32k2_x86, narrow = kLayout_bf16_n32k2_x86, odd = kLayout_bf16_n32k2_x86;
  LayoutDesc kpack4 = kLayout_bf16_n32k2_x86;
  kpack4.k_pack = 4;
  LayoutDesc extra = kLayout_bf16_n32k2_x86;  // a dense layout declaring a second tensor its kernels do not read
  extra.num_tensors = 2;
  extra.tensors[1] = {kRole_scale, "_scale", kTensor_float32, kShape_channel, ""};
  wide.block_n = 128;  // beyond the driver's kMaxBlockN stack buffers
  narrow.block_n = 16;  // a width MK::kBlockN does not have
  odd.block_n = 33;
  const Case cases[] = {
      {"bf16_n32k2_x86", kLayout_bf16_n32k2_x86, true, nullptr},
      {"block_n 128", wide, false, "block_n=128: must be even and in (0, 64]"},
      {"block_n 33", odd, false, "block_n=33: must be even"},
      {"block_n 16", narrow, false, "block_n=16: this level's kernels are written for block_n=32"},
      {"k_pack 4", kpack4, false, "k_pack=4: this level's kernels are written for k_pack=2"},
      {"an int8_channel layout", kLayout_i8_n32k4_x86, false, "is not this kernel's"},
      {"a dense layout with scales", extra, false, "bfloat16 codes only"},
  };
  for (const Case& c : cases) {
    KernelTable t;
    const bool ok = regtest::register_scheme<S>(t, c.L, Isa::avx2);
    check(ok == c.registers && (t.fused[c.L.id][act_index(S::kActMode)][int(Isa::avx2)] != nullptr) == c.registers,
          "register_scheme %s: registered=%d, want %d", c.what, int(ok), int(c.registers));
    const char* why = t.refused[c.L.id][act_index(S::kActMode)][int(Isa::avx2)];
    check(c.why ? std::strstr(why, c.why) != nullptr : *why == '\0',
          "register_scheme %s: refusal reason '%s', want '%s'", c.what, why ? why : "(none)", c.why ? c.why : "(none)");
  }
  // The int8 scheme checks its declaration too: per-channel fp32 scales and int32 sums.
  using S8 = regtest::Int8A8<regtest::MK>;
  LayoutDesc bf16_scales = kLayout_i8_n32k4_x86, no_sums = kLayout_i8_n32k4_x86;
  bf16_scales.tensors[1].dtype = kTensor_bfloat16;
  no_sums.num_tensors = 2;
  for (const LayoutDesc* L : {&bf16_scales, &no_sums}) {
    KernelTable t;
    const bool ok = regtest::register_scheme<S8>(t, *L, Isa::avx2);
    const char* why = t.refused[L->id][act_index(S8::kActMode)][int(Isa::avx2)];
    check(!ok && std::strstr(why, "float32 per-channel scales and int32 per-channel sums"),
          "register_scheme int8 with a changed declaration: registered=%d reason '%s'", int(ok), why ? why : "(none)");
  }
}

void test_i8_quantizer() {
  KernelTable st;
  register_scalar(st);
  const Int8QuantizeFn ref = st.quantize_i8[int(Isa::scalar)];
  std::mt19937_64 rng(99);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  int cases = 0;
  for (const Registrar& r : runnable_registrars()) {
    KernelTable t;
    r.reg(t);
    const Int8QuantizeFn fn = t.quantize_i8[int(r.isa)];
    check((fn != nullptr) == isa_serves(r.isa, kLayout_i8_n32k4_x86, kAct_a8), "%s registers a quantizer exactly when it serves int8",
          r.name.c_str());
    if (fn == nullptr) continue;
    int bad = 0, n_cases = 0;
    for (int n : {1, 5, 8, 9, 31, 32, 33, 63, 100, 768, 2049}) {
      for (int kind = 0; kind < 6; ++kind) {
        for (uint8_t flip : {uint8_t(0), uint8_t(0x80)}) {
          std::vector<float> v(static_cast<size_t>(n));
          for (float& x : v) x = nd(rng) * 3.0f;
          if (kind == 1) {  // ties: amax 127 -> scale exactly 1
            for (int i = 0; i < n; ++i) v[size_t(i)] = float(int(rng() % 254) - 127) + ((i & 1) ? 0.5f : -0.5f);
            v[0] = 127.0f;
          } else if (kind == 2) {  // specials
            const float sp[6] = {std::nanf(""), INFINITY, -INFINITY, -0.0f, 1e-40f, -1e-39f};
            for (int i = 0; i < n; i += 3) v[size_t(i)] = sp[(i / 3) % 6];
          } else if (kind == 3) {
            std::fill(v.begin(), v.end(), 0.0f);
          } else if (kind == 4) {  // a NaN but otherwise finite (NaN is ignored by amax)
            v[size_t(n / 2)] = std::nanf("");
          } else if (kind == 5) {  // tiny values: scale clamps at 1e-7 / 127
            for (float& x : v) x *= 1e-12f;
          }
          const int np = n + (kind % 3) * 4;
          std::vector<int8_t> qa(static_cast<size_t>(np), 7), qb(static_cast<size_t>(np), 9);
          const float sa = ref(v.data(), n, np, qa.data(), flip);
          const float sb = fn(v.data(), n, np, qb.data(), flip);
          ++n_cases;
          if (std::memcmp(&sa, &sb, 4) != 0 || qa != qb) {
            if (bad++ < 3) std::printf("  %s quantizer differs: n=%d kind=%d flip=%d scale %g vs %g\n", r.name.c_str(), n, kind, flip, sa, sb);
          }
        }
      }
    }
    cases += n_cases;
    check(bad == 0, "%-16s int8 row quantizer == scalar bitwise (%d rows, %d differ)", r.name.c_str(), n_cases, bad);
  }
  std::printf("int8 quantizer: %d rows compared bitwise against scalar\n", cases);
}

void test_i8_accumulators(const std::vector<I8Kernel>& ks) {
  const LayoutDesc& L = kLayout_i8_n32k4_x86;
  std::mt19937_64 rng(77);
  std::uniform_int_distribution<int> wq(-128, 127), xq(-127, 127);
  for (int kp : {4, 8, 200, 2052}) {
    std::vector<int8_t> w(size_t(32) * kp), block(size_t(32) * kp);
    for (auto& v : w) v = int8_t(wq(rng));
    for (int n = 0; n < 32; n += 5) w[size_t(n) * kp] = -128;
    pack_matrix_i8(w.data(), 32, kp, 32, kp, L, block.data());
    std::vector<int32_t> colsum(32, 0);
    for (int n = 0; n < 32; ++n)
      for (int k = 0; k < kp; ++k) colsum[n] += w[size_t(n) * kp + k];
    for (int m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 64}) {  // every tile remainder
      std::vector<int8_t> x(size_t(m) * kp);
      for (auto& v : x) v = int8_t(xq(rng));
      for (int k = 0; k < kp; ++k) x[k] = (k % 3) ? int8_t(127) : int8_t(-127);  // extremes in row 0
      std::vector<const int8_t*> rows(m);
      for (int i = 0; i < m; ++i) rows[i] = x.data() + size_t(i) * kp;
      std::vector<int32_t> exact(size_t(m) * 32);
      for (int i = 0; i < m; ++i)
        for (int n = 0; n < 32; ++n) {
          int64_t s = 0;
          for (int k = 0; k < kp; ++k) s += int64_t(x[size_t(i) * kp + k]) * w[size_t(n) * kp + k];
          exact[size_t(i) * 32 + n] = int32_t(s);
        }
      for (const I8Kernel& k : ks) {
        std::vector<int32_t> acc(size_t(m) * 32, 0x5a5a5a5a);
        k.gemm(L, rows.data(), m, block.data(), kp, colsum.data(), acc.data());
        size_t bad = 0;
        for (size_t i = 0; i < acc.size(); ++i) bad += acc[i] != exact[i];
        check(bad == 0, "%-10s int8 block accumulators m=%d kp=%d: %zu of %zu differ from the exact dot products",
              k.name.c_str(), m, kp, bad, acc.size());
      }
    }
  }
}

void test_i8_fused(const std::vector<I8Kernel>& ks) {
  const LayoutDesc& L = kLayout_i8_n32k4_x86;
  const Activation acts[4] = {Activation::silu, Activation::gelu, Activation::gelu_tanh, Activation::swigluoai};
  const DType dts[3] = {DType::f32, DType::bf16, DType::f16};
  const int shapes[3][2] = {{200, 88}, {93, 40}, {68, 20}};
  uint64_t seed = 5000;
  int variant = 0, equal = 0, cases = 0;
  double worst = 0;
  for (const auto& sh : shapes) {
    for (int T : {1, 3, 4, 67}) {
      for (const Activation act : acts) {
        for (const DType dt : dts) {
          ++variant;
          const int E = 5, H = sh[0], I = sh[1], k = variant % 3 == 0 ? 1 : variant % 3 == 1 ? 2 : E;
          const bool bias = variant % 2, inter = act == Activation::swigluoai;
          std::mt19937_64 rng(seed++);
          std::normal_distribution<float> nd(0.0f, 1.0f);
          std::uniform_int_distribution<int> wq(-128, 127);
          std::uniform_real_distribution<float> ud(0.5f, 1.5f);
          const int Ip = int(round_up(I, L.i_align)), Kp = int(round_up(H, L.k_pack)), Np = int(round_up(H, L.block_n));
          // packed row order: gate [0, I) -> [0, I), up -> [Ip, Ip + I); interleaved pairs stay
          auto prow = [&](int r) { return inter ? r : (r < I ? r : Ip + (r - I)); };
          std::vector<int8_t> w13p(size_t(E) * 2 * Ip * Kp), w2p(size_t(E) * Np * Ip);
          std::vector<float> s13(size_t(E) * 2 * Ip, 0.0f), s2(size_t(E) * Np, 0.0f), b13, b2;
          std::vector<int32_t> c13(size_t(E) * 2 * Ip, 0), c2(size_t(E) * Np, 0);
          std::vector<int8_t> m13(size_t(2) * Ip * H), m2(size_t(H) * Ip);
          for (int e = 0; e < E; ++e) {
            std::fill(m13.begin(), m13.end(), 0);
            std::fill(m2.begin(), m2.end(), 0);
            for (int r = 0; r < 2 * I; ++r) {
              const int pr = prow(r);
              for (int h = 0; h < H; ++h) {
                const int8_t q = int8_t(wq(rng));
                m13[size_t(pr) * H + h] = q;
                c13[size_t(e) * 2 * Ip + pr] += q;
              }
              s13[size_t(e) * 2 * Ip + pr] = 1.5f * ud(rng) / (127.0f * std::sqrt(float(H)) * 0.6f);
            }
            for (int n = 0; n < H; ++n) {
              for (int i = 0; i < I; ++i) {
                const int8_t q = int8_t(wq(rng));
                m2[size_t(n) * Ip + i] = q;
                c2[size_t(e) * Np + n] += q;
              }
              s2[size_t(e) * Np + n] = ud(rng) / (127.0f * std::sqrt(float(I)) * 0.6f);
            }
            pack_matrix_i8(m13.data(), 2 * Ip, H, 2 * Ip, Kp, L, &w13p[size_t(e) * 2 * Ip * Kp]);
            pack_matrix_i8(m2.data(), H, Ip, Np, Ip, L, &w2p[size_t(e) * Np * Ip]);
          }
          if (bias) {
            b13.assign(size_t(E) * 2 * Ip, 0.0f);
            b2.assign(size_t(E) * Np, 0.0f);
            for (int e = 0; e < E; ++e) {
              for (int r = 0; r < 2 * I; ++r) b13[size_t(e) * 2 * Ip + prow(r)] = 0.5f * nd(rng);
              for (int n = 0; n < H; ++n) b2[size_t(e) * Np + n] = 0.1f * nd(rng);
            }
          }
          std::vector<uint8_t> x(size_t(T) * H * elem_size(dt));
          for (int i = 0; i < T * H; ++i) store_elem(dt, x.data(), i, nd(rng));
          std::vector<int32_t> ids(size_t(T) * k);
          std::vector<float> tw(size_t(T) * k);
          std::vector<int32_t> perm(E);
          for (int t = 0; t < T; ++t) {
            for (int i = 0; i < E; ++i) perm[i] = i;
            std::shuffle(perm.begin(), perm.end(), rng);
            for (int j = 0; j < k; ++j) {
              ids[size_t(t) * k + j] = perm[j];
              tw[size_t(t) * k + j] = 0.05f + 0.95f * float(rng() % 1000) / 1000.0f;
            }
          }
          FusedMoeArgs a = call_args(x.data(), dt, T, H, tw.data(), ids.data(), k, E, Ip, L);
          a.w13.t[0] = w13p.data();  // the layout's declared order: codes, scales, column sums
          a.w2.t[0] = w2p.data();
          a.interleaved = inter;
          a.b13 = bias ? b13.data() : nullptr;
          a.b2 = bias ? b2.data() : nullptr;
          a.w13.t[1] = s13.data();
          a.w2.t[1] = s2.data();
          a.w13.t[2] = c13.data();
          a.w2.t[2] = c2.data();
          a.act = act;
          a.par = make_parallel(variant % 3);
          char name[160];
          std::snprintf(name, sizeof(name), "T=%d H=%d I=%d k=%d %s %s%s", T, H, I, k, act_name(act), dtype_name(dt),
                        bias ? " bias" : "");
          for (const int one : decode_stream_modes(T)) {
            set_decode_one_stream(one);
            std::vector<std::vector<float>> outs;
            for (const I8Kernel& kk : ks) {
              std::vector<uint8_t> buf(size_t(T) * H * elem_size(dt), 0xff);  // NaN in every dtype
              a.out = buf.data();
              kk.fused(a);
              std::vector<float> o(size_t(T) * H);
              bool finite = true;
              for (int i = 0; i < T * H; ++i) finite &= std::isfinite(o[i] = load_elem(dt, buf.data(), i));
              check(finite, "%-10s int8 %s%s: every output written and finite", kk.name.c_str(), name,
                    stream_mode_suffix(one).c_str());
              outs.push_back(std::move(o));
            }
            set_decode_one_stream(-1);
            for (size_t i = 1; i < ks.size(); ++i) {
              const Cmp m = compare(outs[i], outs[0]);
              ++cases;
              equal += m.ndiff == 0;
              worst = std::max(worst, m.rel);
              check(m.rel <= 1e-2, "%-10s int8 %s%s vs scalar: rel %.3g (bound 1e-2: int8-code flips only), %zu/%zu differ",
                    ks[i].name.c_str(), name, stream_mode_suffix(one).c_str(), m.rel, m.ndiff, outs[i].size());
            }
          }
        }
      }
    }
  }
  std::printf("int8 fused kernels vs scalar: %d comparisons, %d bitwise equal, worst rel %.3g\n", cases, equal, worst);
}

// ---- int4_group layouts (u4*_n32k8_x86): W4A16 and W4A8 ----------------------------------------
// (1) every ISA's W4A8 integer core (the dot_u4 hook) == exact integer dot products, bitwise;
// (2) each ISA's fused kernel in both modes vs scalar on awkward shapes (a partial last group,
// H and I not multiples of 32), with bf16 rows (the W4A16 decode kernel) and fp32 rows.
// Packed here by the layout's rule (moepack/pack/int4.py): byte j of a column's K group word =
// code j | code j + 4 << 4; K padding holds the group's zero point.
void pack_u4(const std::vector<uint8_t>& q, const std::vector<uint8_t>& z, int n, int k, int np, int kp, int G, int ng,
             uint8_t* dst) {
  for (int r = 0; r < np; ++r) {
    for (int c = 0; c < kp; ++c) {
      uint8_t code = 0;
      if (r < n) code = c < k ? q[size_t(r) * k + c] : z[size_t(r) * ng + std::min(c / G, ng - 1)];
      const int64_t off = int64_t(r / 32) * 32 * kp + int64_t(c / 8) * 32 * 8 + int64_t(r % 32) * 8;  // elements
      const int j = c % 8;
      uint8_t& b = dst[off / 2 + j % 4];
      b = uint8_t(j < 4 ? (b & 0xF0) | code : (b & 0x0F) | (code << 4));
    }
  }
}

void test_u4(const std::vector<Registrar>& regs) {
  uint64_t seed = 7000;
  // (1) the integer core
  for (const Registrar& r : regs) {
    KernelTable t;
    r.reg(t);
    const U4BlockDotFn fn = t.dot_u4[kLayoutId_u4g128_n32k8_x86][int(r.isa)];
    if (!fn) continue;
    std::mt19937_64 rng(seed++);
    const int kp = 264;
    std::vector<uint8_t> q(32 * kp), z(32, 0), blk(32 * kp / 2, 0);
    for (auto& v : q) v = uint8_t(rng() % 16);
    pack_u4(q, z, 32, kp, 32, kp, kp, 1, blk.data());
    for (int m : {1, 3, 5, 13}) {
      std::vector<int8_t> rows(size_t(m) * kp);
      for (auto& v : rows) v = int8_t(int(rng() % 256) - 128);
      std::vector<const int8_t*> rp(m);
      for (int i = 0; i < m; ++i) rp[i] = rows.data() + size_t(i) * kp;
      for (const auto& kr : {std::pair<int, int>{0, kp}, {128, 136}, {40, 48}}) {
        std::vector<int32_t> acc(size_t(m) * 32);
        fn(rp.data(), m, blk.data(), kr.first, kr.second, acc.data());
        bool ok = true;
        for (int i = 0; i < m; ++i)
          for (int n = 0; n < 32; ++n) {
            int64_t want = 0;
            for (int kk = kr.first; kk < kr.first + kr.second; ++kk) want += int64_t(rows[size_t(i) * kp + kk]) * q[size_t(n) * kp + kk];
            ok &= acc[size_t(i) * 32 + n] == want;
          }
        check(ok, "%-16s u4 integer core m=%d K [%d, %d): exact", r.name.c_str(), m, kr.first, kr.first + kr.second);
      }
    }
  }
  // (2) the fused kernels vs scalar
  KernelTable st;
  register_scalar(st);
  for (const LayoutDesc* Lp : {&kLayout_u4g32_n32k8_x86, &kLayout_u4g128_n32k8_x86, &kLayout_u4ch_n32k8_x86}) {
    const LayoutDesc& L = *Lp;
    for (const int mode : {kAct_a16, kAct_a8}) {
      for (const DType dt : {DType::bf16, DType::f32}) {
        // H 200: partial last groups (the tile kernels); H 512, I 256, one token: groups that deal
        // out evenly to the decode streams (4 and 2 segments)
        // H 512, I 256, two tokens: 4 routed slots over 3 experts, so one expert has 2 rows (the
        // 2-row W4A8 streams)
        for (const auto [T, H, I] : {std::array<int, 3>{1, 200, 88}, {3, 200, 88}, {40, 200, 88}, {1, 512, 256}, {2, 512, 256}}) {
          const int E = 3, k = 2;
          std::mt19937_64 rng(seed++);
          std::normal_distribution<float> nd(0.0f, 1.0f);
          const int Ip = int(round_up(I, L.i_align)), Kp1 = int(round_up(H, 8)), Np2 = int(round_up(H, 32));
          auto groups = [&](int kp) { return L.group_size ? int((kp + L.group_size - 1) / L.group_size) : 1; };
          const int g1 = groups(Kp1), g2 = groups(Ip);
          const int G1 = L.group_size ? L.group_size : Kp1, G2 = L.group_size ? L.group_size : Ip;
          std::vector<uint8_t> w13(size_t(E) * 2 * Ip * Kp1 / 2, 0), w2(size_t(E) * Np2 * Ip / 2, 0);
          std::vector<float> s13(size_t(E) * g1 * 2 * Ip, 0.0f), s2(size_t(E) * g2 * Np2, 0.0f);
          std::vector<uint8_t> z13(size_t(E) * g1 * 2 * Ip, 0), z2(size_t(E) * g2 * Np2, 0);
          for (int e = 0; e < E; ++e) {
            // w13: 2*Ip rows (gate [0, I), up [Ip, Ip + I)), K = H; w2: H rows, K = I (padded to Ip)
            for (int w = 0; w < 2; ++w) {
              const int n = w ? H : 2 * Ip, kreal = w ? I : H, kp = w ? Ip : Kp1, np = w ? Np2 : 2 * Ip, ng = w ? g2 : g1;
              const int G = w ? G2 : G1;
              std::vector<uint8_t> q(size_t(n) * kreal, 0), z(size_t(n) * ng, 0);
              for (int r = 0; r < n; ++r) {
                const bool real = w || (r % Ip) < I;
                for (int c = 0; c < kreal; ++c) q[size_t(r) * kreal + c] = real ? uint8_t(rng() % 16) : 0;
                for (int g = 0; g < ng; ++g) {
                  const uint8_t zz = real ? uint8_t(rng() % 16) : 0;
                  z[size_t(r) * ng + g] = zz;
                  const float sc = real ? (0.5f + float(rng() % 1000) / 1000.0f) / (8.0f * std::sqrt(float(kreal))) : 0.0f;
                  (w ? z2 : z13)[(size_t(e) * ng + g) * np + r] = zz;
                  (w ? s2 : s13)[(size_t(e) * ng + g) * np + r] = sc;
                }
              }
              uint8_t* dst = (w ? w2.data() + size_t(e) * np * kp / 2 : w13.data() + size_t(e) * np * kp / 2);
              pack_u4(q, z, n, kreal, np, kp, G, ng, dst);
            }
          }
          std::vector<uint8_t> x(size_t(T) * H * elem_size(dt));
          for (int i = 0; i < T * H; ++i) store_elem(dt, x.data(), i, nd(rng));
          std::vector<int32_t> ids(size_t(T) * k);
          std::vector<float> tw(size_t(T) * k);
          for (int t = 0; t < T; ++t) {
            ids[size_t(t) * k] = int32_t(rng() % E);
            ids[size_t(t) * k + 1] = int32_t((ids[size_t(t) * k] + 1 + rng() % (E - 1)) % E);
            tw[size_t(t) * k] = 0.6f;
            tw[size_t(t) * k + 1] = 0.4f;
          }
          FusedMoeArgs a = call_args(x.data(), dt, T, H, tw.data(), ids.data(), k, E, Ip, L);
          a.w13.t[0] = w13.data();
          a.w13.t[1] = s13.data();
          a.w13.t[2] = z13.data();
          a.w2.t[0] = w2.data();
          a.w2.t[1] = s2.data();
          a.w2.t[2] = z2.data();
          a.act_mode = mode;
          a.act = Activation::silu;
          char name[160];
          std::snprintf(name, sizeof(name), "%s %s T=%d %s", L.name, mode == kAct_a8 ? "a8" : "a16", T, dtype_name(dt));
          auto run = [&](FusedMoeFn fn) {
            std::vector<uint8_t> buf(size_t(T) * H * elem_size(dt), 0xff);
            a.out = buf.data();
            fn(a);
            std::vector<float> o(size_t(T) * H);
            for (int i = 0; i < T * H; ++i) o[i] = load_elem(dt, buf.data(), i);
            return o;
          };
          const std::vector<float> ref = run(st.fused[L.id][act_index(mode)][int(Isa::scalar)]);
          for (const Registrar& r : regs) {
            KernelTable t;
            r.reg(t);
            const FusedMoeFn fn = t.fused[L.id][act_index(mode)][int(r.isa)];
            if (!fn) continue;
            for (const int one : decode_stream_modes(T)) {
              set_decode_one_stream(one);
              const Cmp c = compare(run(fn), ref);
              set_decode_one_stream(-1);
              // a16 fp32 rows: summation order only; bf16 outputs and a8: rounding / code flips
              const double bound = (mode == kAct_a16 && dt == DType::f32) ? 1e-5 : 1e-2;
              check(c.rel <= bound, "%-16s u4 %s%s vs scalar: rel %.3g (bound %.0e)", r.name.c_str(), name,
                    stream_mode_suffix(one).c_str(), c.rel, bound);
            }
          }
        }
      }
    }
  }
}

// Every hook a level's MK states (csrc/kernels/mk_hooks.h), for the schemes the level registers,
// ran in the tests above: counted per linked object (this build defines MOEPACK_COUNT_HOOKS).
// A hook that declines every call it gets (gemm_u4a16 returning false) does not count as run.
void test_hooks_run(const std::vector<Registrar>& regs) {
#if !defined(MOEPACK_COUNT_HOOKS)
#error "tests/cpp/build.py builds every object with -DMOEPACK_COUNT_HOOKS"
#endif
  int hooks = 0;
  for (const Registrar& r : regs) {
    KernelTable t;
    r.reg(t);
    const uint64_t* calls = t.hook_calls[int(r.isa)];
    const uint32_t used = t.hooks_used[int(r.isa)];
    for (int h = 0; h < kNumMkHooks; ++h) {
      if (!((used >> h) & 1u)) continue;
      ++hooks;
      const unsigned long long n = calls ? calls[h] : 0;
      check(n > 0, "%-16s hook %-16s stated and run (%llu calls)", r.name.c_str(), kMkHookNames[h], n);
    }
  }
  std::printf("MK hooks: %d stated hooks of %zu level objects checked for calls\n", hooks, regs.size());
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-v") == 0) g_verbose = true;
  }
  const auto t0 = std::chrono::steady_clock::now();
  collect_kernels();
  test_pack();
  test_routing_check();
  test_empty();
  test_select();
  test_register_refusals();
  test_decode_streams();
  {
    const std::vector<I8Kernel> i8 = collect_i8_kernels();
    test_i8_quantizer();
    test_i8_accumulators(i8);
    test_i8_fused(i8);
  }
  test_u4(runnable_registrars());

  const Activation acts[4] = {Activation::silu, Activation::gelu, Activation::gelu_tanh, Activation::swigluoai};
  const DType dts[3] = {DType::f32, DType::bf16, DType::f16};
  struct Shape {
    int H, I;
  };
  // H, I not multiples of 32; Kp(H)/2 = 100, 47, 65, 34 K pairs (every remainder of the 4-pair unroll)
  const Shape shapes[4] = {{200, 88}, {93, 40}, {130, 176}, {68, 20}};
  uint64_t seed = 1000;
  int variant = 0;
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
              c.seed = seed++;
              run_case(c);
            }
          }
        }
      }
    }
  }
  // Every expert with exactly 4 rows (T = 4, k = E): the 4-row decode streams of every kernel.
  for (const Shape& sh : shapes) {
    for (const DType dt : dts) {
      ++variant;
      Case c{4, sh.H, sh.I, 5, 5, Activation::silu, dt, variant % 2 == 0, false, variant % 3, 0};
      c.seed = seed++;
      run_case(c);
    }
  }
  // An expert with > 64 rows (several row chunks per expert), T*k = 300 over 3 experts.
  for (const Activation act : acts) {
    for (const DType dt : dts) {
      ++variant;
      Case c{150, 93, 40, 3, 2, act, dt, variant % 2 == 0, false, variant % 3, 0};
      if (act == Activation::swigluoai) c.limit = 1.25f;
      c.seed = seed++;
      run_case(c);
    }
  }
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

  test_hooks_run(runnable_registrars());

  std::printf("\nmax errors (rel = ||got - ref|| / ||ref||, worst = max|got - ref| / max|ref|):\n");
  std::printf("  %-24s %6s %12s %12s %10s\n", "kernel/dtype", "cases", "max rel", "max worst", "bit-diff");
  for (const auto& [key, s] : g_stats) {
    std::printf("  %-24s %6d %12.3g %12.3g %7d/%d\n", key.c_str(), s.cases, s.max_rel, s.max_worst, s.differing_cases,
                s.cases);
  }
  std::printf("comparisons above the base tolerance (bf16/f16: accepted only within the flip allowance): %d\n",
              g_allowance_used);
  std::printf("kernel time:");
  for (const auto& [k, sec] : g_kernel_seconds) std::printf(" %s %.2fs", k.c_str(), sec);
  std::printf("; total %.1fs\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
