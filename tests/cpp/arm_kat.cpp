// Known-answer tests of the AArch64 instructions the ARM kernels use (csrc/arm/), one line per
// (instruction, case): "KAT <insn> <case>: ok" or "KAT <insn> <case>: WRONG <detail>". It answers
// one question: does the machine running this binary (a real CPU, or qemu-user on x86:
// tests/engine/test_arm_cross.py) compute these instructions as the Arm ARM defines them? The kernel
// tests (test_kernels) compare whole kernels with the scalar level under tolerances; this checks
// each instruction alone, exactly:
//   exact cases   inputs whose every product and partial sum is exact in fp32 (small integers,
//                 halves), so any rounding mode gives one answer;
//   model cases   random normal inputs against a model of the Arm ARM pseudocode (BFDotAdd
//                 without FEAT_EBF16: each product, the pair sum and the accumulation rounded to
//                 odd, subnormals flushed; BFMLAL: one fused multiply-add, round to nearest even);
//   IEEE cases    the quantizer's operations (fmaxnm/fminnm with NaN, frintn ties, fdiv).
// Build: aarch64-linux-gnu-g++ -std=c++20 -O1 -march=armv8.6-a+bf16+i8mm -ffp-contract=off
// (tests/engine/test_arm_cross.py); exit status 1 when any case is WRONG.
#include <arm_neon.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

namespace {

int g_wrong = 0;

// An operand the compiler cannot see through: the instruction runs on the machine (GCC 12 folds
// vmaxnmvq_f32 of constant lanes with NaN to NaN at compile time, which is not what fmaxnmv does).
template <class V>
V opaque(V v) {
  asm volatile("" : "+w"(v));
  return v;
}

void report(const char* insn, const char* kase, int bad, int total, const char* detail) {
  if (bad == 0) {
    std::printf("KAT %s %s: ok (%d lanes)\n", insn, kase, total);
  } else {
    ++g_wrong;
    std::printf("KAT %s %s: WRONG %d of %d lanes differ; first: %s\n", insn, kase, bad, total, detail);
  }
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float bf(uint16_t h) { return from_bits(uint32_t(h) << 16); }
uint16_t to_bf16_trunc(float f) { return uint16_t(bits(f) >> 16); }  // for exact bf16 values only

// ---- the Arm ARM's BFloat16 arithmetic without FEAT_EBF16 (FPCR.EBF = 0) ---------------------
float flush(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
// a + b rounded to odd (x86 or ARM host: the fp32 sum rounds to nearest; TwoSum gives the error)
float add_odd(float a, float b) {
  a = flush(a), b = flush(b);
  volatile float s = a + b;
  volatile float bb = s - a;
  volatile float err = (a - (s - bb)) + (b - bb);
  float r = s;
  if (err != 0.0f && std::isfinite(s)) {
    // truncation toward zero: s itself when |s| < |exact|, else the neighbour toward zero
    if ((err > 0) != (s > 0)) r = std::nextafter(s, 0.0f);
    r = from_bits(bits(r) | 1u);
  }
  return flush(r);
}
float mul_odd(float a, float b) { return flush(flush(a) * flush(b)); }  // bf16 x bf16 is exact in fp32
float bfdotadd(float acc, uint16_t a0, uint16_t a1, uint16_t b0, uint16_t b1) {
  return add_odd(acc, add_odd(mul_odd(bf(a0), bf(b0)), mul_odd(bf(a1), bf(b1))));
}

template <class T, int N>
bool same_bits(const T (&a)[N], const T (&b)[N], int* first) {
  for (int i = 0; i < N; ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      *first = i;
      return false;
    }
  }
  return true;
}

// ---- int8 ---------------------------------------------------------------------------------
void kat_sdot(std::mt19937_64& rng) {
  int bad = 0, total = 0;
  char detail[160] = "";
  for (int it = 0; it < 200; ++it) {
    int8_t a[16], b[16];
    int32_t acc[4], want[4], got[4];
    for (int i = 0; i < 16; ++i) a[i] = int8_t(rng()), b[i] = int8_t(rng());
    if (it == 0)
      for (int i = 0; i < 16; ++i) a[i] = -128, b[i] = -128;  // the extremes
    for (int l = 0; l < 4; ++l) {
      acc[l] = int32_t(rng());
      int64_t s = acc[l];
      for (int j = 0; j < 4; ++j) s += int32_t(a[4 * l + j]) * b[4 * l + j];
      want[l] = int32_t(uint32_t(s));
    }
    vst1q_s32(got, vdotq_s32(vld1q_s32(acc), vld1q_s8(a), vld1q_s8(b)));
    for (int l = 0; l < 4; ++l, ++total) {
      if (got[l] != want[l] && bad++ == 0) std::snprintf(detail, sizeof detail, "lane %d got %d want %d", l, got[l], want[l]);
    }
  }
  report("sdot", "random s8 (and -128 x -128)", bad, total, detail);
}

void kat_smmla(std::mt19937_64& rng) {
  int bad = 0, total = 0;
  char detail[160] = "";
  for (int it = 0; it < 200; ++it) {
    int8_t a[16], b[16];
    int32_t acc[4], want[4], got[4];
    for (int i = 0; i < 16; ++i) a[i] = int8_t(rng()), b[i] = int8_t(rng());
    if (it == 0)
      for (int i = 0; i < 16; ++i) a[i] = -128, b[i] = -128;
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < 2; ++c) {
        acc[2 * r + c] = int32_t(rng() % 100000);
        int64_t s = acc[2 * r + c];
        for (int k = 0; k < 8; ++k) s += int32_t(a[8 * r + k]) * b[8 * c + k];
        want[2 * r + c] = int32_t(uint32_t(s));
      }
    vst1q_s32(got, vmmlaq_s32(vld1q_s32(acc), vld1q_s8(a), vld1q_s8(b)));
    for (int l = 0; l < 4; ++l, ++total) {
      if (got[l] != want[l] && bad++ == 0) std::snprintf(detail, sizeof detail, "lane %d got %d want %d", l, got[l], want[l]);
    }
  }
  report("smmla", "random s8 (and -128 x -128)", bad, total, detail);
}

// ---- bf16 ---------------------------------------------------------------------------------
// Exact operands: bf16 integers -8..8 and halves; accumulators small integers: every product and
// sum is exact in fp32, so the answer does not depend on rounding.
uint16_t exact_bf16(std::mt19937_64& rng) { return to_bf16_trunc(float(int(rng() % 33) - 16) * 0.5f); }

enum class Bf { dot, mmla, mlalb, mlalt };
const char* bf_name(Bf k) {
  return k == Bf::dot ? "bfdot" : k == Bf::mmla ? "bfmmla" : k == Bf::mlalb ? "bfmlalb" : "bfmlalt";
}

void bf_want(Bf k, const float acc[4], const uint16_t a[8], const uint16_t b[8], float want[4]) {
  for (int l = 0; l < 4; ++l) {
    switch (k) {
      case Bf::dot: want[l] = bfdotadd(acc[l], a[2 * l], a[2 * l + 1], b[2 * l], b[2 * l + 1]); break;
      case Bf::mmla: {  // row r of a (4 values), column c of b (4 values): two BFDotAdds in K order
        const int r = l / 2, c = l % 2;
        const float t = bfdotadd(acc[l], a[4 * r], a[4 * r + 1], b[4 * c], b[4 * c + 1]);
        want[l] = bfdotadd(t, a[4 * r + 2], a[4 * r + 3], b[4 * c + 2], b[4 * c + 3]);
        break;
      }
      case Bf::mlalb: want[l] = std::fma(bf(a[2 * l]), bf(b[2 * l]), acc[l]); break;       // even elements
      case Bf::mlalt: want[l] = std::fma(bf(a[2 * l + 1]), bf(b[2 * l + 1]), acc[l]); break;  // odd elements
    }
  }
}

float32x4_t bf_run(Bf k, float32x4_t acc, bfloat16x8_t a, bfloat16x8_t b) {
  switch (k) {
    case Bf::dot: return vbfdotq_f32(acc, a, b);
    case Bf::mmla: return vbfmmlaq_f32(acc, a, b);
    case Bf::mlalb: return vbfmlalbq_f32(acc, a, b);
    case Bf::mlalt: return vbfmlaltq_f32(acc, a, b);
  }
  return acc;
}

void kat_bf16(Bf k, bool exact, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  int bad = 0, total = 0;
  char detail[200] = "";
  for (int it = 0; it < 400; ++it) {
    uint16_t a[8], b[8];
    float acc[4], want[4], got[4];
    for (int i = 0; i < 8; ++i) {
      a[i] = exact ? exact_bf16(rng) : uint16_t(bits(nd(rng)) >> 16);
      b[i] = exact ? exact_bf16(rng) : uint16_t(bits(nd(rng)) >> 16);
    }
    for (float& v : acc) v = exact ? float(int(rng() % 64) - 32) : nd(rng) * 4.0f;
    bf_want(k, acc, a, b, want);
    uint16x8_t av = vld1q_u16(a), bv = vld1q_u16(b);
    vst1q_f32(got, bf_run(k, vld1q_f32(acc), vreinterpretq_bf16_u16(av), vreinterpretq_bf16_u16(bv)));
    for (int l = 0; l < 4; ++l, ++total) {
      if (bits(got[l]) != bits(want[l]) && bad++ == 0)
        std::snprintf(detail, sizeof detail, "lane %d got %.9g (0x%08x) want %.9g (0x%08x)", l, got[l], bits(got[l]), want[l],
                      bits(want[l]));
    }
  }
  report(bf_name(k), exact ? "exact operands" : "random operands vs the Arm ARM model", bad, total, detail);
}

// ---- the quantizer's IEEE operations (docs/SEMANTICS.md §3) ---------------------------------
void kat_ieee() {
  const float qnan = std::nanf("");
  {  // fmaxnm / fminnm: the number when one operand is a quiet NaN
    float a[4] = {qnan, 1.0f, -127.0f, qnan}, b[4] = {-127.0f, qnan, 3.0f, 2.0f}, got[4], gmin[4];
    float want[4] = {-127.0f, 1.0f, 3.0f, 2.0f}, wmin[4] = {-127.0f, 1.0f, -127.0f, 2.0f};
    vst1q_f32(got, vmaxnmq_f32(opaque(vld1q_f32(a)), opaque(vld1q_f32(b))));
    vst1q_f32(gmin, vminnmq_f32(opaque(vld1q_f32(a)), opaque(vld1q_f32(b))));
    int i = 0;
    const bool ok = same_bits(got, want, &i);
    char d[120];
    std::snprintf(d, sizeof d, "lane %d got %g want %g", i, got[i], want[i]);
    report("fmaxnm", "quiet NaN operand", ok ? 0 : 1, 4, d);
    const bool okm = same_bits(gmin, wmin, &i);
    std::snprintf(d, sizeof d, "lane %d got %g want %g", i, gmin[i], wmin[i]);
    report("fminnm", "quiet NaN operand", okm ? 0 : 1, 4, d);
    float lanes[4] = {qnan, 5.0f, qnan, 2.0f};
    const float m = vmaxnmvq_f32(opaque(vld1q_f32(lanes)));
    std::snprintf(d, sizeof d, "got %g want 5", m);
    report("fmaxnmv", "NaN lanes", m == 5.0f ? 0 : 1, 1, d);
  }
  {  // frintn: ties to even
    float in[8] = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f, -126.5f};
    float want[8] = {0.0f, 2.0f, 2.0f, -0.0f, -2.0f, -2.0f, 126.0f, -126.0f}, got[8];
    vst1q_f32(got, vrndnq_f32(opaque(vld1q_f32(in))));
    vst1q_f32(got + 4, vrndnq_f32(opaque(vld1q_f32(in + 4))));
    int i = 0;
    const bool ok = same_bits(got, want, &i);
    char d[120];
    std::snprintf(d, sizeof d, "lane %d: frintn(%g) got %g want %g", i, in[i], got[i], want[i]);
    report("frintn", "ties to even, signed zero", ok ? 0 : 1, 8, d);
  }
  {  // fdiv: correctly rounded (against double division rounded once)
    std::mt19937_64 rng(5);
    std::normal_distribution<float> nd(0.0f, 10.0f);
    int bad = 0;
    char d[160] = "";
    for (int it = 0; it < 256; ++it) {
      float a[4], b[4], got[4];
      for (int l = 0; l < 4; ++l) a[l] = nd(rng), b[l] = std::fabs(nd(rng)) + 1e-3f;
      vst1q_f32(got, vdivq_f32(vld1q_f32(a), vld1q_f32(b)));
      for (int l = 0; l < 4; ++l) {
        const float want = float(double(a[l]) / double(b[l]));
        if (bits(got[l]) != bits(want) && bad++ == 0) std::snprintf(d, sizeof d, "%g / %g got %.9g want %.9g", a[l], b[l], got[l], want);
      }
    }
    report("fdiv", "random", bad, 1024, d);
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(2026);
  kat_sdot(rng);
  kat_smmla(rng);
  for (Bf k : {Bf::dot, Bf::mmla, Bf::mlalb, Bf::mlalt}) {
    kat_bf16(k, true, rng);
    kat_bf16(k, false, rng);
  }
  kat_ieee();
  std::printf("%d wrong\n", g_wrong);
  return g_wrong ? 1 : 0;
}
