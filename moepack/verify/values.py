"""The value rules of a packed directory's tensors: what a checksum-consistent but hostile pack
cannot be allowed to hold (docs/PACKED_FORMAT.md §4 "Value rules").

A sha256 in the manifest proves the bytes are the ones convert wrote, unless the manifest was
rewritten with them. These rules hold for every pack convert can write, whatever the source, so
a value that breaks one was written by someone else, and the kernels' result on it would be
undefined (a zero point above 15 or a NaN scale gives different values on the scalar, AVX2 and
AVX-512 levels). By role (moepack.layout's TensorSpec.role), generic rules here and a scheme's
own ``Scheme.value_rules`` (``ValueRule``) where a role's values mean more in that scheme:

* ``scale`` (int8 and int4 scales): finite and >= 0 (convert refuses a source scale that is not
  finite and > 0; padding channels hold 0);
* ``zero`` (int4 zero points, one per byte): 0..15;
* ``perm`` (int4 act-order ``w13_perm``): each expert's row a permutation of 0..K-1;
* ``bias`` (fp32 expert biases): finite (convert refuses non-finite source biases);
* ``codes`` of a bf16 layout: finite (convert refuses non-finite source weights). Codes of int8
  and 4-bit layouts cannot be out of range: every byte pattern is a code;
The schemes' own rules (their ``value_rules``, keyed as named here):

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
run.py because both open and verify use it.
"""

from __future__ import annotations

import torch

from ..pack.registry import get_scheme, schemes
from ..schemes import ValueRule


def _finite_ok(t: torch.Tensor) -> bool:
    if not t.dtype.is_floating_point:
        return True  # int8 / 4-bit codes: every byte pattern is a code
    lo, hi = torch.aminmax(t) if t.dtype != torch.bfloat16 else (t.min(), t.max())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _scale_ok(t: torch.Tensor) -> bool:
    lo, hi = torch.aminmax(t)
    return bool(lo >= 0) and bool(torch.isfinite(hi))


# The rules of every scheme's roles (a scheme's value_rules replace one for its layouts).
GENERIC_RULES = {
    "scale": ValueRule("scale", lambda t: ~(torch.isfinite(t) & (t >= 0)), lambda v: "scales must be finite and >= 0 (0 only in padding)",
                       _scale_ok, on_open=True),
    "zero": ValueRule("zero", lambda t: t > 15, lambda v: "zero points must be in 0..15 (4-bit codes)", lambda t: int(t.max()) <= 15,
                      on_open=True),
    "bias": ValueRule("bias", lambda t: ~torch.isfinite(t), lambda v: "biases must be finite (convert refuses others)", _finite_ok),
    "codes": ValueRule("codes", lambda t: ~torch.isfinite(t), lambda v: "weights must be finite (convert refuses others)", _finite_ok,
                       streamed=True),
    "perm": ValueRule("perm", None, None, lambda t: False, on_open=True),  # _perm_problem: every row a permutation
}  # fmt: skip


def rule(key: str) -> ValueRule | None:
    """The value rule named ``key``: a generic one, or one a registered scheme declares."""
    if key in GENERIC_RULES:
        return GENERIC_RULES[key]
    return next((r for s in schemes() for r in s.value_rules.values() if r.key == key), None)


def open_roles() -> tuple[str, ...]:
    """The rules ``moepack.open`` checks (their tensors are small next to the codes)."""
    keys = [r.key for r in GENERIC_RULES.values() if r.on_open]
    keys += [r.key for s in schemes() for r in s.value_rules.values() if r.on_open and r.key not in keys]
    return tuple(keys)


def streamed(key: str | None, dtype: torch.dtype) -> bool:
    """Whether the tensor of rule ``key`` is checked piece by piece while it is hashed (large ones:
    float codes, fp8 codes); other rules read their (small) tensor whole."""
    r = rule(key) if key else None
    return r is not None and r.streamed and (key != "codes" or dtype.is_floating_point)


def _at(mask: torch.Tensor) -> tuple[list[int], int]:
    return mask.nonzero()[0].tolist(), int(mask.sum())


def value_problem(name: str, role: str, t: torch.Tensor, *, offset: int | None = None) -> str | None:
    """None when tensor ``name`` (of value rule ``role``; ``t`` its values, or a flat piece of
    them starting at element ``offset``) keeps its rule; else one line naming the first
    element that breaks it, its value and the rule."""
    r = rule(role)
    if r is None or t.numel() == 0 or r.fast_ok(t):
        return None
    if role == "perm":
        return _perm_problem(name, t)
    bad = r.bad(t)
    if not bool(bad.any()):
        return None
    idx, n = _at(bad)
    v = t[tuple(idx)].item()
    text = r.text(v)
    if offset is not None:  # a flat piece: name the element of the whole tensor by its flat index
        where = f"element {offset + idx[0]}"
    else:
        where = str(idx)
    piece = " in this piece" if offset is not None else ""
    return f"tensor {name!r} {where} = {f'0x{v:02X}' if r.hex else repr(v)}: {text} ({n} bad value(s){piece})"


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
    """(tensor name, value rule) of every packed expert tensor of ``model`` (a PackedModel),
    routed and shared, whose rule is in ``roles`` (None: every rule): a layout role's rule is its
    scheme's (``Scheme.value_rules``) where the scheme declares one, else the generic rule."""
    for layer in model.layers.values():
        groups = [(layer.entry["tensors"], layer.packed.layout)]
        if layer.shared is not None:  # in the layer's layout, or its own (a float one kept float)
            groups.append((layer.entry.get("shared") or {}, layer.shared.layout))
        for group, lay in groups:
            own = get_scheme(lay).value_rules
            kinds = {t.name: own[t.role].key if t.role in own else t.role for t in _plan_roles(lay)}
            for r, name in group.items():
                role = kinds.get(r)
                if role is not None and isinstance(name, str) and (roles is None or role in roles):
                    yield name, role


def _plan_roles(lay):
    from ..layout import PERM_SCHEMES, layout_tensor_plan

    return layout_tensor_plan(lay, 1, lay.block_n, lay.block_n, bias=True, perm=lay.scheme in PERM_SCHEMES)


def check_open(model) -> None:
    """``moepack.open``'s value check: the small per-group tensors (``open_roles``) of every layer;
    the first bad value is refused with one ``PackedDirError`` line."""
    from ..errors import PackedDirError

    for name, role in roles_of(model, open_roles()):
        msg = value_problem(name, role, model.tensor(name))
        if msg:
            raise PackedDirError(f"{model.path}: {msg}; the pack was not written by moepack convert or was edited "
                                 "(`moepack verify` names every such value)")  # fmt: skip


def colsum_problem(name: str, codes_name: str, layout, codes: torch.Tensor, sums: torch.Tensor, e0: int = 0) -> str | None:
    """int8 column sums ``sums`` [e, N] against the codes ``codes`` (packed, [e, ...]) of experts
    from ``e0``: None when every channel's sum is the sum of its codes (padding included)."""
    from ..pack import unpack_codes

    got = unpack_codes(layout, codes).to(torch.int32).sum(dim=-1)
    bad = got != sums
    if not bool(bad.any()):
        return None
    idx, n = _at(bad)
    return (f"tensor {name!r} [expert {idx[0] + e0}, channel {idx[1]}] = {int(sums[tuple(idx)])}, the sum of "
            f"{codes_name!r}'s codes is {int(got[tuple(idx)])}: column sums must equal it ({n} differ)")  # fmt: skip
