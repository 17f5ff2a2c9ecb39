"""Exact FP8 decode and the value checks of FP8 weights (docs/FORMATS.md §4), shared by whoever
reads FP8 tensors: the non-expert Linears convert carries and load_model dequantizes
(moepack/sources/linears.py), and any FP8 expert reader.

* ``decode_fp8(codes)``: float32 values of ``float8_e4m3fn`` / ``float8_e5m2`` codes: torch's
  conversion, which is exact (every FP8 value is an fp32 value; NaN codes give NaN;
  tests/schemes/fp8/test_fp8_model.py checks all 256 codes against the bit-level definition), and needs no
  index tensor (a table lookup would allocate 8 bytes of int64 index per weight).
* ``nan_codes(codes)``: the codes that are NaN (e4m3fn: 0x7F / 0xFF; e5m2: exponent 31 with a
  mantissa); ``check_fp8_codes`` refuses the first one naming the tensor and index.
* ``check_block_scales(name, scale, n, k, block)``: a block scale grid must be
  ``[ceil(N/bn), ceil(K/bk)]`` of finite scales > 0 (the rule the experts' scales follow).
* ``dequantize_block(codes, scale, block)``: ``W[n, k] = fp8(codes[n, k]) * scale[n // bn, k // bk]``
  in float32, one multiplication per weight: exact for bf16/f16 scales (an fp8 value has <= 4
  significant bits, so the product has <= 15), rounded once (to nearest) for f32 scales, so any
  implementation that multiplies the two in float32 gets the same bits.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..errors import SourceError
from .int4_common import check_scales

FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@lru_cache(maxsize=None)
def _nan_bytes(dtype: torch.dtype) -> tuple[int, ...]:
    lut = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return tuple(int(i) for i in torch.isnan(lut).nonzero().flatten())


def decode_fp8(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of an FP8 tensor (any shape), exact."""
    if codes.dtype not in FP8_DTYPES.values():
        raise SourceError(f"decode_fp8: dtype {codes.dtype} is not an FP8 dtype ({', '.join(map(str, FP8_DTYPES.values()))})")
    return codes.to(torch.float32)


def nan_codes(codes: torch.Tensor) -> torch.Tensor:
    """Bool mask of the NaN codes of an FP8 tensor (e4m3fn: 0x7F, 0xFF)."""
    b = codes.view(torch.uint8)
    bad = torch.zeros(b.shape, dtype=torch.bool)
    for x in _nan_bytes(codes.dtype):
        bad |= b == x
    return bad


E4M3_LARGEST = 448.0  # float8 e4m3fn's largest finite code: a scale times it must stay finite (check_scales)


def check_fp8_codes(name: str, codes: torch.Tensor) -> torch.Tensor:
    """``codes`` as their uint8 bit patterns, or a SourceError naming the first NaN code (every FP8
    reader's check: the carried Linears' and the experts', moepack/sources/fp8.py)."""
    bad = nan_codes(codes)
    if bool(bad.any()):
        idx = [int(i) for i in bad.nonzero()[0]]
        byte = int(codes.view(torch.uint8)[tuple(idx)])
        what = "an e4m3fn NaN code (0x7F / 0xFF)" if codes.dtype == torch.float8_e4m3fn else f"a NaN {codes.dtype} code"
        raise SourceError(f"tensor {name!r}{idx} = 0x{byte:02X}: {what}; FP8 weights must be finite")
    return codes.view(torch.uint8)


def block_grid(n: int, k: int, block) -> tuple[int, int]:
    return math.ceil(n / block[0]), math.ceil(k / block[1])


def check_block_scales(name: str, scale: torch.Tensor, n: int, k: int, block) -> torch.Tensor:
    """``scale`` as float32 after the shape and value checks (SourceError naming the tensor)."""
    want = block_grid(n, k, block)
    if tuple(scale.shape) != want:
        raise SourceError(f"tensor {name!r} has shape {list(scale.shape)}: expected {list(want)} "
                          f"(ceil(N={n} / {block[0]}), ceil(K={k} / {block[1]}) blocks)")  # fmt: skip
    return check_scales(name, scale, E4M3_LARGEST, "e4m3fn's largest code")


def dequantize_block(codes: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float32 ``[N, K]`` of block-scaled FP8 ``codes [N, K]`` with ``scale [ceil(N/bn), ceil(K/bk)]``;
    one fp32 ``[N, K]`` allocation (the scales are applied in place, block row by block row)."""
    n, k = codes.shape
    bn, bk = block
    v = decode_fp8(codes)
    s = scale.float()
    full = k // bk
    for i in range(s.shape[0]):
        rows = v[i * bn : (i + 1) * bn]
        if full:
            rows[:, : full * bk].unflatten(-1, (full, bk)).mul_(s[i, :full, None])
        if k % bk:
            rows[:, full * bk :].mul_(s[i, full])
    return v


__all__ = ["FP8_DTYPES", "E4M3_LARGEST", "decode_fp8", "nan_codes", "check_fp8_codes", "block_grid", "check_block_scales", "dequantize_block"]
