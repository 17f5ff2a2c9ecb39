// torch.ops.moepack.fused_experts: one MoE layer's experts on packed weights (docs/KERNELS.md,
// "The op"). Each weight is the layout's declared tensors in declared order; one loop checks
// them against the declaration (layout_shapes.h), for the CPU and the Meta kernel alike.
#include "op_common.h"

namespace moepack {
namespace {

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
                         const std::optional<at::Tensor>& expert_map, std::string_view act_mode,
                         const std::optional<at::Tensor>& w13_perm, double silu_limit, bool data) {
  FusedMoeArgs a;
  const LayoutDesc& L = layout_or_throw(layout);
  a.layout = &L;
  a.act_mode = parse_act_mode(L, act_mode);
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
  if (a.act_mode == kAct_a8) {
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
  if (w13_perm) {
    TORCH_CHECK_VALUE(L.scheme == kScheme_int4_group, "w13_perm with layout ", L.name,
                      ": only int4_group layouts take an act-order permutation (w13's codes of other schemes are in "
                      "input-channel order)");
    check_cpu(*w13_perm, "w13_perm");
    TORCH_CHECK_TYPE(w13_perm->scalar_type() == at::kInt, "w13_perm has dtype ", w13_perm->scalar_type(),
                     ": must be int32 (the input channel of each code column)");
    check_exact(*w13_perm, "w13_perm", at::kInt, {E, a.hidden},
                ("int32 [E, H]: row e holds the input channel of each of expert e's w13 code columns, H=" +
                 std::to_string(a.hidden) + " from hidden_states").c_str());
  }
  // manifest.py swiglu_param_problem's rule: the kernels compute in float32, where a larger value is Inf
  constexpr double kF32Max = 3.4028234663852886e38;
  TORCH_CHECK_VALUE(std::isfinite(alpha) && std::isfinite(limit) && std::fabs(alpha) <= kF32Max &&
                        std::fabs(limit) <= kF32Max && limit > 0,
                    "swigluoai alpha=", alpha, ", limit=", limit,
                    ": both must be finite numbers float32 holds (|v| <= 3.4028235e+38) and limit > 0");
  a.alpha = float(alpha);
  a.limit = float(limit);
  // The clamped SwiGLU of silu experts (manifest.py silu_limit_problem's rule): 0 = none.
  TORCH_CHECK_VALUE(std::isfinite(silu_limit) && silu_limit >= 0 && silu_limit <= kF32Max,
                    "silu_limit=", silu_limit, ": must be 0 (no clamp) or a finite number > 0 that float32 holds");
  TORCH_CHECK_VALUE(silu_limit == 0 || a.act == Activation::silu, "silu_limit=", silu_limit, " with activation='",
                    activation, "': the clamp is an option of silu experts only (swigluoai has its own limit)");
  a.silu_limit = float(silu_limit);
  if (data) {
    a.b13 = b13 ? b13->data_ptr<float>() : nullptr;
    a.b2 = b2 ? b2->data_ptr<float>() : nullptr;
    a.w13_perm = w13_perm ? w13_perm->data_ptr<int32_t>() : nullptr;
  }
  return a;
}

// The data rule of w13_perm, checked (like the ids) before any memory is read through it: every
// entry of the rows the call reads (its routed local experts') lies in [0, H). One pass over
// T*k ids, then an OR-reduced compare per routed row (vectorized); an unrouted expert's row is
// never read, so never checked.
void check_perm_rows(const FusedMoeArgs& a) {
  const int64_t E = a.num_experts, H = a.hidden;
  std::vector<uint8_t> used(size_t(E), 0);
  for (int64_t i = 0; i < a.tokens * a.topk; ++i) {
    int32_t e = a.topk_ids[i];
    if (a.expert_map) e = a.expert_map[e];
    if (e >= 0) used[size_t(e)] = 1;
  }
  const uint32_t h = uint32_t(H);
  for (int64_t e = 0; e < E; ++e) {
    if (!used[size_t(e)]) continue;
    const int32_t* p = a.w13_perm + e * H;
    uint32_t bad = 0;
    for (int64_t k = 0; k < H; ++k) bad |= uint32_t(uint32_t(p[k]) >= h);
    if (bad == 0) continue;
    int64_t k = 0;
    while (uint32_t(p[k]) < h) ++k;
    TORCH_CHECK_INDEX(false, "w13_perm[", e, ", ", k, "] = ", p[k], ": act-order permutation entries must be in [0, H=", H,
                      ") (the input channel of expert ", e, "'s w13 code column ", k, ")");
  }
}

at::Tensor fused_experts_cpu(const at::Tensor& x, at::TensorList w13, at::TensorList w2, const at::Tensor& topk_weights,
                             const at::Tensor& topk_ids, int64_t layout, bool interleaved, std::string_view activation,
                             double alpha, double limit, const std::optional<at::Tensor>& b13,
                             const std::optional<at::Tensor>& b2, const std::optional<at::Tensor>& expert_map,
                             std::string_view act_mode, const std::optional<at::Tensor>& w13_perm, double silu_limit) {
  FusedMoeArgs a = check_fused(x, w13, w2, topk_weights, topk_ids, layout, interleaved, std::string(activation), alpha,
                               limit, b13, b2, expert_map, act_mode, w13_perm, silu_limit, /*data=*/true);
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
  if (a.w13_perm) check_perm_rows(a);
  Selection sel = select_or_throw(layout, a.act_mode);
  a.par.run = parallel_run;
  a.par.num_threads = at::get_num_threads();
  a.variant = variant_for(int32_t(layout), a.act_mode, a.tokens);
  {
    at::NoGradGuard no_grad;
    sel.fn(a);
  }
  return out;
}

// The Meta kernel: the same declaration-driven checks, no data. Under torch.compile the token
// count can be symbolic (vLLM compiles its CPU model with a dynamic batch; torch.compile's
// mark_dynamic / dynamic=True): reading it as an integer would specialize the graph to one batch
// size. There every check but the token dimension runs on one-token stand-ins of hidden_states,
// topk_weights and topk_ids (their dtypes, hidden size and k), what involves the token count
// symbolically (the three agree on it, hidden_states' hidden dimension has stride 1, the routing
// tensors are contiguous), and the output keeps the symbolic count.
at::Tensor fused_experts_meta(const at::Tensor& x, at::TensorList w13, at::TensorList w2, const at::Tensor& topk_weights,
                              const at::Tensor& topk_ids, int64_t layout, bool interleaved, std::string_view activation,
                              double alpha, double limit, const std::optional<at::Tensor>& b13,
                              const std::optional<at::Tensor>& b2, const std::optional<at::Tensor>& expert_map,
                              std::string_view act_mode, const std::optional<at::Tensor>& w13_perm, double silu_limit) {
  if (x.dim() == 2 && topk_weights.dim() == 2 && topk_ids.dim() == 2 && x.sym_size(0).is_symbolic()) {
    const c10::SymInt& tokens = x.sym_size(0);
    TORCH_SYM_CHECK(topk_ids.sym_size(0).sym_eq(tokens), "topk_ids and hidden_states must have the same number of tokens");
    TORCH_SYM_CHECK(topk_weights.sym_size(0).sym_eq(tokens),
                    "topk_weights and hidden_states must have the same number of tokens");
    TORCH_CHECK_VALUE(x.sym_stride(1) == 1, "hidden_states: the hidden dimension must be contiguous (stride 1)");
    TORCH_CHECK_VALUE(topk_ids.is_contiguous() && topk_weights.is_contiguous(),
                      "topk_ids and topk_weights must be contiguous");
    const int64_t hidden = x.sym_size(1).guard_int(__FILE__, __LINE__);
    const at::Tensor x1 = at::empty({1, hidden}, x.options());
    const at::Tensor w1 = at::empty({1, topk_weights.sym_size(1).guard_int(__FILE__, __LINE__)}, topk_weights.options());
    const at::Tensor i1 = at::empty({1, topk_ids.sym_size(1).guard_int(__FILE__, __LINE__)}, topk_ids.options());
    check_fused(x1, w13, w2, w1, i1, layout, interleaved, std::string(activation), alpha, limit, b13, b2, expert_map,
                act_mode, w13_perm, silu_limit, /*data=*/false);
    return at::empty_symint({tokens, c10::SymInt(hidden)}, x.options());
  }
  FusedMoeArgs a = check_fused(x, w13, w2, topk_weights, topk_ids, layout, interleaved, std::string(activation), alpha,
                               limit, b13, b2, expert_map, act_mode, w13_perm, silu_limit, /*data=*/false);
  return at::empty({a.tokens, a.hidden}, x.options());
}

}  // namespace
}  // namespace moepack

TORCH_LIBRARY_FRAGMENT(moepack, m) {
  m.def(
      "fused_experts(Tensor hidden_states, Tensor[] w13, Tensor[] w2, Tensor topk_weights, Tensor topk_ids, "
      "int layout, *, bool interleaved=False, str activation=\"silu\", float alpha=1.702, float limit=7.0, "
      "Tensor? w13_bias=None, Tensor? w2_bias=None, Tensor? expert_map=None, str act_mode=\"\", "
      "Tensor? w13_perm=None, float silu_limit=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(moepack, CPU, m) { m.impl("fused_experts", &moepack::fused_experts_cpu); }

TORCH_LIBRARY_IMPL(moepack, Meta, m) { m.impl("fused_experts", &moepack::fused_experts_meta); }
