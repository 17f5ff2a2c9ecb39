"""fp8_block experts (layouts f8g128_n32k2_x86 and f8ch_n32k2_x86, SEMANTICS.md §3 "fp8 block", W8A16).

Trust chain, one level per section:
* the e4m3fn decode: all 256 codes against torch's float8_e4m3fn -> float32 cast (the NaN codes
  refused); the quantizer (block amax / 448, round to nearest even, edge blocks, all-zero
  blocks) and the dequantization;
* the packer: every code where the layout puts it (unpack_codes), scales in packed row order,
  0 in every padding row and group, refusals of bad canonical tensors;
* the kernels: the scalar kernel against ``moe_reference_fp8`` (the fp32 reference on the
  exactly dequantized weights) over the kernel test matrix (tests/support/kernel_cases.py) and awkward
  shapes on both layouts, every finite code through the kernel; SIMD levels that run the f8
  layouts against scalar (none in a build whose fp8 kernels are scalar only: then the dispatcher
  says so, which is checked).
"""

from __future__ import annotations

import functools

import pytest
import torch

import moepack
from moepack.errors import ConvertError, LayoutError
from moepack.isa import available_isas, host_family
from moepack.layout import FP8_LAYOUT, LAYOUTS, layout_get, layout_padded_i
from moepack.pack import unpack_codes
from moepack.reference import moe_reference
from moepack.schemes import get_scheme
from moepack.schemes.fp8 import (
    E4M3FN_VALUES,
    check_fp8_canonical,
    decode_e4m3fn,
    dequantize_fp8,
    moe_reference_fp8,
    pack_experts_fp8,
    parse_options,
    quantize_fp8_block,
)
from tests.conftest import isa_cap, make_moe_inputs
from tests.support.kernel_cases import CASES, Case
from tests.reference.tolerances import TOL, assert_close

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
F8 = torch.float8_e4m3fn
F8_LAYOUTS = [x for x in LAYOUTS if x.scheme == "fp8_block"]
SCHEME = get_scheme("fp8_block")
CH = next(x for x in F8_LAYOUTS if x.group_size == 0)


# ---------------------------------------------------------------------------------------------
# Codes and the quantizer
# ---------------------------------------------------------------------------------------------


def test_every_code_decodes_like_torch():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = decode_e4m3fn(codes)
    torch_vals = codes.view(F8).float()
    nan = torch.isnan(torch_vals)
    assert nan.nonzero().view(-1).tolist() == [0x7F, 0xFF]
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(ours[~nan].view(torch.int32), torch_vals[~nan].view(torch.int32))  # bit for bit, -0 included
    assert float(E4M3FN_VALUES[0x7E]) == 448.0 and float(E4M3FN_VALUES[0x01]) == 2.0**-9
    assert E4M3FN_VALUES[0x80].item() == 0.0 and torch.signbit(E4M3FN_VALUES[0x80])


@pytest.mark.parametrize("nan", [0x7F, 0xFF])
def test_nan_codes_are_refused_with_their_index(nan):
    q = torch.zeros(1, 64, 130, dtype=torch.uint8)
    q[0, 33, 129] = nan
    with pytest.raises(LayoutError, match=rf"w2_q\[0, 33, 129\] = 0x{nan:02X}: an e4m3fn NaN code"):
        check_fp8_canonical("w2", q, torch.ones(1, 64, 2), 128)


def test_quantizer_rule_ragged_blocks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 320, generator=g) * 0.05
    w[128:, 256:] = 0  # the edge block (72 x 64 real elements) all zero: scale 1, codes 0
    w[5, 7] = 3.0  # one large value sets block (0, 0)'s scale
    q, s = quantize_fp8_block(w, 128)
    assert q.dtype == torch.uint8 and tuple(s.shape) == (200, 3)
    # one scale per 128 x 128 block, stored on each of its rows; edge blocks use their real elements
    for bi, rows in enumerate((slice(0, 128), slice(128, 200))):
        for bj, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 320))):
            a = float(w[rows, cols].abs().max())
            want = torch.tensor(a, dtype=F32) / 448 if a else torch.tensor(1.0)
            assert torch.all(s[rows, bj] == want), (bi, bj)
    assert float(s[0, 0]) == float(torch.tensor(3.0) / 448) and torch.all(s[128:, 2] == 1.0) and torch.all(q[128:, 256:] == 0)
    # codes: torch's round-to-nearest-even cast of w / scale, clamped to +-448
    full = s.repeat_interleave(128, 1)[:, :320]
    assert torch.equal(q, (w / full).clamp(-448, 448).to(F8).view(torch.uint8))
    deq = dequantize_fp8(q, s, 128)
    big = w.abs() >= full * 2.0**-6  # normal e4m3fn range: within 2^-4 relative
    assert bool(((deq - w).abs() <= w.abs() * 2.0**-4 + 1e-12)[big].all())
    assert int(q[5, 7]) == 0x7E  # the block's amax is code 448


def test_per_channel_quantizer_and_tiny_rows():
    w = torch.randn(3, 40, 70)
    w[1, 4] = 0
    w[2, 5] = 1e-44  # amax / 448 underflows to 0: scale 1, codes 0 (the row dequantizes to ~0)
    q, s = quantize_fp8_block(w, -1)
    assert tuple(s.shape) == (3, 40, 1) and bool((s > 0).all()) and bool(torch.isfinite(s).all())
    assert float(s[1, 4, 0]) == 1.0 and int(q[1, 4].max()) == 0
    assert torch.equal(s[0, :, 0], w[0].abs().amax(-1) / 448)


@pytest.mark.parametrize("kw,match", [
    (dict(w=torch.zeros(2, 3, dtype=torch.int8)), "quantize_fp8_block takes float32"),
    (dict(w=torch.tensor([[1.0, float("nan")]])), "non-finite"),
    (dict(w=torch.ones(2, 3), group_size=0), "group_size=0"),
])  # fmt: skip
def test_quantizer_refuses(kw, match):
    with pytest.raises(LayoutError, match=match):
        quantize_fp8_block(**kw)


def test_options():
    assert parse_options(()).key() == "fp8_block:g128" and parse_options(("ch",)).key() == "fp8_block:ch"
    assert parse_options(("b128",)).group_size == 128
    for words, match in ((("g64",), "block size 64"), (("x",), "options are"), (("ch", "g128"), "given twice")):
        with pytest.raises(ConvertError, match=match):
            parse_options(words)


# ---------------------------------------------------------------------------------------------
# The packer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lay", F8_LAYOUTS, ids=[x.name for x in F8_LAYOUTS])
@pytest.mark.parametrize("interleaved", [False, True])
def test_codes_and_scales_sit_where_the_layout_says(lay, interleaved):
    e, h, i = 3, 320, 200
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    c = SCHEME.complete(SCHEME.from_float(w13, w2, layout=lay), lay)
    p = pack_experts_fp8(c, layout=lay, interleaved=interleaved)
    ip = layout_padded_i(lay, i)
    assert p.padded_intermediate == ip == 224
    gs = lay.group_size
    for name, q, sc in (("w13", c["w13_q"], c["w13_scale"]), ("w2", c["w2_q"], c["w2_scale"])):
        codes = unpack_codes(lay, p.tensors[name])  # [E, Np, Kp]
        k = q.shape[2]
        rows = (torch.arange(2 * i) if interleaved else torch.cat([torch.arange(i), ip + torch.arange(i)])) if name == "w13" else torch.arange(h)
        assert torch.equal(codes[:, rows, :k], q), name
        pad = torch.ones(codes.shape[1], dtype=torch.bool)
        pad[rows] = False
        assert not codes[:, pad].any() and not codes[:, :, k:].any()  # padding: code 0x00 = +0
        st = p.tensors[f"{name}_scale"]
        if gs:  # [E, groups of the padded K, Np]
            assert torch.equal(st[:, : sc.shape[2], rows], sc.transpose(1, 2))
            assert not st[:, :, pad].any() and not st[:, sc.shape[2] :].any()
        else:
            assert torch.equal(st[:, rows], sc[..., 0]) and not st[:, pad].any()
    spec = pack_experts_fp8(c, layout=lay, interleaved=interleaved, use_cpp=False)
    assert all(torch.equal(spec.tensors[k], v) for k, v in p.tensors.items())


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(w13_q=c["w13_q"].to(torch.int8)), "w13_q has dtype torch.int8: fp8_block codes are e4m3fn bit patterns"),
    (lambda c: c.update(w2_scale=c["w2_scale"][..., :1]), r"w2_scale has shape \[2, 64, 1\]: must be \[2, 64, 2\]"),
    (lambda c: c["w2_scale"].__setitem__((1, 3, 1), float("inf")), r"w2_scale\[1, 3, 1\] = inf: scales must be finite and > 0"),
    (lambda c: c["w13_scale"].__setitem__((0, 0, 0), 0.0), r"w13_scale\[0, 0, 0\] = 0.0"),
    (lambda c: c["w13_q"].__setitem__((0, 9, 4), 0x7F), r"w13_q\[0, 9, 4\] = 0x7F"),
    (lambda c: c.update(group_size=-1), "group_size=-1: layout f8g128_n32k2_x86 has group_size 128"),
])  # fmt: skip
def test_pack_refuses_bad_canonical_tensors(edit, match):
    c = SCHEME.from_float(torch.randn(2, 400, 64), torch.randn(2, 64, 200), layout=FP8_LAYOUT)  # w2: K = 200, 2 groups
    edit(c)
    with pytest.raises(LayoutError, match=match):
        pack_experts_fp8(c, layout=FP8_LAYOUT)


def test_pack_experts_on_float_weights_quantizes_and_round_trips():
    inp = make_moe_inputs(tokens=5, hidden=320, intermediate=200, experts=4, seed=3)
    for lay in F8_LAYOUTS:
        p = moepack.pack_experts(inp.w13, inp.w2, layout=lay)
        c = SCHEME.complete(SCHEME.from_float(inp.w13, inp.w2, layout=lay), lay)
        assert torch.equal(unpack_codes(lay, p.tensors["w2"])[:, :320, :200], c["w2_q"])
        w13, w2 = SCHEME.dequantize(c)
        assert float((w13 - inp.w13.float()).norm() / inp.w13.float().norm()) < 0.04
        assert float((w2 - inp.w2.float()).norm() / inp.w2.float().norm()) < 0.04
        out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids)
        ref32 = moe_reference(inp.x, inp.w13.float(), inp.w2.float(), inp.topk_weights, inp.topk_ids)
        assert float((out - ref32).norm() / ref32.norm()) < SCHEME.output_rule({"BF16"}).fp32_tol


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def computed(case: Case, layout_name: str = FP8_LAYOUT.name):
    lay = layout_get(layout_name)
    inp = case.inputs()
    c = SCHEME.complete(SCHEME.from_float(inp.w13, inp.w2, layout=lay), lay)
    p = SCHEME.pack({**c, "w13_bias": inp.w13_bias, "w2_bias": inp.w2_bias}, interleaved=inp.interleaved, layout=lay)
    kw = dict(case.act_kwargs, interleaved=inp.interleaved, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias)
    with isa_cap("scalar"):
        scalar = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, **case.act_kwargs)
    ref = moe_reference_fp8(inp.x, c, inp.topk_weights, inp.topk_ids, **kw)
    return inp, c, p, scalar, ref


def check(out, ref, dtype, what):
    assert out.dtype == dtype
    assert_close(out, ref, TOL["scalar_vs_reference", dtype] if dtype == F32 else TOL["half_vs_fp32_pipeline", dtype], what)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_scalar_matches_fp8_reference(case: Case):
    inp, c, p, scalar, ref = computed(case)
    assert scalar.shape == (case.tokens, case.hidden)
    check(scalar, ref, case.dtype, f"scalar {case.id}")


AWKWARD = [
    Case(F32, "silu", "1", 320, 200, 67, 5, True, 11),  # H and I ragged against 128 and 32
    Case(BF16, "swigluoai", "1", 130, 176, 3, 2, True, 12),
    Case(F16, "gelu", "1/sqrt(H)", 93, 40, 1, 1, False, 13),
    Case(BF16, "silu", "1/sqrt(H)", 1024, 256, 24, 2, False, 16),
]


def _simd_isas(lay) -> list[str]:
    out = []
    for isa in available_isas():
        if isa != "scalar":
            with isa_cap(isa):
                if moepack.kernel_choice(lay, "a16").isa == isa:
                    out.append(isa)
    return out


@pytest.mark.parametrize("lay", F8_LAYOUTS, ids=[x.name for x in F8_LAYOUTS])
@pytest.mark.parametrize("case", AWKWARD, ids=[c.id for c in AWKWARD])
def test_both_layouts_scalar_and_every_simd_level(case: Case, lay):
    inp, c, p, scalar, ref = computed(case, lay.name)
    check(scalar, ref, case.dtype, f"scalar {lay.name} {case.id}")
    for isa in _simd_isas(lay):
        with isa_cap(isa):
            out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, **case.act_kwargs)
        assert_close(out, scalar, TOL["simd_vs_scalar", case.dtype], f"{isa} {lay.name} {case.id}")


@pytest.mark.parametrize("lay", F8_LAYOUTS, ids=[x.name for x in F8_LAYOUTS])
def test_kernel_choice_says_which_level_runs(lay):
    """A host whose SIMD levels have no f8 kernel runs the scalar one and says so by name;
    one that has, picks the best of them."""
    ch, simd = moepack.kernel_choice(lay, "a16"), _simd_isas(lay)
    if simd:
        assert ch.isa in simd and not ch.is_fallback
    elif lay.family != host_family():  # another architecture's layout: scalar is this CPU's best for it
        assert ch.isa == "scalar" and not ch.is_fallback and f"for layout {lay.name} (" in ch.reason and ": not an " in ch.reason
    else:
        assert ch.isa == "scalar" and ch.is_fallback and lay.name in ch.reason


def test_every_finite_code_through_the_kernel():
    """Each of the 254 finite codes (subnormals, -0, +-448) in the weights, with scales across
    the fp32 range: the scalar kernel equals the reference on the exactly dequantized weights."""
    e, h, i = 2, 256, 128
    finite = torch.tensor([x for x in range(256) if x not in (0x7F, 0xFF)], dtype=torch.uint8)
    g = torch.Generator().manual_seed(5)
    q13 = finite[torch.randint(0, 254, (e, 2 * i, h), generator=g)]
    q2 = finite[torch.randint(0, 254, (e, h, i), generator=g)]
    q13[0, 0, :254] = finite
    q2[1, 3, :127] = finite[:127]
    s13 = torch.exp2(torch.randint(-12, 2, (e, 2 * i, 2), generator=g).float()) * 1.25
    s2 = torch.rand(e, h, 1, generator=g) * 1e-3 + 1e-4
    c = {"w13_q": q13, "w13_scale": s13, "w2_q": q2, "w2_scale": s2.expand(e, h, 1).contiguous(), "group_size": 128}
    p = pack_experts_fp8(c, layout=FP8_LAYOUT)
    x = torch.randn(7, h, generator=g) * 0.05
    w, ids = torch.softmax(torch.randn(7, e, generator=g), -1).topk(2)
    with isa_cap("scalar"):
        out = moepack.run_experts(p, x, w, ids.int())
    ref = moe_reference_fp8(x, c, w, ids.int())
    assert bool(torch.isfinite(ref).all())
    assert_close(out, ref, TOL["scalar_vs_reference", F32], "every finite code")
