"""Quantized Linears outside the experts (attention, dense MLPs, shared experts convert carries):
found from the config and the headers, validated by the experts' rules, dequantized through the
source format's own codec.

convert carries every tensor that no MoE layer consumes unchanged (names and bytes). When the
source quantized some of them, ``find_linears`` lists each such Linear (``CarriedLinear``: its
prefix, [N, K], codec and tensors) from the headers, refusing a malformed one (missing scale,
wrong shape); ``check_linear`` / ``dequantize_linear`` read its values and refuse NaN/Inf/zero/
negative scales, zero points outside 0..15, symmetric zero points other than 8, bad g_idx,
NaN FP8 codes and NaN (255) e8m0 scales, naming the tensor (the same functions the expert readers validate with:
int4_common.check_*, decode_g_idx, the format's ``decode``; fp8_codec). convert checks them all
before it writes anything; ``load_model`` dequantizes them to float32 (then the model dtype) when
it builds the model.

Codecs, by ``quantization_config.quant_method`` (docs/FORMATS.md):

* ``gptq`` (§1: qweight/qzeros/scales/g_idx, v1 "+1" and v2, act-order) and ``awq`` (§2: GEMM,
  interleaved nibbles): the format module's ``scan`` + ``decode`` (codec "int4");
  ``W[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]`` with g = g_idx (act-order) or k // G.
* ``compressed-tensors`` (§3), by tensor: ``weight_packed`` (pack-quantized: codec "int4"
  through ct_pack_quantized), int8 ``weight`` + ``weight_scale [N, 1]`` (int-quantized: "int8"),
  FP8 ``weight`` + ``weight_scale`` (float-quantized: "fp8", the scale's strategy from the
  Linear's config group: tensor, channel, group or block), U8 ``weight_packed`` + e8m0
  ``weight_scale`` (mxfp4-pack-quantized: "mxfp4", decoded by moepack.schemes.mxfp4.codec;
  ``W = e2m1(q) * 2^(e - 127)``, e = 255 refused).
* ``mxfp4`` (§5, gpt-oss): only the experts are MXFP4 (the reader packs them); every other
  Linear is float, so there is nothing to find.
* ``fp8`` (§4, DeepSeek / Qwen FP8): FP8 ``weight`` + ``weight_scale_inv``
  ``[ceil(N/bn), ceil(K/bk)]`` with ``weight_block_size`` [bn, bk] (codec "fp8").

A view is anything with ``path``, ``config`` (config.json as a dict), ``tensors`` (name ->
TensorInfo-like: ``dtype_str``, ``shape``), ``info(name)`` and ``read(name)``: a Checkpoint
restricted to the carried tensors (``CarriedView``), or a packed directory (``PackedView``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..errors import SourceError
from . import fp8_codec
from .checkpoint import TensorInfo
from .dense import FLOAT_DTYPES, text_config
from .int4_common import Int4Format, QModule, check_scales, decode_g_idx, dequantize, expand_groups

_TORCH_TO_ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int8": "I8", "uint8": "U8",
                "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
                "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0"}  # fmt: skip


@dataclass
class CarriedLinear:
    """One quantized Linear outside the experts, as found in the headers (no value read)."""

    prefix: str
    codec: str  # "int4", "int8", "fp8", "mxfp4" or "nvfp4"
    n: int
    k: int
    tensors: dict = field(default_factory=dict)  # role -> tensor name
    fmt: Int4Format | None = None  # int4: the source format's scan/decode
    mod: QModule | None = None
    cfg: dict | None = None
    scale_rule: tuple = ()  # fp8: ("block", bn, bk) | ("tensor",) | ("channel",) | ("group", G)

    @property
    def weight_name(self) -> str:
        return self.mod.main if self.mod is not None else self.tensors["weight"]


class CarriedView:
    """A Checkpoint as seen through the tensors convert carries (``names``)."""

    def __init__(self, ckpt, names):
        self.path, self.config, self._ckpt = ckpt.path, ckpt.config, ckpt
        self.tensors = {n: ckpt.tensors[n] for n in names}

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise SourceError(f"tensor {name!r} is missing from {self.path}")
        return self.tensors[name]

    def read(self, name: str) -> torch.Tensor:
        self.info(name)
        return self._ckpt.read(name)


class PackedView:
    """A packed directory's carried tensors (``moepack.open``'s PackedModel), as a view."""

    def __init__(self, pm):
        self.path, self.config, self._pm = pm.path, pm.config or {}, pm
        self.tensors = {}
        for n, e in pm.manifest["tensors"].items():
            st = _TORCH_TO_ST.get(e["dtype"], e["dtype"])
            self.tensors[n] = TensorInfo(n, pm.path / e["file"], st, tuple(e["shape"]), 0, 0)

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise SourceError(f"tensor {name!r} is missing from {self.path}")
        return self.tensors[name]

    def read(self, name: str) -> torch.Tensor:
        return self._pm.tensor(name)


def _qc(view) -> dict | None:
    qc = text_config(view.config).get("quantization_config") or view.config.get("quantization_config")
    return qc if isinstance(qc, dict) else None


def _method(view) -> str | None:
    qc = _qc(view)
    if qc is None:
        return "gptq" if (view.path / "quantize_config.json").is_file() else None
    return qc.get("quant_method") or qc.get("method")


# --------------------------------------------------------------------------- discovery


def _int4(view, fmt: Int4Format, main_suffix: str, cfg: dict) -> dict[str, CarriedLinear]:
    if not any(n.endswith(main_suffix) for n in view.tensors):
        return {}
    out = {}
    for p, m in fmt.scan(view, cfg).items():
        out[p] = CarriedLinear(p, "int4", m.n, m.k, dict(m.tensors), fmt, m, cfg)
    return out


def _ct_group(qc: dict, prefix: str) -> dict | None:
    """The raw config group whose targets match module ``prefix`` (exact name, "re:" regex, then
    the class "Linear"), as compressed-tensors ranks them; None when no group matches."""
    groups = list((qc.get("config_groups") or {}).values())
    for rank in ("name", "re", "class"):
        for g in groups:
            for t in g.get("targets") or []:
                if (rank == "name" and t == prefix) or (rank == "re" and t.startswith("re:") and _re_match(t[3:], prefix, t)) or (
                    rank == "class" and t == "Linear"
                ):
                    return g
    return None


def _re_match(pattern: str, name: str, target: str):
    try:
        return re.match(pattern, name)
    except re.error as e:
        raise SourceError(f"quantization_config config_groups target {target!r}: not a regular expression ({e}); "
                          "compressed-tensors reads 're:' targets as regexes") from None


def _ct_fp8_rule(name: str, g: dict | None, n: int, k: int) -> tuple:
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


def _ct_mxfp4(view, qc: dict) -> dict[str, CarriedLinear]:
    """The compressed-tensors ``mxfp4-pack-quantized`` Linears: ``weight_packed`` U8 [N, K/2] (two
    e2m1 codes a byte, low nibble first) + ``weight_scale`` e8m0 [N, ceil(K/32)] (FORMATS.md §3.4)."""
    from .mxfp4 import CT_FORMAT

    out = {}
    for name, ti in view.tensors.items():
        if not name.endswith(".weight_packed") or ti.dtype_str != "U8":
            continue
        p = name[: -len(".weight_packed")]
        g = _ct_group(qc, p)
        fmt = (g or {}).get("format") or qc.get("format")
        if fmt == "nvfp4-pack-quantized":  # _nvfp4 finds these
            continue
        if fmt != CT_FORMAT:
            raise SourceError(f"tensor {name!r} is U8 (packed FP4) but its config group's format is {fmt!r}: moepack reads "
                              f"FP4 Linears as {CT_FORMAT!r} or 'nvfp4-pack-quantized'")  # fmt: skip
        if len(ti.shape) != 2:
            raise SourceError(f"tensor {name!r} has shape {list(ti.shape)}: expected a 2-D [N, K/2] weight")
        n, k = ti.shape[0], 2 * ti.shape[1]
        s = f"{p}.weight_scale"
        if s not in view.tensors:
            raise SourceError(f"tensor {name!r} is MXFP4 but {s!r} is missing: MXFP4 codes need their e8m0 scales")
        sti = view.info(s)
        if sti.dtype_str not in ("U8", "F8_E8M0"):
            raise SourceError(f"tensor {s!r} has dtype {sti.dtype_str}: MXFP4 scales are e8m0 bytes (U8)")
        want = (n, -(-k // 32))
        if tuple(sti.shape) != want:
            raise SourceError(f"tensor {s!r} has shape {list(sti.shape)}: expected {list(want)} (one e8m0 scale per 32 K values "
                              f"of {name!r} [N={n}, K/2={k // 2}])")  # fmt: skip
        for extra in (".weight_global_scale", ".weight_zero_point"):
            if p + extra in view.tensors:
                raise SourceError(f"tensor {p + extra!r} is present: MXFP4 has neither a global scale (NVFP4's) nor a zero point")
        out[p] = CarriedLinear(p, "mxfp4", n, k, {"weight": name, "scale": s})
    return out


def _nvfp4(view, fmt: str, qc: dict | None = None) -> dict[str, CarriedLinear]:
    """The NVFP4 Linears (compressed-tensors ``nvfp4-pack-quantized``: U8 ``weight_packed``, F8_E4M3
    ``weight_scale`` [N, K/16], F32 ``weight_global_scale``; ModelOpt: U8 ``weight``, ``weight_scale``,
    ``weight_scale_2``; FORMATS.md §3.5, §6), through the expert reader's header checks."""
    from .nvfp4 import _NAMES, CT_FORMAT, nvfp4_modules

    codes_sfx, glob_sfx, act_sfx = _NAMES[fmt]
    out = {}
    for p, (n, k) in nvfp4_modules(view, fmt).items():
        if qc is not None and ((_ct_group(qc, p) or {}).get("format") or qc.get("format")) != CT_FORMAT:
            continue
        t = {"weight": p + codes_sfx, "scale": p + ".weight_scale", "global": p + glob_sfx}
        if p + act_sfx in view.tensors:
            t["input_scale"] = p + act_sfx
        out[p] = CarriedLinear(p, "nvfp4", n, k, t, cfg={"format": fmt})
    return out


def _compressed_tensors(view, qc: dict) -> dict[str, CarriedLinear]:
    from . import ct_pack_quantized as ctpq

    out = _ct_mxfp4(view, qc)
    if any(((g or {}).get("format") or qc.get("format")) == "nvfp4-pack-quantized" for g in (qc.get("config_groups") or {}).values()):
        out.update(_nvfp4(view, "nvfp4-pack-quantized", qc))
    if out:  # the int4 scan below sees the pack-quantized (I32) Linears only
        view = CarriedView(view, [n for n in view.tensors if n not in {t for lin in out.values() for t in lin.tensors.values()}])
    if any(n.endswith(".weight_packed") for n in view.tensors):
        groups = {gn: g for gn, g in (qc.get("config_groups") or {}).items() if (g.get("format") or qc.get("format")) == ctpq.FORMAT_NAME}
        cfg = {"format": ctpq.FORMAT_NAME, "groups": [ctpq._check_group(gn, g, ctpq.FORMAT_NAME) for gn, g in groups.items()]}
        out.update(_int4(view, ctpq.FORMAT, ".weight_packed", cfg))
    for name, ti in view.tensors.items():
        if not name.endswith(".weight") or ti.dtype_str not in ("I8", *fp8_codec.FP8_DTYPES):
            continue
        p = name[: -len(".weight")]
        s = f"{p}.weight_scale"
        if s not in view.tensors:
            raise SourceError(f"tensor {name!r} is {ti.dtype_str} but {s!r} is missing: a quantized weight needs its scale")
        if len(ti.shape) != 2:
            raise SourceError(f"tensor {name!r} has shape {list(ti.shape)}: expected a 2-D [N, K] weight")
        n, k = ti.shape
        for extra in (".weight_zero_point", ".weight_g_idx"):
            if p + extra in view.tensors:
                raise SourceError(f"tensor {p + extra!r} is present: moepack reads symmetric {ti.dtype_str} weights without act-order")
        sti = view.info(s)
        if sti.dtype_str not in FLOAT_DTYPES:
            raise SourceError(f"tensor {s!r} has dtype {sti.dtype_str}: scales must be BF16, F16 or F32")
        if ti.dtype_str == "I8":
            if tuple(sti.shape) not in ((n, 1), (n,)):
                raise SourceError(f"tensor {s!r} has shape {list(sti.shape)}: expected [{n}, 1] (one scale per output channel of {name!r})")
            out[p] = CarriedLinear(p, "int8", n, k, {"weight": name, "scale": s})
        else:
            rule = _ct_fp8_rule(name, _ct_group(qc, p), n, k)
            want = {"tensor": [(1,), ()], "channel": [(n, 1), (n,)]}.get(rule[0])
            if rule[0] == "block":
                want = [fp8_codec.block_grid(n, k, rule[1:])]
            elif rule[0] == "group":
                want = [(n, -(-k // rule[1]))]
            if tuple(sti.shape) not in want:
                raise SourceError(f"tensor {s!r} has shape {list(sti.shape)}: expected {list(want[0])} ({rule[0]} scales of {name!r} [{n}, {k}])")
            out[p] = CarriedLinear(p, "fp8", n, k, {"weight": name, "scale": s}, scale_rule=rule)
    return out


def _fp8(view, qc: dict) -> dict[str, CarriedLinear]:
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
        p = name[: -len(".weight")]
        s = f"{p}.weight_scale_inv"
        if s not in view.tensors:
            raise SourceError(f"tensor {name!r} is {ti.dtype_str} but {s!r} is missing: every FP8 weight has a scale_inv (FORMATS.md §4)")
        if len(ti.shape) != 2:
            raise SourceError(f"tensor {name!r} has shape {list(ti.shape)}: expected a 2-D [N, K] weight")
        n, k = ti.shape
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


def find_linears(view) -> dict[str, CarriedLinear]:
    """Every quantized Linear among ``view``'s tensors, by module prefix (headers only; a malformed
    one is a SourceError naming the tensor). Empty for float checkpoints."""
    method = _method(view)
    if method in ("gptq", "awq"):
        from . import awq, gptq

        mod = gptq if method == "gptq" else awq
        cfg = mod.config(view)
        return _int4(view, mod.FORMAT, ".qweight", cfg)
    qc = _qc(view) or {}
    if method == "compressed-tensors":
        return _compressed_tensors(view, qc)
    if method == "modelopt" or (view.path / "hf_quant_config.json").is_file():
        return _nvfp4(view, "modelopt")
    if method == "fp8":
        return _fp8(view, qc)
    return {}


def tensor_owner(linears: dict[str, CarriedLinear]) -> dict[str, str]:
    """tensor name -> the prefix of the Linear it belongs to."""
    return {t: p for p, lin in linears.items() for t in lin.tensors.values()}


# --------------------------------------------------------------------------- values


def _int4_values(view, lin: CarriedLinear, dequant: bool = True) -> torch.Tensor | None:
    m = lin.mod
    ql = lin.fmt.decode(view, m, lin.cfg)  # checks scales, zero points (range, symmetry)
    _, g_idx = decode_g_idx(m.tensors.get("g_idx", m.main), lin.fmt.read_g_idx(view, m), m.k, m.group_size, m.ngroups)
    if not dequant:
        return None
    if g_idx is None:
        return dequantize(ql.q, ql.scale, ql.zero, m.group_size)
    g = g_idx.long()
    return (ql.q.float() - ql.zero.float()[:, g]) * ql.scale[:, g]


def _fp8_values(view, lin: CarriedLinear, dequant: bool = True) -> torch.Tensor | None:
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


def _mxfp4_values(view, lin: CarriedLinear, dequant: bool = True) -> torch.Tensor | None:
    from ..schemes.mxfp4.codec import dequantize_mxfp4
    from .mxfp4 import check_e8m0, unpack_e2m1

    sn = lin.tensors["scale"]
    s = check_e8m0(sn, view.read(sn))
    if not dequant:
        return None
    return dequantize_mxfp4(unpack_e2m1(view.read(lin.tensors["weight"])), s)


def _nvfp4_values(view, lin: CarriedLinear, dequant: bool = True) -> torch.Tensor | None:
    from ..schemes.nvfp4.codec import dequantize_nvfp4
    from .nvfp4 import nvfp4_linear

    q, s, g = nvfp4_linear(view, lin.prefix, lin.cfg["format"])  # checks the scales and the global
    return dequantize_nvfp4(q, s, g) if dequant else None


def _values(view, lin: CarriedLinear, dequant: bool) -> torch.Tensor | None:
    if lin.codec == "nvfp4":
        return _nvfp4_values(view, lin, dequant)
    if lin.codec == "mxfp4":
        return _mxfp4_values(view, lin, dequant)
    if lin.codec == "int4":
        return _int4_values(view, lin, dequant)
    if lin.codec == "int8":
        s = check_scales(lin.tensors["scale"], view.read(lin.tensors["scale"]))
        return view.read(lin.tensors["weight"]).float() * s.reshape(-1, 1) if dequant else None
    return _fp8_values(view, lin, dequant)


def dequantize_linear(view, lin: CarriedLinear) -> torch.Tensor:
    """float32 [N, K] of a quantized Linear, through its source's codec; bad values (scales,
    zero points, g_idx, NaN codes) are a SourceError naming the tensor."""
    return _values(view, lin, True)


def check_linear(view, lin: CarriedLinear) -> None:
    """The value checks of ``dequantize_linear``, without the multiplication (convert)."""
    _values(view, lin, False)


def check_carried(ckpt, names) -> dict[str, CarriedLinear]:
    """convert's check of the carried tensors ``names`` of ``ckpt``: every quantized Linear among
    them found and its values validated (SourceError naming the first bad tensor)."""
    view = CarriedView(ckpt, names)
    lins = find_linears(view)
    for lin in lins.values():
        check_linear(view, lin)
    return lins


__all__ = ["CarriedLinear", "CarriedView", "PackedView", "find_linears", "tensor_owner", "dequantize_linear", "check_linear",
           "check_carried"]  # fmt: skip
