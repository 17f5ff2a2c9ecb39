"""AWQ GEMM 4-bit checkpoints (AutoAWQ ``version: "gemm"``, GPTQModel ``format: "gemm"``;
FORMATS.md §2) into int4_group.

Per quantized Linear ``P`` (N outputs, K inputs, group G, ng = ceil(K / G)): ``P.qweight`` int32
[K, N/8], packed along N (the transpose of GPTQ) in the interleaved nibble ORDER
[0, 2, 4, 6, 1, 3, 5, 7]: nibble slot i of word c holds output column 8c + ORDER[i];
``P.qzeros`` int32 [ng, N/8], the same interleave; ``P.scales`` fp16 [ng, N]; ``P.bias``
optional. ``W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]`` with true zero points 0..15
(no +1); groups are contiguous (no g_idx). ``zero_point: false`` (symmetric, no qzeros) reads
as zero 8.

Config ``quantization_config``: quant_method "awq"; bits/w_bit 4; group_size/q_group_size > 0;
version/format "gemm" (the default). gemv, gemv_fast, marlin, llm-awq, exllama, ipex are other
layouts and are refused naming the key and value.
"""

from __future__ import annotations

import torch

from ..errors import SourceError
from .checkpoint import Checkpoint
from .dense import FLOAT_DTYPES
from .linears import LinearFinder, register_linears
from .int4_common import int4_linears, int4_values, Int4Format, Int4Reader, QLinear, QModule, check_dtype, check_scales, check_shape, quantization_config, unpack_nibbles
from .gptq import synonym

NAME = "awq"
SOURCE_NOTE = "AWQ GEMM 4-bit (int4 codes with group scales and zero points, 16-bit activations)"
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # slot i holds column 8c + ORDER[i]
INV = [ORDER.index(j) for j in range(8)]  # column 8c + j sits in slot INV[j] = [0, 4, 1, 5, 2, 6, 3, 7]


def config(ckpt: Checkpoint) -> dict:
    qc = quantization_config(ckpt)
    if qc is None:
        return _refuse("no quantization_config")
    where = "quantization_config"
    method = qc.get("quant_method") or qc.get("method")
    if method != "awq":
        return _refuse(f"quant_method={method!r}, not 'awq'")
    kb, bits = synonym(qc, where, "bits", "w_bit")
    if bits != 4:
        return _refuse(f"{where}.{kb}={bits!r}: AWQ GEMM is 4-bit")
    kv, ver = synonym(qc, where, "version", "format")
    ver = "gemm" if ver is None else str(ver).lower()
    if ver != "gemm":
        return _refuse(f"{where}.{kv}={ver!r}: moepack reads the AWQ 'gemm' layout only (gemv, gemv_fast, marlin, llm-awq, exllama, ipex are other layouts)")
    kg, g = synonym(qc, where, "group_size", "q_group_size")
    if g is None:
        g = 128  # AutoAWQ's default
    if not isinstance(g, int) or isinstance(g, bool) or g <= 0:
        return _refuse(f"{where}.{kg}={g!r}: an AWQ GEMM group size is a positive integer (scales are [K/G, N])")
    zp = qc.get("zero_point", True)
    if not isinstance(zp, bool):
        return _refuse(f"{where}.zero_point={zp!r}: must be true or false")
    return {"format": "awq", "group_size": g, "sym": not zp, "where": where}


def _refuse(why: str):
    raise SourceError(why)


_I32 = "AWQ packs codes and zero points in I32 words"


def scan(ckpt: Checkpoint, cfg: dict) -> dict[str, QModule]:
    mods = {}
    for name in ckpt.tensors:
        if not name.endswith(".qweight"):
            continue
        p = name[: -len(".qweight")]
        t = {"qweight": name, "scales": f"{p}.scales"}
        if f"{p}.qzeros" in ckpt.tensors:
            t["qzeros"] = f"{p}.qzeros"
        if t["scales"] not in ckpt.tensors:
            raise SourceError(f"tensor {name!r} has no {t['scales']!r}: an AWQ Linear needs qweight, scales (and qzeros)")
        if cfg["sym"] == ("qzeros" in t):
            raise SourceError(
                f"tensor {p + '.qzeros'!r} is {'present' if cfg['sym'] else 'missing'} but quantization_config.zero_point="
                f"{str(not cfg['sym']).lower()}: zero points are stored exactly when zero_point is true"
            )
        if f"{p}.g_idx" in ckpt.tensors:
            raise SourceError(f"tensor {p + '.g_idx'!r} is present: AWQ GEMM has no act-order (is this GPTQ?)")
        qw = check_dtype(ckpt, name, {"I32"}, _I32)
        if len(qw.shape) != 2:
            raise SourceError(f"tensor {name!r} has shape {list(qw.shape)}: expected 2-D [K, N/8]")
        k, cols = qw.shape
        sc = check_dtype(ckpt, t["scales"], FLOAT_DTYPES, "scales must be F16, BF16 or F32")
        m = QModule(p, cols * 8, k, cfg["group_size"], name, t, sc.dtype_str, cfg["sym"])
        if len(sc.shape) == 2 and sc.shape[1] != cols * 8:
            raise SourceError(
                f"tensor {t['scales']!r} has N={sc.shape[1]} columns but {name!r} holds {cols} words of 8: AWQ packs along N, "
                "so N must be a multiple of 8 and equal 8 * qweight columns"
            )
        why = f"ceil(K={k} / group_size={cfg['group_size']}) groups"
        check_shape(ckpt, t["scales"], (m.ngroups, m.n), why)
        if "qzeros" in t:
            check_dtype(ckpt, t["qzeros"], {"I32"}, _I32)
            check_shape(ckpt, t["qzeros"], (m.ngroups, cols), why + ", N/8 words")
        mods[p] = m
    if not mods:
        raise SourceError(f"source {ckpt.path}: an AWQ config but no '*.qweight' tensors")
    return mods


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C] in column order (the interleave undone)."""
    slots = unpack_nibbles(words).unflatten(-1, (-1, 8))  # [R, C, slot]
    return slots[..., INV].flatten(-2)


def read_g_idx(ckpt: Checkpoint, m: QModule):
    return None


def decode(ckpt: Checkpoint, m: QModule, cfg: dict) -> QLinear:
    q = unpack_awq(ckpt.read(m.tensors["qweight"])).t().contiguous()  # [N, K]
    if "qzeros" in m.tensors:
        zero = unpack_awq(ckpt.read(m.tensors["qzeros"])).t().contiguous()  # nibbles: 0..15 by construction
    else:
        zero = torch.full((m.n, m.ngroups), 8, dtype=torch.uint8)
    scale = check_scales(m.tensors["scales"], ckpt.read(m.tensors["scales"])).t().contiguous()
    return QLinear(q, scale, zero, None, None)


FORMAT = Int4Format(NAME, SOURCE_NOTE, config, scan, decode, read_g_idx, "qweight/qzeros/scales, AWQ GEMM")
READER = Int4Reader(FORMAT)
SCHEME = READER.scheme

__all__ = ["NAME", "SOURCE_NOTE", "SCHEME", "FORMAT", "READER", "ORDER", "INV", "unpack_awq", "config"]

# the quantized Linears outside the experts (attention, dense MLPs) that convert carries
register_linears("int4", int4_values, LinearFinder(("awq",), lambda view, qc: int4_linears(view, FORMAT, ".qweight", config(view))))
