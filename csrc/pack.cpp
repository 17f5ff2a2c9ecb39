// C++ packer: canonical [N, K] row-major weights -> a bf16 block layout (moepack/layout.py).
// Must equal moepack/pack's reference packer byte for byte (tests/test_pack.py).
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
  const int64_t bn = L.block_n, kpk = L.k_pack;
  int64_t bad = -1;
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* col = dst + (r / bn) * bn * kp + (r % bn) * kpk;
    for (int64_t c = 0; c < k; ++c) {
      bool finite;
      const uint16_t v = load(r * k + c, &finite);
      if (!finite && bad < 0) bad = r * k + c;
      col[(c / kpk) * bn * kpk + c % kpk] = v;
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

int64_t pack_matrix_bf16(const void* src, DType src_dtype, int64_t n, int64_t k, int64_t np, int64_t kp,
                         const LayoutDesc& L, uint16_t* dst) {
  return pack_matrix_bf16_rows(src, src_dtype, n, k, np, kp, L, dst, 0, np / L.block_n);
}

}  // namespace moepack
