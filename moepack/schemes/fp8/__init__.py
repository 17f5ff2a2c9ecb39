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

import torch

from ...errors import ConvertError, LayoutError
from ...layout import LAYOUTS
from ..base import ValueRule
from ..quantized import QuantizedLayer, QuantSpec, quantized_scheme
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


def _f8scale_ok(t) -> bool:
    lo, hi = torch.aminmax(t)
    return bool(lo >= 0) and bool(torch.isfinite(hi * FP8_MAX))


# an fp8 layout's values: its codes are e4m3fn bit patterns (no NaN code), its scales times
# e4m3fn's largest code stay finite in float32 (the kernels would turn either into NaN / Inf)
VALUE_RULES = {
    "codes": ValueRule("f8codes", lambda t: (t & 0x7F) == 0x7F, lambda v: "e4m3fn codes 0x7F / 0xFF are NaN (convert refuses them)",
                       lambda t: not bool(((t & 0x7F) == 0x7F).any()), hex=True, streamed=True),
    "scale": ValueRule("f8scale", lambda t: ~(torch.isfinite(t) & (t >= 0) & torch.isfinite(t * FP8_MAX)),
                       lambda v: (f"scales must be finite and >= 0, and fp8 scales <= {torch.finfo(torch.float32).max / FP8_MAX:.4g} "
                                  "(times e4m3fn's largest code 448 a larger one overflows float32; convert refuses them)"),
                       _f8scale_ok, on_open=True),
}  # fmt: skip

FP8_BLOCK = quantized_scheme(
    QuantSpec(
        name=SCHEME,
        short="fp8",
        canonical=("w13_q", "w13_scale", "w2_q", "w2_scale"),
        quantize=lambda w, g, opts: dict(zip(("q", "scale"), quantize_fp8_block(w, g))),
        dequantize=lambda d, g: dequantize_fp8(d["q"], d["scale"], g),
        pack_weight=pack_fp8_weight,
        stored="e4m3fn codes and scales",
        quantizer="quantize_fp8_block",
        quantizer_rule="round to nearest even",
        tol=FP8_TOL,
        fp32_tol=FP8_FROM_FLOAT_TOL,
        grouped=True,
        facts=Fp8Facts,
        layout_for=fp8_layout_for,
        describe=lambda f: f", {f.strategy} scales",
        bench_counts="the packed e4m3fn bytes and their fp32 scales (3.1% more)",
        bench_label="FP8",
    ),
    aliases=("fp8",),
    summary="float8 e4m3fn codes + fp32 scale per (K group of 128, channel) or per channel; W8A16, exact",
    pack=pack_experts_fp8,
    reference=moe_reference_fp8,
    default_layout="f8g128_n32k2_x86",
    parse_options=parse_options,
    value_rules=VALUE_RULES,
    weights_note="e4m3fn codes",
)
Fp8Layer = QuantizedLayer  # the name older code used: fp8 layers are the generic quantized packer

__all__ = ["FP8_BLOCK", "Fp8Options", "Fp8Facts", "Fp8Layer", "group_sizes", "fp8_layout_for", "layout_group",
           "quantize_fp8_block", "dequantize_fp8", "decode_e4m3fn", "check_fp8_canonical", "pack_experts_fp8",
           "pack_fp8_weight", "moe_reference_fp8", "E4M3FN_VALUES", "FP8_MAX"]  # fmt: skip
