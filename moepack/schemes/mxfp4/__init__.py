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

from ...errors import ConvertError
from ...layout import LAYOUTS
from .. import BenchInfo, OutputRule, Scheme, register, torch_loop_note
from ..quantized import QuantizedLayer, grouped_source_layout
from .codec import E2M1_VALUES, E8M0_NAN, MX4_GROUP, decode_e2m1, dequantize_mxfp4, e8m0_to_float
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


def mxfp4_layout_for(group_size: int, family: str = "x86"):
    """The mxfp4 layout of an ISA family; ``group_size`` must be 32 (OCP MX)."""
    if group_size != MX4_GROUP:
        raise ConvertError(f"mxfp4 group size {group_size}: OCP MX (and moepack's mxfp4 layouts) group 32 K values per scale")
    for x in LAYOUTS:
        if x.scheme == SCHEME and x.family == family:
            return x
    raise ConvertError(f"scheme {SCHEME}: this build has no layout for the {family} family")


class Mxfp4Layer(QuantizedLayer):
    """One layer's experts into the mx4 layout (QuantizedLayer: codes stream, e8m0 scales are
    gathered). A float source is quantized by OCP's rule (quantize_mxfp4)."""

    def quantize_weight(self, w):
        q, s = quantize_mxfp4(w)
        return {"q": q, "scale": s}

    def dequantize_weight(self, d):
        return dequantize_mxfp4(d["q"], d["scale"])

    def pack_weight(self, role, c, interleaved):
        return pack_mxfp4_weight(role, c[f"{role}_q"], c[f"{role}_scale"], interleaved=interleaved, layout=self.layout)


def _facts(spec, shared: bool = False) -> Mxfp4Facts | None:
    f = getattr(spec, "quant", None)
    if not isinstance(f, Mxfp4Facts):
        return None
    return f.shared if shared else f


def source_layout(specs: list, layout):
    """An MXFP4 source packs into the mx4 layout of the family asked for (never re-quantized)."""
    return grouped_source_layout(specs, layout, _facts, mxfp4_layout_for, "mxfp4", lambda f: f", {f.format}")


def _pack(c: dict, *, interleaved: bool, layout, use_cpp: bool = True):
    return pack_experts_mxfp4(c, interleaved=interleaved, layout=layout, use_cpp=use_cpp)


def _from_float(w13, w2, layout=None, options=None) -> dict:
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    return {"w13_q": q13, "w13_scale": s13, "w2_q": q2, "w2_scale": s2}


def _dequantize(c: dict):
    return dequantize_mxfp4(c["w13_q"], c["w13_scale"]), dequantize_mxfp4(c["w2_q"], c["w2_scale"])


def _reference(x, c: dict, topk_weights, topk_ids, **kw):
    return moe_reference_mxfp4(x, c, topk_weights, topk_ids, return_flip=True, **kw)


_FLOAT = ("", "F32", "BF16", "F16")


def _output_rule(source_dtypes: set) -> OutputRule:
    if source_dtypes <= set(_FLOAT):  # quantized by moepack: its error against the float source is judged too
        return OutputRule(base=MXFP4_TOL, flips=MXFP4_FLIPS, fp32_tol=MXFP4_FROM_FLOAT_TOL)
    return OutputRule(base=MXFP4_TOL, flips=MXFP4_FLIPS, fp32_tol=MXFP4_A8_FP32_TOL)


def _rule(source_dtype: str, reader: str) -> str:
    if source_dtype not in _FLOAT:
        return "the source's own e2m1 codes and e8m0 scales"
    return "quantize_mxfp4 of the source (OCP shared exponent, round to nearest even)"


def _source_note(source_dtype: str, reader, options=None) -> str:
    if source_dtype not in _FLOAT:
        return getattr(reader, "weights_note", None) or f"e2m1 codes and e8m0 scales of {reader.name}"
    return f"quantized by moepack from {source_dtype} (mxfp4: e2m1, e8m0 scale per 32, OCP shared exponent, round to nearest even)"


def _bench_notes(kernel_isa: str, instruction: str | None, torch_loop: bool) -> list[str]:
    notes = [f"--scheme mxfp4: GB/s counts the packed e2m1 codes and their e8m0 scales (6.25% more); the kernel runs at "
             f"{kernel_isa}" + (" (this build has no SIMD mxfp4 kernel for the host)" if kernel_isa == "scalar" else "")]  # fmt: skip
    if torch_loop:
        notes.append(torch_loop_note("mxfp4", "MXFP4"))
    return notes


MXFP4 = register(
    Scheme(
        name=SCHEME,
        aliases=(),
        act_mode="a16",
        summary="e2m1 codes + e8m0 scale per (K group of 32, channel), OCP MX; W4A16 (default, exact) or W4A8",
        canonical=("w13_q", "w13_scale", "w2_q", "w2_scale"),
        pack=_pack,
        from_float=_from_float,
        dequantize=_dequantize,
        reference=_reference,
        output_rule=_output_rule,
        rule=_rule,
        source_note=_source_note,
        layer_packer=Mxfp4Layer,
        default_layout="mx4g32_n32k8_x86",
        source_layout=source_layout,
        weights_note="e2m1 codes",
        # the check column includes the quantization error: 0.16-0.24 (max |diff| / max |out|) on bench-like
        # weights, A16 and A8 (int4 g128 sym: 0.19-0.22 the same way)
        bench=BenchInfo(check_tol=0.35, notes=_bench_notes),
    )
)

__all__ = ["MXFP4", "Mxfp4Facts", "Mxfp4Layer", "mxfp4_layout_for", "quantize_mxfp4", "dequantize_mxfp4", "decode_e2m1",
           "e8m0_to_float", "check_mxfp4_canonical", "check_e8m0", "pack_experts_mxfp4", "pack_mxfp4_weight", "pack_mx4_codes",
           "moe_reference_mxfp4", "mxfp4_linear_a8_reference", "E2M1_VALUES", "E8M0_NAN", "MX4_GROUP",
           "MXFP4_TOL", "MXFP4_FLIPS", "MXFP4_A8_FP32_TOL", "MXFP4_FROM_FLOAT_TOL"]  # fmt: skip
