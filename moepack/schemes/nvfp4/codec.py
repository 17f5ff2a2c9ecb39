"""The exact meaning of NVFP4 weights (docs/SEMANTICS.md §3 "nvfp4"), in torch: a leaf module the
readers, the scheme and the tests share.

A weight is a 4-bit e2m1 code q (mxfp4's: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign),
one float8 e4m3fn scale byte c per 16 consecutive K values of an output row, and one fp32 global
scale g per output row (the tensor-wide scale of the source Linear the row came from, stored per
row so that a fused gate/up keeps each half's own). The group's scale is rounded to fp32 once, as
the source's own decode rounds it, and the weight is the fp32 product:

* compressed-tensors (``weight_global_scale``, a divisor; g > 0):
  ``s = fp32(e4m3(c) / g)``, ``w = fp32(e2m1(q) * s)`` — compressed_tensors 0.20.1
  ``_dequantize``: ``scale = weight_scale / global_scale`` (fp32), ``x_q * scale``;
* ModelOpt (``weight_scale_2``, a multiplier m > 0, stored as g = -m):
  ``s = fp32(e4m3(c) * m)``, ``w = fp32(e2m1(q) * s)``: vLLM's order
  (``nvfp4_emulation_utils.dequantize_to_dtype``: ``weight_scale.float() * weight_scale_2``, then
  times the e2m1 values, in fp32).

Padding rows have g = 0 (a multiplier of 0) and scale byte 0. A scale byte with the sign bit set
(negative, or -0) or 0x7F / 0xFF (NaN) is never packed; a global that is zero, negative (CT), NaN
or infinite is refused by the readers.
"""

from __future__ import annotations

import torch

from ..mxfp4.codec import E2M1_VALUES, decode_e2m1

NV4_GROUP = 16  # K values per e4m3 scale
E4M3_NAN = (0x7F, 0xFF)
E4M3_LARGEST = 448.0


def e4m3_to_float(c: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bytes -> fp32, exactly (NaN for 0x7F / 0xFF)."""
    return c.to(torch.uint8).view(torch.float8_e4m3fn).float()


def group_scales(scale: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes ``scale`` [..., N, ng] and per-row globals ``glob`` [..., N] -> the fp32 group
    scales [..., N, ng]: e4m3 / g where g > 0, e4m3 * -g elsewhere (module docstring)."""
    v = e4m3_to_float(scale)
    g = glob.float().unsqueeze(-1).expand_as(v)
    return torch.where(g > 0, v / torch.where(g > 0, g, torch.ones_like(g)), v * -g)


def dequantize_nvfp4(q: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """Canonical codes ``q`` [..., N, K], e4m3 bytes ``scale`` [..., N, ceil(K / 16)] and globals
    ``glob`` [..., N] -> fp32 [..., N, K]: ``e2m1(q[n, k]) * s[n, k // 16]``, s = group_scales."""
    k = q.shape[-1]
    s = group_scales(scale, glob).repeat_interleave(NV4_GROUP, dim=-1)[..., :k]
    return decode_e2m1(q) * s


__all__ = ["NV4_GROUP", "E4M3_NAN", "E4M3_LARGEST", "E2M1_VALUES", "decode_e2m1", "e4m3_to_float", "group_scales",
           "dequantize_nvfp4"]  # fmt: skip
