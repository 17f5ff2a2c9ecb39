"""Plain-torch fp32 implementation of SEMANTICS.md: the oracle every test compares against.

Written for clarity, not speed: one expert at a time with ``F.linear`` in fp32, the same
rounding points as the kernels (intermediate stored in the activation dtype, combine in fp32
in slot order, one cast at the end).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")


def activation_reference(
    h: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0, interleaved: bool | None = None
) -> torch.Tensor:
    """act(h) for h [..., 2I] fp32 -> [..., I] (docs/SEMANTICS.md §2 table). ``interleaved``: h's
    row order, (gate, up) pairs or gate then up; default: pairs for swigluoai, as checkpoints
    store it."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if interleaved is None:
        interleaved = activation == "swigluoai"
    i = h.shape[-1] // 2
    gate, up = (h[..., 0::2], h[..., 1::2]) if interleaved else (h[..., :i], h[..., i:])
    if activation == "swigluoai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1.0) * gate * torch.sigmoid(alpha * gate)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0))) * up
    if activation == "gelu_tanh":
        return 0.5 * gate * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3))) * up


def moe_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    interleaved: bool | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Experts of one MoE layer on canonical (unpacked) weights.

    w13 [E, 2I, H] (gate then up; interleaved pairs for swigluoai), w2 [E, H, I], biases
    [E, 2I] / [E, H]; weights are used at their own precision, computed in fp32. Returns
    [T, H] in the input dtype.
    """
    dtype = hidden_states.dtype
    x = hidden_states.float()
    t, h = x.shape
    k = topk_ids.shape[1]
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    y = torch.zeros(t, k, h, dtype=torch.float32)
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        hh = F.linear(x[tok], w13[e].float(), None if w13_bias is None else w13_bias[e].float())
        a = activation_reference(hh, activation, alpha, limit, interleaved).to(dtype).float()  # stored in the activation dtype
        y[tok, slot] = F.linear(a, w2[e].float(), None if w2_bias is None else w2_bias[e].float())
    w = topk_weights.float()
    if expert_map is not None:
        w = torch.where(ids >= 0, w, torch.zeros_like(w))
    out = torch.zeros(t, h, dtype=torch.float32)
    for j in range(k):  # fp32, in slot order
        out = out + w[:, j : j + 1] * y[:, j]
    return out.to(dtype)


def combine_slots(y: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, expert_map, dtype) -> torch.Tensor:
    """The weighted combine of every reference: sum_j w[t, j] * y[t, j] in fp32 in slot order
    (slots whose expert is not local weigh 0), one cast to ``dtype``."""
    if expert_map is not None:
        w = torch.where(ids >= 0, w, torch.zeros_like(w))
    out = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32)
    for j in range(y.shape[1]):  # fp32, in slot order
        out = out + w[:, j : j + 1] * y[:, j]
    return out.to(dtype)


def quantize_rows_int8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SEMANTICS.md §3 A8: per-row dynamic symmetric int8 of fp32 rows ``v [R, K]``:
    ``scale = max(amax, 1e-7) / 127`` (fp32), ``q = round_half_even(v / scale)`` clamped to
    +-127. Returns (q as fp32 integers [R, K], scale [R, 1]); the kernels do the same fp32 ops."""
    v = v.float()
    scale = v.abs().amax(dim=-1, keepdim=True).clamp(min=1e-7) / 127.0
    return torch.round(v / scale).clamp(-127.0, 127.0), scale


def int8_linear_reference(
    q: torch.Tensor, q_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``acc_i32 · a_scale[t] · w_scale[n] (+ bias)`` in fp32 with the kernels' order: the integer
    dot products are exact (fp64 holds every partial sum of <= 2^53), cast to fp32 once."""
    acc = q.double() @ w_q.double().t()
    out = acc.float() * q_scale * w_scale.float().reshape(1, -1)
    return out if bias is None else out + bias.float()


def moe_reference_int8(
    hidden_states: torch.Tensor,
    w13_q: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_q: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    interleaved: bool | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    return_flip: bool = False,
):
    """W8A8 experts (SEMANTICS.md §3 "int8 channel" with A8) on canonical int8 weights: codes
    w13_q [E, 2I, H] / w2_q [E, H, I] (int8), per-channel scales [E, 2I] / [E, H] (fp32).

    Same rounding points as the kernels: each token's x quantized per row; h = dequantized
    int32 GEMM + bias; act in fp32; the intermediate rounded to the activation dtype, then
    re-quantized per row; y = dequantized GEMM + bias; combine in fp32 in slot order, one cast.

    ``return_flip``: also return the largest change (2-norm of the whole output) that ONE
    intermediate code moving by one step can cause: max over slots and columns of
    ``|w_slot| · a_scale · ||w2_q[e][:, i] · w2_scale||``. Two correct implementations whose
    activations differ by an ulp can round a value sitting on a code boundary differently;
    tests allow a few such flips (tests/reference/tolerances.py)."""
    dtype = hidden_states.dtype
    x = hidden_states.float()
    t, h = x.shape
    k = topk_ids.shape[1]
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    s13 = w13_scale.float().reshape(w13_q.shape[0], -1)
    s2 = w2_scale.float().reshape(w2_q.shape[0], -1)
    xq, xs = quantize_rows_int8(x)
    y = torch.zeros(t, k, h, dtype=torch.float32)
    flip = 0.0
    w = topk_weights.float()
    for e in range(w13_q.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        hh = int8_linear_reference(xq[tok], xs[tok], w13_q[e], s13[e], None if w13_bias is None else w13_bias[e])
        a = activation_reference(hh, activation, alpha, limit, interleaved).to(dtype).float()
        aq, as_ = quantize_rows_int8(a)
        y[tok, slot] = int8_linear_reference(aq, as_, w2_q[e], s2[e], None if w2_bias is None else w2_bias[e])
        if return_flip:
            col = (w2_q[e].double() * s2[e].double().reshape(-1, 1)).norm(dim=0).max().item()
            flip = max(flip, (w[tok, slot].abs().double() * as_.reshape(-1).double()).max().item() * col)
    out = combine_slots(y, w, ids, expert_map, dtype)
    return (out, flip) if return_flip else out


def int4_linear_a8_reference(
    q: torch.Tensor, q_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, w_zero: torch.Tensor,
    group_size: int, bias: torch.Tensor | None,
) -> torch.Tensor:
    """W4A8 (SEMANTICS.md §3 "int4 group" with A8) with the kernels' rounding points: per group g
    the exact integer ``acc_g = sum_{k in g} q_x[k] * (w_q[n, k] - zero[n, g])`` (fp64 holds it),
    ``sum_g float(acc_g) * scale[n, g]`` accumulated in fp32 in group order, times a_scale[t]."""
    k = w_q.shape[-1]
    g = k if group_size <= 0 else group_size
    ng = w_scale.shape[-1]
    out = torch.zeros(q.shape[0], w_q.shape[0], dtype=torch.float32)
    for gi in range(ng):
        k0, k1 = gi * g, min(k, (gi + 1) * g)
        wi = w_q[:, k0:k1].double() - w_zero[:, gi : gi + 1].double()
        acc = (q[:, k0:k1].double() @ wi.t()).float()
        out = out + acc * w_scale[:, gi].float().reshape(1, -1)
    out = out * q_scale
    return out if bias is None else out + bias.float()


def moe_reference_int4(
    hidden_states: torch.Tensor,
    c: dict,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    act_mode: str = "a16",
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    interleaved: bool | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    return_flip: bool = False,
):
    """int4_group experts on canonical int4 tensors (moepack/pack/int4.py: ``w13_q``,
    ``w13_scale``, ``w13_zero``, ``w2_*``, ``group_size`` and, act-order, ``w13_perm`` [E, H]:
    code column j of expert e is input channel w13_perm[e, j]). A16: the dense reference on the
    exactly dequantized fp32 weights (w13's columns put back in input-channel order). A8:
    activations quantized per token (the scale does not depend on the order), each expert's
    codes permuted like its w13 columns, per-group exact integer dot products over the stored
    (sorted) groups (``int4_linear_a8_reference``), the intermediate re-quantized per row, as in
    moe_reference_int8; ``return_flip`` as there."""
    from .pack.int4 import dequantize_int4_group

    g = int(c["group_size"])
    perm = c.get("w13_perm")
    perm = None if perm is None else perm.long().reshape(c["w13_q"].shape[0], -1)
    if act_mode == "a16":
        w13 = dequantize_int4_group(c["w13_q"], c["w13_scale"], c["w13_zero"], g)
        if perm is not None:
            w13 = torch.empty_like(w13).scatter_(2, perm[:, None, :].expand_as(w13), w13)  # w[:, :, perm[j]] = col j
        w2 = dequantize_int4_group(c["w2_q"], c["w2_scale"], c["w2_zero"], g)
        out = moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, activation=activation, alpha=alpha,
                            limit=limit, interleaved=interleaved, w13_bias=w13_bias, w2_bias=w2_bias,
                            expert_map=expert_map)  # fmt: skip
        return (out, 0.0) if return_flip else out
    if act_mode != "a8":
        raise ValueError(f"act_mode={act_mode!r}: must be 'a16' or 'a8'")
    dtype = hidden_states.dtype
    x = hidden_states.float()
    t, h = x.shape
    k = topk_ids.shape[1]
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    xq, xs = quantize_rows_int8(x)
    y = torch.zeros(t, k, h, dtype=torch.float32)
    flip = 0.0
    w = topk_weights.float()
    for e in range(c["w13_q"].shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        b13 = None if w13_bias is None else w13_bias[e]
        xe = xq[tok] if perm is None else xq[tok][:, perm[e]]
        hh = int4_linear_a8_reference(xe, xs[tok], c["w13_q"][e], c["w13_scale"][e], c["w13_zero"][e], g, b13)
        a = activation_reference(hh, activation, alpha, limit, interleaved).to(dtype).float()
        aq, as_ = quantize_rows_int8(a)
        b2 = None if w2_bias is None else w2_bias[e]
        y[tok, slot] = int4_linear_a8_reference(aq, as_, c["w2_q"][e], c["w2_scale"][e], c["w2_zero"][e], g, b2)
        if return_flip:
            w2f = dequantize_int4_group(c["w2_q"][e], c["w2_scale"][e], c["w2_zero"][e], g).double()
            col = w2f.norm(dim=0).max().item()
            flip = max(flip, (w[tok, slot].abs().double() * as_.reshape(-1).double()).max().item() * col)
    out = combine_slots(y, w, ids, expert_map, dtype)
    return (out, flip) if return_flip else out


def torch_loop_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The per-expert loop a user would write in plain torch (bf16 matmuls, silu); the
    benchmark's baseline, not an oracle."""
    out = torch.zeros_like(hidden_states)
    i = w13.shape[1] // 2
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        hh = hidden_states[tok] @ w13[e].t()
        a = F.silu(hh[:, :i]) * hh[:, i:]
        out.index_add_(0, tok, (a @ w2[e].t()) * topk_weights[tok, slot, None].to(hidden_states.dtype))
    return out
