"""fp8_block experts (layouts f8g128_n32k2_x86, f8ch_n32k2_x86; e4m3fn codes, W8A16): the kernels.

The Python scheme (moepack/schemes/fp8) is not what this file tests: the packed tensors are built
here from their layout's declaration (``pack_codes`` puts each e4m3fn bit pattern where
``layout_element_offset`` says; scales transposed to [E, ceil(Kp / 128), Np] or [E, Np] in packed
row order, 0 in padding), so the kernels are checked against the layout alone.

Trust chain (ARCHITECTURE.md principle 6): the codes' values are torch's own float8_e4m3fn
(every finite code, subnormals and -0 on purpose); the scalar kernel against moe_reference on the
dequantized weights (fp8(q) * s in fp32, exact); every SIMD level this CPU runs against scalar;
all over the kernel test matrix (tests/support/kernel_cases.py: every dtype x activation x input scale,
awkward shapes) plus expert_map, k = E, and the NaN codes (the same NaN on every level).
Every level's decoder is checked code by code (all 256, bit for bit) by tests/cpp (kt_fp8.inc).
"""

from __future__ import annotations

import functools

import pytest
import torch

import moepack
from moepack.isa import available_isas
from moepack.layout import LAYOUTS, layout_element_offset, layout_expert_shapes, layout_get, layout_padded_i, layout_padded_k, layout_padded_n
from moepack.pack import PackedExperts, pack_biases, pack_codes, pad_intermediate, with_biases
from moepack.reference import moe_reference
from tests.conftest import isa_cap, make_moe_inputs, run_packed
from tests.support.kernel_cases import CASES, E, Case
from tests.reference.tolerances import TOL, assert_close
from tests.support import skips

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
F8_LAYOUTS = [x for x in LAYOUTS if x.scheme == "fp8_block"]
F8G = layout_get("f8g128_n32k2_x86")
E4M3_MAX = 448.0
# every finite e4m3fn code's value (NaN codes 0x7F / 0xFF give nan)
CODE_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
FINITE_CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)


def isas_running(layout) -> list[str]:
    """The SIMD levels whose fp8 kernel this host runs (each one chosen with the cap at it)."""
    out = []
    for isa in available_isas():
        if isa == "scalar":
            continue
        with isa_cap(isa):
            if moepack.kernel_choice(layout).isa == isa:
                out.append(isa)
    return out


def quantize_fp8(w: torch.Tensor, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (codes uint8 [E, N, K], scales fp32 [E, N, ng]): per (row, K group of
    ``group``) (0: per row) amax / 448, q = e4m3fn(w / s); then 1 code in 16 replaced by a random
    finite code (subnormals, -0, +-448 included: every code path of the decode)."""
    e, n, k = w.shape
    g = group or k
    ng = -(-k // g)
    wp = torch.zeros(e, n, ng * g)
    wp[..., :k] = w.float()
    blocks = wp.view(e, n, ng, g)
    amax = blocks.abs().amax(-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(e, n, ng * g)[..., :k].contiguous()
    gen = torch.Generator().manual_seed(seed)
    pick = torch.rand(q.shape, generator=gen) < 1 / 16
    q[pick] = FINITE_CODES[torch.randint(0, len(FINITE_CODES), (int(pick.sum()),), generator=gen)]
    return q, scale.float()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """fp8(q) * s in fp32, per code (fp8(q) is exact; the product is rounded once)."""
    k = q.shape[-1]
    g = group or k
    s = scale.repeat_interleave(g, dim=-1)[..., :k]
    return CODE_VALUES[q.long()] * s


def pack_f8_weight(name: str, q, scale, lay, *, interleaved: bool = False) -> dict[str, torch.Tensor]:
    """One weight's codes [E, N, K] and scales [E, N, ng] -> {name, name_scale} as the layout declares."""
    e, n, k = q.shape
    if name == "w13":
        ip = layout_padded_i(lay, n // 2)
        q, scale = pad_intermediate(q, ip, interleaved), pad_intermediate(scale, ip, interleaved)
        np_, kp = 2 * ip, layout_padded_k(lay, k)
    else:
        np_, kp = layout_padded_n(lay, n), layout_padded_k(lay, layout_padded_i(lay, k))
    codes = pack_codes(lay, q, n_padded=np_, k_padded=kp)
    if lay.group_size:
        s = torch.zeros(e, -(-kp // lay.group_size), np_)
        s[:, : scale.shape[2], : scale.shape[1]] = scale.transpose(1, 2)
    else:
        s = torch.zeros(e, np_)
        s[:, : scale.shape[1]] = scale[..., 0]
    return {name: codes, f"{name}_scale": s}


def pack_fp8_experts(inp, lay, seed: int):
    """(PackedExperts, dequantized w13, dequantized w2) of ``inp``'s weights quantized to fp8."""
    q13, s13 = quantize_fp8(inp.w13, lay.group_size, seed)
    q2, s2 = quantize_fp8(inp.w2, lay.group_size, seed + 1)
    e, two_i, h = inp.w13.shape
    i = two_i // 2
    shapes = layout_expert_shapes(lay, e, h, i)
    b13, b2 = pack_biases(inp.w13_bias, inp.w2_bias, e, h, i, inp.interleaved, lay)
    t = pack_f8_weight("w13", q13, s13, lay, interleaved=inp.interleaved)
    t.update(pack_f8_weight("w2", q2, s2, lay))
    p = PackedExperts(layout=lay, num_experts=e, hidden=h, intermediate=i, padded_intermediate=shapes.padded_intermediate,
                      interleaved=inp.interleaved, tensors=with_biases(t, b13, b2))  # fmt: skip
    return p, dequantize_fp8(q13, s13, lay.group_size), dequantize_fp8(q2, s2, lay.group_size)


def test_packed_codes_sit_where_the_layout_says():
    q = torch.randint(0, 256, (2, 70, 75), dtype=torch.uint8)
    flat = pack_codes(F8G, q, n_padded=96, k_padded=76).reshape(2, -1)
    for e, n, k in ((0, 0, 0), (1, 69, 74), (0, 33, 1), (1, 31, 64), (0, 64, 13)):
        assert int(flat[e, layout_element_offset(F8G, n, k, 76)]) == int(q[e, n, k])
    assert int(flat[0, layout_element_offset(F8G, 70, 0, 76)]) == 0 and int(flat[0, layout_element_offset(F8G, 0, 75, 76)]) == 0


@functools.lru_cache(maxsize=None)
def computed(case: Case, layout_name: str = F8G.name):
    lay = layout_get(layout_name)
    inp = case.inputs()
    p, w13, w2 = pack_fp8_experts(inp, lay, case.seed)
    with isa_cap("scalar"):
        scalar = run_packed(p, inp, **case.act_kwargs)
    kw = dict(case.act_kwargs, interleaved=inp.interleaved, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias)
    ref = moe_reference(inp.x, w13, w2, inp.topk_weights, inp.topk_ids, **kw)
    ref32 = moe_reference(inp.x.float(), w13, w2, inp.topk_weights, inp.topk_ids, **kw)
    return inp, p, scalar, ref, ref32


def check(out, ref, ref32, dtype, kind: str, what: str):
    assert_close(out, ref, TOL[kind, dtype], what)
    assert_close(out, ref32, TOL["scalar_vs_reference" if dtype == F32 else "half_vs_fp32_pipeline", dtype], what + " vs fp32")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_scalar_matches_reference(case: Case):
    inp, p, scalar, ref, ref32 = computed(case)
    assert scalar.shape == (case.tokens, case.hidden) and scalar.dtype == case.dtype
    check(scalar, ref, ref32, case.dtype, "scalar_vs_reference", f"scalar {case.id}")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_simd_matches_scalar(case: Case):
    inp, p, scalar, ref, ref32 = computed(case)
    isas = isas_running(F8G)
    if not isas:
        skips.host_lacks(f"a SIMD fp8 kernel level (flags: {moepack.cpu_flags()})")
    for isa in isas:
        with isa_cap(isa):
            out = run_packed(p, inp, **case.act_kwargs)
        check(out, scalar, ref32, case.dtype, "simd_vs_scalar", f"{isa} {case.id}")


AWKWARD = [
    Case(F32, "silu", "1", 200, 88, 67, 5, True, 21),  # k = E, T = 67: > one 64-row chunk per expert
    Case(BF16, "swigluoai", "1", 130, 176, 3, 2, True, 22),  # interleaved w13, I = 5.5 blocks
    Case(F16, "gelu", "1/sqrt(H)", 93, 40, 1, 1, False, 23),  # odd H (K padding inside a pair), k = 1
    Case(BF16, "gelu_tanh", "1/sqrt(H)", 520, 264, 24, 2, False, 24),  # 4 groups + 8; the tile paths
    Case(F32, "swigluoai_a1.2_l0.75", "4", 300, 136, 1, 3, True, 25),  # decode, a partial last group
    # decode: 1 and 2 rows per expert through the decode streams (H 1024: 8 groups in 4 or 2
    # segments; I 256: 2 groups, 2 segments)
    Case(BF16, "silu", "1", 1024, 256, 1, 4, True, 29),
    Case(BF16, "gelu", "1/sqrt(H)", 1024, 256, 2, 5, False, 30),
    # decode with groups that do not deal out to the segments (K 1000: 7 groups + 104; 4 or 2
    # groups streamed as segments, the rest in one stream after them): 1, 2 and 3 rows
    Case(BF16, "silu", "1", 1000, 200, 1, 4, True, 31),
    Case(BF16, "gelu", "1/sqrt(H)", 1000, 200, 2, 5, False, 32),
    Case(BF16, "silu", "1", 744, 104, 3, 2, True, 33),
]


@pytest.mark.parametrize("lay", F8_LAYOUTS, ids=[x.name for x in F8_LAYOUTS])
@pytest.mark.parametrize("case", AWKWARD, ids=[c.id for c in AWKWARD])
def test_both_layouts_on_every_level(case: Case, lay):
    inp, p, scalar, ref, ref32 = computed(case, lay.name)
    check(scalar, ref, ref32, case.dtype, "scalar_vs_reference", f"scalar {lay.name} {case.id}")
    for isa in isas_running(lay):
        with isa_cap(isa):
            out = run_packed(p, inp, **case.act_kwargs)
        check(out, scalar, ref32, case.dtype, "simd_vs_scalar", f"{isa} {lay.name} {case.id}")


def test_expert_map_and_threads():
    """Global ids through expert_map (two of 9 global experts are remote), on every level, and
    the same bits with 1 and 2 threads."""
    inp = make_moe_inputs(tokens=9, hidden=136, intermediate=88, experts=6, topk=3, dtype=BF16, bias=True, seed=26)
    p, w13, w2 = pack_fp8_experts(inp, F8G, 26)
    emap = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5, -1], dtype=torch.int32)
    glob = torch.tensor([0, 2, 3, 5, 6, 7])  # local e -> global id
    gen = torch.Generator().manual_seed(27)
    ids = torch.stack([torch.randperm(9, generator=gen)[:3] for _ in range(9)]).to(torch.int32)
    kw = dict(interleaved=False, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias)
    # the reference on global ids: remote experts' slots contribute nothing
    local = torch.full((9,), -1, dtype=torch.long)
    local[glob] = torch.arange(6)
    ref = moe_reference(inp.x, w13, w2, inp.topk_weights, ids, expert_map=emap, **kw)
    assert (local[ids.long()] >= 0).any() and (local[ids.long()] < 0).any()
    with isa_cap("scalar"):
        scalar = run_packed(p, inp, topk_ids=ids, expert_map=emap)
    assert_close(scalar, ref, TOL["scalar_vs_reference", BF16], "scalar expert_map")
    for isa in isas_running(F8G):
        with isa_cap(isa):
            outs = []
            for threads in (1, 2):
                before = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    outs.append(run_packed(p, inp, topk_ids=ids, expert_map=emap))
                finally:
                    torch.set_num_threads(before)
        assert torch.equal(outs[0], outs[1]), f"{isa}: 1 and 2 threads differ"
        assert_close(outs[0], scalar, TOL["simd_vs_scalar", BF16], f"{isa} expert_map")


def test_nan_codes_give_the_same_nan_everywhere():
    """A hostile pack (the NaN codes 0x7F / 0xFF, refused at convert) gives NaN in exactly the
    outputs the scalar kernel gives it, on every level: no CPU-dependent result."""
    inp = make_moe_inputs(tokens=5, hidden=200, intermediate=88, experts=3, topk=1, dtype=F32, seed=28)
    p, _, _ = pack_fp8_experts(inp, F8G, 28)
    w2 = p.tensors["w2"].clone()
    w2.view(3, -1)[1, layout_element_offset(F8G, 7, 3, w2.shape[-1])] = 0xFF  # expert 1, output 7, K 3
    w2.view(3, -1)[2, layout_element_offset(F8G, 40, 50, w2.shape[-1])] = 0x7F
    bad = PackedExperts(layout=F8G, num_experts=3, hidden=200, intermediate=88, padded_intermediate=p.padded_intermediate,
                        interleaved=False, tensors={**p.tensors, "w2": w2})  # fmt: skip
    ids = torch.tensor([[0], [1], [2], [1], [0]], dtype=torch.int32)
    w = torch.ones(5, 1)
    with isa_cap("scalar"):
        scalar = run_packed(bad, inp, topk_ids=ids, topk_weights=w)
    want = torch.zeros(5, 200, dtype=torch.bool)
    want[1, 7] = want[3, 7] = want[2, 40] = True
    assert torch.equal(scalar.isnan(), want)
    for isa in isas_running(F8G):
        with isa_cap(isa):
            out = run_packed(bad, inp, topk_ids=ids, topk_weights=w)
        assert torch.equal(out.isnan(), want), f"{isa}: NaN outputs differ from scalar's"
        assert_close(out.nan_to_num(0.0), scalar.nan_to_num(0.0), TOL["simd_vs_scalar", F32], f"{isa} finite outputs")


def test_every_f8_layout_has_its_best_level():
    """The dispatcher picks a SIMD level for the host family's f8 layouts wherever one serves them
    (x86: avx2 and up); another family's layouts run scalar, as the CPU's best for them."""
    from moepack.isa import host_family

    for lay in F8_LAYOUTS:
        choice = moepack.kernel_choice(lay)
        assert not choice.is_fallback, choice.reason
        if lay.family == host_family() and any(isa != "scalar" for isa in available_isas()):
            assert choice.isa != "scalar", choice.reason


def test_word_table_copy_where_vbmi_picks_the_byte_tables():
    """On a CPU with AVX512-VBMI the avx512_bf16 level's few-row kernel runs the byte tables;
    MOEPACK_F8_WORD_TABLES=1 (read once per process) forces its word-table copy, which a CPU
    without VBMI (Cooper Lake) runs: the awkward cases above, in a process that forces it, so the
    copy is checked natively here and not only under SIMDe (tests/cpp)."""
    import os
    import subprocess
    import sys

    if "avx512_bf16" not in isas_running(F8G) or "avx512vbmi" not in moepack.cpu_flags():
        skips.host_lacks("avx512_bf16 with AVX512-VBMI: without them the word-table copy is what this CPU runs anyway")
    env = dict(os.environ, MOEPACK_F8_WORD_TABLES="1", MOEPACK_MAX_ISA="avx512_bf16")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_both_layouts_on_every_level"],
                       env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-500:]
