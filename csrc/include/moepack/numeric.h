// Bit-exact scalar conversions and activations shared by every kernel.
// Everything here is `static inline` on purpose: each ISA translation unit gets its own
// internal copy, so a function compiled with AVX-512 flags can never be picked by the linker
// for the scalar path (the ODR trap of per-file ISA flags).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace moepack {

static inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN.
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_f32(sign);
    // subnormal: value = man * 2^-24
    float v = float(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// Round to nearest even, with subnormals, overflow to inf; NaN stays NaN.
static inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520 -> inf
  if (a < 0x38800000u) {  // below the smallest normal 2^-14: subnormal or zero
    // value / 2^-24 rounded to nearest even, done exactly in float: a + 0.5 shifts the
    // mantissa so that the float addition performs the rounding.
    float v = bits_to_f32(a);
    float r = v + 0.5f;  // 0.5 = 2^-1: ulp of r is 2^-24, exactly the f16 subnormal step
    return uint16_t(sign | (f32_to_bits(r) - 0x3f000000u));
  }
  uint32_t man_odd = (a >> 13) & 1u;
  a += 0x0fffu + man_odd;  // round mantissa to 10 bits, nearest even
  return uint16_t(sign | (((a >> 13) - (112u << 10)) & 0x7fffu));
}

// Round a value through the activation dtype and back (intermediate storage semantics).
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
static inline float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }

static inline float sigmoid_f32(float x) { return 1.0f / (1.0f + std::exp(-x)); }

static inline float act_silu(float g, float u) { return g * sigmoid_f32(g) * u; }
// silu with a clamped SwiGLU (FusedMoeArgs::silu_limit > 0): gate <= limit, up in [-limit, limit],
// as torch.clamp does (a NaN stays NaN).
static inline float clamp_gate(float g, float limit) { return g > limit ? limit : g; }
static inline float clamp_up(float u, float limit) { return u > limit ? limit : (u < -limit ? -limit : u); }
static inline float act_silu_clamped(float g, float u, float limit) {
  return act_silu(clamp_gate(g, limit), clamp_up(u, limit));
}
static inline float act_gelu(float g, float u) {
  return 0.5f * g * (1.0f + std::erf(g * 0.70710678118654752f)) * u;
}
static inline float act_gelu_tanh(float g, float u) {
  const float c = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * g * (1.0f + std::tanh(c * (g + 0.044715f * g * g * g))) * u;
}
// Non-gated relu^2 (Nemotron-H's relu2): relu(x)^2, a NaN stays NaN as torch.relu keeps it.
static inline float act_relu2(float x) {
  const float r = x > 0.0f ? x : (x == x ? 0.0f : x);
  return r * r;
}
// Clamps as torch.clamp does: a NaN stays NaN (std::fmin/fmax would return the limit).
static inline float act_swigluoai(float g, float u, float alpha, float limit) {
  g = g > limit ? limit : g;
  u = u > limit ? limit : (u < -limit ? -limit : u);
  return (u + 1.0f) * g * sigmoid_f32(alpha * g);
}

}  // namespace moepack
