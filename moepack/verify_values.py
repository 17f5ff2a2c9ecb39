"""The value rules of a packed directory's tensors: what a checksum-consistent but hostile pack
cannot be allowed to hold (docs/PACKED_FORMAT.md §4 "Value rules").

A sha256 in the manifest proves the bytes are the ones convert wrote, unless the manifest was
rewritten with them. These rules hold for every pack convert can write, whatever the source, so
a value that breaks one was written by someone else, and the kernels' result on it would be
undefined (a zero point above 15 or a NaN scale gives different values on the scalar, AVX2 and
AVX-512 levels). By role (moepack.layout's TensorSpec.role):

* ``scale`` (int8 and int4 scales): finite and >= 0 (convert refuses a source scale that is not
  finite and > 0; padding channels hold 0);
* ``zero`` (int4 zero points, one per byte): 0..15;
* ``perm`` (int4 act-order ``w13_perm``): each expert's row a permutation of 0..K-1;
* ``bias`` (fp32 expert biases): finite (convert refuses non-finite source biases);
* ``codes`` of a bf16 layout: finite (convert refuses non-finite source weights). Codes of int8
  and 4-bit layouts cannot be out of range: every byte pattern is a code;
* ``f8codes`` (the ``codes`` of an fp8 layout, e4m3fn bit patterns): never 0x7F / 0xFF, the NaN
  codes (convert and the packer refuse them; the kernels would turn them into NaN outputs);
* ``f8scale`` (the ``scale`` of an fp8 layout): the ``scale`` rule, and times e4m3fn's largest
  code 448 finite in float32 (convert refuses a source scale above it: its weights decode to Inf);
* ``e8m0`` (the ``scale`` of a layout whose scales are e8m0 exponent bytes, mxfp4's): 0..252,
  the scales 2^(e - 127) (0 also in padding): 255 is the e8m0 NaN, and from 253 up 6 (e2m1's
  largest code) x 2^(e - 127) overflows float32 (convert refuses them);
* ``e4m3`` (the ``scale`` of a layout whose scales are e4m3fn bytes, nvfp4's): never NaN (0x7F /
  0xFF) nor negative (sign bit set; 0 also in padding): convert refuses them;
* ``global`` (nvfp4's per-channel fp32 global scales): finite (0 only in padding; the sign says
  divisor or multiplier);
* ``sum`` (int8 column sums): equal to the sum of the channel's codes (only verify checks it:
  it needs every code, see ``colsum_problem``).

``moepack.open`` checks the small per-group tensors (scale, e8m0, zero, perm) of every layer, which
costs a read of about 1/16 of a 4-bit pack (docs/PACKED_FORMAT.md gives the measured cost);
``moepack verify DST`` checks them all, the bf16 codes while it hashes them. Apart from
verify_dir because both open and verify use it.
"""

from __future__ import annotations

import torch

from .schemes.mxfp4.codec import E8M0_LARGEST
from .sources.fp8_codec import E4M3_LARGEST

# the roles open checks (their tensors are small next to the codes)
OPEN_ROLES = ("scale", "f8scale", "e8m0", "e4m3", "global", "zero", "perm")


def _at(mask: torch.Tensor) -> tuple[list[int], int]:
    return mask.nonzero()[0].tolist(), int(mask.sum())


def value_problem(name: str, role: str, t: torch.Tensor, *, offset: int | None = None) -> str | None:
    """None when tensor ``name`` (of layout role ``role``; ``t`` its values, or a flat piece of
    them starting at element ``offset``) keeps its role's rule; else one line naming the first
    element that breaks it, its value and the rule."""
    if t.numel() == 0 or _fast_ok(role, t):
        return None
    if role == "scale":
        bad, rule = ~(torch.isfinite(t) & (t >= 0)), "scales must be finite and >= 0 (0 only in padding)"
    elif role == "zero":
        bad, rule = t > 15, "zero points must be in 0..15 (4-bit codes)"
    elif role in ("bias", "codes"):
        if not t.dtype.is_floating_point:
            return None  # int8 / 4-bit codes: every byte pattern is a code
        bad, rule = ~torch.isfinite(t), f"{'biases' if role == 'bias' else 'weights'} must be finite (convert refuses others)"
    elif role == "f8codes":
        bad, rule = (t & 0x7F) == 0x7F, "e4m3fn codes 0x7F / 0xFF are NaN (convert refuses them)"
    elif role == "e8m0":
        bad = t > E8M0_LARGEST
        first = int(t[tuple(_at(bad)[0])]) if bool(bad.any()) else 0
        rule = (f"e8m0 scale 255 is NaN (scales are 2^(e - 127), e = 0..{E8M0_LARGEST}; convert refuses it)" if first == 255
                else f"e8m0 scales must be 0..{E8M0_LARGEST}: from 253 up 6 (e2m1's largest code) x 2^(e - 127) overflows "
                "float32 (convert refuses them)")  # fmt: skip
    elif role == "e4m3":
        bad, rule = t >= 0x7F, "nvfp4 e4m3 scale bytes 0x7F / 0xFF are NaN and 0x80 up negative (convert refuses them)"
    elif role == "global":
        bad, rule = ~torch.isfinite(t), "nvfp4 global scales must be finite (convert refuses others)"
    elif role == "f8scale":
        bad = ~(torch.isfinite(t) & (t >= 0) & torch.isfinite(t * E4M3_LARGEST))
        rule = (f"scales must be finite and >= 0, and fp8 scales <= {torch.finfo(torch.float32).max / E4M3_LARGEST:.4g} "
                "(times e4m3fn's largest code 448 a larger one overflows float32; convert refuses them)")  # fmt: skip
    elif role == "perm":
        return _perm_problem(name, t)
    else:
        return None
    if not bool(bad.any()):
        return None
    idx, n = _at(bad)
    if offset is not None:  # a flat piece: name the element of the whole tensor by its flat index
        idx = [offset + idx[0]]
        where = f"element {idx[0]}"
    else:
        where = str(idx)
    v = t[tuple(_at(bad)[0])].item()
    if role in ("f8codes", "e4m3"):
        v = f"0x{v:02X}"
        return f"tensor {name!r} {where} = {v}: {rule} ({n} bad value(s){' in this piece' if offset is not None else ''})"
    return f"tensor {name!r} {where} = {v!r}: {rule} ({n} bad value(s){' in this piece' if offset is not None else ''})"


def _fast_ok(role: str, t: torch.Tensor) -> bool:
    """True when the rule surely holds, from two reductions and no temporary tensor (torch's
    max/min propagate NaN): the common case costs a read of the values; only a tensor that may
    break the rule is looked at element by element (``value_problem``)."""
    if role == "scale":
        lo, hi = torch.aminmax(t)
        return bool(lo >= 0) and bool(torch.isfinite(hi))
    if role == "zero":
        return int(t.max()) <= 15
    if role == "f8codes":
        return not bool(((t & 0x7F) == 0x7F).any())
    if role == "e8m0":
        return int(t.max()) <= E8M0_LARGEST
    if role == "e4m3":
        return int(t.max()) < 0x7F
    if role == "global":
        lo, hi = torch.aminmax(t)
        return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
    if role == "f8scale":
        lo, hi = torch.aminmax(t)
        return bool(lo >= 0) and bool(torch.isfinite(hi * E4M3_LARGEST))
    if role in ("bias", "codes") and t.dtype.is_floating_point:
        lo, hi = torch.aminmax(t) if t.dtype != torch.bfloat16 else (t.min(), t.max())
        return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
    return False


def _perm_problem(name: str, t: torch.Tensor) -> str | None:
    """Every row of ``t`` [E, K] a permutation of 0..K-1."""
    if t.dim() != 2:
        return None  # the manifest schema fixed the shape
    k = t.shape[1]
    want = torch.arange(k, dtype=t.dtype)
    srt = t.sort(dim=1).values
    bad = (srt != want).any(dim=1)
    if not bool(bad.any()):
        return None
    e = int(bad.nonzero()[0])
    return f"tensor {name!r} [expert {e}] is not a permutation of 0..{k - 1}: act-order permutations must be"


def roles_of(model, roles: tuple | None = None):
    """(tensor name, role) of every packed expert tensor of ``model`` (a PackedModel), routed and
    shared, whose layout role is in ``roles`` (None: every role)."""
    for layer in model.layers.values():
        groups = [(layer.entry["tensors"], layer.packed.layout)]
        if layer.shared is not None:  # in the layer's layout, or its own (a float one kept float)
            groups.append((layer.entry.get("shared") or {}, layer.shared.layout))
        for group, lay in groups:
            # an fp8 layout's codes have their own rule (no NaN code); other one-byte codes have none;
            # e8m0 scales (exponent bytes) have theirs (no 255), e4m3 scales (nvfp4) theirs, not the
            # float scales' rule
            f8 = lay.scheme == "fp8_block"
            e8 = lay.scale_dtype == "e8m0"
            e4 = lay.scale_dtype == "e4m3"
            kinds = {t.name: ("f8codes" if f8 and t.role == "codes" else "e8m0" if e8 and t.role == "scale"
                              else "e4m3" if e4 and t.role == "scale" else "f8scale" if f8 and t.role == "scale"
                              else t.role)
                     for t in _plan_roles(lay)}  # fmt: skip
            for r, name in group.items():
                role = kinds.get(r)
                if role is not None and isinstance(name, str) and (roles is None or role in roles):
                    yield name, role


def _plan_roles(lay):
    from .layout import layout_tensor_plan

    from .layout import PERM_SCHEMES

    return layout_tensor_plan(lay, 1, lay.block_n, lay.block_n, bias=True, perm=lay.scheme in PERM_SCHEMES)


def check_open(model) -> None:
    """``moepack.open``'s value check: the small per-group tensors (OPEN_ROLES) of every layer;
    the first bad value is refused with one ``PackedDirError`` line."""
    from .errors import PackedDirError

    for name, role in roles_of(model, OPEN_ROLES):
        msg = value_problem(name, role, model.tensor(name))
        if msg:
            raise PackedDirError(f"{model.path}: {msg}; the pack was not written by moepack convert or was edited "
                                 "(`moepack verify` names every such value)")  # fmt: skip


def colsum_problem(name: str, codes_name: str, layout, codes: torch.Tensor, sums: torch.Tensor, e0: int = 0) -> str | None:
    """int8 column sums ``sums`` [e, N] against the codes ``codes`` (packed, [e, ...]) of experts
    from ``e0``: None when every channel's sum is the sum of its codes (padding included)."""
    from .pack import unpack_codes

    got = unpack_codes(layout, codes).to(torch.int32).sum(dim=-1)
    bad = got != sums
    if not bool(bad.any()):
        return None
    idx, n = _at(bad)
    return (f"tensor {name!r} [expert {idx[0] + e0}, channel {idx[1]}] = {int(sums[tuple(idx)])}, the sum of "
            f"{codes_name!r}'s codes is {int(got[tuple(idx)])}: column sums must equal it ({n} differ)")  # fmt: skip
