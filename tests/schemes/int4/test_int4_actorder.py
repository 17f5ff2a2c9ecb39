"""Act-order int4 (GPTQ desc_act, compressed-tensors weight_g_idx) at run time: the packed
``w13_perm`` [E, H] (column j of expert e's w13 codes is input channel w13_perm[e, j]).

* the kernels: every ISA level this host runs, both activation modes, against
  ``moe_reference_int4`` (same codes, sorted groups) and against the fp32 pipeline on the
  weights in their ORIGINAL column order; the identity permutation gives the unpermuted path's
  output bit for bit;
* the op's refusals (dtype, shape, layout, out-of-range entries) and the packer's;
* GPTQ act-order checkpoints written by tools/int4_packers.py (v1 / v2, sym / asym, group 32 /
  128, a shared expert and biases): convert, verify, and ``moepack.open`` layers in both modes on
  every level against the oracle's dequantized weights (``dequant_lookup``: original order).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import moepack
from moepack.errors import LayoutError
from moepack.isa import available_isas
from moepack.layout import int4_layout_for, layout_tensor_plan
from moepack.reference import moe_reference
from moepack.schemes.int4 import moe_reference_int4, pack_experts_int4
from moepack.schemes import get_scheme
from moepack.sources import gptq as gptq_mod
from tests.conftest import isa_cap, make_moe_inputs
from tests.reference.tolerances import TOL, assert_close, assert_close_int8

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SCHEME = get_scheme("int4_group")
MODES = ("a16", "a8")

_spec = importlib.util.spec_from_file_location("int4_packers", Path(__file__).resolve().parents[3] / "tools" / "int4_packers.py")
P = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(P)


def levels(layout, mode: str) -> list[str]:
    """scalar and every SIMD level whose int4 kernel of ``mode`` this host runs (the dispatcher's
    choice under each cap: a level that does not serve the mode is not listed)."""
    out = ["scalar"]
    for isa in available_isas():
        if isa == "scalar":
            continue
        with isa_cap(isa):
            if moepack.kernel_choice(layout, mode).isa == isa:
                out.append(isa)
    return out


def _perm(e: int, h: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(h, generator=g) for _ in range(e)]).to(torch.int32)


def _unpermute_cols(w13: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """w13 [E, N, H] in sorted column order -> original order: out[:, :, perm[j]] = w13[:, :, j]."""
    out = torch.empty_like(w13)
    out.scatter_(2, perm.long()[:, None, :].expand_as(w13), w13)
    return out


def _check(out, ref_int4, flip, ref32, dtype, mode, what):
    if mode == "a16":
        assert_close(out, ref_int4, TOL["scalar_vs_reference", dtype], what)
        key = "scalar_vs_reference" if dtype == F32 else "half_vs_fp32_pipeline"
        assert_close(out, ref32, TOL[key, dtype], what + " vs the fp32 pipeline (original column order)")
    else:
        assert_close_int8(out, ref_int4, TOL["int8_scalar_vs_reference", dtype], flip, what)
        assert_close_int8(out, ref32, TOL["int8_vs_fp32_dequantized", dtype], 0.0, what + " vs the fp32 pipeline")


CASES = [  # (dtype, tokens, hidden, intermediate, experts, topk, group, bias, interleaved)
    (F32, 7, 200, 88, 5, 2, 32, True, False),  # H = 200: a partial last group and K padding
    (BF16, 67, 256, 64, 6, 3, 128, False, False),  # more than one row chunk
    (F16, 3, 136, 40, 4, 1, 64, True, True),
    (F32, 1, 128, 96, 3, 3, -1, False, False),  # per channel
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[1]}-H{c[2]}-g{c[6]}" for c in CASES])
def test_kernels_run_act_order_on_every_level(case):
    dtype, t, h, i, e, k, g, bias, inter = case
    inp = make_moe_inputs(tokens=t, hidden=h, intermediate=i, experts=e, topk=k, dtype=dtype, bias=bias,
                          interleaved=inter, seed=h + t)  # fmt: skip
    lay = int4_layout_for(g)
    c = SCHEME.from_float(inp.w13, inp.w2, layout=lay)
    c["w13_perm"] = _perm(e, h, seed=t)
    p = pack_experts_int4({**c, "w13_bias": inp.w13_bias, "w2_bias": inp.w2_bias}, interleaved=inter, layout=lay)
    assert p.w13_perm.dtype == torch.int32 and p.w13_perm.shape == (e, h)
    kw = dict(interleaved=inter, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias,
              activation="swigluoai" if inter else "silu")  # fmt: skip
    w13o, w2o = SCHEME.dequantize(c)  # original column order
    w13s, _ = SCHEME.dequantize({k_: v for k_, v in c.items() if k_ != "w13_perm"})
    assert torch.equal(_unpermute_cols(w13s, c["w13_perm"]), w13o)
    ref32 = moe_reference(inp.x.float(), w13o, w2o, inp.topk_weights, inp.topk_ids, **kw)
    for mode in MODES:
        ref, flip = moe_reference_int4(inp.x, c, inp.topk_weights, inp.topk_ids, act_mode=mode, return_flip=True, **kw)
        ran = levels(lay, mode)
        for isa in ran:
            with isa_cap(isa):
                out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode, activation=kw["activation"])
            _check(out, ref, flip, ref32, dtype, mode, f"{isa} {mode} {lay.name}")
        assert ran[0] == "scalar" and len(ran) >= 1


@pytest.mark.parametrize("mode", MODES)
def test_identity_perm_is_the_unpermuted_path_bit_for_bit(mode):
    inp = make_moe_inputs(tokens=9, hidden=136, intermediate=88, experts=6, topk=3, dtype=BF16, seed=3)
    lay = int4_layout_for(32)
    c = SCHEME.from_float(inp.w13, inp.w2, layout=lay)
    plain = pack_experts_int4(c, layout=lay)
    ident = pack_experts_int4({**c, "w13_perm": torch.arange(136, dtype=torch.int32).repeat(6, 1)}, layout=lay)
    for isa in levels(lay, mode):
        with isa_cap(isa):
            a = moepack.run_experts(plain, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode)
            b = moepack.run_experts(ident, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode)
        assert torch.equal(a, b), (isa, mode)


def test_expert_map_and_threads_with_a_perm():
    inp = make_moe_inputs(tokens=9, hidden=136, intermediate=88, experts=6, topk=3, seed=14)
    lay = int4_layout_for(128)
    c = {**SCHEME.from_float(inp.w13, inp.w2, layout=lay), "w13_perm": _perm(6, 136, 5)}
    p = pack_experts_int4(c, layout=lay)
    for mode in MODES:
        full = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode)
        parts = []
        for rank in range(2):
            emap = torch.full((6,), -1, dtype=torch.int32)
            emap[rank * 3 : rank * 3 + 3] = torch.arange(3, dtype=torch.int32)
            sub = {k: v[rank * 3 : rank * 3 + 3] for k, v in p.tensors.items()}
            pr = moepack.PackedExperts(p.layout, 3, p.hidden, p.intermediate, p.padded_intermediate, p.interleaved, sub)
            parts.append(moepack.run_experts(pr, inp.x, inp.topk_weights, inp.topk_ids, expert_map=emap, act_mode=mode))
        torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-6)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, full), mode


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


def _small():
    inp = make_moe_inputs(tokens=4, hidden=72, intermediate=40, experts=3, seed=15)
    lay = int4_layout_for(32)
    c = {**SCHEME.from_float(inp.w13, inp.w2, layout=lay), "w13_perm": _perm(3, 72, 1)}
    return inp, pack_experts_int4(c, layout=lay)


def _call(inp, p, perm, layout=None):
    return moepack.fused_experts(inp.x, p.weight("w13"), p.weight("w2"), inp.topk_weights, inp.topk_ids,
                                 layout=layout or p.layout, w13_perm=perm)  # fmt: skip


def test_op_refuses_bad_perms():
    inp, p = _small()
    perm = p.w13_perm
    with pytest.raises(TypeError, match=r"w13_perm has dtype Long: must be int32"):
        _call(inp, p, perm.long())
    with pytest.raises(ValueError, match=r"w13_perm has shape \[3, 71\]: must be \[3, 72\] \(int32 \[E, H\]"):
        _call(inp, p, perm[:, :71].contiguous())
    with pytest.raises(ValueError, match=r"w13_perm with shape \[3, 72\] is not contiguous"):
        _call(inp, p, perm.t().contiguous().t())
    routed = int(inp.topk_ids[0, 0])
    bad = perm.clone()
    bad[routed, 17] = 72
    with pytest.raises(IndexError, match=rf"w13_perm\[{routed}, 17\] = 72: act-order permutation entries must be in \[0, H=72\)"):
        _call(inp, p, bad)
    bad[routed, 17] = -1
    with pytest.raises(IndexError, match=rf"w13_perm\[{routed}, 17\] = -1: act-order permutation entries must be in \[0, H=72\)"):
        _call(inp, p, bad)
    dense = inp.pack()
    with pytest.raises(ValueError, match="w13_perm with layout bf16_n32k2_x86: only int4_group layouts take an act-order permutation"):
        moepack.fused_experts(inp.x, dense.w13, dense.w2, inp.topk_weights, inp.topk_ids, w13_perm=perm)
    # the Meta kernel runs the same shape / dtype checks
    meta = lambda t: t.to("meta")  # noqa: E731
    with pytest.raises(ValueError, match=r"w13_perm has shape \[3, 71\]"):
        torch.ops.moepack.fused_experts(meta(inp.x), [meta(t) for t in p.weight("w13")], [meta(t) for t in p.weight("w2")],
                                        meta(inp.topk_weights), meta(inp.topk_ids), p.layout.id,
                                        w13_perm=meta(perm[:, :71].contiguous()))  # fmt: skip
    out = torch.ops.moepack.fused_experts(meta(inp.x), [meta(t) for t in p.weight("w13")], [meta(t) for t in p.weight("w2")],
                                          meta(inp.topk_weights), meta(inp.topk_ids), p.layout.id, w13_perm=meta(perm))  # fmt: skip
    assert out.shape == inp.x.shape and out.device.type == "meta"


def test_opcheck_with_a_perm():
    inp, p = _small()
    torch.library.opcheck(torch.ops.moepack.fused_experts.default,
                          (inp.x, p.weight("w13"), p.weight("w2"), inp.topk_weights, inp.topk_ids, p.layout.id),
                          {"w13_perm": p.w13_perm})  # fmt: skip


def test_packer_and_plan_refuse_bad_perms():
    inp = make_moe_inputs(tokens=1, hidden=72, intermediate=40, experts=3, seed=16)
    lay = int4_layout_for(32)
    c = SCHEME.from_float(inp.w13, inp.w2, layout=lay)
    perm = _perm(3, 72, 2)
    with pytest.raises(LayoutError, match=r"w13_perm has shape \[3, 71\]: must be \[E, H\] = \[3, 72\]"):
        pack_experts_int4({**c, "w13_perm": perm[:, :71]}, layout=lay)
    bad = perm.clone()
    bad[1, 5] = 80
    with pytest.raises(LayoutError, match=r"w13_perm\[1, 5\] = 80: act-order permutation entries must be in \[0, H=72\)"):
        pack_experts_int4({**c, "w13_perm": bad}, layout=lay)
    bad = perm.clone()
    bad[2, 0] = bad[2, 1]
    with pytest.raises(LayoutError, match=r"w13_perm\[2\] is not a permutation of 0..71: channel \d+ is missing"):
        pack_experts_int4({**c, "w13_perm": bad}, layout=lay)
    with pytest.raises(LayoutError, match="w13_perm has dtype torch.float32"):
        pack_experts_int4({**c, "w13_perm": perm.float()}, layout=lay)
    with pytest.raises(LayoutError, match=r"w13_perm with layout bf16_n32k2_x86 \(scheme dense\): only int4_group layouts"):
        layout_tensor_plan(moepack.layout_get("bf16_n32k2_x86"), 3, 72, 40, perm=True)
    dense = inp.pack()
    with pytest.raises(LayoutError, match="only int4_group layouts carry an act-order permutation"):
        moepack.PackedExperts(dense.layout, 3, 72, 40, dense.padded_intermediate, False, {**dense.tensors, "w13_perm": perm})
    p = pack_experts_int4({**c, "w13_perm": perm}, layout=lay)
    with pytest.raises(LayoutError, match=r"packed tensor 'w13_perm' is int64 \[3, 72\]: layout u4g32_n32k8_x86 says int32 \[3, 72\]"):
        moepack.PackedExperts(p.layout, 3, 72, 40, p.padded_intermediate, False, {**p.tensors, "w13_perm": perm.long()})


# ---------------------------------------------------------------------------------------------
# GPTQ act-order checkpoints: convert, verify, run
# ---------------------------------------------------------------------------------------------

H, I, E, SHARED = 136, 88, 3, 40


def _oracle_layer(orc: dict, prefix: str, e: int):
    """fp32 canonical weights in the ORIGINAL column order (dequant_lookup), biases as stored."""
    w13, w2, b13, b2 = [], [], [], []
    for x in range(e):
        g, u, d = (orc[f"{prefix}.experts.{x}.{r}_proj"] for r in ("gate", "up", "down"))
        w13.append(torch.cat([P.dequant_lookup(g), P.dequant_lookup(u)]))
        w2.append(P.dequant_lookup(d))
        if "bias" in g:
            b13.append(torch.cat([g["bias"], u["bias"]]).float())
            b2.append(d["bias"].float())
    return torch.stack(w13), torch.stack(w2), (torch.stack(b13) if b13 else None), (torch.stack(b2) if b2 else None)


def _oracle_shared(orc: dict, prefix: str):
    g, u, d = (orc[f"{prefix}.shared_expert.{r}_proj"] for r in ("gate", "up", "down"))
    return torch.cat([P.dequant_lookup(g), P.dequant_lookup(u)])[None], P.dequant_lookup(d)[None]


GPTQ = [  # (version, sym, group)
    ("gptq", True, 128),
    ("gptq_v2", False, 32),
    ("gptq", False, 32),
    ("gptq_v2", True, 128),
]


@pytest.mark.parametrize("version,sym,group", GPTQ, ids=[f"{v}-{'sym' if s else 'asym'}-g{g}" for v, s, g in GPTQ])
def test_gptq_act_order_converts_verifies_and_runs(tmp_path, version, sym, group):
    src = tmp_path / "src"
    orc = P.write_moe_checkpoint(src, "gptq", h=H, i=I, e=E, group_size=group, sym=sym, version=version, act_order=True,
                                 shared=SHARED, bias=True, seed=group + sym)  # fmt: skip
    dst = tmp_path / "packed"
    moepack.convert(src, dst)
    m = json.loads((dst / "moepack.json").read_text())
    entry = m["layers"][0]
    assert m["format_version"] == 6 and entry["act_mode"] == "a16"
    assert "w13_perm" in entry["tensors"] and "w13_perm" in entry["shared"]
    report = moepack.verify(dst, source=src)
    assert report.ok, report.failures()
    model = moepack.open(dst)
    layer = model.layers[0]
    assert layer.packed.w13_perm.shape == (E, H) and layer.shared.w13_perm.shape == (1, H)
    assert not torch.equal(layer.packed.w13_perm[0], torch.arange(H, dtype=torch.int32))
    w13, w2, b13, b2 = _oracle_layer(orc, "model.layers.0.mlp", E)
    s13, s2 = _oracle_shared(orc, "model.layers.0.mlp")
    gate = model.tensor(entry["shared"]["gate"]).float()
    ckpt, reader = moepack.sources.open_source(src)
    spec = reader.layers(ckpt)[0]
    canon = reader.read_layer(ckpt, spec)
    for x_ in range(E):  # the reader's float view is the oracle's, in the folded intermediate order
        ip = gptq_mod.READER.intermediate_perm(ckpt, spec, x_)
        ip = torch.arange(I) if ip is None else ip
        assert torch.equal(canon.w13[x_], torch.cat([w13[x_, :I][ip], w13[x_, I:][ip]])) and torch.equal(canon.w2[x_], w2[x_][:, ip])
    shared_c = {**reader.read_shared_canonical(ckpt, reader.layers(ckpt)[0]), "group_size": group}
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(11, H, generator=gen) / H**0.5
    w, ids = torch.softmax(torch.randn(11, E, generator=gen), -1).topk(2)
    w, ids = w.contiguous(), ids.to(torch.int32).contiguous()
    sw = torch.sigmoid(x @ gate.t()).contiguous()
    sid = torch.zeros(11, 1, dtype=torch.int32)
    ref32 = moe_reference(x, w13, w2, w, ids, w13_bias=b13, w2_bias=b2)
    sref32 = moe_reference(x, s13, s2, sw, sid)
    c = {**canon.canonical, "group_size": group}
    for mode in MODES:
        ref, flip = moe_reference_int4(x, c, w, ids, act_mode=mode, return_flip=True, w13_bias=canon.w13_bias,
                                       w2_bias=canon.w2_bias)  # fmt: skip
        sref, sflip = moe_reference_int4(x, shared_c, sw, sid, act_mode=mode, return_flip=True)
        for isa in levels(layer.packed.layout, mode):
            with isa_cap(isa):
                out = layer.experts(x, w, ids, act_mode=mode)
                sout = layer.shared_expert(x, act_mode=mode)
            _check(out, ref, flip, ref32, F32, mode, f"{version} g{group} routed {isa} {mode}")
            _check(sout, sref, sflip, sref32, F32, mode, f"{version} g{group} shared {isa} {mode}")
