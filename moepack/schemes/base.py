"""The types every scheme is made of (moepack.schemes' ``Scheme`` and what it holds), in a leaf
under the scheme packages: they import it, and moepack/schemes/__init__.py imports them, so the
package's imports run one way (no cycle through a half-initialised package)."""


from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import UnsupportedError
from ..layout import LAYOUTS, PackedLayout
from ..pack import pack_bias2, pack_bias13
from ..pack.registry import get_scheme, register, schemes


@dataclass(frozen=True)
class OutputRule:
    """verify's output check: ``rel(out, reference) <= max(base, flips * flip / ||ref||)``, and,
    when ``fp32_tol`` is set, ``rel(out, fp32 reference on the dequantized weights) <= fp32_tol``."""

    base: float
    flips: float = 0.0
    fp32_tol: float | None = None


@dataclass(frozen=True)
class ValueRule:
    """A rule the values of one packed tensor role must keep (docs/PACKED_FORMAT.md §4 "Value
    rules"; checked by moepack.verify.values): ``bad(t)`` -> the mask of the elements that break it,
    ``text(first bad value)`` -> the rule in words, ``fast_ok(t)`` -> True when it surely holds
    (reductions only, no temporary tensor). ``key`` names the rule (unique across schemes);
    ``on_open``: ``moepack.open`` checks it too (a small per-group tensor); ``hex``: a bad value is
    named in hex (byte codes); ``streamed``: a large tensor checked piece by piece while hashed."""

    key: str
    bad: Callable
    text: Callable
    fast_ok: Callable
    on_open: bool = False
    hex: bool = False
    streamed: bool = False


@dataclass(frozen=True)
class Scheme:
    name: str
    aliases: tuple[str, ...]
    act_mode: str
    summary: str
    canonical: tuple[str, ...]
    pack: Callable  # (canonical: dict, *, interleaved, layout, use_cpp=True) -> PackedExperts
    from_float: Callable  # (w13, w2, layout=None, options=None) -> canonical dict (without biases), for that layout
    dequantize: Callable  # canonical dict -> (w13, w2) fp32 canonical weights
    reference: Callable  # (x, canonical, topk_weights, topk_ids, **kw) -> (out, flip)
    output_rule: Callable  # (source dtypes: set[str]) -> OutputRule
    rule: Callable  # (source dtype str, reader name) -> str
    source_note: Callable  # (source dtype str, SourceReader, options or None) -> str
    layer_packer: Callable  # (LayerSource) -> LayerPacker
    default_layout: str | None = None  # the layout layout_for picks (None: the scheme's first of the family)
    layer_perm: Callable | None = None  # (LayerSpec, shared: bool) -> bool: the layer carries a w13_perm
    layer_act_mode: Callable | None = None  # LayerSpec -> "a16" | "a8": the layer's default act mode
    quantized: bool = True  # False: the float values themselves (dense)
    parse_options: Callable | None = None  # (words: tuple[str, ...]) -> options object (key(), note()); None: no options
    source_layout: Callable | None = None  # (specs, layout) -> the layout a source of this scheme packs into
    with_layout: Callable | None = None  # (canonical, layout) -> canonical completed from the layout
    weights_note: str = "codes"  # verify: what the packed weights are compared as ("bf16", "int8 codes")
    bench: "BenchInfo" = field(default_factory=lambda: BenchInfo())
    exports: tuple = ()  # functions older moepack versions exported from moepack.pack
    value_rules: dict = field(default_factory=dict)  # layout role -> ValueRule replacing the generic rule of that role
    quant: object = None  # a quantized scheme's QuantSpec (schemes/quantized.py), which made most of the above

    def has_perm(self, spec, shared: bool = False) -> bool:
        return bool(self.layer_perm and self.layer_perm(spec, shared))

    def default_act_mode(self, spec, layout: PackedLayout) -> str:
        """The act mode convert records for a layer of ``spec`` packed into ``layout``."""
        mode = self.layer_act_mode(spec) if self.layer_act_mode else self.act_mode
        return mode if mode in layout.act_modes else layout.act_modes[0]

    def options(self, words: tuple[str, ...] = ()):
        """The quantizer options ``words`` name (``--quantize int4:g64:asym`` -> ("g64", "asym")),
        checked; the defaults for ``()``. None for a scheme without options; words for such a
        scheme are refused naming the scheme and the word."""
        if self.parse_options is not None:
            return self.parse_options(tuple(words))
        if words:
            raise UnsupportedError(f"--quantize {self.name}:{':'.join(words)}: scheme {self.name} takes no options "
                                   f"(got {words[0]!r})")  # fmt: skip
        return None

    def keeps_source(self, reader) -> bool:
        """A source read by ``reader`` is packed with its own canonical tensors of this scheme
        (never re-quantized), rather than quantized or rounded from float."""
        return self.quantized and reader.scheme == self.name

    def complete(self, canonical: dict, layout: PackedLayout) -> dict:
        """``canonical`` with what ``layout`` implies added (``with_layout``)."""
        return self.with_layout(canonical, layout) if self.with_layout else canonical

    def layouts(self, family: str | None = None) -> list[PackedLayout]:
        """This build's layouts of the scheme (of one ISA family), in table order."""
        return [x for x in LAYOUTS if x.scheme == self.name and (family is None or x.family == family)]

    def layout_for(self, family: str) -> PackedLayout:
        cands = self.layouts(family)
        if not cands:
            raise UnsupportedError(f"scheme {self.name}: this build has no layout for the {family} family")
        return next((x for x in cands if x.name == self.default_layout), cands[0])


@dataclass(frozen=True)
class BenchInfo:
    """What ``moepack bench`` says of a scheme: the largest relative error of its packed experts
    against the torch loop on the float weights that still passes the check column (a quantized
    scheme's includes its quantization error), and ``notes(kernel isa, its dot-product
    instruction or None, whether the torch loop ran) -> [str]``, printed under the table."""

    check_tol: float = 0.08
    notes: Callable | None = None


@dataclass
class LayerSource:
    """What a scheme's layer packer reads from: one MoE layer of an open source checkpoint, the
    layout it packs into, ``checked(pack, tensor, role, expert)``, which runs a packer and names
    the SOURCE tensor and element of a non-finite value it refuses (convert/run.py), the quantizer
    options (``Scheme.options``; None: the scheme's defaults) and ``error``, a ``QuantError`` the
    packer adds each quantized weight's error to (convert's summary)."""

    ckpt: object
    reader: object
    spec: object  # sources.LayerSpec
    layout: PackedLayout
    checked: Callable
    options: object = None
    error: "QuantError | None" = None


@dataclass
class QuantError:
    """The quantization error of the weights a convert quantized from float, summed over every
    quantized weight: ``rel = ||dequant(q) - w|| / ||w||`` (Frobenius, fp64 sums), overall and
    the worst single layer."""

    err2: float = 0.0
    ref2: float = 0.0
    layers: dict = field(default_factory=dict)  # layer index -> [err2, ref2]

    def add(self, layer: int, w, deq) -> None:
        d = (deq.double() - w.double()).pow(2).sum().item()
        r = w.double().pow(2).sum().item()
        self.err2 += d
        self.ref2 += r
        acc = self.layers.setdefault(layer, [0.0, 0.0])
        acc[0] += d
        acc[1] += r

    @property
    def rel(self) -> float | None:
        return None if not self.ref2 else (self.err2 / self.ref2) ** 0.5

    def worst(self) -> tuple[int, float] | None:
        """(layer index, its relative error) of the layer quantized worst, or None."""
        per = {i: (d / r) ** 0.5 for i, (d, r) in self.layers.items() if r}
        return max(per.items(), key=lambda x: x[1]) if per else None


class LayerPacker:
    """Streams one layer's packed tensors (convert's per-scheme stage). ``parts(name)`` yields
    the tensor named ``name`` of layout_tensor_plan (w13, w13_scale, ..., w2_bias) in pieces
    along dim 0 (one expert at a time for the big ones), called in plan order; ``shared()``
    gives the layer's shared expert packed as a one-expert set, or None."""

    def __init__(self, src: LayerSource):
        self.src = src
        self.spec = src.spec
        self.layout = src.layout
        self._biases = None

    def parts(self, name: str):
        raise NotImplementedError

    def shared(self):
        return None

    def bias_parts(self, name: str):
        """The fp32 biases in packed row order (every scheme stores them alike)."""
        s, lay = self.spec, self.layout
        if self._biases is None:
            self._biases = self.src.reader.read_biases(self.src.ckpt, s)
        b13, b2 = self._biases
        if name == "w13_bias":
            yield self.src.checked(lambda t: pack_bias13(t, interleaved=s.interleaved, layout=lay), b13, "w13_bias", 0)
        elif name == "w2_bias":
            yield self.src.checked(lambda t: pack_bias2(t, layout=lay), b2, "w2_bias", 0)
        else:
            raise KeyError(f"layer {s.index}: no tensor {name!r} in layout {lay.name}'s plan")


__all__ = ["Scheme", "ValueRule", "OutputRule", "BenchInfo", "LayerSource", "LayerPacker", "QuantError", "get_scheme", "register",
           "schemes"]  # fmt: skip
