"""The table of packed layouts, and all byte/offset math over them.

Every number that describes how packed bytes are arranged lives here, once. The C++ side reads
the same numbers from ``csrc/include/moepack/layouts_gen.h``, which ``tools/gen_layouts.py``
writes from this file (``--check`` fails when the header is stale), and the extension reports
its compiled table through ``torch.ops.moepack.layout_desc`` so a test can compare both.

A packed weight is the canonical ``[N, K]`` matrix (torch Linear order: N outputs, K inputs) of
one expert, zero-padded to ``[Np, Kp]`` and rearranged so that a kernel streams it in order:

    blocks of ``block_n`` output columns; inside a block, groups of ``k_pack`` adjacent K values
    of one column are contiguous, and the columns of a block follow each other:

        element(n, k) -> (n // block_n) * block_n * Kp      # which column block
                         + (k // k_pack) * block_n * k_pack # which K group inside it
                         + (n % block_n) * k_pack           # which column inside the group
                         + k % k_pack                       # which K inside the group

For ``bf16_n32k2_x86`` one K group of a block is 32 columns x 2 bf16 = 128 bytes, two cache
lines: one AVX-512 register of 16 bf16 pairs holds half of it (what ``vdpbf16ps`` consumes), an
AVX2 register a quarter. For ``i8_n32k4_x86`` one K group is 32 columns x 4 int8 = 128 bytes
too: a 32-bit word holds ``w[n][k..k+3]`` (the operand of ``vpdpbusd``); its per-channel fp32
scales and int32 column sums are separate ``[E, N]`` tensors (moepack/pack: ``pack_experts_int8``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import LayoutError

# Values of ``PackedLayout.family``: which ISA family the blocking was chosen for. A layout of
# any family runs everywhere through the scalar kernel; SIMD kernels register per family.
FAMILIES = ("x86", "arm")
WEIGHT_DTYPES = {"bf16": 2, "f32": 4, "i8": 1}  # dtype name -> bytes per element
SCALE_DTYPES = ("none", "f32", "bf16", "e8m0")
ZERO_KINDS = ("none", "u4", "bf16")


@dataclass(frozen=True)
class PackedLayout:
    """One packed weight layout. ``id`` is written into every manifest and never reused."""

    id: int  # stable; never reused
    name: str  # <dtype>_n<block_n>k<k_pack>_<family>
    weight_dtype: str  # element type of the stored codes/values ("bf16", ...)
    weight_bits: int  # bits per stored weight element
    group_size: int  # K per scale; 0 = no scales (dense) or per output channel
    block_n: int  # output columns per block (one tile of accumulators)
    k_pack: int  # adjacent K values of one column stored together
    scale_dtype: str  # "none" for dense layouts
    zero_kind: str  # "none" for dense and symmetric layouts
    family: str  # ISA family the blocking targets ("x86" | "arm")
    i_align: int  # the intermediate size I is zero-padded to a multiple of this

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise LayoutError(f"layout {self.name}: family={self.family!r} is not one of {FAMILIES}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise LayoutError(f"layout {self.name}: weight_dtype={self.weight_dtype!r} is unknown")
        if self.weight_bits != 8 * WEIGHT_DTYPES[self.weight_dtype]:
            raise LayoutError(f"layout {self.name}: weight_bits={self.weight_bits} does not match {self.weight_dtype}")
        if self.block_n <= 0 or self.k_pack <= 0 or self.i_align % self.block_n:
            raise LayoutError(f"layout {self.name}: i_align={self.i_align} must be a multiple of block_n={self.block_n}")
        if self.scale_dtype not in SCALE_DTYPES or self.zero_kind not in ZERO_KINDS:
            raise LayoutError(f"layout {self.name}: scale_dtype/zero_kind {self.scale_dtype}/{self.zero_kind} unknown")
        if self.quantized and self.scale_dtype == "none":
            raise LayoutError(f"layout {self.name}: integer weights ({self.weight_dtype}) need a scale_dtype")

    @property
    def quantized(self) -> bool:
        """Integer codes that need scales (W8A8 int8), as opposed to float values."""
        return self.weight_dtype == "i8"

    @property
    def elem_bytes(self) -> int:
        return WEIGHT_DTYPES[self.weight_dtype]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


LAYOUTS: tuple[PackedLayout, ...] = (
    PackedLayout(
        id=1,
        name="bf16_n32k2_x86",
        weight_dtype="bf16",
        weight_bits=16,
        group_size=0,
        block_n=32,
        k_pack=2,
        scale_dtype="none",
        zero_kind="none",
        family="x86",
        i_align=32,
    ),
    # W8A8 (SEMANTICS.md §3 "int8 channel"): int8 codes, one fp32 scale per output channel
    # (separate [E, N] tensors, plus int32 column sums for the VNNI kernel's u8 activations).
    # One K group of a block = 32 columns x 4 int8 = 128 bytes: a 32-bit lane holds
    # w[n][k..k+3], the operand of vpdpbusd (AVX-512 VNNI) and of vpmaddubsw + vpmaddwd (AVX2).
    PackedLayout(
        id=2,
        name="i8_n32k4_x86",
        weight_dtype="i8",
        weight_bits=8,
        group_size=0,
        block_n=32,
        k_pack=4,
        scale_dtype="f32",
        zero_kind="none",
        family="x86",
        i_align=32,
    ),
)

_BY_ID = {layout.id: layout for layout in LAYOUTS}
_BY_NAME = {layout.name: layout for layout in LAYOUTS}
assert len(_BY_ID) == len(LAYOUTS) and len(_BY_NAME) == len(LAYOUTS), "duplicate layout id or name"

DEFAULT_LAYOUT = _BY_NAME["bf16_n32k2_x86"]
INT8_LAYOUT = _BY_NAME["i8_n32k4_x86"]


def layout_get(key: int | str | PackedLayout) -> PackedLayout:
    """Look a layout up by id, name or identity; unknown keys raise ``LayoutError``."""
    if isinstance(key, PackedLayout):
        return key
    table = _BY_ID if isinstance(key, int) else _BY_NAME
    try:
        return table[key]
    except KeyError:
        known = ", ".join(f"{x.name} (id {x.id})" for x in LAYOUTS)
        raise LayoutError(f"layout {key!r} is unknown; known layouts: {known}") from None


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def layout_padded_n(layout: PackedLayout, n: int) -> int:
    """Output columns after padding to whole blocks."""
    return _round_up(n, layout.block_n)


def layout_padded_k(layout: PackedLayout, k: int) -> int:
    """Input size after padding to whole K groups."""
    return _round_up(k, layout.k_pack)


def layout_padded_i(layout: PackedLayout, intermediate: int) -> int:
    """Intermediate size after zero padding (gate and up halves are padded separately)."""
    return _round_up(intermediate, layout.i_align)


def layout_matrix_bytes(layout: PackedLayout, n: int, k: int) -> int:
    """Bytes of one packed ``[n, k]`` matrix (one expert's weight), padding included."""
    return layout_padded_n(layout, n) * layout_padded_k(layout, k) * layout.elem_bytes


def layout_element_offset(layout: PackedLayout, n: int, k: int, kp: int) -> int:
    """Element index of logical ``(n, k)`` inside one packed matrix whose padded K is ``kp``."""
    bn, kpk = layout.block_n, layout.k_pack
    return (n // bn) * bn * kp + (k // kpk) * bn * kpk + (n % bn) * kpk + k % kpk


@dataclass(frozen=True)
class ExpertShapes:
    """Logical and padded sizes of one MoE layer's packed experts."""

    num_experts: int
    hidden: int  # H
    intermediate: int  # I (real)
    padded_intermediate: int  # Ip
    w13_shape: tuple[int, int, int]  # packed [E, 2*Ip, Kp(H)]
    w2_shape: tuple[int, int, int]  # packed [E, Np(H), Ip]


def layout_expert_shapes(layout: PackedLayout, num_experts: int, hidden: int, intermediate: int) -> ExpertShapes:
    """The packed tensor shapes for a layer; all padding decisions are made here."""
    if num_experts <= 0 or hidden <= 0 or intermediate <= 0:
        raise LayoutError(
            f"expert shapes E={num_experts}, H={hidden}, I={intermediate}: every size must be positive"
        )
    ip = layout_padded_i(layout, intermediate)
    return ExpertShapes(
        num_experts=num_experts,
        hidden=hidden,
        intermediate=intermediate,
        padded_intermediate=ip,
        w13_shape=(num_experts, 2 * ip, layout_padded_k(layout, hidden)),
        w2_shape=(num_experts, layout_padded_n(layout, hidden), layout_padded_k(layout, ip)),
    )


def layout_flops(tokens: int, topk: int, hidden: int, intermediate: int) -> int:
    """Useful multiply-adds x 2 of one fused MoE call (padding not counted)."""
    return 2 * tokens * topk * 3 * hidden * intermediate


__all__ = [
    "LAYOUTS",
    "DEFAULT_LAYOUT",
    "INT8_LAYOUT",
    "PackedLayout",
    "ExpertShapes",
    "layout_get",
    "layout_padded_n",
    "layout_padded_k",
    "layout_padded_i",
    "layout_matrix_bytes",
    "layout_element_offset",
    "layout_expert_shapes",
    "layout_flops",
]
