"""Issue 29: NaN in, NaN out on every activation mode and ISA level (docs/SEMANTICS.md §3, A8).
The A8 row quantizer's max ignored a NaN, so a NaN activation became a finite output in a8
(a16 propagated it) when ``experts()``/``run_experts`` was called directly. A row holding a NaN
or an Inf now gets a NaN scale: its output row is NaN, every other row is unchanged."""

from __future__ import annotations

import pytest
import torch

import moepack
from moepack.isa import available_isas
from moepack.layout import DEFAULT_LAYOUT, FP8_LAYOUT, INT4_LAYOUT, INT8_LAYOUT, MXFP4_LAYOUT, NVFP4_LAYOUT
from moepack.reference import moe_reference
from moepack.schemes import get_scheme
from tests.conftest import isa_cap, make_moe_inputs

CASES = [(INT4_LAYOUT, "a8"), (INT4_LAYOUT, "a16"), (INT8_LAYOUT, "a8")]


def _packed(layout):
    inp = make_moe_inputs(tokens=5, hidden=96, intermediate=64, experts=4, topk=2, seed=3)
    scheme = get_scheme(layout)
    c = scheme.from_float(inp.w13, inp.w2, layout=layout)
    return inp, scheme.pack(c, interleaved=inp.interleaved, layout=layout)


def _levels(layout, mode):
    out = []
    for isa in available_isas():
        with isa_cap(isa):
            if moepack.kernel_choice(layout, mode).isa == isa:
                out.append(isa)
    return out


@pytest.mark.parametrize("layout,mode", CASES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_activation_gives_a_nan_row_on_every_level(layout, mode, bad):
    inp, p = _packed(layout)
    x = inp.x.clone()
    x[2, 17] = bad
    levels = _levels(layout, mode)
    assert "scalar" in levels
    for isa in levels:
        with isa_cap(isa):
            out = moepack.run_experts(p, x, inp.topk_weights, inp.topk_ids, act_mode=mode)
            ref = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode)
        if mode == "a16" and bad == float("inf"):  # a16 keeps the dtype's own arithmetic: inf or NaN
            assert not torch.isfinite(out[2]).all(), isa
        else:
            assert torch.isnan(out[2]).all(), (isa, out[2])
        rows = [0, 1, 3, 4]
        assert torch.equal(out[rows], ref[rows]), isa  # the other tokens are untouched


def test_the_reference_a8_quantizer_agrees():
    from moepack.reference import quantize_rows_int8

    v = torch.randn(3, 40)
    v[1, 5] = float("nan")
    q, s = quantize_rows_int8(v)
    assert torch.isnan(s[1]).all() and torch.isfinite(s[[0, 2]]).all()


ALL_SCHEMES = [(lay, mode) for lay in (DEFAULT_LAYOUT, INT8_LAYOUT, INT4_LAYOUT, FP8_LAYOUT, MXFP4_LAYOUT, NVFP4_LAYOUT)
               for mode in lay.act_modes]  # fmt: skip


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai"])
@pytest.mark.parametrize("layout,mode", ALL_SCHEMES, ids=lambda v: getattr(v, "name", v))
def test_nan_in_nan_out_per_activation_scheme_mode_and_level(layout, mode, activation):
    """Issue 49, "NaN and Inf propagate through every activation and mode exactly as the
    reference says": per activation x scheme x act mode x every ISA level this host runs, a NaN
    in one token's activations makes that token's output row all NaN, as moepack.reference does
    on the same weights, and leaves every other row bit for bit as it was; in a8 an Inf does the
    same (its row has no int8 meaning, SEMANTICS.md §3)."""
    inp = make_moe_inputs(tokens=5, hidden=256, intermediate=128, experts=4, topk=2, seed=11,
                          interleaved=activation == "swigluoai")  # fmt: skip
    scheme = get_scheme(layout)
    c = scheme.from_float(inp.w13, inp.w2, layout=layout)
    p = scheme.pack(c, interleaved=inp.interleaved, layout=layout)
    w13, w2 = scheme.dequantize(c)  # the weights the kernels compute with, in fp32
    bads = [float("nan")] + ([float("inf"), float("-inf")] if mode == "a8" else [])
    levels = _levels(layout, mode)
    assert "scalar" in levels
    for bad in bads:
        x = inp.x.clone()
        x[3, 40] = bad
        for isa in levels:
            with isa_cap(isa):
                out = moepack.run_experts(p, x, inp.topk_weights, inp.topk_ids, activation=activation, act_mode=mode)
                clean = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, activation=activation, act_mode=mode)
            what = (isa, layout.name, mode, activation, bad)
            assert torch.isnan(out[3]).all(), (what, out[3])
            rows = [0, 1, 2, 4]
            assert torch.equal(out[rows], clean[rows]) and torch.isfinite(out[rows]).all(), what
        if bad != bad:  # the reference on the NaN input: the same row NaN
            ref = moe_reference(x, w13, w2, inp.topk_weights, inp.topk_ids, activation=activation,
                                interleaved=inp.interleaved)  # fmt: skip
            assert torch.isnan(ref[3]).all() and torch.isfinite(ref[[0, 1, 2, 4]]).all(), (layout.name, activation)
