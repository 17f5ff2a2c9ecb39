"""The arrangement of codes, written once in Python: ``pack_codes`` and its inverse ``unpack_codes``.

Every Python packer (the dense, int8 and int4 schemes', the spec packers verify recomputes
with) puts its codes where this module does, and this module asks moepack/layout.py where that
is: ``layout_element_offset`` (which run of ``k_pack`` values of which column) and
``layout_code_position`` (where a code sits inside its run: the layout's ``code_order`` for
sub-byte codes). Nothing here knows a blocking or a nibble order, so a layout of another
``block_n`` / ``k_pack`` / ``code_order`` / ``weight_bits`` is packed and read by the same code.

Vectorized: each logical code ``(n, k)`` of a padded ``[Np, Kp]`` matrix gets its *slot*, the
index of its ``weight_bits``-wide field in the packed matrix's bit stream (``(byte * 8 + shift)
/ weight_bits`` of ``layout_code_position``). Wide codes (bf16, int8) have one element per slot,
so the slot is the element offset; sub-byte codes share a byte, ``8 / weight_bits`` slots each,
slot ``s`` at bits ``(s % per_byte) * weight_bits`` of byte ``s // per_byte`` — which is the
layout's own statement of a code's position, not a second one.
"""

from __future__ import annotations

import sys
from functools import lru_cache

import torch

from ..errors import LayoutError
from ..layout import (
    PackedLayout,
    layout_code_position,
    layout_element_offset,
    layout_get,
    layout_padded_k,
    layout_padded_n,
    tensor_shape,
)

__all__ = ["codes_dtype", "code_slots", "pack_codes", "unpack_codes"]


def codes_dtype(lay: PackedLayout) -> torch.dtype:
    """The torch dtype of a layout's codes tensor (its declaration's tensors[0])."""
    return getattr(torch, lay.tensors[0].dtype)


# One padded matrix's run table is [Np, Kp / k_pack] int64 (Qwen3-30B-A3B's w13 at k_pack 8: 3 MiB).
# convert packs expert after expert of the same shapes, so the few shapes of a model are computed once.
@lru_cache(maxsize=16)
def _runs(layout: PackedLayout, np_: int, kp: int) -> tuple[torch.Tensor, tuple]:
    """(run index [np_ * kp / k_pack], (byte, shift) of element j inside a run, j < k_pack) of one
    packed matrix: the codes
    of one column's run of k_pack consecutive K values are whole bytes, stored together. The run
    of code (n, k) starts at ``layout_element_offset`` of ``(n, k - k % k_pack)`` (a multiple of
    k_pack); element j of a run sits where ``layout_code_position`` puts it in the first run
    (column 0, K 0..k_pack-1, which starts at bit 0). Arranging inside runs k_pack slices at a
    time, then moving whole runs as one integer each, is the same arrangement at a fraction of
    the cost of one index per code."""
    if np_ % layout.block_n or kp % layout.k_pack:
        raise LayoutError(f"packed matrix [{np_}, {kp}]: layout {layout.name} needs N a multiple of block_n={layout.block_n} "
                          f"and K a multiple of k_pack={layout.k_pack}")  # fmt: skip
    kpk = layout.k_pack
    n = torch.arange(np_, dtype=torch.int64).unsqueeze(1)
    k0 = torch.arange(0, kp, kpk, dtype=torch.int64).unsqueeze(0)
    run = layout_element_offset(layout, n, k0, kp) // kpk  # tensor arithmetic on the layout's own formula
    return run.reshape(-1).contiguous(), tuple(layout_code_position(layout, 0, j, kp) for j in range(kpk))


def code_slots(layout: PackedLayout, np_: int, kp: int) -> torch.Tensor:
    """int64 ``[np_, kp]``: the slot of every logical code of one packed matrix (module docstring)."""
    run, pos = _runs(layout, np_, kp)
    kpk = layout.k_pack
    inside = torch.tensor([(b * 8 + s) // layout.weight_bits for b, s in pos], dtype=torch.int64)
    return (run.view(np_, kp // kpk, 1) * kpk + inside).reshape(np_, kp)


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The run arithmetic below reads k_pack one-byte codes as one integer (code j = byte j): the
# byte order of little-endian machines, which every platform torch runs moepack on is.
assert sys.byteorder == "little", "moepack.pack.codes assumes a little-endian machine"


def _pack_runs(codes: torch.Tensor, pos: tuple, bits: int) -> torch.Tensor:
    """Sub-byte codes [E, R, k_pack] (uint8, one per byte) -> the runs' bytes [E, R, k_pack * bits
    / 8], element j at (byte, shift) ``pos[j]``. With k_pack <= 8 a run is one int64 (code j at bit
    8j), rearranged by k_pack shifts over the whole tensor; else byte by byte."""
    e, r, kpk = codes.shape
    nbytes = kpk * bits // 8
    mask = (1 << bits) - 1
    if kpk in (1, 2, 4, 8):
        words = codes.contiguous().view(torch.uint8).view(_WORDS[kpk]).view(e, r)
        out = torch.empty(e, r, nbytes, dtype=torch.uint8)
        acc, t = torch.empty(r, dtype=torch.int64), torch.empty(r, dtype=torch.int64)  # reused: one expert at a time
        for i in range(e):  # (int64 scratch of a whole layer would be 8x its codes)
            x = words[i].to(torch.int64)
            acc.zero_()
            for j, (b, sh) in enumerate(pos):
                torch.bitwise_right_shift(x, 8 * j, out=t).bitwise_and_(mask).bitwise_left_shift_(8 * b + sh)
                acc.bitwise_or_(t)
            out[i] = acc.view(torch.uint8).view(r, 8)[:, :nbytes]
        return out
    runs = torch.zeros(e, r, nbytes, dtype=torch.uint8)
    for j, (b, sh) in enumerate(pos):
        runs[:, :, b] |= codes[:, :, j] << sh
    return runs


def _unpack_runs(runs: torch.Tensor, pos: tuple, bits: int, kpk: int) -> torch.Tensor:
    """Inverse of ``_pack_runs``: runs' bytes [E, R, k_pack * bits / 8] -> codes [E, R, k_pack] uint8."""
    e, r, nbytes = runs.shape
    mask = (1 << bits) - 1
    if kpk in (1, 2, 4, 8) and nbytes in _WORDS:
        words = runs.contiguous().view(_WORDS[nbytes]).view(e, r)
        out = torch.empty(e, r, kpk, dtype=torch.uint8)
        acc, t = torch.empty(r, dtype=torch.int64), torch.empty(r, dtype=torch.int64)
        for i in range(e):
            w = words[i].to(torch.int64).bitwise_and_((1 << (8 * nbytes)) - 1)
            acc.zero_()
            for j, (b, sh) in enumerate(pos):
                torch.bitwise_right_shift(w, 8 * b + sh, out=t).bitwise_and_(mask).bitwise_left_shift_(8 * j)
                acc.bitwise_or_(t)
            out[i] = acc.view(torch.uint8).view(r, 8)[:, :kpk]
        return out
    out = torch.empty(e, r, kpk, dtype=torch.uint8)
    for j, (b, sh) in enumerate(pos):
        out[:, :, j] = (runs[:, :, b] >> sh) & mask
    return out


def _as_words(runs: torch.Tensor) -> torch.Tensor:
    """[E, R, b] (one run of b bytes per row) as [E, R] integers of b bytes where such a dtype
    exists (moving runs is then one gather of elements, not R row copies); else as it is."""
    nbytes = runs.shape[-1] * runs.element_size()
    if nbytes in _WORDS and runs.is_contiguous():
        return runs.view(torch.uint8).view(_WORDS[nbytes]).view(runs.shape[0], runs.shape[1])
    return runs


def _code_range(layout: PackedLayout) -> tuple[int, int]:
    return 0, (1 << layout.weight_bits) - 1


def pack_codes(
    layout: int | str | PackedLayout, codes: torch.Tensor, *, n_padded: int = 0, k_padded: int = 0
) -> torch.Tensor:
    """Logical codes ``[E, N, K]`` (or ``[N, K]``) -> the layout's packed codes tensor ``[E, Np, Kp *
    weight_bits / 8 / element bytes]`` (bf16 / int8 values, or sub-byte codes two or more to a
    uint8). Np, Kp: N and K rounded up to whole blocks / runs, or ``n_padded`` / ``k_padded`` when
    given (a multiple of block_n / k_pack, at least that). Padding is code 0; a scheme whose
    padding means something else (int4: the group's zero point) pads ``codes`` itself.

    ``codes``: float values for a bf16 layout (rounded to bf16 here), integers of the layout's
    code dtype for int8, integers ``0 <= c < 2**weight_bits`` (any integer dtype) for sub-byte
    codes."""
    lay = layout_get(layout)
    squeeze = codes.dim() == 2
    c = codes.unsqueeze(0) if squeeze else codes
    if c.dim() != 3:
        raise LayoutError(f"codes have shape {list(codes.shape)}: must be [E, N, K] or [N, K]")
    e, n, k = c.shape
    np_, kp = _padded(lay, n, k, n_padded, k_padded, list(codes.shape))
    dtype = codes_dtype(lay)
    bits = lay.weight_bits
    if bits < 8:
        if c.dtype.is_floating_point or c.dtype == torch.bool:
            raise LayoutError(f"codes have dtype {c.dtype}: layout {lay.name} packs {bits}-bit integer codes")
        lo, hi = _code_range(lay)
        # one pass for unsigned codes (the usual uint8): they cannot be below 0
        if c.numel() and ((c.dtype != torch.uint8 and int(c.min()) < lo) or int(c.max()) > hi):
            bad = ((c < lo) | (c > hi)).nonzero()[0].tolist()
            raise LayoutError(f"code{bad} = {int(c[tuple(bad)])}: layout {lay.name}'s {bits}-bit codes are {lo}..{hi}")
        work = torch.uint8  # codes < 2**bits: shifted into their field of a byte, they never overflow it
    else:
        work = dtype
    run, pos = _runs(lay, np_, kp)
    kpk = lay.k_pack
    if (n, k) == (np_, kp) and c.dtype == work:
        full = c.contiguous()
    else:
        full = torch.zeros(e, np_, kp, dtype=work)
        full[:, :n, :k] = c
    codes = full.view(e, -1, kpk)
    if bits < 8:
        runs = _pack_runs(codes, pos, bits)
    elif all(b * 8 // bits == j for j, (b, _) in enumerate(pos)):
        runs = codes  # wide codes are stored in K order inside a run
    else:  # pragma: no cover - PackedLayout gives wide codes no code_order
        runs = torch.empty_like(codes)
        for j, (b, _) in enumerate(pos):
            runs[:, :, b * 8 // bits] = codes[:, :, j]
    flat = torch.empty_like(runs)
    _as_words(flat)[:, run] = _as_words(runs)  # each run (whole bytes) to where the layout stores it
    flat = flat.view(e, -1)
    out = flat.view(tensor_shape(lay, lay.tensors[0], e, np_, kp))
    return out[0] if squeeze else out


def unpack_codes(layout: int | str | PackedLayout, packed: torch.Tensor, n: int | None = None, k: int | None = None) -> torch.Tensor:
    """Inverse of ``pack_codes``: the packed codes tensor ``[E, Np, *]`` (or ``[Np, *]``) -> the
    logical codes ``[E, n, k]`` (default: every padded row and column, ``[E, Np, Kp]``): bf16 /
    int8 values as stored, sub-byte codes as uint8 0..2**weight_bits-1, read through the
    layout's own code order."""
    lay = layout_get(layout)
    squeeze = packed.dim() == 2
    p = packed.unsqueeze(0) if squeeze else packed
    if p.dim() != 3:
        raise LayoutError(f"packed codes have shape {list(packed.shape)}: must be [E, Np, *] or [Np, *]")
    e, np_ = p.shape[0], p.shape[1]
    per_elem = 8 * p.element_size()  # bits of one stored element of the codes tensor
    kp = p.shape[2] * per_elem // lay.weight_bits
    if p.dtype != codes_dtype(lay) or tensor_shape(lay, lay.tensors[0], e, np_, kp) != tuple(p.shape):
        raise LayoutError(f"packed codes {p.dtype} {list(p.shape)}: not a codes tensor of layout {lay.name} "
                          f"({codes_dtype(lay)}, [E, Np, Kp * {lay.weight_bits} / {per_elem}])")  # fmt: skip
    run, pos = _runs(lay, np_, kp)
    kpk, bits = lay.k_pack, lay.weight_bits
    stored = p.reshape(e, -1, kpk * bits // (8 * p.element_size()))  # one row per run, in stored order
    runs = _as_words(stored)[:, run]  # back to logical order
    runs = runs.view(stored.dtype).view(e, -1, stored.shape[-1]) if runs.dim() == 2 else runs
    if bits < 8:
        out = _unpack_runs(runs, pos, bits, kpk)
    elif all(b * 8 // bits == j for j, (b, _) in enumerate(pos)):
        out = runs  # wide codes are stored in K order inside a run
    else:  # pragma: no cover - PackedLayout gives wide codes no code_order
        out = torch.empty(e, runs.shape[1], kpk, dtype=p.dtype)
        for j, (b, _) in enumerate(pos):
            out[:, :, j] = runs[:, :, b * 8 // bits]
    out = out.reshape(e, np_, kp)
    out = out[:, : np_ if n is None else n, : kp if k is None else k]
    return out[0] if squeeze else out


def _padded(lay: PackedLayout, n: int, k: int, n_padded: int, k_padded: int, shape: list) -> tuple[int, int]:
    np_, kp = layout_padded_n(lay, n), layout_padded_k(lay, k)
    if n_padded:
        if n_padded < np_ or n_padded % lay.block_n:
            raise LayoutError(f"n_padded={n_padded} for codes {shape}: must be a multiple of block_n={lay.block_n} >= {np_}")
        np_ = n_padded
    if k_padded:
        if k_padded < kp or k_padded % lay.k_pack:
            raise LayoutError(f"k_padded={k_padded} for codes {shape}: must be a multiple of k_pack={lay.k_pack} >= {kp}")
        kp = k_padded
    return np_, kp
