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
==================  ===============================================================

Adding a scheme: docs/CONTRIBUTING.md, "Adding a weight scheme".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import UnsupportedError
from ..layout import LAYOUTS, PackedLayout, layout_get


@dataclass(frozen=True)
class OutputRule:
    """verify's output check: ``rel(out, reference) <= max(base, flips * flip / ||ref||)``, and,
    when ``fp32_tol`` is set, ``rel(out, fp32 reference on the dequantized weights) <= fp32_tol``."""

    base: float
    flips: float = 0.0
    fp32_tol: float | None = None


@dataclass(frozen=True)
class Scheme:
    name: str
    aliases: tuple[str, ...]
    act_mode: str
    summary: str
    canonical: tuple[str, ...]
    pack: Callable  # (canonical: dict, *, interleaved, layout, use_cpp=True) -> PackedExperts
    from_float: Callable  # (w13, w2, layout=None) -> canonical dict (without biases), for that layout
    dequantize: Callable  # canonical dict -> (w13, w2) fp32 canonical weights
    reference: Callable  # (x, canonical, topk_weights, topk_ids, **kw) -> (out, flip)
    output_rule: Callable  # (source dtypes: set[str]) -> OutputRule
    rule: Callable  # (source dtype str, reader name) -> str
    source_note: Callable  # (source dtype str, reader name) -> str
    layer_packer: Callable  # (LayerSource) -> LayerPacker
    default_layout: str | None = None  # the layout layout_for picks (None: the scheme's first of the family)
    layer_perm: Callable | None = None  # (LayerSpec, shared: bool) -> bool: the layer carries a w13_perm
    layer_act_mode: Callable | None = None  # LayerSpec -> "a16" | "a8": the layer's default act mode

    def has_perm(self, spec, shared: bool = False) -> bool:
        return bool(self.layer_perm and self.layer_perm(spec, shared))

    def default_act_mode(self, spec, layout: PackedLayout) -> str:
        """The act mode convert records for a layer of ``spec`` packed into ``layout``."""
        mode = self.layer_act_mode(spec) if self.layer_act_mode else self.act_mode
        return mode if mode in layout.act_modes else layout.act_modes[0]

    def layouts(self, family: str | None = None) -> list[PackedLayout]:
        """This build's layouts of the scheme (of one ISA family), in table order."""
        return [x for x in LAYOUTS if x.scheme == self.name and (family is None or x.family == family)]

    def layout_for(self, family: str) -> PackedLayout:
        cands = self.layouts(family)
        if not cands:
            raise UnsupportedError(f"scheme {self.name}: this build has no layout for the {family} family")
        return next((x for x in cands if x.name == self.default_layout), cands[0])


@dataclass
class LayerSource:
    """What a scheme's layer packer reads from: one MoE layer of an open source checkpoint, the
    layout it packs into, and ``checked(pack, tensor, role, expert)``, which runs a packer and
    names the SOURCE tensor and element of a non-finite value it refuses (convert_dir)."""

    ckpt: object
    reader: object
    spec: object  # sources.LayerSpec
    layout: PackedLayout
    checked: Callable


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
        from ..pack import pack_bias2, pack_bias13

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


_REGISTRY: dict[str, Scheme] = {}


def register(s: Scheme) -> Scheme:
    for key in (s.name, *s.aliases):
        if key in _REGISTRY:
            raise ValueError(f"scheme name {key!r} registered twice")
        _REGISTRY[key] = s
    return s


def get_scheme(key: "str | PackedLayout | int") -> Scheme:
    """A scheme by name or alias, or the scheme of a layout (object, id or name)."""
    if isinstance(key, str) and key in _REGISTRY:
        return _REGISTRY[key]
    if not isinstance(key, str) or any(key == x.name for x in LAYOUTS):
        lay = layout_get(key)
        if lay.scheme not in _REGISTRY:
            raise UnsupportedError(f"layout {lay.name} has scheme {lay.scheme!r}, which this moepack has no module for")
        return _REGISTRY[lay.scheme]
    known = ", ".join(sorted({s.name for s in _REGISTRY.values()}))
    raise UnsupportedError(f"scheme {key!r} is unknown; known schemes: {known} (aliases: "
                           + ", ".join(sorted(k for k, s in _REGISTRY.items() if k != s.name)) + ")")


def schemes() -> list[Scheme]:
    """Every registered scheme once, in registration order."""
    seen: dict[str, Scheme] = {}
    for s in _REGISTRY.values():
        seen.setdefault(s.name, s)
    return list(seen.values())


# The scheme modules register themselves on import.
from . import dense, int8, int4  # noqa: E402,F401

__all__ = ["Scheme", "OutputRule", "LayerSource", "LayerPacker", "get_scheme", "register", "schemes"]
