"""The exact meaning of MXFP4 codes (OCP MX v1.0; docs/SEMANTICS.md §3 "mxfp4"), in torch: a leaf
module the readers, the scheme and the tests share.

A 4-bit e2m1 code q: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa, so codes
0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives (8 = -0). An e8m0 byte e is the
scale 2^(e - 127); e = 255 is NaN (never packed: refused). w = e2m1(q) * 2^(e - 127), one e per
32 consecutive K values of one output row. Every product that is finite is exact in fp32 (fp32
subnormals included: the smallest, 0.5 * 2^-127 = 2^-128, is one)."""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX4_GROUP = 32  # K values per e8m0 scale
E8M0_NAN = 255
# The largest e8m0 byte moepack reads: 6 (e2m1's largest code) x 2^(e - 127) overflows float32
# from e = 253 up, so such a scale decodes weights to Inf (convert, open and verify refuse it).
E8M0_LARGEST = 252


def decode_e2m1(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 (one per element) -> their fp32 values, exactly."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return table[q.long()]


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 bytes -> fp32 2^(e - 127) (exact; e = 0 gives the fp32 subnormal 2^-127), NaN for 255."""
    e = e.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    return torch.where(e == E8M0_NAN, torch.full((), float("nan")), bits.view(torch.float32))


def dequantize_mxfp4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Canonical codes ``q`` [..., N, K] and e8m0 ``scale`` [..., N, ceil(K / 32)] -> fp32 [..., N, K]:
    ``e2m1(q[n, k]) * 2^(scale[n, k // 32] - 127)``, exact where finite."""
    k = q.shape[-1]
    s = e8m0_to_float(scale).repeat_interleave(MX4_GROUP, dim=-1)[..., :k]
    return decode_e2m1(q) * s


__all__ = ["E2M1_VALUES", "MX4_GROUP", "E8M0_NAN", "E8M0_LARGEST", "decode_e2m1", "e8m0_to_float", "dequantize_mxfp4"]
