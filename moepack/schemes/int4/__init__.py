"""Scheme ``int4_group`` (docs/SEMANTICS.md §3, W4A16 / W4A8): unsigned 4-bit codes with one fp32
scale and one zero point per (K group, output channel); ``(q - z) * s``.

Canonical tensors (pack.py): ``w13_q`` [E, 2I, H] / ``w2_q`` [E, H, I] uint8 codes 0..15,
``w13_scale`` / ``w2_scale`` fp32 [E, N, ceil(K / G)], ``w13_zero`` / ``w2_zero`` uint8 true zero
points (8 for symmetric sources), and ``group_size`` (an int: G, or -1 for one group per row).
They come from a 4-bit checkpoint (GPTQ, AWQ, compressed-tensors pack-quantized) as stored, or
from ``quantize_int4_group`` of float weights (``pack_experts`` with an int4 layout: symmetric at
the layout's group size; ``--quantize int4[:g32|g64|g128|ch][:sym|asym]``, round to nearest).

Two activation modes, chosen per call (``act_mode``): a16 (the default: the checkpoint's own
meaning, activations in their own dtype) and a8 (activations quantized per token to int8, as
W8A8 does: faster where int8 dot products are).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConvertError
from ...layout import LAYOUTS, int4_layout_for
from ..quantized import QuantizedLayer, QuantSpec, layout_group, quantized_scheme
from .facts import Int4Facts
from .pack import pack_experts_int4, pack_int4_weight, pack_u4_codes
from .quantize import INT4_DEFAULT_GROUP, check_w13_perm, dequantize_int4_group, quantize_int4_group
from .reference import moe_reference_int4, unpermute_w13

SCHEME = "int4_group"
INT4_TOL = 1e-5  # vs moe_reference_int4 on the same codes (A16; A8 plus flips)
INT4_FLIPS = 2.0
INT4_A8_FP32_TOL = 3e-2  # A8 vs the fp32 reference on the dequantized weights (docs/SEMANTICS.md §4)
# A float source quantized by moepack: the output against the fp32 reference on the SOURCE's
# float weights, reported per layer. Round to nearest leaves each weight within half a step
# (amax / 7.5 symmetric, range / 15 asymmetric): a relative weight error of ~9-10% for
# bell-shaped weights, which two GEMMs and the activation grow to 15-20% of the output (the
# qwen3_moe, mixtral and deepseek_v3 fixtures, every option: weights 0.087-0.103, outputs
# 0.146-0.196), but heavy-tailed weights quantized coarsely go far higher (per channel on
# Student-t df=3 weights: 0.43 of the weights alone). So the value is reported for the user to
# judge, and the layer fails only at 1.0, where the output is no closer to the source's than zero
# is: a broken quantizer (wrong scales, codes or options), never a coarse one. The codes
# themselves are pinned exactly (verify redoes the quantization) and against the int4 reference.
INT4_FROM_FLOAT_TOL = 1.0


def group_sizes(family: str = "x86") -> tuple[int, ...]:
    """The group sizes this build has int4 layouts for (-1: per channel)."""
    return tuple(layout_group(x) for x in LAYOUTS if x.scheme == SCHEME and x.family == family)


@dataclass(frozen=True)
class Int4Options:
    """``--quantize int4``'s options: the group size (the K values sharing one scale; -1 = one per
    output channel) and symmetric (scale = amax / 7.5, zero point 8: GPTQ's and
    compressed-tensors' W4A16) or asymmetric (scale and zero point from the group's min and max:
    W4A16_ASYM, AWQ's zero_point). Round to nearest either way."""

    group_size: int | None = None  # None: not named (the int4 layout asked for, else INT4_DEFAULT_GROUP)
    sym: bool = True

    def group(self) -> int:
        return INT4_DEFAULT_GROUP if self.group_size is None else self.group_size

    def resolved(self, layout) -> "Int4Options":
        """These options with the group size spelled out: the one named, else ``layout``'s (the
        layout a convert writes), so a manifest's ``quantizer`` always names it."""
        return self if self.group_size is not None else Int4Options(layout_group(layout), self.sym)

    def key(self) -> str:
        return f"{SCHEME}:{self.tag()}"

    def tag(self) -> str:
        g = self.group()
        return f"{'ch' if g == -1 else f'g{g}'}:{'sym' if self.sym else 'asym'}"

    def note(self) -> str:
        g = self.group()
        per = "per channel" if g == -1 else f"group {g}"
        return f"int4, {'symmetric' if self.sym else 'asymmetric'}, {per}, round to nearest"

    def layout(self, family: str, given=None):
        """The layout these options quantize into: the named group size's; with none named, the
        int4 layout ``given`` (the one asked for), else the default group's."""
        if self.group_size is None and given is not None:
            return given
        return int4_layout_for(self.group(), family)


def parse_options(words: tuple[str, ...]) -> Int4Options:
    """``("g64", "asym")`` -> Int4Options; each word once: ``g<N>`` / ``ch`` (or ``g-1``) for the
    group size, ``sym`` / ``asym``."""
    group, sym = None, None
    sizes = group_sizes()
    for w in words:
        if w in ("sym", "asym"):
            if sym is not None:
                raise ConvertError(f"--quantize int4 option {w!r}: symmetry given twice (sym or asym, once)")
            sym = w == "sym"
            continue
        g = -1 if w in ("ch", "g-1") else int(w[1:]) if w[:1] == "g" and w[1:].isdigit() else None
        if g is None:
            raise ConvertError(f"--quantize int4 option {w!r}: options are g<N> (group size: "
                               f"{', '.join(f'g{x}' for x in sizes if x > 0)}), ch (per channel), sym or asym")  # fmt: skip
        if group is not None:
            raise ConvertError(f"--quantize int4 option {w!r}: the group size is given twice")
        if g not in sizes:
            raise ConvertError(f"--quantize int4 group size {g}: moepack has int4 layouts for group sizes "
                               f"{', '.join(str(x) for x in sizes)} (-1 = per channel)")  # fmt: skip
        group = g
    return Int4Options(group, True if sym is None else sym)


class Int4Layer(QuantizedLayer):
    """One layer's experts into an int4_group layout (QuantizedLayer: codes stream, scales, zero
    points and the act-order w13_perm are gathered); the gathered w13_perm is checked whole."""

    def finish(self, name, t):
        if name == "w13_perm":  # gathered expert by expert from the source: checked whole here
            return check_w13_perm(f"layer {self.spec.index} w13_perm", t, self.spec.num_experts, self.spec.hidden)
        return t


_QUANT = QuantSpec(
    name=SCHEME,
    short="int4",
    canonical=("w13_q", "w13_scale", "w13_zero", "w2_q", "w2_scale", "w2_zero"),
    quantize=lambda w, g, opts: dict(zip(("q", "scale", "zero"), quantize_int4_group(w, g, sym=opts.sym if opts else True))),
    dequantize=lambda d, g: dequantize_int4_group(d["q"], d["scale"], d["zero"], g),
    pack_weight=pack_int4_weight,
    stored="int4 codes, scales and zero points",
    reader_note=False,
    quantizer="quantize_int4_group",
    quantizer_rule="round to nearest",
    tol=INT4_TOL,
    flips=INT4_FLIPS,
    fp32_tol=INT4_FROM_FLOAT_TOL,
    grouped=True,
    facts=Int4Facts,
    layout_for=int4_layout_for,
)


def layer_has_perm(spec, shared: bool = False) -> bool:
    """Whether a layer's routed (or ``shared``) experts carry a w13_perm: an int4 source with
    act-order (its reader gives every expert's permutation; Int4Facts.act_order)."""
    f = _QUANT.layer_facts(spec, shared)
    return f is not None and f.act_order


def default_act_mode(spec) -> str:
    """A layer's default activation mode (the manifest's ``act_mode``): a8 for a compressed-tensors
    W4A8 checkpoint (input activations dynamic per-token int8, what the a8 mode computes), else
    a16, the checkpoint's own meaning."""
    f = _QUANT.layer_facts(spec)
    return "a8" if f is not None and f.a8_activations else "a16"


def _dequantize(c: dict):
    """fp32 (w13, w2) in the checkpoint's own input-channel order (act-order undone)."""
    w13, w2 = _QUANT.dequantize_canonical(c)
    return unpermute_w13(w13, c.get("w13_perm")), w2


INT4_GROUP = quantized_scheme(
    _QUANT,
    aliases=("int4",),
    summary="4-bit codes + fp32 scale and zero point per (K group, channel); W4A16 (default) or W4A8",
    pack=pack_experts_int4,
    reference=moe_reference_int4,
    layer_packer=Int4Layer,
    default_layout="u4g128_n32k8_x86",
    layer_perm=layer_has_perm,
    layer_act_mode=default_act_mode,
    parse_options=parse_options,
    dequantize=_dequantize,
    weights_note="int4 codes",
)

__all__ = ["INT4_GROUP", "Int4Options", "Int4Facts", "Int4Layer", "layout_group", "group_sizes", "layer_has_perm",
           "default_act_mode", "quantize_int4_group", "dequantize_int4_group", "pack_experts_int4", "pack_int4_weight",
           "pack_u4_codes", "moe_reference_int4"]  # fmt: skip
