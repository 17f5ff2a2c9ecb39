"""Whole transformers models on packed experts: ``patch``, ``load_model``, ``greedy_generate``.

``patch(model, packed)`` swaps every MoE block of a loaded transformers model for a
``PackedMoEBlock``, a module that calls the packed layer (router, routed experts, shared expert)
and returns what the family's own block returns, so the decoder layer around it is untouched.
``load_model(packed_dir)`` builds the model from the packed directory alone: the architecture on
the meta device, the MoE blocks replaced, then every other tensor assigned as a view of the
directory's memory map, so dense expert weights never exist in memory.

Everything is checked before anything is changed: a model whose architecture differs from the
pack's, a family this module (or the installed transformers) does not know, or a layer whose
kernel strict mode refuses is a ``ModelMismatchError`` / ``UnsupportedError`` naming the field,
and the model is left as it was.

transformers is imported lazily (moepack itself does not depend on it). Family knowledge (where
the block sits, how its router computes logits, what the block returns) is the table of
``moepack.families``, whose whole-model entries are ``FAMILIES`` here; the names are
transformers 5's in-memory ones (docs/COMPATIBILITY.md lists what is tested).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import MoepackError, UnsupportedError
from .families import WHOLE_MODEL, Family


class ModelMismatchError(MoepackError, ValueError):
    """A transformers model and a packed directory describe different architectures."""


# The family table lives in moepack/families.py (routing recipe, block shape, checkpoint facts per
# model_type); FAMILIES here is its part that patch / load_model run whole.
FAMILIES: dict[str, Family] = WHOLE_MODEL

# config.json keys that decide the MoE layers' shapes and routing: a pack and a model must agree
# on every one that both carry (transformers' attribute_map aliases are followed on the model side).
ARCH_KEYS = (
    "hidden_size", "num_hidden_layers", "num_experts", "num_local_experts", "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size",
    "n_shared_experts", "first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers", "moe_layers",
    "interleave_moe_layer_step", "moe_layer_freq", "norm_topk_prob", "n_group", "topk_group",
    "routed_scaling_factor", "scoring_func", "topk_method", "router_jitter_noise", "swiglu_limit", "swiglu_alpha",
)  # fmt: skip
_MISSING = object()


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UnsupportedError("moepack.patch / load_model need transformers (pip install transformers)") from None
    return transformers


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own warnings and log lines (tokenizer notices, config deprecations) kept off
    the user's screen: moepack reports what matters in its own one line. ``MOEPACK_DEBUG=1`` (the
    CLI's ``--debug``) lets them through."""
    if os.environ.get("MOEPACK_DEBUG", "") not in ("", "0"):
        yield
        return
    import logging
    import warnings

    loggers = [logging.getLogger(n) for n in ("transformers", "tokenizers", "huggingface_hub")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR + 10)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _family(model_type: str) -> Family:
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise UnsupportedError(
            f"model_type={model_type!r}: moepack runs whole models of {', '.join(sorted(FAMILIES))} only"
        )
    return fam


def _router_recorder(router: torch.nn.Module | None, fam: Family) -> torch.nn.Module | None:
    """A weightless instance of the family's router class whose forward returns what it is given.

    transformers collects ``router_logits`` with forward hooks on modules of the router's class;
    calling this stand-in with the packed block's logits (at the router's output index) lets
    ``output_router_logits=True`` and the aux loss work after the real router is gone."""
    if router is None:
        return None
    cls = type(router)
    rec = cls.__new__(cls)
    torch.nn.Module.__init__(rec)
    rec.forward = lambda *outputs: outputs
    rec.extra_repr = lambda: "moepack: records the packed block's router outputs"
    return rec


class PackedMoEBlock(torch.nn.Module):
    """A transformers MoE block on a ``PackedMoELayer``: same input, same outputs as the family's
    block (SEMANTICS.md §1-§2 inside). ``seconds`` accumulates the wall time of its forwards
    (``moepack generate`` reports the share of time in the MoE layers from it)."""

    def __init__(self, layer, family: Family, model_type: str, recorder: torch.nn.Module | None = None):
        super().__init__()
        self.layer = layer
        self.family = family
        self.recorder = recorder  # a module: transformers' output hooks find it among the children
        self.model_type = model_type
        self.seconds = 0.0
        self.calls = 0

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.layer.router_weight, self.layer.router_bias
        if w is None:
            return self.layer.router_logits(x)  # raises, naming the layer
        if self.family.router_fp32:
            return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        return torch.nn.functional.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        t0 = time.perf_counter()
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = self._logits(x)
        # a layer that routes by token id (DeepSeek-V4's hash layers) gets the decoder layer's input_ids
        ids = kwargs.get("input_ids") if self.layer.hash_table is not None else None
        if self.layer.hash_table is not None and ids is None:
            raise UnsupportedError(f"layer {self.layer.index} routes by token id: the model passed its MoE block no "
                                   "input_ids (inputs_embeds alone cannot be routed by this layer)")  # fmt: skip
        out = self.layer(x, logits.float(), token_ids=ids)
        fam = self.family.returns
        if self.recorder is not None and self.recorder._forward_hooks:  # hooked: output_router_logits can ask
            rec = [None] * (self.family.logits_index + 1)
            rec[self.family.logits_index] = logits
            self.recorder(*rec)
        if fam == "llama4":
            res = (out, logits)
        elif fam == "gpt_oss":
            weights, _ = self.layer.route(logits.float(), x)
            res = (out.reshape(shape), weights.to(x.dtype))
        else:
            res = out.reshape(shape)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return res

    def extra_repr(self) -> str:
        return f"model_type={self.model_type}"


def _decoder_layers(model):
    fam = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
    path = fam.layers if fam is not None else "model.layers"
    layers = None
    for start, rest in ((model, path), (model, path.partition(".")[2])):  # the causal LM, or its inner model itself
        layers = start
        for part in rest.split("."):
            layers = getattr(layers, part, None)
        if layers is not None:
            break
    if layers is None:
        raise ModelMismatchError(f"{type(model).__name__}: no decoder layers at model.{path}")
    return layers


def _norm(v):
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _moe_blocks(model, fam: Family) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> its MoE block (a module with ``experts``, or an already patched one)."""
    out = {}
    for i, layer in enumerate(_decoder_layers(model)):
        m = getattr(layer, fam.block_attr, None)
        if m is not None and (hasattr(m, fam.experts_attr) or isinstance(m, PackedMoEBlock)):
            out[i] = m
    return out


def _block_shapes(block, fam: Family) -> tuple[int, int, int] | None:
    """(E, H, I) of a transformers block's fused expert weights, or None when it holds none."""
    ex = getattr(block, "experts", None)
    lin = getattr(getattr(block, "input_linear", None), "weight", None)  # JetMoE: [E, 2I, H] in the block itself
    if ex is None and isinstance(lin, torch.Tensor) and lin.dim() == 3:
        return lin.shape[0], lin.shape[2], lin.shape[1] // 2
    gu = getattr(ex, "gate_up_proj", None)
    up = getattr(ex, "up_proj", None)
    if gu is None and isinstance(up, torch.Tensor) and up.dim() == 3 and not fam.in_major:  # non-gated: up [E, I, H]
        return up.shape[0], up.shape[2], up.shape[1]
    if gu is None or gu.dim() != 3:
        return None
    dn = getattr(ex, "down_proj", None)
    # E from down_proj: LongCat-Flash's gate_up_proj has rows for its identity experts too (never used)
    e = dn.shape[0] if isinstance(dn, torch.Tensor) and dn.dim() == 3 else gu.shape[0]
    return (e, gu.shape[1], gu.shape[2] // 2) if fam.in_major else (e, gu.shape[2], gu.shape[1] // 2)


def _shared_intermediate(block, fam: Family) -> int | None:
    m = getattr(block, fam.shared, None) if fam.shared else None
    g = getattr(m, "gate_proj", None) if m is not None else None
    if g is None and getattr(m, "gate_up_proj", None) is not None:  # one gate/up Linear (MiniMax-M3): half its rows
        return int(m.gate_up_proj.weight.shape[0]) // 2
    if g is None and getattr(m, "up_proj", None) is not None:  # non-gated (NemotronHMLP): up and down only
        return int(m.up_proj.weight.shape[0])
    return None if g is None else int(g.weight.shape[0])


def check_compatible(model, packed) -> dict[int, torch.nn.Module]:
    """Refuse (``ModelMismatchError``, naming the field) a model whose architecture differs from
    ``packed``'s; returns the model's MoE blocks by layer. Changes nothing."""
    cfg = model.config
    pcfg = packed.config or {}
    ptype = (packed.manifest.get("model") or {}).get("model_type") or pcfg.get("model_type")
    if cfg.model_type != ptype:
        raise ModelMismatchError(f"model_type: the model is {cfg.model_type!r}, the packed directory {packed.path} is {ptype!r}")
    fam = _family(cfg.model_type)
    for key in ARCH_KEYS:
        if key not in pcfg:
            continue
        mine = getattr(cfg, key, _MISSING)
        if mine is _MISSING:
            continue
        if _norm(mine) != _norm(pcfg[key]):
            raise ModelMismatchError(f"config field {key}: the model has {mine!r}, the packed directory {packed.path} has {pcfg[key]!r}")
    blocks = _moe_blocks(model, fam)
    if sorted(blocks) != sorted(packed.layers):
        raise ModelMismatchError(
            f"MoE layers: the model has {sorted(blocks)}, the packed directory {packed.path} has {sorted(packed.layers)}"
        )
    if packed.routing is None:
        raise UnsupportedError(
            f"{packed.path}: the manifest has no routing config ({packed.manifest.get('routing_note')}): "
            "a whole model needs the packed layers to route"
        )
    routing = packed.routing
    k = getattr(cfg, "num_experts_per_tok", None)
    if routing.get("top_k") is not None and k is not None and int(routing["top_k"]) != int(k):
        raise ModelMismatchError(f"top_k: the model routes to {k} experts, the packed directory's routing to {routing['top_k']}")
    for i, block in blocks.items():
        layer = packed.layers[i]
        if isinstance(block, PackedMoEBlock):
            raise ModelMismatchError(f"layer {i}: the model's MoE block is already a PackedMoEBlock (patched once)")
        got = _block_shapes(block, fam)
        want = (layer.num_experts, layer.hidden_size, layer.intermediate_size)
        for name, a, b in zip(("num_experts", "hidden_size", "expert intermediate_size"), got or want, want):
            if a != b:
                raise ModelMismatchError(f"layer {i}: {name} is {a} in the model, {b} in the packed directory {packed.path}")
        si = _shared_intermediate(block, fam)
        psi = None if layer.shared is None else layer.shared.intermediate
        if fam.shared and si != psi:
            raise ModelMismatchError(
                f"layer {i}: the shared expert's intermediate_size is {si} in the model, {psi} in the packed directory"
            )
    return blocks


def _as_packed(packed, strict: bool | None):
    from .runtime.model import PackedModel, open_packed

    if isinstance(packed, PackedModel):
        return packed
    return open_packed(packed, strict=bool(strict))


def patch(model, packed, *, strict: bool | None = None):
    """Replace every MoE block of the transformers ``model`` by a ``PackedMoEBlock`` on the
    matching layer of ``packed`` (a packed directory or ``moepack.open``'s ``PackedModel``), and
    free the block's own weights (experts, router, shared expert: the packed layer carries them).

    Refused, with the model unchanged: a family moepack does not run, an architecture that differs
    (``ModelMismatchError`` naming the field), a layer whose kernel strict mode (``strict=True``,
    the PackedModel's, or ``MOEPACK_STRICT=1``) refuses. Returns the model."""
    pm = _as_packed(packed, strict)
    blocks = check_compatible(model, pm)
    fam = _family(model.config.model_type)
    was = pm.strict
    pm.strict = was or bool(strict)
    try:
        for i in blocks:
            pm.layers[i].check_strict()
    finally:
        pm.strict = was
    layers = _decoder_layers(model)
    new = {}
    for i, block in blocks.items():
        rec = _router_recorder(getattr(block, fam.router_attr, None), fam)
        new[i] = PackedMoEBlock(pm.layers[i], fam, model.config.model_type, rec)
        setattr(layers[i], fam.block_attr, new[i])
    _hook_recorders(model, [b.recorder for b in new.values() if b.recorder is not None])
    model._moepack = pm  # keeps the memory map alive as long as the model
    return model


def _hook_recorders(model, recorders: list) -> None:
    """transformers installs its output hooks once, at a model's first forward: for a model that
    ran before it was patched, hook the new recorders the way it hooked the routers."""
    try:
        from transformers.modeling_utils import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder, install_output_capuring_hook
    except ImportError:  # another transformers: router_logits are then not recorded for a model run before patch
        return
    for sub in model.modules():
        if not (isinstance(sub, PreTrainedModel) and getattr(sub, "_output_capturing_hooks_installed", False)):
            continue
        for key, spec in (_CAN_RECORD_REGISTRY.get(sub) or {}).items():
            for sp in spec if isinstance(spec, list) else [spec]:
                if isinstance(sp, OutputRecorder) and sp.target_class is not None:
                    for rec in recorders:
                        if isinstance(rec, sp.target_class):
                            install_output_capuring_hook(rec, key, sp.index, sp.capture_initial_hidden_state)


def packed_blocks(model) -> list[PackedMoEBlock]:
    """The model's PackedMoEBlocks (empty: not patched)."""
    return [m for m in model.modules() if isinstance(m, PackedMoEBlock)]


# --------------------------------------------------------------------------- load_model


def checkpoint_renames(model_type: str, names) -> dict[str, str | tuple[str, ...] | SplitPart]:
    """{model parameter name: the checkpoint tensor stored for it, or the tensors concatenated
    along dim 0 into it} for the names transformers' own conversion mapping changes on load: its
    ``WeightRenaming`` rules (mimo_v2_flash's ``self_attn.attention_sink_bias`` ->
    ``self_attn.sinks``) and its ``WeightConverter`` rules that only concatenate along dim 0
    (kimi_linear's q/k/v ``conv1d`` -> one ``conv1d``) or split one along dim 0 (lara_mini's
    ``in_proj`` -> ``in_proj_{qkv,z,b,a}``: a ``SplitPart``, rows by the model's parameters): the
    table transformers loads these checkpoints with, not a second copy of it. Other converters
    are not followed: such a parameter stays missing and load_model refuses it by name. Empty
    without transformers or for a family with no mapping."""
    import re

    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import Concatenate, Split, WeightConverter, WeightRenaming
    except ImportError:
        return {}
    rules, concats, splits = [], [], []
    for c in get_checkpoint_conversion_mapping(model_type) or []:
        if isinstance(c, WeightRenaming):
            rules += list(zip(c.source_patterns, c.target_patterns))
        elif (isinstance(c, WeightConverter) and len(c.source_patterns) == 1 and len(c.target_patterns) > 1
              and len(c.operations) == 1 and isinstance(c.operations[0], Split) and c.operations[0].dim == 0
              and "*" not in c.source_patterns[0]):  # fmt: skip
            splits.append((c.source_patterns[0], list(c.target_patterns)))
        elif (isinstance(c, WeightConverter) and len(c.target_patterns) == 1 and len(c.source_patterns) > 1
              and len(c.operations) == 1 and isinstance(c.operations[0], Concatenate) and c.operations[0].dim == 0
              and "*" not in "".join(c.source_patterns)):  # fmt: skip
            concats.append((list(c.source_patterns), c.target_patterns[0]))
    out, back = {}, {}
    for n in names if rules or concats or splits else ():
        m = n
        for a, b in rules:
            m = re.sub(a, b, m)
        back[m] = n
        if m != n:
            out.setdefault(m, n)
    for srcs, tgt in concats:
        for m in list(back):
            if re.search(srcs[0], m):
                parts = [re.sub(srcs[0], x.replace("\\", ""), m) for x in srcs]
                if all(x in back for x in parts):
                    out.setdefault(re.sub(srcs[0], tgt.replace("\\", ""), m), tuple(back[x] for x in parts))
    for src, tgts in splits:
        for m in list(back):
            if re.search(src, m):
                whole = tuple(re.sub(src, x.replace("\\", ""), m) for x in tgts)
                for i, x in enumerate(whole):
                    out.setdefault(x, SplitPart(back[m], whole, i))
    return out


@dataclass(frozen=True)
class SplitPart:
    """Part ``index`` of the stored tensor ``source``, which transformers splits along dim 0 on load
    into ``targets``, each as many rows as that model parameter has (its ``Split`` operation)."""

    source: str
    targets: tuple
    index: int

    def sizes(self, model) -> list[int]:
        """Every target's row count, from the model's parameter shapes (their sum: the stored rows)."""
        return [model.get_parameter(x).shape[0] for x in self.targets]

    def rows(self, model) -> tuple[int, int]:
        """(first row, row count) of this part."""
        sizes = self.sizes(model)
        return sum(sizes[: self.index]), sizes[self.index]


def _config_dict(pm) -> dict:
    from .sources.checkpoint import decode_special_floats

    cfg = decode_special_floats(dict(pm.config or {}))  # {"__float__": "Infinity"} -> inf, as transformers reads config.json
    if not cfg.get("model_type"):
        raise UnsupportedError(f"{pm.path}: the manifest carries no model config (model.config.model_type)")
    cfg.pop("quantization_config", None)  # the experts are packed; other quantized linears are dequantized on load
    return cfg


def _carried_linears(pm):
    """(view, {prefix: CarriedLinear}) of the quantized Linears a packed directory carries
    (moepack/sources/linears.py; found from the source's quantization_config and the headers)."""
    got = pm.__dict__.get("_carried_linears")
    if got is None:
        from .sources.linears import PackedView, find_linears

        view = PackedView(pm)
        got = pm.__dict__["_carried_linears"] = (view, find_linears(view))
    return got


_CODE_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)


def _quantized_weight(pm, prefix: str, qc: dict | None = None) -> torch.Tensor | None:
    """fp32 weight of the Linear ``prefix`` when the directory carries it quantized (GPTQ, AWQ,
    compressed-tensors int/pack/float/mxfp4-pack-quantized, block FP8), dequantized through its source
    format's codec; None when it carries ``prefix.weight`` as floats. A ``prefix.weight`` of an
    integer or FP8 dtype that no codec claims is refused (its raw codes are not weights)."""
    from .sources.linears import dequantize_linear

    view, lins = _carried_linears(pm)
    lin = lins.get(prefix)
    if lin is not None:
        return dequantize_linear(view, lin)
    w = f"{prefix}.weight"
    if w in pm._tensor_file and pm.tensor(w).dtype in _CODE_DTYPES:
        method = ((pm.config or {}).get("quantization_config") or {}).get("quant_method")
        raise UnsupportedError(f"tensor {w!r} is {str(pm.tensor(w).dtype).replace('torch.', '')} with no scale moepack can "
                               f"pair with it (quant_method={method!r}): load_model cannot dequantize it")  # fmt: skip
    return None


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside keep their parameters on the meta device (never allocated nor
    initialized) and their buffers on the CPU, as accelerate's ``init_empty_weights`` does."""
    register = torch.nn.Module.register_parameter

    def on_meta(self, name, param):
        register(self, name, param)
        if param is not None and not param.is_meta:
            self._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _rebuild_buffers(model) -> None:
    """Non-persistent buffers (rotary ``inv_freq``) are computed, never saved: build each module
    that holds one on the meta device again, on the CPU, from the model config."""
    for name, mod in list(model.named_modules()):
        if not any(b is not None and b.is_meta for b in mod._buffers.values()):
            continue
        cfg = getattr(mod, "config", None) or model.config
        fresh, err = None, None
        # (config) or (config, layer_idx): minimax's lightning attention computes per-layer decays
        for args in ({"config": cfg}, (cfg,), (cfg, getattr(mod, "layer_idx", None))):
            try:
                with _parameters_on_meta():  # only the buffers are wanted: no weight is allocated
                    fresh = type(mod)(**args) if isinstance(args, dict) else type(mod)(*args)
                break
            except Exception as e:  # noqa: BLE001 - a module we cannot rebuild: named below
                err = e
        if fresh is None:
            raise UnsupportedError(f"module {name} ({type(mod).__name__}): its buffers are not saved and it cannot be "
                                   f"rebuilt from the config ({type(err).__name__})")  # fmt: skip
        for bname, b in mod._buffers.items():
            if b is not None and b.is_meta:
                nb = fresh._buffers.get(bname)
                if nb is None or nb.is_meta:
                    raise UnsupportedError(f"buffer {name}.{bname}: not in the packed directory and not computable from the config")
                mod._buffers[bname] = nb


_FLOAT_NAMES = ("bfloat16", "float16", "float32")


def _config_dtype(pm, cfgd: dict) -> torch.dtype:
    """The model dtype config.json names (``dtype``, else ``torch_dtype``); "auto" or none: the
    stored dtype of the embedding (else bfloat16); any other word is refused naming it."""
    word = cfgd.get("dtype") or cfgd.get("torch_dtype")
    word = str(word).replace("torch.", "") if word is not None else "auto"
    if word in _FLOAT_NAMES:
        return getattr(torch, word)
    if word != "auto":
        raise UnsupportedError(f"{pm.path}: model.config dtype={word!r}: must be one of {', '.join(_FLOAT_NAMES)} or 'auto' "
                               "(or pass dtype= / --dtype)")  # fmt: skip
    emb = next((n for n in pm._tensor_file if n.endswith("embed_tokens.weight")), None)
    stored = pm.tensor(emb).dtype if emb else torch.bfloat16
    return stored if stored in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def load_model(packed_dir, dtype=None, *, strict: bool = False):
    """The transformers model of a packed directory, built from the directory alone.

    The architecture comes from the carried config.json (instantiated on the meta device, so no
    weight is allocated), its MoE blocks become ``PackedMoEBlock``s on the memory-mapped experts,
    and every other parameter is a view of the directory's memory map (a copy only where ``dtype``
    differs from the stored dtype). A Linear the source stored quantized (GPTQ, AWQ,
    compressed-tensors int/pack/float/mxfp4-pack-quantized, block FP8: attention, dense MLPs) is dequantized
    through its format's codec to fp32, then cast to ``dtype``: it then costs ``N * K *
    dtype.itemsize`` bytes of RAM (docs/COMPATIBILITY.md, "What the rest of the model is"). DeepSeek's
    MTP layers (``num_nextn_predict_layers``, index >= ``num_hidden_layers``; convert never packs
    them) are not run, whether their tensors are carried or were left out: transformers has no
    module for them. ``model.moepack_load`` (a ``LoadReport``) records both. The views are read-only: do not train or modify the weights in
    place. ``dtype``: default the config's ``dtype``."""
    pm = _as_packed(packed_dir, strict)
    tf = _transformers()
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfgd = _config_dict(pm)
    model_type = cfgd["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise UnsupportedError(f"model_type={model_type!r}: the installed transformers {tf.__version__} has no such family")
    _family(model_type)
    if dtype is None:
        dtype = _config_dtype(pm, cfgd)
    cfgd.pop("model_type")
    cfgd["dtype"] = str(dtype).replace("torch.", "")  # "auto" (or none) resolved: transformers reads it too
    cfgd.pop("torch_dtype", None)
    try:
        with quiet_transformers():
            config = AutoConfig.for_model(model_type, **cfgd)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; the user sees one line
        raise UnsupportedError(f"{pm.path}: model.config: transformers cannot build a {model_type} model from it "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None  # fmt: skip
    patch(model, pm, strict=strict)
    qc = (pm.config or {}).get("quantization_config")
    names = pm._tensor_file
    report = _load_report(pm)
    renamed = checkpoint_renames(model_type, names)
    tied = []
    for pname, p in list(model.named_parameters(remove_duplicate=False)):
        mod_name, _, leaf = pname.rpartition(".")
        mod = model.get_submodule(mod_name)
        t = _quantized_weight(pm, mod_name, qc) if leaf == "weight" else None
        if t is not None:
            report.dequantized[mod_name] = _carried_linears(pm)[1][mod_name].codec
            report.dequantized_bytes += t.numel() * p.element_size()
            report.quantized_bytes += report._sizes[mod_name]
        if t is None and pname in names:
            t = pm.tensor(pname)
        elif t is None and pname in renamed:
            r = renamed[pname]  # stored under another name, in parts concatenated on load (a copy), or split (a view)
            if isinstance(r, SplitPart):
                t = pm.tensor(r.source).narrow(0, *r.rows(model))
            else:
                t = pm.tensor(r) if isinstance(r, str) else torch.cat([pm.tensor(x) for x in r], 0)
        if t is None:
            tied.append(pname)
            continue
        if list(t.shape) != list(p.shape):
            raise ModelMismatchError(f"tensor {pname}: {list(t.shape)} in the packed directory, the model expects {list(p.shape)}")
        if t.dtype != p.dtype:
            t = t.to(p.dtype)
        mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
    if tied:
        model.tie_weights()
    for pname, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta:
            raise UnsupportedError(f"tensor {pname}: the model needs it and the packed directory {pm.path} does not carry it")
    _rebuild_buffers(model)
    model.eval()
    model.moepack_load = report
    return model


@dataclass
class LoadReport:
    """What ``load_model`` did besides mapping tensors: the quantized Linears it dequantized
    (prefix -> codec) and the bytes they occupy as stored (``quantized_bytes``, in the directory's
    memory map, never touched once dequantized) and in memory after (``dequantized_bytes`` =
    sum of N * K * dtype.itemsize); the layers it did not run (``mtp_layers``: DeepSeek's
    multi-token-prediction layers, index >= num_hidden_layers, whether convert packed their
    experts, carried their tensors or left them out) with how many carried tensors belong to them
    (``mtp_tensors``) and how many source tensors convert left out (``convert_skipped``, the
    manifest's ``source.skipped``)."""

    dequantized: dict = field(default_factory=dict)
    quantized_bytes: int = 0
    dequantized_bytes: int = 0
    mtp_layers: list = field(default_factory=list)
    mtp_tensors: int = 0
    convert_skipped: int = 0  # source tensors convert left out (manifest source.skipped), e.g. an MTP layer's
    convert_skipped_why: str = ""
    _sizes: dict = field(default_factory=dict, repr=False)  # prefix -> stored bytes of its tensors

    def lines(self) -> list[str]:
        out = []
        if self.dequantized:
            codecs = sorted(set(self.dequantized.values()))
            out.append(f"{len(self.dequantized)} quantized linear(s) ({', '.join(codecs)}) dequantized on load: "
                       f"{self.quantized_bytes / 2**20:.2f} MiB stored -> {self.dequantized_bytes / 2**20:.2f} MiB in memory")  # fmt: skip
        if self.mtp_layers:
            out.append(f"MTP layer(s) {self.mtp_layers} (num_nextn_predict_layers) not run: transformers has no module for "
                       f"them ({self.mtp_tensors} carried tensors left unused, {self.convert_skipped} left out by convert)")  # fmt: skip
        return out


def _load_report(pm) -> LoadReport:
    r = LoadReport()
    _, lins = _carried_linears(pm)
    man = pm.manifest["tensors"]
    nl = (pm.config or {}).get("num_hidden_layers")
    if (pm.config or {}).get("num_nextn_predict_layers") and isinstance(nl, int):
        found = set()
        for n in man:
            parts = n.split(".")
            if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= nl:
                r.mtp_tensors += 1
                found.add(int(parts[2]))
        skipped = (pm.manifest.get("source") or {}).get("skipped") or {}
        r.convert_skipped, r.convert_skipped_why = len(skipped.get("tensors") or []), str(skipped.get("why") or "")
        for n in skipped.get("tensors") or []:
            parts = str(n).split(".")
            if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= nl:
                found.add(int(parts[2]))
        r.mtp_layers = sorted(found)
    r._sizes = {p: sum(_stored_bytes(man[t]) for t in lin.tensors.values()) for p, lin in lins.items()}
    return r


def _stored_bytes(entry: dict) -> int:
    n = 1
    for d in entry["shape"]:
        n *= int(d)
    return n * torch.empty(0, dtype=getattr(torch, entry["dtype"])).element_size()


# --------------------------------------------------------------------------- generation


@dataclass
class Generation:
    tokens: list[int]  # the new tokens
    logits: list[torch.Tensor]  # the fp32 logits [V] each new token was chosen from
    seconds: float  # wall time of the generation (prefill + decode)
    moe_seconds: float  # of which inside the packed MoE blocks (0 when the model is not patched)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")

    @property
    def moe_share(self) -> float:
        return self.moe_seconds / self.seconds if self.seconds > 0 else 0.0


@torch.no_grad()
def greedy_generate(model, prompt_ids, max_new_tokens: int) -> Generation:
    """Greedy decoding of exactly ``max_new_tokens`` tokens (no stop at eos) with the KV cache:
    argmax of the last position's logits at each step (ties: the lowest id, torch.argmax's rule)."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long).reshape(1, -1)
    if ids.numel() == 0:
        raise UnsupportedError("prompt: at least one token id is needed")
    vocab = int(model.config.vocab_size)
    bad = [int(i) for i in ids[0] if not 0 <= int(i) < vocab]
    if bad:
        raise UnsupportedError(f"prompt token id {bad[0]}: must be in [0, vocab_size={vocab})")
    blocks = packed_blocks(model)
    moe0 = sum(b.seconds for b in blocks)
    import inspect

    # transformers 5.24 renamed past_key_values to cache (the old name warns)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out, steps, past = [], [], None
    t0 = time.perf_counter()
    x = ids
    for _ in range(int(max_new_tokens)):
        res = model(input_ids=x, use_cache=True, **({key: past} if past is not None else {}))
        past = getattr(res, key)
        last = res.logits[0, -1].float()
        nxt = int(torch.argmax(last))
        out.append(nxt)
        steps.append(last)
        x = torch.tensor([[nxt]], dtype=torch.long)
    secs = time.perf_counter() - t0
    return Generation(out, steps, secs, sum(b.seconds for b in blocks) - moe0)


def load_tokenizer(packed_dir):
    """The tokenizer the packed directory carries, loaded offline (AutoTokenizer, local files only)."""
    path = Path(packed_dir)
    manifest = json.loads((path / "moepack.json").read_text()) if (path / "moepack.json").is_file() else {}
    carried = set(manifest.get("carried_files") or [])
    tok_files = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}
    if not carried & tok_files:
        raise UnsupportedError(f"{path}: the packed directory carries no tokenizer files (use --prompt-ids): a text prompt "
                               "needs the source's tokenizer (tokenizer.json, tokenizer.model, ...)")  # fmt: skip
    gone = sorted(n for n in carried & tok_files if not (path / n).is_file())
    if gone:
        raise UnsupportedError(f"{path}: tokenizer file {gone[0]} is listed in carried_files but missing: the directory was "
                               "edited after convert (`moepack verify` checks every carried file)")  # fmt: skip
    _transformers()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; the user sees one line
        raise UnsupportedError(f"{path}: its tokenizer does not load offline ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


__all__ = ["FAMILIES", "LoadReport", "SplitPart", "checkpoint_renames", "ModelMismatchError", "PackedMoEBlock", "check_compatible", "greedy_generate", "load_model",
           "load_tokenizer", "packed_blocks", "patch"]  # fmt: skip
