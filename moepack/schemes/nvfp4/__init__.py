"""Scheme ``nvfp4`` (docs/SEMANTICS.md §3; W4A16 / W4A8): 4-bit e2m1 codes with one float8 e4m3fn
scale byte per (K group of 16, output channel) and one fp32 global scale per output channel;
``w = e2m1(q) * s``, s the group's scale rounded to fp32 once as the source rounds it
(compressed-tensors: e4m3 / weight_global_scale; ModelOpt: e4m3 * weight_scale_2; codec.py).

Canonical tensors (pack.py): ``w13_q`` [E, 2I, H] / ``w2_q`` [E, H, I] uint8 e2m1 codes 0..15 (one
per byte), ``w13_scale`` / ``w2_scale`` uint8 e4m3 bytes [E, N, ceil(K / 16)] (never NaN or
negative), ``w13_global`` / ``w2_global`` fp32 [E, N] (> 0 a divisor, < 0 a multiplier negated).
They come from an NVFP4 checkpoint (compressed-tensors ``nvfp4-pack-quantized``, ModelOpt NVFP4;
moepack/sources/nvfp4.py, whose facts are facts.py's ``Nvfp4Facts``) as stored, or from
``quantize_nvfp4`` of float weights (``pack_experts`` with the nv4 layout, ``--quantize nvfp4``):
compressed-tensors' rule (quantize.py).

Two activation modes, chosen per call (``act_mode``) like mxfp4's: a16 (the default, the
checkpoint's exact meaning: activations in their own dtype, the group's fp32 scale applied after
its dot product) and a8 (activations quantized per token to int8; per group the exact integer dot
product with 2 * e2m1(q), times s / 2: reference.py). NVFP4 activations (a checkpoint's
``input_activations`` of 4-bit floats) are never run in 4 bits: the manifest and ``inspect`` say
the activations run in 16 bits (or int8 with ``--act-mode a8``).
"""

from __future__ import annotations

import torch

from ..base import ValueRule
from ..quantized import QuantizedLayer, QuantSpec, fixed_group_layout_for, quantized_scheme
from .codec import NV4_GROUP, decode_e2m1, dequantize_nvfp4, e4m3_to_float, group_scales
from .facts import Nvfp4Facts
from .pack import pack_experts_nvfp4, pack_nvfp4_weight
from .quantize import check_e4m3_scales, check_globals, check_nvfp4_canonical, global_scale, quantize_nvfp4
from .reference import moe_reference_nvfp4, nvfp4_linear_a8_reference

SCHEME = "nvfp4"
# A16 (and A8 against its own reference, plus flips): the kernel against moe_reference_nvfp4 on the
# same codes: fp32 summation order only (as mxfp4's).
NVFP4_TOL = 1e-5
NVFP4_FLIPS = 2.0  # A8: intermediate codes one ulp from a boundary may round either way (SEMANTICS.md §4)
# The output against the fp32 reference on the exactly dequantized weights (an nvfp4 source): A16
# at the summation-order level; A8 adds the per-token int8 rounding (SEMANTICS.md §4: 3e-2).
NVFP4_A8_FP32_TOL = 3e-2
# A float source quantized by moepack (compressed-tensors' rule): Gaussian weights land within ~0.10
# of themselves (Frobenius, relative), the outputs through two GEMMs within ~0.2; the bound catches
# a wrong scale, global or group (off by far more).
NVFP4_FROM_FLOAT_TOL = 0.4


nvfp4_layout_for = fixed_group_layout_for(SCHEME, NV4_GROUP, "NVFP4")

def _globals_ok(t) -> bool:
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


# the group scales are e4m3fn bytes (never NaN, never negative), the per-channel globals finite
VALUE_RULES = {
    "scale": ValueRule("e4m3", lambda t: t >= 0x7F,
                       lambda v: "nvfp4 e4m3 scale bytes 0x7F / 0xFF are NaN and 0x80 up negative (convert refuses them)",
                       lambda t: int(t.max()) < 0x7F, on_open=True, hex=True),
    "global": ValueRule("global", lambda t: ~torch.isfinite(t), lambda v: "nvfp4 global scales must be finite (convert refuses others)",
                        _globals_ok, on_open=True),
}  # fmt: skip

NVFP4 = quantized_scheme(
    QuantSpec(
        name=SCHEME,
        short="nvfp4",
        canonical=("w13_q", "w13_scale", "w13_global", "w2_q", "w2_scale", "w2_global"),
        quantize=lambda w, g, opts: dict(zip(("q", "scale", "global"), quantize_nvfp4(w))),
        dequantize=lambda d, g: dequantize_nvfp4(d["q"], d["scale"], d["global"]),
        pack_weight=pack_nvfp4_weight,
        stored="e2m1 codes, e4m3 scales and global scales",
        quantizer="quantize_nvfp4",
        quantizer_rule="compressed-tensors' NVFP4 rule: amax/6 per 16 in e4m3 under a per-tensor global scale",
        float_note="nvfp4: e2m1, e4m3 scale per 16 under a per-tensor fp32 global scale, compressed-tensors' rule",
        tol=NVFP4_TOL,
        flips=NVFP4_FLIPS,
        fp32_tol=NVFP4_FROM_FLOAT_TOL,
        own_fp32_tol=NVFP4_A8_FP32_TOL,
        facts=Nvfp4Facts,
        layout_for=nvfp4_layout_for,
        describe=lambda f: f", {f.format}",
        bench_counts="the packed e2m1 codes, their e4m3 scales (12.5% more) and the per-channel globals",
        bench_label="NVFP4",
        check_tol=0.35,
    ),
    summary="e2m1 codes + e4m3 scale per (K group of 16, channel) + fp32 global per channel, NVFP4; W4A16 (default, exact) or W4A8",
    pack=pack_experts_nvfp4,
    reference=moe_reference_nvfp4,
    default_layout="nv4g16_n32k8_x86",
    value_rules=VALUE_RULES,
    weights_note="e2m1 codes",
)
Nvfp4Layer = QuantizedLayer  # the name older code used: nvfp4 layers are the generic quantized packer

__all__ = ["NVFP4", "Nvfp4Facts", "Nvfp4Layer", "nvfp4_layout_for", "quantize_nvfp4", "dequantize_nvfp4", "decode_e2m1",
           "e4m3_to_float", "group_scales", "global_scale", "check_nvfp4_canonical", "check_e4m3_scales", "check_globals",
           "pack_experts_nvfp4", "pack_nvfp4_weight", "moe_reference_nvfp4", "nvfp4_linear_a8_reference", "NV4_GROUP",
           "NVFP4_TOL", "NVFP4_FLIPS", "NVFP4_A8_FP32_TOL", "NVFP4_FROM_FLOAT_TOL"]  # fmt: skip
