"""compressed-tensors ``pack-quantized`` 4-bit checkpoints (W4A16, W4A16_ASYM, and the weights of
W4A8; FORMATS.md §3.1, §3.5) into int4_group. The ``int-quantized`` W8A8 reader is
compressed_tensors.py; the two detect() never accept the same config.

Per quantized Linear ``P`` (N outputs, K inputs, group G, ng = ceil(K / G), 1 per channel):
``P.weight_packed`` int32 [N, ceil(K/8)], offset-binary codes u = q + 8 packed along K (element
k in word k // 8, bits 4(k % 8).., LSB-first); ``P.weight_shape`` int [2] = [N, K];
``P.weight_scale`` [N, ng] in the model dtype; asymmetric: ``P.weight_zero_point`` int32
[ceil(N/8), ng], the signed zero point + 8 packed along N (dim 0); legacy act-order
(``actorder: "group"``): ``P.weight_g_idx`` int32 [K]. ``W[n, k] = (u - 8 - zp) * s`` =
``(u - zero) * s`` in moepack's unsigned form: canonical q = u, zero = zp + 8 (symmetric: 8).
"""

from __future__ import annotations

import re

import torch

from ..errors import SourceError
from .checkpoint import Checkpoint
from .compressed_tensors import config_groups, ct_strategy
from .dense import FLOAT_DTYPES
from .linears import LinearFinder, register_linears
from .int4_common import int4_linears, int4_values, Int4Format, Int4Reader, QLinear, QModule, check_dtype, check_scales, check_shape, quantization_config, unpack_nibbles

NAME = "compressed-tensors-pack-quantized"
SOURCE_NOTE = "compressed-tensors pack-quantized 4-bit (int4 codes with group or channel scales, optional zero points)"
FORMAT_NAME = "pack-quantized"


def _check_group(gname: str, g: dict, fmt) -> dict:
    """The group's int4 facts, or a SourceError saying why moepack does not read it."""
    where = f"config group {gname!r}"
    if fmt != FORMAT_NAME:
        raise SourceError(f"{where} has format {fmt!r}: this reader reads {FORMAT_NAME!r} (int-quantized is the int8 reader's)")
    w = g.get("weights") or {}
    bits, typ, strat = w.get("num_bits"), w.get("type"), ct_strategy(w)
    if typ != "int":
        raise SourceError(f"{where} weights type={typ!r}: pack-quantized weights are int")
    if bits == 8:
        raise SourceError(f"{where} weights num_bits=8: 8-bit weights with 16-bit activations (W8A16) are not supported yet")
    if bits != 4:
        raise SourceError(f"{where} weights num_bits={bits!r}: moepack reads 4-bit pack-quantized weights only")
    if strat not in ("group", "channel"):
        raise SourceError(f"{where} weights strategy={strat!r}: moepack's int4 scheme has group or per-channel scales")
    gs = w.get("group_size")
    if strat == "group":
        if not isinstance(gs, int) or isinstance(gs, bool) or gs <= 0:
            raise SourceError(f"{where} weights group_size={gs!r}: strategy 'group' needs a positive group size")
    else:
        if gs not in (None, -1):
            raise SourceError(f"{where} weights group_size={gs!r} with strategy 'channel': expected none or -1")
        gs = -1
    if w.get("dynamic") not in (False, None):
        raise SourceError(f"{where} has dynamic weights: weights must be stored quantized")
    if w.get("block_structure"):
        raise SourceError(f"{where} weights have block_structure={w['block_structure']!r}: not an int4 group layout")
    a = g.get("input_activations")
    if a:
        got = (a.get("num_bits"), ct_strategy(a), a.get("dynamic"))
        if got[0] != 8 or got[1] != "token" or got[2] is not True:
            raise SourceError(
                f"{where} input_activations={a}: moepack runs int4 weights with 16-bit activations or dynamic per-token "
                "8-bit ones (W4A8) only (static activation scales are not supported)"
            )
    if g.get("output_activations"):
        raise SourceError(f"{where} quantizes output activations: not supported")
    return {
        "group_size": gs,
        "sym": bool(w.get("symmetric", True)),
        "actorder": w.get("actorder"),
        "targets": list(g.get("targets") or []),
        "input_activations": dict(a) if a else None,
        "name": gname,
    }


def config(ckpt: Checkpoint) -> dict:
    qc = quantization_config(ckpt)
    if qc is None:
        raise SourceError("no quantization_config")
    if qc.get("quant_method") != "compressed-tensors":
        raise SourceError(f"quant_method={qc.get('quant_method')!r}, not 'compressed-tensors'")
    groups = config_groups(qc)
    parsed = [_check_group(n, g, g.get("format") or qc.get("format")) for n, g in groups.items()]
    return {"format": FORMAT_NAME, "groups": parsed}


def _group_of(cfg: dict, prefix: str) -> dict:
    """The config group whose targets match module ``prefix`` (exact name, then "re:" regex,
    then the class name "Linear", as compressed-tensors' match_name ranks them)."""
    gs = cfg["groups"]
    for rank in ("name", "re", "class"):
        for g in gs:
            for t in g["targets"]:
                if (rank == "name" and t == prefix) or (rank == "re" and t.startswith("re:") and re.match(t[3:], prefix)) or (
                    rank == "class" and t == "Linear"
                ):
                    return g
    raise SourceError(f"tensor {prefix + '.weight_packed'!r}: its module matches no config group's targets")


_I32 = "pack-quantized codes and zero points are packed in I32 words"


def scan(ckpt: Checkpoint, cfg: dict) -> dict[str, QModule]:
    mods = {}
    for name in ckpt.tensors:
        if not name.endswith(".weight_packed"):
            continue
        p = name[: -len(".weight_packed")]
        g = _group_of(cfg, p)
        t = {"weight_packed": name, "weight_shape": f"{p}.weight_shape", "weight_scale": f"{p}.weight_scale"}
        if not g["sym"]:
            t["weight_zero_point"] = f"{p}.weight_zero_point"
        for role in t:
            if t[role] not in ckpt.tensors:
                raise SourceError(f"tensor {name!r} has no {t[role]!r} (config group {g['name']!r}, symmetric={g['sym']})")
        if g["sym"] and f"{p}.weight_zero_point" in ckpt.tensors:
            raise SourceError(f"tensor {p + '.weight_zero_point'!r} is present but config group {g['name']!r} is symmetric")
        if f"{p}.weight_g_idx" in ckpt.tensors:
            t["g_idx"] = f"{p}.weight_g_idx"
        wp = check_dtype(ckpt, name, {"I32"}, _I32)
        ws = check_dtype(ckpt, t["weight_shape"], {"I32", "I64"}, "weight_shape is an integer [N, K]")
        if tuple(ws.shape) != (2,):
            raise SourceError(f"tensor {t['weight_shape']!r} has shape {list(ws.shape)}: expected [2] ([N, K])")
        n, k = (int(v) for v in ckpt.read(t["weight_shape"]))
        if n <= 0 or k <= 0:
            raise SourceError(f"tensor {t['weight_shape']!r} = {[n, k]}: expected positive [N, K]")
        check_shape(ckpt, name, (n, -(-k // 8)), f"weight_shape [N={n}, K={k}]: ceil(K / 8) words per row")
        sc = check_dtype(ckpt, t["weight_scale"], FLOAT_DTYPES, "scales must be BF16, F16 or F32")
        m = QModule(p, n, k, g["group_size"], name, t, sc.dtype_str, g["sym"])
        why = f"ceil(K={k} / group_size={g['group_size']}) groups" if g["group_size"] != -1 else "strategy channel: one group"
        check_shape(ckpt, t["weight_scale"], (n, m.ngroups), why)
        if not g["sym"]:
            check_dtype(ckpt, t["weight_zero_point"], {"I32"}, _I32)
            check_shape(ckpt, t["weight_zero_point"], (-(-n // 8), m.ngroups), why + ", packed along N: ceil(N / 8) words")
        if "g_idx" in t:
            check_dtype(ckpt, t["g_idx"], {"I32", "I64"}, "g_idx must be an integer tensor")
        m.input_activations = g["input_activations"]
        mods[p] = m
    if not mods:
        raise SourceError(f"source {ckpt.path}: a pack-quantized config but no '*.weight_packed' tensors")
    acts = {repr(m.input_activations) for m in mods.values()}
    if len(acts) > 1:
        raise SourceError(f"config groups quantize activations differently ({sorted(acts)}): one activation mode per checkpoint")
    cfg["input_activations"] = next(iter(mods.values())).input_activations
    return mods


def read_g_idx(ckpt: Checkpoint, m: QModule):
    if "g_idx" not in m.tensors:
        return None
    g = ckpt.read(m.tensors["g_idx"])
    if bool((g == -1).all()):
        return None  # the legacy initial value: column order
    return g


def decode(ckpt: Checkpoint, m: QModule, cfg: dict) -> QLinear:
    q = unpack_nibbles(ckpt.read(m.tensors["weight_packed"]))[:, : m.k].contiguous()  # u = q + 8 = canonical code
    if not m.sym:
        zero = unpack_nibbles(ckpt.read(m.tensors["weight_zero_point"]).t())[:, : m.n].t().contiguous()  # zp + 8
    else:
        zero = torch.full((m.n, m.ngroups), 8, dtype=torch.uint8)
    scale = check_scales(m.tensors["weight_scale"], ckpt.read(m.tensors["weight_scale"]))
    return QLinear(q, scale.contiguous(), zero, None, None)


FORMAT = Int4Format(NAME, SOURCE_NOTE, config, scan, decode, read_g_idx, "pack-quantized 4-bit")
READER = Int4Reader(FORMAT)
SCHEME = READER.scheme

__all__ = ["NAME", "SOURCE_NOTE", "SCHEME", "FORMAT", "READER", "config"]


def _linears(view, qc: dict) -> dict:
    """The pack-quantized (I32 ``weight_packed``) Linears, in their config groups' words."""
    if not any(n.endswith(".weight_packed") for n in view.tensors):
        return {}
    groups = {gn: g for gn, g in (qc.get("config_groups") or {}).items() if (g.get("format") or qc.get("format")) == FORMAT_NAME}
    cfg = {"format": FORMAT_NAME, "groups": [_check_group(gn, g, FORMAT_NAME) for gn, g in groups.items()]}
    return int4_linears(view, FORMAT, ".weight_packed", cfg)


# after the FP4 finders (their U8 weight_packed claimed), before int8 / FP8 weights
register_linears("int4", int4_values, LinearFinder(("compressed-tensors",), _linears, order=2, ct_formats=(FORMAT_NAME,)))
