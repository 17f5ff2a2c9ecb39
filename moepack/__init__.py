"""moepack: Mixture-of-Experts layers on CPUs, from packed checkpoints.

Importing moepack is cheap: the native extension is loaded on first use.

    import moepack
    packed = moepack.pack_experts(w13, w2)                  # canonical -> packed layout
    out = moepack.fused_experts(x, packed.w13, packed.w2, topk_weights, topk_ids)
    moepack.kernel_choice()                                 # ('avx2', 'why')
"""

from ._ops import cpu_flags, fused_experts, kernel_choice, load_extension, pack_weight
from .errors import ExtensionError, LayoutError, MoepackError, UnsupportedError
from .layout import DEFAULT_LAYOUT, LAYOUTS, PackedLayout, layout_get
from .pack import PackedExperts, pack_experts
from .runtime import run_experts

__version__ = "0.1.0"

__all__ = [
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
