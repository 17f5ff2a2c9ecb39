"""Stage 1 of convert: the plan, made from config.json and the source's headers alone.

``make_plan`` opens the source, picks the scheme and layout it packs into (``parse_quantize``,
``_target_scheme``, ``_target_layout``), lists every layer's packed tensors, splits the layers
and the carried-over tensors into shards and plans each shard (``ShardPlan``), so bad input is
refused before anything is written. Apart from run.py because it reads and decides, never
writes: the resume key (moepack.convert.resume) and verify's model check (the routing and
swiglu parameters convert derives) use it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..container.plan import ShardPlan
from ..errors import ConvertError, LayoutError, MoepackError
from ..errors import UnsupportedError
from ..families import FAMILIES, family_of
from ..layout import PackedLayout, layout_tensor_plan
from ..schemes import Scheme, float_scheme, get_scheme, schemes
from ..sources import Checkpoint, LayerSpec, SourceReader, open_source, text_config
from ..sources.dense import FLOAT_DTYPES
from ..sources.linears import CarriedView, check_linear, find_linears


def expert_tensor_name(layer: int, role: str) -> str:
    return f"moepack.layers.{layer}.{role}"


def swiglu_params(config: dict) -> tuple[float, float]:
    """config.json's swigluoai ``swiglu_alpha`` and ``swiglu_limit`` (gpt-oss's defaults when
    absent), refused before anything is written by the rule open applies to the manifest's
    ``alpha`` / ``limit`` (moepack.manifest's ``swiglu_param_problem``)."""
    from ..manifest import swiglu_param_problem

    out = []
    for key, default in (("alpha", 1.702), ("limit", 7.0)):
        v = config.get(f"swiglu_{key}", default)
        rule = swiglu_param_problem(key, v)
        if rule:
            raise ConvertError(f"config.json: swiglu_{key}={v!r}: {rule}")
        out.append(float(v))
    return out[0], out[1]


def routing_for(config: dict) -> tuple[dict | None, str]:
    try:
        from ..routing import RoutingConfig
    except ImportError:  # pragma: no cover
        return None, "moepack.routing is not available"
    try:
        return RoutingConfig.from_hf_config(config).to_dict(), "from config.json"
    except MoepackError as e:
        return None, str(e)


def _block_feature(name: str) -> str:
    """What a tensor inside a MoE block that no packed or recorded part consumes is, in words."""
    leaf = name.lower()
    if "shared" in leaf:
        return "a shared expert under names moepack does not read"
    if "norm" in leaf:
        return "a norm inside the MoE block"
    if "bias" in leaf:
        return "a bias moepack does not apply"
    return "a part of the MoE block moepack does not run"


def block_leftovers(ckpt: Checkpoint, spec: LayerSpec, consumed: set) -> list[str]:
    """The source tensors inside ``spec``'s MoE block (``<prefix>.``) that neither the packed experts,
    nor the router (weight, bias, correction bias) nor the shared expert and its gate account for:
    a pack without them would not compute the block the source has."""
    mods = set()
    for n in [*spec.router.values(), *(v for k, v in spec.shared.items() if k in ("gate_proj", "up_proj", "down_proj", "gate"))]:
        if isinstance(n, str) and n:
            mods.add(n.rpartition(".")[0] + ".")  # the module: its quantization tensors (scales, zeros) belong to it
    for m in spec.shared.get("modules") or []:
        mods.add(m + ".")
    leaf = family_of(config_model_type(ckpt)).out_bias
    if leaf:  # the block's output bias: recorded as the layer's out_bias
        consumed = consumed | {f"{spec.prefix}.{leaf}"}
    out = []
    ident = set(spec.identity_tensors)  # identity experts' unused gate/up rows: carried, accounted for
    for n in ckpt.tensors:
        if not n.startswith(spec.prefix + ".") or n in consumed or n in ident or any(n.startswith(m) for m in mods):
            continue
        out.append(n)
    return sorted(out)


# model_type -> what its MoE block computes that moepack does not run, read from the family's transformers
# modeling code (5.24): convert refuses it naming this, before its tensors are read
UNSUPPORTED_FEATURES = {
    **dict.fromkeys(("gemma4", "gemma4_text"), "a MoE block woven into the decoder layer (Gemma4TextRouter normalizes "
                    "its input with its own RMSNorm and scales, and weighs each expert by a per_expert_scale; the experts "
                    "run beside the dense MLP between their own pre and post norms)"),
    "zaya": "a router that is an MLP carrying its state from layer to layer (ZayaRouter's router_states) and a skip expert",
    "inkling_text": "shared experts weighted by the router (InklingTopkRouter normalizes their logits with the routed ones)",
    **dict.fromkeys(("inkling2_text", "inkling2_loop_text"), "a softcapped SwiGLU on the experts (mlp_gate_softcap, "
                    "mlp_up_softcap: tanh softcaps of the gate factor and of up)"),
}  # fmt: skip


def config_model_type(ckpt: Checkpoint) -> str | None:
    return text_config(ckpt.config).get("model_type")


def routing_problem(config: dict, note: str) -> str:
    """The one line that says a family's routing cannot be run (convert's refusal, verify's problem)."""
    from ..routing import SUPPORTED_MODEL_TYPES

    mt = config.get("model_type")
    if mt in UNSUPPORTED_FEATURES:
        return f"model_type={mt!r}: {UNSUPPORTED_FEATURES[mt]}: moepack does not run this family"
    if mt not in SUPPORTED_MODEL_TYPES:
        return f"model_type={mt!r}: routing: moepack does not run this family's routing (it routes {', '.join(SUPPORTED_MODEL_TYPES)})"
    return f"model_type={mt!r}: routing: {note}"


def _refuse_unknown_family(ckpt: Checkpoint) -> None:
    """A MoE family whose routing moepack does not run at all is refused first, naming it: its
    tensors (other expert names, other shared experts) are then no reason to blame. A checkpoint
    with no experts at all is left to the reader ("not a MoE checkpoint")."""
    from ..routing import SUPPORTED_MODEL_TYPES
    from ..sources.dense import looks_moe

    config = text_config(ckpt.config)
    routing, note = routing_for(config)
    if routing is None and config.get("model_type") not in SUPPORTED_MODEL_TYPES and looks_moe(ckpt):
        raise ConvertError(f"refused at convert: {routing_problem(config, note)}")


# A family's norm after its block (``Family.post_norm``: recorded as the layer's ``post_norm``, format
# version 7) and its block's output bias (``Family.out_bias``: the layer's ``out_bias``) are entries of
# moepack.families.


def out_bias_of(ckpt: Checkpoint, config: dict, spec) -> str | None:
    """The carried tensor convert records as ``spec``'s layer ``out_bias`` (None: the family has none,
    or the checkpoint does not hold it). One that is not a float [H] is refused, naming it."""
    leaf = family_of(config.get("model_type")).out_bias
    name = f"{spec.prefix}.{leaf}" if leaf else None
    if name is None or name not in ckpt.tensors:
        return None
    if ckpt.info(name).shape != (spec.hidden,) or ckpt.info(name).dtype_str not in FLOAT_DTYPES:
        raise ConvertError(f"tensor {name!r} is {ckpt.info(name).dtype_str} {list(ckpt.info(name).shape)}: the bias the MoE "
                           f"block adds to its output must be a float [{spec.hidden}]")  # fmt: skip
    return name


def post_norm_of(ckpt: Checkpoint, config: dict, spec) -> dict | None:
    """The ``post_norm`` convert records for ``spec``'s layer: {"weight": the carried norm weight,
    "eps": the config's eps} for a family whose block normalizes its own output (``Family.post_norm``)
    when the checkpoint holds the norm; None otherwise. An eps that is not a finite number > 0 is refused."""
    import math

    fam = family_of(config.get("model_type")).post_norm
    if fam is None:
        return None
    norm, eps_key = fam
    name = f"{spec.prefix.rpartition('.')[0]}.{norm}.weight"  # beside the block, in its decoder layer
    if name not in ckpt.tensors:
        return None
    eps = config.get(eps_key, 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ConvertError(f"config.json: {eps_key}={eps!r}: the eps of the norm after the MoE block must be a finite number > 0")
    if ckpt.info(name).shape != (spec.hidden,) or ckpt.info(name).dtype_str not in FLOAT_DTYPES:
        raise ConvertError(f"tensor {name!r} is {ckpt.info(name).dtype_str} {list(ckpt.info(name).shape)}: the norm "
                           f"after the MoE block must be a float [{spec.hidden}]")  # fmt: skip
    return {"weight": name, "eps": float(eps)}


# a family's routed experts' fixed activation (aria's; its shared expert follows hidden_act): Family.routed_activation

# identity (zero-computation) experts: run for the families whose entry names identity_experts_key (longcat_flash),
# refused for any other family whose config states them
_ZERO_EXPERT_KEYS = ("zero_expert_num", "num_zero_experts")

_CLAMP_KEYS = ("swiglu_limit", "swiglu_clamp", "clamp_limit")
# Family.silu_clamp_key: the config key of a family's silu experts' clamped SwiGLU (gate <= L, up in
# [-L, L], then silu(gate) * up, routed and shared experts alike: DeepseekV4Experts._apply_gate,
# DeepseekV4MLP), which convert records as each layer's ``silu_limit`` (format version 6). A clamp key
# of another family stays refused: its clamp is not known to be this one. Family.shared_clamped False:
# the clamp is on the routed experts only (HYV4Experts._apply_gate clamps, HYV4MLP does not), the shared
# expert recording ``shared.silu_limit`` null (format version 7).
_SILU_CLAMPED = tuple(mt for mt, f in FAMILIES.items() if f.silu_clamp_key)


def shared_silu_limit_of(config: dict, spec) -> float | None:
    """The clamp of ``spec``'s shared expert: the layer's ``silu_limit_of``, or None for a family
    whose shared expert is not clamped (``Family.shared_clamped`` False)."""
    return silu_limit_of(config, spec) if family_of(config.get("model_type")).shared_clamped else None


def silu_limit_of(config: dict, spec) -> float | None:
    """The ``silu_limit`` convert records for ``spec``'s layer (None: none): the family's clamp key
    (``Family.silu_clamp_key``) on silu experts. A value the manifest would refuse is refused here, naming it."""
    from ..manifest import silu_limit_problem

    key = family_of(config.get("model_type")).silu_clamp_key
    v = config.get(key) if key else None
    if v is None or spec.activation != "silu":
        return None
    rule = silu_limit_problem(v)
    if rule:
        raise ConvertError(f"config.json: {key}={v!r}: {rule}")
    return float(v)


def runnable_problems(ckpt: Checkpoint, config: dict, specs: list, routing_note: str | None, consumed: set) -> list[str]:
    """Why the packed model would not compute what the source does, one line each naming the family,
    the feature and its value (empty: it runs). Convert refuses on the first (nothing is written);
    verify --source fails a pack on every one. ``routing_note``: None when the routing was derived,
    else why it could not be."""
    mt = config.get("model_type")
    out = []
    if routing_note is not None:
        out.append(routing_problem(config, routing_note))
    own = family_of(mt).silu_clamp_key  # the family's clamp that silu layers record (silu_limit)
    for key in _CLAMP_KEYS:
        v = config.get(key)
        unclamped = sorted({s.activation for s in specs if s.activation != "swigluoai" and not (key == own and s.activation == "silu")})
        if v is not None and unclamped:
            out.append(f"model_type={mt!r}: {key}={v!r} with {'/'.join(unclamped)} experts: a clamped SwiGLU, which moepack's "
                       f"kernels run for swigluoai (gpt-oss) experts and the silu experts of {', '.join(_SILU_CLAMPED)} only")  # fmt: skip
    norm = family_of(mt).post_norm
    for s in specs if norm else []:
        layer = s.prefix.rpartition(".")[0]  # the decoder layer the block sits in
        names = sorted(n for n in ckpt.tensors if n.startswith(f"{layer}.{norm[0]}.") and n != f"{layer}.{norm[0]}.weight")
        if names:  # a norm with more than its weight (a bias): not the RMSNorm post_norm runs
            out.append(f"model_type={mt!r} layer {s.index}: tensor {names[0]!r} is part of a norm after the MoE block "
                       "that moepack's post_norm (an RMSNorm weight) does not apply")  # fmt: skip
            break
    for key in _ZERO_EXPERT_KEYS:
        v = config.get(key)
        if key == family_of(mt).identity_experts_key:  # the family's own: recorded as each layer's identity_experts and run
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            out.append(f"model_type={mt!r}: {key}={v!r}: identity (zero-computation) experts, which the router may pick "
                       "and which return their input: moepack's experts are gated MLPs only")  # fmt: skip
    fixed = family_of(mt).routed_activation
    acts = sorted({s.activation for s in specs})
    if fixed and acts and acts != [fixed]:
        out.append(f"model_type={mt!r}: hidden_act={config.get('hidden_act')!r}: its routed experts are always {fixed} "
                   f"and only its shared expert follows hidden_act; moepack runs one activation per layer")  # fmt: skip
    latent = config.get("moe_latent_size")  # nemotron_h: Linears around the experts (fc1/fc2_latent_proj)
    if latent is not None:
        out.append(f"model_type={mt!r}: moe_latent_size={latent!r}: a latent projection around the experts "
                   "(fc1_latent_proj, fc2_latent_proj), which moepack does not run")  # fmt: skip
    how = config.get("shared_expert_combination_strategy")  # cohere2_moe: "sum" or "average"
    if how not in (None, "sum") and any(s.shared for s in specs):
        out.append(f"model_type={mt!r}: shared_expert_combination_strategy={how!r}: an averaged shared expert "
                   "((routed + shared) / 2), where moepack adds the shared expert's output")  # fmt: skip
    for s in specs:
        left = block_leftovers(ckpt, s, consumed)
        if left:
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            out.append(f"model_type={mt!r} layer {s.index}: tensor {left[0]!r}{more} is {_block_feature(left[0])}: "
                       f"moepack packs the routed experts, the router and a gate/up/down shared expert of {s.prefix!r} only")  # fmt: skip
    return out


def float_shared_dtype(ckpt: Checkpoint, spec: LayerSpec) -> str | None:
    """The stored dtype of the layer's shared expert when the checkpoint keeps it in float (BF16,
    F16, F32: a quantized checkpoint's ``ignore`` / ``modules_to_not_convert``); None when the
    layer has none or it is quantized (a reader names a quantized one by its code tensor)."""
    if not spec.shared:
        return None
    dt = ckpt.info(spec.shared["gate_proj"]).dtype_str
    return dt if dt in FLOAT_DTYPES else None


def _plan_layer_tensors(spec: LayerSpec, layout: PackedLayout, scheme: Scheme,
                        shared_layout: PackedLayout | None = None) -> list[tuple[str, torch.dtype, tuple]]:  # fmt: skip
    """(stored name, dtype, shape) of every packed tensor of one layer, in write order: the
    layout's tensor plan (moepack.layout.layout_tensor_plan) for the routed experts (+ biases,
    + the act-order w13_perm), then the shared expert's (in ``shared_layout`` when it has its
    own: a float shared expert of a quantized checkpoint, kept float)."""
    gated = spec.activation != "relu2"  # non-gated (relu2) experts: w13 holds the up rows alone
    plan = layout_tensor_plan(layout, spec.num_experts, spec.hidden, spec.intermediate, bias=spec.has_bias,
                              perm=scheme.has_perm(spec), gated=gated)  # fmt: skip
    if spec.shared:
        own = shared_layout is not None and shared_layout is not layout
        plan += layout_tensor_plan(shared_layout if own else layout, 1, spec.hidden, spec.shared["intermediate"],
                                   perm=False if own else scheme.has_perm(spec, True), prefix="shared_", gated=gated)  # fmt: skip
    return [(expert_tensor_name(spec.index, t.name), getattr(torch, t.dtype), t.shape) for t in plan]


def parse_quantize(quantize: str | None) -> tuple[Scheme | None, object]:
    """``quantize`` -> (the scheme, its options object or None). The spelling: a scheme name or
    alias, then its options after colons (``"int8"``, ``"int4"``, ``"int4:g64:asym"``,
    ``"int4_group:ch"``); None -> (None, None). Refused naming the value and the rule: an unknown
    scheme, a scheme that does not quantize float weights, an option the scheme does not take."""
    if quantize is None:
        return None, None
    name, *words = str(quantize).split(":")
    try:
        scheme = get_scheme(name)
    except UnsupportedError:
        scheme = None
    if scheme is None or not scheme.quantized:
        known = ", ".join(f"{x.name!r}" + (f" (or {', '.join(map(repr, x.aliases))})" if x.aliases else "")
                          for x in schemes() if x.quantized)  # fmt: skip
        raise ConvertError(f"quantize={quantize!r}: moepack quantizes to {known}")
    try:
        return scheme, scheme.options(tuple(words))
    except (UnsupportedError, ConvertError) as e:
        raise ConvertError(f"quantize={quantize!r}: {e}") from None


def _target_scheme(lay: PackedLayout, scheme: Scheme | None, reader: SourceReader) -> Scheme:
    """The scheme a convert packs into: ``scheme`` (``quantize``) when given, else the source's own
    (a quantized source stays in its scheme: A8 checkpoints are never dequantized), else the
    layout's."""
    try:
        source = get_scheme(reader.scheme)
    except UnsupportedError:
        raise ConvertError(f"source reader {reader.name!r} has scheme {reader.scheme!r}, which convert cannot pack") from None
    if scheme is not None:
        if source.quantized and source is not scheme:
            raise ConvertError(f"quantize={scheme.name!r} with a {reader.scheme} source: moepack never re-quantizes a quantized checkpoint")
        return scheme
    return source if source.quantized else get_scheme(lay)


def _target_layout(lay: PackedLayout, scheme: Scheme, options, reader: SourceReader, specs: list) -> PackedLayout:
    """The layout a convert writes: a source of ``scheme`` packs into the layout its own facts
    call for (int4: its group size; ``Scheme.source_layout``); quantizer options name theirs
    (int4: the group size's); else ``lay`` when it is of ``scheme``, else the scheme's layout of
    ``lay``'s ISA family."""
    try:
        if scheme.keeps_source(reader) and scheme.source_layout is not None:
            return scheme.source_layout(specs, lay if lay.scheme == scheme.name else scheme.layout_for(lay.family))
        if options is not None and hasattr(options, "layout"):
            return options.layout(lay.family, lay if lay.scheme == scheme.name else None)
        return lay if lay.scheme == scheme.name else scheme.layout_for(lay.family)
    except (UnsupportedError, LayoutError) as e:
        raise ConvertError(str(e)) from None


def tensor_nbytes(dtype: torch.dtype, shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty(0, dtype=dtype).element_size()


def _split_shards(items: list, size_of: Callable, limit: int) -> list[list]:
    shards, cur, cur_bytes = [], [], 0
    for it in items:
        b = size_of(it)
        if cur and cur_bytes + b > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(it)
        cur_bytes += b
    if cur:
        shards.append(cur)
    return shards


@dataclass(frozen=True)
class Options:
    quantize: str | None
    act_mode: str | None
    shard_bytes: int
    resume: bool
    pipeline: bool


@dataclass
class Plan:
    """Everything a convert will write, decided from config.json and the headers alone."""

    src: Path
    ckpt: Checkpoint
    reader: SourceReader
    scheme: Scheme
    layout: PackedLayout
    specs: list
    options: object  # the quantizer's options (Scheme.options), or None
    config: dict
    layer_tensors: dict  # layer index -> [(stored name, dtype, shape)] in write order
    expert_shards: list  # [[LayerSpec]] per experts-*.safetensors
    expert_files: list
    other_shards: list  # [[tensor name]] per model-*.safetensors
    other_files: list
    routing: dict | None
    routing_note: str
    alpha: float
    limit: float
    act_modes: dict  # layer index -> the act mode recorded as its default
    shard_plans: dict = field(default_factory=dict)  # file name -> ShardPlan (every shard, planned up front)
    skipped: tuple = ([], "")  # (source tensors left out deliberately, why): SourceReader.skipped
    # quantized Linears among the carried tensors (attention, dense MLPs): prefix -> CarriedLinear
    carried_linears: dict = field(default_factory=dict)
    # layer index -> the float layout its shared expert is packed in: a quantized source's float
    # shared expert stays float (convert never quantizes unasked; only --quantize does)
    shared_layouts: dict = field(default_factory=dict)
    # the quantizer (its options spelled out) that --quantize ran on a quantized source's float
    # shared experts (the routed experts keep their codes), recorded in each such shared entry
    shared_quantizer: str | None = None

    @property
    def quantizer(self) -> str | None:
        """The quantizer with every option spelled out ("int4_group:g128:sym", "int8_channel")
        when this convert quantizes float weights; None when it does not."""
        if not self.scheme.quantized or self.scheme.keeps_source(self.reader):
            return None
        return self.options.key() if self.options is not None else self.scheme.name


def make_plan(src: Path, lay: PackedLayout, quantize, shard_bytes: int, act_mode: str | None = None) -> Plan:
    """Stage 1: the source, the scheme and layout it packs into, every tensor and shard."""
    ckpt, reader = open_source(src)
    _refuse_unknown_family(ckpt)  # before the layers: an unknown family's tensors are no reason to blame
    qscheme, options = parse_quantize(quantize)
    scheme = _target_scheme(lay, qscheme, reader)
    specs = reader.layers(ckpt)  # without the layers the reader skips (SourceReader.skipped: DeepSeek's MTP layers)
    if scheme.keeps_source(reader):
        if ":" in str(quantize or ""):
            raise ConvertError(f"quantize={quantize!r} with a {reader.scheme} source ({reader.name}): its own codes are packed "
                               "as stored, never re-quantized; quantizer options apply to float sources only")  # fmt: skip
        options = None  # a source of the scheme is packed as stored: no quantizer runs
    lay = _target_layout(lay, scheme, options, reader, specs)
    if options is None and scheme.quantized and not scheme.keeps_source(reader):
        options = scheme.options(())  # the quantizer's defaults, spelled out in the manifest
    if options is not None and hasattr(options, "resolved"):
        options = options.resolved(lay)  # options left to the layout take the written layout's
    config = text_config(ckpt.config)
    expert_names = {n for s in specs for n in s.expert_tensors}
    skipped = reader.skipped(ckpt)
    left_out = expert_names | set(skipped[0])
    other = [n for n in ckpt.tensors if n not in left_out]
    carried_linears = find_linears(CarriedView(ckpt, other))  # headers: a malformed quantized Linear is refused here
    if act_mode is not None and act_mode not in lay.act_modes:
        raise ConvertError(f"act_mode={act_mode!r}: layout {lay.name} (scheme {lay.scheme}) runs with "
                           f"{' or '.join(lay.act_modes)} activations only")  # fmt: skip
    act_modes = {s.index: act_mode or scheme.default_act_mode(s, lay) for s in specs}
    shared_layouts, shared_quantizer = _float_shared_plan(ckpt, specs, scheme, reader, lay, quantize)
    layer_tensors = {s.index: _plan_layer_tensors(s, lay, scheme, shared_layouts.get(s.index)) for s in specs}
    expert_shards = _split_shards(specs, lambda s: sum(tensor_nbytes(d, sh) for _, d, sh in layer_tensors[s.index]), shard_bytes)
    other_shards = _split_shards(other, lambda n: ckpt.info(n).nbytes, shard_bytes) if other else []
    ne, no = len(expert_shards), len(other_shards)
    alpha, limit = swiglu_params(config)  # before transformers reads them (check_config_against_tensors)
    _check_top_k(config, specs)
    check_config_against_tensors(_LogicalShapes(ckpt, carried_linears), config, specs)
    routing, routing_note = routing_for(config)
    problems = runnable_problems(ckpt, config, specs, None if routing is not None else routing_note, expert_names)
    if problems:
        raise ConvertError(f"refused at convert: {problems[0]}")
    if scheme.quantized and any(s.activation == "relu2" for s in specs):  # the packers of quantized schemes are gated
        raise ConvertError(f"refused at convert: model_type={config.get('model_type')!r}: non-gated relu2 experts are packed "
                           f"from float weights into the float layout only, not as {scheme.name} ({reader.name} source"
                           f"{', --quantize' if qscheme is not None else ''})")  # fmt: skip
    for s in specs:
        silu_limit_of(config, s)  # a clamp the manifest would refuse: refused before anything is written
    pl = Plan(
        src, ckpt, reader, scheme, lay, specs, options, config, layer_tensors, expert_shards,
        [f"experts-{i + 1:05d}-of-{ne:05d}.safetensors" for i in range(ne)], other_shards,
        [f"model-{i + 1:05d}-of-{no:05d}.safetensors" for i in range(no)], routing, routing_note, alpha, limit, act_modes,
    )  # fmt: skip
    pl.skipped = skipped
    pl.carried_linears = carried_linears
    pl.shared_layouts, pl.shared_quantizer = shared_layouts, shared_quantizer
    for fname, shard_specs in zip(pl.expert_files, pl.expert_shards):
        shard = pl.shard_plans[fname] = ShardPlan()
        for s in shard_specs:
            for name, dt, shape in pl.layer_tensors[s.index]:
                shard.add(name, dt, shape)
    for fname, names in zip(pl.other_files, pl.other_shards):
        shard = pl.shard_plans[fname] = ShardPlan()
        for n in names:
            ti = ckpt.info(n)
            shard.add(n, ti.dtype, ti.shape)
    return pl


def _float_shared_plan(ckpt: Checkpoint, specs: list, scheme: Scheme, reader: SourceReader, lay: PackedLayout,
                       quantize) -> tuple[dict, str | None]:  # fmt: skip
    """Where a quantized source's float shared experts go: ({layer index: the float scheme's
    layout of ``lay``'s family}, None) without ``quantize`` (kept float, packed beside the
    routed experts' codes), or ({}, the quantizer spelled out) with ``quantize`` naming the
    source's own scheme (moepack quantizes them, as asked). A float source has none to decide:
    its shared expert goes where its routed experts go (float, or ``quantize``d with them)."""
    if not (scheme.quantized and scheme.keeps_source(reader)):
        return {}, None
    floats = [s for s in specs if float_shared_dtype(ckpt, s)]
    if not floats:
        return {}, None
    if quantize is not None:
        o = scheme.options(())
        if o is not None and hasattr(o, "resolved"):
            o = o.resolved(lay)
        return {}, o.key() if o is not None else scheme.name
    try:
        flt = float_scheme().layout_for(lay.family)
    except UnsupportedError as e:
        raise ConvertError(f"layer {floats[0].index}: its shared expert is float ({float_shared_dtype(ckpt, floats[0])}) and "
                           f"stays float, but {e}") from None  # fmt: skip
    return {s.index: flt for s in floats}, None


def check_float_shared_values(pl: Plan) -> None:
    """A float shared expert kept float is packed in the float layout, whose values are bf16: a
    BF16 one exactly; an F16 / F32 one only when every value has a bf16 form (rounding it would
    change the model unasked). The first value without one is refused naming the tensor, the
    element and the rule, before anything is written (reads those shared experts once)."""
    for s in pl.specs:
        if s.index not in pl.shared_layouts:
            continue
        dt = float_shared_dtype(pl.ckpt, s)
        if dt == "BF16":
            continue
        for p in ("gate_proj", "up_proj", "down_proj"):
            name = s.shared[p]
            t = pl.ckpt.read(name)
            bad = (t.to(torch.bfloat16).to(t.dtype) != t) & torch.isfinite(t)
            if bool(bad.any()):
                idx = bad.nonzero()[0].tolist()
                raise ConvertError(
                    f"layer {s.index}: shared-expert tensor {name!r} is {dt} and its value {t[tuple(idx)].item()!r} at "
                    f"{idx} has no bf16 form: a quantized checkpoint's float shared expert is kept float, packed as "
                    f"bf16 exactly, never rounded unasked (--quantize {pl.scheme.name} quantizes it with the routed "
                    "experts' scheme instead)"
                )  # fmt: skip


def check_carried_values(pl: Plan) -> None:
    """Every quantized Linear convert carries (attention, dense MLPs, ...) validated by the rules
    its expert readers apply (scales finite and > 0, zero points in range, g_idx, NaN FP8 codes):
    a SourceError naming the tensor, raised before anything is written. Reads their values once."""
    if not pl.carried_linears:
        return
    view = CarriedView(pl.ckpt, [t for lin in pl.carried_linears.values() for t in lin.tensors.values()])
    for lin in pl.carried_linears.values():
        check_linear(view, lin)


_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token")


def _check_top_k(config: dict, specs: list) -> None:
    """config.json's experts-per-token, where it has one, must be an integer in [1, experts] for
    every MoE layer: refused here, at convert, rather than by ``run`` on the packed directory."""
    key = next((k for k in _TOP_K_KEYS if config.get(k) is not None), None)
    if key is None or not specs:
        return
    k = config[key]
    if not isinstance(k, int) or isinstance(k, bool):
        raise ConvertError(f"config.json: {key}={k!r} must be an integer (the number of experts each token is routed to)")
    fewest = min(specs, key=lambda x: x.num_experts)
    if not 1 <= k <= fewest.num_experts:
        raise ConvertError(f"config.json: {key}={k} with {fewest.num_experts} experts (layer {fewest.index}): each token is "
                           f"routed to between 1 and num_experts experts")  # fmt: skip


_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_LAYER_OF = None  # compiled on first use: "layers.<i>." in a tensor name


def _int_key(config: dict, key: str):
    v = config.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class _LogicalShapes:
    """``ckpt`` with each carried Linear whose packed codes keep the name ``.weight`` at another shape
    than the Linear's (ModelOpt NVFP4: U8 [N, K/2]) seen at its logical [N, K], for the config check
    (the other formats' codes have other names, or the logical shape)."""

    def __init__(self, ckpt: Checkpoint, carried_linears: dict):
        self._ckpt = ckpt
        self._shapes = {w: (lin.n, lin.k) for lin in carried_linears.values() for w in [lin.tensors.get("weight")]
                        if w is not None and w.endswith(".weight") and tuple(ckpt.info(w).shape) != (lin.n, lin.k)}  # fmt: skip

    def info(self, name: str):
        import dataclasses

        ti = self._ckpt.info(name)
        return dataclasses.replace(ti, shape=self._shapes[name]) if name in self._shapes else ti

    def __getattr__(self, name: str):  # everything else (files, read, ...) is the checkpoint's
        return getattr(self._ckpt, name)


def check_config_against_tensors(ckpt: Checkpoint, config: dict, specs: list) -> None:
    """config.json must describe the tensors it comes with (issue 29: a config whose
    moe_intermediate_size, num_hidden_layers, vocab_size or model_type disagrees with the tensors,
    or a shard index that drops a layer's shard, converted and verified; only generate refused
    it). Refused here, before anything is written, naming the key, both values and the rule:

    * ``hidden_size``, the experts' intermediate size (``moe_intermediate_size``, else
      ``intermediate_size`` for families whose experts use it) and the expert count keys, against
      every MoE layer's experts;
    * ``num_hidden_layers``: the decoder layers the tensor names hold must be exactly
      0..num_hidden_layers-1 (a missing shard drops a layer's tensors);
    * ``vocab_size`` against the embedding's rows;
    * with transformers installed, a model family moepack runs whole, a whole checkpoint (it
      has the embedding; an experts-only checkpoint is packed all the same) and a config that
      states vocab_size, hidden_size and num_hidden_layers (else transformers' defaults would
      stand in for them): the model that
      ``load_model`` builds from the config (on the meta device) against the source's tensors:
      its MoE layers and their expert shapes, and every other parameter by name and shape
      (``model_type`` decides which parameters there are)."""
    import re

    refuse = lambda key, msg: ConvertError(f"config.json: {key}={config.get(key)!r}: {msg}: the config must "  # noqa: E731
                                           "describe the checkpoint's tensors")  # fmt: skip
    h = _int_key(config, "hidden_size")
    i_key = "moe_intermediate_size" if _int_key(config, "moe_intermediate_size") is not None else "intermediate_size"
    i_cfg = _int_key(config, i_key)
    for s in specs:
        if h is not None and s.hidden != h:
            raise refuse("hidden_size", f"layer {s.index}'s experts ({s.prefix}) have H={s.hidden}")
        if i_key == "moe_intermediate_size" and i_cfg is not None and s.intermediate != i_cfg:
            raise refuse(i_key, f"layer {s.index}'s experts ({s.prefix}) have intermediate size {s.intermediate}")
        for k in _EXPERTS_KEYS:
            if _int_key(config, k) is not None and s.num_experts != config[k]:
                raise refuse(k, f"layer {s.index} ({s.prefix}) has {s.num_experts} experts")
    n = _int_key(config, "num_hidden_layers")
    pat = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    found = sorted({int(m.group(1)) for name in ckpt.tensors for m in [pat.search(name)] if m})
    if n is not None and found:
        missing = [i for i in range(n) if i not in set(found)]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise refuse("num_hidden_layers", f"no tensor of decoder layer {missing[0]}{more} is in the checkpoint's files "
                                              f"({', '.join(f.name for f in ckpt.files)})")  # fmt: skip
        if max(found) >= n and any(s.index >= n for s in specs):
            bad = next(s for s in specs if s.index >= n)
            raise refuse("num_hidden_layers", f"the checkpoint has MoE layer {bad.index} ({bad.prefix})")
    v = _int_key(config, "vocab_size")
    emb = next((name for name in ckpt.tensors if name.endswith("embed_tokens.weight")), None)
    if v is not None and emb is not None and ckpt.info(emb).shape[0] != v:
        raise refuse("vocab_size", f"tensor {emb!r} has {ckpt.info(emb).shape[0]} rows")
    _check_against_model(ckpt, config, specs, refuse)


def _check_against_model(ckpt: Checkpoint, config: dict, specs: list, refuse) -> None:
    """The meta-device model load_model would build from the config, against the tensors (see
    check_config_against_tensors); skipped without transformers or for a family moepack does not
    run whole (convert packs its experts all the same)."""
    from ..hf import FAMILIES
    from ..sources.checkpoint import decode_special_floats
    from ..sources.dense import text_config_key

    mt = config.get("model_type")
    if not any(n.endswith("embed_tokens.weight") for n in ckpt.tensors):
        return  # experts only (no embedding): not a whole model, load_model could not build it anyway
    if any(_int_key(config, k) is None for k in ("vocab_size", "hidden_size", "num_hidden_layers")):
        return  # a partial config (test and tool checkpoints): transformers would fill in its own defaults
    if mt not in FAMILIES or text_config_key(ckpt.config) is not None:
        return  # a nested (multimodal) config: load_model does not build those
    try:
        import transformers  # noqa: F401
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return
    if mt not in CONFIG_MAPPING:
        return
    from ..hf import SplitPart, _block_shapes, _decoder_layers, _moe_blocks, checkpoint_renames, quiet_transformers

    # the dtype does not change which parameters there are ("auto" and other words included)
    cfgd = {k: v for k, v in decode_special_floats(ckpt.config).items() if k not in ("model_type", "dtype", "torch_dtype")}
    try:
        with quiet_transformers():
            cfg = AutoConfig.for_model(mt, **cfgd)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; the user sees one line
        raise refuse("model_type", f"transformers cannot build a {mt} model from it ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''})") from None  # fmt: skip
    fam = FAMILIES[mt]
    blocks = _moe_blocks(model, fam)
    by_index = {s.index: s for s in specs}
    if sorted(blocks) != sorted(by_index):
        raise refuse("model_type", f"a {mt} model with this config has MoE layers {sorted(blocks)}, the checkpoint's tensors "
                                   f"{sorted(by_index)}")  # fmt: skip
    for i, b in blocks.items():
        got, s = _block_shapes(b, fam), by_index[i]
        if got is not None and got != (s.num_experts, s.hidden, s.intermediate):
            raise refuse("model_type", f"a {mt} model with this config has layer {i}'s experts (E, H, I) = {got}, the "
                                       f"checkpoint's {(s.num_experts, s.hidden, s.intermediate)}")  # fmt: skip
    skip = tuple(f"{fam.layers}.{i}.{fam.block_attr}." for i in blocks)
    names = ckpt.tensors
    renamed = checkpoint_renames(mt, names)  # what transformers renames on load (load_model follows it too)
    for pname, p in model.named_parameters():  # tied parameters once, by their first name
        if pname.startswith(skip):
            continue
        stored = pname if pname in names else renamed.get(pname)
        if isinstance(stored, SplitPart):  # rows of a stored tensor transformers splits on load: they must add up
            total = sum(stored.sizes(model))
            got = list(ckpt.info(stored.source).shape)
            if [total, *p.shape[1:]] != got:
                raise refuse("model_type", f"a {mt} model with this config splits the checkpoint's {stored.source} {got} "
                                           f"into {list(stored.targets)} of {total} rows")  # fmt: skip
            continue
        if stored is not None:
            parts = [ckpt.info(x).shape for x in ((stored,) if isinstance(stored, str) else stored)]
            shape = [sum(x[0] for x in parts), *parts[0][1:]] if all(x[1:] == parts[0][1:] for x in parts) else None
            if shape != list(p.shape):
                where = "" if stored == pname else f"'s {stored}"
                raise refuse("model_type", f"a {mt} model with this config has {pname} {list(p.shape)}, the checkpoint"
                                           f"{where} {[list(x) for x in parts] if len(parts) > 1 else list(parts[0])}")  # fmt: skip
            continue
        mod = pname.rpartition(".")[0] + "."
        # a quantized linear stores other names under its module (qweight, weight_packed, ...)
        if mod + "weight" in names or not any(n.startswith(mod) for n in names):
            raise refuse("model_type", f"a {mt} model with this config needs tensor {pname} {list(p.shape)}, which the "
                                       "checkpoint's files do not hold")  # fmt: skip
