"""int8 W8A8 experts (layout i8_n32k4_x86, SEMANTICS.md §3 "int8 channel" with A8 activations).

Trust chain (ARCHITECTURE.md principle 6), one level per section:
* the quantizer and the packer: round half to even, the zero-row rule, Python spec packer ==
  C++ packer byte for byte, scales / column sums in packed row order;
* the integer core: every ISA's int32 block accumulators identical to the scalar kernel's and to
  exact integer matmuls (``torch.ops.moepack.gemm_i8_block``), -128 codes and extremes included;
* the kernels: scalar vs ``moe_reference_int8`` (same quantization in torch), SIMD vs scalar,
  and both vs the fp32 pipeline on the dequantized weights, over the kernel test matrix
  (tests/support/kernel_cases.py); the activation rounding pinned bitwise; threads, expert_map;
  refusals; opcheck.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch

import moepack
from moepack.errors import LayoutError
from moepack.isa import KERNEL_ISAS, available_isas
from moepack.layout import INT8_LAYOUT, layout_element_offset, layout_expert_shapes
from moepack.pack import pack_weight_reference, unpack_weight_reference
from moepack.reference import moe_reference
from moepack.schemes.int8 import dequantize_int8, moe_reference_int8, pack_experts_int8, quantize_int8_per_channel
from tests.conftest import isa_cap, make_moe_inputs
from tests.support.kernel_cases import CASES, Case
from tests.reference.tolerances import TOL, assert_close_int8
from tests.support import skips

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OPS = torch.ops.moepack
L = INT8_LAYOUT
E = 5

# opcheck's internals (not moepack) still call torch.jit.script_method
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def int8_isas() -> list[str]:
    """SIMD ISAs with an int8 kernel this host runs."""
    out = []
    for isa in available_isas():
        if isa == "scalar":
            continue
        with isa_cap(isa):
            if moepack.kernel_choice(L)[0] == isa:
                out.append(isa)
    return out


SIMD = list(KERNEL_ISAS["i8"][1:])  # the levels with an int8 kernel


def need_int8_isa(isa: str) -> None:
    if isa not in int8_isas():
        skips.host_lacks(f"the {isa} level (no {isa} int8 kernel runs on this CPU; flags: {moepack.cpu_flags()})")


# ---------------------------------------------------------------------------------------------
# Quantizer and packer
# ---------------------------------------------------------------------------------------------


def test_quantize_per_channel_rule():
    # row 0: amax 127 -> scale 1: ties round half to even; row 1: all zero -> scale 1, codes 0;
    # row 2: amax 2.54 -> scale 0.02 (fp32); row 3: a negative amax gives -127, never -128
    w = torch.tensor(
        [
            [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5],
            [0.0] * 8,
            [2.54, -1.0, 0.01, 0.03, -0.01, 0.0, 1.27, -2.54],
            [-3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.5],
        ]
    )
    q, s = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and s.dtype == F32 and s.shape == (4,)
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert s[1].item() == 1.0 and q[1].abs().sum().item() == 0
    s2 = torch.tensor(2.54, dtype=F32) / 127
    assert s[2].item() == s2.item()
    assert q[2].tolist() == torch.round(w[2] / s2).clamp(-127, 127).to(torch.int8).tolist()
    assert q[3, 0].item() == -127 and q.min().item() >= -127
    # 3-D (experts), bf16 input: per [e, n] row
    w3 = torch.randn(3, 5, 9).to(BF16)
    q3, s3 = quantize_int8_per_channel(w3)
    assert s3.shape == (3, 5) and q3.shape == (3, 5, 9)
    assert torch.equal(q3.abs().amax(-1), torch.full((3, 5), 127, dtype=torch.int8))
    assert (dequantize_int8(q3, s3) - w3.float()).abs().max() <= s3.max() / 2 * (1 + 1e-6)


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.zeros(4, 4, dtype=torch.int8), "dtype torch.int8"),
        (torch.tensor([[1.0, float("nan")]]), "non-finite"),
        (torch.tensor([[1.0, float("inf")]]), "non-finite"),
        (torch.zeros(4), "must be"),
    ],
)
def test_quantize_refuses(bad, match):
    with pytest.raises(LayoutError, match=match):
        quantize_int8_per_channel(bad)


def random_codes(e: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Codes over the whole int8 range, -128 (compressed-tensors can store it) and +-127 included."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (e, n, k), generator=g, dtype=torch.int32)
    q.view(-1)[::7] = -128
    q.view(-1)[3::11] = 127
    return q.to(torch.int8)


@pytest.mark.parametrize("shape", [(2, 35, 5), (3, 64, 200), (1, 1, 1), (2, 96, 93), (1, 33, 130)])
def test_cpp_packer_equals_python_spec(shape):
    q = random_codes(*shape, seed=sum(shape))
    e, n, k = shape
    ref = pack_weight_reference(q, L)
    got = OPS.pack_weight(q, L.id)
    assert got.dtype == torch.int8 and ref.dtype == torch.int8 and got.shape == ref.shape
    assert torch.equal(got, ref)
    assert torch.equal(unpack_weight_reference(got, n, k, L), q)
    # the layout formula, element by element, and zero padding
    np_, kp = got.shape[1:]
    flat = got.view(e, -1)
    nn, kk = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    off = torch.tensor([layout_element_offset(L, a, b, kp) for a, b in zip(nn.flatten().tolist(), kk.flatten().tolist())])
    assert torch.equal(flat[:, off].view(e, n, k), q)
    mask = torch.ones(np_ * kp, dtype=torch.bool)
    mask[off] = False
    assert flat[:, mask].abs().sum().item() == 0
    # with explicit padding
    assert torch.equal(OPS.pack_weight(q, L.id, n_padded=np_ + 32, k_padded=kp + 8),
                       pack_weight_reference(q, L, n_padded=np_ + 32, k_padded=kp + 8))  # fmt: skip


@pytest.mark.parametrize("interleaved", [False, True])
def test_pack_experts_int8_tensors(interleaved):
    e, h, i = 3, 93, 40
    q13, q2 = random_codes(e, 2 * i, h, 1), random_codes(e, h, i, 2)
    s13, s2 = torch.rand(e, 2 * i) + 0.1, (torch.rand(e, h) + 0.1).to(BF16)
    b13, b2 = torch.randn(e, 2 * i), torch.randn(e, h)
    p = pack_experts_int8(q13, s13.unsqueeze(-1), q2, s2, b13, b2, interleaved=interleaved)
    py = pack_experts_int8(q13, s13, q2, s2.unsqueeze(-1), b13, b2, interleaved=interleaved, use_cpp=False)
    shapes = layout_expert_shapes(L, e, h, i)
    ip, np2 = shapes.padded_intermediate, shapes.w2_shape[1]
    assert p.layout is L and p.w13.shape == shapes.w13_shape and p.w2.shape == shapes.w2_shape
    for name, t in p.tensors.items():
        assert torch.equal(t, py.tensors[name]), f"{name}: C++ and Python packers differ"
    rows = torch.arange(2 * i) if interleaved else torch.cat([torch.arange(i), ip + torch.arange(i)])
    pad = torch.ones(2 * ip, dtype=torch.bool)
    pad[rows] = False
    assert p.w13_scale.dtype == F32 and p.w13_scale.shape == (e, 2 * ip)
    assert torch.equal(p.w13_scale[:, rows], s13) and p.w13_scale[:, pad].abs().sum() == 0
    assert torch.equal(p.w13_colsum[:, rows], q13.int().sum(-1, dtype=torch.int32)) and p.w13_colsum[:, pad].abs().sum() == 0
    assert p.w2_scale.shape == (e, np2) and torch.equal(p.w2_scale[:, :h], s2.float()) and p.w2_scale[:, h:].abs().sum() == 0
    assert p.w2_colsum.dtype == torch.int32 and torch.equal(p.w2_colsum[:, :h], q2.int().sum(-1, dtype=torch.int32))
    assert torch.equal(p.w13_bias[:, rows], b13)
    # the packed codes are the canonical ones in packed row order
    assert torch.equal(unpack_weight_reference(p.w13, 2 * ip, h, L)[:, rows], q13)
    assert torch.equal(unpack_weight_reference(p.w2, h, ip, L)[:, :, :i], q2)
    assert p.nbytes == sum(t.numel() * t.element_size() for t in p.tensors.values())


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(w13_q=a["w13_q"].float()), "w13 has dtype torch.float32"),
        (lambda a: a.update(w2_q=a["w2_q"].to(torch.int16)), "w2 has dtype torch.int16"),
        (lambda a: a["w13_scale"].__setitem__((1, 3), 0.0), r"w13_scale\[1, 3\] = 0.0.*finite and > 0"),
        (lambda a: a["w13_scale"].__setitem__((0, 0), -1.0), r"w13_scale\[0, 0\] = -1.0"),
        (lambda a: a["w2_scale"].__setitem__((2, 5), float("nan")), r"w2_scale\[2, 5\] = nan"),
        (lambda a: a["w2_scale"].__setitem__((0, 1), float("inf")), r"w2_scale\[0, 1\] = inf"),
        (lambda a: a.update(w2_scale=torch.ones(3, 93, 2)), r"w2_scale has shape \[3, 93, 2\].*per output channel"),
        (lambda a: a.update(w13_scale=torch.ones(3, 1)), r"w13_scale has shape \[3, 1\]"),
        (lambda a: a.update(w13_scale=torch.ones(3, 80, dtype=torch.int32)), "w13_scale has dtype torch.int32"),
        (lambda a: a.update(w2_q=a["w2_q"][:, :, :-1]), r"w2 has shape \[3, 93, 39\]"),
    ],
)
def test_pack_experts_int8_refuses(mutate, match):
    args = dict(w13_q=random_codes(3, 80, 93, 3), w13_scale=torch.ones(3, 80), w2_q=random_codes(3, 93, 40, 4),
                w2_scale=torch.ones(3, 93))  # fmt: skip
    mutate(args)
    with pytest.raises(LayoutError, match=match):
        pack_experts_int8(**args)


def test_pack_experts_quantizes_for_an_int8_layout():
    inp = make_moe_inputs(tokens=1, hidden=72, intermediate=40, seed=5)
    p = moepack.pack_experts(inp.w13, inp.w2, layout=L)
    q13, s13 = quantize_int8_per_channel(inp.w13)
    q2, s2 = quantize_int8_per_channel(inp.w2)
    ref = pack_experts_int8(q13, s13, q2, s2)
    for name, t in ref.tensors.items():
        assert torch.equal(p.tensors[name], t), name
    with pytest.raises(LayoutError, match=r"get_scheme\(.int8_channel.\)\.pack"):
        moepack.pack_experts(q13, q2, layout=L)


# ---------------------------------------------------------------------------------------------
# The integer core: accumulators bitwise identical across ISAs and to exact integer matmuls
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kp", [4, 200, 2052])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 12, 13, 25, 64, 67])  # every u8 tile size (6..12: 8 rows one tile, 13 = 6 + 7)
def test_block_accumulators_are_identical(m, kp):
    g = torch.Generator().manual_seed(m * 10007 + kp)
    rows = torch.randint(-127, 128, (m, kp), generator=g, dtype=torch.int32).to(torch.int8)
    rows[0, : kp // 2] = 127 if m % 2 else -127  # extremes: the largest |sums|
    w = random_codes(1, 32, kp, seed=m + kp)
    w[0, 0] = -128  # every product of -128 x +-127
    block = pack_weight_reference(w, L).reshape(-1)
    colsum = w[0].int().sum(-1, dtype=torch.int32)
    exact = (rows.long() @ w[0].long().t()).int()
    assert OPS.gemm_i8_block(rows, block, colsum, L.id, "scalar").equal(exact)
    ran = []
    for isa in SIMD:
        if isa not in int8_isas():
            continue
        got = OPS.gemm_i8_block(rows, block, colsum, L.id, isa)
        assert got.equal(exact), f"{isa}: {int((got != exact).sum())} accumulators differ from the exact ones"
        ran.append(isa)
    assert "avx2" in ran or "avx2" not in available_isas()


def test_block_gemm_refuses():
    rows, block, cs = torch.zeros(2, 8, dtype=torch.int8), torch.zeros(256, dtype=torch.int8), torch.zeros(32, dtype=torch.int32)
    with pytest.raises(ValueError, match="not an int8_channel layout"):
        OPS.gemm_i8_block(rows, block, cs, moepack.DEFAULT_LAYOUT.id, "scalar")
    with pytest.raises(ValueError, match="isa='sse' is not one of"):
        OPS.gemm_i8_block(rows, block, cs, L.id, "sse")
    with pytest.raises(ValueError, match="block has shape"):
        OPS.gemm_i8_block(rows, block[:-1], cs, L.id, "scalar")


# ---------------------------------------------------------------------------------------------
# Kernels vs the torch int8 reference, SIMD vs scalar, and vs fp32 on the dequantized weights,
# over the kernel test matrix of tests/support/kernel_cases.py (full product of dtype x activation x
# input scale; every pair of shape / tokens / top-k / bias values)
# ---------------------------------------------------------------------------------------------


@dataclass
class Int8Computed:
    inp: object
    packed: moepack.PackedExperts
    scalar: torch.Tensor
    ref: torch.Tensor
    flip: float
    ref_fp32: torch.Tensor


def run_int8(p: moepack.PackedExperts, inp, **kw) -> torch.Tensor:
    x = kw.pop("x", inp.x)
    return moepack.fused_experts(x, p.weight("w13"), p.weight("w2"), inp.topk_weights, inp.topk_ids, layout=p.layout,
                                 w13_bias=p.w13_bias, w2_bias=p.w2_bias, **kw)  # fmt: skip


@functools.lru_cache(maxsize=None)
def computed(case: Case) -> Int8Computed:
    inp = case.inputs()
    q13, s13 = quantize_int8_per_channel(inp.w13)
    q2, s2 = quantize_int8_per_channel(inp.w2)
    p = pack_experts_int8(q13, s13, q2, s2, inp.w13_bias, inp.w2_bias, interleaved=inp.interleaved)
    kw = case.act_kwargs
    with isa_cap("scalar"):
        scalar = run_int8(p, inp, **kw)
    ref, flip = moe_reference_int8(inp.x, q13, s13, q2, s2, inp.topk_weights, inp.topk_ids, w13_bias=inp.w13_bias,
                                   w2_bias=inp.w2_bias, return_flip=True, **kw)  # fmt: skip
    ref32 = moe_reference(inp.x.float(), dequantize_int8(q13, s13), dequantize_int8(q2, s2), inp.topk_weights,
                          inp.topk_ids, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias, **kw)  # fmt: skip
    return Int8Computed(inp, p, scalar, ref, flip, ref32)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_scalar_matches_int8_reference(case: Case):
    c = computed(case)
    assert c.scalar.shape == (case.tokens, case.hidden) and c.scalar.dtype == case.dtype
    assert_close_int8(c.scalar, c.ref, TOL["int8_scalar_vs_reference", case.dtype], c.flip, case.id)
    assert_close_int8(c.scalar, c.ref_fp32, TOL["int8_vs_fp32_dequantized", case.dtype], 0.0, case.id)


@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_simd_matches_scalar_int8(isa: str, case: Case):
    need_int8_isa(isa)
    c = computed(case)
    with isa_cap(isa):
        out = run_int8(c.packed, c.inp, **case.act_kwargs)
    assert_close_int8(out, c.scalar, TOL["int8_simd_vs_scalar", case.dtype], c.flip, f"{isa} {case.id}")
    assert_close_int8(out, c.ref_fp32, TOL["int8_vs_fp32_dequantized", case.dtype], 0.0, f"{isa} {case.id}")


def every_isa() -> list[str]:
    return ["scalar"] + int8_isas()


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_activation_quantization_is_pinned(dtype):
    """x rows with amax 127 have scale exactly 1, so each code is round_half_even(x), ties
    included; the weights are built so that out == those codes exactly: gate bias 64 (silu(64)
    = 64 in fp32), up row i = code 1 at column i with scale 1/64, so a_i = code_i exactly; the
    intermediate's amax is 127 again (scale 1) and w2 is the identity with scale 1."""
    n = 12
    x = torch.tensor(
        [
            [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.25, -3.75, 0.0],
            [-127.0, 4.5, 5.5, -4.5, -5.5, 0.25, 7.5, 8.5, 100.5, 101.5, -100.49, 127.0],
        ]
    )
    expected = torch.round(x)
    e, i = 1, n
    q13 = torch.zeros(e, 2 * i, n, dtype=torch.int8)
    q13[0, i:] = torch.eye(n, dtype=torch.int8)
    s13 = torch.cat([torch.ones(i), torch.full((i,), 1 / 64)]).view(1, -1)
    b13 = torch.cat([torch.full((i,), 64.0), torch.zeros(i)]).view(1, -1)
    q2 = torch.eye(n, dtype=torch.int8).view(1, n, n)
    p = pack_experts_int8(q13, s13, q2, torch.ones(1, n), b13, None)
    ids = torch.zeros(2, 1, dtype=torch.int32)
    for isa in every_isa():
        with isa_cap(isa):
            out = moepack.fused_experts(x.to(dtype), p.weight("w13"), p.weight("w2"), torch.ones(2, 1), ids, layout=L,
                                        w13_bias=p.w13_bias)  # fmt: skip
        assert torch.equal(out.float(), expected), f"{isa} {dtype}: {out.float()} != {expected}"
    ref = moe_reference_int8(x.to(dtype), q13, s13, q2, torch.ones(1, n), torch.ones(2, 1), ids, w13_bias=b13)
    assert torch.equal(ref.float(), expected)


@pytest.mark.parametrize("isa", ["scalar"] + SIMD)
def test_thread_count_and_expert_map(isa, threads):
    if isa != "scalar":
        need_int8_isa(isa)
    inp = make_moe_inputs(tokens=67, hidden=130, intermediate=176, topk=E, dtype=BF16, bias=True, seed=42)
    q13, s13 = quantize_int8_per_channel(inp.w13)
    q2, s2 = quantize_int8_per_channel(inp.w2)
    p = pack_experts_int8(q13, s13, q2, s2, inp.w13_bias, inp.w2_bias)
    outs = []
    with isa_cap(isa):
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(run_int8(p, inp))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        # a rank holding experts [3, 0]: its tokens' slots on other ranks contribute nothing
        own = [3, 0]
        local = pack_experts_int8(q13[own], s13[own], q2[own], s2[own], inp.w13_bias[own], inp.w2_bias[own])
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[own] = torch.arange(2, dtype=torch.int32)
        part = run_int8(local, inp, expert_map=emap)
    ref = moe_reference_int8(inp.x, q13[own], s13[own], q2[own], s2[own], inp.topk_weights, inp.topk_ids,
                             w13_bias=inp.w13_bias[own], w2_bias=inp.w2_bias[own], expert_map=emap)  # fmt: skip
    assert_close_int8(part, ref, TOL["int8_scalar_vs_reference", BF16], 0.0, f"{isa} expert_map")


# ---------------------------------------------------------------------------------------------
# The op: refusals, Meta, opcheck
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def small_packed():
    inp = make_moe_inputs(tokens=3, hidden=93, intermediate=40, topk=2, bias=True, seed=11)
    return inp, moepack.pack_experts(inp.w13, inp.w2, inp.w13_bias, inp.w2_bias, layout=L)


# One weight = the layout's declared tensors in order: [codes, scale, colsum] (moepack/layout.py).
@pytest.mark.parametrize(
    "weight,index,change,exc,match",
    [
        ("w13", 1, None, ValueError, r"w13 is a list of 2 tensors: layout i8_n32k4_x86 packs a weight as 3 \(w13, w13_scale, w13_colsum\)"),
        ("w2", 2, None, ValueError, "w2 is a list of 2 tensors"),
        ("w13", 1, "f64", TypeError, r"w13\[1\] \(w13_scale\) has dtype Double: must be Float"),
        ("w2", 1, "short", ValueError, r"w2\[1\] \(w2_scale\) has shape \[5, 95\]: must be \[5, 96\] \(float32 scales of layout i8_n32k4_x86"),
        ("w13", 2, "f32", TypeError, r"w13\[2\] \(w13_colsum\) has dtype Float: must be Int"),
        ("w13", 0, "bf16", TypeError, r"w13\[0\] \(w13\) has dtype BFloat16: must be Char"),
    ],
)
def test_fused_experts_int8_refuses(weight, index, change, exc, match):
    inp, p = small_packed()
    ws = {"w13": p.weight("w13"), "w2": p.weight("w2")}
    t = ws[weight][index]
    if change is None:
        del ws[weight][index]
    else:
        ws[weight][index] = {"f64": t.double(), "short": t[:, :95].contiguous(), "f32": t.float(), "bf16": t.to(BF16)}[change]
    with pytest.raises(exc, match=match):
        moepack.fused_experts(inp.x, ws["w13"], ws["w2"], inp.topk_weights, inp.topk_ids, layout=L)


def test_bf16_layout_refuses_scales():
    inp, p = small_packed()
    bp = moepack.pack_experts(inp.w13, inp.w2)
    with pytest.raises(ValueError, match=r"w13 is a list of 3 tensors: layout bf16_n32k2_x86 packs a weight as 1 \(w13\)"):
        moepack.fused_experts(inp.x, [bp.w13, p.w13_scale, p.w13_colsum], bp.w2, inp.topk_weights, inp.topk_ids)


def test_meta_and_opcheck_int8():
    inp, p = small_packed()
    args = (inp.x, p.weight("w13"), p.weight("w2"), inp.topk_weights, inp.topk_ids, L.id)
    kwargs = dict(activation="gelu_tanh", interleaved=False, w13_bias=p.w13_bias, w2_bias=p.w2_bias)
    result = torch.library.opcheck(OPS.fused_experts.default, args, kwargs)
    assert set(result.values()) == {"SUCCESS"}, result

    def meta(v):
        if isinstance(v, list):
            return [meta(t) for t in v]
        return v.to("meta") if isinstance(v, torch.Tensor) else v

    out = OPS.fused_experts(*meta(list(args)), **{k: meta(v) for k, v in kwargs.items()})
    assert out.shape == inp.x.shape and out.device.type == "meta"
    result = torch.library.opcheck(OPS.pack_weight.default, (random_codes(2, 45, 93, 9), L.id))
    assert set(result.values()) == {"SUCCESS"}, result
    with pytest.raises(TypeError, match="packs int8 codes"):
        OPS.pack_weight(torch.randn(2, 45, 93), L.id)


def test_run_experts_passes_the_scales():
    inp, p = small_packed()
    out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids)
    assert torch.equal(out, run_int8(p, inp))
    assert math.isfinite(out.abs().max().item())


def test_bench_int8_scheme():
    from moepack import bench as B

    # "int8" is an alias: the rows carry the scheme's one name
    cfg = B.BenchConfig(shapes=B.parse_shapes("tiny"), tokens=[1, 3], threads=1, scheme="int8", calls=1, probe=False)
    result = B.run_benchmark(cfg)
    assert [r.scheme for r in result.rows] == ["int8_channel", "int8_channel"]
    assert all(r.moepack_gbs > 0 and r.check_rel_diff is not None and r.check_rel_diff < 0.08 for r in result.rows)
    assert any("--scheme int8_channel" in n for n in result.notes)
    assert "bf16/int8_channel" in B.render_markdown(result)
    with pytest.raises(ValueError, match="--scheme: scheme 'int3' is unknown; known schemes: dense, fp8_block, int4_group, int8_channel"):
        B.BenchConfig(scheme="int3").validate()
