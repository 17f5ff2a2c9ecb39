// torch.ops.moepack.route: router logits -> (topk_weights, topk_ids). Kernel: csrc/routing.cpp;
// semantics: docs/ROUTING.md.
#include "moepack/routing.h"
#include "op_common.h"

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
                    "sparsemixer, sqrtsoftplus, biased_logit_sigmoid");
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
                    ": only softmax, sigmoid, sqrtsoftplus, biased_logit_sigmoid, grouped_softmax and grouped_sigmoid renormalize");
  a.renormalize = renormalize;
  if (bias) {
    TORCH_CHECK_VALUE(!fixed_weights, "correction_bias given with method ", mname,
                      ": only softmax, sigmoid, sqrtsoftplus, biased_logit_sigmoid, grouped_softmax and grouped_sigmoid take an "
                      "e_score_correction_bias");
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
