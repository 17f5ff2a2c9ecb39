"""fp8_block's codes: the e4m3fn decode (a 256-entry table built from the bit fields, not from
torch's cast, so the tests can hold one against the other), the quantizer from float weights
(round to nearest even through torch's float8_e4m3fn cast) and the rules a canonical fp8 weight
obeys.

e4m3fn (OCP FP8 "E4M3", the "fn" = finite, no infinities): sign bit 7, exponent bits 6..3
(bias 7), mantissa bits 2..0. Exponent 0 is subnormal (m / 8 * 2^-6 = m * 2^-9); exponent 15
with mantissa 7 (0x7F / 0xFF) is NaN, every other code is finite; the largest is 0x7E = 448.
0x80 is -0.
"""

from __future__ import annotations

import torch

from ...errors import LayoutError
from ...pack import FLOAT_DTYPES, check_float

FP8_MAX = 448.0  # the largest finite e4m3fn value (code 0x7E)
FP8_DEFAULT_GROUP = 128  # DeepSeek-V3 / Qwen3-FP8 / compressed-tensors FP8_BLOCK: 128 x 128 blocks
NAN_CODES = (0x7F, 0xFF)


def _table() -> torch.Tensor:
    vals = []
    for c in range(256):
        sign = -1.0 if c & 0x80 else 1.0
        e, m = (c >> 3) & 15, c & 7
        if e == 15 and m == 7:
            vals.append(float("nan"))
        elif e == 0:
            vals.append(sign * m * 2.0**-9)
        else:
            vals.append(sign * (1.0 + m / 8.0) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float32)


E4M3FN_VALUES = _table()  # fp32 value of every code (NaN at 0x7F and 0xFF)


def decode_e4m3fn(q: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bit patterns -> fp32 values, exactly (NaN for the NaN codes)."""
    if q.dtype != torch.uint8:
        raise LayoutError(f"fp8 codes have dtype {q.dtype}: fp8_block codes are e4m3fn bit patterns in uint8")
    return E4M3FN_VALUES[q.long()]


def check_fp8_codes(name: str, q: torch.Tensor) -> None:
    """A LayoutError naming the first NaN code (0x7F / 0xFF) of ``q``: NaN has no meaning as a weight."""
    bad = (q & 0x7F) == 0x7F
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise LayoutError(f"{name}{idx} = 0x{int(q[tuple(idx)]):02X}: an e4m3fn NaN code (0x7F / 0xFF); weights must be finite")


def _groups(k: int, g: int) -> int:
    return 1 if g <= 0 else -(-k // g)


def expand_scale(scale: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """[..., N, ng] fp32 scales -> [..., N, K] (column k gets group k // G; G = -1: the one group)."""
    if group_size <= 0:
        return scale[..., :1].expand(*scale.shape[:-1], k)
    return scale.repeat_interleave(group_size, dim=-1)[..., :k]


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Canonical fp8 -> fp32 ``e4m3fn(q) * scale[n, k // G]``: one fp32 multiplication per weight,
    exact for BF16/F16 scales (4 + 11 significant bits at most), rounded once (to nearest, 2^-24
    relative at most) for F32 scales."""
    return decode_e4m3fn(q) * expand_scale(scale.float(), q.shape[-1], group_size)


def quantize_fp8_block(w: torch.Tensor, group_size: int = FP8_DEFAULT_GROUP, block_rows: int | None = None):
    """Float weights ``w [..., N, K]`` -> (q uint8 e4m3fn bit patterns [..., N, K], scale fp32
    [..., N, ceil(K / G)]; per channel (G = -1): [..., N, 1]), the canonical form.

    Per block of ``block_rows`` rows (default: G; per channel: one row) by G columns, in fp32:
    ``scale = amax(|w|) / 448``, ``q = e4m3fn(w / scale)`` rounded to nearest even by torch's
    float8_e4m3fn cast (clamped to +-448 first, so a quotient rounded just above it never
    becomes NaN). A block whose scale would be 0 (all zeros, or an amax that underflows) gets
    scale 1 and codes 0: every scale is finite and > 0. The block's scale is stored on each of
    its rows (the canonical form is per row); partial edge blocks use their real elements."""
    if w.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"weight has dtype {w.dtype}: quantize_fp8_block takes float32, bfloat16 or float16")
    if w.dim() < 2:
        raise LayoutError(f"weight has shape {list(w.shape)}: must be [..., N, K]")
    if group_size == 0 or group_size < -1:
        raise LayoutError(f"group_size={group_size}: must be a positive number of K values or -1 (per channel)")
    check_float("weight", w)
    wf = w.float()
    n, k = wf.shape[-2], wf.shape[-1]
    g = max(k, 1) if group_size == -1 else group_size
    br = 1 if group_size == -1 else (block_rows or group_size)
    ng, nb = _groups(k, g), _groups(n, br)
    padded = torch.zeros(*wf.shape[:-2], nb * br, ng * g, dtype=torch.float32)
    padded[..., :n, :k] = wf
    blocks = padded.unflatten(-1, (ng, g)).unflatten(-3, (nb, br))  # [..., nb, br, ng, g]
    scale = blocks.abs().amax(dim=(-3, -1)) / FP8_MAX  # [..., nb, ng]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    rows = scale.repeat_interleave(br, dim=-2)[..., :n, :]  # [..., N, ng]
    scaled = (wf / expand_scale(rows, k, group_size)).clamp_(-FP8_MAX, FP8_MAX)
    q = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    return q.contiguous(), rows.contiguous()


def check_fp8_canonical(weight: str, q: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
    """The rules a canonical fp8 weight obeys (a LayoutError names the tensor, the value and the rule)."""
    if q.dtype != torch.uint8:
        raise LayoutError(f"{weight}_q has dtype {q.dtype}: fp8_block codes are e4m3fn bit patterns in uint8 "
                          "(a float8_e4m3fn tensor .view(torch.uint8))")  # fmt: skip
    if q.dim() != 3:
        raise LayoutError(f"{weight}_q has shape {list(q.shape)}: must be [E, N, K]")
    e, n, k = q.shape
    want = (e, n, _groups(k, group_size))
    if tuple(scale.shape) != want:
        raise LayoutError(f"{weight}_scale has shape {list(scale.shape)}: must be {list(want)} "
                          f"(ceil(K={k} / group_size={group_size}) groups per output row)")  # fmt: skip
    check_fp8_codes(f"{weight}_q", q)
    sf = scale.float()
    bad = ~(torch.isfinite(sf) & (sf > 0))
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise LayoutError(f"{weight}_scale{idx} = {sf[tuple(idx)].item()!r}: scales must be finite and > 0")


__all__ = ["FP8_MAX", "FP8_DEFAULT_GROUP", "NAN_CODES", "E4M3FN_VALUES", "decode_e4m3fn", "check_fp8_codes", "expand_scale",
           "dequantize_fp8", "quantize_fp8_block", "check_fp8_canonical"]  # fmt: skip
