"""Scheme ``int8_channel`` (docs/SEMANTICS.md §3, W8A8): symmetric int8 codes with one fp32
scale per output channel; activations quantized per token (A8).

Canonical tensors: w13_q [E, 2I, H] / w2_q [E, H, I] int8 codes and w13_scale [E, 2I] /
w2_scale [E, H] fp32 scales, from an int8 source (compressed-tensors int-quantized) as stored,
or ``quantize_int8_per_channel`` of float weights (``--quantize int8_channel``).
"""

from __future__ import annotations

from .. import BenchInfo, OutputRule, Scheme, register, torch_loop_note
from ..quantized import QuantizedLayer
from .pack import pack_experts_int8, pack_int8_weight
from .quantize import dequantize_int8, quantize_int8_per_channel
from .reference import int8_linear_reference, moe_reference_int8

INT8_TOL = 1e-5  # vs moe_reference_int8 on the same codes (plus flips)
INT8_FLIPS = 2.0
INT8_FP32_TOL = 3e-2  # vs the fp32 reference on the source's weights (docs/SEMANTICS.md §4, A8)


class Int8Layer(QuantizedLayer):
    """One layer's experts into an int8_channel layout (QuantizedLayer: codes stream, scales and
    column sums are gathered). A float source is quantized per output channel."""

    def quantize_weight(self, w):
        q, s = quantize_int8_per_channel(w)
        return {"q": q, "scale": s}

    def dequantize_weight(self, d):
        return dequantize_int8(d["q"], d["scale"])

    def pack_weight(self, role, c, interleaved):
        q, sc = c[f"{role}_q"], c[f"{role}_scale"]
        return pack_int8_weight(role, q, sc.reshape(q.shape[0], -1), interleaved=interleaved, layout=self.layout)


def _pack(c: dict, *, interleaved: bool, layout, use_cpp: bool = True):
    return pack_experts_int8(
        c["w13_q"], c["w13_scale"], c["w2_q"], c["w2_scale"], c.get("w13_bias"), c.get("w2_bias"),
        interleaved=interleaved, layout=layout, use_cpp=use_cpp,
    )  # fmt: skip


def _from_float(w13, w2, layout=None, options=None) -> dict:
    (q13, s13), (q2, s2) = quantize_int8_per_channel(w13), quantize_int8_per_channel(w2)
    return {"w13_q": q13, "w13_scale": s13, "w2_q": q2, "w2_scale": s2}


def _dequantize(c: dict):
    return dequantize_int8(c["w13_q"], c["w13_scale"]), dequantize_int8(c["w2_q"], c["w2_scale"])


def _reference(x, c: dict, topk_weights, topk_ids, **kw):
    return moe_reference_int8(x, c["w13_q"], c["w13_scale"], c["w2_q"], c["w2_scale"], topk_weights, topk_ids,
                              return_flip=True, **kw)  # fmt: skip


def _rule(source_dtype: str, reader: str) -> str:
    if source_dtype == "I8":
        return "the source's own int8 codes and scales"
    return "quantize_int8_per_channel of the source"


def _source_note(source_dtype: str, reader, options=None) -> str:
    if source_dtype == "I8":
        return reader.weights_note or f"int8 codes and scales of {reader.name}"
    return f"quantized by moepack from {source_dtype}"


def _bench_notes(kernel_isa: str, instruction: str | None, torch_loop: bool) -> list[str]:
    notes = ["--scheme int8_channel: GFLOP/s is int8 GOP/s, and '% dot peak' is against the peak of the int8 "
             f"instruction of the kernel that runs here ({kernel_isa}: {instruction or 'scalar code, no peak'})"]  # fmt: skip
    if torch_loop:
        notes.append(torch_loop_note("int8_channel", "int8"))
    return notes


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
        weights_note="int8 codes",
        bench=BenchInfo(check_tol=0.08, notes=_bench_notes),
        exports=(quantize_int8_per_channel, dequantize_int8, pack_int8_weight, pack_experts_int8),
    )
)

__all__ = ["INT8_CHANNEL", "Int8Layer", "quantize_int8_per_channel", "dequantize_int8", "pack_int8_weight",
           "pack_experts_int8", "int8_linear_reference", "moe_reference_int8"]  # fmt: skip
