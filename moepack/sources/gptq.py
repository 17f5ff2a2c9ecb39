"""GPTQ 4-bit checkpoints (AutoGPTQ / GPTQModel / optimum; FORMATS.md §1) into int4_group.

Per quantized Linear ``P`` (N outputs, K inputs, group size G, ng = ceil(K / G), 1 per channel):
``P.qweight`` int32 [K/8, N], codes packed along K (code k of column n in word k // 8, bits
4(k % 8).., LSB-first); ``P.qzeros`` int32 [ng, N/8], zero points packed along N; ``P.scales``
fp16 [ng, N]; ``P.g_idx`` int32 [K] (group of each input channel; non-trivial with desc_act);
``P.bias`` optional. ``W[n, k] = (q[k, n] - Z[g_idx[k], n]) * scales[g_idx[k], n]`` with
``Z = nibble + 1`` for the v1 format (format/checkpoint_format "gptq" or absent: the packer
stored zero - 1; the +1 is taken per nibble in a wide int, no carry, so a stored 15 is a zero
of 16 and refused) and ``Z = nibble`` for "gptq_v2". Symmetric checkpoints (sym=true) must
have every zero point 8 (v1 qzeros 0x77777777).

Config: config.json ``quantization_config`` and/or ``quantize_config.json`` (AutoGPTQ), with
the synonyms bits/w_bit, group_size/q_group_size, format/checkpoint_format; where both files
set a key they must agree. 4-bit only; 8-bit (W8A16), 2/3-bit and the other packings (marlin,
bitblas, gptq_p, qqq, ...) are refused naming the key and value. GPTQModel ``dynamic``
overrides other than module skips ("-:" keys) are refused.
"""

from __future__ import annotations

import json

import torch

from ..errors import SourceError
from .checkpoint import Checkpoint
from .dense import FLOAT_DTYPES
from .linears import LinearFinder, register_linears
from .int4_common import int4_linears, int4_values, Int4Format, Int4Reader, QLinear, QModule, check_dtype, check_scales, check_shape, check_sym, check_zeros, quantization_config, unpack_nibbles

NAME = "gptq"
SOURCE_NOTE = "GPTQ 4-bit (int4 codes with group scales and zero points, 16-bit activations)"
_FORMATS = {"gptq": "gptq", "gptq_v2": "gptq_v2"}
_OTHER_FORMATS = {"marlin", "bitblas", "gptq_p", "qqq", "gguf", "fp8", "exl3", "awq", "ipex", "exllama", "exllamav2"}


def synonym(qc: dict, where: str, *keys):
    """(key, value) of the first of ``keys`` set in ``qc``; two synonyms that disagree are refused."""
    found = [(k, qc[k]) for k in keys if qc.get(k) is not None]
    for k, v in found[1:]:
        if v != found[0][1]:
            raise SourceError(f"{where}: {found[0][0]}={found[0][1]!r} but {k}={v!r}: synonyms must agree")
    return found[0] if found else (keys[0], None)


def _merged_config(ckpt: Checkpoint) -> tuple[dict, str]:
    qc = quantization_config(ckpt)
    side = ckpt.path / "quantize_config.json"
    extra = None
    if side.is_file():
        try:
            extra = json.loads(side.read_text())
        except json.JSONDecodeError as e:
            raise SourceError(f"{side}: not valid JSON ({e})") from None
        if not isinstance(extra, dict):
            raise SourceError(f"{side}: must hold a JSON object")
    if qc is None and extra is None:
        raise SourceError("no quantization_config (config.json) and no quantize_config.json")
    if qc is None:
        return dict(extra), "quantize_config.json"
    if extra is not None:
        method = qc.get("quant_method") or qc.get("method")
        if method == "gptq":
            for keys in (("bits", "w_bit"), ("group_size", "q_group_size"), ("sym",), ("desc_act",), ("format", "checkpoint_format")):
                a = synonym(qc, "config.json quantization_config", *keys)
                b = synonym(extra, "quantize_config.json", *keys)
                if a[1] is not None and b[1] is not None and a[1] != b[1]:
                    raise SourceError(
                        f"config.json quantization_config.{a[0]}={a[1]!r} but quantize_config.json {b[0]}={b[1]!r}: they must agree"
                    )
        merged = {**extra, **qc}
        merged.setdefault("quant_method", "gptq")
        return merged, "quantization_config"
    return dict(qc), "quantization_config"


def config(ckpt: Checkpoint) -> dict:
    qc, where = _merged_config(ckpt)
    method = qc.get("quant_method") or qc.get("method")
    if method is None and where == "quantize_config.json":
        method = "gptq"  # AutoGPTQ's own file
    if method != "gptq":
        raise SourceError(f"quant_method={method!r}, not 'gptq'")
    kb, bits = synonym(qc, where, "bits", "w_bit")
    if bits == 8:
        raise SourceError(f"{where}.{kb}=8: 8-bit GPTQ weights with 16-bit activations: not supported yet (moepack reads 4-bit GPTQ)")
    if bits != 4:
        raise SourceError(f"{where}.{kb}={bits!r}: moepack reads 4-bit GPTQ only (2-, 3- and 8-bit GPTQ are not supported)")
    kf, fmt = synonym(qc, where, "format", "checkpoint_format")
    fmt = "gptq" if fmt is None else str(fmt).lower()
    if fmt not in _FORMATS:
        extra = " (a kernel-specific repacking of GPTQ)" if fmt in _OTHER_FORMATS else ""
        raise SourceError(f"{where}.{kf}={fmt!r}{extra}: moepack reads GPTQ format 'gptq' (v1) or 'gptq_v2'")
    kg, g = synonym(qc, where, "group_size", "q_group_size")
    if g is None:
        g = -1  # AutoGPTQ's default
    if not isinstance(g, int) or isinstance(g, bool) or not (g == -1 or g > 0):
        raise SourceError(f"{where}.{kg}={g!r}: a GPTQ group size is a positive integer or -1 (one group per output channel)")
    sym = qc.get("sym", True)
    if not isinstance(sym, bool):
        raise SourceError(f"{where}.sym={sym!r}: must be true or false")
    dyn = qc.get("dynamic") or {}
    if not isinstance(dyn, dict):
        raise SourceError(f"{where}.dynamic={dyn!r}: must be an object")
    for key in dyn:
        if not str(key).startswith("-:"):
            raise SourceError(
                f"{where}.dynamic[{key!r}]: per-module overrides of the GPTQ parameters are not supported (only '-:' skips)"
            )
    pd = qc.get("pack_dtype", "int32")
    if pd not in ("int32", "torch.int32"):
        raise SourceError(f"{where}.pack_dtype={pd!r}: moepack reads GPTQ packed in int32")
    return {"format": _FORMATS[fmt], "group_size": g, "sym": sym, "desc_act": bool(qc.get("desc_act", False)), "where": where}


_I32 = "GPTQ packs codes and zero points in I32 words"


def scan(ckpt: Checkpoint, cfg: dict) -> dict[str, QModule]:
    mods = {}
    for name in ckpt.tensors:
        if not name.endswith(".qweight"):
            continue
        p = name[: -len(".qweight")]
        t = {"qweight": name, "qzeros": f"{p}.qzeros", "scales": f"{p}.scales"}
        for role in ("qzeros", "scales"):
            if t[role] not in ckpt.tensors:
                raise SourceError(f"tensor {name!r} has no {t[role]!r}: a GPTQ Linear needs qweight, qzeros and scales")
        if f"{p}.g_idx" in ckpt.tensors:
            t["g_idx"] = f"{p}.g_idx"
        qw = check_dtype(ckpt, name, {"I32"}, _I32)
        if len(qw.shape) != 2:
            raise SourceError(f"tensor {name!r} has shape {list(qw.shape)}: expected 2-D [K/8, N]")
        rows, n = qw.shape
        if "g_idx" in t:
            gi = check_dtype(ckpt, t["g_idx"], {"I32", "I64"}, "g_idx must be an integer tensor")
            if len(gi.shape) != 1:
                raise SourceError(f"tensor {t['g_idx']!r} has shape {list(gi.shape)}: expected [K]")
            k = gi.shape[0]
        else:
            k = rows * 8
        if rows != -(-k // 8):
            raise SourceError(f"tensor {name!r} has shape {list(qw.shape)}: expected [{-(-k // 8)}, {n}] (ceil(K={k} / 8) words along K)")
        m = QModule(p, n, k, cfg["group_size"], name, t, sym=cfg["sym"])
        ng = m.ngroups
        sc = check_dtype(ckpt, t["scales"], FLOAT_DTYPES, "scales must be F16, BF16 or F32")
        m.scale_dtype = sc.dtype_str
        why = f"ceil(K={k} / group_size={cfg['group_size']}) groups" if cfg["group_size"] != -1 else "group_size=-1: one group"
        check_shape(ckpt, t["scales"], (ng, n), why)
        check_dtype(ckpt, t["qzeros"], {"I32"}, _I32)
        if n % 8:
            raise SourceError(f"tensor {name!r}: N={n} outputs is not a multiple of 8, which {t['qzeros']!r} packs along N")
        check_shape(ckpt, t["qzeros"], (ng, n // 8), why + ", N/8 words")
        mods[p] = m
    if not mods:
        raise SourceError(f"source {ckpt.path}: a GPTQ config but no '*.qweight' tensors")
    return mods


def read_g_idx(ckpt: Checkpoint, m: QModule) -> torch.Tensor | None:
    return ckpt.read(m.tensors["g_idx"]) if "g_idx" in m.tensors else None


def decode(ckpt: Checkpoint, m: QModule, cfg: dict) -> QLinear:
    q = unpack_nibbles(ckpt.read(m.tensors["qweight"]).t())[:, : m.k].contiguous()  # [N, K]
    z = unpack_nibbles(ckpt.read(m.tensors["qzeros"])).to(torch.int32)  # [ng, N]
    why = ""
    if cfg["format"] == "gptq":
        z = z + 1  # v1 stored zero - 1; per nibble, no carry
        why = " (GPTQ v1 stores zero - 1: a stored 15 is the v1 packer's overflow of a zero of 0 or 16)"
    zero = check_zeros(m.tensors["qzeros"], z, why).t().contiguous()
    if m.sym:
        check_sym(m.tensors["qzeros"], zero)
    scale = check_scales(m.tensors["scales"], ckpt.read(m.tensors["scales"])).t().contiguous()
    return QLinear(q, scale, zero, None, None)


FORMAT = Int4Format(NAME, SOURCE_NOTE, config, scan, decode, read_g_idx, "qweight/qzeros/scales in the quantization_config's format")
READER = Int4Reader(FORMAT)
SCHEME = READER.scheme

__all__ = ["NAME", "SOURCE_NOTE", "SCHEME", "FORMAT", "READER", "config"]

# the quantized Linears outside the experts (attention, dense MLPs) that convert carries
register_linears("int4", int4_values, LinearFinder(("gptq",), lambda view, qc: int4_linears(view, FORMAT, ".qweight", config(view))))
