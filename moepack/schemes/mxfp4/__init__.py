"""Scheme ``mxfp4`` (docs/SEMANTICS.md §3, OCP MX v1.0; W4A16 / W4A8): 4-bit e2m1 codes with one
e8m0 exponent byte per (K group of 32, output channel); ``e2m1(q) * 2^(e - 127)``, exact.

Canonical tensors (pack.py): ``w13_q`` [E, 2I, H] / ``w2_q`` [E, H, I] uint8 e2m1 codes 0..15
(one per byte), ``w13_scale`` / ``w2_scale`` uint8 e8m0 [E, N, ceil(K / 32)] (never 255). They
come from an MXFP4 checkpoint (gpt-oss ``*_blocks`` / ``*_scales``, compressed-tensors
``mxfp4-pack-quantized``; moepack/sources/mxfp4.py, whose facts are facts.py's ``Mxfp4Facts``)
as stored, or from ``quantize_mxfp4`` of float weights (``pack_experts`` with the mx4 layout,
``--quantize mxfp4``): OCP's shared exponent floor(log2(amax)) - 2, round to nearest even on
the e2m1 grid, saturating at +-6 (quantize.py says the rule and its error).

Two activation modes, chosen per call (``act_mode``) like int4_group's: a16 (the default, the
checkpoint's exact meaning: activations in their own dtype, the group's 2^(e - 127) applied in
fp32 after its dot product) and a8 (activations quantized per token to int8; per group the
exact integer dot product with 2 * e2m1(q), -12..12, times 2^(e - 128): reference.py).
"""

from __future__ import annotations

from ..base import ValueRule
from ..quantized import QuantizedLayer, QuantSpec, fixed_group_layout_for, quantized_scheme
from .codec import E2M1_VALUES, E8M0_LARGEST, E8M0_NAN, MX4_GROUP, decode_e2m1, dequantize_mxfp4, e8m0_to_float
from .facts import Mxfp4Facts
from .pack import pack_experts_mxfp4, pack_mx4_codes, pack_mxfp4_weight
from .quantize import check_e8m0, check_mxfp4_canonical, quantize_mxfp4
from .reference import moe_reference_mxfp4, mxfp4_linear_a8_reference

SCHEME = "mxfp4"
# A16 (and A8 against its own reference, plus flips): the kernel against moe_reference_mxfp4 on
# the same codes. A16 differs from the exact dequantized reference by fp32 summation order only.
MXFP4_TOL = 1e-5
MXFP4_FLIPS = 2.0  # A8: intermediate codes one ulp from a boundary may round either way (SEMANTICS.md §4)
# The output against the fp32 reference on the exactly dequantized weights (an mxfp4 source):
# A16 sits at the summation-order level (~1e-6); A8 adds the per-token int8 rounding of x and of
# the intermediate, which SEMANTICS.md §4 bounds at 3e-2 for every A8 mode (measured 0.017-0.019
# on tests/schemes/mxfp4/test_mxfp4.py's shapes).
MXFP4_A8_FP32_TOL = 3e-2
# A float source quantized by moepack: the output against the fp32 reference on the SOURCE's
# float weights. OCP's rule leaves Gaussian weights within 0.115 of themselves (Frobenius,
# relative; heavy tails 0.14, quantize.py); through two GEMMs and the activation the outputs
# land at 0.17-0.22 on the tests' shapes (A16 and A8 alike, silu / gelu / swigluoai, x at 1/sqrt(H),
# 1 and 4). The bound catches a wrong scale,
# code or group (off by far more: a scale one binade off alone doubles a group) and leaves
# room for heavy tails.
MXFP4_FROM_FLOAT_TOL = 0.4


mxfp4_layout_for = fixed_group_layout_for(SCHEME, MX4_GROUP, "OCP MX")

def _e8m0_text(v) -> str:
    if v == E8M0_NAN:
        return f"e8m0 scale 255 is NaN (scales are 2^(e - 127), e = 0..{E8M0_LARGEST}; convert refuses it)"
    return (f"e8m0 scales must be 0..{E8M0_LARGEST}: from 253 up 6 (e2m1's largest code) x 2^(e - 127) overflows "
            "float32 (convert refuses them)")  # fmt: skip


# the scales are e8m0 exponent bytes: 255 is NaN and from 253 up the largest code overflows float32
VALUE_RULES = {"scale": ValueRule("e8m0", lambda t: t > E8M0_LARGEST, _e8m0_text, lambda t: int(t.max()) <= E8M0_LARGEST, on_open=True)}

MXFP4 = quantized_scheme(
    QuantSpec(
        name=SCHEME,
        short="mxfp4",
        canonical=("w13_q", "w13_scale", "w2_q", "w2_scale"),
        quantize=lambda w, g, opts: dict(zip(("q", "scale"), quantize_mxfp4(w))),
        dequantize=lambda d, g: dequantize_mxfp4(d["q"], d["scale"]),
        pack_weight=pack_mxfp4_weight,
        stored="e2m1 codes and e8m0 scales",
        quantizer="quantize_mxfp4",
        quantizer_rule="OCP shared exponent, round to nearest even",
        float_note="mxfp4: e2m1, e8m0 scale per 32, OCP shared exponent, round to nearest even",
        tol=MXFP4_TOL,
        flips=MXFP4_FLIPS,
        fp32_tol=MXFP4_FROM_FLOAT_TOL,
        own_fp32_tol=MXFP4_A8_FP32_TOL,
        facts=Mxfp4Facts,
        layout_for=mxfp4_layout_for,
        describe=lambda f: f", {f.format}",
        bench_counts="the packed e2m1 codes and their e8m0 scales (6.25% more)",
        bench_label="MXFP4",
        # the check column includes the quantization error: 0.16-0.24 (max |diff| / max |out|) on bench-like
        # weights, A16 and A8 (int4 g128 sym: 0.19-0.22 the same way)
        check_tol=0.35,
    ),
    summary="e2m1 codes + e8m0 scale per (K group of 32, channel), OCP MX; W4A16 (default, exact) or W4A8",
    pack=pack_experts_mxfp4,
    reference=moe_reference_mxfp4,
    default_layout="mx4g32_n32k8_x86",
    value_rules=VALUE_RULES,
    weights_note="e2m1 codes",
)
Mxfp4Layer = QuantizedLayer  # the name older code used: mxfp4 layers are the generic quantized packer

__all__ = ["MXFP4", "Mxfp4Facts", "Mxfp4Layer", "mxfp4_layout_for", "quantize_mxfp4", "dequantize_mxfp4", "decode_e2m1",
           "e8m0_to_float", "check_mxfp4_canonical", "check_e8m0", "pack_experts_mxfp4", "pack_mxfp4_weight", "pack_mx4_codes",
           "moe_reference_mxfp4", "mxfp4_linear_a8_reference", "E2M1_VALUES", "E8M0_NAN", "MX4_GROUP",
           "MXFP4_TOL", "MXFP4_FLIPS", "MXFP4_A8_FP32_TOL", "MXFP4_FROM_FLOAT_TOL"]  # fmt: skip
