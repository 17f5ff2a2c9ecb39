// torch.ops.moepack.pack_weight: the C++ packer of one [E, N, K] weight's codes into a layout
// (moepack/pack: pack_weight_reference is its specification; tests/test_pack.py compares them).
#include "op_common.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>

namespace moepack {
namespace {

std::vector<int64_t> packed_shape(const at::Tensor& w, const LayoutDesc& L, int64_t n_padded, int64_t k_padded) {
  TORCH_CHECK_VALUE(w.dim() == 3, "weight has shape ", shape_str(w), ": must be 3-D [E, N, K]");
  const int64_t np = round_up(w.size(1), L.block_n), kp = round_up(w.size(2), L.k_pack);
  TORCH_CHECK_VALUE(n_padded == 0 || (n_padded >= np && n_padded % L.block_n == 0), "n_padded=", n_padded,
                    " for weight ", shape_str(w), ": must be 0 or a multiple of block_n=", L.block_n, " that is >= ", np);
  TORCH_CHECK_VALUE(k_padded == 0 || (k_padded >= kp && k_padded % L.k_pack == 0), "k_padded=", k_padded,
                    " for weight ", shape_str(w), ": must be 0 or a multiple of k_pack=", L.k_pack, " that is >= ", kp);
  return {w.size(0), n_padded ? n_padded : np, k_padded ? k_padded : kp};
}

// One-byte codes: int8 layouts pack int8 codes, fp8 layouts uint8 e4m3fn bit patterns (scales and
// column sums are separate tensors, moepack/pack); the bytes are moved as they are.
void check_one_byte(const at::Tensor& w, const LayoutDesc& L) {
  if (L.tensors[0].dtype == kTensor_uint8) {
    TORCH_CHECK_TYPE(w.scalar_type() == at::kByte, "weight has dtype ", w.scalar_type(), ": layout ", L.name,
                     " packs one-byte uint8 codes (fp8: a float8_e4m3fn tensor .view(torch.uint8))");
  } else {
    TORCH_CHECK_TYPE(w.scalar_type() == at::kChar, "weight has dtype ", w.scalar_type(), ": layout ", L.name,
                     " packs int8 codes (quantize first: moepack.pack.quantize_int8_per_channel)");
  }
}

bool one_byte_codes(const LayoutDesc& L) {
  return L.weight_bits == 8 && (L.tensors[0].dtype == kTensor_int8 || L.tensors[0].dtype == kTensor_uint8);
}

at::Tensor pack_weight_i8(const at::Tensor& w, const LayoutDesc& L, int64_t n_padded, int64_t k_padded) {
  check_one_byte(w, L);
  auto shape = packed_shape(w, L, n_padded, k_padded);
  at::Tensor src = w.contiguous();
  at::Tensor out = at::empty(shape, w.options());
  const int64_t E = shape[0], n = w.size(1), k = w.size(2), np = shape[1], kp = shape[2];
  const int8_t* sp = static_cast<const int8_t*>(src.data_ptr());
  int8_t* dp = static_cast<int8_t*>(out.data_ptr());
  const int64_t blocks = np / L.block_n;
  at::parallel_for(0, E * blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t x = t / blocks, blk = t % blocks;
      pack_matrix_i8_rows(sp + x * n * k, n, k, np, kp, L, dp + x * np * kp, blk, blk + 1);
    }
  });
  return out;
}

// Sub-byte layouts (int4) pack uint8 codes, one per byte, into the layout's [E, Np, Kp * bits / 8]
// bytes. K padding takes the row's zero point of its group (so it dequantizes to exactly 0:
// moepack.schemes.int4.pack_u4_codes is the rule), or code 0 without `zero`.
void check_sub_byte(const at::Tensor& w, const std::optional<at::Tensor>& zero, const LayoutDesc& L, int64_t kp) {
  const int hi = (1 << L.weight_bits) - 1;
  TORCH_CHECK_TYPE(w.scalar_type() == at::kByte, "weight has dtype ", w.scalar_type(), ": layout ", L.name, " packs ",
                   L.weight_bits, "-bit codes as uint8, one per byte, 0..", hi,
                   L.scheme == kScheme_mxfp4 ? " (e2m1 codes: quantize first with moepack.schemes.mxfp4)"
                                             : " (quantize first: moepack.schemes.int4.quantize_int4_group)");
  if (!zero) return;
  const at::Tensor& z = *zero;
  TORCH_CHECK_TYPE(z.scalar_type() == at::kByte, "zero has dtype ", z.scalar_type(), ": layout ", L.name,
                   "'s zero points are uint8 0..", hi);
  // ng between the groups of the real K and those of the padded K (per channel: 1); padding
  // columns of groups past the last given one take that one (pack_u4_codes's rule)
  // per channel, G = kp; an empty K (kp = 0) has one group, as one of size 1 would give
  const int64_t k = w.size(2), G = L.group_size ? L.group_size : std::max<int64_t>(kp, 1);
  const int64_t lo_ng = std::max<int64_t>(1, (k + G - 1) / G), hi_ng = std::max<int64_t>(1, (kp + G - 1) / G);
  TORCH_CHECK_VALUE(z.dim() == 3 && z.size(0) == w.size(0) && z.size(1) == w.size(1) && z.size(2) >= lo_ng &&
                        z.size(2) <= hi_ng,
                    "zero has shape ", shape_str(z), " for weight ", shape_str(w), ": must be [", w.size(0), ", ", w.size(1),
                    ", ng] (one zero point per row and K group) with ", lo_ng, " <= ng <= ", hi_ng, " (layout ", L.name,
                    L.group_size ? ", group_size " + std::to_string(L.group_size) : std::string(", per channel"),
                    ", K=", k, " padded to ", kp, ")");
}

at::Tensor pack_weight_sub_byte(const at::Tensor& w, const std::optional<at::Tensor>& zero, const LayoutDesc& L,
                                int64_t n_padded, int64_t k_padded) {
  auto shape = packed_shape(w, L, n_padded, k_padded);
  check_sub_byte(w, zero, L, shape[2]);
  const int64_t E = shape[0], n = w.size(1), k = w.size(2), np = shape[1], kp = shape[2];
  const int64_t hi = (1 << L.weight_bits) - 1;
  at::Tensor src = w.contiguous();
  at::Tensor z = zero ? zero->contiguous() : at::Tensor();
  const int64_t ng = zero ? z.size(2) : 1;
  const uint8_t* zp = zero ? z.data_ptr<uint8_t>() : nullptr;
  if (zp) {  // a zero point out of range would be packed masked: refuse it, whether padding uses it or not
    for (int64_t i = 0; i < z.numel(); ++i) {
      TORCH_CHECK_VALUE(zp[i] <= hi, "zero[", i / (n * ng), ", ", (i / ng) % n, ", ", i % ng, "] = ", int(zp[i]),
                        ": layout ", L.name, "'s ", L.weight_bits, "-bit zero points are 0..", hi);
    }
  }
  const int64_t row_bytes = kp * L.weight_bits / 8;
  at::Tensor out = at::empty({E, np, row_bytes}, w.options());
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* dp = out.data_ptr<uint8_t>();
  const int64_t blocks = np / L.block_n;
  std::atomic<int64_t> first_bad{std::numeric_limits<int64_t>::max()};
  // one task = one column block of one expert, as for bf16: a single expert packs on every thread
  at::parallel_for(0, E * blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t x = t / blocks, blk = t % blocks;
      const int64_t bad = pack_matrix_sub_byte_rows(sp + x * n * k, zp ? zp + x * n * ng : nullptr, ng, n, k, np, kp, L,
                                                    dp + x * np * row_bytes, blk, blk + 1);
      if (bad >= 0) {
        int64_t flat = x * n * k + bad, cur = first_bad.load();
        while (flat < cur && !first_bad.compare_exchange_weak(cur, flat)) {
        }
      }
    }
  });
  const int64_t bad = first_bad.load();
  TORCH_CHECK_VALUE(bad == std::numeric_limits<int64_t>::max(), "weight[", bad / (n * k), ", ", (bad / k) % n, ", ",
                    bad % k, "] = ", int(sp[bad]), ": layout ", L.name, "'s ", L.weight_bits, "-bit codes are 0..", hi);
  return out;
}

void check_no_zero(const std::optional<at::Tensor>& zero, const LayoutDesc& L) {
  TORCH_CHECK_VALUE(!zero, "zero is given: layout ", L.name, " stores ", kTensorDtypeNames[L.tensors[0].dtype],
                    " codes, and only sub-byte layouts pad K with zero points");
}

at::Tensor pack_weight_cpu(const at::Tensor& w, int64_t layout, int64_t n_padded, int64_t k_padded,
                           const std::optional<at::Tensor>& zero) {
  const LayoutDesc& L = layout_or_throw(layout);
  check_cpu(w, "weight");
  if (zero) check_cpu(*zero, "zero");
  if (L.weight_bits < 8) return pack_weight_sub_byte(w, zero, L, n_padded, k_padded);
  check_no_zero(zero, L);
  const bool one_byte = one_byte_codes(L);
  TORCH_CHECK_VALUE(one_byte || L.tensors[0].dtype == kTensor_bfloat16, "layout ", L.name, " stores ",
                    kTensorDtypeNames[L.tensors[0].dtype],
                    " codes: pack_weight packs bfloat16, one-byte (int8, uint8) and sub-byte codes");
  if (one_byte) return pack_weight_i8(w, L, n_padded, k_padded);
  const DType dt = dtype_of(w, "weight");
  auto shape = packed_shape(w, L, n_padded, k_padded);
  at::Tensor src = w.contiguous();
  at::Tensor out = at::empty(shape, w.options().dtype(at::kBFloat16));
  const int64_t E = shape[0], n = w.size(1), k = w.size(2), np = shape[1], kp = shape[2];
  const int64_t esz = src.element_size();
  const char* sp = static_cast<const char*>(src.data_ptr());
  uint16_t* dp = static_cast<uint16_t*>(out.data_ptr());
  const int64_t blocks = np / L.block_n;
  std::atomic<int64_t> first_bad{std::numeric_limits<int64_t>::max()};
  // one task = one column block of one expert: a single expert still packs on every thread
  at::parallel_for(0, E * blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t x = t / blocks, blk = t % blocks;
      const int64_t bad = pack_matrix_bf16_rows(sp + x * n * k * esz, dt, n, k, np, kp, L, dp + x * np * kp, blk, blk + 1);
      if (bad >= 0) {
        int64_t flat = x * n * k + bad, cur = first_bad.load();
        while (flat < cur && !first_bad.compare_exchange_weak(cur, flat)) {
        }
      }
    }
  });
  const int64_t bad = first_bad.load();
  TORCH_CHECK_VALUE(bad == std::numeric_limits<int64_t>::max(), "weight[", bad / (n * k), ", ", (bad / k) % n, ", ",
                    bad % k, "] is not finite: weights must be finite");
  return out;
}

at::Tensor pack_weight_meta(const at::Tensor& w, int64_t layout, int64_t n_padded, int64_t k_padded,
                            const std::optional<at::Tensor>& zero) {
  const LayoutDesc& L = layout_or_throw(layout);
  if (L.weight_bits < 8) {
    auto shape = packed_shape(w, L, n_padded, k_padded);
    check_sub_byte(w, zero, L, shape[2]);
    shape[2] = shape[2] * L.weight_bits / 8;
    return at::empty(shape, w.options());
  }
  check_no_zero(zero, L);
  if (one_byte_codes(L)) {
    check_one_byte(w, L);
    return at::empty(packed_shape(w, L, n_padded, k_padded), w.options());
  }
  dtype_of(w, "weight");
  return at::empty(packed_shape(w, L, n_padded, k_padded), w.options().dtype(at::kBFloat16));
}

// A copy of t in memory advised for transparent huge pages (madvise MADV_HUGEPAGE on the 2 MiB
// pages inside it, before the copy touches them): decode streams every weight once, and with 4 KiB
// pages each page is a TLB miss and a restart of the hardware prefetcher (docs/KERNELS.md
// "Decode"). The kernel may decline (THP off, no free huge pages): then it is a plain copy.
at::Tensor huge_page_copy_cpu(const at::Tensor& t) {
  check_cpu(t, "tensor");
  at::Tensor src = t.contiguous();
  at::Tensor out = at::empty_like(src, at::MemoryFormat::Contiguous);
  const int64_t n = int64_t(src.nbytes());
  char* d = static_cast<char*>(out.data_ptr());
  const uintptr_t huge = uintptr_t(2) << 20;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(d) + huge - 1) & ~(huge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(d) + uintptr_t(n)) & ~(huge - 1);
  if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  const char* sp = static_cast<const char*>(src.data_ptr());
  at::parallel_for(0, n, int64_t(1) << 22, [&](int64_t b, int64_t e) { std::memcpy(d + b, sp + b, size_t(e - b)); });
  return out;
}

}  // namespace
}  // namespace moepack

TORCH_LIBRARY_FRAGMENT(moepack, m) {
  m.def("pack_weight(Tensor weight, int layout, int n_padded=0, int k_padded=0, Tensor? zero=None) -> Tensor");
  m.def("huge_page_copy(Tensor tensor) -> Tensor");
}

TORCH_LIBRARY_IMPL(moepack, CPU, m) {
  m.impl("pack_weight", &moepack::pack_weight_cpu);
  m.impl("huge_page_copy", &moepack::huge_page_copy_cpu);
}

TORCH_LIBRARY_IMPL(moepack, Meta, m) { m.impl("pack_weight", &moepack::pack_weight_meta); }
