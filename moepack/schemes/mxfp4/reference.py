"""mxfp4's torch oracle (SEMANTICS.md §3 "mxfp4"): A16 is the dense reference on the exactly
dequantized weights; A8 the int4 A8 machinery (moepack/schemes/int4/reference.py) on the exact
integers ``2 * e2m1(q)`` (-12..12) with zero point 0 and the scale ``2^(e - 128)`` per group.

Why A8 is that: ``e2m1(q) * 2^(e - 127) = (2 * e2m1(q)) * 2^(e - 128)`` and ``2 * e2m1(q)`` is an
integer, so a K group of 32 has the exact integer dot product ``acc_g = sum x_s8 * 2 e2m1(q)``
(|acc_g| <= 32 * 127 * 12 = 48768, exact in fp32) and only the per-token row scale and the
group's power of two remain: ``C = row_scale * sum_g float(acc_g) * 2^(e_g - 128)`` in fp32, in
group order, which is ``int4_linear_a8_reference`` with w_q = 2 * e2m1(q), zero 0, scale
2^(e - 128). (2^(e - 128) is exact in fp32 for every e of 0..254: 2^-128 is a subnormal.)"""

from __future__ import annotations

import torch

from ...reference import moe_reference, moe_reference_a8
from ..int4.reference import int4_linear_a8_reference
from .codec import decode_e2m1, dequantize_mxfp4, e8m0_to_float


def a8_operands(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonical codes [N, K] and e8m0 [N, ng] of one expert -> the int4 A8 reference's (w_q, zero,
    scale): the integers 2 * e2m1(q) (fp32, -12..12), zero points 0 and the fp32 2^(e - 128)."""
    wq = decode_e2m1(q) * 2.0  # exact: -12..12
    s = e8m0_to_float(scale) * 0.5  # 2^(e - 127) / 2, exact (2^-128 is an fp32 subnormal)
    return wq, torch.zeros(scale.shape, dtype=torch.int16), s


def mxfp4_linear_a8_reference(x_q, x_scale, q, scale, bias):
    """One expert's W4A8 linear (the rounding points of the module docstring)."""
    wq, z, s = a8_operands(q, scale)
    return int4_linear_a8_reference(x_q, x_scale, wq, s, z, 32, bias)


def moe_reference_mxfp4(
    hidden_states: torch.Tensor,
    c: dict,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    act_mode: str = "a16",
    return_flip: bool = False,
    **kw,
):
    """mxfp4 experts on canonical tensors (moepack/schemes/mxfp4/pack.py: ``w13_q``, ``w13_scale``,
    ``w2_q``, ``w2_scale``). A16: ``moe_reference`` on ``dequantize_mxfp4`` (fp32, exact). A8:
    activations quantized per token (``moe_reference_a8``), per-group exact integer dot products
    on 2 * e2m1(q), scaled by 2^(e - 128) (module docstring). The keywords (activation, alpha,
    limit, interleaved, biases, expert_map) are moe_reference's."""
    if act_mode == "a16":
        w13 = dequantize_mxfp4(c["w13_q"], c["w13_scale"])
        w2 = dequantize_mxfp4(c["w2_q"], c["w2_scale"])
        out = moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, **kw)
        return (out, 0.0) if return_flip else out
    if act_mode != "a8":
        raise ValueError(f"act_mode={act_mode!r}: must be 'a16' or 'a8'")

    def linear13(e, xq, xs, b):
        return mxfp4_linear_a8_reference(xq, xs, c["w13_q"][e], c["w13_scale"][e], b)

    def linear2(e, xq, xs, b):
        return mxfp4_linear_a8_reference(xq, xs, c["w2_q"][e], c["w2_scale"][e], b)

    def column_norm(e):
        return dequantize_mxfp4(c["w2_q"][e], c["w2_scale"][e]).double().norm(dim=0).max().item()

    return moe_reference_a8(hidden_states, c["w13_q"].shape[0], linear13, linear2, column_norm, topk_weights, topk_ids,
                            return_flip=return_flip, **kw)  # fmt: skip


__all__ = ["a8_operands", "mxfp4_linear_a8_reference", "moe_reference_mxfp4"]
