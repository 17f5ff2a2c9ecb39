"""The weight schemes (docs/SEMANTICS.md §3), one module each, looked up by name or layout.

A scheme says what a packed weight *means*; a layout (moepack/layout.py) says how its tensors
are arranged. Everything that differs between schemes lives in the scheme's module, so convert,
verify, the runtime, bench and the CLI look the scheme up instead of branching on it:

==================  ===============================================================
``name``            the one spelling used by the CLI, the manifest, the API and docs
``aliases``         older spellings still accepted on input (CLI ``--quantize int8``)
``act_mode``        "a16" (activations in their own dtype) or "a8" (per-token int8)
``canonical``       the canonical tensors of one layer the scheme packs from (besides
                    the optional biases), e.g. ("w13", "w2") or ("w13_q", ...)
``pack``            canonical dict -> ``PackedExperts`` (``use_cpp=False``: the Python
                    spec packer, which verify uses to recompute what a file must hold)
``from_float``      float w13/w2 (+ the target layout) -> canonical dict (dense: as
                    is; int8 / int4: quantized, int4 at the layout's group size)
``reference``       the pure-torch oracle on the canonical tensors: ``(out, flip)``
``output_rule``     how verify judges the kernel's output against ``reference``
``rule``            words for messages: where the packed values come from
``source_note``     the manifest's ``scheme_source``: what the values were made from
``layer_packer``    convert's streaming stage: one layer of a source -> the packed
                    tensors in plan order, one expert at a time (LayerPacker)
``layer_perm``      (LayerSpec, shared) -> whether the layer's routed / shared experts
                    carry a ``w13_perm`` (int4 act-order); None: never
``layer_act_mode``  LayerSpec -> the layer's default activation mode (the manifest's
                    ``act_mode``); None: ``act_mode``
``quantized``       its codes are not the float values: pack_experts quantizes float
                    weights into it, convert keeps a source of it as it is (never
                    re-quantized) and ``--quantize`` may name it
``options``         the quantizer's options: ``parse_options(words)`` -> a frozen
                    options object (``key``: convert's resume key; ``note``: words);
                    None: the scheme has no options
``source_layout``   (specs, layout) -> the layout a source of this scheme packs into
                    (int4: the layout of the source's group size); None: ``layout``
``with_layout``     (canonical, layout) -> the canonical tensors completed with what
                    the layout implies (int4: ``group_size``); None: as they are
``weights_note``    verify's words for what its packed weights are compared as
``bench``           ``BenchInfo``: the benchmark's check tolerance and notes
``exports``         functions older moepack versions had in moepack.pack (resolved by
                    name through the registry: moepack.pack never imports a scheme)
``value_rules``     layout role -> the ``ValueRule`` its packed values keep where the
                    generic rule of that role (moepack.verify_values) is not enough
                    (fp8's codes never NaN, mxfp4's e8m0 scales never 255, ...)
``quant``           a quantized scheme's facts (``QuantSpec``, schemes/quantized.py), from
                    which ``quantized_scheme`` made its rule and note strings, output
                    rule, bench notes, source layout, from_float and layer packer
==================  ===============================================================

Each scheme is a package, moepack/schemes/<scheme>/: ``__init__.py`` (the ``Scheme`` and its
layer packer), ``quantize.py`` (its quantizer), ``pack.py`` (its spec packer, on
``moepack.pack.pack_codes``), ``reference.py`` (its torch oracle on the generic MoE machinery of
moepack/reference.py). ``quantized.py`` here is the base of the quantized schemes' layer packers.

Adding a scheme: docs/CONTRIBUTING.md, "Adding a weight scheme".
"""

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
    rules"; checked by moepack.verify_values): ``bad(t)`` -> the mask of the elements that break it,
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
    the SOURCE tensor and element of a non-finite value it refuses (convert_dir), the quantizer
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


def float_scheme() -> Scheme:
    """The scheme whose packed values are the float weights themselves (``quantized`` False):
    where convert keeps a float weight float (a float source, a quantized checkpoint's float
    shared expert), generic code asks for it here instead of naming it."""
    found = [x for x in schemes() if not x.quantized]
    if len(found) != 1:
        raise UnsupportedError(f"this build has {len(found)} float schemes ({', '.join(x.name for x in found)}): exactly one is expected")
    return found[0]


# The scheme modules register themselves on import.
from . import dense, int8, int4, fp8, mxfp4, nvfp4  # noqa: E402,F401

__all__ = ["Scheme", "ValueRule", "float_scheme", "OutputRule", "BenchInfo", "LayerSource", "LayerPacker", "QuantError", "get_scheme", "register",
           "schemes"]  # fmt: skip
