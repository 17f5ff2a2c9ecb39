// C++ packer: canonical [N, K] row-major weights -> a bf16 block layout, int8 codes -> an int8
// block layout, sub-byte codes -> a sub-byte layout (moepack/layout.py). Where each element goes
// is the generated layout_element_offset / layout_code_position (layouts_gen.h), written once.
// Must equal moepack/pack's reference packer byte for byte (tests/test_pack.py; the sub-byte one:
// tests/cpp kt_seam.inc).
#include <cstdint>
#include <cstring>

#include "moepack/kernel.h"
#include "moepack/numeric.h"

namespace moepack {
namespace {

inline bool finite_bf16(uint16_t v) { return (v & 0x7f80u) != 0x7f80u; }
inline bool finite_f16(uint16_t v) { return (v & 0x7c00u) != 0x7c00u; }

template <typename Load>
int64_t pack_rows(int64_t r0, int64_t r1, int64_t k, int64_t kp, const LayoutDesc& L, uint16_t* dst, Load load) {
  int64_t bad = -1;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      bool finite;
      const uint16_t v = load(r * k + c, &finite);
      if (!finite && bad < 0) bad = r * k + c;
      dst[layout_element_offset(L, r, c, kp)] = v;
    }
  }
  return bad;
}

}  // namespace

int64_t pack_matrix_bf16_rows(const void* src, DType src_dtype, int64_t n, int64_t k, int64_t np, int64_t kp,
                              const LayoutDesc& L, uint16_t* dst, int64_t block_begin, int64_t block_end) {
  const int64_t bn = L.block_n;
  // zero the blocks first: padding rows and columns are zeros
  std::memset(dst + block_begin * bn * kp, 0, size_t((block_end - block_begin) * bn * kp) * 2);
  const int64_t r0 = block_begin * bn < n ? block_begin * bn : n;
  const int64_t r1 = block_end * bn < n ? block_end * bn : n;
  (void)np;
  if (src_dtype == DType::bf16 && L.k_pack == 2 && k % 2 == 0) {
    // bf16 source, K pairs: the packed block is [K/2][bn] 32-bit words, each word one row's
    // (k, k+1) pair; gather one K pair from the block's rows and write it contiguously.
    const char* s = static_cast<const char*>(src);  // possibly only 2-byte aligned: memcpy loads
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    const int64_t half = k / 2;
    int64_t bad = -1;
    uint32_t any_bad = 0;
    for (int64_t b = block_begin; b < block_end; ++b) {
      const int64_t rows = (b + 1) * bn < n ? bn : n - b * bn;
      for (int64_t kk = 0; kk < half; ++kk) {
        uint32_t* o = d + layout_element_offset(L, b * bn, 2 * kk, kp) / 2;  // the pair (k, k+1) of the block's rows
        uint32_t nonfinite = 0;
        for (int64_t i = 0; i < rows; ++i) {
          uint32_t v;
          std::memcpy(&v, s + ((b * bn + i) * half + kk) * 4, 4);
          nonfinite |= uint32_t((v & 0x7f80u) == 0x7f80u) | uint32_t((v & 0x7f800000u) == 0x7f800000u);
          o[i] = v;
        }
        any_bad |= nonfinite;
      }
    }
    if (any_bad) {  // rare: find the first non-finite element in row-major order
      const uint16_t* h = static_cast<const uint16_t*>(src);
      for (int64_t r = block_begin * bn; r < n && r < block_end * bn && bad < 0; ++r) {
        for (int64_t c = 0; c < k; ++c) {
          if (!finite_bf16(h[r * k + c])) {
            bad = r * k + c;
            break;
          }
        }
      }
    }
    return bad;
  }
  switch (src_dtype) {
    case DType::bf16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      return pack_rows(r0, r1, k, kp, L, dst, [s](int64_t i, bool* ok) {
        *ok = finite_bf16(s[i]);
        return s[i];
      });
    }
    case DType::f16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      return pack_rows(r0, r1, k, kp, L, dst, [s](int64_t i, bool* ok) {
        *ok = finite_f16(s[i]);
        return f32_to_bf16(f16_to_f32(s[i]));
      });
    }
    default: {
      const float* s = static_cast<const float*>(src);
      return pack_rows(r0, r1, k, kp, L, dst, [s](int64_t i, bool* ok) {
        *ok = std::isfinite(s[i]);
        return f32_to_bf16(s[i]);
      });
    }
  }
}

void pack_matrix_i8_rows(const int8_t* src, int64_t n, int64_t k, int64_t np, int64_t kp, const LayoutDesc& L,
                         int8_t* dst, int64_t block_begin, int64_t block_end) {
  const int64_t bn = L.block_n;
  std::memset(dst + block_begin * bn * kp, 0, size_t((block_end - block_begin) * bn * kp));
  const int64_t r0 = block_begin * bn < n ? block_begin * bn : n;
  const int64_t r1 = block_end * bn < n ? block_end * bn : n;
  (void)np;
  for (int64_t r = r0; r < r1; ++r) {
    const int8_t* row = src + r * k;
    for (int64_t c = 0; c < k; ++c) dst[layout_element_offset(L, r, c, kp)] = row[c];
  }
}

void pack_matrix_sub_byte(const uint8_t* src, const uint8_t* zero, int64_t n, int64_t k, int64_t np, int64_t kp,
                          const LayoutDesc& L, uint8_t* dst) {
  const int64_t G = L.group_size ? L.group_size : kp;
  const int64_t ng = (kp + G - 1) / G;
  const int mask = (1 << L.weight_bits) - 1;
  std::memset(dst, 0, size_t(np * kp * L.weight_bits / 8));  // padded rows: code 0
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < kp; ++c) {
      // K padding holds the row's zero point of its group, so it dequantizes to exactly 0
      const int64_t g = c / G < ng ? c / G : ng - 1;
      const int code = (c < k ? src[r * k + c] : zero[r * ng + g]) & mask;
      const CodePosition p = layout_code_position(L, r, c, kp);
      dst[p.byte] = uint8_t((dst[p.byte] & ~(mask << p.shift)) | (code << p.shift));
    }
  }
}

void pack_matrix_i8(const int8_t* src, int64_t n, int64_t k, int64_t np, int64_t kp, const LayoutDesc& L, int8_t* dst) {
  pack_matrix_i8_rows(src, n, k, np, kp, L, dst, 0, np / L.block_n);
}

int64_t pack_matrix_bf16(const void* src, DType src_dtype, int64_t n, int64_t k, int64_t np, int64_t kp,
                         const LayoutDesc& L, uint16_t* dst) {
  return pack_matrix_bf16_rows(src, src_dtype, n, k, np, kp, L, dst, 0, np / L.block_n);
}

}  // namespace moepack
