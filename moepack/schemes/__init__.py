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
                    generic rule of that role (moepack.verify.values) is not enough
                    (fp8's codes never NaN, mxfp4's e8m0 scales never 255, ...)
``quant``           a quantized scheme's facts (``QuantSpec``, schemes/quantized.py), from
                    which ``quantized_scheme`` made its rule and note strings, output
                    rule, bench notes, source layout, from_float and layer packer
==================  ===============================================================

Each scheme is a package, moepack/schemes/<scheme>/: ``__init__.py`` (the ``Scheme`` and its
layer packer), ``quantize.py`` (its quantizer), ``pack.py`` (its spec packer, on
``moepack.pack.pack_codes``), ``reference.py`` (its torch oracle on the generic MoE machinery of
moepack/reference.py). Here: ``base.py`` (the types above, a leaf the scheme packages import),
``quantized.py`` (the quantized schemes' base: ``QuantSpec``, ``quantized_scheme`` and the layer
packer), and this file, which imports every scheme package so that each registers itself.

Adding a scheme: docs/CONTRIBUTING.md, "Adding a weight scheme".
"""

from __future__ import annotations

import importlib.util
import sys

from .. import layout as _layout
from ..errors import UnsupportedError
from .base import BenchInfo, LayerPacker, LayerSource, OutputRule, QuantError, Scheme, ValueRule, get_scheme, register, schemes


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


def _load_testonly_schemes() -> None:
    """The test-only schemes (moepack/layout.py ``add_testonly_schemes``): each folder's scheme.py,
    loaded by path, registers itself; only when MOEPACK_TEST_SCHEMES=1 made layout.py add them."""
    for name, folder in _layout.add_testonly_schemes().items() if _layout.schemes_for_tests_enabled() else ():
        mod_name = f"moepack.schemes._testonly_{name}"
        spec = importlib.util.spec_from_file_location(mod_name, folder / "scheme.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)


_load_testonly_schemes()

__all__ = ["Scheme", "ValueRule", "float_scheme", "OutputRule", "BenchInfo", "LayerSource", "LayerPacker", "QuantError", "get_scheme", "register",
           "schemes"]  # fmt: skip
