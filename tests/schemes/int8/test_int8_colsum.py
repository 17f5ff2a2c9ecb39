"""The int8 layout's stored column sums cannot make a result depend on the CPU (issue 29).

Layout i8_n32k4_x86 stores, next to each weight's codes, int32 column sums (``w13_colsum`` /
``w2_colsum``, [E, N]: sum over K of a channel's codes). The VNNI-class kernels feed vpdpbusd's
unsigned operand rows u8 = q + 128 and take 128 * colsum back off; the other levels multiply
signed rows directly. Had a kernel read the stored sums, a pack with edited sums and re-computed
checksums (tests/support/packdir_edit.py) would give level-dependent results until ``moepack verify``
named it. No kernel reads them (docs/KERNELS.md "int8 column sums"): the VNNI kernels find the sums
from the block's codes. Here every level this host runs gives, on a pack whose stored sums are
wrong (extremes included), bitwise the result it gives on the pack as converted; ``verify`` still
names the edited tensor (the format keeps the sums and their rule).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import moepack
from moepack.layout import INT8_LAYOUT
from moepack.pack import pack_weight_reference
from tests.conftest import isa_cap
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import rewrite_tensor
from tests.schemes.int8.test_int8 import int8_isas

OPS = torch.ops.moepack
L = INT8_LAYOUT
I32_MIN, I32_MAX = -(2**31), 2**31 - 1

# Tokens per call, with every token routed to expert 0 (and one other): the experts see chunks of
# 1 (decode streams), 2, 3 (few rows), 5, 6 (one short tile), 8, 9 (a tile and one row), 13 and
# 45 (tiles and a short one) rows: every path of the VNNI kernels and the AMX few-row path.
TOKENS = (1, 2, 3, 5, 6, 8, 9, 13, 45)


def every_level() -> list[str]:
    return ["scalar"] + int8_isas()


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("colsum") / "int8"
    moepack.convert(fixture_dir("qwen3_moe"), d, quantize="int8")
    return d


def _wrong_sums(t: torch.Tensor) -> None:
    """Every stored sum off by a channel-dependent amount, and the int32 extremes."""
    n = t.shape[-1]
    t += (torch.arange(n, dtype=torch.int32) * 977 - 5000).expand_as(t)
    t[0, 0], t[0, 1] = I32_MIN, I32_MAX
    t[-1, n // 2] = 0


def _inputs(layer, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layer.hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.zeros(tokens, dtype=torch.int32), 1 + torch.arange(tokens, dtype=torch.int32) % (layer.num_experts - 1)], 1)
    w = torch.softmax(torch.randn(tokens, 2, generator=g), -1)
    return x, w, ids.contiguous()


def _outputs(d: Path) -> dict[tuple[str, int, int], torch.Tensor]:
    model = moepack.open(d)
    out = {}
    for lv in every_level():
        with isa_cap(lv):
            for index, layer in model.layers.items():
                assert layer.kernel[0] == lv, (lv, layer.kernel)
                for t in TOKENS:
                    out[lv, index, t] = layer.experts(*_inputs(layer, t, 1000 * index + t))
    return out


def test_wrong_stored_column_sums_change_no_level(converted, tmp_path):
    d = tmp_path / "edited"
    shutil.copytree(converted, d)
    model = moepack.open(d)
    names = []
    for index in model.layers:
        entry = next(e for e in model.manifest["layers"] if int(e["index"]) == index)
        names += [entry["tensors"]["w13_colsum"], entry["tensors"]["w2_colsum"]]
    del model
    for name in names:
        rewrite_tensor(d, name, _wrong_sums)  # sha256 kept consistent: only the codes can tell
    edited = moepack.open(d)
    assert all(not torch.equal(edited.tensor(n), moepack.open(converted).tensor(n)) for n in names)
    want, got = _outputs(converted), _outputs(d)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"(level, layer, tokens) whose output the stored column sums changed: {bad}"
    # the format keeps the sums: verify names every edited tensor
    failures = " ".join(moepack.verify(d).failures())
    assert all(f"tensor {n!r}" in failures for n in names) and "column sums must equal it" in failures


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 12, 17, 67])
def test_block_gemm_ignores_the_column_sums_it_is_given(m):
    """torch.ops.moepack.gemm_i8_block (the kernels' integer core) with column sums that are not
    the block's: every level still gives the exact integer products."""
    kp = 200
    g = torch.Generator().manual_seed(m)
    rows = torch.randint(-127, 128, (m, kp), generator=g, dtype=torch.int32).to(torch.int8)  # the quantizer's range
    w = torch.randint(-128, 128, (1, 32, kp), generator=g, dtype=torch.int32).to(torch.int8)
    block = pack_weight_reference(w, L).reshape(-1)
    exact = (rows.long() @ w[0].long().t()).int()
    for colsum in (w[0].int().sum(-1, dtype=torch.int32) + 1, torch.full((32,), I32_MIN, dtype=torch.int32), torch.zeros(32, dtype=torch.int32)):
        for lv in every_level():
            got = OPS.gemm_i8_block(rows, block, colsum.contiguous(), L.id, lv)
            assert got.equal(exact), f"{lv}, m={m}: {int((got != exact).sum())} accumulators depend on the stored sums"
