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

from ...errors import ConvertError
from ...layout import LAYOUTS
from .. import BenchInfo, OutputRule, Scheme, register, torch_loop_note
from ..quantized import QuantizedLayer, grouped_source_layout
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


def nvfp4_layout_for(group_size: int, family: str = "x86"):
    """The nvfp4 layout of an ISA family; ``group_size`` must be 16 (NVFP4)."""
    if group_size != NV4_GROUP:
        raise ConvertError(f"nvfp4 group size {group_size}: NVFP4 (and moepack's nvfp4 layouts) group 16 K values per scale")
    for x in LAYOUTS:
        if x.scheme == SCHEME and x.family == family:
            return x
    raise ConvertError(f"scheme {SCHEME}: this build has no layout for the {family} family")


class Nvfp4Layer(QuantizedLayer):
    """One layer's experts into the nv4 layout (QuantizedLayer: codes stream, e4m3 scales and
    globals are gathered). A float source is quantized by compressed-tensors' rule."""

    def quantize_weight(self, w):
        q, s, g = quantize_nvfp4(w)
        return {"q": q, "scale": s, "global": g}

    def dequantize_weight(self, d):
        return dequantize_nvfp4(d["q"], d["scale"], d["global"])

    def pack_weight(self, role, c, interleaved):
        return pack_nvfp4_weight(role, c[f"{role}_q"], c[f"{role}_scale"], c[f"{role}_global"], interleaved=interleaved,
                                 layout=self.layout)  # fmt: skip


def _facts(spec, shared: bool = False) -> Nvfp4Facts | None:
    f = getattr(spec, "quant", None)
    if not isinstance(f, Nvfp4Facts):
        return None
    return f.shared if shared else f


def source_layout(specs: list, layout):
    """An NVFP4 source packs into the nv4 layout of the family asked for (never re-quantized)."""
    return grouped_source_layout(specs, layout, _facts, nvfp4_layout_for, "nvfp4", lambda f: f", {f.format}")


def _pack(c: dict, *, interleaved: bool, layout, use_cpp: bool = True):
    return pack_experts_nvfp4(c, interleaved=interleaved, layout=layout, use_cpp=use_cpp)


def _from_float(w13, w2, layout=None, options=None) -> dict:
    q13, s13, g13 = quantize_nvfp4(w13)
    q2, s2, g2 = quantize_nvfp4(w2)
    return {"w13_q": q13, "w13_scale": s13, "w13_global": g13, "w2_q": q2, "w2_scale": s2, "w2_global": g2}


def _dequantize(c: dict):
    return (dequantize_nvfp4(c["w13_q"], c["w13_scale"], c["w13_global"]),
            dequantize_nvfp4(c["w2_q"], c["w2_scale"], c["w2_global"]))  # fmt: skip


def _reference(x, c: dict, topk_weights, topk_ids, **kw):
    return moe_reference_nvfp4(x, c, topk_weights, topk_ids, return_flip=True, **kw)


_FLOAT = ("", "F32", "BF16", "F16")


def _output_rule(source_dtypes: set) -> OutputRule:
    if source_dtypes <= set(_FLOAT):
        return OutputRule(base=NVFP4_TOL, flips=NVFP4_FLIPS, fp32_tol=NVFP4_FROM_FLOAT_TOL)
    return OutputRule(base=NVFP4_TOL, flips=NVFP4_FLIPS, fp32_tol=NVFP4_A8_FP32_TOL)


def _rule(source_dtype: str, reader: str) -> str:
    if source_dtype not in _FLOAT:
        return "the source's own e2m1 codes, e4m3 scales and global scales"
    return "quantize_nvfp4 of the source (compressed-tensors' NVFP4 rule: amax/6 per 16 in e4m3 under a per-tensor global scale)"


def _source_note(source_dtype: str, reader, options=None) -> str:
    if source_dtype not in _FLOAT:
        return getattr(reader, "weights_note", None) or f"e2m1 codes, e4m3 scales and global scales of {reader.name}"
    return (f"quantized by moepack from {source_dtype} (nvfp4: e2m1, e4m3 scale per 16 under a per-tensor fp32 global "
            "scale, compressed-tensors' rule)")  # fmt: skip


def _bench_notes(kernel_isa: str, instruction: str | None, torch_loop: bool) -> list[str]:
    notes = [f"--scheme nvfp4: GB/s counts the packed e2m1 codes, their e4m3 scales (12.5% more) and the per-channel globals; "
             f"the kernel runs at {kernel_isa}"]  # fmt: skip
    if torch_loop:
        notes.append(torch_loop_note("nvfp4", "NVFP4"))
    return notes


NVFP4 = register(
    Scheme(
        name=SCHEME,
        aliases=(),
        act_mode="a16",
        summary="e2m1 codes + e4m3 scale per (K group of 16, channel) + fp32 global per channel, NVFP4; W4A16 (default, exact) or W4A8",
        canonical=("w13_q", "w13_scale", "w13_global", "w2_q", "w2_scale", "w2_global"),
        pack=_pack,
        from_float=_from_float,
        dequantize=_dequantize,
        reference=_reference,
        output_rule=_output_rule,
        rule=_rule,
        source_note=_source_note,
        layer_packer=Nvfp4Layer,
        default_layout="nv4g16_n32k8_x86",
        source_layout=source_layout,
        weights_note="e2m1 codes",
        bench=BenchInfo(check_tol=0.35, notes=_bench_notes),
    )
)

__all__ = ["NVFP4", "Nvfp4Facts", "Nvfp4Layer", "nvfp4_layout_for", "quantize_nvfp4", "dequantize_nvfp4", "decode_e2m1",
           "e4m3_to_float", "group_scales", "global_scale", "check_nvfp4_canonical", "check_e4m3_scales", "check_globals",
           "pack_experts_nvfp4", "pack_nvfp4_weight", "moe_reference_nvfp4", "nvfp4_linear_a8_reference", "NV4_GROUP",
           "NVFP4_TOL", "NVFP4_FLIPS", "NVFP4_A8_FP32_TOL", "NVFP4_FROM_FLOAT_TOL"]  # fmt: skip
