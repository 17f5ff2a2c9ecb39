// The shape math of packed tensors, C++ side. The Python twin is moepack/layout.py
// (tensor_shape, layout_tensor_plan); tests/test_layout_sync.py checks that the op's shape rules
// (this file) accept exactly the shapes Python plans. The tensors a layout consists of are
// declared once, in moepack/layout.py, and reach C++ through the generated layouts_gen.h.
#pragma once
#include <cstdint>

#include "moepack/layouts_gen.h"

namespace moepack {

constexpr int64_t round_up_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
constexpr int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// One packed weight as a matrix of codes: Np packed rows (output columns n) by Kp inputs.
struct WeightDims {
  int64_t np;
  int64_t kp;
};
// w13 of a layer with hidden size H and padded intermediate Ip: [2*Ip, Kp(H)] (gate then up, or
// interleaved pairs), [Ip, Kp(H)] for non-gated experts (up rows alone: relu2); w2: [Np(H), Ip].
constexpr WeightDims w13_dims(const LayoutDesc& L, int64_t hidden, int64_t ip, bool gated = true) {
  return {gated ? 2 * ip : ip, round_up_to(hidden, L.k_pack)};
}
constexpr WeightDims w2_dims(const LayoutDesc& L, int64_t hidden, int64_t ip) {
  return {round_up_to(hidden, L.block_n), round_up_to(ip, L.k_pack)};
}

// Shape of declared tensor `t` of a packed [E, np, kp] weight; writes out[0..ndim) and returns
// ndim (TensorShape: packed [E, np, kp * bits / (8 * element bytes)], channel [E, np], group
// [E, ceil(kp / group_size), np]).
constexpr int tensor_shape(const LayoutDesc& L, const TensorDesc& t, int64_t e, const WeightDims& d, int64_t out[3]) {
  out[0] = e;
  switch (t.shape) {
    case kShape_packed:
      out[1] = d.np;
      out[2] = d.kp * L.weight_bits / (8 * kTensorDtypeBytes[t.dtype]);
      return 3;
    case kShape_channel:
      out[1] = d.np;
      return 2;
    default:  // kShape_group
      out[1] = ceil_div(d.kp, L.group_size);
      out[2] = d.np;
      return 3;
  }
}

// Where column block n0 of one expert's tensor starts, relative to the expert's first byte: the
// bytes per packed row (codes: a whole row of K; channel / group: one element, group rows being
// np elements apart) and per expert.
struct TensorGeom {
  int64_t expert_bytes = 0;
  int64_t row_bytes = 0;     // bytes between packed rows n and n + 1
  int64_t group_stride = 0;  // group tensors: elements between K groups (= np); else 0
};
constexpr TensorGeom tensor_geom(const LayoutDesc& L, const TensorDesc& t, const WeightDims& d) {
  int64_t shape[3] = {1, 0, 0};
  const int nd = tensor_shape(L, t, 1, d, shape);
  int64_t per_expert = 1;
  for (int i = 1; i < nd; ++i) per_expert *= shape[i];
  const int64_t esz = kTensorDtypeBytes[t.dtype];
  TensorGeom g;
  g.expert_bytes = per_expert * esz;
  g.row_bytes = t.shape == kShape_packed ? shape[2] * esz : esz;
  g.group_stride = t.shape == kShape_group ? d.np : 0;
  return g;
}

}  // namespace moepack
