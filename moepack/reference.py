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


def activation_reference(h: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """act(h) for h [..., 2I] fp32 -> [..., I] (SEMANTICS.md §2 table)."""
    if activation == "swigluoai":
        gate, up = h[..., 0::2], h[..., 1::2]
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1.0) * gate * torch.sigmoid(alpha * gate)
    i = h.shape[-1] // 2
    gate, up = h[..., :i], h[..., i:]
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0))) * up
    if activation == "gelu_tanh":
        return 0.5 * gate * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate**3))) * up
    raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")


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
        a = activation_reference(hh, activation, alpha, limit).to(dtype).float()  # stored in the activation dtype
        y[tok, slot] = F.linear(a, w2[e].float(), None if w2_bias is None else w2_bias[e].float())
    w = topk_weights.float()
    if expert_map is not None:
        w = torch.where(ids >= 0, w, torch.zeros_like(w))
    out = torch.zeros(t, h, dtype=torch.float32)
    for j in range(k):  # fp32, in slot order
        out = out + w[:, j : j + 1] * y[:, j]
    return out.to(dtype)


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
