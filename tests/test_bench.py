"""The benchmark's plain-read baseline (torch.ops.moepack.read_experts) and the rows that use it.

read_experts reads every byte of the listed experts of two packed tensors; its checksum (the sum
of the bytes as little-endian uint64 words, then the tail bytes, modulo 2**64) proves every byte
was read, and bad input is refused by name. The bench times it right after each moepack call on
the same experts: '% raw read' = how close moepack is to merely reading its weights, measured in
the same run (robust to a noisy machine, unlike a bandwidth probed at another moment).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moepack
from moepack import bench as B

moepack.load_extension()
OPS = torch.ops.moepack


def checksum(t: torch.Tensor, ids) -> int:
    total = 0
    per = t.numel() * t.element_size() // t.shape[0]
    raw = t.contiguous().view(torch.uint8).reshape(t.shape[0], per).numpy()
    for e in ids:
        b = raw[int(e)]
        for off in range(0, per, 65536):  # the op's 64 KiB pieces, each with its own uint8 tail
            piece = b[off : off + 65536]
            n8 = len(piece) // 32 * 32
            total += int(piece[:n8].view("<u8").astype(np.uint64).sum(dtype=np.uint64))
            total += int(piece[n8:].astype(np.uint64).sum())
    return total % 2**64


@pytest.mark.parametrize("shape", [(5, 70001), (3, 64, 33)], ids=["odd-bytes", "3d"])
def test_read_experts_reads_every_byte(shape):
    g = torch.Generator().manual_seed(1)
    w13 = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
    w2 = torch.randint(0, 2**15, (shape[0], 1000), dtype=torch.int16, generator=g)
    ids = torch.tensor([4 if shape[0] > 4 else 2, 0, 1], dtype=torch.int32)
    got = OPS.read_experts(w13, w2, ids) % 2**64
    assert got == (checksum(w13, ids.tolist()) + checksum(w2, ids.tolist())) % 2**64
    assert OPS.read_experts(w13, w2, ids.long()) == OPS.read_experts(w13, w2, ids)
    assert OPS.read_experts(w13, w2, torch.empty(0, dtype=torch.int32)) == 0


def test_read_experts_refuses():
    w13, w2 = torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(IndexError, match=r"ids\[1\] = 4 is out of range \[0, 4\)"):
        OPS.read_experts(w13, w2, torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="same leading expert dimension"):
        OPS.read_experts(w13, torch.zeros(3, 8, dtype=torch.int8), torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D int32 or int64"):
        OPS.read_experts(w13, w2, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="contiguous"):
        OPS.read_experts(w13.t(), w2, torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_bench_rows_carry_the_plain_read_baseline(scheme):
    cfg = B.BenchConfig(shapes=B.parse_shapes("tiny"), tokens=[1, 3], threads=1, scheme=scheme, calls=2, probe=False,
                        skip_torch=True)
    result = B.run_benchmark(cfg)
    for r in result.rows:
        assert r.raw_read_ms is not None and r.raw_read_ms > 0 and r.raw_read_gbs > 0
        assert r.moepack_raw_frac == pytest.approx(r.raw_read_ms / r.moepack_ms)
    md = B.render_markdown(result)
    assert "% raw read" in md
    assert all(f"{100 * r.moepack_raw_frac:.0f}%" in md for r in result.rows)
