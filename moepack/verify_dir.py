"""``moepack verify DST [--source SRC]``: prove a packed directory intact and equal to its source.

1. Structure: the manifest, every shard header, alignment, shapes against layout math
   (everything ``moepack.open`` checks).
2. Integrity: the sha256 of every tensor's bytes against the manifest (a flipped byte names the
   tensor).
3. With the source: every layer's packed weights unpacked equal the source's weights rounded
   to bf16, exactly, padding included (zero); and the packed layer's output on seeded random
   tokens matches ``moepack.reference`` run on the source's own weights.
   int8 layers (scheme int8_channel): the packed codes, scales and column sums equal the
   source's own int8 codes and scales (or, for a dense source quantized by moepack,
   ``quantize_int8_per_channel`` of its weights) exactly; the output matches
   ``moe_reference_int8`` on those codes (1e-5, up to two intermediate-code flips: see
   tests/reference/tolerances.py) and the fp32 reference on the source's weights (3e-2).
   The shared expert (DeepSeek/GLM ``shared_experts``, Qwen2-MoE ``shared_expert`` with its
   ``shared_expert_gate``, Llama-4 ``shared_expert``) is held to the same rules as a one-expert
   set: ``shared_w13`` / ``shared_w2`` (and, int8, their scales and column sums) exactly, its
   gate bit for bit, and its gated output is part of the layer output compared.
   A differing tensor is named with its first differing element ([expert, row, col] of the
   unpacked values), both values and the rule; the report counts the tensors compared.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .errors import MoepackError
from .pack import PackedExperts, unpack_weight_reference
from .reference import moe_reference
from .schemes import get_scheme
from .runtime.model import PackedModel, open_packed

CHUNK = 64 << 20


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, streamed in chunks (no second copy of a large tensor)."""
    h = hashlib.sha256()
    flat = t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    n = flat.numel()
    for i in range(0, n, CHUNK):
        h.update(memoryview(flat[i : i + CHUNK].numpy()))
    return h.hexdigest()


@dataclass
class TensorCheck:
    name: str
    file: str
    ok: bool
    detail: str = ""


@dataclass
class LayerCheck:
    index: int
    weights_exact: bool
    rel_err: float
    tol: float
    ok: bool
    detail: str = ""
    rel_err_fp32: float | None = None  # int8 layers: vs the fp32 reference on the source's weights
    shared_exact: bool | None = None  # the shared expert's tensors (and gate) equal the source's; None: none
    tensors: dict = field(default_factory=dict)  # routed experts: packed tensor name -> equal to the source
    shared_tensors: dict = field(default_factory=dict)  # the shared expert's, likewise


@dataclass
class VerifyReport:
    path: Path
    tensors: list[TensorCheck] = field(default_factory=list)
    layers: list[LayerCheck] = field(default_factory=list)
    source: str | None = None
    fingerprint_match: bool | None = None

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tensors) and all(layer.ok for layer in self.layers)

    def weights_checked(self, shared: bool = False) -> tuple[int, int]:
        """(equal, checked): packed expert tensors compared with the source (``shared``: only
        the shared experts')."""
        res = [v for c in self.layers for v in c.shared_tensors.values()]
        if not shared:
            res += [v for c in self.layers for v in c.tensors.values()]
        return sum(res), len(res)

    def failures(self) -> list[str]:
        out = [f"tensor {t.name!r} in {t.file}: {t.detail}" for t in self.tensors if not t.ok]
        out += [f"layer {c.index}: {c.detail}" for c in self.layers if not c.ok]
        return out

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "source": self.source,
            "fingerprint_match": self.fingerprint_match,
            "tensors_checked": len(self.tensors),
            "weights_checked": self.weights_checked()[1],
            "shared_weights_checked": self.weights_checked(shared=True)[1],
            "failures": self.failures(),
            "layers": [c.__dict__ for c in self.layers],
        }


def _check_tensors(model: PackedModel, report: VerifyReport, notify) -> None:
    for name, e in model.manifest["tensors"].items():
        digest = tensor_sha256(model.tensor(name))
        ok = digest == e.get("sha256")
        report.tensors.append(
            TensorCheck(name, e["file"], ok, "" if ok else f"sha256 {digest[:16]}… differs from the manifest's {str(e.get('sha256'))[:16]}…")
        )
        notify("tensor", name=name, ok=ok)




def _tokens(model: PackedModel, layer_index: int, e: int, h: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed + layer_index)
    x = torch.randn(tokens, h, generator=g)
    logits = torch.randn(tokens, e, generator=g)
    k = min(int(model.routing["top_k"]) if model.routing else 2, e)
    w, ids = torch.softmax(logits, -1).topk(k)
    return x, w.contiguous(), ids.to(torch.int32).contiguous()


@dataclass
class _Want:
    """What one packed expert set (a layer's routed experts, or its shared expert as a one-expert
    set) must hold, from the source."""

    w13: torch.Tensor  # canonical [E, 2I, H], source dtype (int8 sources: q * scale in fp32)
    w2: torch.Tensor  # [E, H, I]
    rule: str  # where the packed values come from, for messages
    canonical: dict  # the scheme's canonical tensors (moepack.schemes: Scheme.canonical), as packed
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None


def _want(scheme, w13, w2, q: dict | None, reader_name: str, layout, w13_bias=None, w2_bias=None) -> _Want:
    """``q``: the source's own canonical tensors of ``scheme`` (an int8 source's codes and
    scales), or None: the scheme makes them from the float weights for ``layout``, as convert did."""
    if q is not None and scheme.name != "dense":
        c = dict(q)
        if layout.scheme == "int4_group":
            c.setdefault("group_size", layout.group_size or -1)
        return _Want(w13, w2, scheme.rule("I8", reader_name), c, w13_bias, w2_bias)
    return _Want(w13, w2, scheme.rule("", reader_name), scheme.from_float(w13, w2, layout=layout), w13_bias, w2_bias)


def _unpacked(t: torch.Tensor, name: str, p: PackedExperts) -> torch.Tensor:
    """Codes in logical [E, N, K] order, padding included (other tensors as they are)."""
    if name in ("w13", "w2"):
        if p.layout.weight_bits < 8:  # sub-byte codes: [E, Np, Kp * bits / 8] bytes
            from .pack.int4 import unpack_u4_codes

            return unpack_u4_codes(t, t.shape[1], t.shape[2] * 8 // p.layout.weight_bits, p.layout)
        return unpack_weight_reference(t, *t.shape[1:], p.layout)
    return t


def _expected_tensors(p: PackedExperts, want: _Want, scheme) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (the packed tensor's values, every padding element included: codes unpacked to
    [E, N, K]; what they must be): the scheme's Python spec packer run on the source's canonical
    tensors (padding must be zero, as it packs it)."""
    c = dict(want.canonical)
    if want.w13_bias is not None and p.w13_bias is not None:
        c["w13_bias"] = want.w13_bias
    if want.w2_bias is not None and p.w2_bias is not None:
        c["w2_bias"] = want.w2_bias
    spec = scheme.pack(c, interleaved=p.interleaved, layout=p.layout, use_cpp=False)
    return {
        name: (_unpacked(got, name, p), _unpacked(spec.tensors[name], name, p))
        for name, got in p.tensors.items()
        if name in spec.tensors
    }


def _where(role: str, idx: list[int], p: PackedExperts) -> str:
    """Element ``idx`` of ``role``'s unpacked values in words: [expert, row (output channel), col]."""
    if role.endswith("_perm"):
        return f"[expert {idx[0]}, code column {idx[1]}]" if len(idx) == 2 else str(idx)
    if not role.startswith(("w13", "w2")):
        return str(idx)
    i, ip, h = p.intermediate, p.padded_intermediate, p.hidden
    parts = [f"expert {idx[0]}"]
    r = idx[1]
    if role.startswith("w13"):
        if p.interleaved:
            parts.append(f"{'gate' if r % 2 == 0 else 'up'} row {r // 2}" if r < 2 * i else f"padding row {r}")
        else:
            parts.append(f"gate row {r}" if r < i else f"up row {r - ip}" if ip <= r < ip + i else f"padding row {r}")
        if len(idx) > 2:
            parts.append(f"col {idx[2]}" if idx[2] < h else f"padding col {idx[2]}")
    else:
        parts.append(f"row {r}" if r < h else f"padding row {r}")
        if len(idx) > 2:
            parts.append(f"col {idx[2]}" if idx[2] < i else f"padding col {idx[2]}")
    return "[" + ", ".join(parts) + "]"


_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _difference(name: str, role: str, got: torch.Tensor, want: torch.Tensor, p: PackedExperts, rule: str) -> str | None:
    """None when ``got`` equals ``want`` bit for bit; else the first differing element named."""
    if got.dtype != want.dtype:  # the manifest's shapes and dtypes were checked by open
        return f"tensor {name!r} is {got.dtype}, {rule} is {want.dtype}"
    bits = _BITS.get(got.dtype)
    diff = (got.view(bits) != want.view(bits)) if bits else (got != want)
    n = int(diff.sum())
    if n == 0:
        return None
    idx = diff.nonzero()[0].tolist()
    g, w = got[tuple(idx)].item(), want[tuple(idx)].item()
    return (
        f"tensor {name!r} {_where(role, idx, p)} is {g!r}, {rule} gives {w!r} "
        f"({n} of {got.numel()} elements differ; packed values must equal it exactly)"
    )


def _compare(p: PackedExperts, names: dict, want: _Want, what: str, results: dict, problems: list, scheme) -> bool:
    """Every packed tensor of ``p`` (``names``: role -> tensor name) against ``want``: results
    ``{name: equal}``, a message per differing tensor. False when the shapes do not even agree."""
    e, h, i = p.num_experts, p.hidden, p.intermediate
    if tuple(want.w13.shape) != (e, 2 * i, h) or tuple(want.w2.shape) != (e, h, i):
        problems.append(
            f"the source's {what}: w13 {list(want.w13.shape)}, w2 {list(want.w2.shape)}; the packed {what}: "
            f"E={e}, H={h}, I={i} (w13 [{e}, {2 * i}, {h}], w2 [{e}, {h}, {i}]): shapes must agree"
        )
        results.update({names[r]: False for r in ("w13", "w2")})
        return False
    for role, src_b, packed_b in (("w13_bias", want.w13_bias, p.w13_bias), ("w2_bias", want.w2_bias, p.w2_bias)):
        if (src_b is None) != (packed_b is None):
            has, lacks = ("the source", "the packed " + what) if packed_b is None else ("the packed " + what, "the source")
            problems.append(f"{role}: {has} has one and {lacks} does not: biases must be packed exactly when the source has them")
            # a missing tensor fails the weights check as a differing one does (listed under its role)
            results[names[role] if packed_b is not None else f"{role} (missing from the packed {what})"] = False
    for role, (got, exp) in _expected_tensors(p, want, scheme).items():
        msg = _difference(names[role], role, got, exp, p, want.rule)
        results[names[role]] = msg is None
        if msg:
            problems.append(msg)
    return True


def _shared_want(ckpt, reader, spec, scheme, layout) -> _Want:
    """The source's shared expert as convert packs it (convert_dir: float, or the int8 source's
    own codes, or quantized by moepack when the source's shared expert is float)."""
    w13, w2 = reader.read_shared(ckpt, spec)
    q = reader.read_shared_canonical(ckpt, spec) if reader.scheme == scheme.name != "dense" else None
    return _want(scheme, w13, w2, q, reader.name, layout)


def _check_shared(ckpt, reader, spec, layer, results: dict, problems: list) -> tuple[_Want | None, torch.Tensor | None]:
    """The layer's shared expert (its packed tensors and its gate) against the source's: returns
    (what it must hold, the source's gate or None) when both sides have one of the same shape,
    for the output check; else (None, None)."""
    sh = layer.entry.get("shared") or {}
    if not spec.shared and layer.shared is None:
        return None, None
    if not spec.shared or layer.shared is None:
        have, lack = ("packed layer", "source") if sh else ("source", "packed layer")
        names = [sh["w13"], sh["w2"]] if sh else [spec.shared[r] for r in ("gate_proj", "up_proj", "down_proj")]
        problems.append(f"the {have} has a shared expert ({', '.join(map(repr, names))}), the {lack} has none")
        results.update(dict.fromkeys(names, False))
        return None, None
    scheme = get_scheme(layer.packed.layout)
    want = _shared_want(ckpt, reader, spec, scheme, layer.packed.layout)
    if not _compare(layer.shared, sh, want, "shared expert", results, problems, scheme):
        return None, None
    gate = ckpt.read(spec.shared["gate"]) if spec.shared.get("gate") else None
    if (gate is None) != (layer.shared_gate is None):
        problems.append(f"shared-expert gate: the source has {spec.shared.get('gate')!r}, the packed layer has {sh.get('gate')!r}")
        results[sh.get("gate") or spec.shared["gate"]] = False
        return None, None
    if gate is not None:
        if tuple(layer.shared_gate.shape) != tuple(gate.shape):
            msg = f"tensor {sh['gate']!r} has shape {list(layer.shared_gate.shape)}, the source's {list(gate.shape)}"
        else:
            msg = _difference(sh["gate"], "gate", layer.shared_gate, gate, layer.shared, f"the source's {spec.shared['gate']!r}")
        results[sh["gate"]] = msg is None
        if msg:
            problems.append(msg)
    return want, gate


def _check_layer(model: PackedModel, layer_index: int, ckpt, reader, spec, tokens: int, seed: int) -> LayerCheck:
    layer = model.layers[layer_index]
    p = layer.packed
    scheme = get_scheme(p.layout)
    canon = reader.read_layer(ckpt, spec)
    q = canon.canonical if reader.scheme == scheme.name else None
    routed = _want(scheme, canon.w13, canon.w2, q, reader.name, p.layout, canon.w13_bias, canon.w2_bias)
    tensors, shared_tensors, problems = {}, {}, []
    shapes_ok = _compare(p, layer.entry["tensors"], routed, "experts", tensors, problems, scheme)
    exact = shapes_ok and all(tensors.values())
    shared, gate = _check_shared(ckpt, reader, spec, layer, shared_tensors, problems)
    shared_exact = all(shared_tensors.values()) if shared_tensors else None
    if not shapes_ok:  # another model: no output to compare
        nan = float("nan")
        detail = "packed weights differ from the source: " + "; ".join(problems)
        return LayerCheck(layer_index, False, nan, nan, False, detail, None, shared_exact, tensors, shared_tensors)

    # numerics on seeded tokens: the packed layer's experts (+ its shared expert, gated as the
    # block gates it) against the scheme's reference on the canonical tensors, and (schemes
    # with an fp32 tolerance) the fp32 reference on the source's own weights
    x, w, ids = _tokens(model, layer_index, p.num_experts, p.hidden, tokens, seed)
    kw = dict(activation=layer.activation, alpha=layer.alpha, limit=layer.limit, interleaved=p.interleaved,
              w13_bias=routed.w13_bias, w2_bias=routed.w2_bias)  # fmt: skip
    mode = layer.act_mode  # the layer's own (the manifest's act_mode, or MOEPACK_ACT_MODE)
    rkw = dict(act_mode=mode) if len(p.layout.act_modes) > 1 else {}  # the reference of a two-mode scheme takes it
    out = layer.experts(x, w, ids, act_mode=mode)
    ref32 = moe_reference(x, routed.w13, routed.w2, w, ids, **kw)
    ref, flip = scheme.reference(x, routed.canonical, w, ids, **kw, **rkw)
    if shared is not None:
        sw = torch.ones(x.shape[0], 1) if gate is None else torch.sigmoid(torch.nn.functional.linear(x, gate.float()))
        sid = torch.zeros(x.shape[0], 1, dtype=torch.int32)
        out = out + layer.shared_expert(x, act_mode=mode)
        ref32 = ref32 + moe_reference(x, shared.w13, shared.w2, sw, sid)
        r, f = scheme.reference(x, shared.canonical, sw, sid, **rkw)
        ref, flip = ref + r, max(flip, f)
    dtypes = {spec.dtype} | ({ckpt.info(spec.shared["gate_proj"]).dtype_str} if shared is not None else set())
    orule = scheme.output_rule(dtypes)
    norm = float(ref.norm().clamp_min(1e-30))
    rel = float((out - ref).norm()) / norm
    tol = max(orule.base, orule.flips * flip / norm)
    rel32 = float((out - ref32).norm() / ref32.norm().clamp_min(1e-30)) if orule.fp32_tol is not None else None
    ok = exact and shared_exact is not False and rel <= tol and (rel32 is None or rel32 <= orule.fp32_tol)
    detail = ["packed weights differ from the source: " + "; ".join(problems)] if problems else []
    if rel > tol:
        ref_name = "the reference" if scheme.name == "dense" else f"the {scheme.name} reference"
        detail.append(f"output differs from {ref_name}: relative error {rel:.3g} > {tol:.3g}")
    if rel32 is not None and rel32 > orule.fp32_tol:
        detail.append(f"output differs from the fp32 reference on the source's weights: {rel32:.3g} > {orule.fp32_tol:g}")
    return LayerCheck(layer_index, exact, rel, tol, ok, "; ".join(detail), rel32, shared_exact, tensors, shared_tensors)

def verify(
    dst: str | Path,
    *,
    source: str | Path | None = None,
    tokens: int = 7,
    seed: int = 0,
    progress: Callable | None = None,
) -> VerifyReport:
    """Verify the packed directory at ``dst``; see the module docstring."""
    notify = progress or (lambda *a, **k: None)
    model = open_packed(dst)
    report = VerifyReport(path=Path(dst))
    _check_tensors(model, report, notify)
    if source is not None:
        from .sources import open_source

        ckpt, reader = open_source(source)
        report.source = str(source)
        report.fingerprint_match = ckpt.fingerprint() == model.manifest["source"].get("fingerprint")
        specs = {s.index: s for s in reader.layers(ckpt)}
        for idx in sorted(model.layers):
            if idx not in specs:
                raise MoepackError(f"layer {idx} of {dst} has no MoE layer in the source {source}")
            report.layers.append(_check_layer(model, idx, ckpt, reader, specs[idx], tokens, seed))
            notify("layer", index=idx, ok=report.layers[-1].ok)
    return report


__all__ = ["verify", "VerifyReport", "tensor_sha256"]
