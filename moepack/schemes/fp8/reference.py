"""fp8_block's torch oracle (SEMANTICS.md §3 "fp8 block", W8A16): the dense fp32 reference of
moepack/reference.py on the exactly dequantized weights (activations in their own dtype)."""

from __future__ import annotations

import torch

from ...reference import moe_reference
from .quantize import dequantize_fp8


def moe_reference_fp8(
    hidden_states: torch.Tensor, c: dict, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, return_flip: bool = False, **kw
):
    """fp8_block experts on canonical tensors (moepack/schemes/fp8/pack.py: ``w13_q``, ``w13_scale``,
    ``w2_q``, ``w2_scale``, ``group_size``): ``moe_reference`` on ``e4m3fn(q) * scale`` in fp32.
    The keywords (activation, alpha, limit, interleaved, biases, expert_map) are moe_reference's;
    ``act_mode`` may only be "a16"."""
    mode = kw.pop("act_mode", "a16")
    if mode != "a16":
        raise ValueError(f"act_mode={mode!r}: fp8_block runs with a16 activations only")
    g = int(c["group_size"])
    w13 = dequantize_fp8(c["w13_q"], c["w13_scale"], g)
    w2 = dequantize_fp8(c["w2_q"], c["w2_scale"], g)
    out = moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, **kw)
    return (out, 0.0) if return_flip else out


__all__ = ["moe_reference_fp8"]
