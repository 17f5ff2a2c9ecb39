// The only file that sees at::Tensor: TORCH_LIBRARY(moepack) schemas, CPU and Meta kernels.
// Every argument rule is checked here, before a kernel runs, and a refusal names the argument,
// the value and the rule (ValueError / TypeError / IndexError on the Python side).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "moepack/kernel.h"

namespace moepack {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

const LayoutDesc& layout_or_throw(int64_t id) {
  const LayoutDesc* L = layout_find(int32_t(id));
  TORCH_CHECK_VALUE(L != nullptr, "layout=", id, " is unknown to this build of moepack (known ids: 1..", kMaxLayoutId,
                    ")");
  return *L;
}

Activation parse_activation(const std::string& s) {
  if (s == "silu") return Activation::silu;
  if (s == "gelu") return Activation::gelu;
  if (s == "gelu_tanh") return Activation::gelu_tanh;
  if (s == "swigluoai") return Activation::swigluoai;
  TORCH_CHECK_VALUE(false, "activation='", s, "' is not one of silu, gelu, gelu_tanh, swigluoai");
}

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: TORCH_CHECK_TYPE(false, name, " has dtype ", t.scalar_type(), ": must be float32, bfloat16 or float16");
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_meta(), name, " is on ", t.device(), ": moepack runs on the CPU");
}

void check_exact(const at::Tensor& t, const char* name, at::ScalarType st, std::vector<int64_t> shape,
                 const char* rule) {
  check_cpu(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == st, name, " has dtype ", t.scalar_type(), ": must be ", st);
  TORCH_CHECK_VALUE(t.sizes().vec() == shape, name, " has shape ", shape_str(t), ": must be ", at::IntArrayRef(shape),
                    " (", rule, ")");
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " with shape ", shape_str(t), " is not contiguous: must be contiguous");
}

// int32 accumulators of A8 layouts: |acc| <= 128 * 127 * K must fit.
constexpr int64_t kMaxI8K = (int64_t(1) << 31) / (128 * 127);

at::ScalarType scalar_type_of(int32_t tensor_dtype) {
  switch (tensor_dtype) {
    case kTensor_bfloat16: return at::kBFloat16;
    case kTensor_int8: return at::kChar;
    case kTensor_uint8: return at::kByte;
    case kTensor_float32: return at::kFloat;
    default: return at::kInt;  // kTensor_int32
  }
}

const char* role_name(int32_t role) {
  switch (role) {
    case kRole_codes: return "codes";
    case kRole_scale: return "scales";
    case kRole_zero: return "zero points";
    default: return "sums";
  }
}

// One packed weight given as a tensor list: exactly the layout's declared tensors, in declared
// order, each with the declared dtype and the shape layout_shapes.h computes (docs/PACKED_FORMAT.md).
void check_weight(const at::TensorList& ts, const char* weight, const LayoutDesc& L, int64_t E, const WeightDims& d,
                  const std::string& note, PackedWeight* out) {
  std::string names;
  for (int i = 0; i < L.num_tensors; ++i) names += std::string(i ? ", " : "") + weight + L.tensors[i].suffix;
  TORCH_CHECK_VALUE(int64_t(ts.size()) == L.num_tensors, weight, " is a list of ", ts.size(), " tensors: layout ",
                    L.name, " packs a weight as ", L.num_tensors, " (", names, ")");
  for (int i = 0; i < L.num_tensors; ++i) {
    const TensorDesc& td = L.tensors[i];
    const std::string name = std::string(weight) + "[" + std::to_string(i) + "] (" + weight + td.suffix + ")";
    int64_t shape[3];
    const int nd = tensor_shape(L, td, E, d, shape);
    const std::string rule = std::string(kTensorDtypeNames[td.dtype]) + " " + role_name(td.role) + " of layout " + L.name +
                             ": " + td.note + "; " + note;
    check_exact(ts[size_t(i)], name.c_str(), scalar_type_of(td.dtype), std::vector<int64_t>(shape, shape + nd),
                rule.c_str());
    if (out) out->t[i] = ts[size_t(i)].data_ptr();
  }
}

// Validates every shape/dtype rule and fills the kernel arguments (pointers only when `data`).
FusedMoeArgs check_fused(const at::Tensor& x, const at::TensorList& w13, const at::TensorList& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t layout, bool interleaved,
                         const std::string& activation, double alpha, double limit,
                         const std::optional<at::Tensor>& b13, const std::optional<at::Tensor>& b2,
                         const std::optional<at::Tensor>& expert_map, bool data) {
  FusedMoeArgs a;
  const LayoutDesc& L = layout_or_throw(layout);
  a.layout = &L;
  a.act = parse_activation(activation);
  a.interleaved = interleaved;
  check_cpu(x, "hidden_states");
  a.dtype = dtype_of(x, "hidden_states");
  TORCH_CHECK_VALUE(x.dim() == 2, "hidden_states has shape ", shape_str(x), ": must be 2-D [tokens, hidden]");
  TORCH_CHECK_VALUE(x.size(1) == 0 || x.stride(1) == 1, "hidden_states has strides ", x.strides(),
                    ": the hidden dimension must be contiguous (stride 1)");
  a.tokens = x.size(0);
  a.hidden = x.size(1);
  a.x_stride = x.stride(0);
  TORCH_CHECK_VALUE(a.hidden > 0, "hidden_states has shape ", shape_str(x), ": hidden size must be positive");
  // E and Ip come from the codes of w13 ([E, 2*Ip, ...] for every layout); everything else is
  // then determined by the layout's declaration.
  TORCH_CHECK_VALUE(!w13.empty() && !w2.empty(), "w13 / w2 are lists of ", w13.size(), " / ", w2.size(),
                    " tensors: each needs the layout's tensors, the codes first");
  const at::Tensor& c13 = w13[0];
  check_cpu(c13, "w13[0] (w13)");
  TORCH_CHECK_VALUE(c13.dim() == 3, "w13[0] (w13) has shape ", shape_str(c13), ": must be packed 3-D [E, 2*Ip, ...]");
  const int64_t E = c13.size(0);
  TORCH_CHECK_VALUE(E > 0, "w13[0] (w13) has shape ", shape_str(c13), ": needs at least one expert");
  TORCH_CHECK_VALUE(c13.size(1) % (2 * L.i_align) == 0 && c13.size(1) > 0, "w13[0] (w13) has shape ", shape_str(c13),
                    ": dim 1 is 2*Ip and Ip must be a positive multiple of ", L.i_align, " for layout ", L.name);
  a.num_experts = E;
  a.inter_padded = c13.size(1) / 2;
  const std::string hnote = "H=" + std::to_string(a.hidden) + " from hidden_states, Ip=" +
                            std::to_string(a.inter_padded) + " from w13[0]";
  check_weight(w13, "w13", L, E, w13_dims(L, a.hidden, a.inter_padded), "w13 is [E, 2*Ip, H padded to k_pack], " + hnote,
               data ? &a.w13 : nullptr);
  check_weight(w2, "w2", L, E, w2_dims(L, a.hidden, a.inter_padded), "w2 is [E, H padded to block_n, Ip], " + hnote,
               data ? &a.w2 : nullptr);
  if (L.act_modes & kAct_a8) {
    const int64_t kp1 = w13_dims(L, a.hidden, a.inter_padded).kp;
    TORCH_CHECK_VALUE(kp1 <= kMaxI8K && a.inter_padded <= kMaxI8K, "layout ", L.name, " (int8 activations) with H=",
                      a.hidden, ", Ip=", a.inter_padded, ": both must be <= ", kMaxI8K, " (int32 accumulators)");
  }
  const int64_t np2 = w2_dims(L, a.hidden, a.inter_padded).np;
  if (b13) check_exact(*b13, "w13_bias", at::kFloat, {E, 2 * a.inter_padded}, "fp32 [E, 2*Ip] in packed row order");
  if (b2) check_exact(*b2, "w2_bias", at::kFloat, {E, np2}, ("fp32 [E, H padded to block_n], " + hnote).c_str());
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == a.tokens && topk_ids.size(1) > 0, "topk_ids has shape ",
                    shape_str(topk_ids), ": must be [tokens=", a.tokens, ", k] with k >= 1");
  a.topk = topk_ids.size(1);
  check_exact(topk_ids, "topk_ids", at::kInt, {a.tokens, a.topk}, "int32 [tokens, k]");
  check_exact(topk_weights, "topk_weights", at::kFloat, {a.tokens, a.topk}, "fp32, same shape as topk_ids");
  if (expert_map) {
    check_cpu(*expert_map, "expert_map");
    TORCH_CHECK_TYPE(expert_map->scalar_type() == at::kInt, "expert_map has dtype ", expert_map->scalar_type(),
                     ": must be int32");
    TORCH_CHECK_VALUE(expert_map->dim() == 1 && expert_map->size(0) >= E && expert_map->is_contiguous(),
                      "expert_map has shape ", shape_str(*expert_map),
                      ": must be contiguous 1-D [E_global] with E_global >= local experts (", E, ")");
    a.num_global_experts = expert_map->size(0);
  } else {
    a.num_global_experts = E;
  }
  TORCH_CHECK_VALUE(std::isfinite(alpha) && std::isfinite(limit) && limit > 0, "swigluoai alpha=", alpha,
                    ", limit=", limit, ": both must be finite and limit > 0");
  a.alpha = float(alpha);
  a.limit = float(limit);
  if (data) {
    a.b13 = b13 ? b13->data_ptr<float>() : nullptr;
    a.b2 = b2 ? b2->data_ptr<float>() : nullptr;
  }
  return a;
}

void parallel_run(void*, int64_t n, ParallelBody body, void* ctx) {
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) { body(ctx, b, e); });
}

bool strict_mode() {
  const char* v = std::getenv("MOEPACK_STRICT");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

Selection select_or_throw(int64_t layout) {
  Isa cap;
  try {
    cap = env_max_isa();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  Selection sel = select_fused(int32_t(layout), cap);
  TORCH_CHECK_VALUE(sel.fn != nullptr, sel.reason);
  TORCH_CHECK(!strict_mode() || !sel.fallback, "MOEPACK_STRICT=1 refuses a fallback: ", sel.reason);
  return sel;
}

at::Tensor fused_experts_cpu(const at::Tensor& x, at::TensorList w13, at::TensorList w2, const at::Tensor& topk_weights,
                             const at::Tensor& topk_ids, int64_t layout, bool interleaved, std::string_view activation,
                             double alpha, double limit, const std::optional<at::Tensor>& b13,
                             const std::optional<at::Tensor>& b2, const std::optional<at::Tensor>& expert_map) {
  FusedMoeArgs a = check_fused(x, w13, w2, topk_weights, topk_ids, layout, interleaved, std::string(activation), alpha,
                               limit, b13, b2, expert_map, /*data=*/true);
  at::Tensor out = at::empty({a.tokens, a.hidden}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (a.tokens == 0) return out;
  a.x = x.data_ptr();
  a.out = out.data_ptr();
  a.topk_weights = topk_weights.data_ptr<float>();
  a.topk_ids = topk_ids.data_ptr<int32_t>();
  a.expert_map = expert_map ? expert_map->data_ptr<int32_t>() : nullptr;
  char buf[256];
  const char* err = fused_moe_check_routing(a, buf, sizeof(buf));
  TORCH_CHECK_INDEX(err == nullptr, err);
  Selection sel = select_or_throw(layout);
  a.par.run = parallel_run;
  a.par.num_threads = at::get_num_threads();
  {
    at::NoGradGuard no_grad;
    sel.fn(a);
  }
  return out;
}

// The Meta kernel: the same declaration-driven checks, no data.
at::Tensor fused_experts_meta(const at::Tensor& x, at::TensorList w13, at::TensorList w2, const at::Tensor& topk_weights,
                              const at::Tensor& topk_ids, int64_t layout, bool interleaved, std::string_view activation,
                              double alpha, double limit, const std::optional<at::Tensor>& b13,
                              const std::optional<at::Tensor>& b2, const std::optional<at::Tensor>& expert_map) {
  FusedMoeArgs a = check_fused(x, w13, w2, topk_weights, topk_ids, layout, interleaved, std::string(activation), alpha,
                               limit, b13, b2, expert_map, /*data=*/false);
  return at::empty({a.tokens, a.hidden}, x.options());
}

std::vector<int64_t> packed_shape(const at::Tensor& w, const LayoutDesc& L, int64_t n_padded, int64_t k_padded) {
  TORCH_CHECK_VALUE(w.dim() == 3, "weight has shape ", shape_str(w), ": must be 3-D [E, N, K]");
  const int64_t np = round_up(w.size(1), L.block_n), kp = round_up(w.size(2), L.k_pack);
  TORCH_CHECK_VALUE(n_padded == 0 || (n_padded >= np && n_padded % L.block_n == 0), "n_padded=", n_padded,
                    " for weight ", shape_str(w), ": must be 0 or a multiple of block_n=", L.block_n, " that is >= ", np);
  TORCH_CHECK_VALUE(k_padded == 0 || (k_padded >= kp && k_padded % L.k_pack == 0), "k_padded=", k_padded,
                    " for weight ", shape_str(w), ": must be 0 or a multiple of k_pack=", L.k_pack, " that is >= ", kp);
  return {w.size(0), n_padded ? n_padded : np, k_padded ? k_padded : kp};
}

// int8 layouts pack int8 codes (scales and column sums are separate tensors, moepack/pack).
at::Tensor pack_weight_i8(const at::Tensor& w, const LayoutDesc& L, int64_t n_padded, int64_t k_padded) {
  TORCH_CHECK_TYPE(w.scalar_type() == at::kChar, "weight has dtype ", w.scalar_type(), ": layout ", L.name,
                   " packs int8 codes (quantize first: moepack.pack.quantize_int8_per_channel)");
  auto shape = packed_shape(w, L, n_padded, k_padded);
  at::Tensor src = w.contiguous();
  at::Tensor out = at::empty(shape, w.options());
  const int64_t E = shape[0], n = w.size(1), k = w.size(2), np = shape[1], kp = shape[2];
  const int8_t* sp = src.data_ptr<int8_t>();
  int8_t* dp = out.data_ptr<int8_t>();
  const int64_t blocks = np / L.block_n;
  at::parallel_for(0, E * blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t x = t / blocks, blk = t % blocks;
      pack_matrix_i8_rows(sp + x * n * k, n, k, np, kp, L, dp + x * np * kp, blk, blk + 1);
    }
  });
  return out;
}

at::Tensor pack_weight_cpu(const at::Tensor& w, int64_t layout, int64_t n_padded, int64_t k_padded) {
  const LayoutDesc& L = layout_or_throw(layout);
  check_cpu(w, "weight");
  TORCH_CHECK_VALUE(L.tensors[0].dtype == kTensor_int8 || L.tensors[0].dtype == kTensor_bfloat16, "layout ", L.name,
                    " stores ", kTensorDtypeNames[L.tensors[0].dtype], " codes: pack_weight packs bfloat16 and int8 codes");
  if (L.tensors[0].dtype == kTensor_int8) return pack_weight_i8(w, L, n_padded, k_padded);
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

at::Tensor pack_weight_meta(const at::Tensor& w, int64_t layout, int64_t n_padded, int64_t k_padded) {
  const LayoutDesc& L = layout_or_throw(layout);
  if (L.tensors[0].dtype == kTensor_int8) {
    TORCH_CHECK_TYPE(w.scalar_type() == at::kChar, "weight has dtype ", w.scalar_type(), ": layout ", L.name,
                     " packs int8 codes (quantize first: moepack.pack.quantize_int8_per_channel)");
    return at::empty(packed_shape(w, L, n_padded, k_padded), w.options());
  }
  dtype_of(w, "weight");
  return at::empty(packed_shape(w, L, n_padded, k_padded), w.options().dtype(at::kBFloat16));
}

Isa parse_isa(std::string_view name) {
  for (int i = 0; i < kNumIsa; ++i) {
    if (name == isa_name(Isa(i))) return Isa(i);
  }
  TORCH_CHECK_VALUE(false, "isa='", name, "' is not one of ", kIsaNames);
}

// Test hook (SEMANTICS.md §4: SIMD integer dot products identical to scalar): the int32
// accumulators of exactly `isa`'s int8 block GEMM. rows int8 [m, kp], block int8 [block_n * kp]
// (one packed column block), colsum int32 [block_n] -> int32 [m, block_n].
at::Tensor gemm_i8_block_cpu(const at::Tensor& rows, const at::Tensor& block, const at::Tensor& colsum, int64_t layout,
                             std::string_view isa) {
  const LayoutDesc& L = layout_or_throw(layout);
  TORCH_CHECK_VALUE(L.scheme == kScheme_int8_channel, "layout ", L.name, " is not an int8_channel layout");
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(1) % L.k_pack == 0 && rows.size(1) <= kMaxI8K, "rows has shape ",
                    shape_str(rows), ": must be [m, kp] with kp a multiple of k_pack=", L.k_pack, " and <= ", kMaxI8K);
  const int64_t m = rows.size(0), kp = rows.size(1);
  check_exact(rows, "rows", at::kChar, {m, kp}, "int8 [m, kp]");
  check_exact(block, "block", at::kChar, {L.block_n * kp}, "one packed int8 column block [block_n * kp]");
  check_exact(colsum, "colsum", at::kInt, {L.block_n}, "int32 [block_n]");
  const Isa want = parse_isa(isa);
  Int8BlockGemmFn fn = find_gemm_i8(int32_t(layout), want);
  TORCH_CHECK_VALUE(fn != nullptr, "no ", isa_name(want), " int8 block GEMM for layout ", L.name, " on this CPU",
                    isa_unavailable_reason(want) ? std::string(" (") + isa_unavailable_reason(want) + ")" : "");
  at::Tensor out = at::empty({m, L.block_n}, rows.options().dtype(at::kInt));
  std::vector<const int8_t*> ptrs(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) ptrs[size_t(i)] = rows.data_ptr<int8_t>() + i * kp;
  if (m > 0) fn(L, ptrs.data(), int(m), block.data_ptr<int8_t>(), kp, colsum.data_ptr<int32_t>(), out.data_ptr<int32_t>());
  return out;
}

// Benchmark baseline (moepack bench): reads every byte of experts `ids` of the packed w13 and
// w2 ([E, ...], contiguous) on the extension's threads, in 64 KiB pieces, and returns a checksum
// (so the reads cannot be elided). Timed next to fused_experts on the same experts, it says how
// close the kernel is to merely reading its weights on this machine at this moment.
int64_t read_experts_cpu(const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& ids) {
  TORCH_CHECK_VALUE(w13.device().is_cpu() && w2.device().is_cpu() && ids.device().is_cpu(),
                    "read_experts: every tensor must be on the CPU");
  TORCH_CHECK_VALUE(w13.is_contiguous() && w2.is_contiguous() && w13.dim() >= 1 && w2.dim() >= 1 &&
                        w13.size(0) == w2.size(0),
                    "read_experts: w13 ", shape_str(w13), " and w2 ", shape_str(w2),
                    " must be contiguous with the same leading expert dimension");
  TORCH_CHECK_VALUE(ids.dim() == 1 && (ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong),
                    "read_experts: ids must be a 1-D int32 or int64 tensor, got ", shape_str(ids), " ", ids.scalar_type());
  const int64_t E = w13.size(0);
  const at::Tensor id64 = ids.to(at::kLong).contiguous();
  constexpr int64_t kPiece = 65536;
  std::vector<std::pair<const char*, int64_t>> pieces;
  for (int64_t i = 0; i < id64.numel(); ++i) {
    const int64_t e = id64.data_ptr<int64_t>()[i];
    TORCH_CHECK_INDEX(e >= 0 && e < E, "read_experts: ids[", i, "] = ", e, " is out of range [0, ", E, ")");
    for (const at::Tensor* w : {&w13, &w2}) {
      const int64_t per = w->nbytes() / E;
      const char* base = static_cast<const char*>(w->data_ptr()) + e * per;
      for (int64_t off = 0; off < per; off += kPiece) pieces.emplace_back(base + off, std::min(kPiece, per - off));
    }
  }
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, int64_t(pieces.size()), 1, [&](int64_t b, int64_t e) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (int64_t p = b; p < e; ++p) {
      const char* q = pieces[size_t(p)].first;
      const int64_t n = pieces[size_t(p)].second;
      int64_t k = 0;
      for (; k + 32 <= n; k += 32) {
        uint64_t v[4];
        std::memcpy(v, q + k, 32);
        a0 += v[0];
        a1 += v[1];
        a2 += v[2];
        a3 += v[3];
      }
      for (; k < n; ++k) a0 += uint8_t(q[k]);
    }
    total.fetch_add(a0 + a1 + a2 + a3, std::memory_order_relaxed);
  });
  return int64_t(total.load());
}

// The compiled layout table, for tests/test_layout_sync.py: (name, numbers, tensors as
// "role:suffix:dtype:shape" with the enums' indices).
std::tuple<std::string, std::vector<int64_t>, std::vector<std::string>> layout_desc(int64_t id) {
  const LayoutDesc& L = layout_or_throw(id);
  std::vector<std::string> tensors;
  for (int i = 0; i < L.num_tensors; ++i) {
    const TensorDesc& t = L.tensors[i];
    tensors.push_back(std::to_string(t.role) + ":" + t.suffix + ":" + std::to_string(t.dtype) + ":" + std::to_string(t.shape));
  }
  return {L.name,
          {L.id, L.weight_dtype, L.weight_bits, L.group_size, L.block_n, L.k_pack, L.scale_dtype, L.zero_kind, L.family,
           L.i_align, L.scheme, L.act_modes},
          tensors};
}

// (isa, reason, is_fallback): is_fallback is Selection::fallback, what MOEPACK_STRICT refuses.
std::tuple<std::string, std::string, bool> kernel_choice(int64_t layout) {
  Isa cap;
  try {
    cap = env_max_isa();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  Selection sel = select_fused(int32_t(layout), cap);
  TORCH_CHECK_VALUE(sel.fn != nullptr, sel.reason);
  return {isa_name(sel.isa), sel.reason, sel.fallback};
}

std::vector<std::string> cpu_flags() {
  const CpuFeatures& f = cpu_features();
  std::vector<std::string> out;
#define MOEPACK_ADD_FEATURE(name) \
  if (f.name) out.emplace_back(#name);
  MOEPACK_CPU_FEATURES(MOEPACK_ADD_FEATURE)
#undef MOEPACK_ADD_FEATURE
  out.emplace_back(std::string("host_isa=") + isa_name(host_isa()));
  std::string avail = "available_isas=";
  for (int i = 0; i < kNumIsa; ++i) {
    if (isa_unavailable_reason(Isa(i)) == nullptr) avail += std::string(i ? "," : "") + isa_name(Isa(i));
  }
  out.push_back(avail);
  return out;
}

}  // namespace
}  // namespace moepack

TORCH_LIBRARY(moepack, m) {
  m.def(
      "fused_experts(Tensor hidden_states, Tensor[] w13, Tensor[] w2, Tensor topk_weights, Tensor topk_ids, "
      "int layout, *, bool interleaved=False, str activation=\"silu\", float alpha=1.702, float limit=7.0, "
      "Tensor? w13_bias=None, Tensor? w2_bias=None, Tensor? expert_map=None) -> Tensor");
  m.def("pack_weight(Tensor weight, int layout, int n_padded=0, int k_padded=0) -> Tensor");
  m.def("gemm_i8_block(Tensor rows, Tensor block, Tensor colsum, int layout, str isa) -> Tensor");
  m.def("read_experts(Tensor w13, Tensor w2, Tensor ids) -> int");
  m.def("layout_desc(int layout) -> (str, int[], str[])", &moepack::layout_desc);
  m.def("kernel_choice(int layout) -> (str, str, bool)", &moepack::kernel_choice);
  m.def("cpu_flags() -> str[]", &moepack::cpu_flags);
}

TORCH_LIBRARY_IMPL(moepack, CPU, m) {
  m.impl("fused_experts", &moepack::fused_experts_cpu);
  m.impl("pack_weight", &moepack::pack_weight_cpu);
  m.impl("gemm_i8_block", &moepack::gemm_i8_block_cpu);
  m.impl("read_experts", &moepack::read_experts_cpu);
}

TORCH_LIBRARY_IMPL(moepack, Meta, m) {
  m.impl("fused_experts", &moepack::fused_experts_meta);
  m.impl("pack_weight", &moepack::pack_weight_meta);
}

// ---------------------------------------------------------------------------------------------
// moepack::route: router logits -> (topk_weights, topk_ids). Kernel: csrc/routing.cpp;
// semantics: docs/ROUTING.md.
#include <limits>

#include "moepack/routing.h"

namespace moepack {
namespace {

// Validates every argument rule (shapes, dtypes, method constraints) and fills RouteArgs
// (pointers are filled by the CPU impl).
RouteArgs check_route(const at::Tensor& logits, int64_t top_k, std::string_view method, bool renormalize,
                      int64_t num_expert_group, int64_t topk_group, const std::optional<at::Tensor>& bias,
                      double routed_scaling_factor, double sparsemixer_eps) {
  RouteArgs a;
  const std::string mname(method);
  TORCH_CHECK_VALUE(route_method_parse(mname.c_str(), &a.method), "method='", mname,
                    "' is not one of softmax, sigmoid, grouped_softmax, grouped_sigmoid, topk_softmax, llama4, "
                    "sparsemixer");
  check_cpu(logits, "router_logits");
  a.logits_dtype = dtype_of(logits, "router_logits");
  TORCH_CHECK_VALUE(logits.dim() == 2, "router_logits has shape ", shape_str(logits),
                    ": must be 2-D [tokens, experts]");
  a.tokens = logits.size(0);
  a.experts = logits.size(1);
  TORCH_CHECK_VALUE(a.experts >= 1, "router_logits has shape ", shape_str(logits), ": needs at least one expert");
  TORCH_CHECK_VALUE(a.experts <= std::numeric_limits<int32_t>::max(), "router_logits has ", a.experts,
                    " experts: topk_ids are int32");
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= a.experts, "top_k=", top_k, " with ", a.experts,
                    " experts: must be in [1, experts]");
  a.topk = top_k;
  const bool grouped = a.method == RouteMethod::grouped_softmax || a.method == RouteMethod::grouped_sigmoid;
  if (grouped) {
    TORCH_CHECK_VALUE(num_expert_group >= 1, "num_expert_group=", num_expert_group, ": method ", mname,
                      " needs num_expert_group >= 1");
    TORCH_CHECK_VALUE(a.experts % num_expert_group == 0, "num_expert_group=", num_expert_group, " does not divide ",
                      a.experts, " experts (router_logits ", shape_str(logits),
                      "): experts must be a multiple of num_expert_group");
    TORCH_CHECK_VALUE(topk_group >= 1 && topk_group <= num_expert_group, "topk_group=", topk_group,
                      ": must be in [1, num_expert_group=", num_expert_group, "]");
    const int64_t kept = topk_group * (a.experts / num_expert_group);
    TORCH_CHECK_VALUE(top_k <= kept, "top_k=", top_k, " exceeds the ", kept, " experts of the topk_group=", topk_group,
                      " kept groups (", a.experts / num_expert_group, " experts per group)");
    a.groups = num_expert_group;
    a.topk_group = topk_group;
  } else {
    TORCH_CHECK_VALUE(num_expert_group <= 1 && topk_group <= 1 && num_expert_group >= 0 && topk_group >= 0,
                      "num_expert_group=", num_expert_group, ", topk_group=", topk_group, ": method ", mname,
                      " takes no groups (use grouped_softmax or grouped_sigmoid)");
  }
  if (a.method == RouteMethod::llama4)
    TORCH_CHECK_VALUE(top_k == 1, "top_k=", top_k, ": method llama4 routes each token to exactly one expert (top_k=1)");
  if (a.method == RouteMethod::sparsemixer) {
    TORCH_CHECK_VALUE(top_k == 2, "top_k=", top_k, ": method sparsemixer is defined for top_k=2");
    TORCH_CHECK_VALUE(std::isfinite(sparsemixer_eps) && sparsemixer_eps >= 0, "sparsemixer_eps=", sparsemixer_eps,
                      ": must be finite and >= 0");
  }
  a.sparsemixer_eps = float(sparsemixer_eps);
  const bool fixed_weights = a.method == RouteMethod::topk_softmax || a.method == RouteMethod::llama4 ||
                             a.method == RouteMethod::sparsemixer;
  TORCH_CHECK_VALUE(!(renormalize && fixed_weights), "renormalize=True with method ", mname,
                    ": only softmax, sigmoid, grouped_softmax and grouped_sigmoid renormalize");
  a.renormalize = renormalize;
  if (bias) {
    TORCH_CHECK_VALUE(!fixed_weights, "correction_bias given with method ", mname,
                      ": only softmax, sigmoid, grouped_softmax and grouped_sigmoid take an e_score_correction_bias");
    check_exact(*bias, "correction_bias", at::kFloat, {a.experts}, "fp32 [experts], one per expert of router_logits");
  }
  TORCH_CHECK_VALUE(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0, "routed_scaling_factor=",
                    routed_scaling_factor, ": must be finite and > 0");
  a.scale = float(routed_scaling_factor);
  return a;
}

std::tuple<at::Tensor, at::Tensor> route_cpu(const at::Tensor& logits, int64_t top_k, std::string_view method,
                                             bool renormalize, int64_t num_expert_group, int64_t topk_group,
                                             const std::optional<at::Tensor>& bias, double routed_scaling_factor,
                                             double sparsemixer_eps) {
  RouteArgs a = check_route(logits, top_k, method, renormalize, num_expert_group, topk_group, bias,
                            routed_scaling_factor, sparsemixer_eps);
  at::Tensor w = at::empty({a.tokens, a.topk}, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({a.tokens, a.topk}, logits.options().dtype(at::kInt));
  if (a.tokens == 0) return {w, ids};
  at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  a.logits = x.data_ptr();
  a.logits_stride = x.stride(0);
  if (bias) {
    a.bias = bias->data_ptr<float>();
    for (int64_t e = 0; e < a.experts; ++e)
      TORCH_CHECK_VALUE(std::isfinite(a.bias[e]), "correction_bias[", e, "] is ", a.bias[e], ": must be finite");
  }
  a.weights = w.data_ptr<float>();
  a.ids = ids.data_ptr<int32_t>();
  a.par.run = parallel_run;
  a.par.num_threads = at::get_num_threads();
  RouteError err = route_tokens(a);
  TORCH_CHECK_VALUE(err.token < 0, "router_logits[", err.token, ", ", err.expert, "] is ",
                    std::isnan(err.value) ? std::string("nan") : std::to_string(err.value),
                    ": routing refuses NaN and +inf logits (-inf is allowed: that expert is never preferred)");
  return {w, ids};
}

std::tuple<at::Tensor, at::Tensor> route_meta(const at::Tensor& logits, int64_t top_k, std::string_view method,
                                              bool renormalize, int64_t num_expert_group, int64_t topk_group,
                                              const std::optional<at::Tensor>& bias, double routed_scaling_factor,
                                              double sparsemixer_eps) {
  RouteArgs a = check_route(logits, top_k, method, renormalize, num_expert_group, topk_group, bias,
                            routed_scaling_factor, sparsemixer_eps);
  return {at::empty({a.tokens, a.topk}, logits.options().dtype(at::kFloat)),
          at::empty({a.tokens, a.topk}, logits.options().dtype(at::kInt))};
}

}  // namespace
}  // namespace moepack

TORCH_LIBRARY_FRAGMENT(moepack, m) {
  m.def(
      "route(Tensor router_logits, int top_k, str method, bool renormalize=False, int num_expert_group=0, "
      "int topk_group=0, Tensor? correction_bias=None, float routed_scaling_factor=1.0, "
      "float sparsemixer_eps=0.01) -> (Tensor topk_weights, Tensor topk_ids)");
}

TORCH_LIBRARY_IMPL(moepack, CPU, m) { m.impl("route", &moepack::route_cpu); }

TORCH_LIBRARY_IMPL(moepack, Meta, m) { m.impl("route", &moepack::route_meta); }
