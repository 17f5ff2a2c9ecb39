"""``moepack.open(path)``: a packed directory, validated, memory-mapped, as torch modules.

Opening reads the manifest and every shard header, checks them against each other and against
this build's layout table, and maps the shards (MAP_PRIVATE, no copy, no repacking): it costs
milliseconds, and memory grows only as experts are used. Each MoE layer is a
``PackedMoELayer`` whose ``forward(hidden_states, router_logits)`` routes and runs the experts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .._ops import kernel_choice
from ..container.reader import open_shard
from ..errors import MoepackError, PackedDirError, UnsupportedError
from ..isa import host_isa, max_isa
from ..layout import LAYOUTS, layout_expert_shapes, layout_get
from ..pack import PackedExperts
from .experts import run_experts

MANIFEST = "moepack.json"
FORMAT_VERSION = 1
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _strict_env() -> bool:
    v = os.environ.get("MOEPACK_STRICT", "")
    return v not in ("", "0")


def _route_fallback(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.contiguous(), ids.to(torch.int32).contiguous()


class PackedMoELayer(torch.nn.Module):
    """One MoE layer of a packed directory: routing + experts + combine."""

    def __init__(self, model: "PackedModel", entry: dict, experts: PackedExperts):
        super().__init__()
        self.index = int(entry["index"])
        self.prefix = entry["prefix"]
        self.entry = entry
        self.packed = experts
        self.activation = entry["activation"]
        self.alpha = float(entry.get("alpha", 1.702))
        self.limit = float(entry.get("limit", 7.0))
        self.num_experts = experts.num_experts
        self.hidden_size = experts.hidden
        self.intermediate_size = experts.intermediate
        self.routing = model.routing
        self._model = model
        cb = entry.get("router", {}).get("correction_bias")
        self.correction_bias = model.tensor(cb).float() if cb else None

    @property
    def kernel(self) -> tuple[str, str]:
        """(isa, reason): the kernel this layer runs on this CPU, and why."""
        return kernel_choice(self.packed.layout)

    def check_strict(self) -> None:
        isa, reason = self.kernel
        if (self._model.strict or _strict_env()) and isa != max_isa():
            raise UnsupportedError(f"layer {self.index}: strict mode refuses a fallback: {reason}")

    def route(self, router_logits: torch.Tensor, hidden_states: torch.Tensor | None = None):
        """(topk_weights fp32, topk_ids int32) for ``router_logits [T, E]`` per the manifest."""
        if router_logits.dim() != 2 or router_logits.shape[1] != self.num_experts:
            raise UnsupportedError(
                f"router_logits has shape {list(router_logits.shape)}: must be [tokens, E={self.num_experts}]"
            )
        cfg = self.routing
        if cfg is None:
            raise UnsupportedError(
                f"layer {self.index}: the manifest has no routing config ({self._model.manifest.get('routing_note')}); "
                "route yourself and call .experts(hidden_states, topk_weights, topk_ids)"
            )
        try:
            from ..routing import RoutingConfig, route
        except ImportError:
            return _route_fallback(router_logits, int(cfg["top_k"]), bool(cfg.get("renormalize", False)))
        return route(router_logits, RoutingConfig.from_dict(cfg), correction_bias=self.correction_bias, hidden=hidden_states)

    def experts(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Only the experts: ``[T, H]`` from routed tokens."""
        self.check_strict()
        return run_experts(
            self.packed,
            hidden_states,
            topk_weights,
            topk_ids,
            activation=self.activation,
            alpha=self.alpha,
            limit=self.limit,
            expert_map=expert_map,
        )

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(router_logits, hidden_states)
        return self.experts(hidden_states, weights, ids)

    def extra_repr(self) -> str:
        return (
            f"index={self.index}, experts={self.num_experts}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, activation={self.activation}, layout={self.packed.layout.name}"
        )


class PackedModel:
    """A packed directory opened for inference."""

    def __init__(self, path: Path, manifest: dict, shards: dict, strict: bool):
        self.path = path
        self.manifest = manifest
        self._shards = shards
        self.strict = strict
        self.config = manifest.get("model", {}).get("config", {})
        self.routing = manifest.get("routing")
        self._tensor_file = {n: e["file"] for n, e in manifest["tensors"].items()}
        self.layers: dict[int, PackedMoELayer] = {}
        for entry in manifest["layers"]:
            self.layers[int(entry["index"])] = PackedMoELayer(self, entry, self._experts_of(entry))

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor of the directory (experts or carried-over), as a zero-copy view of its file."""
        f = self._tensor_file.get(name)
        if f is None:
            raise PackedDirError(f"{self.path}: no tensor named {name!r}")
        return self._shards[f].tensor(name)

    def _experts_of(self, entry: dict) -> PackedExperts:
        t = entry["tensors"]
        lay = layout_get(int(entry["layout_id"]))
        return PackedExperts(
            layout=lay,
            num_experts=int(entry["num_experts"]),
            hidden=int(entry["hidden"]),
            intermediate=int(entry["intermediate"]),
            padded_intermediate=int(entry["padded_intermediate"]),
            interleaved=bool(entry["interleaved"]),
            w13=self.tensor(t["w13"]),
            w2=self.tensor(t["w2"]),
            w13_bias=self.tensor(t["w13_bias"]) if "w13_bias" in t else None,
            w2_bias=self.tensor(t["w2_bias"]) if "w2_bias" in t else None,
        )

    def __repr__(self) -> str:
        return f"PackedModel({str(self.path)!r}, layers={sorted(self.layers)})"


def _fail(path: Path, msg: str):
    raise PackedDirError(f"{path}: {msg}")


def validate_manifest(path: Path, m: dict) -> None:
    """Structural checks of a manifest against this build (layouts, shapes, files)."""
    if not isinstance(m, dict) or m.get("format") != "moepack":
        _fail(path, f"{MANIFEST}: format={m.get('format') if isinstance(m, dict) else None!r}, expected 'moepack'")
    if m.get("format_version") != FORMAT_VERSION:
        _fail(path, f"{MANIFEST}: format_version={m.get('format_version')!r}; this moepack reads version {FORMAT_VERSION}")
    for key, typ in (("layers", list), ("tensors", dict), ("files", dict), ("layouts", dict)):
        if not isinstance(m.get(key), typ):
            _fail(path, f"{MANIFEST}: field {key!r} must be a {typ.__name__}")
    known = {str(x.id): x for x in LAYOUTS}
    for lid, desc in m["layouts"].items():
        if lid not in known:
            _fail(path, f"{MANIFEST}: layout id {lid} is unknown to this build (known: {sorted(known)})")
        ours = known[lid].to_dict()
        for k, v in ours.items():
            if desc.get(k) != v:
                _fail(path, f"layout {ours['name']} (id {lid}) in the file has {k}={desc.get(k)!r}, this build has {k}={v!r}")
    for name, e in m["tensors"].items():
        if not isinstance(e, dict) or e.get("file") not in m["files"]:
            _fail(path, f"{MANIFEST}: tensor {name!r} names file {e.get('file') if isinstance(e, dict) else None!r}, not listed in 'files'")
    for entry in m["layers"]:
        try:
            lay = layout_get(int(entry["layout_id"]))
            e, h, i = int(entry["num_experts"]), int(entry["hidden"]), int(entry["intermediate"])
            sh = layout_expert_shapes(lay, e, h, i)
            want = {"w13": list(sh.w13_shape), "w2": list(sh.w2_shape)}
            for role, shape in want.items():
                tname = entry["tensors"][role]
                got = m["tensors"][tname]["shape"]
                if list(got) != shape:
                    _fail(path, f"layer {entry['index']}: tensor {tname!r} has shape {got}, layout math says {shape}")
            if int(entry["padded_intermediate"]) != sh.padded_intermediate:
                _fail(path, f"layer {entry['index']}: padded_intermediate={entry['padded_intermediate']}, layout math says {sh.padded_intermediate}")
        except (KeyError, TypeError, ValueError) as ex:
            if isinstance(ex, MoepackError):
                raise
            _fail(path, f"{MANIFEST}: layer entry {entry.get('index') if isinstance(entry, dict) else entry!r} is malformed ({ex!r})")


def open_packed(path: str | os.PathLike, *, strict: bool = False) -> PackedModel:
    """Validate and memory-map the packed directory at ``path``."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        _fail(path, f"no {MANIFEST} (not a packed directory; make one with `moepack convert`)")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _fail(path, f"{MANIFEST} is not valid JSON ({e})")
    validate_manifest(path, manifest)
    shards = {}
    for fname, meta in manifest["files"].items():
        fpath = path / fname
        if not fpath.is_file():
            _fail(path, f"shard {fname} listed in {MANIFEST} is missing")
        size = fpath.stat().st_size
        if size != meta.get("size"):
            _fail(path, f"shard {fname} has {size} bytes, {MANIFEST} says {meta.get('size')}")
        try:
            shards[fname] = open_shard(fpath, require_alignment=64)
        except MoepackError as e:
            raise PackedDirError(str(e)) from None
    for name, e in manifest["tensors"].items():
        shard = shards[e["file"]]
        if name not in shard.names:
            _fail(path, f"tensor {name!r} is not in {e['file']}")
        t = shard.tensor(name)
        if list(t.shape) != list(e["shape"]) or str(t.dtype).replace("torch.", "") != e["dtype"]:
            _fail(
                path,
                f"tensor {name!r} in {e['file']} is {str(t.dtype).replace('torch.', '')} {list(t.shape)}, "
                f"{MANIFEST} says {e['dtype']} {e['shape']}",
            )
    model = PackedModel(path, manifest, shards, strict)
    if strict or _strict_env():
        for layer in model.layers.values():
            layer.check_strict()
    return model


__all__ = ["PackedModel", "PackedMoELayer", "open_packed", "validate_manifest", "MANIFEST", "FORMAT_VERSION", "host_isa"]
