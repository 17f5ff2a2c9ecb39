"""The arm mxfp4 layout (mx4g32_n16k8_arm, id 18) on these x86 machines: the scheme offers it for
the arm family, packs put codes and e8m0 scales where the layout says, and ARM-target packs of the
fixtures convert and verify here through the scalar level (the NEON kernels themselves are tested
under qemu: tests/engine/test_arm_cross.py, tests/cpp/kt_mx4_arm.inc)."""

from __future__ import annotations

import json

import pytest
import torch

import moepack
from moepack.layout import MXFP4_LAYOUT, layout_code_position, layout_get, layout_padded_i, layout_padded_n
from moepack.schemes import get_scheme
from moepack.schemes.mxfp4 import MXFP4_FROM_FLOAT_TOL, mxfp4_layout_for, moe_reference_mxfp4
from tests.support.fixtures_util import fixture_dir
from tests.reference.tolerances import TOL, assert_close, assert_close_int8
from tests.conftest import make_moe_inputs

ARM = layout_get("mx4g32_n16k8_arm")


def test_the_scheme_offers_the_arm_layout_for_the_arm_family():
    assert ARM.id == 18 and ARM.family == "arm" and ARM.scheme == "mxfp4"
    assert (ARM.block_n, ARM.k_pack, ARM.group_size, ARM.scale_dtype) == (16, 8, 32, "e8m0")
    assert ARM.code_order == MXFP4_LAYOUT.code_order  # nibbles where the u4 layouts put theirs
    assert mxfp4_layout_for(32, "arm") is ARM and mxfp4_layout_for(32, "x86") is MXFP4_LAYOUT
    assert get_scheme("mxfp4").layout_for("arm") is ARM and get_scheme("mxfp4").layout_for("x86") is MXFP4_LAYOUT
    # the same code arrangement as the arm int4 layouts: a 16-byte vector = 4 columns x 8 codes
    u4 = layout_get("u4g32_n16k8_arm")
    for n, k in [(0, 0), (3, 5), (15, 7), (9, 37), (1, 100)]:
        assert layout_code_position(ARM, n, k, 128) == layout_code_position(u4, n, k, 128)


@pytest.mark.parametrize("interleaved", [False, True])
def test_pack_puts_codes_and_scales_where_the_layout_says(interleaved):
    from moepack.pack import pack_codes, unpack_codes
    from moepack.schemes.mxfp4 import pack_experts_mxfp4, quantize_mxfp4

    g = torch.Generator().manual_seed(5)
    E, H, I = 2, 72, 40  # H, I not multiples of 16 or 32: padded rows, a partial last group
    q13, s13 = quantize_mxfp4(torch.randn(E, 2 * I, H, generator=g))
    q2, s2 = quantize_mxfp4(torch.randn(E, H, I, generator=g))
    c = {"w13_q": q13, "w13_scale": s13, "w2_q": q2, "w2_scale": s2}
    p = pack_experts_mxfp4(c, layout=ARM, interleaved=interleaved)
    ip = layout_padded_i(ARM, I)
    for name, q, sc in (("w13", q13, s13), ("w2", q2, s2)):
        codes = unpack_codes(ARM, p.tensors[name])  # [E, Np, Kp]
        k = q.shape[2]
        rows = (torch.arange(2 * I) if interleaved else torch.cat([torch.arange(I), ip + torch.arange(I)])) if name == "w13" else torch.arange(H)
        assert torch.equal(codes[:, rows, :k], q), name
        assert not codes[:, :, k:].any()  # K padding: code 0 = +0
        st = p.tensors[f"{name}_scale"]  # [E, Kp / 32, Np] uint8
        assert st.dtype == torch.uint8 and st.shape == (E, -(-codes.shape[2] // 32), codes.shape[1])
        assert torch.equal(st[:, : sc.shape[2], rows], sc.transpose(1, 2))
    assert p.tensors["w2"].shape[1] == layout_padded_n(ARM, H)
    spec = pack_experts_mxfp4(c, layout=ARM, interleaved=interleaved, use_cpp=False)  # the specification
    assert all(torch.equal(spec.tensors[k], v) for k, v in p.tensors.items())
    # code (n, k) sits where the arm int4 layouts put theirs
    qq = torch.randint(0, 16, (2, 48, 96), generator=g, dtype=torch.uint8)
    assert torch.equal(pack_codes(ARM, qq), pack_codes(layout_get("u4g32_n16k8_arm"), qq))


@pytest.mark.parametrize("mode", ["a16", "a8"])
def test_pack_experts_arm_runs_here_on_scalar_against_the_reference(mode):
    inp = make_moe_inputs(tokens=5, hidden=136, intermediate=40, experts=4, topk=2, dtype=torch.bfloat16, bias=True,
                          interleaved=True, seed=31)  # fmt: skip
    p = moepack.pack_experts(inp.w13, inp.w2, inp.w13_bias, inp.w2_bias, layout=ARM.name, interleaved=True)
    assert p.layout is ARM
    c = get_scheme("mxfp4").from_float(inp.w13, inp.w2, layout=ARM)
    kw = dict(activation="swigluoai", interleaved=True, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias)
    out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode, activation="swigluoai")
    ref, flip = moe_reference_mxfp4(inp.x, c, inp.topk_weights, inp.topk_ids, act_mode=mode, return_flip=True, **kw)
    if mode == "a16":
        assert_close(out, ref, TOL["half_vs_fp32_pipeline", torch.bfloat16], mode)
    else:
        assert_close_int8(out, ref, TOL["int8_scalar_vs_reference", torch.bfloat16], flip, mode)
    # the x86 pack of the same weights computes the same function (another blocking, other kernels)
    px = moepack.pack_experts(inp.w13, inp.w2, inp.w13_bias, inp.w2_bias, layout=MXFP4_LAYOUT.name, interleaved=True)
    outx = moepack.run_experts(px, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode, activation="swigluoai")
    rel = float((out.float() - outx.float()).norm() / outx.float().norm())
    assert rel < 2e-2, rel


@pytest.mark.parametrize("name,mode", [("qwen3_moe", "a16"), ("gpt_oss", "a16"), ("qwen3_moe", "a8")])
def test_arm_target_mxfp4_pack_converts_and_verifies_on_x86(tmp_path, name, mode):
    src, dst = fixture_dir(name), tmp_path / "p"
    moepack.convert(src, dst, layout="bf16_n16k4_arm", quantize="mxfp4", act_mode=mode)
    m = json.loads((dst / "moepack.json").read_text())
    assert {moepack.layout_get(x["layout_id"]).name for x in m["layers"]} == {ARM.name}
    assert all(x["act_mode"] == mode for x in m["layers"])
    report = moepack.verify(dst, source=src)
    assert report.ok, report.failures()
    for x in report.layers:
        assert x.weights_exact and x.rel_err_fp32 < MXFP4_FROM_FLOAT_TOL, x
        if mode == "a16":
            assert x.rel_err <= 1e-5, x
