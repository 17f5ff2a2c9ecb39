// The argument checks and helpers every op shares (csrc/torch/op_*.inc, compiled as one unit by
// ops.cpp). Only csrc/torch sees at::Tensor. Every refusal names the argument, the value and the
// rule (ValueError / TypeError / IndexError on the Python side). The ATen headers are the narrow
// ones (the Tensor class and the free functions used), not <ATen/ATen.h>: they cost the build time.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
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

// int32 accumulators of A8 layouts: |acc| <= 128 * 127 * K must fit.
constexpr int64_t kMaxI8K = (int64_t(1) << 31) / (128 * 127);

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
  if (s == "relu2") return Activation::relu2;
  TORCH_CHECK_VALUE(false, "activation='", s, "' is not one of silu, gelu, gelu_tanh, swigluoai, relu2");
}

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: TORCH_CHECK_TYPE(false, name, " has dtype ", t.scalar_type(), ": must be float32, bfloat16 or float16");
  }
}

// The torch dtype of a layout tensor's TensorDtype.
at::ScalarType scalar_type_of(int32_t tensor_dtype) {
  switch (tensor_dtype) {
    case kTensor_bfloat16: return at::kBFloat16;
    case kTensor_int8: return at::kChar;
    case kTensor_uint8: return at::kByte;
    case kTensor_float32: return at::kFloat;
    default: return at::kInt;  // kTensor_int32
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

void parallel_run(void*, int64_t n, ParallelBody body, void* ctx) {
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) { body(ctx, b, e); });
}

bool strict_mode() {
  const char* v = std::getenv("MOEPACK_STRICT");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

// The kernel `layout` runs here under MOEPACK_MAX_ISA (refused when none runs it).
Selection select_under_cap(int64_t layout, int32_t act_mode = 0) {
  Isa cap;
  try {
    cap = env_max_isa();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  TORCH_CHECK_VALUE(decode_streams_error() == nullptr, decode_streams_error());
  TORCH_CHECK_VALUE(mx4_a16_dot_error() == nullptr, mx4_a16_dot_error());
  TORCH_CHECK_VALUE(variant_env_error() == nullptr, variant_env_error());
  Selection sel = select_fused(int32_t(layout), cap, act_mode);
  TORCH_CHECK_VALUE(sel.fn != nullptr, sel.reason);
  return sel;
}

// select_under_cap, and MOEPACK_STRICT=1 refuses a fallback.
Selection select_or_throw(int64_t layout, int32_t act_mode = 0) {
  Selection sel = select_under_cap(layout, act_mode);
  TORCH_CHECK(!strict_mode() || !sel.fallback, "MOEPACK_STRICT=1 refuses a fallback: ", sel.reason);
  return sel;
}

// An activation mode by name ("a16", "a8"; "" = the layout's default) for layout L.
int32_t parse_act_mode(const LayoutDesc& L, std::string_view name) {
  if (name.empty()) return layout_default_act(L);
  int32_t m = name == "a16" ? kAct_a16 : name == "a8" ? kAct_a8 : 0;
  TORCH_CHECK_VALUE(m != 0, "act_mode='", name, "' is not one of a16, a8 (or empty: the layout's default)");
  TORCH_CHECK_VALUE(L.act_modes & m, "act_mode='", name, "': layout ", L.name, " runs with ",
                    (L.act_modes & kAct_a16) ? ((L.act_modes & kAct_a8) ? "a16 or a8" : "a16") : "a8", " activations");
  return m;
}

Isa parse_isa(std::string_view name) {
  for (int i = 0; i < kNumIsa; ++i) {
    if (name == isa_name(Isa(i))) return Isa(i);
  }
  TORCH_CHECK_VALUE(false, "isa='", name, "' is not one of ", kIsaNames);
}

}  // namespace
}  // namespace moepack
