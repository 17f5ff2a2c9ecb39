"""``moepack.open(path)``: a packed directory, validated, memory-mapped, as torch modules.

Opening reads the manifest and every shard header, checks them against each other and against
this build's layout table, and maps the shards (MAP_PRIVATE, no copy, no repacking): it costs
milliseconds, and memory grows only as experts are used. Each MoE layer is a
``PackedMoELayer`` whose ``forward(hidden_states, router_logits)`` routes and runs the experts.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .._ops import kernel_choice
from ..container.reader import open_shard
from ..errors import MoepackError, NoSuchLayerError, PackedDirError, UnsupportedError
from ..isa import host_isa
from ..layout import layout_get
# the version constants are re-exported: moepack/convert/run.py and older callers import them from here
from ..manifest import FORMAT_VERSION, MANIFEST, PERM_FORMAT_VERSION, READABLE_VERSIONS, check_manifest, load_manifest  # noqa: F401
from ..pack import PackedExperts
from .experts import resolve_act_mode, run_experts

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _strict_env() -> bool:
    v = os.environ.get("MOEPACK_STRICT", "")
    return v not in ("", "0")


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
        # silu experts' clamped SwiGLU (format version 6; DeepSeek-V4's swiglu_limit), routed and shared
        self.silu_limit = float(entry["silu_limit"]) if entry.get("silu_limit") is not None else None
        self.num_experts = experts.num_experts
        # identity (zero-computation) experts (format version 7; LongCat-Flash): the router's ids E .. E+Z-1,
        # each returning its token times the routing weight
        self.identity_experts = int(entry.get("identity_experts") or 0)
        self.hidden_size = experts.hidden
        self.intermediate_size = experts.intermediate
        self._model = model
        self.routing = None  # RoutingConfig, or None when the manifest has none
        if model.routing is not None:
            from ..routing import RoutingConfig

            self.routing = RoutingConfig.from_dict(model.routing)
        router = entry.get("router") or {}
        cb = router.get("correction_bias")
        # [E] (or [1, E] as ernie4_5_moe stores it: the same values) -> fp32 [E] for the routing op
        self.correction_bias = model.tensor(cb).float().reshape(-1).contiguous() if cb else None
        self.router_weight = model.tensor(router["weight"]) if router.get("weight") else None
        self.router_bias = model.tensor(router["bias"]) if router.get("bias") else None
        # routing by token id (format version 6; DeepSeek-V4's hash_moe layers): [vocab, k] expert ids
        self.hash_table = model.tensor(router["hash"]) if router.get("hash") else None
        # a norm of the block's output (format version 7; A.X-K1's post_mlp_layernorm): forward applies it last
        pn = entry.get("post_norm")
        self.post_norm_weight = model.tensor(pn["weight"]) if pn else None
        self.post_norm_eps = float(pn["eps"]) if pn else None
        # a bias the block adds to its output (format version 7; JetMoE's mlp.bias): forward adds it
        self.out_bias = model.tensor(entry["out_bias"]) if entry.get("out_bias") else None
        self.shared = None  # the shared expert as a one-expert pack, run for every token
        self.shared_gate = None  # Qwen2-MoE: sigmoid(x . gate) scales the shared expert
        sh = entry.get("shared")
        if sh:
            # the layer's layout, or its own (format version 5: a quantized checkpoint's float shared
            # expert kept float), which then runs in its own layout's act mode
            slay = layout_get(int(sh["layout_id"])) if "layout_id" in sh else experts.layout
            self.shared = PackedExperts(
                layout=slay,
                num_experts=1,
                hidden=experts.hidden,
                intermediate=int(sh["intermediate"]),
                padded_intermediate=int(sh["padded_intermediate"]),
                interleaved=False,
                tensors=model.declared_tensors(sh, slay, bias=False),
                act_mode=experts.act_mode if slay is experts.layout else None,
                gated=experts.gated,  # a relu2 layer's shared expert is non-gated too
            )
            if sh.get("gate"):
                self.shared_gate = model.tensor(sh["gate"])
        # the shared expert's clamp: the layer's, or its own (format version 7; hy_v4's shared expert is not clamped)
        self.shared_silu_limit = self.silu_limit
        if sh and "silu_limit" in sh:
            self.shared_silu_limit = float(sh["silu_limit"]) if sh["silu_limit"] is not None else None

    @property
    def act_mode(self) -> str:
        """The activation mode a call without one runs in (run_experts' rule: MOEPACK_ACT_MODE
        when the layout serves it, else the manifest's per-layer ``act_mode``, else the layout's
        default)."""
        return resolve_act_mode(self.packed.layout, None, self.packed.act_mode)

    @property
    def kernel(self) -> tuple[str, str]:
        """(isa, reason): the kernel this layer runs on this CPU (in its act mode), and why."""
        return kernel_choice(self.packed.layout, self.act_mode)[:2]

    def check_strict(self) -> None:
        choice = kernel_choice(self.packed.layout, self.act_mode)
        if (self._model.strict or _strict_env()) and choice.is_fallback:
            raise UnsupportedError(f"layer {self.index}: strict mode refuses a fallback: {choice.reason}")
        if self.shared is not None and self.shared.layout is not self.packed.layout:
            choice = kernel_choice(self.shared.layout, self.shared_act_mode(None))
            if (self._model.strict or _strict_env()) and choice.is_fallback:
                raise UnsupportedError(f"layer {self.index}: strict mode refuses a fallback (its shared expert, layout "
                                       f"{self.shared.layout.name}): {choice.reason}")  # fmt: skip

    def shared_act_mode(self, act_mode: str | None) -> str:
        """The activation mode the shared expert runs in for a call in ``act_mode`` (None: the
        layer's own): that mode, or, for a shared expert in its own layout that lacks it (a float
        one kept float beside int4 / mxfp4 codes runs a16 only), its layout's."""
        lay = self.shared.layout
        if lay is self.packed.layout:
            return resolve_act_mode(lay, act_mode, self.shared.act_mode)
        return resolve_act_mode(lay, act_mode if act_mode in lay.act_modes else None, None)

    def router_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The router's logits ``[T, E]`` in fp32 from this layer's router weight (and bias)."""
        self._check_hidden(hidden_states)
        if self.router_weight is None:
            raise UnsupportedError(f"layer {self.index}: the packed directory has no router weight for this layer")
        bias = None if self.router_bias is None else _like(self.router_bias.float(), hidden_states)
        return torch.nn.functional.linear(hidden_states.float(), _like(self.router_weight.float(), hidden_states), bias)

    def _check_hidden(self, hidden_states) -> None:
        """``hidden_states`` must be a floating [tokens, H] tensor: refused in one line naming the
        layer, the shape and the rule (before: torch's matmul error, or a 1-D/3-D input blamed on
        router_logits)."""
        if not isinstance(hidden_states, torch.Tensor):
            raise UnsupportedError(f"layer {self.index}: hidden_states is {type(hidden_states).__name__}: must be a "
                                   f"[tokens, H={self.hidden_size}] tensor")  # fmt: skip
        if hidden_states.dim() != 2 or hidden_states.shape[1] != self.hidden_size or not hidden_states.is_floating_point():
            raise UnsupportedError(f"layer {self.index}: hidden_states is {str(hidden_states.dtype).replace('torch.', '')} "
                                   f"{list(hidden_states.shape)}: must be a floating [tokens, H={self.hidden_size}] tensor "
                                   "(2-D: flatten batch and sequence first; H: the hidden size the experts were packed for)")  # fmt: skip

    def route(self, router_logits: torch.Tensor, hidden_states: torch.Tensor | None = None,
              token_ids: torch.Tensor | None = None):  # fmt: skip
        """(topk_weights fp32, topk_ids int32) for ``router_logits [T, E]`` per the manifest.
        ``token_ids`` (one integer per token): required by a layer that routes by token id
        (``hash_table``: DeepSeek-V4's hash layers), ignored by the others."""
        width = self.num_experts + self.identity_experts
        if router_logits.dim() != 2 or router_logits.shape[1] != width:
            what = f"E={self.num_experts}" if not self.identity_experts else \
                f"E + Z={width}: {self.num_experts} experts and {self.identity_experts} identity experts"  # fmt: skip
            raise UnsupportedError(f"router_logits has shape {list(router_logits.shape)}: must be [tokens, {what}]")
        if self.routing is None:
            raise UnsupportedError(
                f"layer {self.index}: the manifest has no routing config ({self._model.manifest.get('routing_note')}); "
                "route yourself and call .experts(hidden_states, topk_weights, topk_ids)"
            )
        from ..routing import route, route_by_token

        if self.hash_table is not None:
            if token_ids is None:
                raise UnsupportedError(f"layer {self.index} routes by token id (router.hash, model_type="
                                       f"{self.routing.model_type!r}): pass token_ids= (the input ids, one per token)")  # fmt: skip
            return route_by_token(router_logits, self.routing, self.hash_table, token_ids)
        return route(router_logits, self.routing, correction_bias=self.correction_bias, hidden=hidden_states)

    def experts(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_map: torch.Tensor | None = None,
        act_mode: str | None = None,
    ) -> torch.Tensor:
        """Only the experts: ``[T, H]`` from routed tokens (``act_mode``: this call's, else
        ``self.act_mode``), with the whole expert math the manifest records (activation, its
        swigluoai alpha / limit, a silu layer's ``silu_limit``, its identity experts: an id in
        E .. E+Z-1 adds its token times its weight; SEMANTICS.md §2 "Identity experts")."""
        self.check_strict()
        z = self.identity_experts
        if z and expert_map is not None:
            raise UnsupportedError(f"layer {self.index} has {z} identity experts (ids {self.num_experts}..{self.num_experts + z - 1}): "
                                   "expert_map is not taken with them (the layer maps those ids itself)")  # fmt: skip
        if z:
            e = self.num_experts
            dev = hidden_states.device if hidden_states.device.type == "meta" else None
            # the identity ids run no packed expert here (-1: their slots add nothing in the kernel)
            expert_map = torch.cat([torch.arange(e, dtype=torch.int32, device=dev),
                                    torch.full((z,), -1, dtype=torch.int32, device=dev)])  # fmt: skip
        out = run_experts(
            self.packed,
            hidden_states,
            topk_weights,
            topk_ids,
            activation=self.activation,
            alpha=self.alpha,
            limit=self.limit,
            expert_map=expert_map,
            act_mode=act_mode,
            silu_limit=self.silu_limit,
        )
        if not z:
            return out
        # each identity slot: weight x token (fp32 sum of the slots' weights, then one multiply-add, cast once)
        ident = (topk_weights.float() * (topk_ids >= self.num_experts)).sum(1, keepdim=True)
        return (out.float() + ident * hidden_states.float()).to(out.dtype)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None, *,
                act_mode: str | None = None, token_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The whole MoE block: route, run the experts, add the shared expert. Without
        ``router_logits`` the layer's own router weight computes them. ``act_mode``: this call's
        activation mode (routed and shared experts), else ``self.act_mode``. ``token_ids``: the
        input ids of the tokens (one per row), which a layer that routes by token id needs
        (``hash_table``; docs/ROUTING.md "Hash routing")."""
        self._check_hidden(hidden_states)
        if router_logits is None:
            router_logits = self.router_logits(hidden_states)
        weights, ids = self.route(router_logits, hidden_states, token_ids=token_ids)
        x = hidden_states
        if self.routing is not None and self.routing.apply_router_weight_on_input:
            from ..routing import apply_router_weight_on_input

            x, weights = apply_router_weight_on_input(hidden_states, weights, ids)
        out = self.experts(x, weights, ids, act_mode=act_mode)
        shared = self.shared_expert(hidden_states, act_mode=act_mode)
        if shared is not None:
            out = (out.float() + shared.float()).to(hidden_states.dtype)
        if self.out_bias is not None:  # JetMoeMoE: the combined output in the model's dtype, then + bias
            out = out + _like(self.out_bias, out).to(out.dtype)
        return out if self.post_norm_weight is None else self.post_norm(out)

    def post_norm(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's norm after the block (``post_norm``): an RMSNorm as the family's (A.X-K1's
        AXK1RMSNorm): the mean square in fp32, x * rsqrt(mean + eps) cast back to x's dtype, then times
        the weight (in x's dtype). The identity for a layer without one."""
        if self.post_norm_weight is None:
            return out
        h = out.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.post_norm_eps)
        return _like(self.post_norm_weight, out).to(out.dtype) * h.to(out.dtype)

    def shared_expert(self, hidden_states: torch.Tensor, act_mode: str | None = None) -> torch.Tensor | None:
        """The shared expert's part of the block output ``[T, H]`` (Qwen2-MoE: scaled by
        ``sigmoid(x . gate)``), run for every token; None when the layer has no shared expert."""
        if self.shared is None:
            return None
        t = hidden_states.shape[0]
        dev = hidden_states.device if hidden_states.device.type == "meta" else None
        if self.shared_gate is not None:
            sw = torch.sigmoid(torch.nn.functional.linear(hidden_states.float(), _like(self.shared_gate.float(), hidden_states)))
        else:
            sw = torch.ones(t, 1, dtype=torch.float32, device=dev)
        ids = torch.zeros(t, 1, dtype=torch.int32, device=dev)
        # the layer's one activation (MiniMax-M3's shared expert is swigluoai as its routed ones), gate rows then up rows
        return run_experts(self.shared, hidden_states, sw.contiguous(), ids, activation=self.activation, alpha=self.alpha,
                           limit=self.limit, act_mode=self.shared_act_mode(act_mode), silu_limit=self.shared_silu_limit)  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"index={self.index}, experts={self.num_experts}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, activation={self.activation}"
            f"{f', silu_limit={self.silu_limit:g}' if self.silu_limit else ''}{', hash routing' if self.hash_table is not None else ''}"
            f"{f', identity_experts={self.identity_experts}' if self.identity_experts else ''}, "
            f"layout={self.packed.layout.name}, "
            f"act_mode={self.act_mode}"
        )


def _like(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A mapped weight (router, bias, shared gate) for a product with ``x``: as it is, or, when ``x``
    is a meta tensor (shape tracing: torch.compile, FakeTensor), on the meta device too, so that
    tracing a layer computes shapes instead of failing on a device mismatch."""
    return weight.to("meta") if x.device.type == "meta" else weight


class _Layers(dict):
    """The MoE layers by decoder-layer index; an index without one is refused naming those there are."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def __missing__(self, key):
        have = ", ".join(str(i) for i in sorted(self)) or "none"
        raise NoSuchLayerError(f"{self.path}: no MoE layer at index {key!r} (the pack's MoE layers: {have}; dense "
                               "layers and layers outside the model are not in .layers)")


class PackedModel:
    """A packed directory opened for inference."""

    def __init__(self, path: Path, manifest: dict, shards: dict, strict: bool):
        self.path = path
        self.manifest = manifest
        self._shards = shards
        self.strict = strict
        self.config = manifest["model"].get("config") or {}
        self.routing = manifest.get("routing")
        self._tensor_file = {n: e["file"] for n, e in manifest["tensors"].items()}
        self.layers: dict[int, PackedMoELayer] = _Layers(path)
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
            tensors=self.declared_tensors(t, lay, bias=True),
            act_mode=entry.get("act_mode"),
            tp=int(entry.get("tp", 1)),
            gated=entry["activation"] != "relu2",  # relu2: non-gated experts, w13 of up rows alone
        )

    def declared_tensors(self, names: dict, lay, *, bias: bool) -> dict[str, torch.Tensor]:
        """The layout's declared tensors of w13 and w2 (+ the biases and the w13_perm present) by
        their role names (``names``: the manifest's role -> stored tensor name)."""
        roles = [*lay.tensor_names("w13"), *lay.tensor_names("w2")] + (["w13_bias", "w2_bias"] if bias else []) + ["w13_perm"]
        return {r: self.tensor(names[r]) for r in roles if r in names}

    def __repr__(self) -> str:
        return f"PackedModel({str(self.path)!r}, layers={sorted(self.layers)})"


def _fail(path: Path, msg: str):
    raise PackedDirError(f"{path}: {msg}")


# The manifest's schema lives in moepack/manifest.py; this name is kept for callers of the
# earlier structural check, which the schema replaces.
validate_manifest = check_manifest


def _file_kind(p: Path) -> str:
    import stat

    try:
        mode = os.stat(p).st_mode
    except OSError:
        return "a dangling symbolic link"
    for test, word in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return word
    return "not a plain file"


def open_packed(path: str | os.PathLike, *, strict: bool = False, check_values: bool = True) -> PackedModel:
    """Validate and memory-map the packed directory at ``path``. ``check_values=False`` (verify,
    which checks and names every value itself) skips the value rules of moepack.verify.values."""
    path = Path(path)
    manifest = load_manifest(path)  # the schema: after it, every field read below is there and typed
    shards = {}
    for fname, meta in manifest["files"].items():
        fpath = path / fname
        if not fpath.is_file():
            what = "is missing" if not os.path.lexists(fpath) else f"is not a regular file ({_file_kind(fpath)})"
            _fail(path, f"shard {fname} listed in {MANIFEST} {what}")
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
    # the small per-group tensors (scales, zero points, act-order permutations) keep their value
    # rules, so that no byte pattern makes the kernels' result depend on the ISA level
    if check_values:
        from ..verify.values import check_open

        check_open(model)
    if strict or _strict_env():
        for layer in model.layers.values():
            layer.check_strict()
    return model


__all__ = ["PackedModel", "PackedMoELayer", "open_packed", "validate_manifest", "MANIFEST", "FORMAT_VERSION", "PERM_FORMAT_VERSION",
           "READABLE_VERSIONS", "host_isa"]
