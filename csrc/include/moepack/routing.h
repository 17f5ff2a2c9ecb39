// Routing: router logits [T, E] -> topk_weights [T, k] fp32, topk_ids [T, k] int32.
// Torch-free like kernel.h: the torch layer (csrc/torch/ops.cpp) checks every argument, then
// calls route_tokens(). The semantics of each method are in docs/ROUTING.md; the plain-torch
// oracle is moepack/routing.py route_reference(), which shares no code with this file.
#pragma once
#include <cstddef>
#include <cstdint>

#include "moepack/kernel.h"

namespace moepack {

enum class RouteMethod : int32_t {
  softmax = 0,          // top-k; softmax(all logits) at the ids (renormalize: / their sum)
  sigmoid = 1,          // top-k; sigmoid(logit) (renormalize: / (sum + 1e-20))
  grouped_softmax = 2,  // DeepSeek-V2 group_limited_greedy (group score = max; top-2 sum with a bias)
  grouped_sigmoid = 3,  // DeepSeek-V3 / GLM-4.5 / Kimi noaux_tc (with e_score_correction_bias)
  topk_softmax = 4,     // gpt-oss, Granite: top-k of the logits, softmax over those k
  llama4 = 5,           // top-1, sigmoid(logit) (the layer applies it on the input)
  sparsemixer = 6,      // Phi-3.5-MoE sparsemixer at inference, k = 2
  sqrtsoftplus = 7,     // DeepSeek-V4: top-k; sqrt(softplus(logit)) (renormalize: / (sum + 1e-20))
  biased_logit_sigmoid = 8,  // Kolibri-1: top-k of logit + bias (the bias on the logits); sigmoid(logit)
};
constexpr int kNumRouteMethods = 9;
const char* route_method_name(RouteMethod m);
// Returns false when `name` is not a method name.
bool route_method_parse(const char* name, RouteMethod* out);

// Shapes (leading dimension in brackets):
//   logits        [T, E] (logits_stride)   fp32 / bf16 / fp16 (logits_dtype)
//   bias          [E] fp32 or null          e_score_correction_bias, selection only
//   weights       [T, k] (k)                fp32 out
//   ids           [T, k] (k)                int32 out
// Preconditions (checked by the torch layer): 1 <= k <= E; grouped: E % groups == 0,
// 1 <= topk_group <= groups, k <= topk_group * E / groups; llama4: k == 1; sparsemixer: k == 2,
// E >= 2; bias finite.
struct RouteArgs {
  const void* logits = nullptr;
  DType logits_dtype = DType::f32;
  int64_t logits_stride = 0;
  int64_t tokens = 0;
  int64_t experts = 0;
  int64_t topk = 0;
  RouteMethod method = RouteMethod::softmax;
  bool renormalize = false;
  int64_t groups = 1;      // num_expert_group (1 for the non-grouped methods)
  int64_t topk_group = 1;  // groups kept
  const float* bias = nullptr;
  float scale = 1.0f;          // routed_scaling_factor, applied last
  float sparsemixer_eps = 0.01f;
  float* weights = nullptr;
  int32_t* ids = nullptr;
  Parallel par;  // used only when tokens * experts is large (see route_tokens)
};

// A logit routing refuses (NaN or +inf): the lowest such token and, in it, the lowest expert.
struct RouteError {
  int64_t token = -1;  // -1: no error
  int64_t expert = -1;
  float value = 0.0f;
};

// Routes every token. Small calls (tokens * experts below a few tens of thousands) run on the
// calling thread: T = 1 never pays a thread wake-up. On a refused logit the outputs of that
// token and of later tokens are unspecified and the error says which logit it was.
RouteError route_tokens(const RouteArgs& a);

}  // namespace moepack
