"""Step 3 of verify: one layer's packed weights and outputs against the source, block by block.

``check_layer`` takes one block of experts at a time (how many: moepack.verify.run's
``BLOCK_BYTES``, passed in): the block's source weights as convert packed them (``_Want``: the
scheme's canonical tensors, a quantized source's own codes), its packed tensors read with pread,
every packed tensor compared bit for bit with what the scheme's Python spec packer makes of the
source (``_compare``; a difference named at its [expert, row, col]), and the block's part of the
output against the scheme's reference (and the fp32 one). The shared expert is checked as a
one-expert set (``_check_shared``). Apart from run.py because it is the numeric heart of
verify and its largest part; run.py only drives it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import PackedDirError
from ..pack import PackedExperts, unpack_codes
from ..reference import moe_reference
from ..runtime.experts import run_experts
from ..runtime.model import PackedModel
from ..schemes import get_scheme
from .report import LayerCheck


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


def _want(scheme, w13, w2, q: dict | None, source_dtype: str, reader_name: str, layout, w13_bias=None, w2_bias=None,
          options=None) -> _Want:  # fmt: skip
    """``q``: the source's own canonical tensors of ``scheme`` (a quantized source's codes and
    scales), or None: the scheme makes them from the float weights for ``layout`` with the
    quantizer ``options`` convert recorded, as convert did. ``source_dtype``: the stored dtype of
    the source's weights (the scheme's words for where the values come from depend on it)."""
    rule = scheme.rule(source_dtype, reader_name)
    if q is not None:
        return _Want(w13, w2, rule, scheme.complete(dict(q), layout), w13_bias, w2_bias)
    return _Want(w13, w2, rule, scheme.from_float(w13, w2, layout=layout, options=options), w13_bias, w2_bias)


def unpacked_values(t: torch.Tensor, name: str, p: PackedExperts) -> torch.Tensor:
    """Codes in logical [E, N, K] order, padding included (other tensors as they are)."""
    if name in ("w13", "w2"):  # every code type, through the layout's own arrangement and code order
        return unpack_codes(p.layout, t)
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
    if p.gated:
        spec = scheme.pack(c, interleaved=p.interleaved, layout=p.layout, use_cpp=False)
    else:  # non-gated (relu2) experts: float only (convert refuses them in a quantized scheme), w13 the up rows
        from ..pack import pack_w2, pack_w13

        t = {"w13": pack_w13(c["w13"], layout=p.layout, use_cpp=False, gated=False), "w2": pack_w2(c["w2"], layout=p.layout, use_cpp=False)}
        spec = PackedExperts(p.layout, p.num_experts, p.hidden, p.intermediate, p.padded_intermediate, False, t, gated=False)
    return {
        name: (unpacked_values(got, name, p), unpacked_values(spec.tensors[name], name, p))
        for name, got in p.tensors.items()
        if name in spec.tensors
    }


def _where(role: str, idx: list[int], p: PackedExperts, e0: int = 0) -> str:
    """Element ``idx`` of ``role``'s unpacked values in words: [expert, row (output channel), col]
    (``e0``: the first expert of the block ``p`` holds)."""
    idx = [idx[0] + e0, *idx[1:]] if idx else idx
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


def _difference(name: str, role: str, got: torch.Tensor, want: torch.Tensor, p: PackedExperts, rule: str,
                e0: int = 0, experts: int | None = None) -> str | None:  # fmt: skip
    """None when ``got`` equals ``want`` bit for bit; else the first differing element named
    (``e0``/``experts``: the block of experts compared, of the layer's ``experts``)."""
    if got.dtype != want.dtype:  # the manifest's shapes and dtypes were checked by open
        return f"tensor {name!r} is {got.dtype}, {rule} is {want.dtype}"
    bits = _BITS.get(got.dtype)
    diff = (got.view(bits) != want.view(bits)) if bits else (got != want)
    n = int(diff.sum())
    if n == 0:
        return None
    idx = diff.nonzero()[0].tolist()
    g, w = got[tuple(idx)].item(), want[tuple(idx)].item()
    block = "" if experts is None or (e0 == 0 and p.num_experts == experts) else f", in experts {e0}..{e0 + p.num_experts - 1}"
    return (
        f"tensor {name!r} {_where(role, idx, p, e0)} is {g!r}, {rule} gives {w!r} "
        f"({n} of {got.numel()} elements differ{block}; packed values must equal it exactly)"
    )


def _compare(p: PackedExperts, names: dict, want: _Want, what: str, results: dict, problems: list, scheme,
             e0: int = 0, experts: int | None = None) -> bool:  # fmt: skip
    """Every packed tensor of ``p`` (``names``: role -> tensor name) against ``want``: results
    ``{name: equal}``, a message per differing tensor. False when the shapes do not even agree.
    ``p``/``want`` may be a block of a layer's experts (from ``e0``, of ``experts``): a tensor is
    equal when every block's part is, and named once, at its first differing block."""
    e, h, i = p.num_experts, p.hidden, p.intermediate
    r = 2 if p.gated else 1  # w13 rows per intermediate column: gate and up, or up alone (relu2)
    if tuple(want.w13.shape) != (e, r * i, h) or tuple(want.w2.shape) != (e, h, i):
        problems.append(
            f"the source's {what}: w13 {list(want.w13.shape)}, w2 {list(want.w2.shape)}; the packed {what}: "
            f"E={e}, H={h}, I={i} (w13 [{e}, {r * i}, {h}], w2 [{e}, {h}, {i}]): shapes must agree"
        )
        results.update({names[r]: False for r in ("w13", "w2")})
        return False
    for role, src_b, packed_b in (("w13_bias", want.w13_bias, p.w13_bias), ("w2_bias", want.w2_bias, p.w2_bias)):
        if (src_b is None) != (packed_b is None) and e0 == 0:
            has, lacks = ("the source", "the packed " + what) if packed_b is None else ("the packed " + what, "the source")
            problems.append(f"{role}: {has} has one and {lacks} does not: biases must be packed exactly when the source has them")
            # a missing tensor fails the weights check as a differing one does (listed under its role)
            results[names[role] if packed_b is not None else f"{role} (missing from the packed {what})"] = False
    for role, (got, exp) in _expected_tensors(p, want, scheme).items():
        msg = _difference(names[role], role, got, exp, p, want.rule, e0, experts)
        if msg and results.get(names[role], True):
            problems.append(msg)
        results[names[role]] = results.get(names[role], True) and msg is None
    return True


def _shared_want(ckpt, reader, spec, scheme, layout, options=None) -> _Want:
    """The source's shared expert as convert packs it (convert/run.py: float, or the quantized
    source's own codes, or quantized by moepack when the source's shared expert is float)."""
    w13, w2 = reader.read_shared(ckpt, spec)
    q = reader.read_shared_canonical(ckpt, spec) if scheme.keeps_source(reader) else None
    return _want(scheme, w13, w2, q, ckpt.info(spec.shared["gate_proj"]).dtype_str, reader.name, layout, options=options)


def _check_shared(ckpt, reader, spec, layer, results: dict, problems: list, options=None) -> tuple[_Want | None, torch.Tensor | None]:
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
    scheme = get_scheme(layer.shared.layout)  # the layer's, or a float shared expert's own (kept float)
    want = _shared_want(ckpt, reader, spec, scheme, layer.shared.layout, options)
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


def _block_size(spec, block_bytes: int) -> int:
    """Experts per step of the weight and output checks: ``block_bytes`` (run.py's
    BLOCK_BYTES) of fp32 weights, >= 1."""
    return max(1, block_bytes // (4 * 3 * spec.hidden * spec.intermediate))


def read_rows(model: PackedModel, name: str, e0: int, e1: int) -> torch.Tensor:
    """Rows ``[e0, e1)`` (dim 0: experts) of a packed tensor, read with pread: a copy of that block
    only, and no page of the directory's mapping touched."""
    shard = model._shards[model.manifest["tensors"][name]["file"]]
    info = shard.info(name)
    row = info.nbytes // info.shape[0]
    out = torch.empty((e1 - e0, *info.shape[1:]), dtype=info.torch_dtype)
    buf = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    with open(shard.path, "rb", buffering=0) as f:
        done = 0
        while done < len(buf):
            n = os.preadv(f.fileno(), [buf[done:]], info.file_offset + e0 * row + done)
            if n <= 0:
                raise PackedDirError(f"{shard.path}: short read of tensor {name!r} (file truncated while verifying?)")
            done += n
    return out


def _packed_block(model: PackedModel, layer, e0: int, e1: int, rank_problems: dict | None = None) -> PackedExperts:
    """Experts ``[e0, e1)`` of the layer's packed tensors. A ``--tp`` pack's are reassembled into
    whole experts from rank 0's copy of the tensors every rank keeps; a problem with another
    rank's copy goes to ``rank_problems`` (tensor name -> message)."""
    p = layer.packed
    names = layer.entry["tensors"]
    if p.tp > 1:  # a --tp pack: the block's rows of every rank, reassembled into whole experts (moepack/tp.py)
        from ..tp import rank_copy_problem, tp_unslice

        e = p.num_experts
        tensors = {role: torch.cat([read_rows(model, names[role], r * e + e0, r * e + e1) for r in range(p.tp)])
                   for role in p.tensors}  # fmt: skip
        for role, t in tensors.items():
            msg = rank_copy_problem(p.layout, role, names[role], t, p.tp, e0)
            if msg and rank_problems is not None:
                rank_problems.setdefault(names[role], msg)
        return tp_unslice(PackedExperts(layout=p.layout, num_experts=e1 - e0, hidden=p.hidden, intermediate=p.intermediate,
                                        padded_intermediate=p.padded_intermediate, interleaved=p.interleaved,
                                        tensors=tensors, act_mode=p.act_mode, tp=p.tp, gated=p.gated))  # fmt: skip
    tensors = {role: read_rows(model, names[role], e0, e1) for role in p.tensors}
    return PackedExperts(layout=p.layout, num_experts=e1 - e0, hidden=p.hidden, intermediate=p.intermediate,
                         padded_intermediate=p.padded_intermediate, interleaved=p.interleaved, tensors=tensors,
                         act_mode=p.act_mode, gated=p.gated)  # fmt: skip


def _source_block(ckpt, reader, spec, scheme, layout, e0: int, e1: int, biases, options=None) -> _Want:
    """What experts ``[e0, e1)`` of the layer must hold, from the source, as convert made it (the
    per-expert readers convert streams from; a quantized source's own canonical tensors)."""
    w13 = torch.stack([reader.read_expert_w13(ckpt, spec, e) for e in range(e0, e1)])
    w2 = torch.stack([reader.read_expert_w2(ckpt, spec, e) for e in range(e0, e1)])
    q = None
    if scheme.keeps_source(reader):
        per = [{**reader.read_expert_canonical(ckpt, spec, "w13", e), **reader.read_expert_canonical(ckpt, spec, "w2", e)}
               for e in range(e0, e1)]  # fmt: skip
        q = {k: torch.stack([x[k] for x in per]) for k in per[0]}
    b13, b2 = biases
    return _want(scheme, w13, w2, q, spec.dtype, reader.name, layout, None if b13 is None else b13[e0:e1],
                 None if b2 is None else b2[e0:e1], options)  # fmt: skip


def _local_routes(w: torch.Tensor, ids: torch.Tensor, e0: int, e1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routes to experts ``[e0, e1)`` as local ids, every other route weighted 0 (to local
    expert 0: 0 x a finite output adds nothing)."""
    inside = (ids >= e0) & (ids < e1)
    return torch.where(inside, w, torch.zeros_like(w)).contiguous(), torch.where(inside, ids - e0, torch.zeros_like(ids)).contiguous()


def _nonfinite(out: torch.Tensor, ref: torch.Tensor, ref_name: str) -> str | None:
    """None when the packed layer's output and ``ref`` are both finite everywhere; else what is
    not: how many NaN / Inf values each has and the first element where they differ in it."""
    bad_o, bad_r = ~torch.isfinite(out), ~torch.isfinite(ref)
    if not bool(bad_o.any()) and not bool(bad_r.any()):
        return None
    where = (bad_o | bad_r).nonzero()[0].tolist()
    o, r = out[tuple(where)].item(), ref[tuple(where)].item()
    return (f"output is not finite: the packed layer gives {int(bad_o.sum())} NaN/Inf of {out.numel()} values, {ref_name} "
            f"{int(bad_r.sum())} (first at [token {where[0]}, column {where[1]}]: {o!r} vs {r!r}); the weights' products "
            "overflow float32 or a NaN reached them")  # fmt: skip


def check_layer(model: PackedModel, layer_index: int, ckpt, reader, spec, tokens: int, seed: int, options=None, *,
                 block_bytes: int) -> LayerCheck:  # fmt: skip
    """One layer against the source, one block of experts at a time (``block_bytes`` of fp32
    weights, at least one expert; this module's and moepack.verify.run's docstrings)."""
    layer = model.layers[layer_index]
    p = layer.packed
    scheme = get_scheme(p.layout)
    e_all = p.num_experts
    tensors, shared_tensors, problems = {}, {}, []
    if (spec.num_experts, spec.hidden, spec.intermediate) != (e_all, p.hidden, p.intermediate):
        problems.append(
            f"the source's experts: E={spec.num_experts}, H={spec.hidden}, I={spec.intermediate}; the packed experts: "
            f"E={e_all}, H={p.hidden}, I={p.intermediate}: shapes must agree"
        )
        tensors.update({layer.entry["tensors"][r]: False for r in ("w13", "w2")})
        nan = float("nan")
        detail = "packed weights differ from the source: " + "; ".join(problems)
        return LayerCheck(layer_index, False, nan, nan, False, detail, None, None, tensors, shared_tensors)

    # numerics on seeded tokens, accumulated block by block: the packed layer's experts (the
    # kernel restricted to the block by expert_map) against the scheme's reference on the block's
    # canonical tensors and (schemes with an fp32 tolerance) the fp32 reference on its weights
    x, w, ids = _tokens(model, layer_index, e_all, p.hidden, tokens, seed)
    from ..convert.plan import silu_limit_of
    from ..sources import text_config

    # the source's clamp (its config), not the pack's: a pack that leaves it out computes otherwise
    src_sl = silu_limit_of(text_config(ckpt.config), spec)
    kw = dict(activation=layer.activation, alpha=layer.alpha, limit=layer.limit, interleaved=p.interleaved, silu_limit=src_sl)
    # the manifest's act_mode (proved against the source's meaning by model.py), never
    # MOEPACK_ACT_MODE: verify proves what the pack says it runs
    mode = layer.entry.get("act_mode") or p.layout.act_modes[0]
    rkw = dict(act_mode=mode) if len(p.layout.act_modes) > 1 else {}  # the reference of a two-mode scheme takes it
    layer.check_strict()
    biases = reader.read_biases(ckpt, spec)
    out = torch.zeros(x.shape, dtype=torch.float32)
    ref, ref32, flip = torch.zeros_like(out), torch.zeros_like(out), 0.0
    step = _block_size(spec, block_bytes)
    for e0 in range(0, e_all, step):
        e1 = min(e_all, e0 + step)
        want = _source_block(ckpt, reader, spec, scheme, p.layout, e0, e1, biases, options)
        rank_problems: dict[str, str] = {}
        block = _packed_block(model, layer, e0, e1, rank_problems)
        _compare(block, layer.entry["tensors"], want, "experts", tensors, problems, scheme, e0, e_all)
        for name, msg in rank_problems.items():  # a --tp pack's other ranks' copies (moepack/tp.py)
            if tensors.get(name, True):
                problems.append(msg)
            tensors[name] = False
        emap = torch.full((e_all,), -1, dtype=torch.int32)
        emap[e0:e1] = torch.arange(e1 - e0, dtype=torch.int32)
        out += run_experts(block, x, w, ids, activation=layer.activation, alpha=layer.alpha, limit=layer.limit,
                           expert_map=emap, act_mode=mode, silu_limit=layer.silu_limit).float()  # fmt: skip
        wb, ib = _local_routes(w, ids, e0, e1)
        bkw = dict(kw, w13_bias=want.w13_bias, w2_bias=want.w2_bias)
        ref32 += moe_reference(x, want.w13, want.w2, wb, ib, **bkw).float()
        r, f = scheme.reference(x, want.canonical, wb, ib, **bkw, **rkw)
        ref += r.float()
        flip = max(flip, f)
        del want, block
    exact = all(tensors.values())
    shared, gate = _check_shared(ckpt, reader, spec, layer, shared_tensors, problems, options)
    shared_exact = all(shared_tensors.values()) if shared_tensors else None
    if shared is not None:
        sw = torch.ones(x.shape[0], 1) if gate is None else torch.sigmoid(torch.nn.functional.linear(x, gate.float()))
        sid = torch.zeros(x.shape[0], 1, dtype=torch.int32)
        out = out + layer.shared_expert(x, act_mode=mode)
        from ..convert.plan import shared_silu_limit_of

        # the layer's activation, the source's clamp of its shared expert; a shared expert is gate rows then up rows
        skw = dict(kw, interleaved=False, silu_limit=shared_silu_limit_of(text_config(ckpt.config), spec))
        ref32 = ref32 + moe_reference(x, shared.w13, shared.w2, sw, sid, **skw)
        slay = layer.shared.layout  # its own layout (a float shared expert kept float) runs its own mode
        smode = layer.shared_act_mode(mode)
        r, f = get_scheme(slay).reference(x, shared.canonical, sw, sid, **skw,
                                          **(dict(act_mode=smode) if len(slay.act_modes) > 1 else {}))  # fmt: skip
        ref, flip = ref + r, max(flip, f)
    sdt = ckpt.info(spec.shared["gate_proj"]).dtype_str if shared is not None else None
    dtypes = {spec.dtype} | ({sdt} if sdt is not None else set())
    orule = scheme.output_rule(dtypes)
    if sdt is not None and get_scheme(layer.shared.layout).quantized:
        # a float shared expert quantized as asked (--quantize) beside the source's own codes: the
        # fp32 check against the source's floats allows that quantization's error, as for a float source
        own = get_scheme(layer.shared.layout).output_rule({sdt}).fp32_tol
        if own is not None and sdt != spec.dtype and (orule.fp32_tol is None or own > orule.fp32_tol):
            from dataclasses import replace

            orule = replace(orule, fp32_tol=own)
    # norms in float64: outputs near float32's range must not overflow them into a false pass
    norm = float(ref.double().norm().clamp_min(1e-30))
    rel = float((out.double() - ref.double()).norm()) / norm
    tol = max(orule.base, orule.flips * flip / norm)
    rel32 = (float((out.double() - ref32.double()).norm() / ref32.double().norm().clamp_min(1e-30))
             if orule.fp32_tol is not None else None)  # fmt: skip
    ok = exact and shared_exact is not False and rel <= tol and (rel32 is None or rel32 <= orule.fp32_tol)
    detail = ["packed weights differ from the source: " + "; ".join(problems)] if problems else []
    ref_name = f"the {scheme.name} reference" if scheme.quantized else "the reference"
    if not rel <= tol:  # NaN too: a failure line always says what differs
        detail.append(_nonfinite(out, ref, ref_name) or f"output differs from {ref_name}: relative error {rel:.3g} > {tol:.3g}")
    if rel32 is not None and not rel32 <= orule.fp32_tol:
        detail.append(_nonfinite(out, ref32, "the fp32 reference on the source's weights")
                      or f"output differs from the fp32 reference on the source's weights: {rel32:.3g} > {orule.fp32_tol:g}")  # fmt: skip
    if not ok and not detail:
        detail.append(f"the layer failed without a named difference (relative error {rel!r}, tolerance {tol!r})")
    return LayerCheck(layer_index, exact, rel, tol, ok, "; ".join(detail), rel32, shared_exact, tensors, shared_tensors,
                      orule.fp32_tol if rel32 is not None else None, scheme.weights_note, layer.entry.get("quantizer"), mode, orule.base)  # fmt: skip
