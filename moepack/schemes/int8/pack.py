"""int8_channel's spec packer: codes through ``moepack.pack`` (the C++ packer, or ``pack_codes``
with ``use_cpp=False``) plus the per-channel fp32 scales and int32 column sums in packed row order.

The column sums ``sum_k q[n, k]`` serve the VNNI kernels, which feed u8 = q_x + 128 and subtract
128 x the column sum; computed here, once, at pack time. Padding rows have code 0, scale 0 and
column sum 0.
"""

from __future__ import annotations

import torch

from ...errors import LayoutError
from ...layout import INT8_LAYOUT, PackedLayout, layout_expert_shapes, layout_get, layout_padded_i
from ...pack import (
    FLOAT_DTYPES,
    PackedExperts,
    check_weight_dtype,
    expert_dims,
    pack_biases,
    pack_w2,
    pack_w13,
    pad_intermediate,
    pad_rows,
    with_biases,
)

SCHEME = "int8_channel"


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
    if lay.scheme != SCHEME:
        raise LayoutError(f"layout {lay.name} has scheme {lay.scheme}: pack_experts_int8 packs {SCHEME} layouts")
    e, h, i = expert_dims(w13_q, w2_q)
    check_weight_dtype("w13", w13_q, lay)
    check_weight_dtype("w2", w2_q, lay)
    shapes = layout_expert_shapes(lay, e, h, i)
    ip = shapes.padded_intermediate
    b13, b2 = pack_biases(w13_bias, w2_bias, e, h, i, interleaved, lay)
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
        tensors=with_biases(tensors, b13, b2),
    )


__all__ = ["pack_int8_weight", "pack_experts_int8"]
