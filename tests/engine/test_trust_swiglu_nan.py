"""swigluoai (gpt-oss): NaN in gives NaN out, as moepack.reference and docs/SEMANTICS.md say,
on every scheme (bf16, int8, int4, fp8, mxfp4), activation mode (a16, a8) and ISA level this
host runs, and on a ``--tp`` pack run whole (issue 49). The kernels clamped the gate and up
values with min/max whose NaN operand came first (x86 ``vminps``/``vmaxps`` and C's
``fmin``/``fmax`` return the other operand), so a NaN activation came out finite (and an Inf
one in a8, whose NaN row scale met the same clamps). The silu layers already propagated it
(tests/verify/test_trust_nan.py); the every-level C++ check, ARM included under qemu, is
tests/cpp/kt_nan.inc."""

from __future__ import annotations

import pytest
import torch

import moepack
from moepack.isa import available_isas
from moepack.layout import DEFAULT_LAYOUT, FP8_LAYOUT, INT4_LAYOUT, INT8_LAYOUT, MXFP4_LAYOUT
from moepack.reference import moe_reference
from moepack.schemes import get_scheme
from moepack.tp import tp_slice
from tests.conftest import isa_cap, make_moe_inputs

CASES = [(DEFAULT_LAYOUT, "a16"), (INT8_LAYOUT, "a8"), (INT4_LAYOUT, "a16"), (INT4_LAYOUT, "a8"), (FP8_LAYOUT, "a16"),
         (MXFP4_LAYOUT, "a16"), (MXFP4_LAYOUT, "a8")]  # fmt: skip
ACTS = {"default": dict(activation="swigluoai"), "tight": dict(activation="swigluoai", alpha=1.2, limit=0.75)}


def _packed(layout, tp: int = 1):
    inp = make_moe_inputs(tokens=5, hidden=256, intermediate=128, experts=4, topk=2, bias=True, interleaved=True, seed=7)
    scheme = get_scheme(layout)
    c = scheme.from_float(inp.w13, inp.w2, layout=layout)
    c["w13_bias"], c["w2_bias"] = inp.w13_bias, inp.w2_bias
    p = scheme.pack(c, interleaved=True, layout=layout)
    return inp, (tp_slice(p, tp) if tp > 1 else p)


def _levels(layout, mode):
    out = []
    for isa in available_isas():
        with isa_cap(isa):
            if moepack.kernel_choice(layout, mode).isa == isa:
                out.append(isa)
    return out


def _check_rows(out, ref, bad_row: int, what):
    assert torch.isnan(out[bad_row]).all(), (what, out[bad_row])
    rows = [r for r in range(out.shape[0]) if r != bad_row]
    assert torch.equal(out[rows], ref[rows]), what  # the other tokens are untouched
    assert torch.isfinite(out[rows]).all(), what


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("layout,mode", CASES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_nan_activation_gives_a_nan_row_on_every_level(layout, mode, act, dtype):
    inp, p = _packed(layout)
    levels = _levels(layout, mode)
    assert "scalar" in levels
    x = inp.x.to(dtype)
    bad = x.clone()
    bad[2, 17] = float("nan")
    for isa in levels:
        with isa_cap(isa):
            out = moepack.run_experts(p, bad, inp.topk_weights, inp.topk_ids, act_mode=mode, **ACTS[act])
            ref = moepack.run_experts(p, x, inp.topk_weights, inp.topk_ids, act_mode=mode, **ACTS[act])
        _check_rows(out, ref, 2, (isa, layout.name, mode, act))


@pytest.mark.parametrize("layout,mode", [c for c in CASES if c[1] == "a8"], ids=lambda v: getattr(v, "name", v))
def test_an_inf_activation_gives_a_nan_row_in_a8(layout, mode):
    """a8: a row holding an Inf has a NaN scale (docs/SEMANTICS.md), and swigluoai keeps it NaN."""
    inp, p = _packed(layout)
    bad = inp.x.clone()
    bad[3, 5] = float("inf")
    for isa in _levels(layout, mode):
        with isa_cap(isa):
            out = moepack.run_experts(p, bad, inp.topk_weights, inp.topk_ids, act_mode=mode, activation="swigluoai")
            ref = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode, activation="swigluoai")
        _check_rows(out, ref, 3, (isa, layout.name))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layout,mode", [(DEFAULT_LAYOUT, "a16"), (MXFP4_LAYOUT, "a16"), (MXFP4_LAYOUT, "a8")],
                         ids=lambda v: getattr(v, "name", v))  # fmt: skip
def test_a_tp_pack_run_whole_keeps_the_nan(layout, mode, tp):
    inp, p = _packed(layout, tp)
    bad = inp.x.clone()
    bad[0, 100] = float("nan")
    for isa in _levels(layout, mode):
        with isa_cap(isa):
            out = moepack.run_experts(p, bad, inp.topk_weights, inp.topk_ids, act_mode=mode, activation="swigluoai")
            ref = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, act_mode=mode, activation="swigluoai")
        _check_rows(out, ref, 0, (isa, layout.name, tp))


def test_the_reference_propagates_the_nan():
    """The rule the kernels follow: torch.clamp keeps a NaN (moepack/reference.py)."""
    inp = make_moe_inputs(tokens=3, hidden=64, intermediate=32, experts=2, topk=1, interleaved=True, seed=1)
    x = inp.x.clone()
    x[1, 0] = float("nan")
    out = moe_reference(x, inp.w13.float(), inp.w2.float(), inp.topk_weights, inp.topk_ids, activation="swigluoai",
                        limit=0.5, interleaved=True)  # fmt: skip
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("field,value", [("limit", 1e300), ("limit", -3.5e38), ("alpha", -1e39), ("alpha", 3.5e38),
                                         ("limit", 0.0), ("alpha", float("inf"))])  # fmt: skip
def test_the_op_holds_alpha_and_limit_to_the_manifest_rule(field, value):
    """run_experts (the op) refuses what open refuses in a manifest (manifest.swiglu_param_problem):
    a value float32 cannot hold would become Inf in the kernels' float32 clamp."""
    inp, p = _packed(INT8_LAYOUT)
    with pytest.raises(ValueError, match=r"both must be finite numbers float32 holds .* and limit > 0"):
        moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, activation="swigluoai", **{field: value})
    ok = 3.4028234663852886e38 if field == "alpha" else 0.5  # the largest float32 is kept
    moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, activation="swigluoai", **{field: ok})
