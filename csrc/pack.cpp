// C++ packer: canonical [N, K] row-major weights -> a bf16 block layout (moepack/layout.py).
// Must equal moepack/pack/reference packer byte for byte (tests/test_pack.py).
#include <cstdint>
#include <cstring>

#include "moepack/kernel.h"
#include "moepack/numeric.h"

namespace moepack {

void pack_matrix_bf16(const void* src, DType src_dtype, int64_t n, int64_t k, int64_t np, int64_t kp,
                      const LayoutDesc& L, uint16_t* dst) {
  const int64_t bn = L.block_n, kpk = L.k_pack;
  std::memset(dst, 0, size_t(np * kp) * 2);  // padding rows/columns are zeros
  for (int64_t r = 0; r < n; ++r) {
    uint16_t* blk = dst + (r / bn) * bn * kp + (r % bn) * kpk;
    for (int64_t c = 0; c < k; ++c) {
      uint16_t v;
      const int64_t i = r * k + c;
      switch (src_dtype) {
        case DType::bf16: v = static_cast<const uint16_t*>(src)[i]; break;
        case DType::f16: v = f32_to_bf16(f16_to_f32(static_cast<const uint16_t*>(src)[i])); break;
        default: v = f32_to_bf16(static_cast<const float*>(src)[i]); break;
      }
      blk[(c / kpk) * bn * kpk + c % kpk] = v;
    }
  }
}

}  // namespace moepack
