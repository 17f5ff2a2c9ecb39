"""int8_channel's quantizer: symmetric int8 per output channel, and its exact dequantization."""

from __future__ import annotations

import torch

from ...errors import LayoutError
from ...pack import FLOAT_DTYPES, check_float


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 (SEMANTICS.md §3 "int8 channel"): w [..., N, K] float
    -> (q int8 [..., N, K], scale fp32 [..., N]) with ``w ~= q * scale[..., None]``.

    In fp32: ``scale = amax(|w[n, :]|) / 127`` and ``q = round_half_even(w / scale)`` clamped to
    +-127 (-128 is never produced). A row whose scale would be 0 (all zeros, or an amax below
    127 x the smallest subnormal) gets scale 1 and codes 0: every scale is finite and positive,
    the rule checkpoint scales are held to, and the row still dequantizes to exactly 0."""
    if w.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"weight has dtype {w.dtype}: quantize_int8_per_channel takes float32, bfloat16 or float16")
    if w.dim() < 2:
        raise LayoutError(f"weight has shape {list(w.shape)}: must be [..., N, K]")
    check_float("weight", w)
    wf = w.float()
    scale = wf.abs().amax(dim=-1) / 127.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(wf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., N, K] int8, scale [..., N] (or [..., N, 1]) -> fp32 ``q * scale`` (exact products)."""
    s = scale.float()
    if s.dim() == q.dim():
        s = s.squeeze(-1)
    return q.float() * s.unsqueeze(-1)


__all__ = ["quantize_int8_per_channel", "dequantize_int8"]
