"""nvfp4 experts: the kernels (csrc/kernels/codec_nvfp4.inc) on every level this host runs.

* one block through each level's real path (``torch.ops.moepack.grouped_block``, whose ``zero``
  argument carries an nvfp4 block's fp32 globals): one-hot rows make C one weight, so every (e2m1
  code, e4m3 scale byte) pair, under divisor (compressed-tensors) and multiplier (ModelOpt) globals,
  equals moepack.schemes.nvfp4.codec's exact weight (A16, fp32 and bf16 rows) and the A8 weight
  2 * e2m1 * (s / 2), bit for bit;
* the fused kernel: scalar against the scheme's reference (A16 and A8, with flips), every SIMD
  level against scalar, both layouts (x86 and arm blockings on the scalar level), shapes that are
  not multiples of 32, biases, swigluoai, a mix of both global conventions in one layer.
"""

from __future__ import annotations

import pytest
import torch

import moepack
from moepack.isa import MODE_ISAS, available_isas
from moepack.layout import NVFP4_LAYOUT, layout_get
from moepack.pack import pack_codes
from moepack.reference import moe_reference
from moepack.schemes.nvfp4 import dequantize_nvfp4, moe_reference_nvfp4, pack_experts_nvfp4, quantize_nvfp4
from moepack.schemes.nvfp4.codec import group_scales
from moepack.schemes.mxfp4 import E2M1_VALUES
from tests.conftest import isa_cap, make_moe_inputs
from tests.reference.tolerances import TOL, assert_close, assert_close_int8

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OPS = torch.ops.moepack
LAY = NVFP4_LAYOUT


def level_isas(mode: str) -> list[str]:
    return [isa for isa in MODE_ISAS[("e2m1", mode)] if isa in available_isas()]


def isas_running(mode: str) -> list[str]:
    out = []
    for isa in available_isas():
        if isa == "scalar":
            continue
        with isa_cap(isa):
            if moepack.kernel_choice(LAY, mode).isa == isa:
                out.append(isa)
    return out


def all_pairs_block(glob: tuple[float, float]):
    """codes [32, 256] (code (n, k) = (k + n) % 16), scale bytes [16, 32] ((32 g + n) % 127: every
    non-negative, non-NaN e4m3 byte), globals [32] alternating glob[0] (> 0) and glob[1] (< 0)."""
    n = torch.arange(32).reshape(-1, 1)
    k = torch.arange(256).reshape(1, -1)
    q = ((k + n) % 16).to(torch.uint8)
    s = ((torch.arange(16).reshape(-1, 1) * 32 + torch.arange(32).reshape(1, -1)) % 127).to(torch.uint8)
    g = torch.tensor([glob[i % 2] for i in range(32)], dtype=torch.float32)
    return q, s, g


def one_hot_run(isa, mode, q, s, g, dtype=F32, rows_per_call=64):
    kp = q.shape[1]
    codes = pack_codes(LAY, q).reshape(-1).contiguous()
    out = []
    for k0 in range(0, kp, rows_per_call):
        m = min(rows_per_call, kp - k0)
        if mode == "a16":
            rows = torch.zeros(m, kp, dtype=dtype)
            rows[torch.arange(m), k0 + torch.arange(m)] = 1
            out.append(OPS.grouped_block(rows, codes, s.contiguous(), g, None, LAY.id, isa, "a16"))
        else:
            rows = torch.zeros(m, kp, dtype=torch.int8)
            rows[torch.arange(m), k0 + torch.arange(m)] = 1
            out.append(OPS.grouped_block(rows, codes, s.contiguous(), g, torch.ones(m), LAY.id, isa, "a8"))
    return torch.cat(out)


@pytest.mark.parametrize("mode", ["a16", "a8"])
@pytest.mark.parametrize("glob", [(3.7, -0.0137), (12345.678, -2.5e-5), (2688.0 / 0.02, -1.0)])
def test_every_pair_exact_on_every_level(mode, glob):
    q, s, g = all_pairs_block(glob)
    sc = group_scales(s.t(), g)  # [32, 16]
    if mode == "a16":
        want = dequantize_nvfp4(q, s.t().contiguous(), g).t()
    else:
        e2 = torch.tensor(E2M1_VALUES).mul(2)[q.long()]
        want = (e2 * (sc * 0.5).repeat_interleave(16, dim=1)).t()
    isas = level_isas(mode)
    assert isas[0] == "scalar"
    for isa in isas:
        runs = ((F32, 64), (BF16, 64), (BF16, 1), (F32, 2)) if mode == "a16" else ((F32, 64),)
        for dt, rpc in runs:
            got = one_hot_run(isa, mode, q, s, g, dt, rpc)
            assert torch.equal(got, want), f"{isa} {mode} {dt} {rpc}: a weight differs"
            # the signs and the subnormals bit for bit (torch.equal takes -0 == +0: C starts at +0)
            nz = want != 0
            assert torch.equal(got[nz].view(torch.int32), want[nz].view(torch.int32)), f"{isa} {mode} {dt} {rpc}: bits differ"


def test_grouped_block_takes_the_globals():
    q, s, g = all_pairs_block((1.0, -1.0))
    codes = pack_codes(LAY, q).reshape(-1).contiguous()
    rows = torch.zeros(1, 256)
    with pytest.raises(ValueError, match="takes its per-column fp32 globals there"):
        OPS.grouped_block(rows, codes, s, None, None, LAY.id, "scalar", "a16")
    with pytest.raises(TypeError, match="zero has dtype Double: must be Float"):
        OPS.grouped_block(rows, codes, s, g.double(), None, LAY.id, "scalar", "a16")


def packed(h, i, e=3, seed=0, interleaved=False, layout=LAY):
    inp = make_moe_inputs(tokens=1, hidden=h, intermediate=i, experts=e, seed=seed)
    q13, s13, g13 = quantize_nvfp4(inp.w13 * 0.3)
    q2, s2, g2 = quantize_nvfp4(inp.w2 * 0.3)
    g13[:, 1::3] = -1.0 / g13[:, 1::3]  # ModelOpt's convention on a third of the rows (the same weights)
    g2[:, ::2] = -1.0 / g2[:, ::2]
    c = dict(w13_q=q13, w13_scale=s13, w13_global=g13, w2_q=q2, w2_scale=s2, w2_global=g2)
    return c, pack_experts_nvfp4(c, interleaved=interleaved, layout=layout)


# dtype, activation, H, I, T, k, bias, seed
FUSED = [(F32, "silu", 64, 48, 1, 2, False, 1), (BF16, "swigluoai", 80, 40, 3, 2, True, 2), (F16, "gelu", 96, 56, 17, 1, True, 3),
         (BF16, "silu", 208, 96, 64, 3, False, 4), (F32, "gelu_tanh", 48, 24, 5, 2, True, 5)]  # fmt: skip


@pytest.mark.parametrize("dtype,act,h,i,t,k,bias,seed", FUSED)
def test_fused_scalar_vs_reference_and_every_level_vs_scalar(dtype, act, h, i, t, k, bias, seed):
    inter = act == "swigluoai"
    c, p = packed(h, i, seed=seed, interleaved=inter)
    inp = make_moe_inputs(tokens=t, hidden=h, intermediate=i, experts=3, topk=k, dtype=dtype, bias=bias, interleaved=inter,
                          seed=seed + 100)  # fmt: skip
    if bias:
        p = pack_experts_nvfp4({**c, "w13_bias": inp.w13_bias, "w2_bias": inp.w2_bias}, interleaved=inter)
    kw = dict(activation=act, interleaved=inter, w13_bias=inp.w13_bias if bias else None, w2_bias=inp.w2_bias if bias else None)
    w13, w2 = dequantize_nvfp4(c["w13_q"], c["w13_scale"], c["w13_global"]), dequantize_nvfp4(c["w2_q"], c["w2_scale"], c["w2_global"])
    ref32 = moe_reference(inp.x.float(), w13, w2, inp.topk_weights, inp.topk_ids, **kw)
    for mode in ("a16", "a8"):
        ref, flip = moe_reference_nvfp4(inp.x, c, inp.topk_weights, inp.topk_ids, act_mode=mode, return_flip=True, **kw)
        with isa_cap("scalar"):
            scalar = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, activation=act, act_mode=mode)
        if mode == "a16":
            assert_close(scalar, ref, TOL["scalar_vs_reference" if dtype == F32 else "half_vs_fp32_pipeline", dtype], "scalar a16")
            assert_close(scalar, ref32, TOL["scalar_vs_reference" if dtype == F32 else "half_vs_fp32_pipeline", dtype], "fp32")
        else:
            assert_close_int8(scalar, ref, TOL["int8_scalar_vs_reference", dtype], flip, "scalar a8")
            assert_close_int8(scalar, ref32, TOL["int8_vs_fp32_dequantized", dtype], 0.0, "a8 vs fp32")
        for isa in isas_running(mode):
            with isa_cap(isa):
                got = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, activation=act, act_mode=mode)
            if mode == "a16":
                assert_close(got, scalar, TOL["simd_vs_scalar", dtype], f"{isa} a16")
            else:
                assert_close_int8(got, scalar, TOL["int8_simd_vs_scalar", dtype], flip, f"{isa} a8")


def test_arm_layout_on_the_scalar_level():
    """nv4g16_n16k8_arm runs everywhere through the scalar kernel: the same numbers as the reference."""
    arm = layout_get("nv4g16_n16k8_arm")
    c, p = packed(72 + 8, 40, seed=9, layout=arm)
    inp = make_moe_inputs(tokens=6, hidden=80, intermediate=40, experts=3, topk=2, seed=19)
    for mode in ("a16", "a8"):
        ref, flip = moe_reference_nvfp4(inp.x, c, inp.topk_weights, inp.topk_ids, act_mode=mode, return_flip=True)
        out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode)
        if mode == "a16":
            assert_close(out, ref, TOL["scalar_vs_reference", F32], "arm a16")
        else:
            assert_close_int8(out, ref, TOL["int8_scalar_vs_reference", F32], flip, "arm a8")


def test_each_mode_runs_on_its_levels():
    assert LAY.act_modes == ("a16", "a8")
    for mode in ("a16", "a8"):
        choice = moepack.kernel_choice(LAY, mode)
        assert not choice.is_fallback, choice.reason
        assert choice.isa == level_isas(mode)[-1], choice.reason


def test_tp_slices_are_exact():
    """A --tp 2 pack's slices (moepack.tp): the per-channel globals follow w13's rows and stay whole
    for w2 like the other channel tensors; unslice gives the pack back byte for byte, and the
    slice experts' outputs add up to the whole layer's."""
    from moepack.tp import tp_slice, tp_unslice

    inp = make_moe_inputs(tokens=5, hidden=96, intermediate=128, experts=3, topk=2, seed=3)
    p = moepack.pack_experts(inp.w13, inp.w2, layout=LAY.name)
    s = tp_slice(p, 2)
    u = tp_unslice(s)
    assert all(torch.equal(u.tensors[k], p.tensors[k]) for k in p.tensors)
    assert s.tensors["w13_global"].shape == (6, 128) and s.tensors["w2_global"].shape == (6, 96)
    for mode in ("a16", "a8"):
        a = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode)
        b = moepack.run_experts(s, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode)
        assert float((a - b).norm() / a.norm()) < (1e-6 if mode == "a16" else 3e-2)
