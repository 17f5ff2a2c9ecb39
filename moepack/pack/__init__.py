"""Canonical expert tensors -> packed layout bytes.

The readable Python packer here (``pack_weight_reference``) is the specification; the C++
packer (``torch.ops.moepack.pack_weight``) must produce the same bytes, which
tests/test_pack.py checks. ``pack_experts`` adds the MoE-specific padding:

* the intermediate size I is zero-padded to ``Ip`` (a multiple of ``layout.i_align``), gate and
  up halves separately (``w13 [E, 2I, H]`` -> ``[E, 2Ip, H]``: gate rows at [0, I), up rows at
  [Ip, Ip + I)); for swigluoai, whose gate/up rows are interleaved (2i = gate_i, 2i+1 = up_i),
  whole pairs are appended at the end instead;
* ``w2 [E, H, I]`` gets zero columns up to ``Ip``;
* biases are padded the same way and stored as fp32.

Padding is exact: a zero gate row and a zero up row give act(0, 0) = 0 for every activation,
and the zero w2 columns multiply it.

int8 layouts (W8A8, ``i8_n32k4_x86``): ``quantize_int8_per_channel`` makes symmetric per-channel
codes from float weights, and ``pack_experts_int8`` packs codes + fp32 scales (from there or from
a checkpoint) into the block layout plus four ``[E, N]`` tensors in packed row order: the scales
and the int32 column sums ``sum_k q[n, k]`` (the VNNI kernel feeds u8 = q_x + 128 and subtracts
128 x the column sum; computed here, once, at pack time). Padding rows have code 0, scale 0 and
column sum 0. ``pack_experts(..., layout="i8_n32k4_x86")`` quantizes float weights first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import LayoutError
from ..layout import (
    DEFAULT_LAYOUT,
    INT8_LAYOUT,
    PackedLayout,
    layout_expert_shapes,
    layout_get,
    layout_padded_i,
    layout_padded_k,
    layout_padded_n,
)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PackedExperts:
    """One MoE layer's experts in a packed layout, ready for ``moepack.fused_experts``."""

    layout: PackedLayout
    num_experts: int
    hidden: int
    intermediate: int
    padded_intermediate: int
    interleaved: bool  # gate/up rows interleaved (swigluoai checkpoints)
    w13: torch.Tensor  # [E, 2*Ip, Kp(H)] bf16
    w2: torch.Tensor  # [E, Np(H), Ip] bf16
    w13_bias: torch.Tensor | None  # [E, 2*Ip] fp32
    w2_bias: torch.Tensor | None  # [E, Np(H)] fp32
    # int8 layouts only (None otherwise), in packed row order:
    w13_scale: torch.Tensor | None = None  # [E, 2*Ip] fp32 per-channel scales
    w2_scale: torch.Tensor | None = None  # [E, Np(H)] fp32
    w13_colsum: torch.Tensor | None = None  # [E, 2*Ip] int32 sum_k q[n, k]
    w2_colsum: torch.Tensor | None = None  # [E, Np(H)] int32

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every packed tensor by name (the None ones left out)."""
        names = ("w13", "w2", "w13_bias", "w2_bias", "w13_scale", "w2_scale", "w13_colsum", "w2_colsum")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def quant_kwargs(self) -> dict[str, torch.Tensor]:
        """The scale / column-sum keyword arguments of ``fused_experts`` (empty for bf16)."""
        return {n: t for n, t in self.tensors().items() if n.endswith(("_scale", "_colsum"))}


def pack_weight_reference(
    weight: torch.Tensor, layout: int | str | PackedLayout = DEFAULT_LAYOUT, n_padded: int = 0, k_padded: int = 0
) -> torch.Tensor:
    """[E, N, K] float -> [E, Np, Kp] bf16 in ``layout`` (see moepack/layout.py for the order);
    for int8 layouts [E, N, K] int8 codes -> [E, Np, Kp] int8.

    Np and Kp are N and K rounded up to whole blocks / K groups, or ``n_padded`` / ``k_padded``
    when given (a multiple of block_n / k_pack, at least that)."""
    lay = layout_get(layout)
    if weight.dim() != 3:
        raise LayoutError(f"weight has shape {list(weight.shape)}: must be 3-D [E, N, K]")
    if lay.quantized and weight.dtype != torch.int8:
        raise LayoutError(f"weight has dtype {weight.dtype}: layout {lay.name} packs int8 codes")
    e, n, k = weight.shape
    bn, kpk = lay.block_n, lay.k_pack
    np_, kp = layout_padded_n(lay, n), layout_padded_k(lay, k)
    if n_padded:
        if n_padded < np_ or n_padded % bn:
            raise LayoutError(f"n_padded={n_padded} for weight {list(weight.shape)}: must be a multiple of block_n={bn} >= {np_}")
        np_ = n_padded
    if k_padded:
        if k_padded < kp or k_padded % kpk:
            raise LayoutError(f"k_padded={k_padded} for weight {list(weight.shape)}: must be a multiple of k_pack={kpk} >= {kp}")
        kp = k_padded
    dtype = torch.int8 if lay.quantized else torch.bfloat16
    w = torch.zeros(e, np_, kp, dtype=dtype)
    w[:, :n, :k] = weight.to(dtype)
    # [E, Np/bn, bn, Kp/kpk, kpk] -> [E, Np/bn, Kp/kpk, bn, kpk]: K groups outer, columns inner
    w = w.view(e, np_ // bn, bn, kp // kpk, kpk).permute(0, 1, 3, 2, 4).contiguous()
    return w.view(e, np_, kp)


def unpack_weight_reference(
    packed: torch.Tensor, n: int, k: int, layout: int | str | PackedLayout = DEFAULT_LAYOUT
) -> torch.Tensor:
    """Inverse of ``pack_weight_reference``: packed [E, Np, Kp] -> [E, n, k] (bf16 or int8)."""
    lay = layout_get(layout)
    e, np_, kp = packed.shape
    bn, kpk = lay.block_n, lay.k_pack
    w = packed.view(e, np_ // bn, kp // kpk, bn, kpk).permute(0, 1, 3, 2, 4).reshape(e, np_, kp)
    return w[:, :n, :k]


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"{name} has dtype {t.dtype}: must be float32, bfloat16 or float16")
    if not bool(torch.isfinite(t).all()):
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise LayoutError(f"{name} has a non-finite value at {bad}: weights and biases must be finite")


def pad_intermediate(w13: torch.Tensor, ip: int, interleaved: bool) -> torch.Tensor:
    """[E, 2I, ...] -> [E, 2Ip, ...] with zero rows (gate/up halves padded separately)."""
    e, two_i = w13.shape[:2]
    i = two_i // 2
    out = w13.new_zeros((e, 2 * ip) + tuple(w13.shape[2:]))
    if interleaved:
        out[:, :two_i] = w13
    else:
        out[:, :i] = w13[:, :i]
        out[:, ip : ip + i] = w13[:, i:]
    return out


def _pack(weight: torch.Tensor, lay: PackedLayout, use_cpp: bool, n_padded: int = 0, k_padded: int = 0) -> torch.Tensor:
    if use_cpp:
        from .._ops import ops

        return ops().pack_weight(weight, lay.id, n_padded, k_padded)  # refuses non-finite values itself
    if not lay.quantized:
        _check_float("weight", weight)
    return pack_weight_reference(weight, lay, n_padded, k_padded)


def pack_w13(
    w13: torch.Tensor, *, interleaved: bool = False, layout: int | str | PackedLayout = DEFAULT_LAYOUT, use_cpp: bool = True
) -> torch.Tensor:
    """[E, 2I, H] canonical gate/up -> packed [E, 2*Ip, Kp(H)]: gate rows [0, I), up rows
    [Ip, Ip + I); interleaved (gate, up) pairs are padded with zero pairs at the end instead."""
    lay = layout_get(layout)
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise LayoutError(f"w13 has shape {list(w13.shape)}: must be 3-D [E, 2I, H]")
    _check_weight_dtype("w13", w13, lay)
    i = w13.shape[1] // 2
    ip = layout_padded_i(lay, i)
    try:
        if interleaved:
            return _pack(w13, lay, use_cpp, n_padded=2 * ip)
        # i_align is a multiple of block_n: packing each half to Ip rows and concatenating the
        # packed halves equals packing the padded [2*Ip, H] matrix.
        return torch.cat([_pack(w13[:, :i], lay, use_cpp, n_padded=ip), _pack(w13[:, i:], lay, use_cpp, n_padded=ip)], dim=1)
    except ValueError as e:
        raise LayoutError(f"w13: {e}".split("\n")[0]) from None


def pack_w2(w2: torch.Tensor, *, layout: int | str | PackedLayout = DEFAULT_LAYOUT, use_cpp: bool = True) -> torch.Tensor:
    """[E, H, I] canonical down -> packed [E, Np(H), Ip] (zero columns up to Ip)."""
    lay = layout_get(layout)
    if w2.dim() != 3:
        raise LayoutError(f"w2 has shape {list(w2.shape)}: must be 3-D [E, H, I]")
    _check_weight_dtype("w2", w2, lay)
    try:
        return _pack(w2, lay, use_cpp, k_padded=layout_padded_i(lay, w2.shape[2]))
    except ValueError as e:
        raise LayoutError(f"w2: {e}".split("\n")[0]) from None


def _check_weight_dtype(name: str, w: torch.Tensor, lay: PackedLayout) -> None:
    if lay.quantized:
        if w.dtype != torch.int8:
            raise LayoutError(f"{name} has dtype {w.dtype}: layout {lay.name} packs int8 codes")
    elif w.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"{name} has dtype {w.dtype}: must be float32, bfloat16 or float16")


def pack_bias13(b13: torch.Tensor, *, interleaved: bool = False, layout: int | str | PackedLayout = DEFAULT_LAYOUT) -> torch.Tensor:
    """[E, 2I] -> fp32 [E, 2*Ip] in packed row order."""
    lay = layout_get(layout)
    _check_float("w13_bias", b13)
    return pad_intermediate(b13.float(), layout_padded_i(lay, b13.shape[1] // 2), interleaved).contiguous()


def pack_bias2(b2: torch.Tensor, *, layout: int | str | PackedLayout = DEFAULT_LAYOUT) -> torch.Tensor:
    """[E, H] -> fp32 [E, Np(H)]."""
    lay = layout_get(layout)
    _check_float("w2_bias", b2)
    out = torch.zeros(b2.shape[0], layout_padded_n(lay, b2.shape[1]), dtype=torch.float32)
    out[:, : b2.shape[1]] = b2.float()
    return out


def _expert_dims(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """(E, H, I) of w13 [E, 2I, H] and w2 [E, H, I], which must agree."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise LayoutError(f"w13 {list(w13.shape)} and w2 {list(w2.shape)}: both must be 3-D [E, out, in]")
    e, two_i, h = w13.shape
    if two_i % 2:
        raise LayoutError(f"w13 has shape {list(w13.shape)}: dim 1 is 2*I and must be even")
    i = two_i // 2
    if tuple(w2.shape) != (e, h, i):
        raise LayoutError(f"w2 has shape {list(w2.shape)}: must be [E, H, I] = {[e, h, i]} to match w13 {list(w13.shape)}")
    return e, h, i


def _pack_biases(w13_bias, w2_bias, e: int, h: int, i: int, interleaved: bool, lay: PackedLayout):
    """Optional biases [E, 2I] / [E, H] -> packed fp32 (or None)."""
    b13 = b2 = None
    if w13_bias is not None:
        if tuple(w13_bias.shape) != (e, 2 * i):
            raise LayoutError(f"w13_bias has shape {list(w13_bias.shape)}: must be [E, 2I] = {[e, 2 * i]}")
        b13 = pack_bias13(w13_bias, interleaved=interleaved, layout=lay)
    if w2_bias is not None:
        if tuple(w2_bias.shape) != (e, h):
            raise LayoutError(f"w2_bias has shape {list(w2_bias.shape)}: must be [E, H] = {[e, h]}")
        b2 = pack_bias2(w2_bias, layout=lay)
    return b13, b2


def pack_experts(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    interleaved: bool = False,
    layout: int | str | PackedLayout = DEFAULT_LAYOUT,
    use_cpp: bool = True,
) -> PackedExperts:
    """Pack canonical experts: w13 [E, 2I, H] (gate then up, or interleaved pairs when
    ``interleaved``), w2 [E, H, I], optional biases [E, 2I] and [E, H].

    With an int8 layout the float weights are quantized first (``quantize_int8_per_channel``)."""
    lay = layout_get(layout)
    if lay.quantized:
        if w13.dtype not in FLOAT_DTYPES or w2.dtype not in FLOAT_DTYPES:
            raise LayoutError(
                f"w13/w2 have dtypes {w13.dtype}/{w2.dtype}: pack_experts quantizes float weights for layout "
                f"{lay.name}; pack int8 codes with their scales through pack_experts_int8"
            )
        _expert_dims(w13, w2)
        _check_float("w13", w13)
        _check_float("w2", w2)
        q13, s13 = quantize_int8_per_channel(w13)
        q2, s2 = quantize_int8_per_channel(w2)
        return pack_experts_int8(q13, s13, q2, s2, w13_bias, w2_bias, interleaved=interleaved, layout=lay, use_cpp=use_cpp)
    e, h, i = _expert_dims(w13, w2)
    shapes = layout_expert_shapes(lay, e, h, i)
    ip = shapes.padded_intermediate
    b13, b2 = _pack_biases(w13_bias, w2_bias, e, h, i, interleaved, lay)
    w13_packed = pack_w13(w13, interleaved=interleaved, layout=lay, use_cpp=use_cpp)
    w2_packed = pack_w2(w2, layout=lay, use_cpp=use_cpp)
    assert tuple(w13_packed.shape) == shapes.w13_shape and tuple(w2_packed.shape) == shapes.w2_shape
    return PackedExperts(
        layout=lay,
        num_experts=e,
        hidden=h,
        intermediate=i,
        padded_intermediate=ip,
        interleaved=interleaved,
        w13=w13_packed,
        w2=w2_packed,
        w13_bias=b13,
        w2_bias=b2,
    )


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
    _check_float("weight", w)
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


def _check_scale(name: str, s: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """[E, N] or [E, N, 1] float scales -> fp32 [E, N]; refuses non-finite and non-positive ones."""
    if s.dim() == 3 and s.shape[2] == 1:
        s = s.squeeze(2)
    if tuple(s.shape) != shape:
        raise LayoutError(f"{name} has shape {list(s.shape)}: must be {list(shape)} (one scale per output channel)")
    if s.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"{name} has dtype {s.dtype}: must be float32, bfloat16 or float16")
    sf = s.float()
    bad = ~(torch.isfinite(sf) & (sf > 0))
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise LayoutError(f"{name}{idx} = {sf[tuple(idx)].item()!r}: scales must be finite and > 0")
    return sf.contiguous()


def pack_experts_int8(
    w13_q: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_q: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    interleaved: bool = False,
    layout: int | str | PackedLayout = INT8_LAYOUT,
    use_cpp: bool = True,
) -> PackedExperts:
    """Pack int8 experts: codes w13_q [E, 2I, H] and w2_q [E, H, I] (int8, any of -128..127),
    per-channel scales [E, 2I] and [E, H] (or with a trailing 1; fp32/bf16/fp16, finite, > 0),
    optional biases; gate/up order as in ``pack_experts``."""
    lay = layout_get(layout)
    if not lay.quantized:
        raise LayoutError(f"layout {lay.name} is not an int8 layout")
    e, h, i = _expert_dims(w13_q, w2_q)
    _check_weight_dtype("w13", w13_q, lay)
    _check_weight_dtype("w2", w2_q, lay)
    s13 = _check_scale("w13_scale", w13_scale, (e, 2 * i))
    s2 = _check_scale("w2_scale", w2_scale, (e, h))
    shapes = layout_expert_shapes(lay, e, h, i)
    ip, np2 = shapes.padded_intermediate, shapes.w2_shape[1]
    b13, b2 = _pack_biases(w13_bias, w2_bias, e, h, i, interleaved, lay)

    def pad_n(v: torch.Tensor) -> torch.Tensor:  # [E, H] -> [E, Np(H)] with zeros
        out = v.new_zeros(e, np2)
        out[:, :h] = v
        return out

    w13_packed = pack_w13(w13_q, interleaved=interleaved, layout=lay, use_cpp=use_cpp)
    w2_packed = pack_w2(w2_q, layout=lay, use_cpp=use_cpp)
    assert tuple(w13_packed.shape) == shapes.w13_shape and tuple(w2_packed.shape) == shapes.w2_shape
    return PackedExperts(
        layout=lay,
        num_experts=e,
        hidden=h,
        intermediate=i,
        padded_intermediate=ip,
        interleaved=interleaved,
        w13=w13_packed,
        w2=w2_packed,
        w13_bias=b13,
        w2_bias=b2,
        w13_scale=pad_intermediate(s13, ip, interleaved).contiguous(),
        w2_scale=pad_n(s2),
        w13_colsum=pad_intermediate(w13_q.to(torch.int32).sum(-1, dtype=torch.int32), ip, interleaved).contiguous(),
        w2_colsum=pad_n(w2_q.to(torch.int32).sum(-1, dtype=torch.int32)),
    )


__all__ = ["PackedExperts", "pack_experts", "pack_experts_int8", "quantize_int8_per_channel", "dequantize_int8", "pack_w13", "pack_w2", "pack_bias13", "pack_bias2", "pack_weight_reference", "unpack_weight_reference", "pad_intermediate"]
