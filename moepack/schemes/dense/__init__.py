"""Scheme ``dense`` (docs/SEMANTICS.md §3): float weights stored as bf16, A16.

Canonical tensors: w13 [E, 2I, H] and w2 [E, H, I] in the source's float dtype (fp32, bf16 or
fp16); packing rounds them to bf16 (exact for bf16 sources).
"""

from __future__ import annotations

import torch

from ...container.writer import Pieces
from ...layout import DEFAULT_LAYOUT, PackedLayout, layout_expert_shapes, layout_get
from ...pack import PackedExperts, expert_dims, pack_biases, pack_w2, pack_w13, pack_w13_pieces, with_biases
from ...reference import moe_reference
from ..base import BenchInfo, LayerPacker, OutputRule, Scheme, register


class DenseLayer(LayerPacker):
    """One layer's float experts rounded to bf16 and packed, one expert at a time."""

    def parts(self, name: str):
        src, s, lay = self.src, self.spec, self.layout
        if name == "w13" and s.activation == "relu2":  # non-gated: the up rows alone ([I, H])
            for e in range(s.num_experts):
                yield src.checked(lambda t: pack_w13(t, layout=lay, gated=False), src.reader.read_expert_w13(src.ckpt, s, e)[None],
                                  "w13", e)  # fmt: skip
        elif name == "w13":
            for e in range(s.num_experts):
                w = src.reader.read_expert_w13(src.ckpt, s, e)[None]
                pieces = src.checked(lambda t: pack_w13_pieces(t, interleaved=s.interleaved, layout=lay), w, "w13", e)
                shape = (1, sum(x.shape[1] for x in pieces), *pieces[0].shape[2:])
                yield Pieces(tuple(pieces), shape, pieces[0].dtype)  # the halves' bytes in order: no cat copy
        elif name == "w2":
            for e in range(s.num_experts):
                yield src.checked(lambda t: pack_w2(t, layout=lay), src.reader.read_expert_w2(src.ckpt, s, e)[None], "w2", e)
        else:
            yield from self.bias_parts(name)

    def shared(self):
        src, s, lay = self.src, self.spec, self.layout
        pair = src.reader.read_shared(src.ckpt, s)
        if pair is None:
            return None
        sw13, sw2 = pair
        gated = s.activation != "relu2"  # a relu2 layer's shared expert is non-gated too (NemotronHMLP)
        w13 = src.checked(lambda t: pack_w13(t, layout=lay, gated=gated), sw13, "shared_w13", 0)
        w2 = src.checked(lambda t: pack_w2(t, layout=lay), sw2, "shared_w2", 0)
        si = sw2.shape[-1]
        return PackedExperts(lay, 1, s.hidden, si, w2.shape[-1], False, {"w13": w13, "w2": w2}, gated=gated)


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
    e, h, i = expert_dims(w13, w2)
    shapes = layout_expert_shapes(lay, e, h, i)
    b13, b2 = pack_biases(w13_bias, w2_bias, e, h, i, interleaved, lay)
    w13_packed = pack_w13(w13, interleaved=interleaved, layout=lay, use_cpp=use_cpp)
    w2_packed = pack_w2(w2, layout=lay, use_cpp=use_cpp)
    assert tuple(w13_packed.shape) == shapes.w13_shape and tuple(w2_packed.shape) == shapes.w2_shape
    return PackedExperts(layout=lay, num_experts=e, hidden=h, intermediate=i, padded_intermediate=shapes.padded_intermediate,
                         interleaved=interleaved, tensors=with_biases({"w13": w13_packed, "w2": w2_packed}, b13, b2))  # fmt: skip


def _pack(c: dict, *, interleaved: bool, layout, use_cpp: bool = True):
    return pack_dense(c["w13"], c["w2"], c.get("w13_bias"), c.get("w2_bias"), interleaved=interleaved, layout=layout, use_cpp=use_cpp)


def _reference(x, c: dict, topk_weights, topk_ids, **kw):
    return moe_reference(x, c["w13"], c["w2"], topk_weights, topk_ids, **kw), 0.0


def _output_rule(source_dtypes: set) -> OutputRule:
    # bf16 sources are packed exactly, so fp32 tokens agree to fp32 rounding; fp16/fp32 sources are
    # rounded to bf16 when packed, which bounds the error at ~1e-2 (docs/SEMANTICS.md §4).
    return OutputRule(base=1e-5 if source_dtypes == {"BF16"} else 1e-2)


DENSE = register(
    Scheme(
        name="dense",
        aliases=("bf16",),
        act_mode="a16",
        summary="float weights packed as bf16; activations in their own dtype",
        canonical=("w13", "w2"),
        pack=_pack,
        from_float=lambda w13, w2, layout=None, options=None: {"w13": w13, "w2": w2},
        dequantize=lambda c: (c["w13"].float(), c["w2"].float()),
        reference=_reference,
        output_rule=_output_rule,
        rule=lambda source_dtype, reader: "the source rounded to bf16",
        source_note=lambda source_dtype, reader, options=None: f"{source_dtype} weights packed as bf16",
        layer_packer=DenseLayer,
        quantized=False,
        weights_note="bf16",
        bench=BenchInfo(check_tol=0.05),
        exports=(pack_dense,),
    )
)

__all__ = ["DENSE", "DenseLayer", "pack_dense"]
