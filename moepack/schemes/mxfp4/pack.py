"""mxfp4's spec packer (docs/SEMANTICS.md §3, docs/PACKED_FORMAT.md): canonical mxfp4 tensors ->
the mx4 layout's bytes.

Canonical form of one weight (``w13`` [E, 2I, H] or ``w2`` [E, H, I], nn.Linear orientation):

* ``q``     uint8 [E, N, K]  e2m1 codes 0..15, one per byte;
* ``scale`` uint8 [E, N, ceil(K / 32)]  e8m0 exponent bytes, never 255,

with ``W[n, k] = e2m1(q[n, k]) * 2^(scale[n, k // 32] - 127)`` (codec.py; exact in fp32).

Packed: the codes where ``moepack.pack.pack_codes`` puts them, exactly as the u4 layouts place
theirs (k_pack 8, U4_CODE_ORDER: byte j of a column's 32-bit word holds codes j and j + 4);
padding code 0 (+0) in every padded row and K column, so the C++ packer's zero-point-free
sub-byte path (``torch.ops.moepack.pack_weight`` without ``zero``) writes the same bytes. The
scales transposed to the layout's [E, Kp / 32, Np], one byte each, 0 in every padding row and
group (a padded weight is +0 * 2^-127 = 0). ``use_cpp`` moves the codes with the C++ packer,
else with the specification, ``pack_codes``; tests/schemes/mxfp4/test_mxfp4.py holds them equal.
"""

from __future__ import annotations

import torch

from ...errors import LayoutError
from ...layout import MXFP4_LAYOUT, PackedLayout, layout_expert_shapes, layout_get, layout_padded_i, layout_padded_k, layout_padded_n
from ...pack import PackedExperts, expert_dims, pack_biases, pack_codes, pad_intermediate, with_biases
from .codec import MX4_GROUP
from .quantize import check_mxfp4_canonical

SCHEME = "mxfp4"


def _scale_tensor(v: torch.Tensor, ngp: int, np_: int) -> torch.Tensor:
    """[E, Np, ng] per-row e8m0 bytes -> the layout's [E, ngp, Np], 0 in the padding groups."""
    out = v.new_zeros(v.shape[0], ngp, np_)
    out[:, : v.shape[2], :] = v.transpose(1, 2)
    return out


def pack_mx4_codes(q: torch.Tensor, lay: PackedLayout, np_: int, kp: int, *, use_cpp: bool = True) -> torch.Tensor:
    """[E, N, K] e2m1 codes -> packed [E, np_, kp / 2] uint8, padding code 0: ``pack_codes`` (the
    specification) or, ``use_cpp``, the C++ packer's sub-byte path without zero points (the same
    bytes)."""
    if use_cpp:
        from ..._ops import ops

        try:
            return ops().pack_weight(q.contiguous(), lay.id, np_, kp)
        except (ValueError, TypeError) as ex:  # names the tensor, the value and the rule already
            raise LayoutError(str(ex).split("\n")[0]) from None
    return pack_codes(lay, q, n_padded=np_, k_padded=kp)


def pack_mxfp4_weight(
    weight: str, q: torch.Tensor, scale: torch.Tensor, *, interleaved: bool = False, layout: PackedLayout, use_cpp: bool = True
) -> dict[str, torch.Tensor]:
    """One mxfp4 weight (canonical ``q`` / ``scale`` of "w13" [E, 2I, H] or "w2" [E, H, I]) -> its
    packed tensors {weight: codes, weight_scale: e8m0 bytes} in packed row order. convert (one
    expert at a time) and pack_experts_mxfp4 both pack through here."""
    check_mxfp4_canonical(weight, q, scale)
    e, n, k = q.shape
    if weight == "w13":
        ip = layout_padded_i(layout, n // 2)
        q, scale = pad_intermediate(q, ip, interleaved), pad_intermediate(scale, ip, interleaved)
        np_, kp = 2 * ip, layout_padded_k(layout, k)
    else:
        np_, kp = layout_padded_n(layout, n), layout_padded_k(layout, layout_padded_i(layout, k))
        q = torch.cat([q, q.new_zeros(e, np_ - n, k)], dim=1)
        scale = torch.cat([scale, scale.new_zeros(e, np_ - n, scale.shape[2])], dim=1)
    ngp = -(-kp // MX4_GROUP)
    return {weight: pack_mx4_codes(q, layout, np_, kp, use_cpp=use_cpp), f"{weight}_scale": _scale_tensor(scale, ngp, np_)}


def pack_experts_mxfp4(c: dict, *, interleaved: bool = False, layout=None, use_cpp: bool = True) -> PackedExperts:
    """Pack canonical mxfp4 experts (``c``: w13_q / w13_scale / w2_q / w2_scale, optional w13_bias
    / w2_bias) into an mxfp4 layout (default: mx4g32_n32k8_x86). ``use_cpp=False``: the codes
    with the Python specification packer (verify recomputes with it)."""
    lay = MXFP4_LAYOUT if layout is None else layout_get(layout)
    if lay.scheme != SCHEME:
        raise LayoutError(f"layout {lay.name} has scheme {lay.scheme}: pack_experts_mxfp4 packs {SCHEME} layouts")
    e, h, i = expert_dims(c["w13_q"], c["w2_q"])
    shapes = layout_expert_shapes(lay, e, h, i)
    b13, b2 = pack_biases(c.get("w13_bias"), c.get("w2_bias"), e, h, i, interleaved, lay)
    tensors = pack_mxfp4_weight("w13", c["w13_q"], c["w13_scale"], interleaved=interleaved, layout=lay, use_cpp=use_cpp)
    tensors.update(pack_mxfp4_weight("w2", c["w2_q"], c["w2_scale"], layout=lay, use_cpp=use_cpp))
    assert tuple(tensors["w13"].shape[:2]) == shapes.w13_shape[:2] and tuple(tensors["w2"].shape[:2]) == shapes.w2_shape[:2]
    return PackedExperts(layout=lay, num_experts=e, hidden=h, intermediate=i, padded_intermediate=shapes.padded_intermediate,
                         interleaved=interleaved, tensors=with_biases(tensors, b13, b2))  # fmt: skip


__all__ = ["pack_mx4_codes", "pack_mxfp4_weight", "pack_experts_mxfp4"]
