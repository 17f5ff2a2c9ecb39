"""Scheme ``int8_channel`` (docs/SEMANTICS.md §3, W8A8): symmetric int8 codes with one fp32
scale per output channel; activations quantized per token (A8).

Canonical tensors: w13_q [E, 2I, H] / w2_q [E, H, I] int8 codes and w13_scale [E, 2I] /
w2_scale [E, H] fp32 scales, from an int8 source (compressed-tensors int-quantized) as stored,
or ``quantize_int8_per_channel`` of float weights (``--quantize int8_channel``).
"""

from __future__ import annotations

import torch

from . import LayerPacker, OutputRule, Scheme, register


class Int8Layer(LayerPacker):
    """One layer's experts into an int8_channel layout, one expert at a time: the codes stream
    out as parts of w13 / w2 while each expert's padded scales and column sums are gathered into
    [E, N] tensors, which the plan writes right after their codes. An int8 source gives its own
    codes and scales (never re-quantized); a float source is quantized per output channel."""

    def __init__(self, src):
        super().__init__(src)
        from ..layout import layout_tensor_plan

        s = self.spec
        # the per-channel tensors (scales, column sums), filled one expert at a time as the codes stream
        self.gathered = {
            t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype))
            for t in layout_tensor_plan(self.layout, s.num_experts, s.hidden, s.intermediate)
            if t.role in ("scale", "sum")
        }

    def _codes(self, role: str, e: int):
        from ..pack import quantize_int8_per_channel

        src, r, s = self.src, self.src.reader, self.spec
        if r.scheme == "int8_channel":
            c = r.read_expert_canonical(src.ckpt, s, role, e)
            return c[f"{role}_q"], c[f"{role}_scale"]
        w = (r.read_expert_w13 if role == "w13" else r.read_expert_w2)(src.ckpt, s, e)
        return src.checked(quantize_int8_per_channel, w[None], role, e)

    def parts(self, name: str):
        from ..pack import pack_int8_weight

        s, g = self.spec, self.gathered
        if name in g:
            yield g[name]
            return
        if name not in ("w13", "w2"):
            yield from self.bias_parts(name)
            return
        for e in range(s.num_experts):
            q, sc = self._codes(name, e)
            one = pack_int8_weight(name, q.reshape(1, *q.shape[-2:]), sc.reshape(1, -1), interleaved=s.interleaved,
                                   layout=self.layout)  # fmt: skip
            g[f"{name}_scale"][e] = one[f"{name}_scale"][0]
            g[f"{name}_colsum"][e] = one[f"{name}_colsum"][0]
            yield one[name]

    def shared(self):
        """The shared expert packed (codes, scales and column sums) as one-expert PackedExperts."""
        from ..pack import pack_experts_int8, quantize_int8_per_channel

        src, r, s = self.src, self.src.reader, self.spec
        if not s.shared:
            return None
        c = r.read_shared_canonical(src.ckpt, s) if r.scheme == "int8_channel" else None
        q = None if c is None else ((c["w13_q"], c["w13_scale"]), (c["w2_q"], c["w2_scale"]))
        if q is None:
            sw13, sw2 = r.read_shared(src.ckpt, s)
            q = (
                src.checked(quantize_int8_per_channel, sw13, "shared_w13", 0),
                src.checked(quantize_int8_per_channel, sw2, "shared_w2", 0),
            )
        (q13, s13), (q2, s2) = q
        return pack_experts_int8(q13, s13, q2, s2, layout=self.layout)

INT8_TOL = 1e-5  # vs moe_reference_int8 on the same codes (plus flips)
INT8_FLIPS = 2.0
INT8_FP32_TOL = 3e-2  # vs the fp32 reference on the source's weights (docs/SEMANTICS.md §4, A8)


def _pack(c: dict, *, interleaved: bool, layout, use_cpp: bool = True):
    from ..pack import pack_experts_int8

    return pack_experts_int8(
        c["w13_q"], c["w13_scale"], c["w2_q"], c["w2_scale"], c.get("w13_bias"), c.get("w2_bias"),
        interleaved=interleaved, layout=layout, use_cpp=use_cpp,
    )  # fmt: skip


def _from_float(w13, w2, layout=None) -> dict:
    from ..pack import quantize_int8_per_channel

    (q13, s13), (q2, s2) = quantize_int8_per_channel(w13), quantize_int8_per_channel(w2)
    return {"w13_q": q13, "w13_scale": s13, "w2_q": q2, "w2_scale": s2}


def _dequantize(c: dict):
    from ..pack import dequantize_int8

    return dequantize_int8(c["w13_q"], c["w13_scale"]), dequantize_int8(c["w2_q"], c["w2_scale"])


def _reference(x, c: dict, topk_weights, topk_ids, **kw):
    from ..reference import moe_reference_int8

    return moe_reference_int8(x, c["w13_q"], c["w13_scale"], c["w2_q"], c["w2_scale"], topk_weights, topk_ids,
                              return_flip=True, **kw)  # fmt: skip


def _rule(source_dtype: str, reader: str) -> str:
    if source_dtype == "I8":
        return "the source's own int8 codes and scales"
    return "quantize_int8_per_channel of the source"


def _source_note(source_dtype: str, reader: str) -> str:
    if source_dtype == "I8":
        from ..sources.compressed_tensors import SOURCE_NOTE

        return SOURCE_NOTE if reader == "compressed-tensors" else f"int8 codes and scales of {reader}"
    return f"quantized by moepack from {source_dtype}"


INT8_CHANNEL = register(
    Scheme(
        name="int8_channel",
        aliases=("int8",),
        act_mode="a8",
        summary="int8 codes + fp32 per-channel scales (W8A8); activations quantized per token",
        canonical=("w13_q", "w13_scale", "w2_q", "w2_scale"),
        pack=_pack,
        from_float=_from_float,
        dequantize=_dequantize,
        reference=_reference,
        output_rule=lambda source_dtypes: OutputRule(base=INT8_TOL, flips=INT8_FLIPS, fp32_tol=INT8_FP32_TOL),
        rule=_rule,
        source_note=_source_note,
        layer_packer=Int8Layer,
    )
)
