// [NOTE] The exact float8 e4m3fn -> bf16 decode, as one 256-entry table: the contract of every
// fp8_block decoder (codec_fp8.inc's portable one, each level's unpack_f8 hook: mk_hooks.h) and
// the table the SIMD decoders load their lookups from.
//
// Every finite e4m3fn value is exact in bf16 (3 mantissa bits; exponents 2^-9 .. 2^8, all normal
// in bf16: the subnormal e4m3 codes m * 2^-9 become normal bf16 numbers), so no entry is a bf16
// subnormal. The NaN codes 0x7F / 0xFF (refused at convert) decode to the quiet bf16 NaN of their
// sign, 0x7FC0 / 0xFFC0, on every level: a hostile pack gives the same result on every CPU.
#pragma once
#include <cstdint>

namespace moepack {
namespace {

struct F8Bf16Table {
  uint16_t v[256];
  constexpr F8Bf16Table() : v{} {
    for (int c = 0; c < 256; ++c) {
      const uint16_t sign = (c & 0x80) ? 0x8000 : 0;
      const int e = (c >> 3) & 15, m = c & 7;
      if (e == 15 && m == 7) {
        v[c] = uint16_t(sign | 0x7FC0);  // NaN
      } else if (e != 0) {
        v[c] = uint16_t(sign | ((e + 120) << 7) | (m << 4));  // (1 + m/8) 2^(e-7)
      } else if (m == 0) {
        v[c] = sign;  // +-0
      } else {  // m 2^-9: normalize the mantissa
        int p = 2;
        while (!(m >> p)) --p;  // m = 2^p (1 + f), p = 0..2
        const int frac = (m - (1 << p)) << (7 - p);  // f in bf16's 7 mantissa bits
        v[c] = uint16_t(sign | ((p - 9 + 127) << 7) | frac);
      }
    }
  }
};
constexpr F8Bf16Table kF8Bf16{};

// No entry is a bf16 subnormal (exponent field 0 with a nonzero mantissa): the dot-product
// instructions that flush subnormal inputs (docs/KERNELS.md) see every decoded value exactly.
constexpr bool f8_table_has_no_subnormal() {
  for (int c = 0; c < 256; ++c) {
    if ((kF8Bf16.v[c] & 0x7F80) == 0 && (kF8Bf16.v[c] & 0x7F) != 0) return false;
  }
  return true;
}
static_assert(f8_table_has_no_subnormal(), "an e4m3fn code decodes to a bf16 subnormal");
static_assert(kF8Bf16.v[0x01] == 0x3B00 && kF8Bf16.v[0x08] == 0x3C80 && kF8Bf16.v[0x7E] == 0x43E0 &&
                  kF8Bf16.v[0xFF] == 0xFFC0 && kF8Bf16.v[0x80] == 0x8000,
              "e4m3fn: 2^-9, 2^-6, 448, -NaN, -0");

}  // namespace
}  // namespace moepack
