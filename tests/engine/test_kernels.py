"""Kernel correctness: every ISA path vs the scalar C++ kernel, and the scalar kernel vs
moepack/reference.py (ARCHITECTURE.md principle 6: reference -> scalar -> SIMD), on shapes that
are awkward on purpose (SEMANTICS.md §4), plus the routing edge cases (expert parallelism,
out-of-range ids, empty batches, strided activations, thread-count invariance).

The matrix: the full product of (dtype x activation x input scale) - the axes that change which
code runs inside the kernels - and every PAIR of values of all seven axes covered at least once
(a greedy covering array, built deterministically in tests/support/kernel_cases.py).
``test_matrix_is_what_it_claims`` pins its size and proves the coverage, so an axis cannot
silently lose a value.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import pytest
import torch

import moepack
from moepack.reference import moe_reference
from tests.conftest import MoeInputs, isa_cap, make_moe_inputs, reference, run_packed
from tests.support.kernel_cases import (
    ACTIVATIONS,
    AXES,
    BF16,
    CASES,
    E,
    EXPECTED_CASES,
    F16,
    F32,
    FULL_PRODUCT_AXES,
    ROWS,
    Case,
)
from tests.reference.tolerances import TOL, assert_close


def test_matrix_is_what_it_claims():
    assert len(CASES) == EXPECTED_CASES, f"the kernel matrix has {len(CASES)} cases, expected {EXPECTED_CASES}"
    assert len({c.id for c in CASES}) == len(CASES), "duplicate case ids"
    # every value of every axis appears (the torchao lesson: a column silently lost)
    for name, values in AXES.items():
        seen = {r[name] for r in ROWS}
        assert seen == set(values), f"axis {name}: values {set(values) - seen} never tested"
    # every pair of values of two axes appears
    for a, b in itertools.combinations(AXES, 2):
        seen = {(r[a], r[b]) for r in ROWS}
        missing = set(itertools.product(AXES[a], AXES[b])) - seen
        assert not missing, f"axes {a} x {b}: pairs {missing} never tested"
    # the code-path axes are a full product
    seen = {tuple(r[n] for n in FULL_PRODUCT_AXES) for r in ROWS}
    assert len(seen) == 3 * 5 * 3
    # every gated activation (the non-gated relu2, whose w13 has no gate half, is tests/engine/test_relu2.py's)
    assert len(ACTIVATIONS) == 5 and {v["activation"] for v in ACTIVATIONS.values()} == set(moepack._ops.ACTIVATIONS) - {"relu2"}


@dataclass
class Computed:
    inp: MoeInputs
    packed: moepack.PackedExperts
    scalar: torch.Tensor  # the scalar C++ kernel
    ref: torch.Tensor  # moe_reference, same rounding points
    ref_fp32: torch.Tensor  # fp32 pipeline (x upcast, no intermediate rounding, no final cast)


@functools.lru_cache(maxsize=None)
def computed(case: Case) -> Computed:
    inp = case.inputs()
    packed = inp.pack()
    with isa_cap("scalar"):
        scalar = run_packed(packed, inp, **case.act_kwargs)
    ref = reference(inp, **case.act_kwargs)
    ref_fp32 = moe_reference(
        inp.x.float(), inp.w13, inp.w2, inp.topk_weights, inp.topk_ids,
        w13_bias=inp.w13_bias, w2_bias=inp.w2_bias, **case.act_kwargs,
    )  # fmt: skip
    return Computed(inp, packed, scalar, ref, ref_fp32)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_scalar_matches_reference(case: Case):
    c = computed(case)
    assert c.scalar.shape == (case.tokens, case.hidden) and c.scalar.dtype == case.dtype
    assert_close(c.scalar, c.ref, TOL["scalar_vs_reference", case.dtype], case.id)
    if case.dtype != F32:  # SEMANTICS.md §4: bf16 activations vs fp32 reference
        assert_close(c.scalar, c.ref_fp32, TOL["half_vs_fp32_pipeline", case.dtype], case.id)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_simd_matches_scalar(simd_isa: str, case: Case):
    c = computed(case)
    out = run_packed(c.packed, c.inp, **case.act_kwargs)
    assert out.shape == (case.tokens, case.hidden) and out.dtype == case.dtype
    assert_close(out, c.scalar, TOL["simd_vs_scalar", case.dtype], f"{simd_isa} {case.id}")
    if case.dtype != F32:
        assert_close(out, c.ref_fp32, TOL["half_vs_fp32_pipeline", case.dtype], f"{simd_isa} {case.id}")


def check_every_path(isa: str, inp: MoeInputs, what: str, **kw) -> torch.Tensor:
    """Scalar kernel vs the reference, and ``isa``'s kernel vs the scalar one; returns isa's."""
    packed = inp.pack()
    with isa_cap("scalar"):
        scalar = run_packed(packed, inp, **kw)
    dtype = inp.x.dtype
    assert_close(scalar, reference(inp, **kw), TOL["scalar_vs_reference", dtype], what)
    if isa == "scalar":
        return scalar
    out = run_packed(packed, inp, **kw)
    assert_close(out, scalar, TOL["simd_vs_scalar", dtype], f"{isa} {what}")
    return out


# ---------------------------------------------------------------------------------------------
# Routing shapes the matrix does not reach
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_many_rows_per_expert(isa, dtype):
    """Row chunks of 64: 130 rows on one expert (2 full chunks + 2), 200 on two others."""
    inp = make_moe_inputs(tokens=200, hidden=72, intermediate=40, topk=2, dtype=dtype, bias=True, seed=7)
    inp.topk_ids[:, 0] = 1
    inp.topk_ids[:, 1] = 3
    inp.topk_ids[:130, 1] = 4
    check_every_path(isa, inp, "many rows")


@pytest.mark.parametrize("bias", [False, True])
def test_large_output_is_streamed(isa, bias):
    """Past 2 MiB of expert outputs (fused_moe_driver.inc kStreamYBytes) stage 2 stores them
    with non-temporal stores: 500 tokens x top-4 x H 520 (padded to 544) = 4.4 MB of them, the
    last column block part padding; under an expert_map 3 of the 5 experts are local, ~2.6 MB
    of rows written, and some tokens have no local expert."""
    inp = make_moe_inputs(tokens=500, hidden=520, intermediate=40, topk=4, dtype=BF16, bias=bias, seed=11)
    check_every_path(isa, inp, "streamed output")
    local, expert_map = local_inputs(inp, [0, 2, 3])
    check_every_path(isa, local, "streamed output, expert map", expert_map=expert_map)


def test_repeated_expert_in_one_token(isa):
    """Two slots of a token naming the same expert both count (in slot order)."""
    inp = make_moe_inputs(tokens=3, hidden=93, intermediate=40, topk=3, bias=True, seed=8)
    inp.topk_ids[:] = torch.tensor([[2, 2, 2], [0, 4, 0], [1, 1, 3]], dtype=torch.int32)
    check_every_path(isa, inp, "repeated expert")


def test_unused_experts_and_zero_weights(isa):
    """Experts no token picks are skipped; a zero routing weight contributes exactly zero."""
    inp = make_moe_inputs(tokens=5, hidden=72, intermediate=40, topk=2, seed=9)
    inp.topk_ids[:] = 2
    inp.topk_ids[:, 1] = 0
    inp.topk_weights[:, 1] = 0.0
    out = check_every_path(isa, inp, "unused experts")
    only_slot0 = run_packed(inp.pack(), inp, topk_weights=inp.topk_weights[:, :1].contiguous(),
                            topk_ids=inp.topk_ids[:, :1].contiguous())  # fmt: skip
    assert torch.equal(out, only_slot0)


# ---------------------------------------------------------------------------------------------
# Expert parallelism (SEMANTICS.md §1): expert_map [E_global] -> local id or -1
# ---------------------------------------------------------------------------------------------


def split_experts(num_experts: int, ranks: int, how: str) -> list[list[int]]:
    if how == "contiguous":
        return [c.tolist() for c in torch.arange(num_experts).tensor_split(ranks)]
    return [list(range(r, num_experts, ranks)) for r in range(ranks)]  # round robin


def local_inputs(inp: MoeInputs, owned: list[int]) -> tuple[MoeInputs, torch.Tensor]:
    """The experts one rank holds (in the order of ``owned``) and its expert_map."""
    idx = torch.tensor(owned)
    local = MoeInputs(
        x=inp.x,
        w13=inp.w13[idx],
        w2=inp.w2[idx],
        w13_bias=None if inp.w13_bias is None else inp.w13_bias[idx],
        w2_bias=None if inp.w2_bias is None else inp.w2_bias[idx],
        topk_weights=inp.topk_weights,
        topk_ids=inp.topk_ids,
        interleaved=inp.interleaved,
    )
    expert_map = torch.full((inp.num_experts,), -1, dtype=torch.int32)
    expert_map[idx] = torch.arange(len(owned), dtype=torch.int32)
    return local, expert_map


@pytest.mark.parametrize("how", ["contiguous", "round_robin"])
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("topk", [1, 2, E])
def test_expert_parallel_ranks_sum_to_single_rank(isa, ranks, how, topk):
    inp = make_moe_inputs(tokens=67, hidden=93, intermediate=40, topk=topk, bias=True, seed=20 + topk)
    full = run_packed(inp.pack(), inp)
    total = torch.zeros_like(full)
    for owned in split_experts(E, ranks, how):
        local, expert_map = local_inputs(inp, owned)
        part = run_packed(local.pack(), local, expert_map=expert_map)
        expected = reference(local, expert_map=expert_map)
        tol = TOL["scalar_vs_reference", F32]  # isa vs reference: scalar's bound holds with room
        assert_close(part, expected, tol, f"rank owning {owned}")
        total += part
    if topk == 1:  # each token's single slot lives on exactly one rank: the sum is exact
        assert torch.equal(total, full)
    else:  # fp32 sum of partial sums vs one fp32 sum in slot order
        assert_close(total, full, TOL["expert_parallel_sum", F32], f"{ranks} ranks ({how})")


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_tokens_without_local_experts_are_zero(isa, dtype):
    inp = make_moe_inputs(tokens=12, hidden=72, intermediate=40, topk=2, dtype=dtype, bias=True, seed=30)
    inp.topk_ids[:6] = torch.tensor([[2, 3], [4, 2], [3, 4], [4, 3], [2, 4], [3, 2]], dtype=torch.int32)
    inp.topk_ids[6:, 0] = 0
    inp.topk_ids[6:, 1] = 3
    local, expert_map = local_inputs(inp, [0, 1])
    out = run_packed(local.pack(), local, expert_map=expert_map)
    assert torch.equal(out[:6], torch.zeros(6, 72, dtype=dtype)), "tokens routed only off-rank must be zero (no bias)"
    expected = reference(local, expert_map=expert_map)
    assert_close(out[6:], expected[6:], TOL["scalar_vs_reference", dtype], "half-local tokens")


def test_expert_map_identity_equals_no_map(layout_isa):
    inp = make_moe_inputs(tokens=67, hidden=130, intermediate=40, topk=2, bias=True, seed=31)
    packed = inp.pack(layout=layout_isa)
    identity = torch.arange(E, dtype=torch.int32)
    assert torch.equal(run_packed(packed, inp, expert_map=identity), run_packed(packed, inp))


@pytest.mark.parametrize("bad_id", [-1, E, E + 1, 1000, -(2**31), 2**31 - 1])
def test_out_of_range_ids_raise_index_error(layout_isa, bad_id):
    inp = make_moe_inputs(tokens=3, hidden=72, intermediate=40, topk=2, seed=32)
    ids = inp.topk_ids.clone()
    ids[2, 1] = bad_id
    with pytest.raises(IndexError, match=r"topk_ids\[2, 1\] = -?\d+ is out of range.*\[0, 5\)"):
        run_packed(inp.pack(layout=layout_isa), inp, topk_ids=ids)


@pytest.mark.parametrize("bad_id", [-1, E, 77])
def test_out_of_range_global_ids_with_expert_map(layout_isa, bad_id):
    inp = make_moe_inputs(tokens=3, hidden=72, intermediate=40, topk=2, seed=33)
    local, expert_map = local_inputs(inp, [1, 3])
    ids = inp.topk_ids.clone()
    ids[0, 0] = bad_id
    with pytest.raises(IndexError, match=r"topk_ids\[0, 0\].*out of range.*\[0, 5\)"):
        run_packed(local.pack(layout=layout_isa), local, topk_ids=ids, expert_map=expert_map)


@pytest.mark.parametrize("bad_local", [-2, 2, 5])
def test_expert_map_entries_out_of_range(layout_isa, bad_local):
    inp = make_moe_inputs(tokens=3, hidden=72, intermediate=40, topk=2, seed=34)
    local, expert_map = local_inputs(inp, [1, 3])
    expert_map[4] = bad_local
    with pytest.raises(IndexError, match=r"expert_map\[4\] = -?\d+ is out of range.*-1.*\[0, 2\)"):
        run_packed(local.pack(layout=layout_isa), local, expert_map=expert_map)


# ---------------------------------------------------------------------------------------------
# Activation tensors: empty, strided; thread count
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("with_map", [False, True])
def test_zero_tokens_returns_empty(layout_isa, dtype, with_map):
    inp = make_moe_inputs(tokens=0, hidden=93, intermediate=40, topk=2, dtype=dtype, bias=True, seed=40)
    kw = dict(expert_map=torch.arange(E, dtype=torch.int32)) if with_map else {}
    out = run_packed(inp.pack(layout=layout_isa), inp, **kw)
    assert out.shape == (0, 93) and out.dtype == dtype


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_row_strided_hidden_states(layout_isa, dtype):
    """x = a column slice of a wider tensor (row stride > H, storage offset > 0) and a broadcast
    row (row stride 0) give exactly what their contiguous copies give."""
    inp = make_moe_inputs(tokens=67, hidden=93, intermediate=40, topk=2, dtype=dtype, bias=True, seed=41)
    packed = inp.pack(layout=layout_isa)
    wide = torch.randn(67, 93 + 37).to(dtype)
    wide[:, 5 : 5 + 93] = inp.x
    x = wide[:, 5 : 5 + 93]
    assert x.stride() == (130, 1) and x.storage_offset() == 5 and not x.is_contiguous()
    assert torch.equal(run_packed(packed, inp, x=x), run_packed(packed, inp, x=x.contiguous()))
    row = inp.x[:1].expand(67, 93)
    assert row.stride() == (0, 1)
    assert torch.equal(run_packed(packed, inp, x=row), run_packed(packed, inp, x=row.contiguous()))


@pytest.mark.parametrize(
    "dtype,activation", [(F32, "silu"), (BF16, "swigluoai"), (F16, "gelu_tanh"), (BF16, "gelu")]
)
def test_thread_count_does_not_change_the_result(layout_isa, threads, dtype, activation):
    """Each task's math is the same whichever thread runs it, so the result is bitwise equal.
    (Big enough - 335 rows, H=130, Ip=192 - to be run in parallel: the driver keeps calls it
    estimates under ~0.1 ms on one thread.)"""
    inp = make_moe_inputs(
        tokens=67, hidden=130, intermediate=176, topk=E, dtype=dtype, bias=True,
        interleaved=activation == "swigluoai", seed=42,
    )  # fmt: skip
    packed = inp.pack(layout=layout_isa)
    outs = {}
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        assert torch.get_num_threads() == n
        outs[n] = run_packed(packed, inp, activation=activation)
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[3])


# ---------------------------------------------------------------------------------------------
# Rounding points pinned exactly (SEMANTICS.md §2): inputs built so that every fp32 step is
# exact and only the specified roundings happen, so any kernel must agree BITWISE.
# ---------------------------------------------------------------------------------------------


def raw_packed(w13: torch.Tensor, w2: torch.Tensor, b13=None, b2=None, interleaved=False) -> moepack.PackedExperts:
    return moepack.pack_experts(w13, w2, b13, b2, interleaved=interleaved)


def cast_cases() -> torch.Tensor:
    """fp32 values that stress a round-to-nearest-even cast to bf16 and fp16: exact ties,
    neighbours of ties, fp16 subnormals and overflow, fp32 subnormals, random bit patterns."""
    g = torch.Generator().manual_seed(50)
    # every 3rd positive finite fp16 value, and the ties between it and its successor
    h = torch.arange(0, 0x7BFF, 3, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    h_next = (torch.arange(0, 0x7BFF, 3, dtype=torch.int32) + 1).to(torch.int16).view(torch.float16).float()
    f16_ties = (h + h_next) / 2  # exact in fp32
    # bf16 ties: bf16 bits << 16 | 0x8000, and one fp32 ulp either side
    b = torch.randint(0, 0x7F7F, (4000,), generator=g, dtype=torch.int32)
    bf16_ties = ((b << 16) | 0x8000).view(torch.float32)
    near = torch.cat([bf16_ties.view(torch.int32) + 1, bf16_ties.view(torch.int32) - 1]).view(torch.float32)
    bits = torch.randint(-(2**31), 2**31 - 1, (12000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    special = torch.tensor(
        [65504.0, 65519.996, 65520.0, 70000.0, 3.3895314e38, 3.4028235e38, 2.0**-24, 2.0**-25, 2.0**-25 * 3,
         2.0**-14, 2.0**-14 * (1 - 2.0**-11), 1e-40, 2.0**-149, 1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8],
    )  # fmt: skip
    v = torch.cat([f16_ties, h, bf16_ties, near, bits, special])
    v = torch.cat([v, -v])
    return v[torch.isfinite(v) & (v != 0)]


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_output_cast_is_round_to_nearest_even(isa, dtype):
    """With zero weights, out[t] = 1.0 * (0 + w2_bias[e]): the result is exactly the fp32 bias
    cast to the output dtype once (ties to even, fp16 subnormals, overflow to inf)."""
    values = cast_cases()
    hidden = 4000
    experts = (values.numel() + hidden - 1) // hidden
    b2 = torch.zeros(experts * hidden)
    b2[: values.numel()] = values
    b2 = b2.view(experts, hidden)
    packed = raw_packed(torch.zeros(experts, 2, hidden), torch.zeros(experts, hidden, 1), None, b2)
    x = torch.randn(experts, hidden).to(dtype)
    ids = torch.arange(experts, dtype=torch.int32).view(experts, 1)
    out = moepack.fused_experts(x, packed.w13, packed.w2, torch.ones(experts, 1), ids, w2_bias=packed.w2_bias)
    expected = b2.to(dtype)
    if dtype == F32:
        assert torch.equal(out, expected)
        return
    diff = (out.view(torch.int16) != expected.view(torch.int16)).nonzero()
    assert diff.numel() == 0, (
        f"{len(diff)} casts differ, first: fp32 {b2[tuple(diff[0])].item()!r} -> "
        f"{out[tuple(diff[0])].item()!r}, expected {expected[tuple(diff[0])].item()!r}"
    )


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai"])
def test_intermediate_is_rounded_to_the_activation_dtype(isa, dtype, activation):
    """Saturated gate (bias 64 -> silu/gelu/gelu_tanh(64) = 64 exactly in fp32), up = bias u:
    a = 64*u (swigluoai, limit 1000: 64*(u+1)) exactly, then ROUNDED to the activation dtype;
    each output sums two intermediates times 2^-6, exact in fp32, then one cast. Pins the
    gate/up row convention (halves, or interleaved pairs), bias order, intermediate rounding and
    final cast bitwise."""
    g = torch.Generator().manual_seed(51)
    experts, inter = 2, 88  # H = I
    hidden = inter
    mag = torch.exp2(torch.empty(experts, inter).uniform_(-14, 4, generator=g))
    u = (mag * torch.where(torch.rand(experts, inter, generator=g) < 0.5, -1.0, 1.0)).float()
    gate = torch.full((experts, inter), 64.0)
    interleaved = activation == "swigluoai"
    if interleaved:
        b13 = torch.stack([gate, u], dim=-1).reshape(experts, 2 * inter)  # 2i = gate_i, 2i+1 = up_i
        a = (u + 1.0) * 64.0
    else:
        b13 = torch.cat([gate, u], dim=1)
        a = 64.0 * u
    a = a.to(dtype).float()  # the intermediate's one rounding
    eye = torch.eye(inter)
    w2 = (eye + eye.roll(1, dims=1)) * 2.0**-6  # w2[h, h] = w2[h, h+1 mod I] = 2^-6
    expected = ((a + a.roll(-1, dims=1)) * 2.0**-6).to(dtype)  # out[h] = (a[h] + a[h+1]) / 64
    packed = raw_packed(torch.zeros(experts, 2 * inter, hidden), w2.expand(experts, -1, -1), b13, None, interleaved)
    x = torch.randn(experts, hidden).to(dtype)
    ids = torch.arange(experts, dtype=torch.int32).view(experts, 1)
    kw = dict(alpha=1.0, limit=1000.0) if interleaved else {}
    out = moepack.fused_experts(x, packed.w13, packed.w2, torch.ones(experts, 1), ids, activation=activation,
                                w13_bias=packed.w13_bias, **kw)  # fmt: skip
    mismatch = (out.float() != expected.float()).nonzero()
    assert mismatch.numel() == 0, (
        f"{len(mismatch)} outputs differ; first {tuple(mismatch[0].tolist())}: "
        f"{out[tuple(mismatch[0])].item()!r} != {expected[tuple(mismatch[0])].item()!r}"
    )


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_swigluoai_runs_on_either_row_order(isa, dtype, interleaved):
    """swigluoai on gate-then-up halves (MiniMax-M3's experts) as on interleaved pairs (gpt-oss's):
    the driver splits the rows by the pack's order before the activation, so every level computes
    the reference of that order (scalar vs the reference, the level vs scalar)."""
    inp = make_moe_inputs(tokens=33, hidden=72, intermediate=40, topk=2, dtype=dtype, bias=True,
                          interleaved=interleaved, seed=61)  # fmt: skip
    check_every_path(isa, inp, f"swigluoai interleaved={interleaved}", activation="swigluoai", alpha=1.702, limit=0.5)
