"""Plain-torch fp32 implementation of SEMANTICS.md: the oracle every test compares against.

Written for clarity, not speed: one expert at a time with ``F.linear`` in fp32, the same
rounding points as the kernels (intermediate stored in the activation dtype, combine in fp32
in slot order, one cast at the end).

What every scheme shares lives here (activation, the dense MoE on float weights, the A8 rounding
points, the combine); each scheme's own formulas (its integer GEMMs, its dequantization) are in
its package, moepack/schemes/<scheme>/reference.py, and build on these.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "relu2")


def activation_reference(
    h: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0, interleaved: bool | None = None,
    silu_limit: float | None = None,
) -> torch.Tensor:
    """act(h) for h [..., 2I] fp32 -> [..., I] (docs/SEMANTICS.md §2 table); relu2 (non-gated,
    Nemotron-H's NemotronHExperts): h [..., I] of up rows -> relu(h)^2. ``interleaved``: h's
    row order, (gate, up) pairs or gate then up; default: pairs for swigluoai, as checkpoints
    store it. ``silu_limit`` (silu only; None or 0: none): the clamped SwiGLU of DeepSeek-V4's
    experts (``DeepseekV4Experts._apply_gate``): gate clamped to <= L, up to [-L, L], then silu."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if activation == "relu2":
        return torch.relu(h).square()
    if interleaved is None:
        interleaved = activation == "swigluoai"
    i = h.shape[-1] // 2
    gate, up = (h[..., 0::2], h[..., 1::2]) if interleaved else (h[..., :i], h[..., i:])
    if activation == "swigluoai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1.0) * gate * torch.sigmoid(alpha * gate)
    if activation == "silu":
        if silu_limit:
            gate = gate.clamp(max=silu_limit)
            up = up.clamp(min=-silu_limit, max=silu_limit)
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
    silu_limit: float | None = None,
    interleaved: bool | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Experts of one MoE layer on canonical (unpacked) weights.

    w13 [E, 2I, H] (gate then up; interleaved pairs for swigluoai; [E, I, H] of up rows for the
    non-gated relu2), w2 [E, H, I], biases [E, 2I] / [E, H]; weights are used at their own precision, computed in fp32. Returns
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
        a = activation_reference(hh, activation, alpha, limit, interleaved, silu_limit).to(dtype).float()  # stored in the activation dtype
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


def moe_reference_a8(
    hidden_states: torch.Tensor,
    num_experts: int,
    linear13: Callable,
    linear2: Callable,
    w2_column_norm: Callable,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    silu_limit: float | None = None,
    interleaved: bool | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    return_flip: bool = False,
):
    """The A8 rounding points (SEMANTICS.md §3 A8) around a scheme's integer GEMMs: each token's x
    quantized per row (``quantize_rows_int8``); ``h = linear13(e, q, q_scale, bias)`` (fp32, the
    scheme's dequantized integer GEMM + bias); act in fp32; the intermediate rounded to the
    activation dtype, then re-quantized per row; ``y = linear2(e, q, q_scale, bias)``; combine in
    fp32 in slot order, one cast. The schemes' references (int8_channel, int4_group with A8)
    supply the two GEMMs.

    ``return_flip``: also return the largest change (2-norm of the whole output) that ONE
    intermediate code moving by one step can cause: max over slots of ``|w_slot| · a_scale ·
    w2_column_norm(e)`` (the largest 2-norm of one dequantized w2 column of expert e). Two
    correct implementations whose activations differ by an ulp can round a value sitting on a
    code boundary differently; tests allow a few such flips (tests/reference/tolerances.py)."""
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
    for e in range(num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        hh = linear13(e, xq[tok], xs[tok], None if w13_bias is None else w13_bias[e])
        a = activation_reference(hh, activation, alpha, limit, interleaved, silu_limit).to(dtype).float()
        aq, as_ = quantize_rows_int8(a)
        y[tok, slot] = linear2(e, aq, as_, None if w2_bias is None else w2_bias[e])
        if return_flip:
            flip = max(flip, (w[tok, slot].abs().double() * as_.reshape(-1).double()).max().item() * w2_column_norm(e))
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
