"""int4_group experts (layouts u4*_n32k8_x86, SEMANTICS.md §3 "int4 group"), W4A16 and W4A8.

Trust chain (ARCHITECTURE.md principle 6), one level per section:
* the quantizer (round to nearest, sym and asym, partial last group) and the dequantization
  (exact in fp32);
* the packer: every code at the element offset the layout defines with the nibble order of
  U4_NIBBLE_ORDER, K padding = the group's zero point, scales / zero points in packed row order;
* the integer core of W4A8: every ISA's per-group int32 accumulators identical to exact integer
  matmuls (``torch.ops.moepack.dot_u4_block``);
* the kernels: scalar vs ``moe_reference_int4`` (same rounding points in torch), SIMD vs scalar,
  and both vs the fp32 pipeline on the dequantized weights, over the kernel test matrix
  (tests/support/kernel_cases.py) for the group-128 layout and awkward shapes for every group size (a
  partial last group included); the activation mode per call, its refusals and overrides.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

import moepack
from moepack.errors import LayoutError
from moepack.isa import MODE_ISAS, available_isas
from moepack.layout import INT4_LAYOUT, LAYOUTS, int4_layout_for, layout_element_offset, layout_get
from moepack.pack import unpack_codes
from moepack.reference import moe_reference
from moepack.schemes.int4 import (
    dequantize_int4_group,
    moe_reference_int4,
    pack_experts_int4,
    pack_int4_weight,
    pack_u4_codes,
    quantize_int4_group,
)
from moepack.schemes import get_scheme
from tests.conftest import isa_cap, make_moe_inputs
from tests.support.kernel_cases import CASES, Case
from tests.reference.tolerances import TOL, assert_close, assert_close_int8
from tests.support import skips

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OPS = torch.ops.moepack
U4_LAYOUTS = [x for x in LAYOUTS if x.scheme == "int4_group"]
SCHEME = get_scheme("int4_group")


def isas_running(layout, mode: str) -> list[str]:
    """SIMD levels whose int4 kernel of ``mode`` this host runs."""
    out = []
    for isa in available_isas():
        if isa == "scalar":
            continue
        with isa_cap(isa):
            if moepack.kernel_choice(layout, mode).isa == isa:
                out.append(isa)
    return out


def need(isa: str, mode: str) -> None:
    if isa not in isas_running(INT4_LAYOUT, mode):
        skips.host_lacks(f"the {isa} level (no {isa} int4 {mode} kernel runs on this CPU; flags: {moepack.cpu_flags()})")


# ---------------------------------------------------------------------------------------------
# Quantizer and dequantization
# ---------------------------------------------------------------------------------------------


def test_symmetric_quantizer_rule():
    # one group of 8: amax 7.5 -> scale 1, zero 8, q = round_half_even(w) + 8 clamped to 0..15
    w = torch.tensor([[7.5, -7.5, 0.5, 1.5, 2.5, -0.5, -3.2, 0.0]])
    q, s, z = quantize_int4_group(w, 8)
    assert q.dtype == torch.uint8 and s.dtype == F32 and z.dtype == torch.uint8
    assert s.tolist() == [[1.0]] and z.tolist() == [[8]]
    assert q.tolist() == [[15, 0, 8, 10, 10, 8, 5, 8]]  # 7.5 rounds to 8 -> 16, clamped to 15
    # an all-zero group gets scale 1 and codes == its zero point: every scale finite and > 0
    q, s, z = quantize_int4_group(torch.zeros(2, 16), 8)
    assert torch.equal(s, torch.ones(2, 2)) and bool((q == 8).all())


def test_asymmetric_quantizer_rule_and_partial_group():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 88, generator=g)
    q, s, z = quantize_int4_group(w, 32, sym=False)
    assert q.shape == (6, 88) and s.shape == (6, 3) == z.shape  # ceil(88 / 32) groups, the last of 24
    last = w[:, 64:]
    mx, mn = last.amax(-1).clamp(min=0), last.amin(-1).clamp(max=0)
    torch.testing.assert_close(s[:, 2], (mx - mn) / 15, rtol=0, atol=0)  # padding never widens the range
    assert bool((z <= 15).all()) and int(q.max()) <= 15
    err = (dequantize_int4_group(q, s, z, 32) - w).abs()
    assert bool((err <= s.repeat_interleave(32, -1)[:, :88] * 0.5 * (1 + 1e-6)).all())


def test_dequantize_is_exact():
    """(q - z) * s with fp16 scales: exactly the float64 value (15 significant bits at most)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (4, 8, 72), generator=g, dtype=torch.uint8)
    z = torch.randint(0, 16, (4, 8, 3), generator=g, dtype=torch.uint8)
    s = (torch.rand(4, 8, 3, generator=g) * 0.1 + 1e-3).half().float()
    got = dequantize_int4_group(q, s, z, 32)
    idx = torch.arange(72) // 32
    want = (q.double() - z.double()[..., idx]) * s.double()[..., idx]
    assert torch.equal(got.double(), want)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(w=torch.zeros(4, 4, dtype=torch.int8)), "dtype torch.int8"),
        (dict(w=torch.tensor([[1.0, float("nan")]])), "non-finite"),
        (dict(w=torch.zeros(4)), "must be"),
        (dict(w=torch.zeros(4, 4), group_size=0), "group_size=0"),
    ],
)
def test_quantizer_refuses(kw, match):
    with pytest.raises(LayoutError, match=match):
        quantize_int4_group(**kw)


# ---------------------------------------------------------------------------------------------
# Packer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lay", U4_LAYOUTS, ids=[x.name for x in U4_LAYOUTS])
def test_codes_sit_where_the_layout_says(lay):
    """Element (n, k) at layout_element_offset; within a column's K group of 8 the code j sits in
    byte j % 4, low nibble for j < 4 (U4_NIBBLE_ORDER); K padding holds the group's zero point."""
    g = torch.Generator().manual_seed(3)
    e, n, k = 2, 40, 100
    np_, kp = 64, 104
    gs = lay.group_size or -1
    ng = 1 if gs < 0 else -(-k // gs)
    q = torch.randint(0, 16, (e, n, k), generator=g, dtype=torch.uint8)
    z = torch.randint(0, 16, (e, n, ng), generator=g, dtype=torch.uint8)
    packed = pack_u4_codes(q, z, gs, lay, np_, kp)
    assert packed.shape == (e, np_, kp // 2) and packed.dtype == torch.uint8
    flat = packed.view(e, -1)
    for ee, nn, kk in [(0, 0, 0), (1, 39, 99), (0, 5, 3), (1, 31, 4), (0, 32, 7), (1, 17, 64), (0, 3, 101), (1, 50, 10)]:
        off = layout_element_offset(lay, nn, kk, kp)
        base, j = off - off % 8, off % 8
        byte = int(flat[ee, base // 2 + j % 4])
        code = (byte >> 4) if j >= 4 else (byte & 15)
        if nn >= n:
            want = 0  # padded rows
        elif kk >= k:
            want = int(z[ee, nn, (kk // gs) if gs > 0 else 0])  # K padding: the zero point
        else:
            want = int(q[ee, nn, kk])
        assert code == want, (ee, nn, kk)
    back = unpack_codes(lay, packed, np_, kp)
    assert torch.equal(back[:, :n, :k], q)


def test_scales_and_zeros_in_packed_row_order():
    g = torch.Generator().manual_seed(4)
    e, i, h = 2, 40, 72
    lay = int4_layout_for(32)
    q13 = torch.randint(0, 16, (e, 2 * i, h), generator=g, dtype=torch.uint8)
    s13 = torch.rand(e, 2 * i, 3, generator=g) + 0.1
    z13 = torch.randint(0, 16, (e, 2 * i, 3), generator=g, dtype=torch.uint8)
    for interleaved in (False, True):
        t = pack_int4_weight("w13", q13, s13, z13, interleaved=interleaved, layout=lay)
        ip = 64
        assert t["w13_scale"].shape == (e, 3, 2 * ip) and t["w13_zero"].shape == (e, 3, 2 * ip)
        if interleaved:
            assert torch.equal(t["w13_scale"][:, :, : 2 * i], s13.transpose(1, 2))
            assert bool((t["w13_scale"][:, :, 2 * i :] == 0).all())
        else:
            assert torch.equal(t["w13_scale"][:, :, :i], s13[:, :i].transpose(1, 2))
            assert torch.equal(t["w13_scale"][:, :, ip : ip + i], s13[:, i:].transpose(1, 2))
            assert torch.equal(t["w13_zero"][:, :, ip : ip + i], z13[:, i:].transpose(1, 2))
            assert bool((t["w13_zero"][:, :, i:ip] == 0).all())
    # per channel: [E, Np] tensors
    ch = int4_layout_for(-1)
    t = pack_int4_weight("w2", q13[:, :h, :i], s13[:, :h, :1], z13[:, :h, :1], layout=ch)
    assert t["w2_scale"].shape == (e, 96) and torch.equal(t["w2_scale"][:, :h], s13[:, :h, 0])


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c: c.update(w13_zero=c["w13_zero"] + 16), "w13_zero.* = 1[6-9]|w13_zero.*: int4 zero points are 0..15"),
        (lambda c: c["w13_scale"].view(-1).__setitem__(0, float("nan")), r"w13_scale\[0, 0, 0\] = nan"),
        (lambda c: c["w2_scale"].view(-1).__setitem__(3, 0.0), r"w2_scale.* = 0.0: scales must be finite and > 0"),
        (lambda c: c.update(w2_scale=c["w2_scale"][..., :1]), r"w2_scale has shape .*ceil\(K=40 / group_size=32\)"),
        (lambda c: c.update(w13_q=c["w13_q"].to(torch.int8)), "uint8"),
        (lambda c: c.update(group_size=64), "group_size=64: layout u4g32_n32k8_x86 has group_size 32"),
    ],
)
def test_pack_refuses_bad_canonical_tensors(edit, match):
    inp = make_moe_inputs(tokens=1, hidden=72, intermediate=40, seed=5)
    lay = int4_layout_for(32)
    c = SCHEME.from_float(inp.w13, inp.w2, layout=lay)
    edit(c)
    with pytest.raises(LayoutError, match=match):
        pack_experts_int4(c, layout=lay)


# ---------------------------------------------------------------------------------------------
# The W4A8 integer core
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("isa", ["scalar", *MODE_ISAS[("u4", "a8")][1:]])
def test_integer_core_is_exact_on_every_isa(isa):
    """Per K range (a group, a partial group, the whole K), int32 accumulators == the exact
    integer matmul of s8 rows (-128 and 127 included) and u4 codes (0 and 15 included)."""
    if isa != "scalar":
        need(isa, "a8")
    g = torch.Generator().manual_seed(6)
    kp = 264
    for m in (1, 3, 8, 13, 64):
        rows = torch.randint(-128, 128, (m, kp), generator=g, dtype=torch.int32).to(torch.int8)
        rows.view(-1)[::5] = 127
        rows.view(-1)[1::7] = -128
        q = torch.randint(0, 16, (1, 32, kp), generator=g, dtype=torch.uint8)
        q.view(-1)[::3] = 15
        block = pack_u4_codes(q, torch.zeros(1, 32, 1, dtype=torch.uint8), -1, INT4_LAYOUT, 32, kp).reshape(-1)
        for k0, kk in ((0, kp), (0, 128), (128, 136), (256, 8), (40, 48)):
            got = OPS.dot_u4_block(rows, block, k0, kk, INT4_LAYOUT.id, isa)
            want = rows[:, k0 : k0 + kk].long() @ q[0, :, k0 : k0 + kk].long().t()
            assert torch.equal(got.long(), want), (isa, m, k0, kk)


def test_integer_core_refuses():
    rows = torch.zeros(2, 64, dtype=torch.int8)
    block = torch.zeros(32 * 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"K range \[4, 12\): must be multiples of 8"):
        OPS.dot_u4_block(rows, block, 4, 8, INT4_LAYOUT.id, "scalar")
    with pytest.raises(ValueError, match="not an int4_group layout"):
        OPS.dot_u4_block(rows, block, 0, 8, 1, "scalar")
    with pytest.raises(ValueError, match="one packed u4 column block"):
        OPS.dot_u4_block(rows, block[:-1], 0, 8, INT4_LAYOUT.id, "scalar")


# ---------------------------------------------------------------------------------------------
# Kernels: the test matrix on u4g128, awkward shapes on every group size
# ---------------------------------------------------------------------------------------------


@dataclass
class Computed:
    inp: object
    canonical: dict
    packed: object
    scalar: dict  # mode -> output
    ref: dict  # mode -> (reference, flip)
    ref_fp32: torch.Tensor


def _run(p, inp, mode, **kw):
    return moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode, **kw)


@functools.lru_cache(maxsize=None)
def computed(case: Case, layout_name: str = INT4_LAYOUT.name) -> Computed:
    lay = layout_get(layout_name)
    inp = case.inputs()
    c = SCHEME.from_float(inp.w13, inp.w2, layout=lay)
    full = {**c, "w13_bias": inp.w13_bias, "w2_bias": inp.w2_bias}
    p = SCHEME.pack(full, interleaved=inp.interleaved, layout=lay)
    kw = dict(case.act_kwargs, interleaved=inp.interleaved, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias)
    scalar, ref = {}, {}
    for mode in ("a16", "a8"):
        with isa_cap("scalar"):
            scalar[mode] = _run(p, inp, mode, **case.act_kwargs)
        ref[mode] = moe_reference_int4(inp.x, c, inp.topk_weights, inp.topk_ids, act_mode=mode, return_flip=True, **kw)
    w13, w2 = SCHEME.dequantize(c)
    ref32 = moe_reference(inp.x.float(), w13, w2, inp.topk_weights, inp.topk_ids, **kw)
    return Computed(inp, c, p, scalar, ref, ref32)


def check_a16(out, c: Computed, dtype, base: str, what: str):
    ref = c.ref["a16"][0] if base == "reference" else c.scalar["a16"]
    assert_close(out, ref, TOL["scalar_vs_reference" if base == "reference" else "simd_vs_scalar", dtype], what)
    if dtype == F32:
        assert_close(out, c.ref_fp32, TOL["scalar_vs_reference", F32], what + " vs the fp32 pipeline")
    else:
        assert_close(out, c.ref_fp32, TOL["half_vs_fp32_pipeline", dtype], what + " vs the fp32 pipeline")


def check_a8(out, c: Computed, dtype, base: str, what: str):
    ref, flip = c.ref["a8"]
    if base == "reference":
        assert_close_int8(out, ref, TOL["int8_scalar_vs_reference", dtype], flip, what)
    else:
        assert_close_int8(out, c.scalar["a8"], TOL["int8_simd_vs_scalar", dtype], flip, what)
    assert_close_int8(out, c.ref_fp32, TOL["int8_vs_fp32_dequantized", dtype], 0.0, what + " vs the fp32 pipeline")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_scalar_matches_int4_reference(case: Case):
    c = computed(case)
    for mode, check in (("a16", check_a16), ("a8", check_a8)):
        out = c.scalar[mode]
        assert out.shape == (case.tokens, case.hidden) and out.dtype == case.dtype
        check(out, c, case.dtype, "reference", f"scalar {mode} {case.id}")


SIMD_MODES = [(isa, mode) for mode in ("a16", "a8") for isa in MODE_ISAS[("u4", mode)][1:]]


@pytest.mark.parametrize("isa,mode", SIMD_MODES, ids=[f"{i}-{m}" for i, m in SIMD_MODES])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_simd_matches_scalar_int4(case: Case, isa: str, mode: str):
    need(isa, mode)
    c = computed(case)
    with isa_cap(isa):
        out = _run(c.packed, c.inp, mode, **case.act_kwargs)
    (check_a16 if mode == "a16" else check_a8)(out, c, case.dtype, "scalar", f"{isa} {mode} {case.id}")


AWKWARD = [
    Case(F32, "silu", "1", 200, 88, 67, 5, True, 11),  # I = 88: group 32's last group is partial
    Case(BF16, "swigluoai", "1", 130, 176, 3, 2, True, 12),
    Case(F16, "gelu", "1/sqrt(H)", 93, 40, 1, 1, False, 13),
    # H = 2048: bf16 x rows of 4 KiB get the driver's one-line padding (tile loads at a row
    # stride > K); 24 tokens x 2 of E experts give every expert chunks that the tile paths take
    Case(BF16, "silu", "1/sqrt(H)", 2048, 64, 24, 2, False, 16),
    # decode: one and two rows per expert through the W4A8 streams (H = 1024: 32 / 16 / 8 / 1
    # groups, 4 streams or a split single group; I = 256: 2 groups of 128, 2 streams)
    Case(BF16, "silu", "1", 1024, 256, 1, 4, True, 17),
    Case(F32, "gelu", "1/sqrt(H)", 1024, 256, 2, 5, False, 18),
]


@pytest.mark.parametrize("lay", U4_LAYOUTS, ids=[x.name for x in U4_LAYOUTS])
@pytest.mark.parametrize("case", AWKWARD, ids=[c.id for c in AWKWARD])
def test_every_group_size_on_every_level(case: Case, lay):
    c = computed(case, lay.name)
    for mode, check in (("a16", check_a16), ("a8", check_a8)):
        check(c.scalar[mode], c, case.dtype, "reference", f"scalar {mode} {lay.name} {case.id}")
        for isa in isas_running(lay, mode):
            with isa_cap(isa):
                out = _run(c.packed, c.inp, mode, **case.act_kwargs)
            check(out, c, case.dtype, "scalar", f"{isa} {mode} {lay.name} {case.id}")


def test_expert_map_and_threads():
    inp = make_moe_inputs(tokens=9, hidden=136, intermediate=88, experts=6, topk=3, seed=14)
    p = pack_experts_int4(SCHEME.from_float(inp.w13, inp.w2, layout=INT4_LAYOUT), layout=INT4_LAYOUT)
    for mode in ("a16", "a8"):
        full = _run(p, inp, mode)
        # expert parallelism: two ranks of 3 experts each; the sum of their outputs is the whole
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
            one = _run(p, inp, mode)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, full), mode


# ---------------------------------------------------------------------------------------------
# The activation mode: per call, per packed set, MOEPACK_ACT_MODE; refusals
# ---------------------------------------------------------------------------------------------


def test_act_mode_selection_and_refusals(monkeypatch):
    inp = make_moe_inputs(tokens=4, hidden=72, intermediate=40, seed=15)
    c = SCHEME.from_float(inp.w13, inp.w2, layout=INT4_LAYOUT)
    p = pack_experts_int4(c, layout=INT4_LAYOUT)
    a16, a8 = _run(p, inp, "a16"), _run(p, inp, "a8")
    assert not torch.equal(a16, a8)
    monkeypatch.delenv("MOEPACK_ACT_MODE", raising=False)
    assert torch.equal(_run(p, inp, None), a16)  # the layout's default: a16
    pa8 = moepack.PackedExperts(p.layout, p.num_experts, p.hidden, p.intermediate, p.padded_intermediate,
                                p.interleaved, p.tensors, act_mode="a8")  # fmt: skip
    assert torch.equal(_run(pa8, inp, None), a8)  # the packed set's default
    monkeypatch.setenv("MOEPACK_ACT_MODE", "a16")
    assert torch.equal(_run(pa8, inp, None), a16)  # the environment overrides it
    assert torch.equal(_run(pa8, inp, "a8"), a8)  # an explicit mode overrides everything
    monkeypatch.setenv("MOEPACK_ACT_MODE", "a8")
    dense = inp.pack()
    moepack.run_experts(dense, inp.x, inp.topk_weights, inp.topk_ids)  # a layout without a8 ignores it
    monkeypatch.setenv("MOEPACK_ACT_MODE", "a4")
    with pytest.raises(LayoutError, match="MOEPACK_ACT_MODE='a4' is not one of a16, a8"):
        _run(p, inp, None)
    monkeypatch.delenv("MOEPACK_ACT_MODE")
    with pytest.raises(LayoutError, match="act_mode='a8': layout bf16_n32k2_x86 runs with a16 activations"):
        moepack.run_experts(dense, inp.x, inp.topk_weights, inp.topk_ids, act_mode="a8")
    with pytest.raises(ValueError, match="act_mode='a8': layout bf16_n32k2_x86 runs with a16 activations"):
        moepack.fused_experts(inp.x, dense.w13, dense.w2, inp.topk_weights, inp.topk_ids, act_mode="a8")
    with pytest.raises(ValueError, match="act_mode='w4' is not one of a16, a8"):
        moepack.fused_experts(inp.x, p.weight("w13"), p.weight("w2"), inp.topk_weights, inp.topk_ids,
                              layout=p.layout, act_mode="w4")  # fmt: skip
    with pytest.raises(LayoutError, match="act_mode='a4': layout u4g128_n32k8_x86 runs with a16 or a8"):
        moepack.PackedExperts(p.layout, p.num_experts, p.hidden, p.intermediate, p.padded_intermediate,
                              p.interleaved, p.tensors, act_mode="a4")  # fmt: skip


def test_kernel_choice_per_mode():
    """Each mode runs on the best level serving it: bf16 dot products for a16, int8 for a8."""
    for mode in ("a16", "a8"):
        ch = moepack.kernel_choice(INT4_LAYOUT, mode)
        serving = [x for x in MODE_ISAS[("u4", mode)] if x in available_isas()]
        assert ch.isa == serving[-1] and not ch.is_fallback, (mode, ch)
    assert moepack.kernel_choice(INT4_LAYOUT).isa == moepack.kernel_choice(INT4_LAYOUT, "a16").isa
    with pytest.raises(ValueError, match="act_mode='a16': layout i8_n32k4_x86 runs with a8 activations"):
        moepack.kernel_choice("i8_n32k4_x86", "a16")


def test_pack_experts_on_float_weights_quantizes():
    """The peers' harness convention: pack_experts(float, layout=<int4 layout>) quantizes
    (symmetric, the layout's group size) and runs close to the float weights."""
    inp = make_moe_inputs(tokens=5, hidden=256, intermediate=128, seed=16)
    for lay in U4_LAYOUTS:
        p = moepack.pack_experts(inp.w13, inp.w2, layout=lay)
        assert p.layout is lay and p.w13_zero.dtype == torch.uint8 and bool((p.w13_zero[..., :128] == 8).all())
        out = _run(p, inp, "a16")
        ref = moe_reference(inp.x, inp.w13.float(), inp.w2.float(), inp.topk_weights, inp.topk_ids)
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel < 0.25, (lay.name, rel)  # 4-bit RTN noise, not a wrong kernel (that is O(1))
