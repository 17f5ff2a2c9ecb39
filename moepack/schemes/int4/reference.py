"""int4_group's torch oracle (SEMANTICS.md §3 "int4 group"): A16 is the dense reference on the
exactly dequantized weights, A8 its per-group integer GEMM on the generic A8 machinery of
moepack/reference.py."""

from __future__ import annotations

import torch

from ...reference import moe_reference, moe_reference_a8
from .quantize import dequantize_int4_group


def int4_linear_a8_reference(
    q: torch.Tensor, q_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, w_zero: torch.Tensor,
    group_size: int, bias: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """W4A8 with the kernels' rounding points: per group g the exact integer ``acc_g = sum_{k in
    g} q_x[k] * (w_q[n, k] - zero[n, g])`` (fp64 holds it), ``sum_g float(acc_g) * scale[n, g]``
    accumulated in fp32 in group order, times a_scale[t]."""
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


def unpermute_w13(w13: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """Dequantized w13 [E, 2I, H] with act-order code columns put back in input-channel order:
    ``w[:, :, perm[e, j]] = column j``."""
    if perm is None:
        return w13
    p = perm.long().reshape(w13.shape[0], 1, -1).expand_as(w13)
    return torch.empty_like(w13).scatter_(2, p, w13)


def moe_reference_int4(
    hidden_states: torch.Tensor,
    c: dict,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    act_mode: str = "a16",
    return_flip: bool = False,
    **kw,
):
    """int4_group experts on canonical int4 tensors (moepack/schemes/int4/pack.py: ``w13_q``,
    ``w13_scale``, ``w13_zero``, ``w2_*``, ``group_size`` and, act-order, ``w13_perm`` [E, H]:
    code column j of expert e is input channel w13_perm[e, j]). A16: the dense reference on the
    exactly dequantized fp32 weights (w13's columns put back in input-channel order). A8:
    activations quantized per token (the scale does not depend on the order), each expert's
    rows permuted like its w13 columns, per-group exact integer dot products over the stored
    (sorted) groups (``int4_linear_a8_reference``), the rest as ``moe_reference_a8``. The
    keywords (activation, alpha, limit, interleaved, biases, expert_map) are moe_reference's."""
    g = int(c["group_size"])
    perm = c.get("w13_perm")
    perm = None if perm is None else perm.long().reshape(c["w13_q"].shape[0], -1)
    if act_mode == "a16":
        w13 = unpermute_w13(dequantize_int4_group(c["w13_q"], c["w13_scale"], c["w13_zero"], g), perm)
        w2 = dequantize_int4_group(c["w2_q"], c["w2_scale"], c["w2_zero"], g)
        out = moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, **kw)
        return (out, 0.0) if return_flip else out
    if act_mode != "a8":
        raise ValueError(f"act_mode={act_mode!r}: must be 'a16' or 'a8'")

    def linear13(e, q, qs, b):
        return int4_linear_a8_reference(q if perm is None else q[:, perm[e]], qs, c["w13_q"][e], c["w13_scale"][e],
                                        c["w13_zero"][e], g, b)  # fmt: skip

    def linear2(e, q, qs, b):
        return int4_linear_a8_reference(q, qs, c["w2_q"][e], c["w2_scale"][e], c["w2_zero"][e], g, b)

    def column_norm(e):
        return dequantize_int4_group(c["w2_q"][e], c["w2_scale"][e], c["w2_zero"][e], g).double().norm(dim=0).max().item()

    return moe_reference_a8(hidden_states, c["w13_q"].shape[0], linear13, linear2, column_norm, topk_weights, topk_ids,
                            return_flip=return_flip, **kw)  # fmt: skip


__all__ = ["int4_linear_a8_reference", "moe_reference_int4", "unpermute_w13"]
