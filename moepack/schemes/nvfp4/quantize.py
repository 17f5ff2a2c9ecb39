"""nvfp4's quantizer from float weights (compressed-tensors' NVFP4 rule) and the rules a canonical
nvfp4 weight obeys. The exact decode is codec.py's.

The rule (compressed-tensors 0.20.1, ``generate_gparam`` + ``calculate_qparams`` with
``FP8_E4M3`` group scales and ``quantize``'s FP4 rounding), per weight of one expert (w13: gate
and up together, which is llm-compressor's fused gate/up global scale; w2), in fp32:

* the global scale ``gs = 448 * 6 / amax(|w|)`` (e4m3's largest value times e2m1's over the
  tensor's amax; amax clamped to the smallest normal fp32; a NaN or infinite result becomes 1);
* per (output row, K group of 16): ``amax_g / 6 * gs`` rounded to e4m3 (round to nearest even,
  clamped to +-448); a scale of 0 (a group of zeros) becomes 0.125 (compressed-tensors' e4m3
  "eps"), so every scale byte is positive;
* every value ``v = w / fp32(e4m3 / gs)`` clamped to +-6 and rounded to the nearest e2m1
  magnitude, ties to the even code (mxfp4's round_to_e2m1: compressed-tensors' cast_to_fp4 draws
  the same boundaries), the sign to bit 3 (a negative value rounding to 0 is code 8, -0).

The canonical globals are compressed-tensors' divisor gs, one per output row (the same over a
weight). The error: the group's amax maps to 6 * (e4m3 rounding, 2^-4 relative at most), so a
value's error is at most half an e2m1 step at its magnitude plus the scale's rounding; on Gaussian
weights the whole weight's relative error (Frobenius) is ~0.10 (tests/schemes/nvfp4).
"""

from __future__ import annotations

import torch

from ...errors import LayoutError
from ...pack import FLOAT_DTYPES, check_float
from ..mxfp4.quantize import round_to_e2m1
from .codec import E4M3_LARGEST, NV4_GROUP, e4m3_to_float

E2M1_MAX = 6.0
E4M3_EPS = 0.125  # compressed-tensors' replacement of a zero group scale (_get_dtype_eps)


def _groups(k: int) -> int:
    return -(-k // NV4_GROUP)


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``generate_gparam`` of one weight: fp32 ``448 * 6 / amax`` (shape [])."""
    amax = w.float().abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    gs = torch.tensor(E4M3_LARGEST * E2M1_MAX, dtype=torch.float32) / amax
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights ``w [..., N, K]`` -> (q uint8 e2m1 codes [..., N, K], scale uint8 e4m3 bytes
    [..., N, ceil(K / 16)], global fp32 [..., N]), the canonical form, by the module's rule; a
    leading expert dimension gets one global scale per expert."""
    if w.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"weight has dtype {w.dtype}: quantize_nvfp4 takes float32, bfloat16 or float16")
    if w.dim() < 2:
        raise LayoutError(f"weight has shape {list(w.shape)}: must be [..., N, K]")
    check_float("weight", w)
    if w.dim() > 2:
        parts = [quantize_nvfp4(x) for x in w.unbind(0)]
        return tuple(torch.stack([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]
    return _quantize(w)


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    wf = w.float()
    n, k = wf.shape
    ng = _groups(k)
    gs = global_scale(wf)
    padded = torch.zeros(n, ng * NV4_GROUP, dtype=torch.float32)
    padded[:, :k] = wf
    grp = padded.view(n, ng, NV4_GROUP)
    amax = grp.abs().amax(dim=-1)
    s = gs * (amax / E2M1_MAX)
    c = s.clamp(-E4M3_LARGEST, E4M3_LARGEST).to(torch.float8_e4m3fn).float()
    c = torch.where(c == 0, torch.full_like(c, E4M3_EPS), c)
    scale_bytes = c.to(torch.float8_e4m3fn).view(torch.uint8)
    eff = e4m3_to_float(scale_bytes) / gs  # fp32, compressed-tensors' scale / global_scale
    v = (grp / eff.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    q = round_to_e2m1(v).reshape(n, ng * NV4_GROUP)[:, :k]
    return q.contiguous(), scale_bytes.contiguous(), gs.expand(n).contiguous()


def check_e4m3_scales(name: str, scale: torch.Tensor, err=LayoutError, at: tuple = ()) -> None:
    """``err`` naming the first e4m3 scale byte that is NaN (0x7F / 0xFF) or negative (sign bit
    set, -0 included), with its index (``at``: the index of ``scale`` in the stored tensor)."""
    s = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    nan = (s & 0x7F) == 0x7F
    if bool(nan.any()):
        idx = [*at, *(int(i) for i in nan.nonzero()[0])]
        raise err(f"tensor {name!r}{idx} = 0x{int(s[tuple(idx[len(at):])]):02x}: an e4m3 NaN scale; NVFP4 group scales "
                  "must be finite and non-negative")  # fmt: skip
    neg = s >= 0x80
    if bool(neg.any()):
        idx = [*at, *(int(i) for i in neg.nonzero()[0])]
        b = int(s[tuple(idx[len(at):])])
        v = float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float())
        raise err(f"tensor {name!r}{idx} = 0x{b:02x} ({v}): a negative e4m3 scale; NVFP4 group scales must be non-negative")


def check_globals(name: str, glob: torch.Tensor, err=LayoutError) -> None:
    """``err`` naming the first canonical global that is NaN, infinite or zero (> 0: a
    compressed-tensors divisor; < 0: a ModelOpt multiplier negated; 0 means neither)."""
    bad = ~torch.isfinite(glob) | (glob == 0)
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise err(f"tensor {name!r}{idx} = {float(glob[tuple(idx)])}: NVFP4 global scales must be finite and nonzero")


def check_nvfp4_canonical(weight: str, q: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor) -> None:
    """The rules a canonical nvfp4 weight obeys (a LayoutError names the tensor, the value and the
    rule): ``{weight}_q`` uint8 [E, N, K] codes 0..15, ``{weight}_scale`` uint8 e4m3 bytes
    [E, N, ceil(K / 16)], never NaN or negative, ``{weight}_global`` fp32 [E, N], finite."""
    if q.dtype != torch.uint8 or scale.dtype != torch.uint8 or glob.dtype != torch.float32:
        raise LayoutError(f"{weight}_q / {weight}_scale / {weight}_global have dtypes {q.dtype}/{scale.dtype}/{glob.dtype}: "
                          "nvfp4 codes (e2m1, one per byte) and scales (e4m3 bytes) are uint8, globals float32")  # fmt: skip
    if q.dim() != 3:
        raise LayoutError(f"{weight}_q has shape {list(q.shape)}: must be [E, N, K]")
    e, n, k = q.shape
    want = (e, n, _groups(k))
    if tuple(scale.shape) != want:
        raise LayoutError(f"{weight}_scale has shape {list(scale.shape)}: must be {list(want)} "
                          f"(ceil(K={k} / 16) e4m3 scales per output row)")  # fmt: skip
    if tuple(glob.shape) != (e, n):
        raise LayoutError(f"{weight}_global has shape {list(glob.shape)}: must be {[e, n]} (one global scale per output row)")
    if q.numel() and int(q.max()) > 15:
        idx = (q > 15).nonzero()[0].tolist()
        raise LayoutError(f"{weight}_q{idx} = {int(q[tuple(idx)])}: e2m1 codes are 0..15 (one per byte)")
    check_e4m3_scales(f"{weight}_scale", scale)
    check_globals(f"{weight}_global", glob)


__all__ = ["E2M1_MAX", "E4M3_EPS", "global_scale", "quantize_nvfp4", "check_e4m3_scales", "check_globals",
           "check_nvfp4_canonical"]  # fmt: skip
