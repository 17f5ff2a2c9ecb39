"""Scheme ``int4_group`` (docs/SEMANTICS.md §3, W4A16 / W4A8): unsigned 4-bit codes with one fp32
scale and one zero point per (K group, output channel); ``(q - z) * s``.

Canonical tensors (moepack/pack/int4.py): ``w13_q`` [E, 2I, H] / ``w2_q`` [E, H, I] uint8 codes
0..15, ``w13_scale`` / ``w2_scale`` fp32 [E, N, ceil(K / G)], ``w13_zero`` / ``w2_zero`` uint8 true
zero points (8 for symmetric sources), and ``group_size`` (an int: G, or -1 for one group per
row). They come from a 4-bit checkpoint (GPTQ, AWQ, compressed-tensors pack-quantized) as stored,
or from ``quantize_int4_group`` of float weights (``pack_experts`` with an int4 layout,
``--quantize int4``: symmetric, group 128, round to nearest).

Two activation modes, chosen per call (``act_mode``): a16 (the default: the checkpoint's own
meaning, activations in their own dtype) and a8 (activations quantized per token to int8, as
W8A8 does: faster where int8 dot products are).
"""

from __future__ import annotations

import torch

from . import LayerPacker, OutputRule, Scheme, register

INT4_TOL = 1e-5  # vs moe_reference_int4 on the same codes (A16; A8 plus flips)
INT4_FLIPS = 2.0
INT4_A8_FP32_TOL = 3e-2  # A8 vs the fp32 reference on the dequantized weights (docs/SEMANTICS.md §4)


def layout_group(layout) -> int:
    """The canonical group size of an int4 layout (-1: per channel)."""
    return layout.group_size or -1


class Int4Layer(LayerPacker):
    """One layer's experts into an int4_group layout, one expert at a time: codes stream out as
    parts of w13 / w2 while each expert's scales and zero points are gathered into the layer's
    group tensors, which the plan writes right after their codes. An int4 source gives its own
    codes, scales and zero points (never re-quantized); a float source is quantized (symmetric,
    round to nearest, the layout's group size)."""

    def __init__(self, src):
        super().__init__(src)
        from ..layout import layout_tensor_plan

        s = self.spec
        self.gathered = {
            t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype))
            for t in layout_tensor_plan(self.layout, s.num_experts, s.hidden, s.intermediate, perm=layer_has_perm(s))
            if t.role in ("scale", "zero", "perm")
        }

    def _canonical(self, role: str, e: int):
        from ..pack.int4 import quantize_int4_group

        src, r, s = self.src, self.src.reader, self.spec
        if r.scheme == "int4_group":
            c = r.read_expert_canonical(src.ckpt, s, role, e)
            if "w13_perm" in self.gathered and role == "w13":
                self.gathered["w13_perm"][e] = c["w13_perm"].reshape(-1)  # checked with the layer in parts("w13_perm")
            return c[f"{role}_q"], c[f"{role}_scale"], c[f"{role}_zero"]
        w = (r.read_expert_w13 if role == "w13" else r.read_expert_w2)(src.ckpt, s, e)
        return src.checked(lambda t: quantize_int4_group(t, layout_group(self.layout)), w[None], role, e)

    def parts(self, name: str):
        from ..pack.int4 import pack_int4_weight

        from ..pack.int4 import check_w13_perm

        s, g = self.spec, self.gathered
        if name == "w13_perm":  # gathered while w13 streamed (plan order: after w13's codes)
            yield check_w13_perm(f"layer {s.index} w13_perm", g[name], s.num_experts, s.hidden)
            return
        if name in g:
            yield g[name]
            return
        if name not in ("w13", "w2"):
            yield from self.bias_parts(name)
            return
        for e in range(s.num_experts):
            q, sc, z = self._canonical(name, e)
            one = pack_int4_weight(name, q.reshape(1, *q.shape[-2:]), sc.reshape(1, *sc.shape[-2:]),
                                   z.reshape(1, *z.shape[-2:]), interleaved=s.interleaved, layout=self.layout)  # fmt: skip
            g[f"{name}_scale"][e] = one[f"{name}_scale"][0]
            g[f"{name}_zero"][e] = one[f"{name}_zero"][0]
            yield one[name]

    def shared(self):
        from ..pack.int4 import quantize_int4_group

        src, r, s = self.src, self.src.reader, self.spec
        if not s.shared:
            return None
        c = r.read_shared_canonical(src.ckpt, s) if r.scheme == "int4_group" else None
        if c is None:
            sw13, sw2 = r.read_shared(src.ckpt, s)
            g = layout_group(self.layout)
            (q13, s13, z13) = src.checked(lambda t: quantize_int4_group(t, g), sw13, "shared_w13", 0)
            (q2, s2, z2) = src.checked(lambda t: quantize_int4_group(t, g), sw2, "shared_w2", 0)
            c = {"w13_q": q13, "w13_scale": s13, "w13_zero": z13, "w2_q": q2, "w2_scale": s2, "w2_zero": z2}
        c = dict(c, group_size=layout_group(self.layout))
        return _pack(c, interleaved=False, layout=self.layout)


def layer_has_perm(spec, shared: bool = False) -> bool:
    """Whether a layer's routed (or ``shared``) experts carry a w13_perm: an int4 source with
    act-order (its reader gives every expert's permutation; LayerSpec.quant["act_order"])."""
    q = getattr(spec, "quant", None) or {}
    if shared:
        q = q.get("shared") or {}
    return q.get("scheme", "int4_group" if shared else None) == "int4_group" and bool(q.get("act_order"))


def default_act_mode(spec) -> str:
    """A layer's default activation mode (the manifest's ``act_mode``): a8 for a compressed-tensors
    W4A8 checkpoint (input activations dynamic per-token int8, what the a8 mode computes), else
    a16, the checkpoint's own meaning."""
    act = (getattr(spec, "quant", None) or {}).get("input_activations") or {}
    if (isinstance(act, dict) and act.get("num_bits") == 8 and act.get("type", "int") == "int"
            and act.get("strategy") == "token" and act.get("dynamic") in (True, "true")):  # fmt: skip
        return "a8"
    return "a16"


def _pack(c: dict, *, interleaved: bool, layout, use_cpp: bool = True):
    from ..pack.int4 import pack_experts_int4

    return pack_experts_int4(c, interleaved=interleaved, layout=layout)


def _from_float(w13, w2, layout=None) -> dict:
    from ..pack.int4 import INT4_DEFAULT_GROUP, quantize_int4_group

    g = layout_group(layout) if layout is not None else INT4_DEFAULT_GROUP
    q13, s13, z13 = quantize_int4_group(w13, g)
    q2, s2, z2 = quantize_int4_group(w2, g)
    return {"w13_q": q13, "w13_scale": s13, "w13_zero": z13, "w2_q": q2, "w2_scale": s2, "w2_zero": z2, "group_size": g}


def _dequantize(c: dict):
    """fp32 (w13, w2) in the checkpoint's own input-channel order (act-order undone)."""
    from ..pack.int4 import dequantize_int4_group

    g = int(c["group_size"])
    w13 = dequantize_int4_group(c["w13_q"], c["w13_scale"], c["w13_zero"], g)
    if c.get("w13_perm") is not None:
        perm = c["w13_perm"].long().reshape(w13.shape[0], 1, -1).expand_as(w13)
        w13 = torch.empty_like(w13).scatter_(2, perm, w13)
    return w13, dequantize_int4_group(c["w2_q"], c["w2_scale"], c["w2_zero"], g)


def _reference(x, c: dict, topk_weights, topk_ids, **kw):
    from ..reference import moe_reference_int4

    return moe_reference_int4(x, c, topk_weights, topk_ids, return_flip=True, **kw)


def _output_rule(source_dtypes: set) -> OutputRule:
    return OutputRule(base=INT4_TOL, flips=INT4_FLIPS)


_FLOAT = ("", "F32", "BF16", "F16")


def _rule(source_dtype: str, reader: str) -> str:
    if source_dtype not in _FLOAT:
        return "the source's own int4 codes, scales and zero points"
    return "quantize_int4_group of the source (symmetric, round to nearest)"


def _source_note(source_dtype: str, reader: str) -> str:
    if source_dtype not in _FLOAT:
        return f"int4 codes, scales and zero points of {reader}"
    return f"quantized by moepack from {source_dtype} (int4, symmetric, round to nearest)"


INT4_GROUP = register(
    Scheme(
        name="int4_group",
        aliases=("int4",),
        act_mode="a16",
        summary="4-bit codes + fp32 scale and zero point per (K group, channel); W4A16 (default) or W4A8",
        canonical=("w13_q", "w13_scale", "w13_zero", "w2_q", "w2_scale", "w2_zero"),
        pack=_pack,
        from_float=_from_float,
        dequantize=_dequantize,
        reference=_reference,
        output_rule=_output_rule,
        rule=_rule,
        source_note=_source_note,
        layer_packer=Int4Layer,
        default_layout="u4g128_n32k8_x86",
        layer_perm=layer_has_perm,
        layer_act_mode=default_act_mode,
    )
)
