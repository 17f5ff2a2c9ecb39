"""int4_group's spec packer (docs/SEMANTICS.md §3): canonical int4 tensors -> the u4 layouts' bytes.

Canonical form of one weight (``w13`` [E, 2I, H] or ``w2`` [E, H, I], nn.Linear orientation):

* ``q``     uint8 [E, N, K]  codes 0..15;
* ``scale`` fp32  [E, N, ceil(K / G)]  (per channel: [E, N, 1]);
* ``zero``  uint8 [E, N, ceil(K / G)]  true zero points 0..15 (8 for symmetric sources),

with ``W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]``, computed in fp32, which is
exact: ``q - zero`` is an integer in [-15, 15] and the scales come from fp16/bf16 checkpoints
(11 significant bits at most), so the product has at most 15 significant bits. G does not
have to divide K: the last group is partial (ceil(K / G) groups), as GPTQ and compressed-tensors
write them.

The packed form (moepack/layout.py, the u4 layouts): codes where ``moepack.pack.pack_codes``
puts them (the layout's blocking and code_order); scales and zero points transposed to [E, ceil(Kp / G), Np]
(per channel [E, Np]) in packed row order. Padding: K beyond the real K holds the group's zero
point (dequantizes to exactly 0); padded rows have code 0, scale 0, zero 0.

The codes are packed by the C++ packer (``torch.ops.moepack.pack_weight`` with the zero points;
convert, ``pack_experts``) or, with ``use_cpp=False``, by ``pack_codes`` after the padding rule
here: that is the specification, which verify recomputes with and tests/engine/test_pack.py compares
the C++ bytes to.
"""

from __future__ import annotations

import torch

from ...errors import LayoutError
from ...layout import PackedLayout, int4_layout_for, layout_expert_shapes, layout_get, layout_padded_i, layout_padded_k, layout_padded_n
from ...pack import PackedExperts, expert_dims, pack_biases, pack_codes, pad_intermediate, with_biases
from .quantize import INT4_DEFAULT_GROUP, group_of_k, check_int4_canonical, check_w13_perm

SCHEME = "int4_group"


def pack_u4_codes(
    q: torch.Tensor, zero: torch.Tensor, group_size: int, lay: PackedLayout, np_: int, kp: int, *, use_cpp: bool = False
) -> torch.Tensor:
    """[E, N, K] codes -> packed [E, np_, kp / 2] uint8: the int4 padding rule (K beyond the real K
    holds the group's zero point, so a padded weight dequantizes to exactly 0; padded rows code
    0), then ``pack_codes``, which places every code where the layout says. That is the
    specification; ``use_cpp=True`` packs with the C++ packer (``torch.ops.moepack.pack_weight``
    with ``zero``: the same rule, the same bytes, tests/engine/test_pack.py), whose group size is the
    layout's own."""
    e, n, k = q.shape
    g = kp if group_size <= 0 else group_size
    if use_cpp:
        if (lay.group_size or -1) != (group_size if group_size > 0 else -1):
            raise LayoutError(f"group_size={group_size}: the C++ packer pads K with layout {lay.name}'s own groups "
                              f"(group_size {lay.group_size or -1})")  # fmt: skip
        from ..._ops import ops

        try:
            return ops().pack_weight(q, lay.id, np_, kp, zero)
        except (ValueError, TypeError) as ex:  # names the tensor, the value and the rule already
            raise LayoutError(str(ex).split("\n")[0]) from None
    if kp == k:  # no K padding: the codes as they are (pack_codes pads the rows)
        return pack_codes(lay, q, n_padded=np_, k_padded=kp)
    c = torch.zeros(e, n, kp, dtype=torch.uint8)
    c[:, :, :k] = q
    if kp > k:
        gi = (torch.arange(k, kp) // g).clamp(max=zero.shape[-1] - 1)
        c[:, :, k:] = zero.index_select(-1, gi)
    return pack_codes(lay, c, n_padded=np_, k_padded=kp)


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
    use_cpp: bool = True,
) -> dict[str, torch.Tensor]:
    """One int4_group weight (canonical ``q``/``scale``/``zero`` of "w13" [E, 2I, H] or "w2"
    [E, H, I]) -> its packed tensors {weight, weight_scale, weight_zero} in packed row order.
    convert (one expert at a time) and pack_experts_int4 both pack through here; the codes with
    the C++ packer, or with the specification ``pack_codes`` when ``use_cpp=False`` (verify)."""
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
        weight: pack_u4_codes(q, zero, gsz, layout, np_, kp, use_cpp=use_cpp),
        f"{weight}_scale": _group_tensor(sf, layout, ngp, np_),
        f"{weight}_zero": _group_tensor(zero, layout, ngp, np_),
    }




def pack_experts_int4(c: dict, *, interleaved: bool = False, layout=None, use_cpp: bool = True):
    """Pack canonical int4_group experts (``c``: w13_q / w13_scale / w13_zero / w2_* and, optional,
    w13_bias / w2_bias, w13_perm [E, H] (act-order: code column j of expert e is input channel
    w13_perm[e, j]; stored as is, int32) and group_size, which must be the layout's) into an int4
    layout (default: the one of c["group_size"]). ``use_cpp=False``: the codes with the Python
    specification packer (verify recomputes with it)."""
    g = int(c.get("group_size", INT4_DEFAULT_GROUP))
    lay = int4_layout_for(g) if layout is None else layout_get(layout)
    if lay.scheme != SCHEME:
        raise LayoutError(f"layout {lay.name} has scheme {lay.scheme}: pack_experts_int4 packs {SCHEME} layouts")
    if (lay.group_size or -1) != (g if g > 0 else -1):
        raise LayoutError(f"group_size={g}: layout {lay.name} has group_size {lay.group_size or -1} (-1 = per channel)")
    e, h, i = expert_dims(c["w13_q"], c["w2_q"])
    shapes = layout_expert_shapes(lay, e, h, i)
    b13, b2 = pack_biases(c.get("w13_bias"), c.get("w2_bias"), e, h, i, interleaved, lay)
    tensors = pack_int4_weight("w13", c["w13_q"], c["w13_scale"], c["w13_zero"], interleaved=interleaved, layout=lay,
                               use_cpp=use_cpp)  # fmt: skip
    tensors.update(pack_int4_weight("w2", c["w2_q"], c["w2_scale"], c["w2_zero"], layout=lay, use_cpp=use_cpp))
    assert tuple(tensors["w13"].shape[:2]) == shapes.w13_shape[:2] and tuple(tensors["w2"].shape[:2]) == shapes.w2_shape[:2]
    if c.get("w13_perm") is not None:
        tensors["w13_perm"] = check_w13_perm("w13_perm", c["w13_perm"], e, h)
    return PackedExperts(layout=lay, num_experts=e, hidden=h, intermediate=i,
                         padded_intermediate=shapes.padded_intermediate, interleaved=interleaved,
                         tensors=with_biases(tensors, b13, b2))  # fmt: skip


__all__ = ["pack_u4_codes", "pack_int4_weight", "pack_experts_int4"]
