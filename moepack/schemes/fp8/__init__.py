"""Scheme ``fp8_block`` (docs/SEMANTICS.md §3, W8A16): float8 e4m3fn codes, one fp32 scale per
(K group of 128, output channel) or per output channel; ``e4m3fn(q) * s``, exact.

Canonical tensors (pack.py): ``w13_q`` [E, 2I, H] / ``w2_q`` [E, H, I] uint8 e4m3fn bit patterns,
``w13_scale`` / ``w2_scale`` fp32 [E, N, ceil(K / 128)] ([E, N, 1] per channel) and
``group_size`` (128, or -1 per channel). They come from an FP8 checkpoint (DeepSeek-V3/R1 and
Qwen3-FP8 ``weight_scale_inv`` blocks, compressed-tensors float-quantized block / channel /
tensor scales; moepack/sources/fp8.py) as stored, the 2-D block scales expanded over each
block's rows, or from ``quantize_fp8_block`` of float weights (``pack_experts`` with an f8
layout; ``--quantize fp8[:g128|ch]``): 128 x 128 blocks, scale = block amax / 448, round to
nearest even.

Activations stay in their own dtype (a16), also for checkpoints whose activations were meant to
be quantized to FP8 at run time: moepack computes with the 16-bit (or fp32) activations, which
is more accurate than the FP8 activations the checkpoint allowed, never less.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConvertError, LayoutError, UnsupportedError
from ...layout import LAYOUTS
from .. import BenchInfo, OutputRule, Scheme, register, torch_loop_note
from ..quantized import QuantizedLayer, grouped_source_layout
from .facts import Fp8Facts
from .pack import layout_group, pack_experts_fp8, pack_fp8_weight
from .quantize import (
    E4M3FN_VALUES,
    FP8_DEFAULT_GROUP,
    FP8_MAX,
    check_fp8_canonical,
    decode_e4m3fn,
    dequantize_fp8,
    quantize_fp8_block,
)
from .reference import moe_reference_fp8

SCHEME = "fp8_block"
FP8_TOL = 1e-5  # the kernel against moe_reference_fp8 on the same codes (the same dequantized weights)
# A float source quantized by moepack: the output against the fp32 reference on the SOURCE's
# float weights. e4m3fn keeps 3 mantissa bits, so every weight above its block's subnormal range
# (scale * 2^-6) is within 2^-4 of itself, relative (under 4% RMS on bell-shaped weights,
# tests/schemes/fp8/test_fp8.py); through two GEMMs and the activation the fixtures' outputs land at
# 0.036-0.053 (qwen3_moe, deepseek_v3, gpt_oss, mixtral, olmoe; blocks of 128 and per channel).
# The bound leaves room for heavy tails and still catches a wrong scale, code or block, which
# is off by far more.
FP8_FROM_FLOAT_TOL = 0.15


def group_sizes(family: str = "x86") -> tuple[int, ...]:
    """The K group sizes this build has fp8 layouts for (-1: per channel)."""
    return tuple(layout_group(x) for x in LAYOUTS if x.scheme == SCHEME and x.family == family)


def fp8_layout_for(group_size: int, family: str = "x86"):
    """The fp8 layout of a K group size (-1 = per channel) and ISA family."""
    for x in LAYOUTS:
        if x.scheme == SCHEME and x.family == family and layout_group(x) == group_size:
            return x
    raise LayoutError(f"fp8 group size {group_size}: moepack has {family} fp8 layouts for group sizes "
                      f"{', '.join(map(str, group_sizes(family)))} (-1 = per channel)")  # fmt: skip


@dataclass(frozen=True)
class Fp8Options:
    """``--quantize fp8``'s options: the K group of a scale, 128 (128 x 128 blocks, DeepSeek's and
    FP8_BLOCK's) or -1 (one scale per output channel, FP8_DYNAMIC's). Round to nearest even."""

    group_size: int | None = None  # None: not named (the fp8 layout asked for, else 128)

    def group(self) -> int:
        return FP8_DEFAULT_GROUP if self.group_size is None else self.group_size

    def resolved(self, layout) -> "Fp8Options":
        return self if self.group_size is not None else Fp8Options(layout_group(layout))

    def key(self) -> str:
        return f"{SCHEME}:{'ch' if self.group() == -1 else f'g{self.group()}'}"

    def note(self) -> str:
        g = self.group()
        return f"fp8 e4m3fn, {'per channel' if g == -1 else f'{g} x {g} blocks'}, scale = amax / 448, round to nearest even"

    def layout(self, family: str, given=None):
        if self.group_size is None and given is not None:
            return given
        return fp8_layout_for(self.group(), family)


def parse_options(words: tuple[str, ...]) -> Fp8Options:
    """``("ch",)`` -> Fp8Options: one word at most, ``g<N>`` / ``b<N>`` (the block size) or ``ch``."""
    group = None
    sizes = group_sizes()
    for w in words:
        g = -1 if w in ("ch", "g-1") else int(w[1:]) if w[:1] in ("g", "b") and w[1:].isdigit() else None
        if g is None:
            raise ConvertError(f"--quantize fp8 option {w!r}: options are g<N> (block size: "
                               f"{', '.join(f'g{x}' for x in sizes if x > 0)}) or ch (per channel)")  # fmt: skip
        if group is not None:
            raise ConvertError(f"--quantize fp8 option {w!r}: the block size is given twice")
        if g not in sizes:
            raise ConvertError(f"--quantize fp8 block size {g}: moepack has fp8 layouts for "
                               f"{', '.join(str(x) for x in sizes)} (-1 = per channel)")  # fmt: skip
        group = g
    return Fp8Options(group)


class Fp8Layer(QuantizedLayer):
    """One layer's experts into an fp8 layout (QuantizedLayer: codes stream, scales are gathered).
    A float source is quantized in blocks of the layout's group size (per channel: rows)."""

    def quantize_weight(self, w):
        q, s = quantize_fp8_block(w, layout_group(self.layout))
        return {"q": q, "scale": s}

    def dequantize_weight(self, d):
        return dequantize_fp8(d["q"], d["scale"], layout_group(self.layout))

    def pack_weight(self, role, c, interleaved):
        return pack_fp8_weight(role, c[f"{role}_q"], c[f"{role}_scale"], interleaved=interleaved, layout=self.layout)


def _facts(spec, shared: bool = False) -> Fp8Facts | None:
    f = getattr(spec, "quant", None)
    if not isinstance(f, Fp8Facts):
        return None
    return f.shared if shared else f


def source_layout(specs: list, layout):
    """An FP8 source packs into the fp8 layout of its own scales (never re-quantized): K blocks of
    128 -> f8g128, per channel or per tensor -> f8ch."""
    return grouped_source_layout(specs, layout, _facts, fp8_layout_for, "fp8", lambda f: f", {f.strategy} scales")


def _pack(c: dict, *, interleaved: bool, layout, use_cpp: bool = True):
    return pack_experts_fp8(c, interleaved=interleaved, layout=layout, use_cpp=use_cpp)


def _from_float(w13, w2, layout=None, options: Fp8Options | None = None) -> dict:
    opts = options or Fp8Options()
    g = layout_group(layout) if layout is not None else opts.group()
    if opts.group_size is not None and layout is not None and g != opts.group_size:
        raise UnsupportedError(f"fp8 group size {opts.group_size} with layout {layout.name} (group size {g}): "
                               "the options and the layout must agree")  # fmt: skip
    q13, s13 = quantize_fp8_block(w13, g)
    q2, s2 = quantize_fp8_block(w2, g)
    return {"w13_q": q13, "w13_scale": s13, "w2_q": q2, "w2_scale": s2, "group_size": g}


def _dequantize(c: dict):
    g = int(c["group_size"])
    return dequantize_fp8(c["w13_q"], c["w13_scale"], g), dequantize_fp8(c["w2_q"], c["w2_scale"], g)


def _reference(x, c: dict, topk_weights, topk_ids, **kw):
    return moe_reference_fp8(x, c, topk_weights, topk_ids, return_flip=True, **kw)


_FLOAT = ("", "F32", "BF16", "F16")


def _output_rule(source_dtypes: set) -> OutputRule:
    if source_dtypes <= set(_FLOAT):  # quantized by moepack: its error against the float source is judged too
        return OutputRule(base=FP8_TOL, fp32_tol=FP8_FROM_FLOAT_TOL)
    return OutputRule(base=FP8_TOL)


def _rule(source_dtype: str, reader: str) -> str:
    if source_dtype not in _FLOAT:
        return "the source's own e4m3fn codes and scales"
    return "quantize_fp8_block of the source (round to nearest even)"


def _source_note(source_dtype: str, reader, options: Fp8Options | None = None) -> str:
    if source_dtype not in _FLOAT:
        return reader.weights_note or f"e4m3fn codes and scales of {reader.name}"
    return f"quantized by moepack from {source_dtype} ({(options or Fp8Options()).note()})"


def _bench_notes(kernel_isa: str, instruction: str | None, torch_loop: bool) -> list[str]:
    notes = [f"--scheme fp8_block: GB/s counts the packed e4m3fn bytes and their fp32 scales (3.1% more); the kernel "
             f"runs at {kernel_isa}" + (" (this build has no SIMD fp8 kernel for the host)" if kernel_isa == "scalar" else "")]  # fmt: skip
    if torch_loop:
        notes.append(torch_loop_note("fp8_block", "FP8"))
    return notes


FP8_BLOCK = register(
    Scheme(
        name=SCHEME,
        aliases=("fp8",),
        act_mode="a16",
        summary="float8 e4m3fn codes + fp32 scale per (K group of 128, channel) or per channel; W8A16, exact",
        canonical=("w13_q", "w13_scale", "w2_q", "w2_scale"),
        pack=_pack,
        from_float=_from_float,
        dequantize=_dequantize,
        reference=_reference,
        output_rule=_output_rule,
        rule=_rule,
        source_note=_source_note,
        layer_packer=Fp8Layer,
        default_layout="f8g128_n32k2_x86",
        parse_options=parse_options,
        source_layout=source_layout,
        with_layout=lambda c, layout: {**c, "group_size": c.get("group_size", layout_group(layout))},
        weights_note="e4m3fn codes",
        bench=BenchInfo(check_tol=0.08, notes=_bench_notes),
    )
)

__all__ = ["FP8_BLOCK", "Fp8Options", "Fp8Facts", "Fp8Layer", "group_sizes", "fp8_layout_for", "layout_group",
           "quantize_fp8_block", "dequantize_fp8", "decode_e4m3fn", "check_fp8_canonical", "pack_experts_fp8",
           "pack_fp8_weight", "moe_reference_fp8", "E4M3FN_VALUES", "FP8_MAX"]  # fmt: skip
