// C++ packer: canonical [N, K] row-major weights -> a bf16 block layout, int8 codes -> an int8
// block layout, sub-byte codes -> a sub-byte layout (moepack/layout.py). Where each element goes
// is the generated layout_element_offset / layout_code_position (layouts_gen.h), written once.
// Must equal moepack/pack's reference packer byte for byte (tests/test_pack.py; the sub-byte one:
// tests/cpp kt_seam.inc).
#include <bit>
#include <cstdint>
#include <cstring>

#include "moepack/kernel.h"
#include "moepack/numeric.h"

namespace moepack {
// The sub-byte packer reads a run's k_pack one-byte codes as one integer, code j = byte j
// (moepack/pack/codes.py does the same and asserts the same).
static_assert(std::endian::native == std::endian::little, "moepack's packers assume a little-endian machine");

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

namespace {

// How the k_pack one-byte codes of a run, read as one little-endian word w (code j = byte j),
// become the run's packed bytes: code j moves by a fixed distance d_j = its packed bit
// (layout_code_position in the first run) - 8j, so the packed word is the OR over the distinct
// distances d of shift(w, d) & (the fields of the codes moved by d). The u4 x86 nibble order
// has two distances (codes 0..3 stay, 4..7 move down 28 bits): two shift-and-mask steps per
// run of 8 codes instead of one layout_code_position (divisions) per code.
struct RunMoves {
  int count = 0;
  int dist[8];
  uint64_t field[8];
};

RunMoves run_moves(const LayoutDesc& L, int64_t kp) {
  RunMoves m;
  const uint64_t mask = (uint64_t(1) << L.weight_bits) - 1;
  for (int64_t j = 0; j < L.k_pack; ++j) {
    const CodePosition p = layout_code_position(L, 0, j, kp);  // the first run starts at bit 0
    const int to = int(8 * p.byte + p.shift), d = to - int(8 * j);
    int i = 0;
    while (i < m.count && m.dist[i] != d) ++i;
    if (i == m.count) {
      m.dist[m.count] = d;
      m.field[m.count++] = 0;
    }
    m.field[i] |= mask << to;
  }
  return m;
}

template <int KPK>  // k_pack as a constant where it is one of the common ones (0: read from L)
uint64_t pack_sub_byte_whole_runs(const uint8_t* row, int64_t runs, int64_t kpk_rt, const RunMoves& m,
                                  uint64_t high, uint8_t* out, int64_t run_stride, int64_t run_bytes) {
  const int64_t kpk = KPK ? KPK : kpk_rt;
  uint64_t any_high = 0;
  for (int64_t kk = 0; kk < runs; ++kk) {
    uint64_t w = 0, packed = 0;
    std::memcpy(&w, row + kk * kpk, size_t(kpk));
    any_high |= w & high;
    for (int i = 0; i < m.count; ++i) packed |= (m.dist[i] >= 0 ? w << m.dist[i] : w >> -m.dist[i]) & m.field[i];
    std::memcpy(out + kk * run_stride, &packed, size_t(run_bytes));
  }
  return any_high;
}

}  // namespace

int64_t pack_matrix_sub_byte_rows(const uint8_t* src, const uint8_t* zero, int64_t ng, int64_t n, int64_t k, int64_t np,
                                  int64_t kp, const LayoutDesc& L, uint8_t* dst, int64_t block_begin, int64_t block_end) {
  const int64_t bn = L.block_n, kpk = L.k_pack, bits = L.weight_bits;
  const int64_t G = L.group_size ? L.group_size : (kp > 0 ? kp : 1);  // per channel; an empty K is one group
  const int mask = (1 << bits) - 1;
  const int64_t run_bytes = kpk * bits / 8;  // a column's run of k_pack codes is whole bytes (layouts_gen.h asserts)
  (void)np;
  std::memset(dst + block_begin * bn * kp * bits / 8, 0, size_t((block_end - block_begin) * bn * kp * bits / 8));  // padded rows: code 0
  const int64_t r0 = block_begin * bn < n ? block_begin * bn : n;
  const int64_t r1 = block_end * bn < n ? block_end * bn : n;
  // Runs wholly inside the real K go a word at a time (RunMoves), where a run's codes and its
  // bytes each fit 64 bits: every run starts on a byte (layout_element_offset of a K multiple
  // of k_pack is a multiple of k_pack), so the moves of the first run are those of every run,
  // as moepack/pack/codes.py's _runs has it too.
  const bool by_runs = kpk <= 8;
  const RunMoves moves = by_runs ? run_moves(L, kp) : RunMoves{};
  uint64_t high = 0;  // bits above the code width in each of the k_pack source bytes: a code out of range
  for (int64_t j = 0; j < kpk && j < 8; ++j) high |= uint64_t(0xff & ~mask) << (8 * j);
  const int64_t full_runs = by_runs ? k / kpk : 0;
  // consecutive runs of one column are one K step of its block apart
  const int64_t run_stride = (layout_element_offset(L, 0, kpk, kp) - layout_element_offset(L, 0, 0, kp)) * bits / 8;
  uint64_t any_high = 0;
  int any_bad = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = src + r * k;
    uint8_t* out = dst + layout_element_offset(L, r, 0, kp) * bits / 8;
    any_high |= kpk == 8 ? pack_sub_byte_whole_runs<8>(row, full_runs, kpk, moves, high, out, run_stride, run_bytes)
                         : pack_sub_byte_whole_runs<0>(row, full_runs, kpk, moves, high, out, run_stride, run_bytes);
    // the rest (the run with K padding, or every code of a layout whose runs are wider): one
    // code at a time. K padding holds the row's zero point of its group, so it dequantizes to
    // exactly 0; group indices past the last given zero point take that one.
    for (int64_t c = full_runs * kpk; c < kp; ++c) {
      int code;
      if (c < k) {
        code = row[c];
        any_bad |= code & ~mask;
      } else {
        const int64_t g = c / G < ng ? c / G : ng - 1;
        code = zero ? zero[r * ng + g] : 0;
      }
      const CodePosition p = layout_code_position(L, r, c, kp);
      dst[p.byte] = uint8_t((dst[p.byte] & ~(mask << p.shift)) | ((code & mask) << p.shift));
    }
  }
  if (!any_high && !any_bad) return -1;
  for (int64_t i = r0 * k; i < r1 * k; ++i) {  // rare: the first code out of range in row-major order
    if (src[i] > mask) return i;
  }
  return -1;  // not reached
}

void pack_matrix_sub_byte(const uint8_t* src, const uint8_t* zero, int64_t n, int64_t k, int64_t np, int64_t kp,
                          const LayoutDesc& L, uint8_t* dst) {
  const int64_t G = L.group_size ? L.group_size : (kp > 0 ? kp : 1);  // per channel; an empty K is one group
  pack_matrix_sub_byte_rows(src, zero, (kp + G - 1) / G, n, k, np, kp, L, dst, 0, np / L.block_n);
}

void pack_matrix_i8(const int8_t* src, int64_t n, int64_t k, int64_t np, int64_t kp, const LayoutDesc& L, int8_t* dst) {
  pack_matrix_i8_rows(src, n, k, np, kp, L, dst, 0, np / L.block_n);
}

int64_t pack_matrix_bf16(const void* src, DType src_dtype, int64_t n, int64_t k, int64_t np, int64_t kp,
                         const LayoutDesc& L, uint16_t* dst) {
  return pack_matrix_bf16_rows(src, src_dtype, n, k, np, kp, L, dst, 0, np / L.block_n);
}

}  // namespace moepack
