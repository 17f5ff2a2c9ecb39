"""Generic packing: canonical expert tensors -> a layout's bytes, whatever the scheme.

What is here knows layouts, never a scheme: ``pack_codes`` / ``unpack_codes`` (codes.py: THE
arrangement of codes, for every code type), ``PackedExperts``, the MoE padding, the biases, and
``pack_experts``, which asks the layout's scheme (the registry in registry.py, which the scheme
packages of moepack/schemes/ fill) to make its canonical tensors from float weights and pack
them. The scheme packages import from here; nothing here imports them (docs/ARCHITECTURE.md).

The readable Python packers are the specification; the C++ packer
(``torch.ops.moepack.pack_weight``) must produce the same bytes (tests/engine/test_pack.py).
``pack_w13`` / ``pack_w2`` add the MoE-specific padding:

* the intermediate size I is zero-padded to ``Ip`` (a multiple of ``layout.i_align``), gate and
  up halves separately (``w13 [E, 2I, H]`` -> ``[E, 2Ip, H]``: gate rows at [0, I), up rows at
  [Ip, Ip + I)); for swigluoai, whose gate/up rows are interleaved (2i = gate_i, 2i+1 = up_i),
  whole pairs are appended at the end instead;
* ``w2 [E, H, I]`` gets zero columns up to ``Ip``;
* biases are padded the same way and stored as fp32.

Padding is exact: a zero gate row and a zero up row give act(0, 0) = 0 for every activation,
and the zero w2 columns multiply it.
"""


from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..container.pages import huge_pages_wanted
from ..errors import LayoutError
from ..layout import DEFAULT_LAYOUT, PackedLayout, layout_get, layout_padded_i, layout_padded_n, layout_tensor_plan
from .codes import code_slots, codes_dtype, pack_codes, unpack_codes
from .registry import exported, get_scheme

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)  # identity equality and hash: it holds tensors
class PackedExperts:
    """One MoE layer's experts in a packed layout, ready for ``moepack.fused_experts``: the
    layout plus its tensors by stored name (``layout_tensor_plan``: w13's declared tensors,
    w2's, then the optional fp32 biases ``w13_bias`` [E, 2*Ip] / ``w2_bias`` [E, Np(H)] and, for
    int4_group layouts of an act-order checkpoint, the optional ``w13_perm`` int32 [E, H]:
    column j of w13's codes is input channel ``w13_perm[e, j]`` (docs/SEMANTICS.md §3))."""

    layout: PackedLayout
    num_experts: int
    hidden: int
    intermediate: int
    padded_intermediate: int
    interleaved: bool  # w13's row order: (gate, up) pairs (swigluoai checkpoints) or gate then up
    tensors: dict[str, torch.Tensor]
    act_mode: str | None = None  # the default activation mode of calls (None: the layout's first)
    # tensor-parallel slices (moepack/tp.py): > 1, the tensors hold tp*E slice experts of
    # intermediate I/tp, rank-major; num_experts and intermediate stay the model's E and I, and
    # padded_intermediate is one slice's
    tp: int = 1
    gated: bool = True  # False: non-gated experts (activation relu2), w13 of Ip up rows alone

    def __post_init__(self) -> None:
        if self.tp < 1 or self.intermediate % self.tp:
            raise LayoutError(f"tp={self.tp}: must be >= 1 and divide the intermediate size I={self.intermediate}")
        want = layout_tensor_plan(self.layout, self.num_experts * self.tp, self.hidden, self.intermediate // self.tp,
                                  bias=True, perm="w13_perm" in self.tensors, gated=self.gated)  # fmt: skip
        if self.act_mode is not None and self.act_mode not in self.layout.act_modes:
            raise LayoutError(f"act_mode={self.act_mode!r}: layout {self.layout.name} runs with "
                              f"{' or '.join(self.layout.act_modes)} activations")  # fmt: skip
        declared = {t.name for t in want}
        for name in self.tensors:
            if name not in declared:
                raise LayoutError(f"packed tensor {name!r}: layout {self.layout.name} declares {sorted(declared)}")
        for t in want:
            if t.role in ("bias", "perm") and t.name not in self.tensors:
                continue
            got = self.tensors.get(t.name)
            if got is None:
                raise LayoutError(f"packed experts of layout {self.layout.name} lack tensor {t.name!r}")
            if tuple(got.shape) != t.shape or str(got.dtype).replace("torch.", "") != t.dtype:
                raise LayoutError(
                    f"packed tensor {t.name!r} is {str(got.dtype).replace('torch.', '')} {list(got.shape)}: "
                    f"layout {self.layout.name} says {t.dtype} {list(t.shape)}"
                )

        # Every declared tensor (and both bias names and w13_perm, None when absent) is also an
        # attribute: packed.w13, packed.w2_scale, packed.w13_bias, packed.w13_perm.
        for t in want:
            object.__setattr__(self, t.name, self.tensors.get(t.name))
        if "w13_perm" not in self.tensors:
            object.__setattr__(self, "w13_perm", None)

    def weight(self, name: str) -> list[torch.Tensor]:
        """One packed weight ("w13" or "w2") as the op takes it: the layout's tensors in order."""
        return [self.tensors[n] for n in self.layout.tensor_names(name)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def pack_weight_reference(
    weight: torch.Tensor, layout: int | str | PackedLayout = DEFAULT_LAYOUT, n_padded: int = 0, k_padded: int = 0
) -> torch.Tensor:
    """[E, N, K] float -> [E, Np, Kp] bf16 in ``layout``; for int8 layouts [E, N, K] int8 codes
    -> [E, Np, Kp] int8 (``pack_codes`` with the dtype rule of the C++ packer it specifies)."""
    lay = layout_get(layout)
    if weight.dim() != 3:
        raise LayoutError(f"weight has shape {list(weight.shape)}: must be 3-D [E, N, K]")
    dtype = codes_dtype(lay)
    if dtype != torch.bfloat16 and weight.dtype != dtype:
        raise LayoutError(f"weight has dtype {weight.dtype}: layout {lay.name} packs {dtype} codes")
    return pack_codes(lay, weight, n_padded=n_padded, k_padded=k_padded)


def unpack_weight_reference(
    packed: torch.Tensor, n: int, k: int, layout: int | str | PackedLayout = DEFAULT_LAYOUT
) -> torch.Tensor:
    """Inverse of ``pack_weight_reference``: packed [E, Np, Kp] -> [E, n, k] (bf16 or int8)."""
    return unpack_codes(layout, packed, n, k)


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"{name} has dtype {t.dtype}: must be float32, bfloat16 or float16")
    if not bool(torch.isfinite(t).all()):
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise LayoutError(f"{name} has a non-finite value at {bad}: weights and biases must be finite")


def pad_intermediate(w13: torch.Tensor, ip: int, interleaved: bool) -> torch.Tensor:
    """[E, 2I, ...] -> [E, 2Ip, ...] with zero rows (gate/up halves padded separately)."""
    e, two_i = w13.shape[:2]
    i = two_i // 2
    out = w13.new_zeros((e, 2 * ip) + tuple(w13.shape[2:]))
    if interleaved:
        out[:, :two_i] = w13
    else:
        out[:, :i] = w13[:, :i]
        out[:, ip : ip + i] = w13[:, i:]
    return out


def _pack(weight: torch.Tensor, lay: PackedLayout, use_cpp: bool, n_padded: int = 0, k_padded: int = 0) -> torch.Tensor:
    if use_cpp:
        from .._ops import ops

        return ops().pack_weight(weight, lay.id, n_padded, k_padded)  # refuses non-finite values itself
    if codes_dtype(lay) == torch.bfloat16:
        check_float("weight", weight)
    return pack_weight_reference(weight, lay, n_padded, k_padded)


def pack_w13(
    w13: torch.Tensor, *, interleaved: bool = False, layout: int | str | PackedLayout = DEFAULT_LAYOUT, use_cpp: bool = True,
    gated: bool = True,
) -> torch.Tensor:
    """[E, 2I, H] canonical gate/up -> packed [E, 2*Ip, Kp(H)]: gate rows [0, I), up rows
    [Ip, Ip + I); interleaved (gate, up) pairs are padded with zero pairs at the end instead.
    ``gated=False`` (non-gated relu2 experts): [E, I, H] up rows -> [E, Ip, Kp(H)]."""
    lay = layout_get(layout)
    if not gated:
        if w13.dim() != 3 or interleaved:
            raise LayoutError(f"w13 has shape {list(w13.shape)}{' (interleaved)' if interleaved else ''}: non-gated experts' "
                              "up rows must be 3-D [E, I, H], not interleaved")  # fmt: skip
        check_weight_dtype("w13", w13, lay)
        try:
            return _pack(w13, lay, use_cpp, n_padded=layout_padded_i(lay, w13.shape[1]))
        except ValueError as e:
            raise LayoutError(f"w13: {e}".split("\n")[0]) from None
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise LayoutError(f"w13 has shape {list(w13.shape)}: must be 3-D [E, 2I, H]")
    check_weight_dtype("w13", w13, lay)
    i = w13.shape[1] // 2
    ip = layout_padded_i(lay, i)
    try:
        if interleaved:
            return _pack(w13, lay, use_cpp, n_padded=2 * ip)
        # i_align is a multiple of block_n: packing each half to Ip rows and concatenating the
        # packed halves equals packing the padded [2*Ip, H] matrix.
        return torch.cat([_pack(w13[:, :i], lay, use_cpp, n_padded=ip), _pack(w13[:, i:], lay, use_cpp, n_padded=ip)], dim=1)
    except ValueError as e:
        raise LayoutError(f"w13: {e}".split("\n")[0]) from None


def pack_w13_pieces(w13: torch.Tensor, *, interleaved: bool = False, layout: PackedLayout, use_cpp: bool = True) -> list[torch.Tensor]:
    """``pack_w13`` of ONE expert ([1, 2I, H]) as the packed tensors whose bytes, in order, are
    its result (the gate half then the up half; one tensor if interleaved): convert writes them
    one after the other instead of paying a ``torch.cat`` copy per expert."""
    lay = layout_get(layout)
    if w13.dim() != 3 or w13.shape[0] != 1 or w13.shape[1] % 2 or interleaved:
        return [pack_w13(w13, interleaved=interleaved, layout=lay, use_cpp=use_cpp)]
    check_weight_dtype("w13", w13, lay)
    i = w13.shape[1] // 2
    ip = layout_padded_i(lay, i)
    try:
        return [_pack(w13[:, :i], lay, use_cpp, n_padded=ip), _pack(w13[:, i:], lay, use_cpp, n_padded=ip)]
    except ValueError as e:
        raise LayoutError(f"w13: {e}".split("\n")[0]) from None


def pack_w2(w2: torch.Tensor, *, layout: int | str | PackedLayout = DEFAULT_LAYOUT, use_cpp: bool = True) -> torch.Tensor:
    """[E, H, I] canonical down -> packed [E, Np(H), Ip] (zero columns up to Ip)."""
    lay = layout_get(layout)
    if w2.dim() != 3:
        raise LayoutError(f"w2 has shape {list(w2.shape)}: must be 3-D [E, H, I]")
    check_weight_dtype("w2", w2, lay)
    try:
        return _pack(w2, lay, use_cpp, k_padded=layout_padded_i(lay, w2.shape[2]))
    except ValueError as e:
        raise LayoutError(f"w2: {e}".split("\n")[0]) from None


def check_weight_dtype(name: str, w: torch.Tensor, lay: PackedLayout) -> None:
    dtype = codes_dtype(lay)
    if dtype != torch.bfloat16:
        if w.dtype != dtype:
            raise LayoutError(f"{name} has dtype {w.dtype}: layout {lay.name} packs {dtype} codes")
    elif w.dtype not in FLOAT_DTYPES:
        raise LayoutError(f"{name} has dtype {w.dtype}: must be float32, bfloat16 or float16")


def pack_bias13(b13: torch.Tensor, *, interleaved: bool = False, layout: int | str | PackedLayout = DEFAULT_LAYOUT) -> torch.Tensor:
    """[E, 2I] -> fp32 [E, 2*Ip] in packed row order."""
    lay = layout_get(layout)
    check_float("w13_bias", b13)
    return pad_intermediate(b13.float(), layout_padded_i(lay, b13.shape[1] // 2), interleaved).contiguous()


def pack_bias2(b2: torch.Tensor, *, layout: int | str | PackedLayout = DEFAULT_LAYOUT) -> torch.Tensor:
    """[E, H] -> fp32 [E, Np(H)]."""
    lay = layout_get(layout)
    check_float("w2_bias", b2)
    return pad_rows(b2.float(), layout_padded_n(lay, b2.shape[1]))


def pad_rows(v: torch.Tensor, np_: int) -> torch.Tensor:
    """[E, N] -> [E, np_] with zeros after column N (w2's per-output-channel tensors: H -> Np(H))."""
    out = v.new_zeros(v.shape[0], np_)
    out[:, : v.shape[1]] = v
    return out


def with_biases(tensors: dict, b13, b2) -> dict:
    if b13 is not None:
        tensors["w13_bias"] = b13
    if b2 is not None:
        tensors["w2_bias"] = b2
    return tensors


def expert_dims(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """(E, H, I) of w13 [E, 2I, H] and w2 [E, H, I], which must agree."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise LayoutError(f"w13 {list(w13.shape)} and w2 {list(w2.shape)}: both must be 3-D [E, out, in]")
    e, two_i, h = w13.shape
    if two_i % 2:
        raise LayoutError(f"w13 has shape {list(w13.shape)}: dim 1 is 2*I and must be even")
    i = two_i // 2
    if tuple(w2.shape) != (e, h, i):
        raise LayoutError(f"w2 has shape {list(w2.shape)}: must be [E, H, I] = {[e, h, i]} to match w13 {list(w13.shape)}")
    return e, h, i


def pack_biases(w13_bias, w2_bias, e: int, h: int, i: int, interleaved: bool, lay: PackedLayout):
    """Optional biases [E, 2I] / [E, H] -> packed fp32 (or None)."""
    b13 = b2 = None
    if w13_bias is not None:
        if tuple(w13_bias.shape) != (e, 2 * i):
            raise LayoutError(f"w13_bias has shape {list(w13_bias.shape)}: must be [E, 2I] = {[e, 2 * i]}")
        b13 = pack_bias13(w13_bias, interleaved=interleaved, layout=lay)
    if w2_bias is not None:
        if tuple(w2_bias.shape) != (e, h):
            raise LayoutError(f"w2_bias has shape {list(w2_bias.shape)}: must be [E, H] = {[e, h]}")
        b2 = pack_bias2(w2_bias, layout=lay)
    return b13, b2


def pack_experts(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    *,
    interleaved: bool = False,
    layout: int | str | PackedLayout = DEFAULT_LAYOUT,
    use_cpp: bool = True,
) -> PackedExperts:
    """Pack canonical float experts: w13 [E, 2I, H] (gate then up, or interleaved pairs when
    ``interleaved``), w2 [E, H, I], optional biases [E, 2I] and [E, H], into ``layout``.

    The layout's scheme (moepack.schemes) turns the float weights into its canonical tensors
    first (``Scheme.from_float``: dense keeps them, a quantized scheme quantizes them with its
    default options for that layout, e.g. int4 symmetric at the layout's group size)."""
    lay = layout_get(layout)
    scheme = get_scheme(lay)
    if scheme.quantized and (w13.dtype not in FLOAT_DTYPES or w2.dtype not in FLOAT_DTYPES):
        raise LayoutError(
            f"w13/w2 have dtypes {w13.dtype}/{w2.dtype}: pack_experts takes float weights (layout {lay.name}, scheme "
            f"{scheme.name}, quantizes them); pack a scheme's own canonical tensors with moepack.schemes.get_scheme"
            f"({scheme.name!r}).pack"
        )
    expert_dims(w13, w2)
    if scheme.quantized:  # a quantizer divides by amax: refuse NaN/Inf here, naming the tensor
        check_float("w13", w13)
        check_float("w2", w2)
    c = with_biases(scheme.from_float(w13, w2, layout=lay), w13_bias, w2_bias)
    packed = scheme.pack(c, interleaved=interleaved, layout=lay, use_cpp=use_cpp)
    return in_huge_pages(packed) if use_cpp else packed


HUGE_PAGE_MIN_BYTES = 4 << 20


def in_huge_pages(packed: PackedExperts) -> PackedExperts:
    """``packed`` with its tensors of at least 4 MiB copied into memory advised for transparent
    huge pages (torch.ops.moepack.huge_page_copy): decode streams each weight once, and on 4 KiB
    pages every page costs a TLB miss and a hardware-prefetcher restart (docs/KERNELS.md
    "Decode"). For in-memory packs made with the C++ packer only (an opened directory stays a
    memory map); ``MOEPACK_HUGE_PAGES=0`` turns it off. Where the kernel declines, the copies are plain."""
    if not huge_pages_wanted():
        return packed
    from .._ops import ops

    big = {
        k: v
        for k, v in packed.tensors.items()
        if v.device.type == "cpu" and v.numel() * v.element_size() >= HUGE_PAGE_MIN_BYTES
    }
    if not big:
        return packed
    copies = {k: ops().huge_page_copy(v) for k, v in big.items()}
    return dataclasses.replace(packed, tensors={**packed.tensors, **copies})


def __getattr__(name: str):
    """Older import paths: the scheme-specific functions that lived here (``quantize_int8_per_channel``,
    ``pack_experts_int8``, ``dequantize_int8``, ``pack_int8_weight``, ``pack_dense``) moved into their
    scheme packages; ``from moepack.pack import quantize_int8_per_channel`` still works, resolved
    through the registry (each scheme lists them in ``Scheme.exports``), not by importing them."""
    f = exported(name)
    if f is None:
        raise AttributeError(f"module 'moepack.pack' has no attribute {name!r}")
    return f


__all__ = ["PackedExperts", "pack_experts", "codes_dtype", "code_slots", "pack_codes", "unpack_codes", "pad_rows",
           "pack_w13", "pack_w2", "pack_w13_pieces", "pack_bias13", "pack_bias2", "pack_weight_reference",
           "unpack_weight_reference", "pad_intermediate", "get_scheme", "FLOAT_DTYPES", "check_float", "check_weight_dtype",
           "expert_dims", "pack_biases", "with_biases", "in_huge_pages"]  # fmt: skip
