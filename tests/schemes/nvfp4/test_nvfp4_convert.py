"""nvfp4 end to end: ``pack_experts`` on float weights (it quantizes them itself), convert
``--quantize nvfp4`` (compressed-tensors' rule) and ``--act-mode a8``, verify (every code and scale
exact against the source), open / verify DST refusing a NaN e4m3 scale and a non-finite global in a
checksum-consistent pack, and the CLI's convert / inspect / verify / run / bench."""

from __future__ import annotations

import json

import pytest
import torch

import moepack
from moepack.errors import PackedDirError
from moepack.layout import NVFP4_LAYOUT
from moepack.reference import moe_reference
from moepack.schemes import get_scheme
from moepack.schemes.nvfp4 import NVFP4_FROM_FLOAT_TOL, moe_reference_nvfp4
from tests.conftest import make_moe_inputs
from tests.reference.tolerances import TOL, assert_close, assert_close_int8
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import rewrite_tensor

F32, BF16 = torch.float32, torch.bfloat16
SCHEME = get_scheme("nvfp4")
LAY = NVFP4_LAYOUT


def cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("dtype,act,h,i,t", [(F32, "silu", 320, 200, 7), (BF16, "swigluoai", 130, 176, 3)])
def test_pack_experts_on_float_weights_through_the_kernels(dtype, act, h, i, t):
    inp = make_moe_inputs(tokens=t, hidden=h, intermediate=i, experts=5, topk=2, dtype=dtype, bias=True,
                          interleaved=act == "swigluoai", seed=h + t)  # fmt: skip
    p = moepack.pack_experts(inp.w13, inp.w2, inp.w13_bias, inp.w2_bias, layout=LAY.name, interleaved=inp.interleaved)
    assert p.layout is LAY and set(p.tensors) >= {"w13", "w13_scale", "w13_global", "w2", "w2_scale", "w2_global"}
    c = SCHEME.from_float(inp.w13, inp.w2, layout=LAY)
    kw = dict(activation=act, interleaved=inp.interleaved, w13_bias=inp.w13_bias, w2_bias=inp.w2_bias)
    ref32 = moe_reference(inp.x.float(), inp.w13.float(), inp.w2.float(), inp.topk_weights, inp.topk_ids, **kw)
    for mode in ("a16", "a8"):
        out = moepack.run_experts(p, inp.x, inp.topk_weights, inp.topk_ids, activation=act, act_mode=mode)
        ref, flip = moe_reference_nvfp4(inp.x, c, inp.topk_weights, inp.topk_ids, act_mode=mode, return_flip=True, **kw)
        if mode == "a16":
            assert_close(out, ref, TOL["scalar_vs_reference" if dtype == F32 else "half_vs_fp32_pipeline", dtype], mode)
        else:
            assert_close_int8(out, ref, TOL["int8_scalar_vs_reference", dtype], flip, mode)
        rel = float((out.float() - ref32).norm() / ref32.norm())
        assert rel < NVFP4_FROM_FLOAT_TOL, (mode, rel)


def test_convert_quantize_nvfp4_from_float(tmp_path):
    src, dst = fixture_dir("qwen3_moe"), tmp_path / "p"
    report = moepack.convert(src, dst, quantize="nvfp4")
    assert 0.07 < report.quant_error < 0.12, report.quant_error
    m = json.loads((dst / "moepack.json").read_text())
    assert all(moepack.layout_get(x["layout_id"]).name == LAY.name for x in m["layers"])
    assert all(x["quantizer"] == "nvfp4" and x["act_mode"] == "a16" for x in m["layers"])
    assert all(x["scheme_source"].startswith("quantized by moepack from BF16 (nvfp4") for x in m["layers"])
    assert moepack.verify(dst).ok
    report = moepack.verify(dst, source=src)
    assert report.ok, report.failures()
    for x in report.layers:
        assert x.weights_exact and x.rel_err <= 1e-5 and x.fp32_tol == NVFP4_FROM_FLOAT_TOL and x.rel_err_fp32 < 0.3, x


def test_convert_act_mode_a8_verifies_in_a8(tmp_path):
    src, dst = fixture_dir("qwen3_moe"), tmp_path / "p"
    moepack.convert(src, dst, quantize="nvfp4", act_mode="a8")
    m = json.loads((dst / "moepack.json").read_text())
    assert {x["act_mode"] for x in m["layers"]} == {"a8"}
    assert moepack.verify(dst, source=src).ok


@pytest.mark.parametrize("tensor,index,value,words", [
    ("w2_scale", 5, 0x7F, "= 0x7F: nvfp4 e4m3 scale bytes 0x7F / 0xFF are NaN and 0x80 up negative"),
    ("w13_scale", 3, 0xB8, "= 0xB8: nvfp4 e4m3 scale bytes 0x7F / 0xFF are NaN and 0x80 up negative"),
    ("w13_global", 2, float("inf"), "= inf: nvfp4 global scales must be finite"),
])  # fmt: skip
def test_bad_values_in_a_checksum_consistent_pack_are_refused(tmp_path, tensor, index, value, words):
    d = tmp_path / "p"
    moepack.convert(fixture_dir("qwen3_moe"), d, quantize="nvfp4")
    name = f"moepack.layers.1.{tensor}"
    rewrite_tensor(d, name, lambda t: t.view(-1).__setitem__(index, value))
    with pytest.raises(PackedDirError, match=rf"{name!r} .* {words}"):
        moepack.open(d)
    report = moepack.verify(d)
    assert not report.ok and words in " ".join(report.failures()), report.failures()


def test_cli_convert_inspect_verify_run_bench(tmp_path):
    src, dst = fixture_dir("qwen3_moe"), tmp_path / "p"
    r = cli("convert", src, dst, "--quantize", "nvfp4", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["quantizer"] == "nvfp4"
    r = cli("convert", src, tmp_path / "q", "--quantize", "nvfp4:g32")
    assert r.exit_code != 0 and "scheme nvfp4 takes no options" in r.output, r.output
    for args in (("verify", dst), ("inspect", dst, "--json"), ("verify", dst, "--source", src)):
        r = cli(*args)
        assert r.exit_code == 0, r.output
    r = cli("run", dst, "--tokens", "3", "--json", "--act-mode", "a8")
    assert r.exit_code == 0, r.output
    assert all(x["act_mode"] == "a8" and 0 < x["out_rms"] < float("inf") for x in json.loads(r.output))
    for mode in ("a16", "a8"):
        r = cli("bench", "--scheme", "nvfp4", "--act-mode", mode, "--shapes", "e4k2h320i200", "--tokens", "1,5", "--no-probe",
                "--calls", "3", "--min-time", "0.01", "--json", tmp_path / f"b{mode}.json", "-q")  # fmt: skip
        assert r.exit_code == 0, r.output
        rows = json.loads((tmp_path / f"b{mode}.json").read_text())["rows"]
        assert {x["scheme"] for x in rows} == {"nvfp4"} and len(rows) == 2
        assert all(x["check_rel_diff"] is not None and x["check_rel_diff"] < SCHEME.bench.check_tol for x in rows)
