"""Step 4 of verify: the whole model the source describes, against the pack's manifest.

``check_model`` compares the set of MoE layers the source reader finds, each layer's facts
(experts, shapes, activation, biases, act-order, shared expert, router, scheme) and the routing
config convert derives from config.json with what the manifest records; ``_check_carried``
compares the carried-over tensors as a set, with dtype, shape and bytes. Apart from run.py
and the layer check because it reads no packed weights at all: it is a comparison of metadata
(and of the source's carried-over bytes against the manifest's sha256).
"""

from __future__ import annotations

from ..errors import MoepackError
from ..runtime.model import PackedModel
from ..schemes import get_scheme
from .report import READ_CHUNK, file_sha256


def _norm_routing(r: dict | None) -> dict | None:
    from ..routing import RoutingConfig

    return None if r is None else RoutingConfig.from_dict(r).to_dict()


def check_model(model: PackedModel, ckpt, reader, specs: dict, notes: list | None = None) -> list[str]:
    """Step 4 of moepack.verify.run's docstring: what the source says the model is, against the manifest.
    Returns one line per difference (empty: the same model); ``notes`` gets what passed but must
    be reported (a layer run in a deliberate ``--act-mode`` other than the source's meaning)."""
    notes = notes if notes is not None else []
    from ..convert.plan import (out_bias_of, post_norm_of, routing_for, runnable_problems, shared_silu_limit_of, silu_limit_of,
                                swiglu_params)  # fmt: skip
    from ..sources import text_config

    out = []
    m = model.manifest
    config = text_config(ckpt.config)
    packed = {e["index"]: e for e in m["layers"]}
    for idx in sorted(set(specs) - set(packed)):
        out.append(f"layer {idx} ({specs[idx].prefix}) is a MoE layer of the source but not in the pack")
    for idx in sorted(set(packed) - set(specs)):
        out.append(f"layer {idx} ({packed[idx]['prefix']}) is in the pack but is no MoE layer of the source")
    alpha, limit = swiglu_params(config)
    for idx in sorted(set(specs) & set(packed)):
        s, e = specs[idx], packed[idx]
        lay = model.layers[idx].packed.layout
        scheme = get_scheme(lay)
        sh = e.get("shared") or {}
        router = {k: v for k, v in (e.get("router") or {}).items() if v}
        want = {
            "prefix": (s.prefix, e["prefix"]),
            "num_experts": (s.num_experts, e["num_experts"]),
            "hidden": (s.hidden, e["hidden"]),
            "intermediate": (s.intermediate, e["intermediate"]),
            "activation": (s.activation, e["activation"]),
            "alpha": (alpha, e.get("alpha", 1.702)),
            "limit": (limit, e.get("limit", 7.0)),
            "silu_limit (clamped SwiGLU)": (silu_limit_of(config, s), e.get("silu_limit")),
            "post_norm (a norm after the block)": (post_norm_of(ckpt, config, s), e.get("post_norm")),
            "identity_experts (zero-computation experts)": (s.identity_experts, e.get("identity_experts") or 0),
            "out_bias (a bias added to the block's output)": (out_bias_of(ckpt, config, s), e.get("out_bias")),
            "interleaved": (s.interleaved, e["interleaved"]),
            "biases": (s.has_bias, "w13_bias" in e["tensors"] or "w2_bias" in e["tensors"]),
            "act-order w13_perm": (scheme.has_perm(s), "w13_perm" in e["tensors"]),
            "router": ({k: v for k, v in s.router.items() if v}, router),
            "shared expert": (bool(s.shared), bool(sh)),
        }
        if s.shared and sh:
            want["shared.intermediate"] = (s.shared["intermediate"], sh["intermediate"])
            want["shared.gate"] = (s.shared.get("gate"), sh.get("gate"))
            want["shared silu_limit"] = (shared_silu_limit_of(config, s), sh.get("silu_limit", e.get("silu_limit")))
            want["shared act-order w13_perm"] = (scheme.has_perm(s, True), "w13_perm" in sh)
        if get_scheme(reader.scheme).quantized:  # a quantized source keeps its scheme (convert never re-quantizes)
            want["scheme"] = (reader.scheme, lay.scheme)
        for what, (src, got) in want.items():
            if src != got:
                out.append(f"layer {idx} {what}: pack {got!r}, source {src!r}")
        if s.shared and sh and model.layers[idx].shared is not None:
            out += _check_shared_scheme(idx, s, e, model.layers[idx].shared.layout, lay, ckpt, reader)
        out += _check_act_mode(idx, s, e, lay, scheme, m.get("act_mode_option"), notes, "act_mode_option" not in m)
    src_routing, note = routing_for(config)
    consumed = {n for sp in specs.values() for n in sp.expert_tensors}
    # what the pack cannot compute that the source has: its routing, a clamp, a block part (convert refuses each)
    out += runnable_problems(ckpt, config, list(specs.values()), None if src_routing is not None else note, consumed)
    try:
        pack_routing = _norm_routing(m["routing"])
    except MoepackError as ex:  # unreachable after the schema; kept so that verify never crashes on it
        pack_routing = None
        out.append(f"routing: the pack's is not a RoutingConfig ({ex})")
    if (src_routing is None) != (pack_routing is None):
        out.append(f"routing: pack {'none' if pack_routing is None else 'has one'}, source config "
                   f"{'none (' + note + ')' if src_routing is None else 'has one'}")  # fmt: skip
    elif src_routing is not None:
        for k in src_routing:
            if src_routing[k] != pack_routing.get(k):
                out.append(f"routing.{k}: pack {pack_routing.get(k)!r}, source config {src_routing[k]!r}")
    out += _check_config(m, ckpt)
    out += _check_carried(model, ckpt, specs, set(reader.skipped(ckpt)[0]))
    out += _check_carried_files(model, ckpt)
    return out


def _check_shared_scheme(idx: int, spec, entry: dict, slay, lay, ckpt, reader) -> list[str]:
    """The scheme the layer's shared expert is packed in against the source's: a quantized one
    keeps its scheme; a float one stays float (convert never quantizes unasked) unless the pack
    records the quantizer ``--quantize`` ran on it (the layer's ``quantizer``: a float source
    quantized whole; the shared entry's: a quantized source's float shared expert)."""
    from ..convert.plan import float_shared_dtype
    from ..schemes import float_scheme

    sh = entry.get("shared") or {}
    got = get_scheme(slay)
    dt = float_shared_dtype(ckpt, spec)
    if dt is None:  # quantized in the source: the reader's scheme, in the layer's layout
        if got.name != reader.scheme or slay is not lay:
            return [f"layer {idx} shared expert: pack {got.name!r} (layout {slay.name}), source {reader.scheme!r} in the "
                    f"layer's layout {lay.name}: a quantized shared expert is packed as stored"]  # fmt: skip
        return []
    asked = entry.get("quantizer") or sh.get("quantizer")
    if not got.quantized or asked:
        return []
    return [f"layer {idx} shared expert: the source's is float ({dt}: {spec.shared['gate_proj']!r}), the pack's is "
            f"{got.name} (layout {slay.name}) with no quantizer recorded: convert keeps a float shared expert "
            f"{float_scheme().name} unless --quantize asks (a pack of an older moepack quantized it unasked: convert "
            "the checkpoint again)"]  # fmt: skip


def act_mode_meaning(scheme, spec, lay) -> str:
    """The activation mode the source means for a layer: a16 for W4A16 and dense sources, a8 for
    W8A8 and compressed-tensors W4A8 (Scheme.default_act_mode)."""
    return scheme.default_act_mode(spec, lay)


def _check_act_mode(idx: int, spec, entry: dict, lay, scheme, option, notes: list, older: bool = False) -> list[str]:
    """The layer's recorded act_mode against the source's meaning; a different one passes only
    when convert recorded it as the deliberate ``--act-mode`` (``act_mode_option``), and is then
    reported in ``notes``. A manifest written before convert recorded ``act_mode_option`` at all
    (``older``) cannot tell a deliberate mode from an edit: its other mode is reported in
    ``notes`` as such, not failed (its output is still compared, in its own mode)."""
    got = entry.get("act_mode") or lay.act_modes[0]
    meaning = act_mode_meaning(scheme, spec, lay)
    if option is not None and got != option:
        return [f"layer {idx} act_mode: pack {got!r}, but the pack records convert --act-mode {option!r}"]
    if got == meaning:
        return []
    if option == got:
        notes.append(f"layer {idx} runs in act_mode {got} (convert --act-mode {got}); the source means {meaning}: "
                     f"its output was compared in {got}, with the {got} tolerance")  # fmt: skip
        return []
    if older:
        notes.append(f"layer {idx} runs in act_mode {got}; the source means {meaning}, and this manifest predates "
                     f"act_mode_option, so whether convert --act-mode chose it cannot be told: its output was compared "
                     f"in {got}, with the {got} tolerance")  # fmt: skip
        return []
    return [f"layer {idx} act_mode: pack {got!r}, source {meaning!r} (the source's meaning; another mode is "
            "recorded only by convert --act-mode)"]  # fmt: skip


def _canon(v) -> str:
    """A JSON value as text that tells every difference apart, types included (8 and 8.0, true
    and 1 are equal in Python, not in a config)."""
    import json

    return json.dumps(v, sort_keys=True)


def _first_difference(a, b, path: str) -> str | None:
    """The path of the first place where JSON values ``a`` (pack) and ``b`` (source) differ,
    type included."""
    if _canon(a) == _canon(b):
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                return f"{path}.{k}: pack {_short(a.get(k, '(absent)'))}, source config.json {_short(b.get(k, '(absent)'))}"
            sub = _first_difference(a[k], b[k], f"{path}.{k}")
            if sub:
                return sub
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            sub = _first_difference(x, y, f"{path}[{i}]")
            if sub:
                return sub
    return f"{path}: pack {_short(a)}, source config.json {_short(b)}"


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:55] + "…" + r[-4:]


def _check_config(m: dict, ckpt) -> list[str]:
    """The model config the manifest stores (load_model and generate build the model from it)
    against the source's config.json, key for key, and the two fields derived from it."""
    from ..sources import text_config

    out = []
    diff = _first_difference(m["model"].get("config"), ckpt.config, "model.config")
    if diff:
        out.append(diff)
    tc = text_config(ckpt.config)
    for k in ("model_type", "hidden_size"):
        if m["model"].get(k) != tc.get(k):
            out.append(f"model.{k}: pack {m['model'].get(k)!r}, source config.json {tc.get(k)!r}")
    return out


def _check_carried_files(model: PackedModel, ckpt) -> list[str]:
    """The carried files (config.json, tokenizer files, ...) against the source's: the same set
    of names, and each one's sha256 (recorded at convert, proved against the pack by step 2)
    equal to the source file's."""
    m = model.manifest
    src = {p.name: p for p in ckpt.carried_files()}
    ours = list(m.get("carried_files") or [])
    out = []
    for words, names in (("in the source but not carried", sorted(set(src) - set(ours))),
                         ("carried but not in the source", sorted(set(ours) - set(src)))):  # fmt: skip
        if names:
            out.append(f"{len(names)} file(s) {words}: {', '.join(map(repr, names[:3]))}{' ...' if len(names) > 3 else ''}")
    sums = m.get("carried_sha256")
    for name in (n for n in ours if n in src):
        p = src[name]
        digest = file_sha256(p, 0, p.stat().st_size)
        if sums is not None and digest != sums.get(name):
            out.append(f"carried file {name!r}: its sha256 in the manifest differs from the source file's")
        elif sums is None and (model.path / name).is_file():
            mine = file_sha256(model.path / name, 0, (model.path / name).stat().st_size)
            if mine != digest:
                out.append(f"carried file {name!r}: its bytes differ from the source file's")
    return out


def _check_carried(model: PackedModel, ckpt, specs: dict, skipped: set = frozenset()) -> list[str]:
    """The carried-over tensors: the source's tensors that no MoE layer consumes and the reader
    does not skip (``skipped``: SourceReader.skipped), as a set, and each one's dtype, shape and
    bytes (the source's sha256 against the manifest's)."""
    consumed = {n for s in specs.values() for n in s.expert_tensors} | skipped
    src = [n for n in ckpt.tensors if n not in consumed]
    ours = {n for n in model.manifest["tensors"] if not n.startswith("moepack.layers.")}
    out = []
    for words, names in (("in the source but not in the pack", [n for n in src if n not in ours]),
                         ("in the pack but not in the source", sorted(ours - set(src)))):  # fmt: skip
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            out.append(f"{len(names)} carried-over tensor(s) {words}: {', '.join(map(repr, names[:3]))}{more}")
    buf = bytearray(READ_CHUNK)
    for n in (n for n in src if n in ours):
        ti, e = ckpt.info(n), model.manifest["tensors"][n]
        dt = str(ti.dtype).replace("torch.", "") if ti.dtype_str != "F4" and _has_dtype(ti) else ti.dtype_str
        if dt != e["dtype"] or list(ti.shape) != list(e["shape"]):
            out.append(f"carried-over tensor {n!r}: pack {e['dtype']} {e['shape']}, source {dt} {list(ti.shape)}")
        elif file_sha256(ti.file, ti.offset, ti.nbytes, buf) != e["sha256"]:
            out.append(f"carried-over tensor {n!r}: its bytes differ from the source's (sha256)")
    return out


def _has_dtype(ti) -> bool:
    try:
        ti.dtype
    except Exception:  # noqa: BLE001 - a dtype this torch has no type for: compare names
        return False
    return True
