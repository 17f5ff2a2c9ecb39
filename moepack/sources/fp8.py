"""FP8 checkpoints (scheme fp8_block; docs/FORMATS.md "FP8"): DeepSeek-V3/R1 and Qwen3-FP8 block
FP8, and compressed-tensors ``float-quantized`` (FP8_BLOCK, FP8_DYNAMIC, FP8).

Per quantized Linear ``P`` (N outputs, K inputs):

* ``P.weight`` safetensors F8_E4M3 (torch.float8_e4m3fn) [N, K], read as its uint8 bit patterns;
* DeepSeek / Qwen (``quant_method: "fp8"``, ``fmt: "e4m3"``, ``weight_block_size: [bn, bk]``):
  ``P.weight_scale_inv`` [ceil(N / bn), ceil(K / bk)] in F32 (DeepSeek), BF16 (Qwen3) or F16,
  multiplied despite its name;
* compressed-tensors (``quant_method: "compressed-tensors"``, ``format: "float-quantized"``):
  ``P.weight_scale`` in the model dtype, [ceil(N / bn), ceil(K / bk)] (strategy "block",
  ``block_structure: [bn, bk]``), [N, 1] (strategy "channel") or [1] (strategy "tensor"), and,
  for static FP8 activations, ``P.input_scale`` [1], which moepack does not use (it runs the
  activations in 16 bits);

``W[n, k] = e4m3fn(q[n, k]) * scale[n // bn, k // bk]``; an edge block (N or K not a multiple of
the block) is partial and its scale applies to its real rows and columns. The canonical form
(moepack/schemes/fp8/pack.py) keeps the codes as they are and expands the scales over the rows
of their block: [N, ceil(K / 128)] (bk must be 128, the layout's K group), or [N, 1] per channel
(a per-tensor scale on every row). Nothing is re-quantized.

Refused, each in one line naming the tensor (or config key), the value and the rule, before
convert writes anything final: e5m2 and e4m3fnuz weights or configs (their values are not
e4m3fn's: e4m3fnuz's +-240 at 0x7F / 0xFF fit e4m3fn only at the block's own scale and its odd
subnormals m * 2^-10 only at half of it, and e5m2 keeps 2 mantissa bits over a wider range), NaN
codes (0x7F / 0xFF, with their first index), NaN / Inf / zero / negative scales, scale shapes
that disagree with the block and the weight shape, block widths other than 128, unknown
``quant_method`` / ``fmt`` / ``scale_fmt`` values, and a module the config leaves unquantized
(``modules_to_not_convert``, ``ignored_layers``, compressed-tensors ``ignore``) that is stored
in FP8.

Expert discovery is the dense reader's (``experts.<e>.{gate,up,down}_proj``, Mixtral's
``w1/w3/w2``); shared experts may be FP8 or float (a float one stays float: convert packs it in
the float layout unless ``--quantize fp8`` asks, docs/FORMATS.md "Float shared experts").
DeepSeek-V3's multi-token-prediction layers (``num_nextn_predict_layers``: ``model.layers.<i>``
with i >= ``num_hidden_layers``) are not part of the model's forward pass:
every tensor under them is skipped, deliberately, and the manifest's ``source.skipped`` lists
them with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import SourceError
from ..schemes.fp8.facts import Fp8Facts
from ..schemes.fp8.quantize import dequantize_fp8
from .checkpoint import Checkpoint
from .compressed_tensors import check_float_router, config_groups, ct_strategy, quantization_config, symmetric_scales
from .fp8_codec import E4M3_LARGEST, check_fp8_codes
from . import fp8_codec
from .int4_common import check_scales, expand_groups
from .linears import CarriedLinear, LinearFinder, ct_group, register_linears, weight_and_scale
from .dense import FLOAT_DTYPES, CanonicalLayer, LayerSpec, discover_layers, mtp_skipped, read_biases as dense_read_biases

SCHEME = "fp8_block"
FP8 = "F8_E4M3"
LAYOUT_GROUP = 128  # the f8g128 layout's K group: a block's width must be this
DEEPSEEK_NOTE = ("block FP8 (DeepSeek/Qwen quant_method fp8: e4m3fn codes, weight_scale_inv per block); "
                 "activations run in 16 bits (the checkpoint quantizes them to FP8 per 128 at run time)")  # fmt: skip
CT_NOTE = ("compressed-tensors float-quantized (e4m3fn codes, block / channel / tensor weight_scale); activations "
           "run in 16 bits (where the checkpoint meant FP8 activations: more accurate, never less)")  # fmt: skip
_ROLES = ("gate", "up", "down")
# F8_E8M0: UE8M0 scales (one byte, a power of two 2^(b-127); DeepSeek's "scale_fmt": "ue8m0", the
# "V4 style" transformers' FineGrainedFP8Config names), exact in fp32 like the float ones; 0xFF is NaN
_SCALE_DTYPES = FLOAT_DTYPES | {"F8_E8M0"}
_WHY_E5M2 = ("e5m2 keeps 2 mantissa bits (exponent bias 15): its values are not e4m3fn codes, and moepack's fp8 "
             "layouts hold e4m3fn only")  # fmt: skip
_WHY_FNUZ = ("e4m3fnuz (bias 8, 0x80 = NaN) is not e4m3fn: its +-240 (0x7F/0xFF) have an exact e4m3fn code only at "
             "the same scale and its odd subnormals (m * 2^-10) only at half the scale, so it cannot be repacked exactly")  # fmt: skip


@dataclass(frozen=True)
class _Cfg:
    """What the config says, checked: the format, the scale tensor's suffix, the strategy and block."""

    format: str  # "fp8" (DeepSeek/Qwen) | "float-quantized" (compressed-tensors)
    suffix: str  # ".weight_scale_inv" | ".weight_scale"
    strategy: str  # "block" | "channel" | "tensor"
    block: tuple | None  # (bn, bk)
    not_converted: tuple  # module names / substrings the config leaves in float
    ignore: tuple  # compressed-tensors "ignore": exact names or "re:" regexes
    input_activations: dict | None


def _block(value, key: str) -> tuple:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):  # fmt: skip
        raise SourceError(f"quantization_config {key}={value!r}: must be [rows, columns], two positive integers")
    bn, bk = value
    if bk != LAYOUT_GROUP:
        raise SourceError(f"quantization_config {key}={list(value)!r}: a block {bk} columns wide; moepack's fp8 layout "
                          f"has one scale per {LAYOUT_GROUP} K values, so the block width must be {LAYOUT_GROUP} (any "
                          "row count is fine)")  # fmt: skip
    return (bn, bk)


def _deepseek_cfg(qc: dict) -> _Cfg:
    fmt = qc.get("fmt", "e4m3")
    if fmt in ("e5m2",):
        raise SourceError(f"quantization_config fmt={fmt!r}: {_WHY_E5M2}")
    if fmt in ("e4m3fnuz", "e4m3_fnuz"):
        raise SourceError(f"quantization_config fmt={fmt!r}: {_WHY_FNUZ}")
    if fmt not in ("e4m3", "e4m3fn"):
        raise SourceError(f"quantization_config fmt={fmt!r}: moepack reads e4m3 (float8 e4m3fn) block FP8 only")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "float", "ue8m0"):
        raise SourceError(f"quantization_config scale_fmt={scale_fmt!r}: moepack knows 'float' and 'ue8m0' "
                          "(weight scales are read as the tensors store them)")  # fmt: skip
    if qc.get("expert_dtype") not in (None, "fp8"):
        raise SourceError(f"quantization_config expert_dtype={qc.get('expert_dtype')!r}: moepack reads FP8 experts only")
    act = qc.get("activation_scheme")
    if act not in (None, "dynamic", "static"):
        raise SourceError(f"quantization_config activation_scheme={act!r}: expected 'dynamic' or 'static'")
    # as transformers reads the config: the key absent is its default [128, 128]; an explicit null
    # is per-tensor FP8 (one weight_scale_inv per weight)
    wbs = qc.get("weight_block_size", [128, 128])
    block = _block(wbs, "weight_block_size") if wbs is not None else None
    skip = tuple(str(x) for x in (qc.get("modules_to_not_convert") or []) + (qc.get("ignored_layers") or []))
    return _Cfg("fp8", ".weight_scale_inv", "block" if block else "tensor", block, skip, (),
                {"activation_scheme": act} if act else None)  # fmt: skip


def _ct_cfg(qc: dict) -> _Cfg:
    groups = config_groups(qc)
    found = None
    for gname, g in groups.items():
        where = f"config group {gname!r}"
        fmt = g.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise SourceError(f"{where} has format {fmt!r}: this reader reads 'float-quantized' (FP8)")
        w = g.get("weights") or {}
        if not isinstance(w, dict):
            raise SourceError(f"{where} weights is {type(w).__name__} {w!r:.60}: the weights' quantization args are a JSON object")
        bits, typ, strat = w.get("num_bits"), w.get("type"), ct_strategy(w)
        if (bits, typ) != (8, "float"):
            raise SourceError(f"{where} weights num_bits={bits!r}, type={typ!r}: float-quantized FP8 weights are 8-bit float")
        if w.get("symmetric") is False:
            raise SourceError(f"{where} weights symmetric=False: FP8 weights have no zero point")
        if w.get("dynamic") not in (False, None):
            raise SourceError(f"{where} has dynamic weights: weights must be stored quantized")
        if strat == "block":
            block = _block(w.get("block_structure"), f"{where} weights block_structure")
        elif strat in ("channel", "tensor"):
            block = None
        else:
            raise SourceError(f"{where} weights strategy={strat!r}: moepack reads FP8 weights with block, channel or "
                              "tensor scales")  # fmt: skip
        if g.get("output_activations"):
            raise SourceError(f"{where} quantizes output activations: not supported")
        a = g.get("input_activations")
        if a is not None and not isinstance(a, dict):
            raise SourceError(f"{where} input_activations is {type(a).__name__} {a!r:.60}: a JSON object or null")
        this = (strat, block)
        if found is not None and found[0] != this:
            raise SourceError(f"{where} weights are strategy={strat!r} block={block}, config group {found[1]!r} "
                              f"strategy={found[0][0]!r} block={found[0][1]}: moepack reads one FP8 scheme per checkpoint")  # fmt: skip
        found = (this, gname, dict(a) if a else None)
    (strat, block), _, act = found
    return _Cfg("float-quantized", ".weight_scale", strat, block, (), tuple(str(x) for x in (qc.get("ignore") or [])), act)


def config(ckpt: Checkpoint) -> _Cfg:
    """The checked FP8 config of ``ckpt`` (cached), or a SourceError saying why it is not one."""
    cached = ckpt.__dict__.get("_fp8_cfg")
    if cached is not None:
        return cached
    qc = quantization_config(ckpt)
    if qc is None:
        raise SourceError("no quantization_config")
    method = qc.get("quant_method")
    if method == "fp8":
        cfg = _deepseek_cfg(qc)
    elif method == "compressed-tensors":
        fmt = qc.get("format")
        fmts = {(g.get("format") if isinstance(g, dict) else None) or fmt for g in qc["config_groups"].values()} if isinstance(
            qc.get("config_groups"), dict) else {fmt}  # fmt: skip
        if "float-quantized" not in fmts:
            raise SourceError(f"compressed-tensors format {fmt!r}: not float-quantized (FP8)")
        cfg = _ct_cfg(qc)
    else:
        raise SourceError(f"quant_method={method!r}: the FP8 reader reads 'fp8' (DeepSeek/Qwen block FP8) and "
                          "'compressed-tensors' float-quantized")  # fmt: skip
    ckpt.__dict__["_fp8_cfg"] = cfg
    return cfg


def _detect(ckpt: Checkpoint, fmt: str) -> tuple[bool, str]:
    qc = quantization_config(ckpt)
    method = qc.get("quant_method") if qc else None
    if (method == "fp8") != (fmt == "fp8"):
        return False, f"quant_method={method!r}: not this reader's"
    try:
        config(ckpt)
    except SourceError as e:
        return False, str(e)
    if not any(ti.dtype_str.startswith("F8_E") and ti.dtype_str != "F8_E8M0" for ti in ckpt.tensors.values()):
        return False, f"quant_method={method!r} but no tensor is stored in FP8 (F8_E4M3): not an FP8 checkpoint"
    return True, DEEPSEEK_NOTE if fmt == "fp8" else CT_NOTE


def detect_block_fp8(ckpt: Checkpoint) -> tuple[bool, str]:
    """DeepSeek-V3/R1 and Qwen3-FP8 (``quant_method: "fp8"``)."""
    return _detect(ckpt, "fp8")


def detect_float_quantized(ckpt: Checkpoint) -> tuple[bool, str]:
    """compressed-tensors ``float-quantized``."""
    return _detect(ckpt, "float-quantized")


# --------------------------------------------------------------------------- MTP layers


class _View:
    """The checkpoint without the skipped tensors, as discover_layers sees it."""

    def __init__(self, ckpt: Checkpoint, drop: set):
        self.path, self.config = ckpt.path, ckpt.config
        self.tensors = {n: ti for n, ti in ckpt.tensors.items() if n not in drop}

    def info(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise SourceError(f"tensor {name!r} is missing from {self.path}") from None


# --------------------------------------------------------------------------- layers


def _module_of(weight: str) -> str:
    return weight[: -len(".weight")]


def names_module(key: str, module: str) -> bool:
    """Whether a ``modules_to_not_convert`` / ``ignored_layers`` entry names ``module``, as
    transformers 5 reads them: the whole name or a dotted suffix of it ("lm_head",
    "experts.3.down_proj"), or a regex matching from the start up to a module boundary
    ("model.layers.1" names "model.layers.1.mlp...", not "model.layers.11..."; "mlp.gate" never
    names "mlp.gate_proj")."""
    if not key:
        return False
    if module == key or module.endswith("." + key):
        return True
    try:
        m = re.match(f"(?:{key})", module)
    except re.error:
        return False
    return m is not None and (m.end() == len(module) or module[m.end()] == "." or module[m.end() - 1] == ".")


def _left_in_float(cfg: _Cfg, module: str) -> str | None:
    """The config entry that leaves ``module`` unquantized, or None."""
    for key in cfg.not_converted:
        if names_module(key, module):
            return key
    return ignore_entry(cfg.ignore, module)


def ignore_entry(ignore, module: str) -> str | None:
    """The entry of a compressed-tensors ``ignore`` list that names ``module`` (its exact name, or a
    ``re:`` pattern matching it), or None."""
    for t in ignore:
        if (t.startswith("re:") and _re_match(t[3:], module, f"quantization_config ignore entry {t!r}")) or t == module:
            return t
    return None


def _re_match(pattern: str, name: str, what: str):
    """re.match, with a pattern from the config that is not a regular expression refused naming it."""
    try:
        return re.match(pattern, name)
    except re.error as e:
        raise SourceError(f"{what}: not a regular expression ({e}); compressed-tensors reads 're:' entries as regexes") from None


def _scale_shape(cfg: _Cfg, n: int, k: int) -> tuple[tuple, ...]:
    if cfg.strategy == "block":
        bn, bk = cfg.block
        return ((-(-n // bn), -(-k // bk)),)
    if cfg.strategy == "channel":
        return ((n, 1), (n,))
    return ((1,), ())


def _check_module(ckpt: Checkpoint, cfg: _Cfg, weight: str) -> tuple[str, str]:
    """Header checks of one FP8 Linear: (its scale tensor's name, the scale's dtype)."""
    ti = ckpt.info(weight)
    module = _module_of(weight)
    why = _left_in_float(cfg, module)
    if why is not None:
        raise SourceError(f"tensor {weight!r} is {ti.dtype_str}, but the config leaves {module!r} unquantized ({why!r}): "
                          "the config and the weights disagree")  # fmt: skip
    sname = module + cfg.suffix
    if sname not in ckpt.tensors:
        raise SourceError(f"tensor {weight!r} is {FP8} but {sname!r} is missing: FP8 weights need their scale")
    st = ckpt.info(sname)
    if st.dtype_str not in _SCALE_DTYPES:
        raise SourceError(f"tensor {sname!r} has dtype {st.dtype_str}: FP8 weight scales must be F32, BF16, F16 or "
                          "F8_E8M0 (UE8M0)")  # fmt: skip
    n, k = ti.shape
    want = _scale_shape(cfg, n, k)
    if tuple(st.shape) not in want:
        rule = (f"ceil(N={n} / {cfg.block[0]}) x ceil(K={k} / {cfg.block[1]}) blocks" if cfg.strategy == "block"
                else "one scale per output channel" if cfg.strategy == "channel" else "one scale for the tensor")  # fmt: skip
        raise SourceError(f"tensor {sname!r} has shape {list(st.shape)}: expected {list(want[0])} ({rule} of {weight!r})")
    return sname, st.dtype_str


def _refuse_other_fp8(ckpt) -> None:
    for name, ti in ckpt.tensors.items():
        if ti.dtype_str == "F8_E5M2":
            raise SourceError(f"tensor {name!r} has dtype F8_E5M2: {_WHY_E5M2}")
        if "FNUZ" in ti.dtype_str.upper():
            raise SourceError(f"tensor {name!r} has dtype {ti.dtype_str}: {_WHY_FNUZ}")


def layers(ckpt: Checkpoint) -> list[LayerSpec]:
    cfg = config(ckpt)
    drop, _ = mtp_skipped(ckpt)
    view = _View(ckpt, set(drop))
    _refuse_other_fp8(view)
    weights = (FLOAT_DTYPES | {FP8}, "FP8 checkpoints' expert weights must be F8_E4M3 (float8 e4m3fn; shared experts may be "
                                     "BF16/F16/F32)")  # fmt: skip
    specs = discover_layers(view, weights)
    for s in specs:
        if s.kind != "per_expert":
            raise SourceError(f"layer {s.prefix!r}: expert tensors are fused ({s.kind}, {s.names.get('gate_up')!r}); FP8 "
                              "checkpoints' experts are per-expert Linear weights")  # fmt: skip
        if s.dtype != FP8:
            name = s.names[(0, "gate", "weight")]
            raise SourceError(f"tensor {name!r} has dtype {s.dtype}: {weights[1]}")
        # transformers 5 fuses the per-expert Linears into one ``<block>.experts`` module and holds
        # that name against modules_to_not_convert / ignore: an entry naming it ("experts") leaves
        # every expert in float there, which FP8 expert weights contradict
        first = s.names[(0, "gate", "weight")]
        fused = first[: first.index(".experts.") + len(".experts")] if ".experts." in first else None
        why = _left_in_float(cfg, fused) if fused else None
        if why is not None:
            raise SourceError(f"tensor {first!r} is {FP8}, but the config leaves {fused!r} (the experts, as transformers "
                              f"fuses them) unquantized ({why!r}): the config and the weights disagree")  # fmt: skip
        sdt = None
        for e in range(s.num_experts):
            for role in _ROLES:
                sn, dt = _check_module(view, cfg, s.names[(e, role, "weight")])
                sdt = sdt or dt
                _read_scale(ckpt, sn)  # the values too (small): a bad scale is refused before anything is written
                s.names[(e, role, "scale")] = sn
                s.expert_tensors.append(sn)
                inp = _module_of(s.names[(e, role, "weight")]) + ".input_scale"
                if inp in view.tensors:  # static FP8 activations: moepack runs them in 16 bits; consumed, unused
                    s.expert_tensors.append(inp)
                zp = _module_of(s.names[(e, role, "weight")]) + ".weight_zero_point"
                if zp in view.tensors:  # FP8 weights are symmetric: a zero point must be 0 (then consumed)
                    _check_zero_points(ckpt, zp)
                    s.expert_tensors.append(zp)
        s.expert_tensors.sort()
        if s.activation == "swigluoai":  # gpt-oss, linearized: gate/up de-interleaved; re-interleave
            s.interleaved = True
        facts = Fp8Facts(cfg.strategy, cfg.block, sdt, cfg.format, cfg.input_activations)
        check_float_router(view, s)
        if s.shared and view.info(s.shared["gate_proj"]).dtype_str == FP8:
            scales, sdt2 = [], None
            for p in ("gate_proj", "up_proj", "down_proj"):
                sn, dt = _check_module(view, cfg, s.shared[p])
                sdt2 = sdt2 or dt
                _read_scale(ckpt, sn)
                scales.append(sn)
            s.shared["scales"] = scales
            facts = Fp8Facts(cfg.strategy, cfg.block, sdt, cfg.format, cfg.input_activations,
                             shared=Fp8Facts(cfg.strategy, cfg.block, sdt2, cfg.format, cfg.input_activations))  # fmt: skip
        elif s.shared:
            for p in ("gate_proj", "up_proj", "down_proj"):
                if view.info(s.shared[p]).dtype_str == FP8:
                    raise SourceError(f"tensor {s.shared[p]!r} is {FP8} but {s.shared['gate_proj']!r} is not: the shared "
                                      "expert's projections are stored alike")  # fmt: skip
        s.quant = facts
    return specs


# --------------------------------------------------------------------------- reading


def _read_scale(ckpt: Checkpoint, name: str) -> torch.Tensor:
    """A scale tensor as fp32, or a SourceError naming its first NaN / Inf / zero / negative value."""
    return check_scales(name, ckpt.read(name), E4M3_LARGEST, "e4m3fn's largest code")


def _check_zero_points(ckpt: Checkpoint, name: str) -> None:
    """A stored FP8 ``weight_zero_point`` must be all zero (FP8 weights are symmetric: the value is
    ``e4m3fn(q) * scale``); the first nonzero one is refused by name and value."""
    z = ckpt.read(name)
    nz = (z.float() != 0) if z.is_floating_point() or z.dtype.is_floating_point else (z != 0)
    if bool(nz.any()):
        idx = [int(i) for i in nz.nonzero()[0]]
        raise SourceError(f"tensor {name!r}{idx} = {z.float()[tuple(idx)].item()!r}: FP8 weights have no zero point "
                          "(symmetric: value = e4m3fn code x scale); a stored one must be 0")  # fmt: skip


def _read_codes(ckpt: Checkpoint, name: str) -> torch.Tensor:
    """An F8_E4M3 weight as its uint8 bit patterns, or a SourceError naming its first NaN code."""
    return check_fp8_codes(name, ckpt.read(name))


def _canonical_scale(s: torch.Tensor, cfg: _Cfg, n: int) -> torch.Tensor:
    """A source scale -> the canonical per-row form: blocks expanded over their rows [N, ceil(K/128)];
    channel [N, 1]; tensor: its one value on every row [N, 1]."""
    if cfg.strategy == "block":
        return s.repeat_interleave(cfg.block[0], dim=0)[:n].contiguous()
    if cfg.strategy == "channel":
        return s.reshape(n, 1).contiguous()
    return s.reshape(1, 1).expand(n, 1).contiguous()


def _linear(ckpt: Checkpoint, cfg: _Cfg, weight: str, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    q = _read_codes(ckpt, weight)
    return q, _canonical_scale(_read_scale(ckpt, scale), cfg, q.shape[0])


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """rows 2j = gate_j, 2j+1 = up_j (swigluoai's canonical order)."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def _w13(ckpt, cfg, g: tuple, u: tuple, interleaved: bool) -> dict:
    (gq, gs), (uq, us) = _linear(ckpt, cfg, *g), _linear(ckpt, cfg, *u)
    join = _interleave if interleaved else (lambda a, b: torch.cat([a, b]))
    return {"w13_q": join(gq, uq).contiguous(), "w13_scale": join(gs, us).contiguous()}


def read_expert_canonical(ckpt: Checkpoint, s: LayerSpec, weight: str, e: int) -> dict[str, torch.Tensor]:
    """Scheme fp8_block's canonical tensors of expert ``e``'s ``weight`` ("w13" or "w2"):
    {"w13_q": uint8 [2I, H], "w13_scale": fp32 [2I, ng]} (or w2_q / w2_scale), the codes as stored."""
    cfg = config(ckpt)
    if weight == "w13":
        return _w13(ckpt, cfg, (s.names[(e, "gate", "weight")], s.names[(e, "gate", "scale")]),
                    (s.names[(e, "up", "weight")], s.names[(e, "up", "scale")]), s.interleaved)  # fmt: skip
    if weight == "w2":
        q, sc = _linear(ckpt, cfg, s.names[(e, "down", "weight")], s.names[(e, "down", "scale")])
        return {"w2_q": q, "w2_scale": sc}
    raise KeyError(f"weight {weight!r}: expected 'w13' or 'w2'")


def _group(s: LayerSpec, shared: bool = False) -> int:
    f = s.quant.shared if shared else s.quant
    return f.group_size


def _deq(q: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    return dequantize_fp8(q, scale, group_size)


def read_expert_w13(ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
    """fp32 [2I, H]: the codes times their scales, exactly as the scheme dequantizes them."""
    c = read_expert_canonical(ckpt, s, "w13", e)
    return _deq(c["w13_q"], c["w13_scale"], _group(s))


def read_expert_w2(ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
    c = read_expert_canonical(ckpt, s, "w2", e)
    return _deq(c["w2_q"], c["w2_scale"], _group(s))


def read_biases(ckpt: Checkpoint, s: LayerSpec) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    b13, b2 = dense_read_biases(ckpt, s)
    if b13 is not None and s.interleaved:
        i = s.intermediate
        b13 = _interleave(b13[:, :i].t(), b13[:, i:].t()).t().contiguous()
    return b13, b2


def read_layer(ckpt: Checkpoint, s: LayerSpec) -> CanonicalLayer:
    per = [{**read_expert_canonical(ckpt, s, "w13", e), **read_expert_canonical(ckpt, s, "w2", e)} for e in range(s.num_experts)]
    canon = {k: torch.stack([p[k] for p in per]) for k in per[0]}
    g = _group(s)
    b13, b2 = read_biases(ckpt, s)
    return CanonicalLayer(spec=s, w13=_deq(canon["w13_q"], canon["w13_scale"], g), w2=_deq(canon["w2_q"], canon["w2_scale"], g),
                          w13_bias=b13, w2_bias=b2, canonical={**canon, "group_size": g})  # fmt: skip


def read_shared_canonical(ckpt: Checkpoint, s: LayerSpec) -> dict[str, torch.Tensor] | None:
    """The FP8 shared expert's canonical tensors as a one-expert set (w13_q [1, 2Is, H], ...), or
    None (no shared expert, or a float one)."""
    if not s.shared or "scales" not in s.shared:
        return None
    cfg = config(ckpt)
    gs, us, ds = s.shared["scales"]
    c = _w13(ckpt, cfg, (s.shared["gate_proj"], gs), (s.shared["up_proj"], us), False)
    q2, s2 = _linear(ckpt, cfg, s.shared["down_proj"], ds)
    return {"w13_q": c["w13_q"][None], "w13_scale": c["w13_scale"][None], "w2_q": q2[None], "w2_scale": s2[None]}


def read_shared(ckpt: Checkpoint, s: LayerSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared expert as float (dequantized if FP8), a one-expert canonical pair."""
    c = read_shared_canonical(ckpt, s)
    if c is None:
        from .dense import read_shared as dense_read_shared

        return dense_read_shared(ckpt, s)
    g = _group(s, shared=True)
    return _deq(c["w13_q"], c["w13_scale"], g), _deq(c["w2_q"], c["w2_scale"], g)


__all__ = ["SCHEME", "detect_block_fp8", "detect_float_quantized", "layers", "read_layer", "read_expert_canonical", "read_shared_canonical",
           "read_expert_w13", "read_expert_w2", "read_biases", "read_shared", "config"]  # fmt: skip


# --------------------------------------------------------------------------- carried Linears


def _ct_rule(name: str, g: dict | None, n: int, k: int) -> tuple:
    w = (g or {}).get("weights") or {}
    strat = w.get("strategy")
    if strat == "block":
        bs = w.get("block_structure")
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(x, int) and x > 0 for x in bs)):
            raise SourceError(f"tensor {name!r}: its config group has strategy 'block' with block_structure={bs!r}: expected [bn, bk]")
        return ("block", bs[0], bs[1])
    if strat == "group":
        gs = w.get("group_size")
        if not isinstance(gs, int) or gs <= 0:
            raise SourceError(f"tensor {name!r}: its config group has strategy 'group' with group_size={gs!r}")
        return ("group", gs)
    if strat in ("channel", "tensor"):
        return (strat,)
    raise SourceError(f"tensor {name!r}: its config group's weights strategy is {strat!r}: an FP8 weight needs tensor, channel, "
                      "group or block scales")  # fmt: skip


def _ct_linears(view, qc: dict) -> dict:
    """The compressed-tensors float-quantized Linears: FP8 ``weight`` + ``weight_scale``, the
    scale's strategy from the Linear's config group (tensor, channel, group or block)."""
    out = {}
    for name, ti in view.tensors.items():
        if not name.endswith(".weight") or ti.dtype_str not in fp8_codec.FP8_DTYPES:
            continue
        p, s, n, k = weight_and_scale(view, name, ti)
        symmetric_scales(view, p, name, ti)
        sti = view.info(s)
        rule = _ct_rule(name, ct_group(qc, p), n, k)
        want = {"tensor": [(1,), ()], "channel": [(n, 1), (n,)]}.get(rule[0])
        if rule[0] == "block":
            want = [fp8_codec.block_grid(n, k, rule[1:])]
        elif rule[0] == "group":
            want = [(n, -(-k // rule[1]))]
        if tuple(sti.shape) not in want:
            raise SourceError(f"tensor {s!r} has shape {list(sti.shape)}: expected {list(want[0])} ({rule[0]} scales of {name!r} [{n}, {k}])")
        out[p] = CarriedLinear(p, "fp8", n, k, {"weight": name, "scale": s}, scale_rule=rule)
    return out


def _block_linears(view, qc: dict) -> dict:
    """DeepSeek / Qwen FP8 Linears: FP8 ``weight`` + ``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)]
    (``weight_block_size`` [bn, bk]; null: one scale per tensor)."""
    bs = qc.get("weight_block_size", [128, 128])  # transformers: absent = [128, 128], null = per tensor
    if bs is not None and not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in bs)):
        raise SourceError(f"quantization_config.weight_block_size={bs!r}: expected [block_n, block_k], two positive integers")
    fmt = qc.get("scale_fmt")
    if fmt not in (None, "float", "ue8m0"):
        raise SourceError(f"quantization_config.scale_fmt={fmt!r}: moepack reads 'float' or 'ue8m0' FP8 scales")
    out = {}
    for name, ti in view.tensors.items():
        if not name.endswith(".weight") or ti.dtype_str not in fp8_codec.FP8_DTYPES:
            continue
        p, s, n, k = weight_and_scale(view, name, ti, ".weight_scale_inv", "every FP8 weight has a scale_inv (FORMATS.md §4)")
        sti = view.info(s)
        if sti.dtype_str not in (*FLOAT_DTYPES, "F8_E8M0"):
            raise SourceError(f"tensor {s!r} has dtype {sti.dtype_str}: FP8 scales must be F32, BF16, F16 (or E8M0)")
        if bs is None:
            if tuple(sti.shape) not in ((), (1,)):
                raise SourceError(f"tensor {s!r} has shape {list(sti.shape)}: with weight_block_size null a scale_inv is one value per tensor")
            rule = ("tensor",)
        else:
            rule = ("block", bs[0], bs[1])
            want = fp8_codec.block_grid(n, k, bs)
            if tuple(sti.shape) != want:
                raise SourceError(f"tensor {s!r} has shape {list(sti.shape)}: expected {list(want)} "
                                  f"(ceil(N={n} / {bs[0]}), ceil(K={k} / {bs[1]}) blocks of {name!r})")  # fmt: skip
        out[p] = CarriedLinear(p, "fp8", n, k, {"weight": name, "scale": s}, scale_rule=rule)
    return out


def _linear_values(view, lin, dequant: bool = True) -> torch.Tensor | None:
    wn, sn = lin.tensors["weight"], lin.tensors["scale"]
    codes = view.read(wn)
    fp8_codec.check_fp8_codes(wn, codes)
    raw = view.read(sn)
    if raw.dtype == getattr(torch, "float8_e8m0fnu", None):
        raw = raw.float()  # E8M0: powers of two (0xFF = NaN is refused below)
    rule, n, k = lin.scale_rule, lin.n, lin.k
    if rule[0] == "block":
        s = fp8_codec.check_block_scales(sn, raw, n, k, rule[1:])
        return fp8_codec.dequantize_block(codes, s, rule[1:]) if dequant else None
    s = check_scales(sn, raw, fp8_codec.E4M3_LARGEST, "e4m3fn's largest code")
    if not dequant:
        return None
    v = fp8_codec.decode_fp8(codes)
    if rule[0] == "tensor":
        return v * s.reshape(())
    if rule[0] == "channel":
        return v * s.reshape(n, 1)
    return v * expand_groups(s.reshape(n, -1), rule[1], k)


register_linears("fp8", _linear_values, LinearFinder(("fp8",), _block_linears),
                 LinearFinder(("compressed-tensors",), _ct_linears, order=3, ct_formats=("float-quantized",)))
