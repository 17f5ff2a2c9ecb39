"""int4_group's quantizer (round to nearest, symmetric or asymmetric, per K group or channel),
its exact dequantization, and the rules a canonical int4 weight obeys."""

from __future__ import annotations

import torch

from ...errors import LayoutError
from ...pack import FLOAT_DTYPES, check_float

INT4_DEFAULT_GROUP = 128


def group_of_k(k: int, g: int) -> int:
    return 1 if g <= 0 else -(-k // g)


def quantize_int4_group(w: torch.Tensor, group_size: int = INT4_DEFAULT_GROUP, *, sym: bool = True):
    """Round-to-nearest int4 of float weights ``w [..., N, K]`` per (output channel, K group of
    ``group_size``; -1 = the whole row): returns (q uint8, scale fp32, zero uint8) in the
    canonical form above.

    Symmetric (the default, GPTQ's and compressed-tensors' sym rule): ``scale = amax / 7.5``,
    ``zero = 8``, ``q = clamp(round_half_even(w / scale) + 8, 0, 15)``. Asymmetric: ``scale =
    (max - min) / 15`` over a range that includes 0, ``zero = clamp(round(-min / scale), 0,
    15)``, ``q = clamp(round(w / scale) + zero, 0, 15)``. A group whose scale would be 0 (all
    zeros) gets scale 1 and codes equal to its zero point: every scale is finite and > 0."""
    if w.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"weight has dtype {w.dtype}: quantize_int4_group takes float32, bfloat16 or float16")
    if w.dim() < 2:
        raise LayoutError(f"weight has shape {list(w.shape)}: must be [..., N, K]")
    if group_size == 0 or group_size < -1:
        raise LayoutError(f"group_size={group_size}: must be a positive number of K values or -1 (per channel)")
    check_float("weight", w)
    wf = w.float()
    k = wf.shape[-1]
    g = k if group_size == -1 else group_size
    ng = group_of_k(k, g)
    padded = torch.zeros(*wf.shape[:-1], ng * g, dtype=torch.float32)
    padded[..., :k] = wf
    grp = padded.view(*wf.shape[:-1], ng, g)
    # the partial last group's padding must not widen its range: mask it out of min/max
    valid = torch.zeros(ng * g, dtype=torch.bool)
    valid[:k] = True
    valid = valid.view(ng, g)
    big = torch.finfo(torch.float32).max
    if sym:
        amax = torch.where(valid, grp.abs(), torch.zeros(())).amax(dim=-1)
        scale = amax / 7.5
        zero = torch.full_like(scale, 8.0)
    else:
        mx = torch.where(valid, grp, torch.full((), -big)).amax(dim=-1).clamp(min=0.0)
        mn = torch.where(valid, grp, torch.full((), big)).amin(dim=-1).clamp(max=0.0)
        scale = (mx - mn) / 15.0
        zero = torch.round(-mn / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp(0, 15)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(grp / scale.unsqueeze(-1)) + zero.unsqueeze(-1)
    q = q.clamp_(0, 15).reshape(*wf.shape[:-1], ng * g)[..., :k]
    return q.to(torch.uint8).contiguous(), scale.contiguous(), zero.to(torch.uint8).contiguous()


def dequantize_int4_group(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Canonical int4 -> fp32 ``(q - zero[g]) * scale[g]`` (exact, see the module docstring)."""
    k = q.shape[-1]
    g = k if group_size <= 0 else group_size
    idx = torch.arange(k) // g
    z = zero.to(torch.int16).index_select(-1, idx)
    s = scale.float().index_select(-1, idx)
    return (q.to(torch.int16) - z).float() * s


def check_int4_canonical(weight: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> None:
    """The rules a canonical int4 weight obeys (a LayoutError names the tensor, value and rule)."""
    if q.dtype != torch.uint8 or zero.dtype != torch.uint8:
        raise LayoutError(f"{weight}_q / {weight}_zero have dtypes {q.dtype}/{zero.dtype}: int4 codes and zero points are uint8")
    if q.dim() != 3:
        raise LayoutError(f"{weight}_q has shape {list(q.shape)}: must be [E, N, K]")
    e, n, k = q.shape
    want = (e, n, group_of_k(k, group_size))
    for name, t in ((f"{weight}_scale", scale), (f"{weight}_zero", zero)):
        if tuple(t.shape) != want:
            raise LayoutError(f"{name} has shape {list(t.shape)}: must be {list(want)} (ceil(K={k} / group_size={group_size}) groups)")
    if int(q.max()) > 15 if q.numel() else False:
        idx = (q > 15).nonzero()[0].tolist()
        raise LayoutError(f"{weight}_q{idx} = {int(q[tuple(idx)])}: int4 codes are 0..15")
    if zero.numel() and int(zero.max()) > 15:
        idx = (zero > 15).nonzero()[0].tolist()
        raise LayoutError(f"{weight}_zero{idx} = {int(zero[tuple(idx)])}: int4 zero points are 0..15")
    sf = scale.float()
    bad = ~(torch.isfinite(sf) & (sf > 0))
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise LayoutError(f"{weight}_scale{idx} = {sf[tuple(idx)].item()!r}: scales must be finite and > 0")


def check_w13_perm(name: str, perm: torch.Tensor, e: int, h: int) -> torch.Tensor:
    """An act-order permutation ``[E, H]`` (any integer dtype) as contiguous int32, or a
    LayoutError naming the tensor, the value and the rule: every row is a permutation of 0..H-1
    (row e, column j: the input channel of expert e's code column j)."""
    if perm.dtype.is_floating_point or perm.dtype == torch.bool or perm.dtype.is_complex:
        raise LayoutError(f"{name} has dtype {perm.dtype}: an act-order permutation holds integer channel indices (int32)")
    if tuple(perm.shape) != (e, h):
        raise LayoutError(f"{name} has shape {list(perm.shape)}: must be [E, H] = {[e, h]} (one input permutation per expert)")
    p = perm.to(torch.int64)
    bad = (p < 0) | (p >= h)
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise LayoutError(f"{name}{idx} = {int(p[tuple(idx)])}: act-order permutation entries must be in [0, H={h})")
    dup = p.sort(dim=-1).values != torch.arange(h)
    if bool(dup.any()):
        r = int(dup.nonzero()[0, 0])
        missing = int(torch.isin(torch.arange(h), p[r], invert=True).nonzero()[0])
        raise LayoutError(f"{name}[{r}] is not a permutation of 0..{h - 1}: channel {missing} is missing (each input "
                          "channel appears exactly once)")  # fmt: skip
    return p.to(torch.int32).contiguous()


__all__ = ["INT4_DEFAULT_GROUP", "quantize_int4_group", "dequantize_int4_group", "check_int4_canonical", "check_w13_perm"]
