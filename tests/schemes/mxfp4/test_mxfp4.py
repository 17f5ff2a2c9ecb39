"""mxfp4 experts (layout mx4g32_n32k8_x86, SEMANTICS.md §3 "mxfp4", OCP MX: W4A16 and W4A8).

Trust chain, one level per section:
* the codes: every e2m1 code and every e8m0 byte against values built from the bit fields; the
  quantizer's rule on crafted values (ties to even, saturation at 6, all-zero groups, amax
  exactly a power of two, the e8m0 range's ends, partial groups) and its error;
* the source library: compressed-tensors 0.20.1's own MXFP4 (its observer's scales, its
  ``mxfp4-pack-quantized`` compressor and decompressor) against our decode, bit for bit, and
  our quantizer against its codes;
* the packer: every code where the layout puts it (unpack_codes), e8m0 scales in packed row
  order, 0 in every padding row and group, the spec packer's bytes equal to the C++ packer's,
  refusals of bad canonical tensors;
* the oracle: A16 is the dense reference on the exactly dequantized weights; A8 the exact
  per-group integer sums on 2 * e2m1(q), scaled by 2^(e - 128), checked against an independent
  integer computation, and within SEMANTICS.md §4's 3e-2 of the fp32 pipeline;
* end to end: ``pack_experts`` on float weights through the kernels (both modes), convert
  ``--quantize mxfp4``, verify (e8m0 = 255 refused by open and verify DST), inspect, run, bench.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import moepack
from moepack.errors import LayoutError, PackedDirError
from moepack.layout import MXFP4_LAYOUT, layout_padded_i, layout_padded_k, layout_padded_n
from moepack.pack import unpack_codes
from moepack.reference import moe_reference
from moepack.schemes import get_scheme
from moepack.schemes.mxfp4 import (
    E2M1_VALUES,
    MXFP4_A8_FP32_TOL,
    MXFP4_FROM_FLOAT_TOL,
    check_mxfp4_canonical,
    decode_e2m1,
    dequantize_mxfp4,
    e8m0_to_float,
    moe_reference_mxfp4,
    mxfp4_linear_a8_reference,
    pack_experts_mxfp4,
    quantize_mxfp4,
)
from moepack.schemes.mxfp4.quantize import shared_exponent
from tests.conftest import isa_cap, make_moe_inputs
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import rewrite_tensor
from tests.reference.tolerances import TOL, assert_close, assert_close_int8

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
SCHEME = get_scheme("mxfp4")
LAY = MXFP4_LAYOUT


def cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


# ---------------------------------------------------------------------------------------------
# Codes and the quantizer
# ---------------------------------------------------------------------------------------------


def _e2m1_from_bits(q: int) -> float:
    sign = -1.0 if q & 8 else 1.0
    exp, man = (q >> 1) & 3, q & 1
    mag = man * 0.5 if exp == 0 else (1.0 + man / 2.0) * 2.0 ** (exp - 1)
    return sign * mag


def test_every_code_and_every_scale_from_the_bit_fields():
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.tensor([_e2m1_from_bits(q) for q in range(16)], dtype=F32)
    assert torch.equal(decode_e2m1(codes).view(torch.int32), want.view(torch.int32))  # -0 (code 8) included
    assert tuple(E2M1_VALUES) == tuple(want.tolist())
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e8m0_to_float(e)
    want = torch.tensor([math.ldexp(1.0, x - 127) for x in range(255)], dtype=torch.float64).float()
    assert torch.equal(got[:255], want) and bool(torch.isnan(got[255]))
    assert got[0].item() == 2.0**-127 and got[254].item() == 2.0**127  # the ends: an fp32 subnormal, the top
    # every (code, scale) product within fp32's range is exact in fp32 (e2m1 has 2 significant
    # bits; the smallest, 0.5 * 2^-127, is a subnormal); beyond it (|e2m1| >= 2 with e = 254, >= 4
    # with e = 253: 12 pairs no quantizer writes) fp32 holds inf
    prod = decode_e2m1(codes)[:, None].double() * got[None, :255].double()
    finite = prod.abs() <= torch.finfo(F32).max
    assert torch.equal(prod.float().double()[finite], prod[finite]) and int((~finite).sum()) == 12
    assert torch.equal(dequantize_mxfp4(codes.repeat(255, 1), e[:255, None]), prod.t().float())


def _one_group(*vals: float, k: int = 32) -> torch.Tensor:
    w = torch.zeros(1, k)
    w[0, : len(vals)] = torch.tensor(vals)
    return w


@pytest.mark.parametrize("vals,e,codes", [
    # amax 6 -> s = floor(log2 6) - 2 = 0: the values are the grid; ties go to the even code
    ((6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), 127, (7, 0, 2, 2, 4, 4, 6, 6)),
    ((6.0, 0.2500001, 0.7499999, 1.2500001, 1.7499999, 2.5000002, 3.4999998, 5.0000005), 127, (7, 1, 1, 3, 3, 5, 5, 7)),
    ((-6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0), 127, (15, 8, 10, 10, 12, 12, 14, 14)),  # -0.25 -> -0
    # saturation: amax in (6, 8) * 2^s is clipped to 6 * 2^s
    ((7.9, 6.5, -7.0, 6.0), 127, (7, 7, 15, 7)),
    # amax exactly a power of two lands on code 6 (4 * 2^s)
    ((4.0, 1.0, 0.5), 127, (6, 2, 1)),
    ((8.0, 1.0, 0.5), 128, (6, 1, 0)),  # s = 1: 1 / 2 = 0.5, 0.5 / 2 = 0.25 (tie -> 0)
    ((0.5, -0.125), 124, (6, 10)),  # s = -3: -0.125 * 8 = -1
    ((2.0**-126, 2.0**-127), 0, (4, 2)),  # s = -128 clamped to -127 (e = 0): 2^-126 = 2 * 2^-127
    ((2.0**-140,), 0, (0,)),  # far below 2^-127 * 0.25: rounds to 0 with the smallest scale
    ((3.0e38, -1.0e38), 252, (7, 12)),  # floor(log2 3e38) = 127 -> s = 125: 7.05 saturates to 6, -2.35 -> -2
])  # fmt: skip
def test_quantizer_rule_on_crafted_values(vals, e, codes):
    q, s = quantize_mxfp4(_one_group(*vals))
    assert s.tolist() == [[e]]
    assert q[0, : len(codes)].tolist() == list(codes), q[0, : len(codes)].tolist()
    assert not q[0, len(codes) :].any()


def test_rounding_is_nearest_even_on_a_sweep():
    """round_to_e2m1 against a brute-force nearest-even search in float64, on every midpoint, one
    fp32 ulp either side of it, and a dense sweep of [-9, 9]."""
    from moepack.schemes.mxfp4.quantize import round_to_e2m1

    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    v = torch.cat([mids, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 9.0)),
                   torch.linspace(-9, 9, 20001)])  # fmt: skip
    v = torch.cat([v, -v])
    d = (v.double().abs()[:, None] - grid[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = (d == best).int() * (8 - torch.arange(8) % 2)  # among equally near codes, an even one wins
    want = cand.argmax(dim=1).to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)
    assert torch.equal(round_to_e2m1(v), want)


def test_quantizer_groups_zero_groups_and_partial_groups():
    w = torch.zeros(3, 70)  # groups of 32, 32 and 6 real values
    w[0, 0:32] = torch.linspace(-1.0, 1.0, 32)
    w[0, 64:70] = torch.tensor([0.0, 3.0, -0.1, 0.0, 0.0, 0.0])  # the partial group's amax from its own values
    w[2, 33] = -1e-3
    q, s = quantize_mxfp4(w)
    assert q.shape == (3, 70) and s.shape == (3, 3) and q.dtype == s.dtype == torch.uint8
    assert s.tolist() == [[125, 127, 126], [127, 127, 127], [127, 115, 127]]  # zero groups: 127 (scale 1)
    assert not q[1].any() and not q[0, 32:64].any()
    d = dequantize_mxfp4(q, s)
    assert not d[1].any()  # a zero group stays 0
    assert d[0, 65].item() == 3.0 and d[2, 33].item() == -2.0**-10 * 1.0  # -1e-3 = -1.024 * 2^-10 -> -1 * 2^-10
    for dt in (BF16, F16):  # 16-bit sources quantize like their fp32 values
        q2, s2 = quantize_mxfp4(w.to(dt))
        q3, s3 = quantize_mxfp4(w.to(dt).float())
        assert torch.equal(q2, q3) and torch.equal(s2, s3)


def test_shared_exponent_is_floor_log2_minus_2_over_the_fp32_range():
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.exp2(torch.empty(4000).uniform_(-149, 127.9, generator=g)), torch.tensor([0.0, 1.0, 6.0, 7.99])])
    e = shared_exponent(amax).int()
    lg = torch.floor(torch.log2(amax.double())).int() - 2 + 127
    want = torch.where(amax == 0, torch.full_like(lg, 127), lg.clamp(0, 254))
    assert torch.equal(e, want)
    assert int(e.max()) <= 254


@pytest.mark.parametrize("w,match", [
    (torch.ones(2, 32, dtype=torch.int32), "dtype torch.int32: quantize_mxfp4 takes float32"),
    (torch.ones(32), r"shape \[32\]: must be \[\.\.\., N, K\]"),
    (torch.tensor([[1.0, float("nan")]]), r"weight has a non-finite value at \[0, 1\]"),
    (torch.ones(3, 4, 40).index_put_((torch.tensor(2), torch.tensor(1), torch.tensor(33)), torch.tensor(float("inf"))),
     r"weight has a non-finite value at \[2, 1, 33\]"),
])  # fmt: skip
def test_quantizer_refuses(w, match):
    with pytest.raises(LayoutError, match=match):
        quantize_mxfp4(w)


def test_quantization_error_as_documented():
    """quantize.py's numbers: Gaussian weights within ~0.115 (Frobenius, relative), Student-t(3)
    ~0.14; every value within a quarter of its group's amax (saturation and half a grid step)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 1024, generator=g)
    q, s = quantize_mxfp4(w)
    d = dequantize_mxfp4(q, s)
    rel = float((d - w).norm() / w.norm())
    assert 0.105 < rel < 0.125, rel
    amax = w.view(64, 32, 32).abs().amax(-1, keepdim=True)
    assert bool(((d - w).view(64, 32, 32).abs() <= amax / 4).all())
    t = torch.distributions.StudentT(3.0).sample((64, 1024))
    qt, st = quantize_mxfp4(t)
    relt = float((dequantize_mxfp4(qt, st) - t).norm() / t.norm())
    assert 0.12 < relt < 0.16, relt


# ---------------------------------------------------------------------------------------------
# compressed-tensors' own MXFP4
# ---------------------------------------------------------------------------------------------


def _ct():
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    return MXFP4PackedCompressor, preset_name_to_scheme("MXFP4A16", ["Linear"]), calculate_qparams


def _ct_codes(packed: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' weight_packed [N, K / 2] (low nibble = even k) -> codes [N, K]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def test_compressed_tensors_decode_is_ours_bit_for_bit():
    """The library quantizes with its own observer scales and writes mxfp4-pack-quantized; its
    decompression equals dequantize_mxfp4 of the same bytes, bit for bit."""
    comp, scheme, qparams = _ct()
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 160, generator=g) * 0.02).to(BF16)
    grp = w.float().view(96, 5, 32)
    scale_f, _ = qparams(grp.amin(-1), grp.amax(-1), scheme.weights)  # the library's observer: 2^(e - 127)
    sd = comp.compress({"weight": w, "weight_scale": scale_f}, scheme)
    packed, e = sd["weight_packed"], sd["weight_scale"]
    assert packed.dtype == torch.uint8 and e.dtype == torch.uint8 and packed.shape == (96, 80) and e.shape == (96, 5)
    assert torch.equal(e8m0_to_float(e), scale_f) and 110 < int(e.min()) and int(e.max()) < 127
    codes = _ct_codes(packed)
    assert len(codes.unique()) == 16  # every code occurs
    ours = dequantize_mxfp4(codes, e)
    theirs = comp.decompress({"weight_packed": packed, "weight_scale": e}, scheme)["weight"]
    assert torch.equal(theirs.float(), ours)
    assert float((ours - w.float()).norm() / w.float().norm()) < 0.2


def test_our_quantizer_against_compressed_tensors():
    """Where the library's observer picks OCP's exponent (amax's mantissa below 1.75) the e8m0
    bytes agree; above, the library rounds the exponent up (one more). Given the same scales,
    its compressor's codes are ours, code for code (round to nearest even, saturating)."""
    comp, scheme, qparams = _ct()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g) * 0.05
    q, e = quantize_mxfp4(w)
    grp = w.view(128, 8, 32)
    amax = grp.abs().amax(-1)
    scale_f, _ = qparams(grp.amin(-1), grp.amax(-1), scheme.weights)
    theirs = torch.log2(scale_f).to(torch.int32) + 127
    assert torch.equal(e8m0_to_float(theirs.to(torch.uint8)), scale_f)
    mant = amax / torch.exp2(torch.floor(torch.log2(amax)))
    up = mant >= 1.75
    assert bool(up.any()) and bool((~up).any())
    assert torch.equal(theirs.to(torch.int32)[~up], e.to(torch.int32)[~up])
    assert torch.equal(theirs.to(torch.int32)[up], e.to(torch.int32)[up] + 1)
    sd = comp.compress({"weight": w, "weight_scale": e8m0_to_float(e)}, scheme)  # our scales, its rounding
    assert torch.equal(sd["weight_scale"], e)
    got = _ct_codes(sd["weight_packed"])
    nonzero = dequantize_mxfp4(q, e) != 0  # +-0: the library signs a value rounded to 0 too, as we do
    assert torch.equal(got[nonzero], q[nonzero])
    assert torch.equal(decode_e2m1(got), decode_e2m1(q))


# ---------------------------------------------------------------------------------------------
# The packer
# ---------------------------------------------------------------------------------------------


def _canonical(e, h, i, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * scale, torch.randn(e, h, i, generator=g) * scale
    return SCHEME.from_float(w13, w2, layout=LAY)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("h,i", [(320, 200), (70, 40), (2880 // 9, 96)])
def test_codes_and_scales_sit_where_the_layout_says(interleaved, h, i):
    e = 3
    c = _canonical(e, h, i, seed=h + i)
    p = pack_experts_mxfp4(c, layout=LAY, interleaved=interleaved)
    ip = layout_padded_i(LAY, i)
    assert p.padded_intermediate == ip and ip % 32 == 0
    for name, q, sc in (("w13", c["w13_q"], c["w13_scale"]), ("w2", c["w2_q"], c["w2_scale"])):
        codes = unpack_codes(LAY, p.tensors[name])  # [E, Np, Kp]
        k = q.shape[2]
        assert codes.shape[2] == (layout_padded_k(LAY, h) if name == "w13" else layout_padded_k(LAY, ip))
        rows = (torch.arange(2 * i) if interleaved else torch.cat([torch.arange(i), ip + torch.arange(i)])) if name == "w13" else torch.arange(h)
        assert torch.equal(codes[:, rows, :k], q), name
        pad = torch.ones(codes.shape[1], dtype=torch.bool)
        pad[rows] = False
        assert not codes[:, pad].any() and not codes[:, :, k:].any()  # padding: code 0 = +0
        st = p.tensors[f"{name}_scale"]  # [E, Kp / 32, Np] uint8
        assert st.dtype == torch.uint8 and st.shape == (e, -(-codes.shape[2] // 32), codes.shape[1])
        assert torch.equal(st[:, : sc.shape[2], rows], sc.transpose(1, 2))
        assert not st[:, :, pad].any() and not st[:, sc.shape[2] :].any()  # padding scales 0
    assert p.tensors["w2"].shape[1] == layout_padded_n(LAY, h) and p.tensors["w13"].shape[1] == 2 * ip
    spec = pack_experts_mxfp4(c, layout=LAY, interleaved=interleaved, use_cpp=False)  # the specification
    assert all(torch.equal(spec.tensors[k], v) for k, v in p.tensors.items())


def test_scales_are_a_sixteenth_of_the_codes():
    p = pack_experts_mxfp4(_canonical(2, 256, 128), layout=LAY)
    for w in ("w13", "w2"):
        assert p.tensors[f"{w}_scale"].nbytes * 16 == p.tensors[w].nbytes


def test_codes_are_placed_like_u4():
    """The mx4 layout puts code (n, k) exactly where the u4 layouts put theirs (the contract)."""
    from moepack.layout import INT4_LAYOUT
    from moepack.pack import pack_codes

    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (2, 64, 96), generator=g, dtype=torch.uint8)
    assert torch.equal(pack_codes(LAY, q), pack_codes(INT4_LAYOUT, q))


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(w13_q=c["w13_q"].to(torch.int8)), "w13_q / w13_scale have dtypes torch.int8/torch.uint8"),
    (lambda c: c.update(w2_scale=c["w2_scale"][..., :1]), r"w2_scale has shape \[2, 64, 1\]: must be \[2, 64, 7\]"),
    (lambda c: c["w2_scale"].__setitem__((1, 3, 6), 255), r"w2_scale\[1, 3, 6\] = 255: the e8m0 NaN"),
    (lambda c: c["w13_q"].__setitem__((0, 9, 4), 16), r"w13_q\[0, 9, 4\] = 16: e2m1 codes are 0..15"),
    (lambda c: c.update(w2_q=c["w2_q"][:, :, :-1]), r"w2 has shape \[2, 64, 199\]: must be \[E, H, I\]"),
])  # fmt: skip
def test_pack_refuses_bad_canonical_tensors(edit, match):
    c = SCHEME.from_float(torch.randn(2, 400, 64), torch.randn(2, 64, 200), layout=LAY)  # w2: K = 200, 7 groups
    edit(c)
    for use_cpp in (True, False):
        with pytest.raises(LayoutError, match=match):
            pack_experts_mxfp4(c, layout=LAY, use_cpp=use_cpp)


def test_check_canonical_names_the_first_nan_scale():
    q = torch.zeros(1, 4, 64, dtype=torch.uint8)
    s = torch.full((1, 4, 2), 127, dtype=torch.uint8)
    check_mxfp4_canonical("w13", q, s)
    s[0, 2, 1] = 255
    with pytest.raises(LayoutError, match=r"w13_scale\[0, 2, 1\] = 255"):
        check_mxfp4_canonical("w13", q, s)


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------


def test_a16_reference_is_the_dense_reference_on_the_exact_weights():
    inp = make_moe_inputs(tokens=6, hidden=200, intermediate=88, experts=4, bias=True, seed=5)
    c = SCHEME.from_float(inp.w13, inp.w2, layout=LAY)
    # the dequantized weights, independently: per element, in float64 from the bit fields
    q, s = c["w2_q"], c["w2_scale"]
    vals = torch.tensor([_e2m1_from_bits(x) for x in range(16)], dtype=torch.float64)
    ind = vals[q.long()] * torch.exp2(s.double() - 127).repeat_interleave(32, -1)[..., : q.shape[-1]]
    assert torch.equal(dequantize_mxfp4(q, s).double(), ind)
    kw = dict(w13_bias=inp.w13_bias, w2_bias=inp.w2_bias, activation="swigluoai")
    w13, w2 = SCHEME.dequantize(c)
    out = moe_reference_mxfp4(inp.x, c, inp.topk_weights, inp.topk_ids, **kw)
    assert torch.equal(out, moe_reference(inp.x, w13, w2, inp.topk_weights, inp.topk_ids, **kw))
    out2, flip = SCHEME.reference(inp.x, c, inp.topk_weights, inp.topk_ids, **kw)
    assert torch.equal(out2, out) and flip == 0.0


def test_a8_linear_is_the_exact_integer_sum_per_group():
    """A8: per group of 32 the integer sum of x_s8 * 2 e2m1(q) (int64 here), times 2^(e - 128)
    in fp32, groups in order, times the token's scale; K = 200 (a partial last group)."""
    g = torch.Generator().manual_seed(6)
    n, k = 48, 200
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    e = torch.randint(100, 140, (n, 7), generator=g).to(torch.uint8)
    e[0, 0], e[1, 6] = 0, 254  # the ends of the e8m0 range
    xq = torch.randint(-127, 128, (5, k), generator=g).float()
    xs = torch.rand(5, 1, generator=g) * 0.01
    got = mxfp4_linear_a8_reference(xq, xs, q, e, None)
    w2x = torch.tensor([round(2 * _e2m1_from_bits(x)) for x in range(16)], dtype=torch.int64)[q.long()]  # -12..12
    want = torch.zeros(5, n, dtype=F32)
    for gi in range(7):
        acc = xq[:, gi * 32 : (gi + 1) * 32].long() @ w2x[:, gi * 32 : (gi + 1) * 32].t()
        want = want + acc.float() * torch.tensor([math.ldexp(1.0, int(v) - 128) for v in e[:, gi]], dtype=F32)
    want = want * xs
    assert torch.equal(got, want)


def test_a8_reference_against_the_fp32_pipeline():
    """The A8 rounding (per-token int8 of x and of the intermediate) stays within SEMANTICS.md
    §4's 3e-2 of the fp32 reference on the same dequantized weights (the output rule's bound)."""
    worst = 0.0
    for seed, act in ((7, "silu"), (8, "swigluoai"), (9, "gelu")):
        inp = make_moe_inputs(tokens=9, hidden=320, intermediate=200, experts=5, topk=2, seed=seed)
        c = SCHEME.from_float(inp.w13, inp.w2, layout=LAY)
        w13, w2 = SCHEME.dequantize(c)
        ref32 = moe_reference(inp.x, w13, w2, inp.topk_weights, inp.topk_ids, activation=act)
        out, flip = moe_reference_mxfp4(inp.x, c, inp.topk_weights, inp.topk_ids, act_mode="a8", activation=act,
                                        return_flip=True)  # fmt: skip
        rel = float((out - ref32).norm() / ref32.norm())
        assert 0 < rel < MXFP4_A8_FP32_TOL and flip > 0, (act, rel)
        worst = max(worst, rel)
    assert worst > 1e-3  # A8 does round (it is not the A16 result)
    with pytest.raises(ValueError, match="act_mode='a4'"):
        moe_reference_mxfp4(inp.x, c, inp.topk_weights, inp.topk_ids, act_mode="a4")


def test_output_rules():
    r = SCHEME.output_rule({"U8"})
    assert r.base == 1e-5 and r.flips == 2.0 and r.fp32_tol == MXFP4_A8_FP32_TOL
    assert SCHEME.output_rule({"BF16"}).fp32_tol == MXFP4_FROM_FLOAT_TOL


# ---------------------------------------------------------------------------------------------
# End to end: kernels, convert, verify, the CLI
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,act,h,i,t", [
    (F32, "silu", 320, 200, 7),
    (BF16, "swigluoai", 130, 176, 3),
    (F16, "gelu", 93, 40, 1),
    (BF16, "silu", 2880 // 9, 96, 67),
])  # fmt: skip
def test_pack_experts_on_float_weights_through_the_kernels(dtype, act, h, i, t):
    """``pack_experts(w13, w2, layout=mx4...)`` quantizes float weights itself (the peers'
    harness relies on it); both modes against the oracle, and against the float source."""
    inp = make_moe_inputs(tokens=t, hidden=h, intermediate=i, experts=5, topk=2, dtype=dtype, bias=True,
                          interleaved=act == "swigluoai", seed=h + t)  # fmt: skip
    p = moepack.pack_experts(inp.w13, inp.w2, inp.w13_bias, inp.w2_bias, layout=LAY.name, interleaved=inp.interleaved)
    assert isinstance(vars(p)["w13"], torch.Tensor) and p.layout is LAY  # what bench_moepack.py reads
    c = SCHEME.from_float(inp.w13, inp.w2, layout=LAY)
    kw = dict(activation=act, interleaved=inp.interleaved, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias)
    ref32 = moe_reference(inp.x.float(), inp.w13.float(), inp.w2.float(), inp.topk_weights, inp.topk_ids, **kw)
    for mode in ("a16", "a8"):
        out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, activation=act, act_mode=mode)
        ref, flip = moe_reference_mxfp4(inp.x, c, inp.topk_weights, inp.topk_ids, act_mode=mode, return_flip=True, **kw)
        if mode == "a16":
            assert_close(out, ref, TOL["scalar_vs_reference" if dtype == F32 else "half_vs_fp32_pipeline", dtype], mode)
        else:
            assert_close_int8(out, ref, TOL["int8_scalar_vs_reference", dtype], flip, mode)
        rel = float((out.float() - ref32).norm() / ref32.norm())
        assert rel < MXFP4_FROM_FLOAT_TOL, (mode, rel)


def test_act_mode_per_call_environment_and_default(monkeypatch):
    inp = make_moe_inputs(tokens=4, hidden=128, intermediate=64, seed=10)
    p = moepack.pack_experts(inp.w13, inp.w2, layout=LAY.name)

    def run(mode):
        return moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode)

    a16, a8 = run("a16"), run("a8")
    assert not torch.equal(a16, a8) and torch.equal(run(None), a16)  # the layout's default: a16
    monkeypatch.setenv("MOEPACK_ACT_MODE", "a8")
    assert torch.equal(run(None), a8) and torch.equal(run("a16"), a16)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_convert_quantize_mxfp4_from_float(tmp_path, name):
    src, dst = fixture_dir(name), tmp_path / "p"
    report = moepack.convert(src, dst, quantize="mxfp4")
    assert 0.10 < report.quant_error < 0.13, report.quant_error
    m = json.loads((dst / "moepack.json").read_text())
    assert all(moepack.layout_get(x["layout_id"]).name == LAY.name for x in m["layers"])
    assert all(x["quantizer"] == "mxfp4" and x["act_mode"] == "a16" for x in m["layers"])
    assert all(x["scheme_source"].startswith("quantized by moepack from BF16 (mxfp4") for x in m["layers"])
    assert moepack.verify(dst).ok
    report = moepack.verify(dst, source=src)
    assert report.ok, report.failures()
    for x in report.layers:
        assert x.weights_exact and x.rel_err <= 1e-5 and x.fp32_tol == MXFP4_FROM_FLOAT_TOL and x.rel_err_fp32 < 0.3, x


def test_convert_act_mode_a8_verifies_in_a8(tmp_path):
    src, dst = fixture_dir("qwen3_moe"), tmp_path / "p"
    moepack.convert(src, dst, quantize="mxfp4", act_mode="a8")
    m = json.loads((dst / "moepack.json").read_text())
    assert all(x["act_mode"] == "a8" for x in m["layers"]) and m["act_mode_option"] == "a8"
    report = moepack.verify(dst, source=src)
    assert report.ok, report.failures()
    assert all(x.act_mode == "a8" and x.rel_err_fp32 < 0.3 for x in report.layers)


def test_nan_scale_in_a_checksum_consistent_pack_is_refused(tmp_path):
    """An e8m0 byte 255 (NaN) written with its sha256 fixed: open refuses the directory and
    verify DST names the tensor, the element and the rule."""
    d = tmp_path / "p"
    moepack.convert(fixture_dir("qwen3_moe"), d, quantize="mxfp4")
    name = "moepack.layers.1.w2_scale"
    rewrite_tensor(d, name, lambda t: t.view(-1).__setitem__(5, 255))
    with pytest.raises(PackedDirError, match=rf"{name!r} \[0, 0, 5\] = 255: e8m0 scale 255 is NaN"):
        moepack.open(d)
    report = moepack.verify(d)
    assert not report.ok
    fails = " ".join(report.failures())
    assert f"{name!r} [0, 0, 5] = 255: e8m0 scale 255 is NaN" in fails, fails


def test_cli_convert_inspect_verify_run_bench(tmp_path):
    src, dst = fixture_dir("gpt_oss"), tmp_path / "p"
    r = cli("convert", src, dst, "--quantize", "mxfp4", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["quantizer"] == "mxfp4"
    r = cli("convert", src, tmp_path / "q", "--quantize", "mxfp4:g32")
    assert r.exit_code != 0 and "scheme mxfp4 takes no options" in r.output, r.output
    r = cli("verify", dst)
    assert r.exit_code == 0, r.output
    r = cli("inspect", dst, "--json")
    assert r.exit_code == 0, r.output
    r = cli("verify", dst, "--source", src)
    assert r.exit_code == 0, r.output
    r = cli("run", dst, "--tokens", "3", "--json", "--act-mode", "a8")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert all(x["act_mode"] == "a8" and 0 < x["out_rms"] < float("inf") for x in res)
    for mode in ("a16", "a8"):
        r = cli("bench", "--scheme", "mxfp4", "--act-mode", mode, "--shapes", "e4k2h320i200", "--tokens", "1,5", "--no-probe",
                "--calls", "3", "--min-time", "0.01", "--json", tmp_path / f"b{mode}.json", "-q")  # fmt: skip
        assert r.exit_code == 0, r.output
        rows = json.loads((tmp_path / f"b{mode}.json").read_text())["rows"]
        assert {x["scheme"] for x in rows} == {"mxfp4"} and len(rows) == 2
        assert all(x["check_rel_diff"] is not None and x["check_rel_diff"] < SCHEME.bench.check_tol for x in rows)


def test_a_pack_copy_with_the_scales_intact_still_opens(tmp_path):
    """The value rule does not refuse a good pack (the 0 scales of padding included)."""
    d = tmp_path / "p"
    moepack.convert(fixture_dir("gpt_oss"), d, quantize="mxfp4")
    e = tmp_path / "copy"
    shutil.copytree(d, e)
    m = moepack.open(e)
    s = m.tensor("moepack.layers.0.w13_scale")
    assert s.dtype == torch.uint8 and int(s.max()) < 255 and bool((s == 0).any())
