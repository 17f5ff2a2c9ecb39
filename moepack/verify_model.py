"""Step 4 of verify: the whole model the source describes, against the pack's manifest.

``_check_model`` compares the set of MoE layers the source reader finds, each layer's facts
(experts, shapes, activation, biases, act-order, shared expert, router, scheme) and the routing
config convert derives from config.json with what the manifest records; ``_check_carried``
compares the carried-over tensors as a set, with dtype, shape and bytes. Apart from verify_dir
and the layer check because it reads no packed weights at all: it is a comparison of metadata
(and of the source's carried-over bytes against the manifest's sha256).
"""

from __future__ import annotations

from .errors import MoepackError
from .runtime.model import PackedModel
from .schemes import get_scheme
from .verify_report import READ_CHUNK, file_sha256


def _norm_routing(r: dict | None) -> dict | None:
    from .routing import RoutingConfig

    return None if r is None else RoutingConfig.from_dict(r).to_dict()


def _check_model(model: PackedModel, ckpt, reader, specs: dict) -> list[str]:
    """Step 4 of moepack.verify_dir's docstring: what the source says the model is, against the manifest.
    Returns one line per difference (empty: the same model)."""
    from .convert_plan import _routing_for, _swiglu_params
    from .sources import text_config

    out = []
    m = model.manifest
    config = text_config(ckpt.config)
    packed = {e["index"]: e for e in m["layers"]}
    for idx in sorted(set(specs) - set(packed)):
        out.append(f"layer {idx} ({specs[idx].prefix}) is a MoE layer of the source but not in the pack")
    for idx in sorted(set(packed) - set(specs)):
        out.append(f"layer {idx} ({packed[idx]['prefix']}) is in the pack but is no MoE layer of the source")
    alpha, limit = _swiglu_params(config)
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
            "interleaved": (s.interleaved, e["interleaved"]),
            "biases": (s.has_bias, "w13_bias" in e["tensors"] or "w2_bias" in e["tensors"]),
            "act-order w13_perm": (scheme.has_perm(s), "w13_perm" in e["tensors"]),
            "router": ({k: v for k, v in s.router.items() if v}, router),
            "shared expert": (bool(s.shared), bool(sh)),
        }
        if s.shared and sh:
            want["shared.intermediate"] = (s.shared["intermediate"], sh["intermediate"])
            want["shared.gate"] = (s.shared.get("gate"), sh.get("gate"))
            want["shared act-order w13_perm"] = (scheme.has_perm(s, True), "w13_perm" in sh)
        if get_scheme(reader.scheme).quantized:  # a quantized source keeps its scheme (convert never re-quantizes)
            want["scheme"] = (reader.scheme, lay.scheme)
        for what, (src, got) in want.items():
            if src != got:
                out.append(f"layer {idx} {what}: pack {got!r}, source {src!r}")
    src_routing, note = _routing_for(config)
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
    out += _check_carried(model, ckpt, specs, set(reader.skipped(ckpt)[0]) if reader.skipped is not None else set())
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
