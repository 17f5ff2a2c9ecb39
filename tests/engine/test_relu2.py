"""Non-gated relu2 experts (Nemotron-H's NemotronHExperts: up -> relu(x)^2 -> down, no gate).

w13 holds the up rows alone ([E, I, H], packed [E, Ip, Kp]); the driver runs one block per stage-1
task and each level's activation on it (csrc/kernels/fused_moe_driver.inc). The scalar kernel
against the torch reference (moepack.reference, relu2 written from its definition), every SIMD
level against the scalar one, the reference against transformers' own NemotronHExperts, and the
op's refusals. The kernel matrix of tests/support/kernel_cases.py builds gated experts only.
"""

from __future__ import annotations

import pytest
import torch

import moepack
from moepack.errors import LayoutError
from moepack.pack import PackedExperts, pack_w2, pack_w13
from moepack.reference import moe_reference
from tests.conftest import isa_cap
from tests.reference.tolerances import TOL, assert_close

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LAYOUT = moepack.layout_get(moepack.DEFAULT_LAYOUT)


def _inputs(t: int, h: int, i: int, e: int, k: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # bf16-valued weights, h ~ N(0, 1.5^2): about half the pre-activations are negative (relu's flat side)
    w1 = (torch.randn(e, i, h, generator=g) * 1.5 / h**0.5).to(BF16)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(BF16)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, k, generator=g) * 0.95 + 0.05
    return x, w1, w2, w, ids


def _packed(w1, w2) -> PackedExperts:
    up, down = pack_w13(w1, layout=LAYOUT, gated=False), pack_w2(w2, layout=LAYOUT)
    e, i, h = w1.shape
    return PackedExperts(LAYOUT, e, h, i, down.shape[-1], False, {"w13": up, "w2": down}, gated=False)


def _run(p: PackedExperts, x, w, ids, **kw):
    return moepack.fused_experts(x, p.weight("w13"), p.weight("w2"), w, ids, layout=p.layout, interleaved=False,
                                 activation="relu2", **kw)  # fmt: skip


CASES = [(t, h, i, dt) for t in (1, 5, 70) for (h, i) in ((200, 88), (93, 40)) for dt in (F32, BF16, F16)]


@pytest.mark.parametrize("t,h,i,dtype", CASES)
def test_scalar_relu2_matches_reference(t, h, i, dtype):
    x, w1, w2, w, ids = _inputs(t, h, i, 5, 2, dtype, seed=t + h)
    p = _packed(w1, w2)
    assert tuple(p.w13.shape) == (5, p.padded_intermediate, h + h % 2)  # Ip rows: no gate half
    with isa_cap("scalar"):
        out = _run(p, x, w, ids)
    ref = moe_reference(x, w1, w2, w, ids, activation="relu2")
    assert_close(out, ref, TOL["scalar_vs_reference", dtype], f"relu2 T={t} H={h} I={i}")


@pytest.mark.parametrize("t,h,i,dtype", CASES)
def test_simd_relu2_matches_scalar(simd_isa, t, h, i, dtype):
    x, w1, w2, w, ids = _inputs(t, h, i, 5, 2, dtype, seed=t + h)
    p = _packed(w1, w2)
    with isa_cap("scalar"):
        want = _run(p, x, w, ids)
    assert_close(_run(p, x, w, ids), want, TOL["simd_vs_scalar", dtype], f"{simd_isa} relu2 T={t} H={h} I={i}")


def test_relu2_reference_is_transformers_nemotron_h_experts():
    """moepack.reference's relu2 layer equals transformers' NemotronHExperts on the same weights."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    x, w1, w2, w, ids = _inputs(9, 64, 32, 4, 2, F32, seed=3)
    cfg = NemotronHConfig(hidden_size=64, n_routed_experts=4, moe_intermediate_size=32, num_experts_per_tok=2)
    ex = NemotronHExperts(cfg).float()
    with torch.no_grad():
        ex.up_proj.copy_(w1.float())
        ex.down_proj.copy_(w2.float())
        want = ex(x, ids.long(), w)
    torch.testing.assert_close(moe_reference(x, w1, w2, w, ids, activation="relu2"), want, rtol=1e-5, atol=1e-6)


def test_relu2_keeps_nan_and_zeroes_negatives():
    """relu(NaN) is NaN (torch.relu's rule, every level): a NaN input row gives a NaN output row and
    leaves the others alone; negative pre-activations contribute nothing."""
    x, w1, w2, w, ids = _inputs(3, 64, 32, 4, 2, F32, seed=5)
    p = _packed(w1, w2)
    x[1, 7] = float("nan")
    out = _run(p, x, w, ids)
    assert bool(torch.isnan(out[1]).all()) and bool(torch.isfinite(out[[0, 2]]).all())
    neg = _packed(-w1.abs(), w2)  # x >= 0 below: every pre-activation <= 0
    assert bool((_run(neg, x[[0, 2]].abs(), w[[0, 2]], ids[[0, 2]]) == 0).all())


def test_relu2_refusals():
    x, w1, w2, w, ids = _inputs(2, 64, 32, 4, 2, F32)
    p = _packed(w1, w2)
    with pytest.raises(ValueError, match=r"relu2.*interleaved=True"):
        moepack.fused_experts(x, p.weight("w13"), p.weight("w2"), w, ids, layout=LAYOUT, interleaved=True, activation="relu2")
    # a gated w13 ([E, 2*Ip]) run as relu2: the w2 it pairs with says Ip, w13's rows say 2*Ip
    with pytest.raises(ValueError, match=r"w2"):
        moepack.fused_experts(x, [pack_w13(torch.cat([w1, w1], 1), layout=LAYOUT)], p.weight("w2"), w, ids, layout=LAYOUT,
                              activation="relu2")  # fmt: skip
    with pytest.raises(LayoutError, match=r"non-gated experts' up rows must be 3-D"):
        pack_w13(w1[0], layout=LAYOUT, gated=False)
    with pytest.raises(LayoutError, match=r"lack tensor|says"):
        PackedExperts(LAYOUT, 4, 64, 32, p.padded_intermediate, False, {"w13": p.w13, "w2": p.w2})  # gated=True: 2*Ip rows
