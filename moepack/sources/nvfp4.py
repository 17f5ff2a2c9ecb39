"""NVFP4 checkpoints (scheme nvfp4; docs/FORMATS.md §3.4 and §5.5): compressed-tensors
``nvfp4-pack-quantized`` and NVIDIA ModelOpt NVFP4 (``quant_algo: NVFP4``).

Both store, per quantized Linear ``P`` (N outputs, K inputs), a 4-bit e2m1 code per weight packed
two a byte (U8 [N, K/2], the low nibble the even k: compressed-tensors ``pack_fp4_to_uint8``,
vLLM ``break_fp4_bytes``), one float8 e4m3fn scale per 16 consecutive K values of a row
(F8_E4M3 [N, K/16]) and one fp32 tensor-wide scale:

* compressed-tensors: ``P.weight_packed``, ``P.weight_scale``, ``P.weight_global_scale`` F32 [1], a
  DIVISOR: compressed_tensors 0.20.1 ``NVFP4PackedCompressor.decompress`` -> ``_dequantize``:
  ``w = e2m1(q) * fp32(weight_scale / weight_global_scale)``; optional ``P.input_global_scale``
  (the activations' FP4 scale: moepack runs activations in 16 bits, it is not read);
* ModelOpt: ``P.weight`` (U8, the packed codes), ``P.weight_scale``, ``P.weight_scale_2`` F32 [] or
  [1], a MULTIPLIER: ``w = e2m1(q) * fp32(weight_scale * weight_scale_2)`` (vLLM
  ``nvfp4_emulation_utils.dequantize_to_dtype``; compressed-tensors' ModelOpt converter turns
  weight_scale_2 into weight_global_scale = 1 / weight_scale_2, confirming the convention);
  optional ``P.input_scale``. The config: ``hf_quant_config.json`` {"quantization": {"quant_algo":
  "NVFP4", "group_size": 16, "exclude_modules": [...]}} or config.json ``quantization_config``
  {"quant_method": "modelopt", "quant_algo": "NVFP4", ...} (flat, or with the same "quantization"
  object); ``exclude_modules`` (or ``ignore``) entries are fnmatch patterns of module names.

Canonical tensors of one expert (``read_expert_canonical``): ``w13_q`` uint8 [2I, H] (one code per
byte), ``w13_scale`` uint8 [2I, H/16] (the e4m3 bytes as stored), ``w13_global`` fp32 [2I] (each
row its Linear's global: compressed-tensors' divisor as stored, ModelOpt's multiplier negated;
moepack/schemes/nvfp4/codec.py), and w2_* [H, I] alike. Nothing is re-quantized or re-rounded.

Refused in one line naming the tensor (or config key), the value and the rule, before convert
writes anything final: an e4m3 scale that is NaN or negative (with its index), a global scale that
is zero, negative, NaN or infinite, a group size other than 16, packed codes / scales / globals
whose shapes disagree with each other or with config.json, compressed-tensors config groups that
are not NVFP4 (strategy tensor_group, 4-bit float, group 16, symmetric), fused expert tensors, and
experts the config leaves unquantized that are stored quantized.
"""

from __future__ import annotations

import fnmatch
import json

import torch

from ..errors import SourceError
from ..schemes.nvfp4.codec import NV4_GROUP, dequantize_nvfp4
from ..schemes.nvfp4.facts import Nvfp4Facts
from ..schemes.nvfp4.quantize import check_e4m3_scales
from .checkpoint import Checkpoint
from .compressed_tensors import fp4_groups, quantization_config
from .dense import CanonicalLayer, LayerSpec, read_biases as dense_read_biases, text_config
from .fp8 import ignore_entry
from .linears import CarriedLinear, LinearFinder, ct_group_format, register_linears
from .mxfp4 import HeaderView, check_dtype, check_router, check_shape, discover_experts, interleave_gate_up, claim_expert_modules, unpack_e2m1

SCHEME = "nvfp4"
NVFP4 = "NVFP4"  # LayerSpec.dtype of NVFP4 experts (stand-in dtype of the packed weights)
CT_FORMAT = "nvfp4-pack-quantized"
MODELOPT = "modelopt"
_ACTS = "; activations run in 16 bits (int8 with --act-mode a8), never in FP4"
CT_NOTE = ("compressed-tensors nvfp4-pack-quantized (e2m1 codes, one e4m3 weight_scale per 16 K values, fp32 "
           "weight_global_scale dividing)" + _ACTS)  # fmt: skip
MODELOPT_NOTE = "ModelOpt NVFP4 (e2m1 codes, one e4m3 weight_scale per 16 K values, fp32 weight_scale_2 multiplying)" + _ACTS
_SCALE_DTYPES = {"F8_E4M3"}
_ROLES = ("gate", "up", "down")
# per format: (codes suffix, global suffix, optional activation-scale suffix)
_NAMES = {CT_FORMAT: (".weight_packed", ".weight_global_scale", ".input_global_scale"),
          MODELOPT: (".weight", ".weight_scale_2", ".input_scale")}  # fmt: skip


# --------------------------------------------------------------------------- config


def _grouping(where: str, strat, gs) -> None:
    if gs != NV4_GROUP:
        raise SourceError(f"{where} weights group_size={gs!r}: NVFP4 has one e4m3 scale per group of {NV4_GROUP} K values")
    if strat != "tensor_group":
        raise SourceError(f"{where} weights strategy={strat!r}: NVFP4 weights are strategy 'tensor_group' (group scales under "
                          "a per-tensor global scale)")  # fmt: skip


def _ct_cfg(qc: dict) -> dict:
    acts = fp4_groups(qc, CT_FORMAT, "NVFP4", _grouping, ("torch.float8_e4m3fn", "float8_e4m3fn"),
                      "NVFP4 group scales are float8_e4m3fn")  # fmt: skip
    return {"format": CT_FORMAT, "ignore": tuple(str(x) for x in qc.get("ignore") or []), "exclude": (),
            "input_activations": acts}  # fmt: skip


def _modelopt_quant(ckpt: Checkpoint) -> tuple[dict | None, str]:
    """ModelOpt's quantization object and where it came from: hf_quant_config.json's
    "quantization", else config.json's quantization_config (quant_method "modelopt", flat or with
    a nested "quantization")."""
    f = ckpt.path / "hf_quant_config.json"
    if f.is_file():
        try:
            q = json.loads(f.read_text()).get("quantization")
        except (ValueError, AttributeError):
            raise SourceError("hf_quant_config.json: not a JSON object with a 'quantization' object") from None
        if not isinstance(q, dict):
            raise SourceError(f"hf_quant_config.json: quantization={q!r:.60} must be a JSON object")
        return q, "hf_quant_config.json"
    qc = quantization_config(ckpt)
    if qc and qc.get("quant_method") == MODELOPT:
        q = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
        return q, "config.json quantization_config"
    return None, ""


def _modelopt_cfg(q: dict, where: str) -> dict:
    algo = q.get("quant_algo")
    if str(algo).upper() != "NVFP4":
        raise SourceError(f"{where} quant_algo={algo!r}: this reader reads ModelOpt 'NVFP4'")
    gs = q.get("group_size", NV4_GROUP)
    if gs != NV4_GROUP:
        raise SourceError(f"{where} group_size={gs!r}: NVFP4 has one e4m3 scale per group of {NV4_GROUP} K values")
    ex = q.get("exclude_modules", q.get("ignore")) or []
    if not isinstance(ex, list) or not all(isinstance(x, str) for x in ex):
        raise SourceError(f"{where} exclude_modules={ex!r:.80}: must be a list of module-name patterns")
    acts = {"num_bits": 4, "type": "float", "group_size": NV4_GROUP, "source": "ModelOpt NVFP4 (W4A4)"}
    return {"format": MODELOPT, "ignore": (), "exclude": tuple(ex), "input_activations": acts}


def config(ckpt: Checkpoint) -> dict:
    """The checked NVFP4 config of ``ckpt`` (cached), or a SourceError saying why it is not one."""
    cached = ckpt.__dict__.get("_nvfp4_cfg")
    if cached is not None:
        return cached
    q, where = _modelopt_quant(ckpt)
    if q is not None:
        cfg = _modelopt_cfg(q, where)
    else:
        qc = quantization_config(ckpt)
        if qc is None:
            raise SourceError("no quantization_config and no hf_quant_config.json")
        method = qc.get("quant_method")
        if method != "compressed-tensors":
            raise SourceError(f"quant_method={method!r}: the NVFP4 reader reads compressed-tensors {CT_FORMAT!r} and ModelOpt "
                              "NVFP4")  # fmt: skip
        cfg = _ct_cfg(qc)
    ckpt.__dict__["_nvfp4_cfg"] = cfg
    return cfg


def _detect(ckpt: Checkpoint, fmt: str) -> tuple[bool, str]:
    q, _ = _modelopt_quant(ckpt) if fmt == MODELOPT else (None, "")
    if fmt == MODELOPT and q is None:
        return False, "no ModelOpt quantization (hf_quant_config.json or quant_method 'modelopt')"
    if fmt == CT_FORMAT:
        qc = quantization_config(ckpt)
        method = qc.get("quant_method") if qc else None
        if method != "compressed-tensors":
            return False, f"quant_method={method!r}: not 'compressed-tensors'"
    try:
        cfg = config(ckpt)
    except SourceError as e:
        return False, str(e)
    if cfg["format"] != fmt:
        return False, f"a {cfg['format']} checkpoint"
    return True, CT_NOTE if fmt == CT_FORMAT else MODELOPT_NOTE


def detect_ct(ckpt: Checkpoint) -> tuple[bool, str]:
    """compressed-tensors ``nvfp4-pack-quantized``."""
    return _detect(ckpt, CT_FORMAT)


def detect_modelopt(ckpt: Checkpoint) -> tuple[bool, str]:
    """NVIDIA ModelOpt NVFP4."""
    return _detect(ckpt, MODELOPT)


def _left_in_float(cfg: dict, module: str) -> str | None:
    """The config entry that leaves ``module`` unquantized, or None."""
    for pat in cfg["exclude"]:
        if fnmatch.fnmatchcase(module, pat):
            return pat
    return ignore_entry(cfg["ignore"], module)


# --------------------------------------------------------------------------- layers


def nvfp4_modules(ckpt, fmt: str) -> dict[str, tuple[int, int]]:
    """prefix -> (N, K) of every NVFP4 Linear of ``ckpt`` (headers checked: codes U8 [N, K/2],
    scales F8_E4M3 [N, K/16], a one-element F32 global). Used by the expert reader and by the
    carried-Linear scan (moepack/sources/linears.py)."""
    codes_sfx, glob_sfx, _ = _NAMES[fmt]
    mods = {}
    for name, ti in ckpt.tensors.items():
        if not name.endswith(codes_sfx) or ti.dtype_str != "U8":
            continue
        p = name[: -len(codes_sfx)]
        if len(ti.shape) != 2:
            raise SourceError(f"tensor {name!r} has shape {list(ti.shape)}: expected 2-D [N, K/2] (two e2m1 codes a byte)")
        n, k = ti.shape[0], 2 * ti.shape[1]
        sc, gl = p + ".weight_scale", p + glob_sfx
        for t, why in ((sc, "its e4m3 group scales"), (gl, "its fp32 global scale")):
            if t not in ckpt.tensors:
                raise SourceError(f"tensor {name!r} has no {t!r}: NVFP4 codes need {why}")
        check_dtype(ckpt, sc, _SCALE_DTYPES, "NVFP4 group scales are float8 e4m3fn (F8_E4M3)")
        if k % NV4_GROUP:
            raise SourceError(f"tensor {name!r} has shape {list(ti.shape)}: K={k} is not a multiple of {NV4_GROUP} (NVFP4 groups)")
        check_shape(ckpt, sc, (n, k // NV4_GROUP), f"one e4m3 scale per {NV4_GROUP} K values of {name!r} [N={n}, K/2={k // 2}]")
        check_dtype(ckpt, gl, {"F32"}, "NVFP4 global scales are fp32")
        gshape = tuple(ckpt.info(gl).shape)
        if gshape not in ((), (1,)):
            raise SourceError(f"tensor {gl!r} has shape {list(gshape)}: expected [] or [1] (one global scale per tensor)")
        if p + ".weight_zero_point" in ckpt.tensors:
            raise SourceError(f"tensor {p + '.weight_zero_point'!r} is present: NVFP4 weights are symmetric (no zero point)")
        mods[p] = (n, k)
    return mods


def layers(ckpt: Checkpoint) -> list[LayerSpec]:
    cfg = config(ckpt)
    fmt = cfg["format"]
    codes_sfx, glob_sfx, act_sfx = _NAMES[fmt]
    mods = nvfp4_modules(ckpt, fmt)
    if not mods:
        raise SourceError(f"source {ckpt.path}: an NVFP4 ({fmt}) config but no '*{codes_sfx}' U8 tensors")
    stand = {p + ".weight": (p + codes_sfx, nk) for p, nk in mods.items()}
    hidden = {t for p in mods for t in (p + codes_sfx, p + ".weight_scale", p + glob_sfx, p + act_sfx)}
    view = HeaderView(ckpt, stand, hidden, "NVFP4", NVFP4)
    rule = f"{fmt} expert weights must be NVFP4 (codes, e4m3 weight_scale and a global scale; shared experts may be float)"
    specs = discover_experts(ckpt, view, rule, stand, "NVFP4", NVFP4)
    flavour = "compressed-tensors" if fmt == CT_FORMAT else "ModelOpt"
    for s in specs:
        claim_expert_modules(s, rule, "NVFP4", NVFP4, flavour, lambda p: _left_in_float(cfg, p), codes_sfx,
                             lambda p: [p + codes_sfx, p + ".weight_scale", p + glob_sfx]
                             + ([p + act_sfx] if p + act_sfx in ckpt.tensors else []))  # fmt: skip
        if s.activation == "swigluoai":  # gpt-oss, linearized: gate/up de-interleaved; re-interleave
            s.interleaved = True
        check_router(view, s)
        facts = Nvfp4Facts(fmt, cfg["input_activations"])
        if s.shared and view.info(s.shared["gate_proj"]).dtype_str == NVFP4:
            sm = [s.shared[p][: -len(".weight")] for p in ("gate_proj", "up_proj", "down_proj")]
            for p, m in zip(("gate_proj", "up_proj", "down_proj"), sm):
                if view.info(m + ".weight").dtype_str != NVFP4:
                    raise SourceError(f"tensor {m + '.weight'!r} is float but {sm[0] + codes_sfx!r} is NVFP4: the shared "
                                      "expert's projections are stored alike")  # fmt: skip
            s.shared["modules"] = sm
            for p, m in zip(("gate_proj", "up_proj", "down_proj"), sm):
                s.shared[p] = m + codes_sfx  # real tensors (convert names the shared expert's sources with these)
            facts = Nvfp4Facts(fmt, cfg["input_activations"], shared=Nvfp4Facts(fmt, cfg["input_activations"]))
        elif s.shared:
            for p in ("up_proj", "down_proj"):
                if view.info(s.shared[p]).dtype_str == NVFP4:
                    raise SourceError(f"tensor {s.shared[p][: -len('.weight')] + codes_sfx!r} is NVFP4 but "
                                      f"{s.shared['gate_proj']!r} is not: the shared expert's projections are stored alike")  # fmt: skip
        s.quant = facts
    return specs


# --------------------------------------------------------------------------- reading


def read_global(ckpt, name: str, fmt: str) -> float:
    """The fp32 global scale stored in ``name``, checked: finite and positive (a zero global divides
    by zero in compressed-tensors' decode and zeroes every weight in ModelOpt's)."""
    g = ckpt.read(name).float().reshape(-1)
    v = float(g[0])
    rule = "it divides the e4m3 scales" if fmt == CT_FORMAT else "it multiplies the e4m3 scales"
    if not torch.isfinite(g[0]) or v <= 0:
        raise SourceError(f"tensor {name!r} = {v}: an NVFP4 global scale must be finite and positive ({rule})")
    return v


def nvfp4_linear(ckpt, prefix: str, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One NVFP4 Linear: (codes uint8 [N, K], e4m3 bytes uint8 [N, K/16], canonical globals fp32 [N]:
    compressed-tensors' divisor, or ModelOpt's multiplier negated), every value checked."""
    codes_sfx, glob_sfx, _ = _NAMES[fmt]
    q = unpack_e2m1(ckpt.read(prefix + codes_sfx)).contiguous()
    sn = prefix + ".weight_scale"
    s = ckpt.read(sn).view(torch.uint8).contiguous()
    check_e4m3_scales(sn, s, SourceError)
    g = read_global(ckpt, prefix + glob_sfx, fmt)
    glob = torch.full((q.shape[0],), g if fmt == CT_FORMAT else -g, dtype=torch.float32)
    return q, s, glob


def _w13(ckpt, mods2: list, fmt: str, interleaved: bool) -> dict:
    (gq, gs, gg), (uq, us, ug) = (nvfp4_linear(ckpt, m, fmt) for m in mods2)
    join = interleave_gate_up if interleaved else (lambda a, b: torch.cat([a, b]))
    return {"w13_q": join(gq, uq).contiguous(), "w13_scale": join(gs, us).contiguous(), "w13_global": join(gg, ug).contiguous()}


def _fmt(s: LayerSpec) -> str:
    return s.quant.format


def read_expert_canonical(ckpt: Checkpoint, s: LayerSpec, weight: str, e: int) -> dict[str, torch.Tensor]:
    """Scheme nvfp4's canonical tensors of expert ``e``'s ``weight`` ("w13" or "w2"), as stored."""
    if weight == "w13":
        return _w13(ckpt, [s.names[(e, r, "module")] for r in ("gate", "up")], _fmt(s), s.interleaved)
    if weight != "w2":
        raise KeyError(f"weight {weight!r}: expected 'w13' or 'w2'")
    q, sc, g = nvfp4_linear(ckpt, s.names[(e, "down", "module")], _fmt(s))
    return {"w2_q": q, "w2_scale": sc, "w2_global": g}


def _deq(c: dict, w: str) -> torch.Tensor:
    return dequantize_nvfp4(c[f"{w}_q"], c[f"{w}_scale"], c[f"{w}_global"])


def read_expert_w13(ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
    """fp32 [2I, H]: the codes times their group scales (moepack.schemes.nvfp4.codec)."""
    return _deq(read_expert_canonical(ckpt, s, "w13", e), "w13")


def read_expert_w2(ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
    return _deq(read_expert_canonical(ckpt, s, "w2", e), "w2")


def read_biases(ckpt: Checkpoint, s: LayerSpec) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """[E, 2I] and [E, H] biases in canonical row order, or (None, None)."""
    b13, b2 = dense_read_biases(ckpt, s)
    if b13 is not None and s.interleaved:
        i = s.intermediate
        b13 = interleave_gate_up(b13[:, :i].t(), b13[:, i:].t()).t().contiguous()
    return b13, b2


def read_layer(ckpt: Checkpoint, s: LayerSpec) -> CanonicalLayer:
    per = [{**read_expert_canonical(ckpt, s, "w13", e), **read_expert_canonical(ckpt, s, "w2", e)} for e in range(s.num_experts)]
    canon = {k: torch.stack([p[k] for p in per]) for k in per[0]}
    b13, b2 = read_biases(ckpt, s)
    return CanonicalLayer(spec=s, w13=_deq(canon, "w13"), w2=_deq(canon, "w2"), w13_bias=b13, w2_bias=b2, canonical=canon)


def read_shared_canonical(ckpt: Checkpoint, s: LayerSpec) -> dict[str, torch.Tensor] | None:
    """The NVFP4 shared expert's canonical tensors as a one-expert set, or None (none, or float)."""
    if not s.shared or "modules" not in s.shared:
        return None
    g, u, d = s.shared["modules"]
    c = _w13(ckpt, [g, u], _fmt(s), False)
    q2, s2, g2 = nvfp4_linear(ckpt, d, _fmt(s))
    return {**{k: v[None] for k, v in c.items()}, "w2_q": q2[None], "w2_scale": s2[None], "w2_global": g2[None]}


def read_shared(ckpt: Checkpoint, s: LayerSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared expert as float (decoded if NVFP4), a one-expert canonical pair."""
    c = read_shared_canonical(ckpt, s)
    if c is None:
        from .dense import read_shared as dense_read_shared

        return dense_read_shared(ckpt, s)
    return _deq(c, "w13"), _deq(c, "w2")


__all__ = ["SCHEME", "NVFP4", "CT_FORMAT", "MODELOPT", "CT_NOTE", "MODELOPT_NOTE", "config", "detect_ct", "detect_modelopt",
           "nvfp4_modules", "nvfp4_linear", "read_global", "layers", "read_layer", "read_expert_canonical",
           "read_shared_canonical", "read_expert_w13", "read_expert_w2", "read_biases", "read_shared"]  # fmt: skip


# --------------------------------------------------------------------------- carried Linears


def _linears_of(view, fmt: str, qc: dict | None = None) -> dict:
    """The NVFP4 Linears (compressed-tensors: U8 ``weight_packed``, F8_E4M3 ``weight_scale``
    [N, K/16], F32 ``weight_global_scale``; ModelOpt: U8 ``weight``, ``weight_scale``,
    ``weight_scale_2``; FORMATS.md §3.5, §6), through the expert reader's header checks."""
    codes_sfx, glob_sfx, act_sfx = _NAMES[fmt]
    out = {}
    for p, (n, k) in nvfp4_modules(view, fmt).items():
        if qc is not None and ct_group_format(qc, p) != CT_FORMAT:
            continue
        t = {"weight": p + codes_sfx, "scale": p + ".weight_scale", "global": p + glob_sfx}
        if p + act_sfx in view.tensors:
            t["input_scale"] = p + act_sfx
        out[p] = CarriedLinear(p, "nvfp4", n, k, t, cfg={"format": fmt})
    return out


def _ct_linears(view, qc: dict) -> dict:
    if not any(((g or {}).get("format") or qc.get("format")) == CT_FORMAT for g in (qc.get("config_groups") or {}).values()):
        return {}
    return _linears_of(view, CT_FORMAT, qc)


def _linear_values(view, lin, dequant: bool = True) -> torch.Tensor | None:
    q, s, g = nvfp4_linear(view, lin.prefix, lin.cfg["format"])  # checks the scales and the global
    return dequantize_nvfp4(q, s, g) if dequant else None


register_linears("nvfp4", _linear_values, LinearFinder(("compressed-tensors",), _ct_linears, order=1, ct_formats=(CT_FORMAT,)),
                 LinearFinder(("modelopt",), lambda view, qc: _linears_of(view, MODELOPT)))
