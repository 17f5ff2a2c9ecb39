"""Dense (bf16 / fp16 / fp32) MoE checkpoints, as Hugging Face ships them.

Expert tensors are found by name, whatever the family (FORMATS.md §6):

* per expert, 2-D ``[out, in]``: ``<prefix>.experts.<e>.{gate_proj,up_proj,down_proj}.weight``
  (Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.5, ...) or ``.{w1,w3,w2}.weight`` (Mixtral,
  Phi-3.5-MoE), biases optional;
* fused 3-D, out-major ``<prefix>.experts.gate_up_proj [E, 2I, H]`` + ``down_proj [E, H, I]``
  (transformers 5 in-memory form);
* fused 3-D, in-major ``gate_up_proj [E, H, 2I]`` + ``down_proj [E, I, H]`` (Llama-4; gpt-oss,
  whose gate/up columns are interleaved and which has ``*_bias`` tensors);
* Granite-MoE ``<prefix>.input_linear.weight [E, 2I, H]`` + ``output_linear.weight [E, H, I]``.

Everything is decided from the headers and config.json before a byte of data is read, and
every inconsistency (missing or extra experts, a shape or dtype mismatch) is refused with the
tensor's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..errors import SourceError
from ..families import family_of
from .checkpoint import Checkpoint, decode_special_floats

FLOAT_DTYPES = {"BF16", "F16", "F32"}

# model_type -> (experts key, top-k key, expert intermediate key) in config.json
_NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_HIDDEN_KEYS = ("hidden_size", "d_model")  # d_model: DBRX
# The per-family checkpoint facts (experts stored in-major or interleaved, an activation config.json
# does not name, attention experts, identity experts) are moepack.families entries (family_of).


def identity_experts_of(config: dict) -> int:
    """Z, the identity experts the family's routing picks after its E packed experts (0: none)."""
    key = family_of(config.get("model_type")).identity_experts_key
    v = config.get(key) if key else None
    if v is None:
        return 0
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise SourceError(f"config.json: {key}={v!r}: the number of identity (zero-computation) experts must be an integer >= 0")
    return v

_PER_EXPERT = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<kind>weight|bias)$")
_FUSED = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<proj>gate_up_proj|down_proj|fc1|fc2)(?P<bias>_bias)?(?:\.weight)?$")
_GRANITE = re.compile(r"^(?P<prefix>.+)\.(?P<proj>input_linear|output_linear)\.weight$")
# DBRX: every expert's gate (w1), up (v1) and down (w2, stored [I, H] per expert) stacked in one 2-D [E x I, H] each
_DBRX = re.compile(r"^(?P<prefix>.+)\.experts\.mlp\.(?P<proj>w1|v1|w2)$")
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)(?:\.|$)")  # blocks: DBRX's transformer.blocks.<n>

_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass
class LayerSpec:
    """One MoE layer, as found in the headers (no data read)."""

    index: int
    prefix: str  # e.g. "model.layers.3.mlp"
    kind: str  # "per_expert" | "fused_out" | "fused_in" | "granite"
    num_experts: int
    hidden: int
    intermediate: int
    dtype: str  # safetensors dtype of the expert weights
    interleaved: bool
    has_bias: bool
    activation: str
    names: dict = field(default_factory=dict)  # role -> tensor name(s)
    expert_tensors: list = field(default_factory=list)  # every source tensor this layer consumes
    router: dict = field(default_factory=dict)  # {"weight": name, "bias": name|None, "correction_bias": name|None}
    shared: dict = field(default_factory=dict)  # shared-expert tensor names (carried over as they are)
    # Quantized sources: the facts the source's scheme reads, as that scheme's typed dataclass
    # (the int4 readers: moepack.schemes.int4.facts.Int4Facts). None for float sources and for
    # sources whose scheme needs none (int8 per channel).
    quant: object | None = None
    # identity (zero-computation) experts routed after the E packed ones (longcat_flash), and the source
    # tensors stored for them (transformers' unused gate/up rows): carried unchanged, never packed
    identity_experts: int = 0
    identity_tensors: list = field(default_factory=list)


@dataclass
class CanonicalLayer:
    """One MoE layer in the canonical in-memory form every packer consumes."""

    spec: LayerSpec
    w13: torch.Tensor  # [E, 2I, H]: gate rows then up rows (interleaved pairs if spec.interleaved)
    w2: torch.Tensor  # [E, H, I]
    w13_bias: torch.Tensor | None  # [E, 2I]
    w2_bias: torch.Tensor | None  # [E, H]
    # Quantized sources: the source scheme's canonical tensors as stored (moepack.schemes:
    # Scheme.canonical, e.g. int8_channel's w13_q / w13_scale / w2_q / w2_scale); w13 / w2 above
    # are then their dequantized fp32 values. None for float sources.
    canonical: dict | None = None


def _cfg(config: dict, *keys, default=None):
    for k in keys:
        if k in config and config[k] is not None:
            return config[k]
    return default


def text_config(config: dict) -> dict:
    """The language-model part of a config (multimodal configs nest it), with transformers'
    ``{"__float__": "Infinity"}`` values decoded to floats (checkpoint.decode_special_floats)."""
    config = decode_special_floats(config)
    key = text_config_key(config)
    if key is None:
        return config
    merged = dict(config[key])
    merged.setdefault("model_type", config.get("model_type"))
    return merged


def text_config_key(config: dict) -> str | None:
    """The key of the nested language-model config a multimodal config.json holds, or None."""
    for key in ("text_config", "language_config"):
        sub = config.get(key)
        if isinstance(sub, dict) and any(k in sub for k in _NUM_EXPERTS_KEYS):
            return key
    return None


def mtp_skipped(ckpt) -> tuple[list, str]:
    """(the source tensors convert leaves out, why): DeepSeek-V3's multi-token-prediction layers,
    ``layers.<i>`` with i >= num_hidden_layers when ``num_nextn_predict_layers`` > 0. They are a
    training / speculative-decoding head that transformers builds no module for: every reader
    skips them (neither packed nor carried; the manifest's ``source.skipped`` lists them)."""
    cfg = text_config(ckpt.config)
    mtp, n = cfg.get("num_nextn_predict_layers"), cfg.get("num_hidden_layers")
    if not isinstance(mtp, int) or mtp <= 0 or not isinstance(n, int):
        return [], ""
    names = sorted(x for x in ckpt.tensors if (m := _LAYER_INDEX.search(x)) and int(m.group(1)) >= n)
    if not names:
        return [], ""
    return names, (f"multi-token-prediction layers (num_nextn_predict_layers={mtp}: layers {n}..{n + mtp - 1}) are a "
                   "training / speculative-decoding head, not part of the model's forward pass: skipped")  # fmt: skip


def activation_of(config: dict) -> str:
    """The expert activation from config.json (gpt-oss: swigluoai; MiniMax-M3, whose config says
    hidden_act="silu" while its experts compute gpt-oss's clamped gate with its swiglu_alpha / swiglu_limit
    on halves that are not interleaved)."""
    fixed = family_of(config.get("model_type")).activation
    if fixed == "swigluoai":
        return "swigluoai"
    if fixed == "relu2":  # non-gated experts: its experts' activation (its Mamba layers have their own)
        act = config.get("mlp_hidden_act", "relu2")
        if act != "relu2":
            raise SourceError(f"config.json mlp_hidden_act={act!r}: moepack runs {config['model_type']}'s non-gated experts "
                              "with relu2 only")  # fmt: skip
        return "relu2"
    act = _cfg(config, "hidden_act", "hidden_activation", "activation_function", default="silu")
    ffn = config.get("ffn_config")  # DBRX: ffn_config.ffn_act_fn = {"name": ...} (DbrxExpertGLU's default silu)
    if isinstance(ffn, dict) and isinstance(ffn.get("ffn_act_fn"), dict):
        act = ffn["ffn_act_fn"].get("name", "silu")
    table = {
        "silu": "silu",
        "swish": "silu",
        "gelu": "gelu",
        "gelu_pytorch_tanh": "gelu_tanh",
        "gelu_new": "gelu_tanh",
        "gelu_fast": "gelu_tanh",
    }
    if act not in table:
        raise SourceError(f"config.json hidden_act={act!r}: moepack runs silu, gelu, gelu_tanh (and gpt-oss swigluoai, "
                          "Nemotron-H's non-gated relu2)")  # fmt: skip
    return table[act]


def num_experts_of(config: dict):
    """The routed expert count config.json states (DBRX keeps it in ``ffn_config.moe_num_experts``), or None."""
    n = _cfg(config, *_NUM_EXPERTS_KEYS)
    ffn = config.get("ffn_config")
    if n is None and isinstance(ffn, dict):
        n = ffn.get("moe_num_experts")
    return n


_EXPERTISH = re.compile(r"(?:^|\.)(?:experts?|expert_\w+|moe)\.")


def looks_moe(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint is a MoE model by its config (an expert count) or its tensor names."""
    n = num_experts_of(text_config(ckpt.config))
    return (isinstance(n, int) and n > 0) or any(_EXPERTISH.search(x) for x in ckpt.tensors)


def _no_expert_groups(ckpt: Checkpoint, model_type, num_experts) -> str:
    """Why no expert group was found: a checkpoint whose tensors do look like experts (or whose config
    counts experts) stores them under names no reader here knows; else it is no MoE checkpoint."""
    looks = sorted(n for n in ckpt.tensors if _EXPERTISH.search(n))
    known = "'...experts.<e>.{gate,up,down}_proj.weight' / '.{w1,w3,w2}.weight', '...experts.{gate_up,down}_proj', " \
            "'...{input,output}_linear.weight'"  # fmt: skip
    if looks or (isinstance(num_experts, int) and num_experts > 0):
        shown = ", ".join(repr(n) for n in looks[:3]) if looks else "none named '...experts...'"
        return (f"source {ckpt.path}: model_type={model_type!r} is a MoE model, but its expert tensors ({shown}) are stored "
                f"under names moepack does not read (it reads {known})")  # fmt: skip
    return f"source {ckpt.path}: not a MoE checkpoint (model_type={model_type!r}): no expert tensors ({known}) were found"


def _layer_index(prefix: str) -> int:
    m = _LAYER_INDEX.search(prefix)
    if not m:
        raise SourceError(f"expert tensors under {prefix!r}: cannot find a layer index ('layers.<n>') in the name")
    return int(m.group(1))


# What the expert weights of a checkpoint may be stored as (readers of quantized formats pass
# their own), and the rule a refusal quotes.
DENSE_WEIGHTS = (FLOAT_DTYPES, "a dense checkpoint's experts must be BF16, F16 or F32 (quantized checkpoints need their own reader)")


def discover_layers(ckpt: Checkpoint, weights: tuple[set, str] = DENSE_WEIGHTS) -> list[LayerSpec]:
    """Every MoE layer of the checkpoint, validated against config.json. ``weights``: the
    allowed safetensors dtypes of expert (and shared-expert) weights and the rule's wording."""
    config = text_config(ckpt.config)
    model_type = config.get("model_type", "?")
    hidden = _cfg(config, *_HIDDEN_KEYS)
    num_experts = num_experts_of(config)
    if not isinstance(hidden, int) or hidden <= 0:
        key = next((k for k in _HIDDEN_KEYS if k in config), "hidden_size")
        raise SourceError(f"config.json: {key}={hidden!r} must be a positive integer")

    groups: dict[str, dict] = {}
    attention = family_of(model_type).attention_experts
    for name, ti in ckpt.tensors.items():
        if attention and f"{attention}." in name:
            continue
        m = _PER_EXPERT.match(name)
        if m:
            g = groups.setdefault(m["prefix"], {"kind": "per_expert", "t": {}})
            if g["kind"] != "per_expert":
                raise SourceError(f"{name}: per-expert tensors mixed with fused expert tensors under {m['prefix']!r}")
            g["t"][(int(m["e"]), _ROLE[m["proj"]], m["kind"])] = name
            continue
        m = _FUSED.match(name)
        role = _fused_role(model_type, name, m["proj"]) if m else None
        if role is not None:
            g = groups.setdefault(m["prefix"], {"kind": "fused", "t": {}})
            if g["kind"] != "fused":
                raise SourceError(f"{name}: fused expert tensors mixed with per-expert tensors under {m['prefix']!r}")
            g["t"][(role, "bias" if m["bias"] else "weight")] = name
            continue
        m = _DBRX.match(name)
        if m and ti.shape and len(ti.shape) == 2:
            g = groups.setdefault(m["prefix"], {"kind": "dbrx", "t": {}})
            g["t"][m["proj"]] = name
            continue
        m = _GRANITE.match(name)
        if m and ti.shape and len(ti.shape) == 3:
            g = groups.setdefault(m["prefix"], {"kind": "granite", "t": {}})
            g["t"][(m["proj"], "weight")] = name
    if not groups:
        raise SourceError(_no_expert_groups(ckpt, model_type, num_experts))
    if num_experts is not None and (not isinstance(num_experts, int) or isinstance(num_experts, bool)):
        key = next((k for k in _NUM_EXPERTS_KEYS if _cfg(config, k) is not None), "ffn_config.moe_num_experts")
        raise SourceError(f"config.json: {key}={num_experts!r} ({type(num_experts).__name__}) must be an integer (the number of routed experts)")
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise SourceError(f"config.json: number of experts ({'/'.join(_NUM_EXPERTS_KEYS)}) is missing or not positive")

    act = activation_of(config)
    z = identity_experts_of(config)
    specs = []
    for prefix, g in sorted(groups.items(), key=lambda kv: _layer_index(kv[0])):
        if g["kind"] == "per_expert":
            specs.append(_per_expert_spec(ckpt, prefix, g["t"], num_experts, hidden, act, weights, z))
        elif g["kind"] == "dbrx":
            specs.append(_dbrx_spec(ckpt, prefix, g["t"], num_experts, hidden, act, weights))
        else:
            specs.append(_fused_spec(ckpt, prefix, g["kind"], g["t"], num_experts, hidden, act, model_type, weights))
    seen = {}
    for s in specs:
        s.identity_experts = z
        if s.index in seen:
            raise SourceError(f"layer {s.index} has two expert groups: {seen[s.index]!r} and {s.prefix!r}")
        seen[s.index] = s.prefix
        _attach_router_and_shared(ckpt, s, weights)
    return specs


def _check_dtype(ckpt: Checkpoint, name: str, want: str | None, weights: tuple[set, str] = DENSE_WEIGHTS) -> str:
    d = ckpt.info(name).dtype_str
    if d not in weights[0]:
        raise SourceError(f"tensor {name!r} has dtype {d}: {weights[1]}")
    if want is not None and d != want:
        raise SourceError(f"tensor {name!r} has dtype {d}, but the layer's other expert tensors are {want}")
    return d


def _check_shape(ckpt: Checkpoint, name: str, want: tuple) -> None:
    got = ckpt.info(name).shape
    if tuple(got) != tuple(want):
        raise SourceError(f"tensor {name!r} has shape {list(got)}: expected {list(want)}")


def _per_expert_spec(ckpt, prefix, t, num_experts, hidden, act, weights=DENSE_WEIGHTS, identity: int = 0) -> LayerSpec:
    # an identity expert's gate/up rows (transformers' LongcatFlashExperts keeps E+Z of them, unused): set aside
    ident = sorted(n for (e, role, _), n in t.items() if num_experts <= e < num_experts + identity and role != "down")
    t = {k: v for k, v in t.items() if v not in ident}
    ids = sorted({e for (e, _, _) in t})
    extra = [e for e in ids if e >= num_experts]
    if extra:
        names = sorted(n for (e, _, _), n in t.items() if e >= num_experts)
        raise SourceError(f"layer {prefix!r}: extra expert tensors {names[:3]} (config.json says {num_experts} experts)")
    # non-gated (relu2) experts: up and down only (NemotronHExperts); a gate would be a part moepack does not run
    roles = ("up", "down") if act == "relu2" else ("gate", "up", "down")
    gates = sorted(n for (e, role, _), n in t.items() if role not in roles)
    if gates:
        raise SourceError(f"tensor {gates[0]!r}: the experts of this family are non-gated (relu2: up and down only)")
    for e in range(num_experts):
        for role in roles:
            if (e, role, "weight") not in t:
                raise SourceError(f"layer {prefix!r}: expert {e} has no {role} weight (config.json says {num_experts} experts)")
    gate0 = ckpt.info(t[(0, roles[0], "weight")])
    if len(gate0.shape) != 2:
        raise SourceError(f"tensor {gate0.name!r} has shape {list(gate0.shape)}: expected 2-D [I, H]")
    inter = gate0.shape[0]
    dtype = None
    has_bias = any(k == "bias" for (_, _, k) in t)
    if has_bias and act == "relu2":
        raise SourceError(f"layer {prefix!r}: non-gated (relu2) experts with biases: moepack runs them without")
    for e in range(num_experts):
        for role, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            if role not in roles:
                continue
            n = t[(e, role, "weight")]
            dtype = _check_dtype(ckpt, n, dtype, weights)
            _check_shape(ckpt, n, shape)
            if has_bias:
                b = t.get((e, role, "bias"))
                if b is None:
                    raise SourceError(f"layer {prefix!r}: expert {e} has no {role} bias while other experts have biases")
                _check_shape(ckpt, b, (shape[0],))
    return LayerSpec(
        index=_layer_index(prefix),
        prefix=prefix,
        kind="per_expert",
        num_experts=num_experts,
        hidden=hidden,
        intermediate=inter,
        dtype=dtype,
        interleaved=False,
        has_bias=has_bias,
        activation=act,
        names={k: v for k, v in t.items()},
        expert_tensors=sorted(t.values()),
        identity_tensors=ident,
    )


def _dbrx_spec(ckpt, prefix, t, num_experts, hidden, act, weights=DENSE_WEIGHTS) -> LayerSpec:
    """DBRX's experts: ``experts.mlp.{w1, v1, w2}``, each [E x I, H] (expert e's rows e*I .. (e+1)*I; w2's
    rows are its down projection transposed, [I, H]: DbrxExpertGLU computes ``a @ w2``)."""
    missing = [p for p in ("w1", "v1", "w2") if p not in t]
    if missing:
        raise SourceError(f"layer {prefix!r}: DBRX experts need experts.mlp.w1, v1 and w2: {missing} missing")
    rows = ckpt.info(t["w1"]).shape[0]
    if rows % num_experts:
        raise SourceError(f"tensor {t['w1']!r} has {rows} rows: not a multiple of the {num_experts} experts of config.json")
    inter = rows // num_experts
    dtype = None
    for p in ("w1", "v1", "w2"):
        dtype = _check_dtype(ckpt, t[p], dtype, weights)
        _check_shape(ckpt, t[p], (rows, hidden))
    if dtype not in FLOAT_DTYPES:  # the quantized readers know fused and per-expert layouts only
        raise SourceError(f"tensor {t['w1']!r} is {dtype}: moepack reads DBRX's stacked experts from float (BF16, F16, F32) "
                          "tensors only")  # fmt: skip
    names = {"gate": t["w1"], "up": t["v1"], "down_t": t["w2"]}
    return LayerSpec(index=_layer_index(prefix), prefix=prefix, kind="dbrx", num_experts=num_experts, hidden=hidden,
                     intermediate=inter, dtype=dtype, interleaved=False, has_bias=False, activation=act, names=names,
                     expert_tensors=sorted(names.values()))  # fmt: skip


def _read_rows(ckpt: Checkpoint, name: str, r0: int, r1: int) -> torch.Tensor:
    """Rows ``r0 .. r1`` of a 2-D tensor, read from disk without the rest."""
    from .checkpoint import TensorInfo

    ti = ckpt.info(name)
    row = ti.nbytes // ti.shape[0]
    part = TensorInfo(name, ti.file, ti.dtype_str, (r1 - r0, *ti.shape[1:]), ti.offset + r0 * row, (r1 - r0) * row)
    return ckpt._read_info(part, None)


def _fused_spec(ckpt, prefix, kind, t, num_experts, hidden, act, model_type, weights=DENSE_WEIGHTS) -> LayerSpec:
    if kind == "granite":
        gu_name, dn_name = t.get(("input_linear", "weight")), t.get(("output_linear", "weight"))
        gub_name = dnb_name = None
        if gu_name is None or dn_name is None:
            raise SourceError(f"layer {prefix!r}: Granite-MoE experts need both input_linear and output_linear weights")
    else:
        gu_name, dn_name = t.get(("gate_up_proj", "weight")), t.get(("down_proj", "weight"))
        gub_name, dnb_name = t.get(("gate_up_proj", "bias")), t.get(("down_proj", "bias"))
        if gu_name is None or dn_name is None:
            raise SourceError(f"layer {prefix!r}: fused experts need both gate_up_proj and down_proj")
    gu = ckpt.info(gu_name)
    if len(gu.shape) != 3 or gu.shape[0] != num_experts:
        raise SourceError(f"tensor {gu_name!r} has shape {list(gu.shape)}: expected 3-D [{num_experts}, ., .] (config.json experts)")
    e, a, b = gu.shape
    in_major = family_of(model_type).stored_in_major
    if kind == "granite" or (not in_major and b == hidden and a % 2 == 0):
        layout, inter = "fused_out", a // 2
        if b != hidden:
            raise SourceError(f"tensor {gu_name!r} has shape {list(gu.shape)}: expected [E, 2I, H={hidden}]")
        down_shape = (e, hidden, inter)
    elif a == hidden and b % 2 == 0:
        layout, inter = "fused_in", b // 2
        down_shape = (e, inter, hidden)
    else:
        raise SourceError(
            f"tensor {gu_name!r} has shape {list(gu.shape)}: neither [E, 2I, H] nor [E, H, 2I] with H={hidden}"
        )
    dtype = _check_dtype(ckpt, gu_name, None, weights)
    _check_dtype(ckpt, dn_name, dtype, weights)
    _check_shape(ckpt, dn_name, down_shape)
    has_bias = gub_name is not None or dnb_name is not None
    if has_bias:
        if gub_name is None or dnb_name is None:
            raise SourceError(f"layer {prefix!r}: only one of gate_up_proj_bias / down_proj_bias is present")
        _check_shape(ckpt, gub_name, (e, 2 * inter))
        _check_shape(ckpt, dnb_name, (e, hidden))
    names = {"gate_up": gu_name, "down": dn_name, "gate_up_bias": gub_name, "down_bias": dnb_name}
    return LayerSpec(
        index=_layer_index(prefix),
        prefix=prefix,
        kind="granite" if kind == "granite" else layout,
        num_experts=e,
        hidden=hidden,
        intermediate=inter,
        dtype=dtype,
        interleaved=family_of(model_type).interleaved,
        has_bias=has_bias,
        activation=act,
        names=names,
        expert_tensors=sorted(n for n in names.values() if n),
    )


def _attach_router_and_shared(ckpt: Checkpoint, s: LayerSpec, weights: tuple[set, str] = DENSE_WEIGHTS) -> None:
    """Router and shared-expert tensor names next to the experts (carried over unchanged)."""
    parent = s.prefix
    moe = parent
    # (hy_v3 stores its router as router.gate, hunyuan_v1_moe as gate.wg)
    cands_w = [f"{moe}.gate.weight", f"{moe}.router.weight", f"{moe}.router.layer.weight", f"{moe}.router.gate.weight",
               f"{moe}.gate.wg.weight", f"{moe}.router.classifier.weight"]  # fmt: skip
    for c in cands_w:
        if c in ckpt.tensors:
            s.router["weight"] = c
            base = c[: -len(".weight")]
            if f"{base}.bias" in ckpt.tensors:
                # a logit bias, or (DeepSeek-V4's gate.bias) a correction bias: transformers' own
                # conversion mapping says which, by the name it loads the tensor under
                role = "correction_bias" if _loads_as(ckpt, f"{base}.bias", ".e_score_correction_bias") else "bias"
                s.router[role] = f"{base}.bias"
            for cb in ("e_score_correction_bias", "expert_bias"):  # expert_bias: bailing_hybrid
                if f"{base}.{cb}" in ckpt.tensors:
                    s.router["correction_bias"] = f"{base}.{cb}"
            if f"{base}.tid2eid" in ckpt.tensors:  # DeepSeek-V4's hash layers: token id -> expert ids
                s.router["hash"] = f"{base}.tid2eid"
            break
    # some layouts keep it beside the gate (hy_v3 as expert_bias), laguna beside the experts
    # (longcat_flash: beside its router.classifier, in the router)
    for c in (f"{moe}.e_score_correction_bias", f"{moe}.expert_bias", f"{moe}.experts.e_score_correction_bias",
              f"{moe}.router.e_score_correction_bias"):  # fmt: skip
        if c in ckpt.tensors:
            s.router["correction_bias"] = c
    # stored outside the block, where transformers' own mapping takes it into the gate (kolibri1's
    # <layer>.moe.router.expert_bias): the mapping decides, by the name it loads the tensor under
    layer = moe.rpartition(".")[0] + "."
    outside = [n for n in ckpt.tensors if n.startswith(layer) and not n.startswith(moe + ".") and "bias" in n.rsplit(".", 1)[-1]]
    if outside and "correction_bias" not in s.router:
        from ..hf import checkpoint_renames

        mt = text_config(ckpt.config).get("model_type")
        for target, stored in checkpoint_renames(mt, outside).items():
            if target == f"{moe}.gate.e_score_correction_bias" and isinstance(stored, str):
                s.router["correction_bias"] = stored
    c = f"{moe}.moe_statics.e_score_correction_bias"  # ernie4_5_moe's ([1, E]), which its mapping moves into the gate
    if c in ckpt.tensors and _loads_as(ckpt, c, ".gate.moe_statics.e_score_correction_bias"):
        s.router["correction_bias"] = c
    subs = [(sub, ("gate_proj", "up_proj", "down_proj")) for sub in ("shared_expert", "shared_experts", "shared_mlp")]
    # DeepSeek-V4's names (w1 gate, w3 up, w2 down), where transformers' mapping loads them as those
    if _loads_as(ckpt, f"{moe}.shared_experts.w1.weight", ".shared_experts.gate_proj.weight"):
        subs.append(("shared_experts", ("w1", "w3", "w2")))
    # hy_v4's gate_proj stored as linear_gate (transformers' mapping renames every .linear_gate to .gate_proj on load)
    if _loads_as(ckpt, f"{moe}.shared_experts.linear_gate.weight", ".shared_experts.gate_proj.weight"):
        subs.insert(0, ("shared_experts", ("linear_gate", "up_proj", "down_proj")))
    # MiniMax-M3's shared expert is one Linear gate_up_proj [2I, H] (gate rows, then up rows) and a down_proj
    fused = f"{moe}.shared_experts.gate_up_proj.weight"
    if fused in ckpt.tensors:
        subs = [("shared_experts", ("gate_up_proj", "gate_up_proj", "down_proj"))]
    if s.activation == "relu2":  # a non-gated shared expert (NemotronHMLP: up and down), read as gate_proj = up_proj
        subs = [("shared_experts", ("up_proj", "up_proj", "down_proj"))]
    for sub, parts in subs:  # shared_mlp: hy_v3, hunyuan_v1_moe
        names = {p: f"{moe}.{sub}.{x}.weight" for p, x in zip(("gate_proj", "up_proj", "down_proj"), parts)}
        present = [n for n in names.values() if n in ckpt.tensors]
        if not present:
            continue
        if len(set(present)) != len(set(names.values())):
            missing = sorted(set(names.values()) - set(present))
            raise SourceError(f"layer {s.prefix!r}: shared expert is incomplete: {missing} missing")
        g, u, d = (ckpt.info(names[p]) for p in ("gate_proj", "up_proj", "down_proj"))
        is_fused = g.name == u.name and s.activation != "relu2"
        if len(g.shape) != 2 or g.shape[1] != s.hidden or (is_fused and g.shape[0] % 2):
            want = "[2 x I_shared, H" if is_fused else "[I_shared, H"
            raise SourceError(f"tensor {g.name!r} has shape {list(g.shape)}: expected {want}={s.hidden}]")
        si = g.shape[0] // 2 if is_fused else g.shape[0]  # (non-gated: g is the up projection)
        _check_shape(ckpt, u.name, (2 * si if is_fused else si, s.hidden))
        _check_shape(ckpt, d.name, (s.hidden, si))
        dt = _check_dtype(ckpt, g.name, None, weights)
        _check_dtype(ckpt, u.name, dt, weights)
        _check_dtype(ckpt, d.name, dt, weights)
        if is_fused and dt not in FLOAT_DTYPES:
            raise SourceError(f"tensor {g.name!r} is a fused gate/up shared expert stored as {dt}: moepack reads a fused "
                              "shared expert from a float (BF16, F16, F32) tensor only")  # fmt: skip
        s.shared = {"gate_proj": g.name, "up_proj": u.name, "down_proj": d.name, "intermediate": si, "gate": None}
        if is_fused:
            s.shared["fused"] = True  # gate_proj and up_proj name one [2 x I_shared, H] tensor: gate rows, then up rows
        gate = f"{moe}.shared_expert_gate.weight"
        if gate in ckpt.tensors:
            _check_shape(ckpt, gate, (1, s.hidden))
            s.shared["gate"] = gate
        break


def _fused_role(model_type: str, name: str, proj: str) -> str | None:
    """The role ("gate_up_proj" / "down_proj") of the fused expert tensor ``name``: its own name, or for
    another stored name (aria's ``experts.fc1`` / ``fc2``) the name transformers' own conversion mapping
    of the family loads it as (None: the mapping does not make it an expert tensor): not a second table here."""
    if proj in ("gate_up_proj", "down_proj"):
        return proj
    from ..hf import checkpoint_renames

    for target, stored in checkpoint_renames(model_type, [name]).items():
        leaf = target.rpartition(".experts.")[2].removesuffix(".weight")
        if stored == name and leaf in ("gate_up_proj", "down_proj"):
            return leaf
    return None


def _loads_as(ckpt: Checkpoint, name: str, suffix: str) -> bool:
    """Whether transformers' own conversion mapping of the checkpoint's family loads the tensor
    ``name`` under a name ending in ``suffix`` (DeepSeek-V4's ``gate.bias`` as the gate's
    ``e_score_correction_bias``, its ``shared_experts.w1`` as ``shared_experts.gate_proj``;
    ernie4_5_moe's ``moe_statics`` into the gate): the mapping decides what a stored name is, not a
    second table here."""
    if name not in ckpt.tensors:
        return False
    from ..hf import checkpoint_renames

    mt = text_config(ckpt.config).get("model_type")
    return any(v == name and k.endswith(suffix) for k, v in checkpoint_renames(mt, [name]).items())


def read_layer(ckpt: Checkpoint, s: LayerSpec) -> CanonicalLayer:
    """Read one layer's experts into the canonical form (only this layer is in memory)."""
    dt = ckpt.info(s.expert_tensors[0]).dtype
    e, h, i = s.num_experts, s.hidden, s.intermediate
    b13 = b2 = None
    if s.kind == "per_expert" and s.activation == "relu2":  # non-gated: w13 is the up rows [E, I, H]
        w13 = torch.stack([ckpt.read(s.names[(x, "up", "weight")]) for x in range(e)])
        w2 = torch.stack([ckpt.read(s.names[(x, "down", "weight")]) for x in range(e)])
    elif s.kind == "per_expert":
        w13 = torch.empty(e, 2 * i, h, dtype=dt)
        w2 = torch.empty(e, h, i, dtype=dt)
        if s.has_bias:
            b13 = torch.empty(e, 2 * i, dtype=dt)
            b2 = torch.empty(e, h, dtype=dt)
        for x in range(e):
            ckpt.read(s.names[(x, "gate", "weight")], w13[x, :i])
            ckpt.read(s.names[(x, "up", "weight")], w13[x, i:])
            ckpt.read(s.names[(x, "down", "weight")], w2[x])
            if s.has_bias:
                ckpt.read(s.names[(x, "gate", "bias")], b13[x, :i])
                ckpt.read(s.names[(x, "up", "bias")], b13[x, i:])
                ckpt.read(s.names[(x, "down", "bias")], b2[x])
    elif s.kind in ("fused_out", "granite"):
        w13 = ckpt.read(s.names["gate_up"])
        w2 = ckpt.read(s.names["down"])
    elif s.kind == "dbrx":
        w13 = torch.cat([ckpt.read(s.names["gate"]).view(e, i, h), ckpt.read(s.names["up"]).view(e, i, h)], 1)
        w2 = ckpt.read(s.names["down_t"]).view(e, i, h).transpose(1, 2).contiguous()
    else:  # fused_in: [E, H, 2I] and [E, I, H] -> transpose (last-dim halves gate/up, or interleaved)
        w13 = ckpt.read(s.names["gate_up"]).transpose(1, 2).contiguous()
        w2 = ckpt.read(s.names["down"]).transpose(1, 2).contiguous()
    if s.kind != "per_expert" and s.has_bias:
        b13 = ckpt.read(s.names["gate_up_bias"])
        b2 = ckpt.read(s.names["down_bias"])
    return CanonicalLayer(spec=s, w13=w13, w2=w2, w13_bias=b13, w2_bias=b2)


def read_expert_w13(ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
    """Expert ``e``'s canonical gate/up ``[2I, H]`` (interleaved pairs if ``s.interleaved``); its up
    rows ``[I, H]`` for non-gated (relu2) experts."""
    i = s.intermediate
    if s.kind == "per_expert" and s.activation == "relu2":
        return ckpt.read(s.names[(e, "up", "weight")])
    if s.kind == "per_expert":
        out = torch.empty(2 * i, s.hidden, dtype=ckpt.info(s.names[(e, "gate", "weight")]).dtype)
        ckpt.read(s.names[(e, "gate", "weight")], out[:i])
        ckpt.read(s.names[(e, "up", "weight")], out[i:])
        return out
    if s.kind == "dbrx":
        return torch.cat([_read_rows(ckpt, s.names[p], e * i, (e + 1) * i) for p in ("gate", "up")], 0)
    part = ckpt.read_slice(s.names["gate_up"], e)
    return part if s.kind in ("fused_out", "granite") else part.t().contiguous()


def read_expert_w2(ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
    """Expert ``e``'s canonical down ``[H, I]``."""
    if s.kind == "per_expert":
        return ckpt.read(s.names[(e, "down", "weight")])
    if s.kind == "dbrx":
        return _read_rows(ckpt, s.names["down_t"], e * s.intermediate, (e + 1) * s.intermediate).t().contiguous()
    part = ckpt.read_slice(s.names["down"], e)
    return part if s.kind in ("fused_out", "granite") else part.t().contiguous()


def read_biases(ckpt: Checkpoint, s: LayerSpec) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The layer's ``[E, 2I]`` and ``[E, H]`` biases, or (None, None)."""
    if not s.has_bias:
        return None, None
    if s.kind != "per_expert":
        return ckpt.read(s.names["gate_up_bias"]), ckpt.read(s.names["down_bias"])
    e, i = s.num_experts, s.intermediate
    dt = ckpt.info(s.names[(0, "gate", "bias")]).dtype
    b13, b2 = torch.empty(e, 2 * i, dtype=dt), torch.empty(e, s.hidden, dtype=dt)
    for x in range(e):
        ckpt.read(s.names[(x, "gate", "bias")], b13[x, :i])
        ckpt.read(s.names[(x, "up", "bias")], b13[x, i:])
        ckpt.read(s.names[(x, "down", "bias")], b2[x])
    return b13, b2


def read_shared(ckpt: Checkpoint, s: LayerSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared expert as a one-expert canonical pair (w13 [1, 2Is, H], w2 [1, H, Is]), or None."""
    if not s.shared:
        return None
    d = ckpt.read(s.shared["down_proj"])
    if s.activation == "relu2":  # non-gated: w13 is the up rows [1, Is, H]
        return ckpt.read(s.shared["up_proj"])[None], d[None]
    if s.shared.get("fused"):  # one [2 x I_shared, H] tensor, gate rows then up rows: already canonical
        return ckpt.read(s.shared["gate_proj"])[None], d[None]
    g = ckpt.read(s.shared["gate_proj"])
    u = ckpt.read(s.shared["up_proj"])
    return torch.cat([g, u], 0)[None], d[None]
