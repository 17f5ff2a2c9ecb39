"""What the int4 readers share (GPTQ, AWQ GEMM, compressed-tensors pack-quantized): one
canonical form, scheme ``int4_group`` (docs/SEMANTICS.md §3), whatever the source packing.

Each format module (gptq.py, awq.py, ct_pack_quantized.py) supplies an ``Int4Format``: its
config check, a header scan that finds every quantized Linear (``QModule``: logical [N, K], group
size, tensor names) and a decoder to a ``QLinear`` (codes, scales, zero points, g_idx, validated).
Everything else is here: finding the MoE layers (the dense reader's name patterns, run on a view
of the checkpoint in which each quantized Linear appears as a ``<prefix>.weight`` of dtype "I4"
and its logical shape), act-order sorting, folding down_proj's permutation into gate/up, and the
reader functions.

Canonical tensors of one expert (``read_expert_canonical(ckpt, spec, "w13" | "w2", e)``):

* ``{w}_q`` uint8 [N, K], codes 0..15, nn.Linear orientation; w13 = gate rows then up rows
  ([2I, H]) or interleaved (gate_j, up_j) pairs when ``spec.interleaved``; w2 = down [H, I];
* ``{w}_scale`` float32 [N, ceil(K / G)] ([N, 1] per channel), the source's scales exactly;
* ``{w}_zero`` uint8 [N, ceil(K / G)], true zero points 0..15 (symmetric sources: 8), so that
  ``W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]``;
* ``w13_perm`` int32 [H], only when ``spec.quant.act_order`` (then for every expert of the
  layer, the identity for an expert without act-order): column j of the codes is ORIGINAL input
  channel ``perm[j]`` (``perm`` = stable argsort of gate_proj's g_idx), i.e.
  ``W_orig[:, perm[j]] = dequant(q)[:, j]``; groups are contiguous runs of G columns.
  The kernel computes ``x[:, perm] @ dequant(q).T``.

down_proj's own act-order (its K is the intermediate dimension) never yields a perm: its columns
are sorted by its g_idx and the same permutation ``ip`` is applied to the gate and up rows of
w13 (codes, scales, zeros) and to their biases (``read_biases``), which computes the same
function exactly. So every per-expert float or bias this reader returns is in that FOLDED
intermediate order (``intermediate_perm(ckpt, spec, e)`` gives ``ip``, or None): row j of gate,
up and b13's halves, and column j of down, are the source's intermediate channel ``ip[j]``. The
float weights (``read_expert_w13/w2``, ``read_layer``'s w13 / w2) are dequantized in the
ORIGINAL input-channel order of w13 (H), i.e. W_orig with w13_perm undone.

``LayerSpec.quant``: an ``Int4Facts`` (moepack/schemes/int4/facts.py: group size, symmetry, scale
dtype, format, act-order, input activations, the shared expert's facts), which the int4 scheme
reads.

Scales, zero points and g_idx are validated when an expert is read (the values would be read up
front for every expert otherwise): a bad one is a SourceError naming the tensor, the value and
the rule, before convert writes anything final (it writes to a temporary directory).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import SourceError
from ..schemes.int4.facts import Int4Facts
from .checkpoint import Checkpoint, TensorInfo
from .dense import FLOAT_DTYPES, CanonicalLayer, LayerSpec, discover_layers, read_biases as dense_read_biases
from .linears import CarriedLinear

SCHEME = "int4_group"
INT4 = "I4"  # LayerSpec.dtype of 4-bit experts (safetensors has no such dtype: the codes are packed in I32)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_ROLES = ("gate", "up", "down")


@dataclass
class QModule:
    """One quantized Linear as found in the headers (no data read)."""

    prefix: str  # e.g. "model.layers.3.mlp.experts.17.down_proj"
    n: int  # out_features
    k: int  # in_features
    group_size: int  # G; -1 = one group over the whole row
    main: str  # the tensor standing for the module (qweight / weight_packed)
    tensors: dict = field(default_factory=dict)  # format role -> tensor name
    scale_dtype: str = "F16"
    sym: bool = True

    @property
    def ngroups(self) -> int:
        return 1 if self.group_size == -1 else math.ceil(self.k / self.group_size)


@dataclass
class QLinear:
    """One quantized Linear decoded and validated: codes in the ORIGINAL input-channel order."""

    q: torch.Tensor  # uint8 [N, K], 0..15
    scale: torch.Tensor  # float32 [N, ngroups]
    zero: torch.Tensor  # uint8 [N, ngroups], 0..15
    perm: torch.Tensor | None  # int64 [K]: stable argsort of a non-trivial g_idx, else None
    g_idx: torch.Tensor | None  # int64 [K] as stored (None: absent or k // G)


@dataclass(frozen=True)
class Int4Format:
    name: str  # the reader's name ("gptq", "awq", "compressed-tensors-pack-quantized")
    note: str  # SOURCE_NOTE (manifest scheme_source)
    config: Callable  # (ckpt) -> cfg dict (SourceError when the config is not this format's, said why)
    scan: Callable  # (ckpt, cfg) -> {prefix: QModule}
    decode: Callable  # (ckpt, QModule, cfg) -> QLinear (perm/g_idx filled by decode_g_idx)
    read_g_idx: Callable  # (ckpt, QModule) -> int tensor [K] or None
    # the rule a refusal quotes when an expert weight is not this format's
    weights_rule: str = "int4 expert weights must all be quantized the same way"


# --------------------------------------------------------------------------- bit helpers


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> uint8 [..., 8C]: nibble j of word c is element 8c + j (LSB-first)."""
    w = words.to(torch.int32)
    return ((w.unsqueeze(-1) >> _SHIFTS) & 15).to(torch.uint8).flatten(-2)


def pack_nibbles(vals: torch.Tensor) -> torch.Tensor:
    """uint8/int [..., 8C] (0..15) -> int32 [..., C], the inverse of unpack_nibbles."""
    v = vals.to(torch.int64).unflatten(-1, (-1, 8))
    w = (v << _SHIFTS.to(torch.int64)).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def expand_groups(t: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """[N, ngroups] -> [N, K]: column k gets group k // G (G = -1: the one group)."""
    if group_size == -1:
        return t[:, :1].expand(t.shape[0], k)
    return t.repeat_interleave(group_size, dim=1)[:, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 ``(q - zero[g(k)]) * scale[g(k)]``, exact (a small integer times an fp16/bf16 scale)."""
    k = q.shape[-1]
    return (q.float() - expand_groups(zero, group_size, k).float()) * expand_groups(scale, group_size, k)


# --------------------------------------------------------------------------- validation


def check_dtype(ckpt: Checkpoint, name: str, allowed: set, rule: str) -> TensorInfo:
    ti = ckpt.info(name)
    if ti.dtype_str not in allowed:
        raise SourceError(f"tensor {name!r} has dtype {ti.dtype_str}: {rule}")
    return ti


def check_shape(ckpt: Checkpoint, name: str, want: tuple, why: str) -> None:
    got = tuple(ckpt.info(name).shape)
    if got != tuple(want):
        raise SourceError(f"tensor {name!r} has shape {list(got)}: expected {list(want)} ({why})")


def check_scales(name: str, s: torch.Tensor, largest: float | None = None, code: str = "") -> torch.Tensor:
    """``s`` as float32, or a SourceError naming the first NaN/Inf/zero/negative scale; with
    ``largest`` (the format's largest code magnitude, ``code`` its name) also the first scale
    whose product with it overflows float32: such a weight decodes to Inf."""
    s = s.float()
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        raise SourceError(f"tensor {name!r}{idx} = {s[tuple(idx)].item()!r}: scales must be finite and > 0")
    if largest is not None:
        over = ~torch.isfinite(s * largest)
        if bool(over.any()):
            idx = [int(i) for i in over.nonzero()[0]]
            raise SourceError(f"tensor {name!r}{idx} = {s[tuple(idx)].item()!r}: scale x {code} ({largest:g}) overflows "
                              f"float32: scales must be <= {torch.finfo(torch.float32).max / largest:.4g}, so that "
                              "every weight decodes to a finite value")  # fmt: skip
    return s


def check_zeros(name: str, z: torch.Tensor, why: str = "") -> torch.Tensor:
    """``z`` (a wide int tensor) as uint8, or a SourceError naming the first value outside 0..15."""
    bad = (z < 0) | (z > 15)
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        raise SourceError(f"tensor {name!r}{idx}: zero point {int(z[tuple(idx)])} is outside 0..15{why}")
    return z.to(torch.uint8)


def check_sym(name: str, zero: torch.Tensor) -> None:
    bad = zero != 8
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        raise SourceError(
            f"tensor {name!r}{idx}: zero point {int(zero[tuple(idx)])} in a symmetric checkpoint (sym=true): "
            "symmetric 4-bit zero points must all be 8"
        )


def decode_g_idx(name: str, g: torch.Tensor | None, k: int, group_size: int, ngroups: int) -> tuple:
    """(perm, g_idx) of a stored g_idx: perm = stable argsort when it is not ``k // G``, else None.

    A valid g_idx is an int tensor [K] with values in 0..ngroups-1 whose groups have exactly G
    members (the last one K - (ngroups-1)*G), as GPTQ act-order writes it: only then are the
    sorted groups the contiguous runs of G columns that ``k // G`` addresses."""
    if g is None:
        return None, None
    if g.dim() != 1 or g.numel() != k:
        raise SourceError(f"tensor {name!r} has shape {list(g.shape)}: expected [{k}] (one group index per input channel)")
    g = g.to(torch.int64)
    bad = (g < 0) | (g >= ngroups)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise SourceError(
            f"tensor {name!r}[{i}] = {int(g[i])}: group indices must lie in 0..{ngroups - 1} (ceil(K={k} / group_size={group_size}))"
        )
    gs = k if group_size == -1 else group_size
    if torch.equal(g, torch.arange(k) // gs):
        return None, g
    counts = torch.bincount(g, minlength=ngroups)
    want = torch.full((ngroups,), gs, dtype=torch.int64)
    want[-1] = k - (ngroups - 1) * gs
    if not torch.equal(counts, want):
        j = int((counts != want).nonzero()[0])
        raise SourceError(
            f"tensor {name!r}: group {j} has {int(counts[j])} input channels, expected {int(want[j])}: a g_idx must give "
            f"every group exactly group_size={gs} channels (the last {int(want[-1])}) so that sorting by it makes contiguous groups"
        )
    return torch.argsort(g, stable=True), g


# --------------------------------------------------------------------------- layers


def quantization_config(ckpt: Checkpoint) -> dict | None:
    from .dense import text_config

    qc = text_config(ckpt.config).get("quantization_config") or ckpt.config.get("quantization_config")
    return qc if isinstance(qc, dict) else None


class _View:
    """The checkpoint as discover_layers sees it: each quantized Linear ``P`` is ``P.weight`` of
    dtype I4 and shape [N, K]; its packed tensors are hidden; everything else is unchanged."""

    def __init__(self, ckpt: Checkpoint, mods: dict):
        self.path, self.config = ckpt.path, ckpt.config
        hidden = {n for m in mods.values() for n in m.tensors.values()}
        self.tensors = {n: ti for n, ti in ckpt.tensors.items() if n not in hidden}
        for p, m in mods.items():
            name = f"{p}.weight"
            if name in self.tensors:
                raise SourceError(f"tensor {name!r} is present next to the quantized {m.main!r}: a Linear is either float or quantized")
            ref = ckpt.info(m.main)
            self.tensors[name] = TensorInfo(name, ref.file, INT4, (m.n, m.k), ref.offset, ref.nbytes)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise SourceError(f"tensor {name!r} is missing from {self.path}") from None


def _mod(mods: dict, weight_name: str) -> QModule:
    return mods[weight_name[: -len(".weight")]]


def _facts(fmt_key: str, m: QModule, cfg: dict) -> dict:
    return {"group_size": m.group_size, "sym": m.sym, "scale_dtype": m.scale_dtype}


def make_layers(ckpt: Checkpoint, fmt: Int4Format) -> list[LayerSpec]:
    """Every MoE layer, its experts' QModules attached (spec.names[(e, role, "module")])."""
    cfg = fmt.config(ckpt)
    mods = fmt.scan(ckpt, cfg)
    view = _View(ckpt, mods)
    weights = (FLOAT_DTYPES | {INT4}, f"{fmt.name} expert weights must be 4-bit quantized ({fmt.weights_rule})")
    try:
        specs = discover_layers(view, weights)
    except SourceError as err:  # name the real tensors, not the view's stand-ins
        msg = str(err)
        for p, m in mods.items():
            msg = msg.replace(f"'{p}.weight'", f"'{m.main}' (as a 4-bit [N, K] Linear)")
        raise SourceError(msg) from None
    for s in specs:
        if s.kind != "per_expert":
            raise SourceError(
                f"layer {s.prefix!r}: expert tensors are fused ({s.kind}, {s.names.get('gate_up')!r}); {fmt.name} experts are "
                "per-expert Linear layers"
            )
        if s.dtype != INT4:
            name = s.names[(0, "gate", "weight")]
            raise SourceError(f"tensor {name!r} has dtype {s.dtype}: {weights[1]}")
        facts = None
        used = []
        act13 = act2 = False
        for e in range(s.num_experts):
            g13 = None
            for role in _ROLES:
                m = _mod(mods, s.names[(e, role, "weight")])
                s.names[(e, role, "module")] = m.prefix
                used += m.tensors.values()
                f = _facts(fmt.name, m, cfg)
                if facts is None:
                    facts = f
                elif f != facts:
                    raise SourceError(
                        f"tensor {m.main!r}: group_size={f['group_size']}, sym={f['sym']}, scales {f['scale_dtype']}, but "
                        f"the layer's other experts have group_size={facts['group_size']}, sym={facts['sym']}, scales "
                        f"{facts['scale_dtype']}: one MoE layer has one int4 scheme"
                    )
                perm, g = decode_g_idx(m.tensors.get("g_idx", m.main), fmt.read_g_idx(ckpt, m), m.k, m.group_size, m.ngroups)
                if role == "gate":
                    g13 = (m, perm, g)
                elif role == "up":
                    _same_g_idx(g13, (m, perm, g))
                    act13 |= perm is not None
                else:
                    act2 |= perm is not None
        s.expert_tensors = sorted(set(s.expert_tensors) - {s.names[(e, r, "weight")] for e in range(s.num_experts) for r in _ROLES} | set(used))
        if s.activation == "swigluoai":  # gpt-oss, linearized: gate/up de-interleaved; re-interleave
            s.interleaved = True
        s.quant = Int4Facts(**facts, format=cfg["format"], act_order=act13, w2_act_order=act2,
                            input_activations=cfg.get("input_activations"))  # fmt: skip
        for key in ("weight", "bias"):
            rn = s.router.get(key)
            if rn and view.info(rn).dtype_str not in FLOAT_DTYPES:
                raise SourceError(f"router tensor {rn!r} is quantized: the router must stay in float")
        if s.shared.get("gate") and view.info(s.shared["gate"]).dtype_str not in FLOAT_DTYPES:
            raise SourceError(f"tensor {s.shared['gate']!r} is quantized: the shared-expert gate must stay in float")
        if s.shared and view.info(s.shared["gate_proj"]).dtype_str == INT4:
            sm = [_mod(mods, s.shared[p]) for p in ("gate_proj", "up_proj", "down_proj")]
            fs = _facts(fmt.name, sm[0], cfg)
            for m in sm[1:]:
                if _facts(fmt.name, m, cfg) != fs:
                    raise SourceError(f"tensor {m.main!r}: the shared expert's projections are quantized differently")
            gi = [decode_g_idx(m.tensors.get("g_idx", m.main), fmt.read_g_idx(ckpt, m), m.k, m.group_size, m.ngroups) for m in sm]
            _same_g_idx((sm[0], *gi[0]), (sm[1], *gi[1]))
            s.shared["modules"] = [m.prefix for m in sm]
            for p, m in zip(("gate_proj", "up_proj", "down_proj"), sm):
                s.shared[p] = m.main  # a real tensor (convert names the shared expert's sources with these)
            s.quant = dataclasses.replace(s.quant, shared=Int4Facts(**fs, format=cfg["format"], act_order=gi[0][0] is not None,
                                                                    w2_act_order=gi[2][0] is not None))  # fmt: skip
    return specs


def _same_g_idx(a: tuple, b: tuple) -> None:
    (ma, _, ga), (mb, _, gb) = a, b
    eq = (ga is None and gb is None) or (ga is not None and gb is not None and torch.equal(ga, gb))
    if not eq:
        trivial = lambda m, g: g is None or torch.equal(g, torch.arange(m.k) // (m.k if m.group_size == -1 else m.group_size))  # noqa: E731
        if trivial(ma, ga) and trivial(mb, gb):
            return
        na, nb = ma.tensors.get("g_idx", ma.main), mb.tensors.get("g_idx", mb.main)
        raise SourceError(
            f"tensors {na!r} and {nb!r} differ: gate_proj and up_proj of one expert share their input, so they need the same "
            "g_idx (one input permutation)"
        )


# --------------------------------------------------------------------------- reading


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """rows 2j = gate_j, 2j+1 = up_j (swigluoai's canonical order)."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


class Int4Reader:
    """The SourceReader functions of one Int4Format (moepack/sources/__init__.py registers them)."""

    def __init__(self, fmt: Int4Format):
        self.fmt = fmt
        self.name = fmt.name
        self.scheme = SCHEME

    # -- modules
    def _cfg(self, ckpt):
        cache = ckpt.__dict__.setdefault("_int4_cfg", {})
        if self.fmt.name not in cache:
            cache[self.fmt.name] = self.fmt.config(ckpt)
        return cache[self.fmt.name]

    def _mods(self, ckpt):
        cache = ckpt.__dict__.setdefault("_int4_mods", {})
        if self.fmt.name not in cache:
            cache[self.fmt.name] = self.fmt.scan(ckpt, self._cfg(ckpt))
        return cache[self.fmt.name]

    def _decode(self, ckpt, prefix: str) -> tuple[QModule, QLinear]:
        m = self._mods(ckpt)[prefix]
        ql = self.fmt.decode(ckpt, m, self._cfg(ckpt))
        ql.perm, ql.g_idx = decode_g_idx(m.tensors.get("g_idx", m.main), self.fmt.read_g_idx(ckpt, m), m.k, m.group_size, m.ngroups)
        return m, ql

    def _ip(self, ckpt, prefix: str) -> torch.Tensor | None:
        m = self._mods(ckpt)[prefix]
        return decode_g_idx(m.tensors.get("g_idx", m.main), self.fmt.read_g_idx(ckpt, m), m.k, m.group_size, m.ngroups)[0]

    # -- one expert (routed or shared), as prefixes of its gate, up, down
    def _w13(self, ckpt, mods3: list, interleaved: bool, want_perm: bool) -> dict:
        (mg, g), (mu, u) = self._decode(ckpt, mods3[0]), self._decode(ckpt, mods3[1])
        _same_g_idx((mg, g.perm, g.g_idx), (mu, u.perm, u.g_idx))
        ip = self._ip(ckpt, mods3[2])
        parts = []
        for x in (g, u):
            q, sc, z = x.q, x.scale, x.zero
            if ip is not None:
                q, sc, z = q[ip], sc[ip], z[ip]
            if g.perm is not None:
                q = q[:, g.perm]
            parts.append((q, sc, z))
        join = _interleave if interleaved else (lambda a, b: torch.cat([a, b]))
        out = {
            "w13_q": join(parts[0][0], parts[1][0]).contiguous(),
            "w13_scale": join(parts[0][1], parts[1][1]).contiguous(),
            "w13_zero": join(parts[0][2], parts[1][2]).contiguous(),
        }
        if want_perm:
            perm = g.perm if g.perm is not None else torch.arange(mg.k)
            out["w13_perm"] = perm.to(torch.int32)
        return out

    def _w2(self, ckpt, prefix: str) -> dict:
        _, d = self._decode(ckpt, prefix)
        q = d.q if d.perm is None else d.q[:, d.perm].contiguous()
        return {"w2_q": q, "w2_scale": d.scale, "w2_zero": d.zero}

    def _mods3(self, s: LayerSpec, e: int) -> list:
        return [s.names[(e, r, "module")] for r in _ROLES]

    # -- SourceReader interface
    def detect(self, ckpt: Checkpoint) -> tuple[bool, str]:
        try:
            self.fmt.config(ckpt)
        except SourceError as err:
            return False, str(err)
        return True, self.fmt.note

    def layers(self, ckpt: Checkpoint) -> list[LayerSpec]:
        return make_layers(ckpt, self.fmt)

    def read_expert_canonical(self, ckpt: Checkpoint, s: LayerSpec, weight: str, e: int) -> dict[str, torch.Tensor]:
        """Scheme int4_group's canonical tensors of expert ``e``'s ``weight`` ("w13" or "w2")
        (module docstring: codes, scales, zeros, w13_perm; down's act-order folded into w13)."""
        if weight == "w13":
            return self._w13(ckpt, self._mods3(s, e), s.interleaved, s.quant.act_order)
        if weight == "w2":
            return self._w2(ckpt, s.names[(e, "down", "module")])
        raise KeyError(f"weight {weight!r}: expected 'w13' or 'w2'")

    def intermediate_perm(self, ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor | None:
        """Expert ``e``'s folded intermediate order (row j of gate/up = source channel ip[j]), or None."""
        return self._ip(ckpt, s.names[(e, "down", "module")])

    def _float13(self, c: dict, group_size: int) -> torch.Tensor:
        w = dequantize(c["w13_q"], c["w13_scale"], c["w13_zero"], group_size)
        if "w13_perm" in c:
            out = torch.empty_like(w)
            out[:, c["w13_perm"].long()] = w  # back to the original input-channel order
            return out
        return w

    def read_expert_w13(self, ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
        """fp32 [2I, H], original H order, folded intermediate order (module docstring)."""
        return self._float13(self.read_expert_canonical(ckpt, s, "w13", e), s.quant.group_size)

    def read_expert_w2(self, ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
        c = self.read_expert_canonical(ckpt, s, "w2", e)
        return dequantize(c["w2_q"], c["w2_scale"], c["w2_zero"], s.quant.group_size)

    def read_biases(self, ckpt: Checkpoint, s: LayerSpec):
        """[E, 2I] and [E, H] biases in canonical row order (folded and interleaved like w13), or (None, None)."""
        b13, b2 = dense_read_biases(ckpt, s)
        if b13 is None:
            return b13, b2
        i = s.intermediate
        rows = []
        for e in range(s.num_experts):
            g, u = b13[e, :i], b13[e, i:]
            ip = self.intermediate_perm(ckpt, s, e)
            if ip is not None:
                g, u = g[ip], u[ip]
            rows.append(_interleave(g, u) if s.interleaved else torch.cat([g, u]))
        return torch.stack(rows), b2

    def read_layer(self, ckpt: Checkpoint, s: LayerSpec) -> CanonicalLayer:
        per = [
            {**self.read_expert_canonical(ckpt, s, "w13", e), **self.read_expert_canonical(ckpt, s, "w2", e)}
            for e in range(s.num_experts)
        ]
        canon = {k: torch.stack([p[k] for p in per]) for k in per[0]}
        g = s.quant.group_size
        b13, b2 = self.read_biases(ckpt, s)
        return CanonicalLayer(
            spec=s,
            w13=torch.stack([self._float13(p, g) for p in per]),
            w2=torch.stack([dequantize(p["w2_q"], p["w2_scale"], p["w2_zero"], g) for p in per]),
            w13_bias=b13,
            w2_bias=b2,
            canonical=canon,
        )

    def read_shared_canonical(self, ckpt: Checkpoint, s: LayerSpec) -> dict[str, torch.Tensor] | None:
        """The quantized shared expert's canonical tensors as a one-expert set ({"w13_q": [1, 2Is, H], ...,
        "w13_perm": [1, H] when s.quant.shared.act_order}), or None (none, or a float one)."""
        if not s.shared or "modules" not in s.shared:
            return None
        mods3 = s.shared["modules"]
        c = {**self._w13(ckpt, mods3, False, s.quant.shared.act_order), **self._w2(ckpt, mods3[2])}
        return {k: v[None] for k, v in c.items()}

    def read_shared(self, ckpt: Checkpoint, s: LayerSpec):
        """The shared expert as float (w13 [1, 2Is, H] in original H order, w2 [1, H, Is]), or None."""
        c = self.read_shared_canonical(ckpt, s)
        if c is None:
            from .dense import read_shared as dense_read_shared

            return dense_read_shared(ckpt, s)
        g = s.quant.shared.group_size
        one = {k: v[0] for k, v in c.items()}
        return self._float13(one, g)[None], dequantize(one["w2_q"], one["w2_scale"], one["w2_zero"], g)[None]


__all__ = ["SCHEME", "INT4", "QModule", "QLinear", "Int4Format", "Int4Reader", "unpack_nibbles", "pack_nibbles", "dequantize"]


# --------------------------------------------------------------------------- carried Linears


def int4_linears(view, fmt: Int4Format, main_suffix: str, cfg: dict) -> dict:
    """The int4 Linears of one int4 format among ``view``'s tensors (its ``scan``), as carried
    Linears of codec "int4" (moepack/sources/linears.py)."""
    if not any(n.endswith(main_suffix) for n in view.tensors):
        return {}
    return {p: CarriedLinear(p, "int4", m.n, m.k, dict(m.tensors), fmt, m, cfg) for p, m in fmt.scan(view, cfg).items()}


def int4_values(view, lin, dequant: bool = True) -> torch.Tensor | None:
    """A carried int4 Linear's value checks (the format's ``decode``: scales, zero points, g_idx)
    and, when ``dequant``, its fp32 [N, K] weight."""
    m = lin.mod
    ql = lin.fmt.decode(view, m, lin.cfg)  # checks scales, zero points (range, symmetry)
    _, g_idx = decode_g_idx(m.tensors.get("g_idx", m.main), lin.fmt.read_g_idx(view, m), m.k, m.group_size, m.ngroups)
    if not dequant:
        return None
    if g_idx is None:
        return dequantize(ql.q, ql.scale, ql.zero, m.group_size)
    g = g_idx.long()
    return (ql.q.float() - ql.zero.float()[:, g]) * ql.scale[:, g]
