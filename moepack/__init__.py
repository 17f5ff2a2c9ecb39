"""moepack: Mixture-of-Experts layers on CPUs, from packed checkpoints.

Importing moepack is cheap: the native extension is loaded on first use.

    import moepack
    packed = moepack.pack_experts(w13, w2)                  # canonical -> packed layout
    out = moepack.fused_experts(x, packed.w13, packed.w2, topk_weights, topk_ids)
    moepack.kernel_choice()                                 # ('avx2', 'why', False): isa, reason, is_fallback
"""

from ._ops import cpu_flags, fused_experts, kernel_choice, load_extension, pack_weight
from .errors import ExtensionError, LayoutError, MoepackError, UnsupportedError
from .layout import DEFAULT_LAYOUT, LAYOUTS, PackedLayout, layout_get
from .pack import PackedExperts, pack_experts
from . import schemes as _schemes  # noqa: F401,E402 - registers the weight schemes, which moepack.pack looks up
from .runtime import open_packed, run_experts

from ._version import __version__

# moepack.convert(src, dst, ...) and moepack.verify(dst, ...): each a package whose module is
# callable (the function of the same name; moepack/convert/__init__.py says why)
from . import convert, verify  # noqa: E402



def open(path, *, strict: bool = False):  # noqa: A001 - the public name is moepack.open
    """Validate and memory-map a packed directory; returns a ``PackedModel`` (see moepack.runtime.model)."""
    return open_packed(path, strict=strict)


def patch(model, packed, *, strict=None):
    """Run a loaded transformers model's MoE blocks on a packed directory's layers (see moepack.hf)."""
    from .hf import patch as _patch

    return _patch(model, packed, strict=strict)


def load_model(packed_dir, dtype=None, *, strict: bool = False):
    """The transformers model of a packed directory, built from the directory alone (see moepack.hf)."""
    from .hf import load_model as _load

    return _load(packed_dir, dtype=dtype, strict=strict)


__all__ = [
    "open",
    "patch",
    "load_model",
    "convert",
    "verify",
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "ExtensionError",
    "LayoutError",
    "MoepackError",
    "PackedExperts",
    "PackedLayout",
    "UnsupportedError",
    "cpu_flags",
    "fused_experts",
    "kernel_choice",
    "layout_get",
    "load_extension",
    "pack_experts",
    "pack_weight",
    "run_experts",
]
