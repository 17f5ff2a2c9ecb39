"""The base of the quantized schemes: their layer packer and their ``Scheme`` built from data.

A quantized scheme declares its facts once (``QuantSpec``: what it stores, the functions of ONE
weight that quantize, dequantize and pack it, its tolerances, its words); ``quantized_scheme``
makes the ``Scheme`` from them: the rule and note strings, the output rule, the bench notes, the
source layout, ``from_float`` / ``dequantize`` / ``reference`` and the layer packer. A scheme's
``__init__.py`` then holds what is its own (options, constants) and one ``QuantSpec``.

What they share: the codes of w13 / w2 stream out one expert at a time while each expert's
other packed tensors (scales, zero points, column sums, the act-order permutation) are gathered
into the layer's tensors, which the plan writes right after their codes; a source of the scheme
gives its own canonical tensors (never re-quantized), a float source is quantized with the
convert's options and its quantization error is summed into ``LayerSource.error``; the shared
expert is packed as a one-expert set the same way. A scheme supplies three functions of ONE
weight: quantize, dequantize (for the error) and pack.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ConvertError, LayoutError, UnsupportedError
from ..layout import LAYOUTS, layout_tensor_plan
from ..pack.registry import get_scheme
from .base import BenchInfo, LayerPacker, OutputRule, Scheme, register


class QuantizedLayer(LayerPacker):
    """Subclasses define ``quantize_weight(w) -> {"q": ..., "scale": ..., ...}`` (one float weight
    ``[1, N, K]`` -> its canonical tensors, unprefixed), ``dequantize_weight(d) -> fp32`` and
    ``pack_weight(role, canonical, interleaved) -> {stored name: packed tensor}`` (one expert);
    optionally ``finish(name, tensor)`` for a gathered tensor before it is written."""

    def __init__(self, src):
        super().__init__(src)
        s = self.spec
        self.scheme = get_scheme(self.layout)
        # every per-expert tensor other than the codes and the biases, filled as the codes stream
        plan = layout_tensor_plan(self.layout, s.num_experts, s.hidden, s.intermediate, perm=self.scheme.has_perm(s))
        self.gathered = {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in plan if t.role not in ("codes", "bias")}

    # -- the scheme's part (its QuantSpec's functions of one weight, by default) ----------------
    def quantize_weight(self, w: torch.Tensor) -> dict:
        return self.scheme.quant.quantize(w, layout_group(self.layout), self.src.options)

    def dequantize_weight(self, d: dict) -> torch.Tensor:
        return self.scheme.quant.dequantize(d, layout_group(self.layout))

    def pack_weight(self, role: str, c: dict, interleaved: bool) -> dict:
        q = self.scheme.quant
        return q.pack_weight(role, *(c[f"{role}_{k}"] for k in q.parts()), interleaved=interleaved, layout=self.layout)

    def finish(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t

    # -- shared -----------------------------------------------------------------------------
    def _quantized(self, w: torch.Tensor, role: str, where: str, e: int) -> dict:
        """Quantize float ``w`` [1, N, K] (a non-finite value is named in the SOURCE by ``checked``)
        and add its error to the convert's; -> canonical tensors prefixed with ``role``."""
        src = self.src
        d = src.checked(self.quantize_weight, w, where, e)
        if src.error is not None:
            src.error.add(self.spec.index, w, self.dequantize_weight(d))
        return {f"{role}_{k}": v for k, v in d.items()}

    def canonical(self, role: str, e: int) -> dict:
        """Expert ``e``'s canonical tensors of ``role`` ("w13" / "w2"), one-expert [1, ...]."""
        src, r, s = self.src, self.src.reader, self.spec
        if self.scheme.keeps_source(r):
            return {k: v[None] for k, v in r.read_expert_canonical(src.ckpt, s, role, e).items()}
        w = (r.read_expert_w13 if role == "w13" else r.read_expert_w2)(src.ckpt, s, e)
        return self._quantized(w[None], role, role, e)

    def parts(self, name: str):
        s, g = self.spec, self.gathered
        if name in g:  # gathered while the codes streamed (plan order: after them)
            yield self.finish(name, g[name])
            return
        if name not in ("w13", "w2"):
            yield from self.bias_parts(name)
            return
        for e in range(s.num_experts):
            c = self.scheme.complete(self.canonical(name, e), self.layout)
            one = self.pack_weight(name, c, s.interleaved)
            for k, t in g.items():
                if k in one:
                    t[e] = one[k][0]
                elif k in c and k.startswith(name):  # stored as the source gives it (w13_perm)
                    t[e] = c[k].reshape(t[e].shape)
            yield one[name]

    def shared(self):
        """The shared expert packed as one-expert PackedExperts: the source's own canonical
        tensors of this scheme, or its float weights quantized."""
        src, r, s = self.src, self.src.reader, self.spec
        if not s.shared:
            return None
        c = r.read_shared_canonical(src.ckpt, s) if self.scheme.keeps_source(r) else None
        if c is None:
            sw13, sw2 = r.read_shared(src.ckpt, s)
            c = {**self._quantized(sw13, "w13", "shared_w13", 0), **self._quantized(sw2, "w2", "shared_w2", 0)}
        return self.scheme.pack(self.scheme.complete(c, self.layout), interleaved=False, layout=self.layout)




def grouped_source_layout(specs: list, layout, facts, layout_for, what: str, describe=lambda f: ""):
    """The layout a grouped scheme's source packs into (int4, fp8): the scheme's layout of the
    source's own group size, never re-grouped. ``facts(spec)`` is a layer's scheme facts (None:
    not of the scheme), with ``group_size`` and ``shared`` (the shared expert's facts or None);
    every MoE layer and quantized shared expert must have the same group size (one layout per
    directory), and ``layout_for(group_size, family)`` must know it (its LayoutError becomes a
    ConvertError naming where the size came from). ``describe(f)``: words added to a place."""
    sizes = {}
    for s in specs:
        f = facts(s)
        if f is None:
            continue
        sizes.setdefault(f.group_size, f"layer {s.index} ({s.prefix}{describe(f)})")
        if f.shared is not None:
            sizes.setdefault(f.shared.group_size, f"layer {s.index}'s shared expert{describe(f.shared)}")
    if not sizes:
        return layout
    if len(sizes) != 1:
        listed = "; ".join(f"group_size={g} in {where}" for g, where in sizes.items())
        raise ConvertError(f"{what} source with several group sizes ({listed}): moepack packs one {what} layout per directory")
    (g,) = sizes
    try:
        return layout_for(g, layout.family)
    except LayoutError as e:
        raise ConvertError(f"{sizes[g]}: {e}") from None


def layout_group(layout) -> int:
    """The canonical K group size of a grouped layout (-1: one group per output channel)."""
    return layout.group_size or -1


def fixed_group_layout_for(scheme: str, group: int, standard: str):
    """``layout_for(group_size, family)`` of a scheme whose group is fixed by its standard
    (mxfp4: 32, OCP MX; nvfp4: 16): the scheme's layout of the family, any other size refused."""

    def layout_for(group_size: int, family: str = "x86"):
        if group_size != group:
            raise ConvertError(f"{scheme} group size {group_size}: {standard} (and moepack's {scheme} layouts) group "
                               f"{group} K values per scale")  # fmt: skip
        for x in LAYOUTS:
            if x.scheme == scheme and x.family == family:
                return x
        raise ConvertError(f"scheme {scheme}: this build has no layout for the {family} family")

    layout_for.__doc__ = f"The {scheme} layout of an ISA family; ``group_size`` must be {group} ({standard})."
    return layout_for


_FLOAT = ("", "F32", "BF16", "F16")  # a float source's dtypes (the quantized schemes' "from float")


@dataclass(frozen=True)
class QuantSpec:
    """The facts of a quantized scheme, from which ``quantized_scheme`` builds its ``Scheme``.

    Values: ``quantize(w [E, N, K] float, group or -1, options or None) -> {part: tensor}`` (the
    parts are the canonical names without ``w13_`` / ``w2_``: "q", "scale", ...),
    ``dequantize({part: tensor}, group) -> fp32`` and ``pack_weight(role, *parts in canonical
    order, interleaved=, layout=) -> {stored name: packed}``; ``grouped``: the canonical set
    carries ``group_size`` (the layout's), checked against the options' group. Words: ``stored``
    names what a source of the scheme holds ("e4m3fn codes and scales"), ``quantizer`` the
    function that quantizes a float source and ``quantizer_rule`` its rule in words; ``float_note``
    the manifest's words for a float source when the scheme has no options (else the options'
    ``note()``); ``reader_note``: a reader's own ``weights_note`` wins over ``stored``.
    Checks: ``tol`` / ``flips`` against the scheme's reference on the same codes, ``fp32_tol``
    (a float source quantized by moepack, against the source's weights) and ``own_fp32_tol``
    (a source of the scheme, against its exact dequantization; None: not judged).
    ``stored_dtypes``: the source dtypes that are the scheme's own values (None: any non-float).
    Sources: ``facts`` (the ``LayerSpec.quant`` class of the scheme's reader), ``layout_for``
    (group, family) and ``describe(facts)`` (words for a place in a refusal). Bench:
    ``bench_counts`` (what GB/s counts), ``bench_label`` (the torch loop's quantization), or
    ``bench_lead(kernel isa, instruction)`` for a first note of the scheme's own."""

    name: str
    short: str  # the name in the user's words ("fp8", "int4")
    canonical: tuple[str, ...]
    quantize: Callable
    dequantize: Callable
    pack_weight: Callable
    stored: str
    quantizer: str
    tol: float
    quantizer_rule: str = ""
    float_note: str = ""
    reader_note: bool = True
    flips: float = 0.0
    fp32_tol: float | None = None
    own_fp32_tol: float | None = None
    stored_dtypes: tuple | None = None
    grouped: bool = False
    facts: type | None = None
    layout_for: Callable | None = None
    describe: Callable = lambda f: ""
    bench_counts: str | None = None
    bench_label: str | None = None
    bench_lead: Callable | None = None
    check_tol: float = 0.08

    def parts(self) -> tuple[str, ...]:
        return tuple(n[len("w13_"):] for n in self.canonical if n.startswith("w13_"))

    def own(self, source_dtype: str) -> bool:
        """A source of this dtype holds the scheme's own values (else it is float, quantized here)."""
        return source_dtype in self.stored_dtypes if self.stored_dtypes is not None else source_dtype not in _FLOAT

    # -- what a Scheme asks, made from the facts ----------------------------------------------
    def rule(self, source_dtype: str, reader: str) -> str:
        if self.own(source_dtype):
            return f"the source's own {self.stored}"
        return f"{self.quantizer} of the source" + (f" ({self.quantizer_rule})" if self.quantizer_rule else "")

    def source_note(self, parse_options, source_dtype: str, reader, options=None) -> str:
        if self.own(source_dtype):
            return (self.reader_note and getattr(reader, "weights_note", None)) or f"{self.stored} of {reader.name}"
        note = (options or parse_options(())).note() if parse_options is not None else self.float_note
        return f"quantized by moepack from {source_dtype}" + (f" ({note})" if note else "")

    def output_rule(self, source_dtypes: set) -> OutputRule:
        floats = source_dtypes <= set(_FLOAT)  # quantized by moepack: its error against the float source is judged
        return OutputRule(base=self.tol, flips=self.flips, fp32_tol=self.fp32_tol if floats else self.own_fp32_tol)

    def bench_notes(self, kernel_isa: str, instruction: str | None, torch_loop: bool) -> list[str]:
        notes = []
        if self.bench_lead is not None:
            notes.append(self.bench_lead(kernel_isa, instruction))
        elif self.bench_counts:
            notes.append(f"--scheme {self.name}: GB/s counts {self.bench_counts}; the kernel runs at {kernel_isa}"
                         + (f" (this build has no SIMD {self.short} kernel for the host)" if kernel_isa == "scalar" else ""))  # fmt: skip
        if torch_loop and self.bench_label:
            notes.append(f"--scheme {self.name}: the torch loop runs the bf16 weights (the check column includes the "
                         f"{self.bench_label} quantization error)")  # fmt: skip
        return notes

    def layer_facts(self, spec, shared: bool = False):
        """A layer's facts of this scheme (its reader's ``LayerSpec.quant``), or None."""
        f = getattr(spec, "quant", None)
        if self.facts is None or not isinstance(f, self.facts):
            return None
        return f.shared if shared else f

    def source_layout(self, specs: list, layout):
        """A source of the scheme packs into the scheme's layout of its own group size (never
        re-quantized, never re-grouped)."""
        return grouped_source_layout(specs, layout, self.layer_facts, self.layout_for, self.short, self.describe)

    def group(self, layout, options) -> int | None:
        """The K group a float weight is quantized at: the layout's, which the options must agree with."""
        if not self.grouped:
            return None
        if layout is None:
            return options.group() if options is not None else None
        g = layout_group(layout)
        named = getattr(options, "group_size", None)
        if named is not None and g != named:
            raise UnsupportedError(f"{self.short} group size {named} with layout {layout.name} (group size {g}): "
                                   "the options and the layout must agree")  # fmt: skip
        return g

    def from_float(self, w13, w2, layout=None, options=None, *, default_options=None) -> dict:
        opts = options if options is not None else default_options
        g = self.group(layout, opts)
        c = {}
        for role, w in (("w13", w13), ("w2", w2)):
            c.update({f"{role}_{k}": v for k, v in self.quantize(w, g, opts).items()})
        if g is not None:
            c["group_size"] = g
        return c

    def dequantize_canonical(self, c: dict):
        g = int(c["group_size"]) if self.grouped else None
        return tuple(self.dequantize({k: c[f"{role}_{k}"] for k in self.parts()}, g) for role in ("w13", "w2"))


def quantized_scheme(q: QuantSpec, *, pack: Callable, reference: Callable, summary: str, aliases: tuple = (),
                     act_mode: str = "a16", layer_packer: type = QuantizedLayer, weights_note: str, **more) -> Scheme:
    """Register the ``Scheme`` of ``q`` (``more``: the ``Scheme`` fields the facts do not make,
    e.g. ``parse_options``, ``layer_perm``, or one that overrides a made one)."""
    parse = more.get("parse_options")
    made = dict(
        name=q.name, aliases=aliases, act_mode=act_mode, summary=summary, canonical=q.canonical, pack=pack,
        from_float=functools.partial(q.from_float, default_options=parse(()) if parse else None),
        dequantize=q.dequantize_canonical, reference=functools.partial(reference, return_flip=True),
        output_rule=q.output_rule, rule=q.rule, source_note=functools.partial(q.source_note, parse),
        layer_packer=layer_packer, weights_note=weights_note, quant=q,
        source_layout=q.source_layout if q.layout_for is not None else None,
        with_layout=(lambda c, layout: {**c, "group_size": c.get("group_size", layout_group(layout))}) if q.grouped else None,
        bench=BenchInfo(check_tol=q.check_tol, notes=q.bench_notes if (q.bench_counts or q.bench_lead or q.bench_label) else None),
    )  # fmt: skip
    made.update(more)
    return register(Scheme(**made))


__all__ = ["QuantizedLayer", "QuantSpec", "quantized_scheme", "layout_group", "fixed_group_layout_for", "grouped_source_layout"]
