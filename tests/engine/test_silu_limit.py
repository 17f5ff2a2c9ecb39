"""The clamped SwiGLU of silu experts (``silu_limit``: DeepSeek-V4's ``swiglu_limit``;
docs/SEMANTICS.md §2): every native level against the scalar kernel, the scalar kernel against
moepack/reference.py, the reference against transformers' own ``DeepseekV4Experts`` /
``DeepseekV4MLP``, and the op's refusals. The clamp is applied by the driver before each level's
unchanged silu (csrc/kernels/fused_moe_driver.inc ``clamp_silu_inputs``), so every level and
every layout runs it; tests/cpp (test_kernels.cpp, ``silu_limit`` cases) checks the same on the
SIMDe-emulated levels (``-m emulated``)."""

from __future__ import annotations

import pytest
import torch

import moepack
from moepack.reference import activation_reference
from tests.conftest import isa_cap, make_moe_inputs, reference, run_packed
from tests.reference.tolerances import TOL, assert_close

F32, BF16 = torch.float32, torch.bfloat16
LIMIT = 0.5  # h ~ N(0, 1): a third of the gates and up values are clamped


def _inputs(dtype, bias, seed):
    return make_moe_inputs(tokens=37, hidden=93, intermediate=40, topk=2, dtype=dtype, bias=bias, seed=seed)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("bias", [False, True])
def test_scalar_matches_reference_and_the_clamp_bites(dtype, bias):
    inp = _inputs(dtype, bias, seed=3 + bias)
    packed = inp.pack()
    with isa_cap("scalar"):
        got = run_packed(packed, inp, silu_limit=LIMIT)
        plain = run_packed(packed, inp)
    assert_close(got, reference(inp, silu_limit=LIMIT), TOL["scalar_vs_reference", dtype], f"silu_limit={LIMIT}")
    assert_close(plain, reference(inp), TOL["scalar_vs_reference", dtype], "no clamp")
    changed = float((got.float() - plain.float()).norm() / plain.float().norm())
    assert changed > 0.05, f"the clamp changed the output by {changed:.3g} only: the test does not test it"


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_every_level_and_layout_matches_scalar(layout_isa, dtype):
    """Each layout on each level it runs on (the layout_isa fixture caps the level), clamped,
    against the scalar kernel on the same packed weights."""
    inp = _inputs(dtype, True, seed=11)
    packed = inp.pack(layout=layout_isa)
    got = run_packed(packed, inp, silu_limit=LIMIT)
    with isa_cap("scalar"):
        want = run_packed(packed, inp, silu_limit=LIMIT)
        plain = run_packed(packed, inp)
    if packed.layout.scheme == "dense":
        assert_close(got, want, TOL["simd_vs_scalar", dtype], f"{packed.layout.name} silu_limit={LIMIT}")
    else:  # quantized activations (a8 rows) may flip a code between levels: the relative bound of their tests
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert rel <= 2e-2, f"{packed.layout.name}: clamped output vs the scalar kernel: rel {rel:.3g}"
    assert not torch.equal(want, plain), f"{packed.layout.name}: the clamp changed nothing"


def test_reference_matches_transformers_deepseek_v4():
    """activation_reference(silu, silu_limit) is DeepseekV4Experts._apply_gate and the gated
    product of DeepseekV4MLP (transformers' own modules)."""
    from types import SimpleNamespace

    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    cfg = SimpleNamespace(num_local_experts=2, hidden_size=16, intermediate_size=8, hidden_act="silu",
                          swiglu_limit=LIMIT, mlp_bias=False)  # fmt: skip
    experts = m.DeepseekV4Experts(cfg)
    h = torch.randn(9, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = experts._apply_gate(h)
    assert torch.equal(activation_reference(h, "silu", silu_limit=LIMIT), want)
    assert not torch.equal(activation_reference(h, "silu"), want)
    mlp = m.DeepseekV4MLP(cfg)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y = mlp(x)
        hh = torch.cat([torch.nn.functional.linear(x, mlp.gate_proj.weight), torch.nn.functional.linear(x, mlp.up_proj.weight)], -1)
        torch.testing.assert_close(torch.nn.functional.linear(activation_reference(hh, "silu", silu_limit=LIMIT),
                                                              mlp.down_proj.weight), y, rtol=1e-6, atol=1e-6)  # fmt: skip


def test_nan_stays_nan_through_the_clamp():
    """As torch.clamp: a NaN gate or up is not clamped to the limit (NaN in, NaN out)."""
    inp = _inputs(F32, False, seed=21)
    x = inp.x.clone()
    x[3, 0] = float("nan")
    got = run_packed(inp.pack(), inp, x=x, silu_limit=LIMIT)
    assert bool(torch.isnan(got[3]).all()) and bool(torch.isfinite(got[torch.arange(37) != 3]).all())


@pytest.mark.parametrize("bad,match", [(-1.0, "silu_limit=-1"), (float("inf"), "silu_limit=inf"),
                                       (float("nan"), "silu_limit=nan")])  # fmt: skip
def test_bad_limit_refused(bad, match):
    inp = _inputs(F32, False, seed=1)
    with pytest.raises(ValueError, match=match):
        run_packed(inp.pack(), inp, silu_limit=bad)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "swigluoai"])
def test_limit_on_another_activation_refused(activation):
    inp = _inputs(F32, False, seed=1)
    with pytest.raises(ValueError, match=f"silu_limit=0.5 with activation='{activation}': the clamp is an option of silu"):
        run_packed(inp.pack(), inp, activation=activation, silu_limit=LIMIT)


def test_meta_kernel_takes_the_limit():
    inp = _inputs(F32, False, seed=1)
    p = inp.pack()
    x = torch.empty(4, 93, device="meta")
    out = moepack.fused_experts(x, [t.to("meta") for t in p.weight("w13")], [t.to("meta") for t in p.weight("w2")],
                                torch.empty(4, 2, device="meta"), torch.empty(4, 2, dtype=torch.int32, device="meta"),
                                layout=p.layout, silu_limit=LIMIT)  # fmt: skip
    assert out.shape == (4, 93) and out.device.type == "meta"
