"""Scheme ``int8_channel`` (docs/SEMANTICS.md §3, W8A8): symmetric int8 codes with one fp32
scale per output channel; activations quantized per token (A8).

Canonical tensors: w13_q [E, 2I, H] / w2_q [E, H, I] int8 codes and w13_scale [E, 2I] /
w2_scale [E, H] fp32 scales, from an int8 source (compressed-tensors int-quantized) as stored,
or ``quantize_int8_per_channel`` of float weights (``--quantize int8_channel``).
"""

from __future__ import annotations

from ..quantized import QuantizedLayer, QuantSpec, quantized_scheme
from .pack import pack_experts_int8, pack_int8_weight
from .quantize import dequantize_int8, quantize_int8_per_channel
from .reference import int8_linear_reference, moe_reference_int8

INT8_TOL = 1e-5  # vs moe_reference_int8 on the same codes (plus flips)
INT8_FLIPS = 2.0
INT8_FP32_TOL = 3e-2  # vs the fp32 reference on the source's weights (docs/SEMANTICS.md §4, A8)


def _pack(c: dict, *, interleaved: bool, layout, use_cpp: bool = True):
    return pack_experts_int8(
        c["w13_q"], c["w13_scale"], c["w2_q"], c["w2_scale"], c.get("w13_bias"), c.get("w2_bias"),
        interleaved=interleaved, layout=layout, use_cpp=use_cpp,
    )  # fmt: skip


def _bench_lead(kernel_isa: str, instruction: str | None) -> str:
    return ("--scheme int8_channel: GFLOP/s is int8 GOP/s, and '% dot peak' is against the peak of the int8 "
            f"instruction of the kernel that runs here ({kernel_isa}: {instruction or 'scalar code, no peak'})")  # fmt: skip


INT8_CHANNEL = quantized_scheme(
    QuantSpec(
        name="int8_channel",
        short="int8",
        canonical=("w13_q", "w13_scale", "w2_q", "w2_scale"),
        quantize=lambda w, g, opts: dict(zip(("q", "scale"), quantize_int8_per_channel(w))),
        dequantize=lambda d, g: dequantize_int8(d["q"], d["scale"]),
        pack_weight=lambda role, q, sc, **kw: pack_int8_weight(role, q, sc.reshape(q.shape[0], -1), **kw),
        stored="int8 codes and scales",
        stored_dtypes=("I8",),
        quantizer="quantize_int8_per_channel",
        tol=INT8_TOL,
        flips=INT8_FLIPS,
        fp32_tol=INT8_FP32_TOL,
        own_fp32_tol=INT8_FP32_TOL,
        bench_lead=_bench_lead,
        bench_label="int8",
    ),
    aliases=("int8",),
    act_mode="a8",
    summary="int8 codes + fp32 per-channel scales (W8A8); activations quantized per token",
    pack=_pack,
    reference=lambda x, c, topk_weights, topk_ids, **kw: moe_reference_int8(x, c["w13_q"], c["w13_scale"], c["w2_q"], c["w2_scale"],
                                                                           topk_weights, topk_ids, **kw),
    weights_note="int8 codes",
    exports=(quantize_int8_per_channel, dequantize_int8, pack_int8_weight, pack_experts_int8),
)
Int8Layer = QuantizedLayer  # the name older code used: int8 layers are the generic quantized packer

__all__ = ["INT8_CHANNEL", "Int8Layer", "quantize_int8_per_channel", "dequantize_int8", "pack_int8_weight",
           "pack_experts_int8", "int8_linear_reference", "moe_reference_int8"]  # fmt: skip
