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

from ...errors import ConvertError, LayoutError, UnsupportedError
from ...layout import LAYOUTS, int4_layout_for
from .. import BenchInfo, OutputRule, Scheme, register
from ..quantized import QuantizedLayer, grouped_source_layout
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


def layout_group(layout) -> int:
    """The canonical group size of an int4 layout (-1: per channel)."""
    return layout.group_size or -1


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
    points and the act-order w13_perm are gathered). A float source is quantized round to
    nearest at the layout's group size, symmetric unless the options say asym."""

    def _sym(self) -> bool:
        return self.src.options.sym if self.src.options is not None else True

    def quantize_weight(self, w):
        q, s, z = quantize_int4_group(w, layout_group(self.layout), sym=self._sym())
        return {"q": q, "scale": s, "zero": z}

    def dequantize_weight(self, d):
        return dequantize_int4_group(d["q"], d["scale"], d["zero"], layout_group(self.layout))

    def pack_weight(self, role, c, interleaved):
        return pack_int4_weight(role, c[f"{role}_q"], c[f"{role}_scale"], c[f"{role}_zero"], interleaved=interleaved,
                                layout=self.layout)  # fmt: skip

    def finish(self, name, t):
        if name == "w13_perm":  # gathered expert by expert from the source: checked whole here
            return check_w13_perm(f"layer {self.spec.index} w13_perm", t, self.spec.num_experts, self.spec.hidden)
        return t


def _facts(spec, shared: bool = False) -> Int4Facts | None:
    f = getattr(spec, "quant", None)
    if not isinstance(f, Int4Facts):
        return None
    return f.shared if shared else f


def layer_has_perm(spec, shared: bool = False) -> bool:
    """Whether a layer's routed (or ``shared``) experts carry a w13_perm: an int4 source with
    act-order (its reader gives every expert's permutation; Int4Facts.act_order)."""
    f = _facts(spec, shared)
    return f is not None and f.act_order


def default_act_mode(spec) -> str:
    """A layer's default activation mode (the manifest's ``act_mode``): a8 for a compressed-tensors
    W4A8 checkpoint (input activations dynamic per-token int8, what the a8 mode computes), else
    a16, the checkpoint's own meaning."""
    f = _facts(spec)
    return "a8" if f is not None and f.a8_activations else "a16"


def source_layout(specs: list, layout):
    """An int4 source packs into the int4 layout of its own group size (never re-grouped)."""
    return grouped_source_layout(specs, layout, _facts, int4_layout_for, "int4")


def _pack(c: dict, *, interleaved: bool, layout, use_cpp: bool = True):
    return pack_experts_int4(c, interleaved=interleaved, layout=layout, use_cpp=use_cpp)


def _from_float(w13, w2, layout=None, options: Int4Options | None = None) -> dict:
    opts = options or Int4Options()
    g = layout_group(layout) if layout is not None else opts.group()
    if opts.group_size is not None and layout is not None and g != opts.group_size:
        raise UnsupportedError(f"int4 group size {opts.group_size} with layout {layout.name} (group size {g}): "
                               "the options and the layout must agree")  # fmt: skip
    q13, s13, z13 = quantize_int4_group(w13, g, sym=opts.sym)
    q2, s2, z2 = quantize_int4_group(w2, g, sym=opts.sym)
    return {"w13_q": q13, "w13_scale": s13, "w13_zero": z13, "w2_q": q2, "w2_scale": s2, "w2_zero": z2, "group_size": g}


def _dequantize(c: dict):
    """fp32 (w13, w2) in the checkpoint's own input-channel order (act-order undone)."""
    g = int(c["group_size"])
    w13 = unpermute_w13(dequantize_int4_group(c["w13_q"], c["w13_scale"], c["w13_zero"], g), c.get("w13_perm"))
    return w13, dequantize_int4_group(c["w2_q"], c["w2_scale"], c["w2_zero"], g)


def _reference(x, c: dict, topk_weights, topk_ids, **kw):
    return moe_reference_int4(x, c, topk_weights, topk_ids, return_flip=True, **kw)


_FLOAT = ("", "F32", "BF16", "F16")


def _output_rule(source_dtypes: set) -> OutputRule:
    if source_dtypes <= set(_FLOAT):  # quantized by moepack: its error against the float source is judged too
        return OutputRule(base=INT4_TOL, flips=INT4_FLIPS, fp32_tol=INT4_FROM_FLOAT_TOL)
    return OutputRule(base=INT4_TOL, flips=INT4_FLIPS)


def _rule(source_dtype: str, reader: str) -> str:
    if source_dtype not in _FLOAT:
        return "the source's own int4 codes, scales and zero points"
    return "quantize_int4_group of the source (round to nearest)"


def _source_note(source_dtype: str, reader, options: Int4Options | None = None) -> str:
    if source_dtype not in _FLOAT:
        return f"int4 codes, scales and zero points of {reader.name}"
    return f"quantized by moepack from {source_dtype} ({(options or Int4Options()).note()})"


INT4_GROUP = register(
    Scheme(
        name=SCHEME,
        aliases=("int4",),
        act_mode="a16",
        summary="4-bit codes + fp32 scale and zero point per (K group, channel); W4A16 (default) or W4A8",
        canonical=("w13_q", "w13_scale", "w13_zero", "w2_q", "w2_scale", "w2_zero"),
        pack=_pack,
        from_float=_from_float,
        dequantize=_dequantize,
        reference=_reference,
        output_rule=_output_rule,
        rule=_rule,
        source_note=_source_note,
        layer_packer=Int4Layer,
        default_layout="u4g128_n32k8_x86",
        layer_perm=layer_has_perm,
        layer_act_mode=default_act_mode,
        parse_options=parse_options,
        source_layout=source_layout,
        with_layout=lambda c, layout: {**c, "group_size": c.get("group_size", layout_group(layout))},
        weights_note="int4 codes",
        bench=BenchInfo(check_tol=0.08),
    )
)

__all__ = ["INT4_GROUP", "Int4Options", "Int4Facts", "Int4Layer", "layout_group", "group_sizes", "layer_has_perm",
           "default_act_mode", "quantize_int4_group", "dequantize_int4_group", "pack_experts_int4", "pack_int4_weight",
           "pack_u4_codes", "moe_reference_int4"]  # fmt: skip
