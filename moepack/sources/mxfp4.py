"""MXFP4 checkpoints (scheme mxfp4; docs/FORMATS.md §5 and §3.4, "What moepack's MXFP4 readers
accept"): transformers gpt-oss (``quant_method: "mxfp4"``) and compressed-tensors
``mxfp4-pack-quantized``.

Both store OCP MX FP4: a 4-bit e2m1 code per weight (bit 3 the sign, codes 0..7 = 0, 0.5, 1, 1.5,
2, 3, 4, 6) and one e8m0 byte e per 32 consecutive K values of a row, ``W = e2m1(q) * 2^(e - 127)``
(moepack/schemes/mxfp4/codec.py); e = 255 is NaN and refused.

* gpt-oss (per MoE layer ``P = model.layers.L.mlp``): ``P.experts.gate_up_proj_blocks`` U8
  [E, 2I, H/32, 16], ``P.experts.gate_up_proj_scales`` U8 [E, 2I, H/32], ``P.experts.gate_up_proj_bias``
  [E, 2I], ``P.experts.down_proj_blocks`` [E, H, I/32, 16], ``_scales`` [E, H, I/32], ``_bias`` [E, H],
  ``P.router.weight`` / ``.bias`` in float. The blocks are output-major; byte j of a 16-byte block
  holds K element 2j in its low nibble and 2j+1 in its high nibble. The gate/up rows are
  interleaved (even = gate, odd = up), exactly the order moepack's swigluoai canonical form
  keeps (the dense reader's bf16 gpt-oss ``[E, H, 2I]`` transposed is the same [E, 2I, H]). K is
  a whole number of blocks by construction: H and I must be multiples of 32 and the shapes must
  agree with config.json. ``quantization_config.modules_to_not_convert`` (transformers' rule:
  whole name, suffix or regex up to a module boundary) naming a layer's ``experts`` that are
  stored as blocks is refused (the config and the weights disagree); every other tensor is
  carried as it is.
* compressed-tensors (per quantized Linear ``P``, N outputs, K inputs): ``P.weight_packed`` U8
  [N, K/2] (low nibble = even k), ``P.weight_scale`` U8 (or F8_E8M0) e8m0 [N, ceil(K/32)]; no
  global scale, no zero point. Experts are per expert (llm-compressor linearizes fused ones;
  gpt-oss' gate/up come de-interleaved and are re-interleaved here), found with the dense
  reader's per-expert names; a quantized shared expert is read the same way.

Canonical tensors of one expert (``read_expert_canonical``): ``w13_q`` uint8 [2I, H] (one code
0..15 per byte), ``w13_scale`` uint8 [2I, ceil(H/32)], ``w2_q`` [H, I], ``w2_scale`` [H, ceil(I/32)],
as stored (nothing is re-quantized); biases fp32-able [E, 2I] / [E, H] through ``read_biases``.
The float readers (``read_expert_w13/w2``, ``read_layer``) decode them exactly in fp32.

Refused in one line naming the tensor (or config key), the value and the rule, before convert
writes anything final: an e8m0 scale of 255 (with its first index), blocks / packed codes and
scales whose shapes disagree with each other or with config.json, a gpt-oss hidden or
intermediate size that is not a multiple of 32, an unknown ``quant_method`` / format variant
(NVFP4, MXFP6, MXFP8 are other formats), and experts the config leaves unquantized that are
stored quantized.
"""

from __future__ import annotations

import re

import torch

from ..errors import SourceError
from ..schemes.mxfp4.codec import E8M0_LARGEST, E8M0_NAN, MX4_GROUP, dequantize_mxfp4
from ..schemes.mxfp4.facts import Mxfp4Facts
from .checkpoint import Checkpoint, TensorInfo
from .compressed_tensors import fp4_groups, quantization_config
from .dense import FLOAT_DTYPES, CanonicalLayer, LayerSpec, discover_layers, read_biases as dense_read_biases, text_config
from .fp8 import names_module, ignore_entry
from .linears import CarriedLinear, LinearFinder, ct_formats, ct_group_format, register_linears

SCHEME = "mxfp4"
E2M1 = "E2M1"  # LayerSpec.dtype of MXFP4 experts (4-bit e2m1 codes; safetensors stores them packed in U8)
CT_FORMAT = "mxfp4-pack-quantized"
GPT_OSS_NOTE = ("gpt-oss MXFP4 (transformers quant_method mxfp4: e2m1 codes in 16-byte blocks of 32, one e8m0 scale per "
                "32 K values)")  # fmt: skip
CT_NOTE = "compressed-tensors mxfp4-pack-quantized (e2m1 codes, one e8m0 weight_scale per 32 K values)"
_SCALE_DTYPES = {"U8", "F8_E8M0"}
_OTHER_METHODS = {
    "nvfp4": "NVFP4 (16-element groups, e4m3 scales and a global scale) is not MXFP4",
    "mxfp6": "MXFP6 (6-bit elements) is not MXFP4",
    "mxfp8": "MXFP8 (8-bit elements) is not MXFP4",
    "fp4": "a bare FP4 method names no scale format",
}
_OTHER_CT_FORMATS = {
    "nvfp4-pack-quantized": "NVFP4 (16-element groups, e4m3 scales and a global scale) is not MXFP4",
    "mxfp6-pack-quantized": "MXFP6 (6-bit elements) is not MXFP4",
    "mxfp8-quantized": "MXFP8 (8-bit elements) is not MXFP4",
}
_ROLES = ("gate", "up", "down")


# --------------------------------------------------------------------------- codes and scales


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., B] (two codes a byte, low nibble first) -> uint8 [..., 2B], one code per byte."""
    p = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


def check_e8m0(name: str, scale: torch.Tensor, at: tuple = ()) -> torch.Tensor:
    """``scale`` (U8 or float8_e8m0fnu) as uint8 e8m0 bytes, or a SourceError naming the first 255
    (NaN) with its index in the stored tensor (``at``: the index of ``scale`` within it)."""
    s = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    bad = s == E8M0_NAN
    if bool(bad.any()):
        idx = [*at, *(int(i) for i in bad.nonzero()[0])]
        raise SourceError(f"tensor {name!r}{idx} = 255: an e8m0 NaN scale; MXFP4 scales must be 0..{E8M0_LARGEST} (2^(e - 127))")
    bad = s > E8M0_LARGEST
    if bool(bad.any()):
        idx = [*at, *(int(i) for i in bad.nonzero()[0])]
        e = int(s[tuple(idx[len(at):])])
        raise SourceError(f"tensor {name!r}{idx} = {e}: e8m0 scale 2^{e - 127} x e2m1's largest code 6 overflows float32; "
                          f"MXFP4 scales must be 0..{E8M0_LARGEST}, so that every weight decodes to a finite value")  # fmt: skip
    return s


def check_dtype(ckpt, name: str, allowed: set, rule: str) -> TensorInfo:
    ti = ckpt.info(name)
    if ti.dtype_str not in allowed:
        raise SourceError(f"tensor {name!r} has dtype {ti.dtype_str}: {rule}")
    return ti


def check_shape(ckpt, name: str, want: tuple, why: str) -> None:
    got = tuple(ckpt.info(name).shape)
    if got != tuple(want):
        raise SourceError(f"tensor {name!r} has shape {list(got)}: expected {list(want)} ({why})")


def _int(config: dict, key: str):
    v = config.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# --------------------------------------------------------------------------- config


def _gpt_oss_cfg(qc: dict) -> dict:
    skip = qc.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(x, str) for x in skip):
        raise SourceError(f"quantization_config modules_to_not_convert={skip!r}: must be a list of module names / patterns")
    return {"format": "gpt_oss", "not_converted": tuple(skip), "ignore": (), "input_activations": None}


def _grouping(where: str, strat, gs) -> None:
    if strat != "group" or gs != MX4_GROUP:
        raise SourceError(f"{where} weights strategy={strat!r}, group_size={gs!r}: MXFP4 has one scale per group of "
                          f"{MX4_GROUP} K values (strategy 'group', group_size {MX4_GROUP})")  # fmt: skip


def _ct_cfg(qc: dict) -> dict:
    acts = fp4_groups(qc, CT_FORMAT, "MXFP4", _grouping, ("torch.uint8", "uint8"), "MXFP4 scales are e8m0 bytes (torch.uint8)",
                      other_formats=_OTHER_CT_FORMATS, static_acts=False)  # fmt: skip
    return {"format": CT_FORMAT, "not_converted": (), "ignore": tuple(str(x) for x in qc.get("ignore") or []),
            "input_activations": acts}  # fmt: skip


def config(ckpt: Checkpoint) -> dict:
    """The checked MXFP4 config of ``ckpt`` (cached), or a SourceError saying why it is not one."""
    cached = ckpt.__dict__.get("_mxfp4_cfg")
    if cached is not None:
        return cached
    qc = quantization_config(ckpt)
    if qc is None:
        raise SourceError("no quantization_config")
    method = qc.get("quant_method")
    if method == "mxfp4":
        cfg = _gpt_oss_cfg(qc)
    elif method == "compressed-tensors":
        cfg = _ct_cfg(qc)
    elif isinstance(method, str) and method.lower() in _OTHER_METHODS:
        raise SourceError(f"quant_method={method!r}: {_OTHER_METHODS[method.lower()]}; the MXFP4 reader reads 'mxfp4' "
                          f"(gpt-oss) and compressed-tensors {CT_FORMAT!r}")  # fmt: skip
    else:
        raise SourceError(f"quant_method={method!r}: the MXFP4 reader reads 'mxfp4' (gpt-oss) and compressed-tensors {CT_FORMAT!r}")
    ckpt.__dict__["_mxfp4_cfg"] = cfg
    return cfg


def _detect(ckpt: Checkpoint, fmt: str) -> tuple[bool, str]:
    qc = quantization_config(ckpt)
    method = qc.get("quant_method") if qc else None
    if fmt == "gpt_oss" and method != "mxfp4" and not (isinstance(method, str) and method.lower() in _OTHER_METHODS):
        return False, f"quant_method={method!r}: not 'mxfp4'"
    if fmt == CT_FORMAT and method != "compressed-tensors":
        return False, f"quant_method={method!r}: not 'compressed-tensors'"
    try:
        config(ckpt)
    except SourceError as e:
        return False, str(e)
    return True, GPT_OSS_NOTE if fmt == "gpt_oss" else CT_NOTE


def detect_gpt_oss(ckpt: Checkpoint) -> tuple[bool, str]:
    """transformers gpt-oss MXFP4 (``quant_method: "mxfp4"``)."""
    return _detect(ckpt, "gpt_oss")


def detect_ct(ckpt: Checkpoint) -> tuple[bool, str]:
    """compressed-tensors ``mxfp4-pack-quantized``."""
    return _detect(ckpt, CT_FORMAT)


def _left_in_float(cfg: dict, module: str) -> str | None:
    """The config entry that leaves ``module`` unquantized, or None."""
    for key in cfg["not_converted"]:
        if names_module(key, module):
            return key
    return ignore_entry(cfg["ignore"], module)


# --------------------------------------------------------------------------- views for discover_layers


class HeaderView:
    """The checkpoint as discover_layers sees it: every MXFP4 weight appears as a stand-in tensor
    of dtype E2M1 and its logical shape (``stand``: name -> (real tensor, shape)); the packed
    tensors are hidden."""

    def __init__(self, ckpt: Checkpoint, stand: dict, hidden: set, what: str = "MXFP4", tag: str = E2M1):
        self.path, self.config = ckpt.path, ckpt.config
        self.tensors = {n: ti for n, ti in ckpt.tensors.items() if n not in hidden}
        for name, (real, shape) in stand.items():
            if name in self.tensors:
                raise SourceError(f"tensor {name!r} is present next to the {what} {real!r}: a weight is either float or {what}")
            ref = ckpt.info(real)
            self.tensors[name] = TensorInfo(name, ref.file, tag, tuple(shape), ref.offset, ref.nbytes)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise SourceError(f"tensor {name!r} is missing from {self.path}") from None


def claim_expert_modules(s: LayerSpec, rule: str, what: str, tag: str, flavour: str, left_in_float, codes_sfx: str,
                         tensors_of) -> None:  # fmt: skip
    """A layer of per-expert quantized Linears (compressed-tensors MXFP4, NVFP4 of either flavour):
    refuses fused expert tensors, experts not stored as ``tag``, and an expert module the config
    leaves in float (``left_in_float(module)``: the reason, or None); records each expert's module
    (``names[(e, role, "module")]``) and puts its stored tensors (``tensors_of(module)``) in place of
    the stand-in ``.weight`` names among the layer's ``expert_tensors``."""
    if s.kind != "per_expert":
        raise SourceError(f"layer {s.prefix!r}: expert tensors are fused ({s.kind}, {s.names.get('gate_up')!r}); {flavour} "
                          f"{what} experts are per-expert Linear weights")  # fmt: skip
    if s.dtype != tag:
        raise SourceError(f"tensor {s.names[(0, 'gate', 'weight')]!r} has dtype {s.dtype}: {rule}")
    used = []
    for e in range(s.num_experts):
        for role in _ROLES:
            p = s.names[(e, role, "weight")][: -len(".weight")]
            why = left_in_float(p)
            if why is not None:
                raise SourceError(f"tensor {p + codes_sfx!r} is {what}, but the config leaves {p!r} unquantized "
                                  f"({why!r}): the config and the weights disagree")  # fmt: skip
            s.names[(e, role, "module")] = p
            used += tensors_of(p)
    stand = {s.names[(e, r, "weight")] for e in range(s.num_experts) for r in _ROLES}
    s.expert_tensors = sorted(set(s.expert_tensors) - stand | set(used))


def discover_experts(ckpt, view, rule: str, stand: dict, what: str = "MXFP4", tag: str = E2M1) -> list[LayerSpec]:
    try:
        return discover_layers(view, (FLOAT_DTYPES | {tag}, rule))
    except SourceError as err:  # name the real tensors, not the view's stand-ins
        msg = str(err)
        for name, (real, _) in stand.items():
            msg = msg.replace(repr(name), f"{real!r} (as {what})")
        raise SourceError(msg) from None


def check_router(view, s: LayerSpec) -> None:
    for key in ("weight", "bias"):
        rn = s.router.get(key)
        dt = view.info(rn).dtype_str if rn else None
        if dt == E2M1:
            raise SourceError(f"router tensor {rn[: -len('.weight')] + '.weight_packed'!r} is MXFP4: the router must stay in float")
        if rn and dt not in FLOAT_DTYPES:
            raise SourceError(f"router tensor {rn!r} has dtype {dt}: the router must stay in float")
    if s.shared.get("gate") and view.info(s.shared["gate"]).dtype_str not in FLOAT_DTYPES:
        raise SourceError(f"tensor {s.shared['gate']!r} is quantized: the shared-expert gate must stay in float")


# --------------------------------------------------------------------------- gpt-oss layers

_GPT_OSS_BLOCKS = re.compile(r"^(?P<p>.+\.experts)\.(?P<w>gate_up_proj|down_proj)_blocks$")


def _gpt_oss_layers(ckpt: Checkpoint, cfg: dict) -> list[LayerSpec]:
    conf = text_config(ckpt.config)
    h, i_cfg = _int(conf, "hidden_size"), _int(conf, "intermediate_size")
    e_cfg = next((_int(conf, k) for k in ("num_local_experts", "num_experts") if _int(conf, k) is not None), None)
    found: dict[str, dict] = {}
    for name in ckpt.tensors:
        m = _GPT_OSS_BLOCKS.match(name)
        if m:
            found.setdefault(m["p"], {})[m["w"]] = name
    if not found:
        raise SourceError(f"source {ckpt.path}: quant_method 'mxfp4' but no '*.experts.gate_up_proj_blocks' tensors (FORMATS.md §5.1)")
    if h is None or h <= 0:
        raise SourceError(f"config.json: hidden_size={conf.get('hidden_size')!r} must be a positive integer")
    if h % MX4_GROUP:
        raise SourceError(f"config.json: hidden_size={h}: gpt-oss MXFP4 blocks hold {MX4_GROUP} K values each, so H (the "
                          f"gate_up blocks' K) must be a multiple of {MX4_GROUP}")  # fmt: skip
    stand, hidden, extra = {}, set(), {}
    for p, w in sorted(found.items()):
        for which in ("gate_up_proj", "down_proj"):
            if which not in w:
                raise SourceError(f"layer {p!r}: {w[next(iter(w))]!r} has no {p + '.' + which + '_blocks'!r}: gpt-oss MXFP4 "
                                  "experts store both gate_up_proj and down_proj as blocks")  # fmt: skip
        gb, db = w["gate_up_proj"], w["down_proj"]
        for b in (gb, db):
            ti = check_dtype(ckpt, b, {"U8"}, "gpt-oss MXFP4 blocks are U8, two e2m1 codes a byte")
            if len(ti.shape) != 4 or ti.shape[-1] != 16:
                raise SourceError(f"tensor {b!r} has shape {list(ti.shape)}: expected 4-D [E, N, K/32, 16] (16 bytes = 32 "
                                  "e2m1 codes per block)")  # fmt: skip
            sc = b[: -len("_blocks")] + "_scales"
            if sc not in ckpt.tensors:
                raise SourceError(f"tensor {b!r} has no {sc!r}: MXFP4 blocks need their e8m0 scales")
            check_dtype(ckpt, sc, _SCALE_DTYPES, "MXFP4 scales are e8m0 bytes (U8)")
            check_shape(ckpt, sc, ti.shape[:-1], f"one e8m0 scale per block of {b!r} {list(ti.shape)}")
            hidden |= {b, sc}
        e, rows, nb, _ = ckpt.info(gb).shape
        if e_cfg is not None and e != e_cfg:
            raise SourceError(f"tensor {gb!r} has shape {list(ckpt.info(gb).shape)}: {e} experts, config.json says {e_cfg}")
        if rows % 2:
            raise SourceError(f"tensor {gb!r} has shape {list(ckpt.info(gb).shape)}: {rows} rows, expected 2I (gate and up)")
        inter = rows // 2
        if i_cfg is not None and inter != i_cfg:
            raise SourceError(f"tensor {gb!r} has shape {list(ckpt.info(gb).shape)}: expected [{e}, {2 * i_cfg}, {h // 32}, 16] "
                              f"([E, 2I, H/32, 16] with intermediate_size={i_cfg} in config.json)")  # fmt: skip
        if inter % MX4_GROUP:
            raise SourceError(f"tensor {gb!r}: intermediate size I={inter}: gpt-oss MXFP4 blocks hold {MX4_GROUP} K values each, "
                              f"so I (down_proj's K) must be a multiple of {MX4_GROUP}")  # fmt: skip
        check_shape(ckpt, gb, (e, 2 * inter, h // MX4_GROUP, 16), f"[E, 2I, H/32, 16] with hidden_size={h} in config.json")
        check_shape(ckpt, db, (e, h, inter // MX4_GROUP, 16), f"[E, H, I/32, 16] with H={h}, I={inter}")
        base = p + "."
        stand[base + "gate_up_proj"] = (gb, (e, h, 2 * inter))  # the bf16 gpt-oss layout, in-major, for discover_layers
        stand[base + "down_proj"] = (db, (e, inter, h))
        extra[p] = (gb, db)
    view = HeaderView(ckpt, stand, hidden)
    rule = "gpt-oss MXFP4 experts are stored as *_blocks / *_scales (one layer, one scheme: float experts are refused)"
    specs = discover_experts(ckpt, view, rule, stand)
    for s in specs:
        p = s.prefix + ".experts"
        if s.kind != "fused_in" or p not in extra:
            name = s.names.get("gate_up") or s.names.get((0, "gate", "weight"))
            raise SourceError(f"tensor {name!r} has dtype {view.info(name).dtype_str}: {rule}")
        gb, db = extra[p]
        module = p
        why = _left_in_float(cfg, module)
        if why is not None:
            raise SourceError(f"tensor {gb!r} is MXFP4, but the config leaves {module!r} unquantized (modules_to_not_convert "
                              f"entry {why!r}): the config and the weights disagree")  # fmt: skip
        for key in ("gate_up_bias", "down_bias"):
            bn = s.names.get(key)
            if bn and view.info(bn).dtype_str not in FLOAT_DTYPES:
                raise SourceError(f"tensor {bn!r} has dtype {view.info(bn).dtype_str}: expert biases are float (BF16, F16, F32)")
        s.kind = "fused_out"  # the blocks are output-major [E, N, K/32, 16]
        s.dtype = E2M1
        s.names.update(gate_up=gb, down=db, gate_up_scales=gb[: -len("_blocks")] + "_scales",
                       down_scales=db[: -len("_blocks")] + "_scales")  # fmt: skip
        s.expert_tensors = sorted(n for n in (gb, db, s.names["gate_up_scales"], s.names["down_scales"], s.names.get("gate_up_bias"),
                                             s.names.get("down_bias")) if n)  # fmt: skip
        s.interleaved = True  # gpt-oss: even rows gate, odd rows up (FORMATS.md §5.2)
        check_router(view, s)
        s.quant = Mxfp4Facts("gpt_oss")
    return specs


# --------------------------------------------------------------------------- compressed-tensors layers


def _ct_modules(ckpt: Checkpoint) -> dict[str, tuple[int, int]]:
    """prefix -> (N, K) of every mxfp4 Linear (``weight_packed`` U8 + ``weight_scale``), headers checked."""
    mods = {}
    for name, ti in ckpt.tensors.items():
        if not name.endswith(".weight_packed"):
            continue
        p = name[: -len(".weight_packed")]
        check_dtype(ckpt, name, {"U8"}, "mxfp4-pack-quantized codes are U8, two e2m1 codes a byte")
        if len(ti.shape) != 2:
            raise SourceError(f"tensor {name!r} has shape {list(ti.shape)}: expected 2-D [N, K/2]")
        n, k = ti.shape[0], 2 * ti.shape[1]
        sc = p + ".weight_scale"
        if sc not in ckpt.tensors:
            raise SourceError(f"tensor {name!r} has no {sc!r}: MXFP4 codes need their e8m0 scales")
        check_dtype(ckpt, sc, _SCALE_DTYPES, "MXFP4 scales are e8m0 bytes (U8)")
        check_shape(ckpt, sc, (n, -(-k // MX4_GROUP)), f"one e8m0 scale per {MX4_GROUP} K values of {name!r} [N={n}, K/2={k // 2}]")
        for other in (".weight_global_scale", ".weight_zero_point"):
            if p + other in ckpt.tensors:
                raise SourceError(f"tensor {p + other!r} is present: MXFP4 has neither a global scale (NVFP4's) nor a zero point")
        mods[p] = (n, k)
    return mods


def _ct_layers(ckpt: Checkpoint, cfg: dict) -> list[LayerSpec]:
    mods = _ct_modules(ckpt)
    if not mods:
        raise SourceError(f"source {ckpt.path}: a {CT_FORMAT} config but no '*.weight_packed' tensors")
    stand = {p + ".weight": (p + ".weight_packed", nk) for p, nk in mods.items()}
    hidden = {t for p in mods for t in (p + ".weight_packed", p + ".weight_scale")}
    view = HeaderView(ckpt, stand, hidden)
    rule = f"{CT_FORMAT} expert weights must be MXFP4 (weight_packed + weight_scale; shared experts may be float)"
    specs = discover_experts(ckpt, view, rule, stand)
    for s in specs:
        claim_expert_modules(s, rule, "MXFP4", E2M1, "compressed-tensors", lambda p: _left_in_float(cfg, p), ".weight_packed",
                             lambda p: [p + ".weight_packed", p + ".weight_scale"])  # fmt: skip
        if s.activation == "swigluoai":  # gpt-oss, linearized: gate/up de-interleaved; re-interleave
            s.interleaved = True
        check_router(view, s)
        facts = Mxfp4Facts(CT_FORMAT, cfg["input_activations"])
        if s.shared and view.info(s.shared["gate_proj"]).dtype_str == E2M1:
            sm = [s.shared[p][: -len(".weight")] for p in ("gate_proj", "up_proj", "down_proj")]
            s.shared["modules"] = sm
            for p, m in zip(("gate_proj", "up_proj", "down_proj"), sm):
                s.shared[p] = m + ".weight_packed"  # real tensors (convert names the shared expert's sources with these)
            facts = Mxfp4Facts(CT_FORMAT, cfg["input_activations"], shared=Mxfp4Facts(CT_FORMAT, cfg["input_activations"]))
        elif s.shared:
            for p in ("up_proj", "down_proj"):
                if view.info(s.shared[p]).dtype_str == E2M1:
                    raise SourceError(f"tensor {s.shared[p][: -len('.weight')] + '.weight_packed'!r} is MXFP4 but "
                                      f"{s.shared['gate_proj']!r} is not: the shared expert's projections are stored alike")  # fmt: skip
        s.quant = facts
    return specs


def layers(ckpt: Checkpoint) -> list[LayerSpec]:
    cfg = config(ckpt)
    return _gpt_oss_layers(ckpt, cfg) if cfg["format"] == "gpt_oss" else _ct_layers(ckpt, cfg)


# --------------------------------------------------------------------------- reading


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """rows 2j = gate_j, 2j+1 = up_j (swigluoai's canonical order)."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def _blocks_expert(ckpt: Checkpoint, blocks: str, scales: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss expert ``e``: (codes uint8 [N, K], e8m0 uint8 [N, K/32])."""
    q = unpack_e2m1(ckpt.read_slice(blocks, e)).flatten(-2)  # [N, nb, 32] -> [N, K]
    return q.contiguous(), check_e8m0(scales, ckpt.read_slice(scales, e), (e,)).contiguous()


def _ct_linear(ckpt: Checkpoint, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors Linear: (codes uint8 [N, K], e8m0 uint8 [N, ceil(K/32)])."""
    sn = prefix + ".weight_scale"
    return unpack_e2m1(ckpt.read(prefix + ".weight_packed")).contiguous(), check_e8m0(sn, ckpt.read(sn)).contiguous()


def _ct_w13(ckpt, mods3: list, interleaved: bool) -> dict:
    (gq, gs), (uq, us) = _ct_linear(ckpt, mods3[0]), _ct_linear(ckpt, mods3[1])
    join = interleave_gate_up if interleaved else (lambda a, b: torch.cat([a, b]))
    return {"w13_q": join(gq, uq).contiguous(), "w13_scale": join(gs, us).contiguous()}


def read_expert_canonical(ckpt: Checkpoint, s: LayerSpec, weight: str, e: int) -> dict[str, torch.Tensor]:
    """Scheme mxfp4's canonical tensors of expert ``e``'s ``weight`` ("w13" or "w2"): {"w13_q": uint8
    [2I, H] codes 0..15, "w13_scale": uint8 [2I, ceil(H/32)] e8m0} (or w2_q [H, I] / w2_scale), as stored."""
    if weight not in ("w13", "w2"):
        raise KeyError(f"weight {weight!r}: expected 'w13' or 'w2'")
    if s.kind == "fused_out":  # gpt-oss blocks
        key = "gate_up" if weight == "w13" else "down"
        q, sc = _blocks_expert(ckpt, s.names[key], s.names[key + "_scales"], e)
        return {f"{weight}_q": q, f"{weight}_scale": sc}
    if weight == "w13":
        return _ct_w13(ckpt, [s.names[(e, r, "module")] for r in ("gate", "up")], s.interleaved)
    q, sc = _ct_linear(ckpt, s.names[(e, "down", "module")])
    return {"w2_q": q, "w2_scale": sc}


def read_expert_w13(ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
    """fp32 [2I, H]: the codes times their scales, exactly (moepack.schemes.mxfp4.codec)."""
    c = read_expert_canonical(ckpt, s, "w13", e)
    return dequantize_mxfp4(c["w13_q"], c["w13_scale"])


def read_expert_w2(ckpt: Checkpoint, s: LayerSpec, e: int) -> torch.Tensor:
    c = read_expert_canonical(ckpt, s, "w2", e)
    return dequantize_mxfp4(c["w2_q"], c["w2_scale"])


def read_biases(ckpt: Checkpoint, s: LayerSpec) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """[E, 2I] and [E, H] biases in canonical row order (gpt-oss: interleaved as stored), or (None, None)."""
    b13, b2 = dense_read_biases(ckpt, s)
    if b13 is not None and s.kind == "per_expert" and s.interleaved:
        i = s.intermediate
        b13 = interleave_gate_up(b13[:, :i].t(), b13[:, i:].t()).t().contiguous()
    return b13, b2


def read_layer(ckpt: Checkpoint, s: LayerSpec) -> CanonicalLayer:
    per = [{**read_expert_canonical(ckpt, s, "w13", e), **read_expert_canonical(ckpt, s, "w2", e)} for e in range(s.num_experts)]
    canon = {k: torch.stack([p[k] for p in per]) for k in per[0]}
    b13, b2 = read_biases(ckpt, s)
    return CanonicalLayer(spec=s, w13=dequantize_mxfp4(canon["w13_q"], canon["w13_scale"]),
                          w2=dequantize_mxfp4(canon["w2_q"], canon["w2_scale"]), w13_bias=b13, w2_bias=b2,
                          canonical=canon)  # fmt: skip


def read_shared_canonical(ckpt: Checkpoint, s: LayerSpec) -> dict[str, torch.Tensor] | None:
    """The MXFP4 shared expert's canonical tensors as a one-expert set (w13_q [1, 2Is, H], ...), or
    None (no shared expert, or a float one)."""
    if not s.shared or "modules" not in s.shared:
        return None
    g, u, d = s.shared["modules"]
    c = _ct_w13(ckpt, [g, u], False)
    q2, s2 = _ct_linear(ckpt, d)
    return {"w13_q": c["w13_q"][None], "w13_scale": c["w13_scale"][None], "w2_q": q2[None], "w2_scale": s2[None]}


def read_shared(ckpt: Checkpoint, s: LayerSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared expert as float (decoded if MXFP4), a one-expert canonical pair."""
    c = read_shared_canonical(ckpt, s)
    if c is None:
        from .dense import read_shared as dense_read_shared

        return dense_read_shared(ckpt, s)
    return dequantize_mxfp4(c["w13_q"], c["w13_scale"]), dequantize_mxfp4(c["w2_q"], c["w2_scale"])


__all__ = ["SCHEME", "E2M1", "CT_FORMAT", "GPT_OSS_NOTE", "CT_NOTE", "unpack_e2m1", "check_e8m0", "config", "detect_gpt_oss",
           "detect_ct", "layers", "read_layer", "read_expert_canonical", "read_shared_canonical", "read_expert_w13",
           "read_expert_w2", "read_biases", "read_shared"]  # fmt: skip


# --------------------------------------------------------------------------- carried Linears


def _linears(view, qc: dict) -> dict:
    """The compressed-tensors ``mxfp4-pack-quantized`` Linears: ``weight_packed`` U8 [N, K/2] (two
    e2m1 codes a byte, low nibble first) + ``weight_scale`` e8m0 [N, ceil(K/32)] (FORMATS.md §3.4).
    A U8 ``weight_packed`` of a format no registered finder reads is refused here (the FP4 finder
    that runs first)."""
    out = {}
    for name, ti in view.tensors.items():
        if not name.endswith(".weight_packed") or ti.dtype_str != "U8":
            continue
        p = name[: -len(".weight_packed")]
        fmt = ct_group_format(qc, p)
        if fmt != CT_FORMAT and fmt in ct_formats():  # another registered finder reads it
            continue
        if fmt != CT_FORMAT:
            fp4 = [f for f in ct_formats() if "fp4" in f]
            raise SourceError(f"tensor {name!r} is U8 (packed FP4) but its config group's format is {fmt!r}: moepack reads "
                              f"FP4 Linears as {' or '.join(repr(f) for f in fp4)}")  # fmt: skip
        if len(ti.shape) != 2:
            raise SourceError(f"tensor {name!r} has shape {list(ti.shape)}: expected a 2-D [N, K/2] weight")
        n, k = ti.shape[0], 2 * ti.shape[1]
        s = f"{p}.weight_scale"
        if s not in view.tensors:
            raise SourceError(f"tensor {name!r} is MXFP4 but {s!r} is missing: MXFP4 codes need their e8m0 scales")
        sti = view.info(s)
        if sti.dtype_str not in ("U8", "F8_E8M0"):
            raise SourceError(f"tensor {s!r} has dtype {sti.dtype_str}: MXFP4 scales are e8m0 bytes (U8)")
        want = (n, -(-k // MX4_GROUP))
        if tuple(sti.shape) != want:
            raise SourceError(f"tensor {s!r} has shape {list(sti.shape)}: expected {list(want)} (one e8m0 scale per 32 K values "
                              f"of {name!r} [N={n}, K/2={k // 2}])")  # fmt: skip
        for extra in (".weight_global_scale", ".weight_zero_point"):
            if p + extra in view.tensors:
                raise SourceError(f"tensor {p + extra!r} is present: MXFP4 has neither a global scale (NVFP4's) nor a zero point")
        out[p] = CarriedLinear(p, "mxfp4", n, k, {"weight": name, "scale": s})
    return out


def _linear_values(view, lin, dequant: bool = True) -> torch.Tensor | None:
    sn = lin.tensors["scale"]
    s = check_e8m0(sn, view.read(sn))
    if not dequant:
        return None
    return dequantize_mxfp4(unpack_e2m1(view.read(lin.tensors["weight"])), s)


register_linears("mxfp4", _linear_values, LinearFinder(("compressed-tensors",), _linears, order=0, ct_formats=(CT_FORMAT,)))
