"""nvfp4's torch oracle (SEMANTICS.md §3 "nvfp4"): A16 is the dense reference on the exactly
dequantized weights (codec.dequantize_nvfp4); A8 the int4 A8 machinery
(moepack/schemes/int4/reference.py) on the exact integers ``2 * e2m1(q)`` (-12..12) with zero point
0 and the scale ``s / 2`` per group, s the group's fp32 scale (codec.group_scales).

Why A8 is that: ``e2m1(q) * s = (2 * e2m1(q)) * (s / 2)`` and ``2 * e2m1(q)`` is an integer, so a K
group of 16 has the exact integer dot product ``acc_g = sum x_s8 * 2 e2m1(q)`` (|acc_g| <= 16 * 127
* 12, exact in fp32) and ``C = row_scale * sum_g float(acc_g) * (s_g / 2)`` in fp32, groups in
order: the kernel's order (csrc/kernels/codec_nvfp4.inc)."""

from __future__ import annotations

import torch

from ...reference import moe_reference, moe_reference_a8
from ..int4.reference import int4_linear_a8_reference
from .codec import NV4_GROUP, decode_e2m1, dequantize_nvfp4, group_scales


def a8_operands(q: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert's canonical codes [N, K], e4m3 bytes [N, ng] and globals [N] -> the int4 A8
    reference's (w_q, zero, scale): 2 * e2m1(q) (fp32), zero points 0, fp32 s / 2."""
    wq = decode_e2m1(q) * 2.0
    s = group_scales(scale, glob) * 0.5
    return wq, torch.zeros(scale.shape, dtype=torch.int16), s


def nvfp4_linear_a8_reference(x_q, x_scale, q, scale, glob, bias):
    """One expert's W4A8 linear (the rounding points of the module docstring)."""
    wq, z, s = a8_operands(q, scale, glob)
    return int4_linear_a8_reference(x_q, x_scale, wq, s, z, NV4_GROUP, bias)


def moe_reference_nvfp4(hidden_states: torch.Tensor, c: dict, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                        act_mode: str = "a16", return_flip: bool = False, **kw):  # fmt: skip
    """nvfp4 experts on canonical tensors (w13_q / w13_scale / w13_global, w2_*). A16:
    ``moe_reference`` on ``dequantize_nvfp4`` (fp32). A8: per-token int8 activations, exact
    per-group integer dot products on 2 * e2m1(q), scaled by s / 2 (module docstring). The
    keywords are moe_reference's."""
    if act_mode == "a16":
        w13 = dequantize_nvfp4(c["w13_q"], c["w13_scale"], c["w13_global"])
        w2 = dequantize_nvfp4(c["w2_q"], c["w2_scale"], c["w2_global"])
        out = moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, **kw)
        return (out, 0.0) if return_flip else out
    if act_mode != "a8":
        raise ValueError(f"act_mode={act_mode!r}: must be 'a16' or 'a8'")

    def linear13(e, xq, xs, b):
        return nvfp4_linear_a8_reference(xq, xs, c["w13_q"][e], c["w13_scale"][e], c["w13_global"][e], b)

    def linear2(e, xq, xs, b):
        return nvfp4_linear_a8_reference(xq, xs, c["w2_q"][e], c["w2_scale"][e], c["w2_global"][e], b)

    def column_norm(e):
        return dequantize_nvfp4(c["w2_q"][e], c["w2_scale"][e], c["w2_global"][e]).double().norm(dim=0).max().item()

    return moe_reference_a8(hidden_states, c["w13_q"].shape[0], linear13, linear2, column_norm, topk_weights, topk_ids,
                            return_flip=return_flip, **kw)  # fmt: skip


__all__ = ["a8_operands", "nvfp4_linear_a8_reference", "moe_reference_nvfp4"]
