"""w13's row order is recorded with the packed weights (PackedExperts.interleaved, the manifest's
"interleaved"), not guessed from the activation: every activation runs on either order, on every
kernel level of both schemes, and equals the reference computed with the same order."""

from __future__ import annotations

import pytest
import torch

import moepack
from moepack.reference import moe_reference
from moepack.schemes.int8 import moe_reference_int8
from moepack.schemes import get_scheme
from tests.conftest import isa_cap, make_moe_inputs
from tests.reference.tolerances import TOL, assert_close, assert_close_int8

ACTS = ("silu", "gelu", "gelu_tanh", "swigluoai")


def _levels(scheme: str) -> list[str]:
    from moepack.isa import KERNEL_ISAS, available_isas

    kind = {"dense": "bf16", "int8_channel": "i8"}[scheme]
    return [x for x in available_isas() if x in KERNEL_ISAS[kind]]


@pytest.mark.parametrize("interleaved", [False, True], ids=["gate_then_up", "interleaved"])
@pytest.mark.parametrize("activation", ACTS)
def test_dense_any_activation_on_either_row_order(activation, interleaved):
    inp = make_moe_inputs(tokens=5, hidden=72, intermediate=40, bias=True, interleaved=interleaved, seed=3)
    p = inp.pack()
    assert p.interleaved is interleaved
    kw = dict(activation=activation, alpha=1.5, limit=0.9)
    ref = moe_reference(inp.x, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, w13_bias=inp.w13_bias,
                        w2_bias=inp.w2_bias, interleaved=interleaved, **kw)  # fmt: skip
    for isa in _levels("dense"):
        with isa_cap(isa):
            out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, **kw)
        assert_close(out, ref, TOL["scalar_vs_reference", torch.float32], f"{isa} {activation} interleaved={interleaved}")


@pytest.mark.parametrize("interleaved", [False, True], ids=["gate_then_up", "interleaved"])
@pytest.mark.parametrize("activation", ("silu", "swigluoai"))
def test_int8_any_activation_on_either_row_order(activation, interleaved):
    inp = make_moe_inputs(tokens=5, hidden=72, intermediate=40, bias=True, interleaved=interleaved, seed=4)
    scheme = get_scheme("int8_channel")
    c = scheme.from_float(inp.w13, inp.w2)
    p = scheme.pack({**c, "w13_bias": inp.w13_bias, "w2_bias": inp.w2_bias}, interleaved=interleaved,
                    layout=scheme.layout_for("x86"))  # fmt: skip
    kw = dict(activation=activation, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias)
    ref, flip = moe_reference_int8(inp.x, c["w13_q"], c["w13_scale"], c["w2_q"], c["w2_scale"], inp.topk_weights,
                                   inp.topk_ids, interleaved=interleaved, return_flip=True, **kw)  # fmt: skip
    for isa in _levels("int8_channel"):
        with isa_cap(isa):
            out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, activation=activation)
        assert_close_int8(out, ref, TOL["int8_scalar_vs_reference", torch.float32], flip, f"{isa} {activation}")


def test_the_raw_op_takes_the_row_order_as_given():
    """Gate-then-up rows run as interleaved pairs give a different (wrong) answer: the op does not
    infer the order from the activation."""
    inp = make_moe_inputs(tokens=3, hidden=64, intermediate=32, interleaved=False, seed=5)
    p = inp.pack()
    a = moepack.fused_experts(inp.x, p.w13, p.w2, inp.topk_weights, inp.topk_ids, activation="silu", interleaved=False)
    b = moepack.fused_experts(inp.x, p.w13, p.w2, inp.topk_weights, inp.topk_ids, activation="silu", interleaved=True)
    assert not torch.allclose(a, b)
    ref = moe_reference(inp.x, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, activation="silu", interleaved=True)
    assert_close(b, ref, TOL["scalar_vs_reference", torch.float32], "silu on rows read as pairs")
