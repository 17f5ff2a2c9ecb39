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

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..errors import LayoutError
from ..layout import (
    DEFAULT_LAYOUT,
    INT8_LAYOUT,
    PackedLayout,
    layout_expert_shapes,
    layout_get,
    layout_tensor_plan,
    layout_padded_i,
    layout_padded_k,
    layout_padded_n,
)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)  # identity equality and hash: it holds tensors
class PackedExperts:
    """One MoE layer's experts in a packed layout, ready for ``moepack.fused_experts``: the
    layout plus its tensors by stored name (``layout_tensor_plan``: w13's declared tensors,
    w2's, then the optional fp32 biases ``w13_bias`` [E, 2*Ip] / ``w2_bias`` [E, Np(H)] and, for
    int4_group layouts of an act-order checkpoint, the optional ``w13_perm`` int32 [E, H]:
    column j of w13's codes is input channel ``w13_perm[e, j]`` (docs/SEMANTICS.md §3))."""

    layout: PackedLayout
    num_experts: int
    hidden: int
    intermediate: int
    padded_intermediate: int
    interleaved: bool  # w13's row order: (gate, up) pairs (swigluoai checkpoints) or gate then up
    tensors: dict[str, torch.Tensor]
    act_mode: str | None = None  # the default activation mode of calls (None: the layout's first)

    def __post_init__(self) -> None:
        want = layout_tensor_plan(self.layout, self.num_experts, self.hidden, self.intermediate, bias=True,
                                  perm="w13_perm" in self.tensors)  # fmt: skip
        if self.act_mode is not None and self.act_mode not in self.layout.act_modes:
            raise LayoutError(f"act_mode={self.act_mode!r}: layout {self.layout.name} runs with "
                              f"{' or '.join(self.layout.act_modes)} activations")  # fmt: skip
        declared = {t.name for t in want}
        for name in self.tensors:
            if name not in declared:
                raise LayoutError(f"packed tensor {name!r}: layout {self.layout.name} declares {sorted(declared)}")
        for t in want:
            if t.role in ("bias", "perm") and t.name not in self.tensors:
                continue
            got = self.tensors.get(t.name)
            if got is None:
                raise LayoutError(f"packed experts of layout {self.layout.name} lack tensor {t.name!r}")
            if tuple(got.shape) != t.shape or str(got.dtype).replace("torch.", "") != t.dtype:
                raise LayoutError(
                    f"packed tensor {t.name!r} is {str(got.dtype).replace('torch.', '')} {list(got.shape)}: "
                    f"layout {self.layout.name} says {t.dtype} {list(t.shape)}"
                )

        # Every declared tensor (and both bias names and w13_perm, None when absent) is also an
        # attribute: packed.w13, packed.w2_scale, packed.w13_bias, packed.w13_perm.
        for t in want:
            object.__setattr__(self, t.name, self.tensors.get(t.name))
        if "w13_perm" not in self.tensors:
            object.__setattr__(self, "w13_perm", None)

    def weight(self, name: str) -> list[torch.Tensor]:
        """One packed weight ("w13" or "w2") as the op takes it: the layout's tensors in order."""
        return [self.tensors[n] for n in self.layout.tensor_names(name)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


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
    dtype = codes_dtype(lay)
    if dtype != torch.bfloat16 and weight.dtype != dtype:
        raise LayoutError(f"weight has dtype {weight.dtype}: layout {lay.name} packs {dtype} codes")
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
    if codes_dtype(lay) == torch.bfloat16:
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


def pack_w13_pieces(w13: torch.Tensor, *, interleaved: bool = False, layout: PackedLayout, use_cpp: bool = True) -> list[torch.Tensor]:
    """``pack_w13`` of ONE expert ([1, 2I, H]) as the packed tensors whose bytes, in order, are
    its result (the gate half then the up half; one tensor if interleaved): convert writes them
    one after the other instead of paying a ``torch.cat`` copy per expert."""
    lay = layout_get(layout)
    if w13.dim() != 3 or w13.shape[0] != 1 or w13.shape[1] % 2 or interleaved:
        return [pack_w13(w13, interleaved=interleaved, layout=lay, use_cpp=use_cpp)]
    _check_weight_dtype("w13", w13, lay)
    i = w13.shape[1] // 2
    ip = layout_padded_i(lay, i)
    try:
        return [_pack(w13[:, :i], lay, use_cpp, n_padded=ip), _pack(w13[:, i:], lay, use_cpp, n_padded=ip)]
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


def codes_dtype(lay: PackedLayout) -> torch.dtype:
    """The torch dtype of a layout's codes tensor (its declaration's tensors[0])."""
    return getattr(torch, lay.tensors[0].dtype)


def _check_weight_dtype(name: str, w: torch.Tensor, lay: PackedLayout) -> None:
    dtype = codes_dtype(lay)
    if dtype != torch.bfloat16:
        if w.dtype != dtype:
            raise LayoutError(f"{name} has dtype {w.dtype}: layout {lay.name} packs {dtype} codes")
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
    return pad_rows(b2.float(), layout_padded_n(lay, b2.shape[1]))


def pad_rows(v: torch.Tensor, np_: int) -> torch.Tensor:
    """[E, N] -> [E, np_] with zeros after column N (w2's per-output-channel tensors: H -> Np(H))."""
    out = v.new_zeros(v.shape[0], np_)
    out[:, : v.shape[1]] = v
    return out


def _with_biases(tensors: dict, b13, b2) -> dict:
    if b13 is not None:
        tensors["w13_bias"] = b13
    if b2 is not None:
        tensors["w2_bias"] = b2
    return tensors


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
    """Pack canonical float experts: w13 [E, 2I, H] (gate then up, or interleaved pairs when
    ``interleaved``), w2 [E, H, I], optional biases [E, 2I] and [E, H], into ``layout``.

    The layout's scheme (moepack.schemes) turns the float weights into its canonical tensors
    first: dense keeps them, int8_channel quantizes them per output channel, int4_group per
    (K group of the layout's size, channel), symmetric, round to nearest."""
    from ..schemes import get_scheme

    lay = layout_get(layout)
    scheme = get_scheme(lay)
    if scheme.name != "dense" and (w13.dtype not in FLOAT_DTYPES or w2.dtype not in FLOAT_DTYPES):
        raise LayoutError(
            f"w13/w2 have dtypes {w13.dtype}/{w2.dtype}: pack_experts takes float weights (layout {lay.name}, scheme "
            f"{scheme.name}, quantizes them); pack a scheme's own canonical tensors with moepack.schemes.get_scheme"
            f"({scheme.name!r}).pack"
        )
    _expert_dims(w13, w2)
    if scheme.name != "dense":
        _check_float("w13", w13)
        _check_float("w2", w2)
    c = _with_biases(scheme.from_float(w13, w2, layout=lay), w13_bias, w2_bias)
    packed = scheme.pack(c, interleaved=interleaved, layout=lay, use_cpp=use_cpp)
    return in_huge_pages(packed) if use_cpp else packed


HUGE_PAGE_MIN_BYTES = 4 << 20


def in_huge_pages(packed: PackedExperts) -> PackedExperts:
    """``packed`` with its tensors of at least 4 MiB copied into memory advised for transparent
    huge pages (torch.ops.moepack.huge_page_copy): decode streams each weight once, and on 4 KiB
    pages every page costs a TLB miss and a hardware-prefetcher restart (docs/KERNELS.md
    "Decode"). For in-memory packs made with the C++ packer only (an opened directory stays a
    memory map); ``MOEPACK_HUGE_PAGES=0`` turns it off. Where the kernel declines, the copies are plain."""
    if os.environ.get("MOEPACK_HUGE_PAGES", "1") == "0":
        return packed
    from .._ops import ops

    big = {
        k: v
        for k, v in packed.tensors.items()
        if v.device.type == "cpu" and v.numel() * v.element_size() >= HUGE_PAGE_MIN_BYTES
    }
    if not big:
        return packed
    copies = {k: ops().huge_page_copy(v) for k, v in big.items()}
    return dataclasses.replace(packed, tensors={**packed.tensors, **copies})


def pack_dense(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    interleaved: bool = False,
    layout: int | str | PackedLayout = DEFAULT_LAYOUT,
    use_cpp: bool = True,
) -> PackedExperts:
    """Scheme dense: float w13/w2 (+ biases) rounded to bf16 and packed."""
    lay = layout_get(layout)
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
        tensors=_with_biases({"w13": w13_packed, "w2": w2_packed}, b13, b2),
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


def pack_int8_weight(
    weight: str, q: torch.Tensor, scale: torch.Tensor, *, interleaved: bool = False, layout: PackedLayout, use_cpp: bool = True
) -> dict[str, torch.Tensor]:
    """One int8_channel weight ("w13": codes [E, 2I, H], scales [E, 2I]; "w2": [E, H, I], [E, H])
    -> its three packed tensors {weight: codes, weight_scale: fp32, weight_colsum: int32 sum_k q},
    in packed row order, zero in the padding rows. convert (one expert at a time) and
    pack_experts_int8 both pack through here."""
    e, n = q.shape[0], q.shape[1]
    s = _check_scale(f"{weight}_scale", scale, (e, n))
    colsum = q.to(torch.int32).sum(-1, dtype=torch.int32)
    if weight == "w13":
        ip = layout_padded_i(layout, n // 2)
        codes = pack_w13(q, interleaved=interleaved, layout=layout, use_cpp=use_cpp)
        pad = lambda v: pad_intermediate(v, ip, interleaved).contiguous()  # noqa: E731
    else:
        codes = pack_w2(q, layout=layout, use_cpp=use_cpp)
        pad = lambda v: pad_rows(v, codes.shape[1])  # noqa: E731
    return {weight: codes, f"{weight}_scale": pad(s), f"{weight}_colsum": pad(colsum)}


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
    if lay.scheme != "int8_channel":
        raise LayoutError(f"layout {lay.name} has scheme {lay.scheme}: pack_experts_int8 packs int8_channel layouts")
    e, h, i = _expert_dims(w13_q, w2_q)
    _check_weight_dtype("w13", w13_q, lay)
    _check_weight_dtype("w2", w2_q, lay)
    shapes = layout_expert_shapes(lay, e, h, i)
    ip = shapes.padded_intermediate
    b13, b2 = _pack_biases(w13_bias, w2_bias, e, h, i, interleaved, lay)
    tensors = pack_int8_weight("w13", w13_q, w13_scale, interleaved=interleaved, layout=lay, use_cpp=use_cpp)
    tensors.update(pack_int8_weight("w2", w2_q, w2_scale, layout=lay, use_cpp=use_cpp))
    assert tuple(tensors["w13"].shape) == shapes.w13_shape and tuple(tensors["w2"].shape) == shapes.w2_shape
    return PackedExperts(
        layout=lay,
        num_experts=e,
        hidden=h,
        intermediate=i,
        padded_intermediate=ip,
        interleaved=interleaved,
        tensors=_with_biases(tensors, b13, b2),
    )


__all__ = ["PackedExperts", "pack_experts", "pack_dense", "codes_dtype", "pack_experts_int8", "pack_int8_weight", "pad_rows", "quantize_int8_per_channel", "dequantize_int8", "pack_w13", "pack_w2", "pack_bias13", "pack_bias2", "pack_weight_reference", "unpack_weight_reference", "pad_intermediate"]
