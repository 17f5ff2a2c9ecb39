"""int8_channel's torch oracle (SEMANTICS.md §3 "int8 channel" with A8): its integer GEMM on the
generic A8 machinery of moepack/reference.py."""

from __future__ import annotations

import torch

from ...reference import moe_reference_a8


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
    return_flip: bool = False,
    **kw,
):
    """W8A8 experts on canonical int8 weights: codes w13_q [E, 2I, H] / w2_q [E, H, I] (int8),
    per-channel scales [E, 2I] / [E, H] (fp32, or with a trailing 1). The rounding points, the
    keywords (activation, alpha, limit, interleaved, biases, expert_map) and ``return_flip``:
    ``moepack.reference.moe_reference_a8``."""
    s13 = w13_scale.float().reshape(w13_q.shape[0], -1)
    s2 = w2_scale.float().reshape(w2_q.shape[0], -1)
    return moe_reference_a8(
        hidden_states, w13_q.shape[0],
        lambda e, q, qs, b: int8_linear_reference(q, qs, w13_q[e], s13[e], b),
        lambda e, q, qs, b: int8_linear_reference(q, qs, w2_q[e], s2[e], b),
        lambda e: (w2_q[e].double() * s2[e].double().reshape(-1, 1)).norm(dim=0).max().item(),
        topk_weights, topk_ids, return_flip=return_flip, **kw,
    )  # fmt: skip


__all__ = ["int8_linear_reference", "moe_reference_int8"]
