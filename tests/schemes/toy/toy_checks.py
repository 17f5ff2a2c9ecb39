"""The toy scheme end to end, run by test_toy_scheme.py in a child process with
MOEPACK_TEST_SCHEMES=1 (so moepack, imported by the child's conftest, registers it): not collected
by the suite itself (the name does not match test_*.py).

What it shows: the C++ table holds the toy's layout (layout_desc) and the scalar level's C++ codec
runs it (grouped_block on one block against the dequantize-then-matmul; no SIMD level has it);
pack_experts on float weights -> run_experts equals the toy's torch reference; convert a tiny
float checkpoint with quantize="toy" -> verify (also against the source) -> open + run the layer;
the CLI lists the scheme and its kernel while it is enabled."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import moepack
from moepack.isa import available_isas
from moepack.layout import LAYOUTS, layout_get
from moepack.reference import moe_reference
from moepack.schemes import get_scheme
from tests.conftest import make_moe_inputs
from tests.engine import test_layout_sync as sync
from tests.support.fixtures_util import fixture_dir

SCHEME = get_scheme("toy")
LAY = layout_get("toy_u8g24_n16k4_portable")
TOY = sys.modules[SCHEME.pack.__module__]  # scheme.py, as moepack.schemes loaded it (by path)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_registered_in_python_and_in_the_compiled_table():
    assert LAY in LAYOUTS and LAY.scheme == "toy" and SCHEME.quant is not None and SCHEME.layouts() == [LAY]
    # the compiled table (layouts_gen.h, from layouts.py through tools/gen_layouts.py) says what
    # moepack.layout says, field by field: the layout-sync test on the toy's layout
    sync.test_compiled_table_equals_python_table(LAY)


def test_the_scalar_c_kernel_runs_it_and_no_simd_level_does(monkeypatch):
    for cap in available_isas():
        monkeypatch.setenv("MOEPACK_MAX_ISA", cap)
        isa, reason, fallback = moepack.kernel_choice(LAY)  # the C++ dispatcher's own report
        assert isa == "scalar" and not fallback and reason.startswith(f"scalar: best ISA of this CPU for layout {LAY.name}"), (cap, reason)
    monkeypatch.delenv("MOEPACK_MAX_ISA")
    # one packed column block through the scalar level's registered grouped_block (the toy codec)
    g = torch.Generator().manual_seed(7)
    kp, m = 160, 5  # a multiple of i_align (as w2 packs it), with a partial last group (160 = 6 x 24 + 16)
    w = torch.randn(1, LAY.block_n, kp, generator=g)
    q, s = TOY.quantize_toy(w)
    packed = TOY.pack_toy_weight("w2", q, s, layout=LAY)
    codes, scale = packed["w2"][0].reshape(-1), packed["w2_scale"][0][:, : LAY.block_n].contiguous()
    rows = torch.randn(m, kp, generator=g)
    out = torch.ops.moepack.grouped_block(rows, codes.contiguous(), scale, None, None, LAY.id, "scalar", "a16")
    want = rows @ TOY.dequantize_toy(q, s)[0].T
    assert rel(out, want) < 1e-6
    for isa in available_isas():
        if isa != "scalar":  # no SIMD level registered it: the table has no entry there
            with pytest.raises(ValueError, match=f"no {isa} a16 kernel for layout {LAY.name}"):
                torch.ops.moepack.grouped_block(rows, codes.contiguous(), scale, None, None, LAY.id, isa, "a16")


@pytest.mark.parametrize("dtype,act,h,i,t", [(torch.float32, "silu", 100, 72, 7), (torch.bfloat16, "gelu", 48, 40, 3)])
def test_pack_experts_then_run_experts_equals_the_reference(dtype, act, h, i, t):
    inp = make_moe_inputs(tokens=t, hidden=h, intermediate=i, experts=4, topk=2, dtype=dtype, bias=True, seed=h + t)
    p = moepack.pack_experts(inp.w13, inp.w2, inp.w13_bias, inp.w2_bias, layout=LAY.name)
    assert p.layout is LAY and set(p.tensors) == {"w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias"}
    out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, activation=act)
    c = SCHEME.from_float(inp.w13, inp.w2, layout=LAY)
    kw = dict(activation=act, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias)
    ref = TOY.toy_reference(inp.x.float(), c, inp.topk_weights, inp.topk_ids, **kw)
    # fp32: summation order only; bf16 activations and output: the output's rounding
    assert rel(out, ref) < (TOY.TOY_TOL if dtype == torch.float32 else 8e-3), rel(out, ref)
    ref32 = moe_reference(inp.x.float(), inp.w13.float(), inp.w2.float(), inp.topk_weights, inp.topk_ids, **kw)
    assert rel(out, ref32) < TOY.TOY_FROM_FLOAT_TOL


def test_convert_verify_open_run(tmp_path):
    # TOY_PACK_DIR: where test_toy_scheme.py wants the pack, to show that moepack without the
    # switch refuses it
    src, dst = fixture_dir("qwen3_moe"), Path(os.environ.get("TOY_PACK_DIR") or tmp_path / "p")
    report = moepack.convert(src, dst, layout=LAY.name, quantize="toy")
    assert 0 < report.quant_error < 0.02, report.quant_error
    m = json.loads((dst / "moepack.json").read_text())
    assert m["layers"] and all(x["layout_id"] == LAY.id and x["quantizer"] == "toy" for x in m["layers"]), m["layers"]
    assert moepack.verify(dst).ok
    v = moepack.verify(dst, source=src)
    assert v.ok, v.failures()
    for x in v.layers:
        assert x.weights_exact and x.rel_err <= TOY.TOY_TOL and x.rel_err_fp32 < TOY.TOY_FROM_FLOAT_TOL, x
    # open + run a layer: the packed model's MoE block against the float checkpoint's own block
    # (transformers), on the same hidden states: within the toy's quantization error
    from transformers import AutoModelForCausalLM

    model = moepack.open(dst)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    x = torch.randn(5, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for idx, layer in model.layers.items():
        out = layer(x)
        with torch.no_grad():
            want = hf.model.layers[idx].mlp(x[None])
        want = (want[0] if isinstance(want, tuple) else want)[0]
        assert out.shape == want.shape and rel(out, want) < TOY.TOY_FROM_FLOAT_TOL, (idx, rel(out, want))


def test_the_cli_lists_it_while_enabled():
    r = cli("convert", "--help")
    assert r.exit_code == 0 and "toy" in r.output, r.output
    r = cli("info", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert f"{LAY.name} (id {LAY.id})" in info["layouts"] and info["kernels"][LAY.name]["isa"] == "scalar"
