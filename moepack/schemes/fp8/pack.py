"""fp8_block's spec packer (docs/SEMANTICS.md §3, docs/PACKED_FORMAT.md): canonical fp8 tensors ->
the f8 layouts' bytes.

Canonical form of one weight (``w13`` [E, 2I, H] or ``w2`` [E, H, I], nn.Linear orientation):

* ``q``     uint8 [E, N, K]  e4m3fn bit patterns (a float8_e4m3fn tensor viewed as uint8);
* ``scale`` fp32  [E, N, ceil(K / G)]  one scale per (output row, K group of G = 128); per
  channel (G = -1): [E, N, 1],

with ``W[n, k] = e4m3fn(q[n, k]) * scale[n, k // G]``. A source's 2-D block scales
[ceil(N / bn), ceil(K / 128)] are expanded over each block's rows before they get here, so any
row blocking packs exactly. Packed: the codes through ``moepack.pack.pack_codes`` (blocked like
bf16_n32k2_x86, one byte per code; padding code 0x00 = +0), the scales transposed to the
layout's [E, ceil(Kp / G), Np] (per channel: [E, Np]), 0 in every padding row and group.
``use_cpp`` moves the code bytes with the C++ packer (``torch.ops.moepack.pack_weight``, one-byte
codes), else with the specification, ``pack_codes``; tests/engine/test_pack.py holds them equal.
"""

from __future__ import annotations

import torch

from ...errors import LayoutError
from ...layout import FP8_LAYOUT, LAYOUTS, PackedLayout, layout_expert_shapes, layout_get, layout_padded_i, layout_padded_k, layout_padded_n
from ...pack import PackedExperts, expert_dims, pack_biases, pack_codes, pad_intermediate, with_biases
from .quantize import FP8_DEFAULT_GROUP, check_fp8_canonical

SCHEME = "fp8_block"


def layout_group(layout: PackedLayout) -> int:
    """The canonical group size of an fp8 layout (-1: per channel)."""
    return layout.group_size or -1


def _channel_layout() -> PackedLayout:
    return next(x for x in LAYOUTS if x.scheme == SCHEME and x.group_size == 0 and x.family == FP8_LAYOUT.family)


def _scale_tensor(v: torch.Tensor, lay: PackedLayout, ngp: int, np_: int) -> torch.Tensor:
    """[E, Np, ng] per-row scales -> the layout's [E, ngp, Np] (group) or [E, Np] (channel)."""
    if lay.group_size == 0:
        return v[..., 0].contiguous()
    out = v.new_zeros(v.shape[0], ngp, np_)
    out[:, : v.shape[2], :] = v.transpose(1, 2)
    return out


def pack_fp8_weight(
    weight: str, q: torch.Tensor, scale: torch.Tensor, *, interleaved: bool = False, layout: PackedLayout, use_cpp: bool = True
) -> dict[str, torch.Tensor]:
    """One fp8_block weight (canonical ``q`` / ``scale`` of "w13" [E, 2I, H] or "w2" [E, H, I])
    -> its packed tensors {weight: codes, weight_scale: fp32} in packed row order. convert (one
    expert at a time) and pack_experts_fp8 both pack through here."""
    gsz = layout_group(layout)
    check_fp8_canonical(weight, q, scale, gsz)
    e, n, k = q.shape
    sf = scale.float()
    if weight == "w13":
        ip = layout_padded_i(layout, n // 2)
        q, sf = pad_intermediate(q, ip, interleaved), pad_intermediate(sf, ip, interleaved)
        np_, kp = 2 * ip, layout_padded_k(layout, k)
    else:
        np_, kp = layout_padded_n(layout, n), layout_padded_k(layout, layout_padded_i(layout, k))
        q = torch.cat([q, q.new_zeros(e, np_ - n, k)], dim=1)
        sf = torch.cat([sf, sf.new_zeros(e, np_ - n, sf.shape[2])], dim=1)
    ngp = 1 if layout.group_size == 0 else -(-kp // layout.group_size)
    if use_cpp:
        from ..._ops import ops

        codes = ops().pack_weight(q.contiguous(), layout.id, np_, kp)
    else:
        codes = pack_codes(layout, q, n_padded=np_, k_padded=kp)
    return {weight: codes, f"{weight}_scale": _scale_tensor(sf, layout, ngp, np_)}


def pack_experts_fp8(c: dict, *, interleaved: bool = False, layout=None, use_cpp: bool = True) -> PackedExperts:
    """Pack canonical fp8_block experts (``c``: w13_q / w13_scale / w2_q / w2_scale, optional
    w13_bias / w2_bias, and group_size, which must be the layout's: 128 or -1) into an fp8 layout
    (default: the one of c["group_size"])."""
    g = int(c.get("group_size", FP8_DEFAULT_GROUP))
    lay = (FP8_LAYOUT if g > 0 else _channel_layout()) if layout is None else layout_get(layout)
    if lay.scheme != SCHEME:
        raise LayoutError(f"layout {lay.name} has scheme {lay.scheme}: pack_experts_fp8 packs {SCHEME} layouts")
    if layout_group(lay) != (g if g > 0 else -1):
        raise LayoutError(f"group_size={g}: layout {lay.name} has group_size {layout_group(lay)} (-1 = per channel)")
    e, h, i = expert_dims(c["w13_q"], c["w2_q"])
    shapes = layout_expert_shapes(lay, e, h, i)
    b13, b2 = pack_biases(c.get("w13_bias"), c.get("w2_bias"), e, h, i, interleaved, lay)
    tensors = pack_fp8_weight("w13", c["w13_q"], c["w13_scale"], interleaved=interleaved, layout=lay, use_cpp=use_cpp)
    tensors.update(pack_fp8_weight("w2", c["w2_q"], c["w2_scale"], layout=lay, use_cpp=use_cpp))
    assert tuple(tensors["w13"].shape) == shapes.w13_shape and tuple(tensors["w2"].shape) == shapes.w2_shape
    return PackedExperts(layout=lay, num_experts=e, hidden=h, intermediate=i, padded_intermediate=shapes.padded_intermediate,
                         interleaved=interleaved, tensors=with_biases(tensors, b13, b2))  # fmt: skip


__all__ = ["layout_group", "pack_fp8_weight", "pack_experts_fp8"]
