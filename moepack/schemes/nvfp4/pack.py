"""nvfp4's spec packer (docs/SEMANTICS.md §3, docs/PACKED_FORMAT.md): canonical nvfp4 tensors ->
the nv4 layout's bytes.

Canonical form of one weight (``w13`` [E, 2I, H] or ``w2`` [E, H, I], nn.Linear orientation):

* ``q``      uint8 [E, N, K]  e2m1 codes 0..15, one per byte;
* ``scale``  uint8 [E, N, ceil(K / 16)]  e4m3fn bytes, never NaN or negative;
* ``global`` float32 [E, N]  the row's global scale (> 0: a divisor; < 0: a multiplier negated),

with ``W[n, k] = e2m1(q[n, k]) * s[n, k // 16]`` (codec.py).

Packed: the codes exactly as the mx4 layouts place theirs (``moepack.schemes.mxfp4.pack_mx4_codes``:
k_pack 8, U4_CODE_ORDER, padding code 0); the scale bytes transposed to the layout's
[E, Kp / 16, Np], 0 in every padding row and group; the globals [E, Np], 0 in padding rows (a
multiplier of 0: a padded weight is 0).
"""

from __future__ import annotations

import torch

from ...errors import LayoutError
from ...layout import NVFP4_LAYOUT, layout_expert_shapes, layout_get, layout_padded_i, layout_padded_k, layout_padded_n
from ...pack import PackedExperts, expert_dims, pack_biases, pad_intermediate, with_biases
from ..mxfp4.pack import pack_mx4_codes
from .codec import NV4_GROUP
from .quantize import check_nvfp4_canonical

SCHEME = "nvfp4"


def pack_nvfp4_weight(weight: str, q: torch.Tensor, scale: torch.Tensor, glob: torch.Tensor, *, interleaved: bool = False,
                      layout, use_cpp: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """One nvfp4 weight (canonical ``q`` / ``scale`` / ``global`` of "w13" [E, 2I, H] or "w2"
    [E, H, I]) -> its packed tensors {weight: codes, weight_scale: e4m3 bytes, weight_global: fp32}
    in packed row order."""
    check_nvfp4_canonical(weight, q, scale, glob)
    e, n, k = q.shape
    if weight == "w13":
        ip = layout_padded_i(layout, n // 2)
        q, scale = pad_intermediate(q, ip, interleaved), pad_intermediate(scale, ip, interleaved)
        glob = pad_intermediate(glob.unsqueeze(-1), ip, interleaved).squeeze(-1)
        np_, kp = 2 * ip, layout_padded_k(layout, k)
    else:
        np_, kp = layout_padded_n(layout, n), layout_padded_k(layout, layout_padded_i(layout, k))
        q = torch.cat([q, q.new_zeros(e, np_ - n, k)], dim=1)
        scale = torch.cat([scale, scale.new_zeros(e, np_ - n, scale.shape[2])], dim=1)
        glob = torch.cat([glob, glob.new_zeros(e, np_ - n)], dim=1)
    ngp = -(-kp // NV4_GROUP)
    st = scale.new_zeros(e, ngp, np_)
    st[:, : scale.shape[2], :] = scale.transpose(1, 2)
    return {weight: pack_mx4_codes(q, layout, np_, kp, use_cpp=use_cpp), f"{weight}_scale": st,
            f"{weight}_global": glob.float().contiguous()}  # fmt: skip


def pack_experts_nvfp4(c: dict, *, interleaved: bool = False, layout=None, use_cpp: bool = True) -> PackedExperts:
    """Pack canonical nvfp4 experts (``c``: w13_q / w13_scale / w13_global / w2_q / w2_scale /
    w2_global, optional w13_bias / w2_bias) into an nvfp4 layout (default: nv4g16_n32k8_x86)."""
    lay = NVFP4_LAYOUT if layout is None else layout_get(layout)
    if lay.scheme != SCHEME:
        raise LayoutError(f"layout {lay.name} has scheme {lay.scheme}: pack_experts_nvfp4 packs {SCHEME} layouts")
    e, h, i = expert_dims(c["w13_q"], c["w2_q"])
    shapes = layout_expert_shapes(lay, e, h, i)
    b13, b2 = pack_biases(c.get("w13_bias"), c.get("w2_bias"), e, h, i, interleaved, lay)
    tensors = pack_nvfp4_weight("w13", c["w13_q"], c["w13_scale"], c["w13_global"], interleaved=interleaved, layout=lay,
                                use_cpp=use_cpp)  # fmt: skip
    tensors.update(pack_nvfp4_weight("w2", c["w2_q"], c["w2_scale"], c["w2_global"], layout=lay, use_cpp=use_cpp))
    assert tuple(tensors["w13"].shape[:2]) == shapes.w13_shape[:2] and tuple(tensors["w2"].shape[:2]) == shapes.w2_shape[:2]
    return PackedExperts(layout=lay, num_experts=e, hidden=h, intermediate=i, padded_intermediate=shapes.padded_intermediate,
                         interleaved=interleaved, tensors=with_biases(tensors, b13, b2))  # fmt: skip


__all__ = ["pack_nvfp4_weight", "pack_experts_nvfp4"]
