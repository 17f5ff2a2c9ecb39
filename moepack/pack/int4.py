"""Scheme int4_group (docs/SEMANTICS.md §3): canonical int4 tensors -> the u4 layouts' bytes.

Canonical form of one weight (``w13`` [E, 2I, H] or ``w2`` [E, H, I], nn.Linear orientation):

* ``q``     uint8 [E, N, K]  codes 0..15;
* ``scale`` fp32  [E, N, ceil(K / G)]  (per channel: [E, N, 1]);
* ``zero``  uint8 [E, N, ceil(K / G)]  true zero points 0..15 (8 for symmetric sources),

with ``W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]``, computed in fp32, which is
exact: ``q - zero`` is an integer in [-15, 15] and the scales come from fp16/bf16 checkpoints
(11 significant bits at most), so the product has at most 15 significant bits. G does not
have to divide K: the last group is partial (ceil(K / G) groups), as GPTQ and compressed-tensors
write them.

The packed form (moepack/layout.py, the u4 layouts): codes blocked like every layout (blocks of
32 output columns, K groups of 8) with the 8 codes of one column in one 32-bit word, byte j =
code[k0 + j] | code[k0 + 4 + j] << 4; scales and zero points transposed to [E, ceil(Kp / G), Np]
(per channel [E, Np]) in packed row order. Padding: K beyond the real K holds the group's zero
point (dequantizes to exactly 0); padded rows have code 0, scale 0, zero 0.
"""

from __future__ import annotations

import torch

from ..errors import LayoutError
from ..layout import PackedLayout, layout_padded_i, layout_padded_k, layout_padded_n

INT4_DEFAULT_GROUP = 128


def _groups(k: int, g: int) -> int:
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
    from . import FLOAT_DTYPES, _check_float

    if w.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"weight has dtype {w.dtype}: quantize_int4_group takes float32, bfloat16 or float16")
    if w.dim() < 2:
        raise LayoutError(f"weight has shape {list(w.shape)}: must be [..., N, K]")
    if group_size == 0 or group_size < -1:
        raise LayoutError(f"group_size={group_size}: must be a positive number of K values or -1 (per channel)")
    _check_float("weight", w)
    wf = w.float()
    k = wf.shape[-1]
    g = k if group_size == -1 else group_size
    ng = _groups(k, g)
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
    want = (e, n, _groups(k, group_size))
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


def pack_u4_codes(q: torch.Tensor, zero: torch.Tensor, group_size: int, lay: PackedLayout, np_: int, kp: int) -> torch.Tensor:
    """[E, N, K] codes -> packed [E, np_, kp / 2] uint8: K padding holds the group's zero point,
    padded rows code 0; blocks of 32 columns, K groups of 8, byte j = c[j] | c[j + 4] << 4."""
    e, n, k = q.shape
    bn, kpk = lay.block_n, lay.k_pack
    g = kp if group_size <= 0 else group_size
    c = torch.zeros(e, np_, kp, dtype=torch.uint8)
    c[:, :n, :k] = q
    if kp > k:
        gi = torch.arange(k, kp) // g
        gi = gi.clamp(max=zero.shape[-1] - 1)
        c[:, :n, k:] = zero.index_select(-1, gi)
    c = c.view(e, np_ // bn, bn, kp // kpk, kpk).permute(0, 1, 3, 2, 4)  # [E, Nb, Kg, bn, 8]
    half = kpk // 2
    packed = c[..., :half] | (c[..., half:] << 4)  # [E, Nb, Kg, bn, 4]
    return packed.contiguous().view(e, np_, kp // 2)


def unpack_u4_codes(packed: torch.Tensor, n: int, k: int, lay: PackedLayout) -> torch.Tensor:
    """Inverse of pack_u4_codes: [E, Np, Kp/2] -> codes [E, n, k]."""
    e, np_, kh = packed.shape
    kp = 2 * kh
    bn, kpk = lay.block_n, lay.k_pack
    b = packed.view(e, np_ // bn, kp // kpk, bn, kpk // 2)
    c = torch.cat([b & 0x0F, b >> 4], dim=-1)  # [E, Nb, Kg, bn, 8]
    return c.permute(0, 1, 3, 2, 4).reshape(e, np_, kp)[:, :n, :k]


def _group_tensor(v: torch.Tensor, lay: PackedLayout, ngp: int, np_: int) -> torch.Tensor:
    """[E, Np, ng] per-channel-row values -> the layout's [E, ngp, Np] (group) or [E, Np] (channel)."""
    if lay.group_size == 0:
        return v[..., 0].contiguous()
    out = v.new_zeros(v.shape[0], ngp, np_)
    out[:, : v.shape[2], :] = v.transpose(1, 2)
    return out


def pack_int4_weight(
    weight: str,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    interleaved: bool = False,
    layout: PackedLayout,
) -> dict[str, torch.Tensor]:
    """One int4_group weight (canonical ``q``/``scale``/``zero`` of "w13" [E, 2I, H] or "w2"
    [E, H, I]) -> its packed tensors {weight, weight_scale, weight_zero} in packed row order.
    convert (one expert at a time) and pack_experts_int4 both pack through here."""
    from . import pad_intermediate

    gsz = layout.group_size if layout.group_size else -1
    check_int4_canonical(weight, q, scale, zero, gsz)
    e, n, k = q.shape
    sf = scale.float()
    if weight == "w13":
        ip = layout_padded_i(layout, n // 2)
        q, sf, zero = (pad_intermediate(t, ip, interleaved) for t in (q, sf, zero))
        np_, kp = 2 * ip, layout_padded_k(layout, k)
    else:
        np_, kp = layout_padded_n(layout, n), layout_padded_k(layout, layout_padded_i(layout, k))
        pad = lambda t: torch.cat([t, t.new_zeros(e, np_ - n, t.shape[2])], dim=1)  # noqa: E731
        q, sf, zero = pad(q), pad(sf), pad(zero)
    ngp = 1 if layout.group_size == 0 else -(-kp // layout.group_size)
    if zero.shape[2] > ngp:
        raise LayoutError(f"{weight}: {zero.shape[2]} groups but the padded K={kp} holds {ngp}")
    return {
        weight: pack_u4_codes(q, zero, gsz, layout, np_, kp),
        f"{weight}_scale": _group_tensor(sf, layout, ngp, np_),
        f"{weight}_zero": _group_tensor(zero, layout, ngp, np_),
    }


__all__ = [
    "INT4_DEFAULT_GROUP",
    "quantize_int4_group",
    "dequantize_int4_group",
    "check_int4_canonical",
    "check_w13_perm",
    "pack_u4_codes",
    "unpack_u4_codes",
    "pack_int4_weight",
    "pack_experts_int4",
]


def pack_experts_int4(c: dict, *, interleaved: bool = False, layout=None):
    """Pack canonical int4_group experts (``c``: w13_q / w13_scale / w13_zero / w2_* and, optional,
    w13_bias / w2_bias, w13_perm [E, H] (act-order: code column j of expert e is input channel
    w13_perm[e, j]; stored as is, int32) and group_size, which must be the layout's) into an int4
    layout (default: the one of c["group_size"])."""
    from ..layout import int4_layout_for, layout_expert_shapes, layout_get
    from . import PackedExperts, _expert_dims, _pack_biases, _with_biases

    g = int(c.get("group_size", INT4_DEFAULT_GROUP))
    lay = int4_layout_for(g) if layout is None else layout_get(layout)
    if lay.scheme != "int4_group":
        raise LayoutError(f"layout {lay.name} has scheme {lay.scheme}: pack_experts_int4 packs int4_group layouts")
    if (lay.group_size or -1) != (g if g > 0 else -1):
        raise LayoutError(f"group_size={g}: layout {lay.name} has group_size {lay.group_size or -1} (-1 = per channel)")
    e, h, i = _expert_dims(c["w13_q"], c["w2_q"])
    shapes = layout_expert_shapes(lay, e, h, i)
    b13, b2 = _pack_biases(c.get("w13_bias"), c.get("w2_bias"), e, h, i, interleaved, lay)
    tensors = pack_int4_weight("w13", c["w13_q"], c["w13_scale"], c["w13_zero"], interleaved=interleaved, layout=lay)
    tensors.update(pack_int4_weight("w2", c["w2_q"], c["w2_scale"], c["w2_zero"], layout=lay))
    assert tuple(tensors["w13"].shape[:2]) == shapes.w13_shape[:2] and tuple(tensors["w2"].shape[:2]) == shapes.w2_shape[:2]
    if c.get("w13_perm") is not None:
        tensors["w13_perm"] = check_w13_perm("w13_perm", c["w13_perm"], e, h)
    return PackedExperts(layout=lay, num_experts=e, hidden=h, intermediate=i,
                         padded_intermediate=shapes.padded_intermediate, interleaved=interleaved,
                         tensors=_with_biases(tensors, b13, b2))  # fmt: skip
