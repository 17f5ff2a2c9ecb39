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

Formats register themselves (``register_linears``): each reader module declares the codec of
its Linears (``values``: the value checks and dequantization) and the finders of the
``quant_method`` values it reads (``LinearFinder``), so this module names no format. A finder sees
the view less the tensors the finders of the same method before it claimed (compressed-tensors:
mxfp4, nvfp4, pack-quantized int4, then int8 and FP8 weights). Where each lives (docs/FORMATS.md):

* ``gptq`` / ``awq`` / compressed-tensors ``pack-quantized`` (§1-§3): int4_common.py's
  ``int4_linears`` and ``int4_values``, registered by gptq.py, awq.py, ct_pack_quantized.py;
  ``W[n, k] = (q[n, k] - zero[n, g(k)]) * scale[n, g(k)]`` with g = g_idx (act-order) or k // G.
* compressed-tensors int-quantized (int8 ``weight`` + ``weight_scale [N, 1]``): compressed_tensors.py.
* compressed-tensors float-quantized and ``fp8`` (§3, §4: DeepSeek / Qwen FP8 ``weight_scale_inv``
  ``[ceil(N/bn), ceil(K/bk)]``): fp8.py.
* compressed-tensors ``mxfp4-pack-quantized`` (U8 ``weight_packed`` + e8m0 ``weight_scale``,
  ``W = e2m1(q) * 2^(e - 127)``, e = 255 refused): mxfp4.py. gpt-oss ``mxfp4`` (§5) quantizes only
  the experts, so there is nothing to find.
* compressed-tensors ``nvfp4-pack-quantized`` and ModelOpt NVFP4: nvfp4.py.

A view is anything with ``path``, ``config`` (config.json as a dict), ``tensors`` (name ->
TensorInfo-like: ``dtype_str``, ``shape``), ``info(name)`` and ``read(name)``: a Checkpoint
restricted to the carried tensors (``CarriedView``), or a packed directory (``PackedView``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import SourceError
from .checkpoint import TensorInfo
from .dense import FLOAT_DTYPES, text_config

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
    fmt: object = None  # int4: the source format's scan/decode (int4_common.Int4Format)
    mod: object = None  # int4: its int4_common.QModule
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


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class LinearFinder:
    """Finds the quantized Linears of the ``quant_method`` values in ``methods`` ("modelopt" also
    for a checkpoint with an hf_quant_config.json): ``find(view, quantization_config dict) ->
    {prefix: CarriedLinear}`` (headers only; a malformed one is a SourceError naming the tensor).
    Among one method's finders the lower ``order`` runs first; ``ct_formats``: the
    compressed-tensors formats it reads."""

    methods: tuple[str, ...]
    find: Callable
    order: int = 0
    ct_formats: tuple[str, ...] = ()


_FINDERS: list[LinearFinder] = []
_VALUES: dict[str, Callable] = {}


def register_linears(codec: str | None, values: Callable | None, *finders: LinearFinder) -> None:
    """A reader module's Linears: ``values(view, lin, dequant) -> fp32 [N, K] or None`` for the
    Linears of ``codec`` (the value checks, then the dequantization when ``dequant``), and the
    finders that produce them (a module may register finders for a codec another registered)."""
    if codec is not None:
        if codec in _VALUES and _VALUES[codec] is not values:
            raise ValueError(f"carried-Linear codec {codec!r} registered twice")
        _VALUES[codec] = values
    _FINDERS.extend(finders)


def ct_formats() -> tuple[str, ...]:
    """The compressed-tensors formats whose Linears a registered finder reads."""
    return tuple(f for x in _FINDERS for f in x.ct_formats)


def ct_group(qc: dict, prefix: str) -> dict | None:
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


def ct_group_format(qc: dict, prefix: str):
    """The compressed-tensors format of module ``prefix``: its config group's, else the config's."""
    return (ct_group(qc, prefix) or {}).get("format") or qc.get("format")


def _re_match(pattern: str, name: str, target: str):
    try:
        return re.match(pattern, name)
    except re.error as e:
        raise SourceError(f"quantization_config config_groups target {target!r}: not a regular expression ({e}); "
                          "compressed-tensors reads 're:' targets as regexes") from None


def weight_and_scale(view, name: str, ti, scale_suffix: str = ".weight_scale", why: str = "a quantized weight needs its scale"):
    """(prefix, scale name, N, K) of a 2-D quantized ``weight`` whose scale must be present (the
    checks every per-tensor-scaled Linear shares; a SourceError naming the tensor otherwise)."""
    p = name[: -len(".weight")]
    s = p + scale_suffix
    if s not in view.tensors:
        raise SourceError(f"tensor {name!r} is {ti.dtype_str} but {s!r} is missing: {why}")
    if len(ti.shape) != 2:
        raise SourceError(f"tensor {name!r} has shape {list(ti.shape)}: expected a 2-D [N, K] weight")
    return p, s, ti.shape[0], ti.shape[1]


def find_linears(view) -> dict[str, CarriedLinear]:
    """Every quantized Linear among ``view``'s tensors, by module prefix (headers only; a malformed
    one is a SourceError naming the tensor). Empty for float checkpoints."""
    method = _method(view)
    if method not in ("gptq", "awq", "compressed-tensors") and (view.path / "hf_quant_config.json").is_file():
        method = "modelopt"
    qc = _qc(view) or {}
    out: dict[str, CarriedLinear] = {}
    rest = view
    for f in sorted((f for f in _FINDERS if method in f.methods), key=lambda f: f.order):
        found = f.find(rest, qc)
        if found:
            out.update(found)
            claimed = {t for lin in found.values() for t in lin.tensors.values()}
            rest = CarriedView(rest, [n for n in rest.tensors if n not in claimed])
    return out


def tensor_owner(linears: dict[str, CarriedLinear]) -> dict[str, str]:
    """tensor name -> the prefix of the Linear it belongs to."""
    return {t: p for p, lin in linears.items() for t in lin.tensors.values()}


# --------------------------------------------------------------------------- values


def _values(view, lin: CarriedLinear, dequant: bool) -> torch.Tensor | None:
    if lin.codec not in _VALUES:
        raise SourceError(f"Linear {lin.prefix!r}: codec {lin.codec!r} has no registered reader")
    return _VALUES[lin.codec](view, lin, dequant)


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


__all__ = ["CarriedLinear", "CarriedView", "PackedView", "LinearFinder", "register_linears", "ct_group", "ct_group_format",
           "ct_formats", "weight_and_scale", "find_linears", "tensor_owner", "dequantize_linear", "check_linear",
           "check_carried"]  # fmt: skip
