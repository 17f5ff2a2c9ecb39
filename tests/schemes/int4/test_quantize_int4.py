"""``moepack convert --quantize int4`` (issue 27): float checkpoints quantized round to nearest into
the int4_group layouts, symmetric or asymmetric, at group 32 / 64 / 128 or per channel; the
convert summary's weight error and verify's output error against the float source, with the rule
it is judged by; the options in the resume key; bad options refused naming the option, the value
and the rule."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

import moepack
from moepack.convert.run import MANIFEST, parse_quantize
from moepack.errors import MoepackError
from moepack.layout import int4_layout_for
from moepack.pack import unpack_codes
from moepack.schemes.int4 import INT4_FROM_FLOAT_TOL, Int4Options, dequantize_int4_group, quantize_int4_group
from moepack.sources import open_source
from tests.support.fixtures_util import fixture_dir

ROOT = Path(__file__).resolve().parents[3]

# (fixture, --quantize): every option at least once, on fixtures with awkward shapes (qwen3_moe:
# H=72, I=40: partial groups everywhere), a shared expert (deepseek_v3) and interleaved rows with
# biases (gpt_oss)
CASES = [
    ("qwen3_moe", "int4", Int4Options(128, True)),
    ("qwen3_moe", "int4:g32", Int4Options(32, True)),
    ("qwen3_moe", "int4:g64:asym", Int4Options(64, False)),
    ("qwen3_moe", "int4:ch", Int4Options(-1, True)),
    ("mixtral", "int4_group:asym:g128", Int4Options(128, False)),
    ("deepseek_v3", "int4:g32:asym", Int4Options(32, False)),
    ("gpt_oss", "int4:ch:asym", Int4Options(-1, False)),
]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("int4q"))


@cache
def converted(tmp_root: str, src: str, quantize: str):
    dst = Path(tmp_root) / f"{src}-{quantize.replace(':', '_')}"
    report = moepack.convert(fixture_dir(src), dst, quantize=quantize)
    return dst, report


@pytest.mark.parametrize("src, quantize, opts", CASES, ids=[f"{s}-{q}" for s, q, _ in CASES])
def test_convert_verify_run(tmp_root, src, quantize, opts):
    dst, report = converted(tmp_root, src, quantize)
    lay = int4_layout_for(opts.group_size)
    assert report.layout == lay.name and report.scheme == "int4_group" and report.quantize == opts.key()
    # the convert summary's weight error: of the weights it quantized, and plausible for 4 bits
    assert report.quant_error is not None and 0.01 < report.quant_error < 0.2, report.quant_error
    assert report.quant_error_worst[1] >= report.quant_error - 1e-12
    m = json.loads((dst / MANIFEST).read_text())
    for entry in m["layers"]:
        assert entry["layout_id"] == lay.id and entry["quantizer"] == opts.key()
        assert entry["scheme_source"].endswith(f"({opts.note()})"), entry["scheme_source"]
    v = moepack.verify(dst, source=fixture_dir(src))
    assert v.ok, v.failures()
    for c in v.layers:
        # the packed codes are moepack's quantization of the source, exactly; the kernel matches the
        # int4 reference on them; the output error against the FLOAT source is reported and judged
        assert c.weights_exact and c.quantizer == opts.key() and c.weights == "int4 codes"
        # the fixtures' weights are bell-shaped: 4-bit RTN costs them 15-20% of the output
        assert c.fp32_tol == INT4_FROM_FLOAT_TOL and 0.0 < c.rel_err_fp32 < 0.25, c.rel_err_fp32
    model = moepack.open(dst)
    for layer in model.layers.values():
        x = torch.randn(5, layer.hidden_size, generator=torch.Generator().manual_seed(layer.index))
        out = layer(x)
        assert out.shape == x.shape and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("src, quantize, opts", CASES[:5], ids=[q for _, q, _ in CASES[:5]])
def test_codes_are_round_to_nearest_with_the_options(tmp_root, src, quantize, opts):
    """The packed codes, scales and zero points are quantize_int4_group of the source's weights with
    the options (asymmetric: zero points other than 8 appear; symmetric: every one is 8)."""
    dst, _ = converted(tmp_root, src, quantize)
    ckpt, reader = open_source(fixture_dir(src))
    spec = {s.index: s for s in reader.layers(ckpt)}[1]
    layer = moepack.open(dst).layers[1]
    w2 = reader.read_expert_w2(ckpt, spec, 3)[None]
    q, s, z = quantize_int4_group(w2, opts.group_size, sym=opts.sym)
    p = layer.packed
    h, i = w2.shape[1:]
    if opts.group_size == -1:  # [E, Np]: one per channel
        got_s, got_z = p.w2_scale[3, :h, None], p.w2_zero[3, :h, None]
    else:  # [E, groups, Np]
        got_s, got_z = p.w2_scale[3, : s.shape[-1], :h].t(), p.w2_zero[3, : z.shape[-1], :h].t()
    assert torch.equal(got_s, s[0]) and torch.equal(got_z, z[0])
    assert torch.equal(unpack_codes(p.layout, p.w2[3:4])[0, :h, :i], q[0])
    assert bool((z == 8).all()) == opts.sym  # symmetric: every zero point 8; asymmetric: others too
    err = (dequantize_int4_group(q, s, z, opts.group_size) - w2.float()).norm() / w2.float().norm()
    assert 0.0 < float(err) < 0.2


def cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_options_summary_and_verify_table(tmp_path):
    r = cli("convert", fixture_dir("qwen3_moe"), tmp_path / "a", "--quantize", "int4", "--group-size", "64", "--asym", "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["layout"] == int4_layout_for(64).name and out["quantizer"] == "int4_group:g64:asym"
    assert 0.01 < out["quant_error"] < 0.2 and out["quant_error_worst_layer"][0] in (0, 1)
    r = cli("convert", fixture_dir("qwen3_moe"), tmp_path / "b", "--quantize", "int4:ch")
    assert r.exit_code == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "int4_group:ch:sym" in text and "weight error" in text
    r = cli("inspect", tmp_path / "a", "--json")
    assert r.exit_code == 0 and {x["quantizer"] for x in json.loads(r.stdout)["layers"]} == {"int4_group:g64:asym"}
    r = cli("verify", tmp_path / "a", "--source", fixture_dir("qwen3_moe"))
    assert r.exit_code == 0, r.stdout
    assert f"({INT4_FROM_FLOAT_TOL:g})" in r.stdout  # the rule the fp32 column was judged by, beside it
    r = cli("verify", tmp_path / "a", "--source", fixture_dir("qwen3_moe"), "--json")
    layers = json.loads(r.stdout)["layers"]
    assert r.exit_code == 0 and {x["weights"] for x in layers} == {"int4 codes"}
    assert all(x["fp32_tol"] == INT4_FROM_FLOAT_TOL and x["rel_err_fp32"] < x["fp32_tol"] for x in layers)


@pytest.mark.parametrize("quantize, words", [
    ("int4:g48", "int4 group size 48: moepack has int4 layouts for group sizes 32, 64, 128, -1 (-1 = per channel)"),
    ("int4:g0", "int4 group size 0: moepack has int4 layouts for group sizes"),
    ("int4:gx", "int4 option 'gx': options are g<N> (group size: g32, g64, g128), ch (per channel), sym or asym"),
    ("int4:sym:asym", "int4 option 'asym': symmetry given twice (sym or asym, once)"),
    ("int4:g32:g64", "int4 option 'g64': the group size is given twice"),
    ("int8:g64", "scheme int8_channel takes no options (got 'g64')"),
    ("bf16:g64", "moepack quantizes to 'int8_channel' (or 'int8'), 'int4_group' (or 'int4')"),
    ("int3", "moepack quantizes to"),
])  # fmt: skip
def test_bad_options_are_refused_naming_option_value_and_rule(tmp_path, quantize, words):
    with pytest.raises(MoepackError) as ei:
        moepack.convert(fixture_dir("qwen3_moe"), tmp_path / "dst", quantize=quantize)
    assert f"quantize={quantize!r}" in str(ei.value) and words in str(ei.value), str(ei.value)
    assert not (tmp_path / "dst").exists()


def test_cli_refuses_options_without_quantize_and_options_for_a_quantized_source(tmp_path):
    r = cli("convert", fixture_dir("qwen3_moe"), tmp_path / "a", "--group-size", "64")
    assert r.exit_code == 2 and "--group-size / --asym (g64) quantize float weights: give --quantize int4" in " ".join(r.stderr.split())
    r = cli("convert", fixture_dir("qwen3_moe"), tmp_path / "a", "--quantize", "int4", "--group-size", "100")
    assert r.exit_code == 2 and "int4 group size 100" in " ".join(r.stderr.split())
    with pytest.raises(MoepackError, match=r"quantize='int4:g64' with a int4_group source .*never re-quantized"):
        moepack.convert(fixture_dir("qwen2_moe_w4a16"), tmp_path / "b", quantize="int4:g64")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_options_spelled_out_and_parsed_once():
    # "int4" names no group: the layout written decides (the default layout: group 128)
    assert parse_quantize("int4")[1] == Int4Options(None, True)
    assert parse_quantize("int4")[1].resolved(int4_layout_for(128)) == parse_quantize("int4_group:g128:sym")[1] == Int4Options(128, True)
    assert parse_quantize("int4")[1].key() == "int4_group:g128:sym"
    assert parse_quantize("int4:asym:ch")[1] == Int4Options(-1, False)
    assert parse_quantize("int8")[1] is None and parse_quantize(None) == (None, None)


_CHILD = """
import os, signal, sys
from moepack.convert.run import convert
src, dst, quantize = sys.argv[1:4]
def progress(ev, **kw):
    if ev == "shard_done":
        os.kill(os.getpid(), signal.SIGKILL)
convert(src, dst, quantize=quantize, shard_bytes=1, progress=progress)
"""


def test_resume_key_holds_the_options(tmp_path):
    """A hard-killed --quantize int4:g64:asym convert is continued only by a run with the same
    options (symmetric is another plan: its temporary directory is deleted, naming why)."""
    src = fixture_dir("qwen3_moe")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def killed(dst, quantize):
        p = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst), quantize], env=env, capture_output=True, text=True)
        assert p.returncode == -signal.SIGKILL, p.stderr

    dst = tmp_path / "pk"
    killed(dst, "int4:g64:asym")
    events = []
    moepack.convert(src, dst, quantize="int4:g64", shard_bytes=1, progress=lambda ev, **kw: events.append((ev, kw)))
    removed = [kw["reason"] for ev, kw in events if ev == "stale_removed"]
    assert removed and "its quantize differs" in removed[0], removed
    assert json.loads((dst / MANIFEST).read_text())["layers"][0]["quantizer"] == "int4_group:g64:sym"
    # the same options: continued from the killed run's first shard, and right
    dst2 = tmp_path / "pk2"
    killed(dst2, "int4:g64:asym")
    events = []
    resumed = moepack.convert(src, dst2, quantize="int4:g64:asym", shard_bytes=1, progress=lambda ev, **kw: events.append(ev))
    assert "resume" in events and "shard_resumed" in events
    # the summary's error covers every layer, the ones the killed run wrote too (from its journal)
    whole = moepack.convert(src, tmp_path / "pk3", quantize="int4:g64:asym")
    assert resumed.quant_error == pytest.approx(whole.quant_error, rel=1e-12) and resumed.quant_error_worst == whole.quant_error_worst
    assert json.loads((dst2 / MANIFEST).read_text())["layers"][0]["quantizer"] == "int4_group:g64:asym"
    assert moepack.verify(dst2, source=src).ok


@pytest.mark.parametrize("quantize", [None, "int4", "int4:asym"])
def test_options_without_a_group_take_the_layout_asked_for(tmp_path, quantize):
    """A float source converted into an int4 layout (Python API: ``layout=``) with no group size
    named keeps that layout; the manifest's quantizer spells the group out, so verify redoes the
    same quantization (a bare "int4_group" used to read back as group 128 and fail)."""
    dst = tmp_path / "p"
    moepack.convert(fixture_dir("qwen3_moe"), dst, layout="u4g32_n32k8_x86", quantize=quantize)
    m = json.loads((dst / "moepack.json").read_text())
    assert [x["name"] for x in m["layouts"].values()] == ["u4g32_n32k8_x86"]
    sym = "asym" if quantize and "asym" in quantize else "sym"
    assert {x["quantizer"] for x in m["layers"]} == {f"int4_group:g32:{sym}"}
    assert moepack.verify(dst, source=fixture_dir("qwen3_moe")).ok


def test_a_named_group_overrides_the_layout(tmp_path):
    dst = tmp_path / "p"
    moepack.convert(fixture_dir("qwen3_moe"), dst, layout="u4g32_n32k8_x86", quantize="int4:g64")
    m = json.loads((dst / "moepack.json").read_text())
    assert [x["name"] for x in m["layouts"].values()] == ["u4g64_n32k8_x86"]
