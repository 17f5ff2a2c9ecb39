"""mxfp4's quantizer from float weights (OCP MX v1.0, round to nearest even) and the rules a
canonical mxfp4 weight obeys. The exact decode is codec.py's.

The rule, per (output row, K group of 32 consecutive values; the last group of a row holds
the real values left, ceil(K / 32) groups):

* ``amax = max |w|`` over the group, in fp32;
* the shared exponent ``s = floor(log2(amax)) - 2`` (OCP MX: the group's largest power of two
  minus e2m1's largest exponent, 2), clamped to e8m0's range [-127, 127]; ``e = s + 127``, so
  the scale is ``2^s``. A group of zeros gets e = 127 (scale 1) and codes 0: it stays 0. e is
  never 255 (NaN);
* every value ``v = w * 2^-s`` (a power-of-two multiply: exact where v is a normal fp32) is
  rounded to the nearest e2m1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the even code
  (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), and saturated at 6;
  the sign goes to bit 3 (a negative value that rounds to 0 is code 8, -0).

The error. With s = floor(log2(amax)) - 2 the scaled amax lies in [4, 8): values up to 6 (the
top of e2m1's grid) round to the grid, and values in (6, 8) saturate to 6, an error of up to
2 * 2^s, a quarter of the group's amax at most (only values above 6 * 2^s = 1.5 *
2^floor(log2 amax) are clipped). Below, the error of a rounded value is
at most half a step of the grid at its magnitude: 0.25 * 2^s under 2, 0.5 * 2^s in [2, 4), 1 * 2^s
in [4, 6]. Relative to amax that is at most 1/4 (saturation) and typically ~1/16; on bell-shaped
(Gaussian) weights the whole weight's relative error (Frobenius) is 0.115, on heavy-tailed
ones (Student-t, 3 degrees of freedom) 0.14 (tests/schemes/mxfp4/test_mxfp4.py).
This is OCP's rule; compressed-tensors' observer rounds amax's exponent UP when its mantissa is at
least 1.75 (``round_to_power_2``), which avoids most saturation at the cost of one bit of
resolution in those groups: the two agree on every group whose amax has a mantissa below 1.75,
and code for code on the values (tests/schemes/mxfp4/test_mxfp4.py holds both against the library).
"""

from __future__ import annotations

import torch

from ...errors import LayoutError
from ...pack import FLOAT_DTYPES, check_float
from .codec import E8M0_LARGEST, E8M0_NAN, MX4_GROUP, e8m0_to_float

E2M1_MAX = 6.0
E8M0_BIAS = 127
ZERO_GROUP_EXPONENT = 127  # the e8m0 byte of an all-zero group: scale 1, every code 0
# round to nearest even on the e2m1 magnitudes: (midpoint, ties go up) -> passing it adds one
# code; a tie at a midpoint goes to the even code (codes 0, 2, 4, 6 are the even ones)
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
# the same as bucketize boundaries (the code is the number of boundaries strictly below |v|): a
# midpoint whose tie goes up is moved one fp32 ulp down, so |v| = midpoint passes it
_MIDS = torch.tensor([t for t, _ in _THRESHOLDS], dtype=torch.float32)
_BOUNDS = torch.where(torch.tensor([up for _, up in _THRESHOLDS]), torch.nextafter(_MIDS, torch.zeros(())), _MIDS)


def _groups(k: int) -> int:
    return -(-k // MX4_GROUP)


def shared_exponent(amax: torch.Tensor) -> torch.Tensor:
    """fp32 group maxima (>= 0) -> the e8m0 bytes (uint8) of their groups: ``floor(log2(amax)) - 2
    + 127`` clamped to 0..254, 127 for amax = 0. ``floor(log2(x))`` is read from frexp (x = m *
    2^ex, m in [0.5, 1): floor(log2 x) = ex - 1), exact for every finite fp32, subnormals too."""
    _, ex = torch.frexp(amax.float())
    e = (ex.to(torch.int32) - 1 - 2 + E8M0_BIAS).clamp_(0, E8M0_NAN - 1)
    return torch.where(amax == 0, torch.full_like(e, ZERO_GROUP_EXPONENT), e).to(torch.uint8)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> e2m1 codes (uint8 0..15): the nearest
    magnitude of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to even, saturated at 6; the sign in bit 3."""
    idx = torch.bucketize(v.abs(), _BOUNDS).to(torch.uint8)
    return idx.bitwise_or_(torch.signbit(v).to(torch.uint8) << 3)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights ``w [..., N, K]`` -> (q uint8 e2m1 codes [..., N, K], scale uint8 e8m0
    [..., N, ceil(K / 32)]), the canonical form, by the rule of the module docstring."""
    if w.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"weight has dtype {w.dtype}: quantize_mxfp4 takes float32, bfloat16 or float16")
    if w.dim() < 2:
        raise LayoutError(f"weight has shape {list(w.shape)}: must be [..., N, K]")
    check_float("weight", w)  # names the element in the whole tensor (expert index included)
    if w.dim() > 2 and w.shape[0] > 1:  # expert by expert: fp32 temporaries of one expert, not of a layer
        parts = [_quantize(x) for x in w.unbind(0)]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    return _quantize(w)


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    k = wf.shape[-1]
    ng = _groups(k)
    padded = torch.zeros(*wf.shape[:-1], ng * MX4_GROUP, dtype=torch.float32)  # zeros never raise a group's amax
    padded[..., :k] = wf
    grp = padded.view(*wf.shape[:-1], ng, MX4_GROUP)
    e = shared_exponent(grp.abs().amax(dim=-1))
    # 2^-s = 2^(127 - e) = e8m0_to_float(254 - e), exact (2^-127 .. 2^127, all representable in fp32)
    inv = e8m0_to_float((E8M0_NAN - 1) - e)
    q = round_to_e2m1(grp * inv.unsqueeze(-1)).reshape(*wf.shape[:-1], ng * MX4_GROUP)[..., :k]
    return q.contiguous(), e.contiguous()


def check_mxfp4_canonical(weight: str, q: torch.Tensor, scale: torch.Tensor) -> None:
    """The rules a canonical mxfp4 weight obeys (a LayoutError names the tensor, the value and
    the rule): ``{weight}_q`` uint8 [E, N, K] codes 0..15, ``{weight}_scale`` uint8 e8m0
    [E, N, ceil(K / 32)], never 255 (NaN)."""
    if q.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise LayoutError(f"{weight}_q / {weight}_scale have dtypes {q.dtype}/{scale.dtype}: mxfp4 codes (e2m1, one "
                          "per byte) and scales (e8m0 exponent bytes) are uint8")  # fmt: skip
    if q.dim() != 3:
        raise LayoutError(f"{weight}_q has shape {list(q.shape)}: must be [E, N, K]")
    e, n, k = q.shape
    want = (e, n, _groups(k))
    if tuple(scale.shape) != want:
        raise LayoutError(f"{weight}_scale has shape {list(scale.shape)}: must be {list(want)} "
                          f"(ceil(K={k} / 32) e8m0 scales per output row)")  # fmt: skip
    if q.numel() and int(q.max()) > 15:
        idx = (q > 15).nonzero()[0].tolist()
        raise LayoutError(f"{weight}_q{idx} = {int(q[tuple(idx)])}: e2m1 codes are 0..15 (one per byte)")
    check_e8m0(f"{weight}_scale", scale)


def check_e8m0(name: str, scale: torch.Tensor) -> None:
    """A LayoutError naming the first e8m0 byte of ``scale`` above E8M0_LARGEST: 255 (NaN) has no
    meaning as a scale, and from 253 up e2m1's largest code times 2^(e - 127) overflows float32
    (the fused kernels apply the scale after the group's dot product, so such weights would give
    finite outputs where the format's decode gives Inf: refused, as convert and open do)."""
    bad = scale == E8M0_NAN
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise LayoutError(f"{name}{idx} = 255: the e8m0 NaN (scales are 2^(e - 127), e = 0..{E8M0_LARGEST}); weights must "
                          "be finite")  # fmt: skip
    bad = scale > E8M0_LARGEST
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        e = int(scale[tuple(idx)])
        raise LayoutError(f"{name}{idx} = {e}: e8m0 scale 2^{e - 127} x e2m1's largest code 6 overflows float32 "
                          f"(scales must be 0..{E8M0_LARGEST}); weights must be finite")  # fmt: skip


__all__ = ["E2M1_MAX", "E8M0_BIAS", "ZERO_GROUP_EXPONENT", "shared_exponent", "round_to_e2m1", "quantize_mxfp4",
           "check_mxfp4_canonical", "check_e8m0"]  # fmt: skip
