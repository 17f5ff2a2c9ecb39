"""``moepack convert | verify | inspect``: what they print, their ``--json`` outputs, exit codes
(0 ok, 1 verify mismatch, 2 user error with one line ``moepack: error: ...`` on stderr, ``--debug``
for the traceback). Most runs are in-process (typer's CliRunner); two go through
``python -m moepack`` to cover the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moepack
from moepack.convert.run import MANIFEST
from moepack.errors import MoepackError
from moepack.isa import ISAS
from tests.support.fixtures_util import fixture_dir, fixture_info

REPO = Path(__file__).resolve().parents[2]


def cli(*args, **kw):
    from moepack.cli.main import app
    from typer.testing import CliRunner

    return CliRunner().invoke(app, [str(a) for a in args], **kw)


_BOX = {c: " " for c in range(0x2500, 0x2580)} | {ord("|"): " "}


def flat(text: str) -> str:
    """Text without rich's box-drawing characters, whitespace collapsed (rich wraps long lines
    and table cells at the console width)."""
    return " ".join(text.translate(_BOX).split())


def start_module(*args, env_extra: dict | None = None) -> subprocess.Popen:
    """``python -m moepack ARGS`` started in the background (stdout/stderr piped, text)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **(env_extra or {}))
    cmd = [sys.executable, "-m", "moepack", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """deepseek_v3 (1 MoE layer after a dense one, shared expert, grouped routing) via the CLI."""
    dst = tmp_path_factory.mktemp("cli") / "ds3"
    r = cli("convert", fixture_dir("deepseek_v3"), dst)
    assert r.exit_code == 0, r.stderr
    return dst


def test_convert_prints_a_summary(tmp_path):
    dst = tmp_path / "q3"
    r = cli("convert", fixture_dir("qwen3_moe"), dst)
    assert r.exit_code == 0, r.stderr
    out = flat(r.stdout)
    m = json.loads((dst / MANIFEST).read_text())
    for needle in ("moepack convert", "MoE layers 2", "layout bf16_n32k2_x86", "packed experts", "other tensors", "MB/s"):
        assert needle in out, f"{needle!r} not in {out!r}"
    for f in m["files"]:
        if f.endswith(".safetensors"):
            assert f in out
    assert "Traceback" not in r.stderr


def test_convert_json(tmp_path):
    dst = tmp_path / "mx"
    r = cli("convert", fixture_dir("mixtral_sharded"), dst, "--json")
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)
    m = json.loads((dst / MANIFEST).read_text())
    assert s["dst"] == str(dst) and s["layers"] == 2 and s["layout"] == "bf16_n32k2_x86"
    assert s["files"] == [f for f in m["files"] if f.endswith(".safetensors")]
    expert_bytes = sum((dst / f).stat().st_size for f in s["files"] if f.startswith("experts-"))
    assert 0 < s["expert_bytes"] <= expert_bytes and s["other_bytes"] > 0 and s["seconds"] > 0


def test_convert_shard_size_and_threads(tmp_path):
    """--shard-gib splits the expert layers (and the other tensors) over several files;
    --threads applies to the convert only (torch's thread count is restored)."""
    threads = torch.get_num_threads()
    dst = tmp_path / "q3"
    r = cli("convert", fixture_dir("qwen3_moe"), dst, "--shard-gib", 0.0002, "--threads", 1, "--json")
    assert r.exit_code == 0, r.stderr
    assert torch.get_num_threads() == threads
    files = json.loads(r.stdout)["files"]
    assert [f for f in files if f.startswith("experts-")] == ["experts-00001-of-00002.safetensors", "experts-00002-of-00002.safetensors"]
    assert len([f for f in files if f.startswith("model-")]) >= 1
    assert moepack.verify(dst, source=fixture_dir("qwen3_moe")).ok
    m = moepack.open(dst)
    assert {m.manifest["tensors"][m.layers[i].entry["tensors"]["w13"]]["file"] for i in (0, 1)} == set(files[:2])


def test_verify_text_and_json(packed):
    n = len(json.loads((packed / MANIFEST).read_text())["tensors"])
    r = cli("verify", packed)
    assert r.exit_code == 0, r.stderr
    assert f"checksums: {n}/{n} tensors match the manifest" in r.stdout
    r = cli("verify", packed, "--json")
    assert r.exit_code == 0
    v = json.loads(r.stdout)
    assert v["ok"] is True and v["tensors_checked"] == n and v["failures"] == [] and v["layers"] == [] and v["source"] is None


def test_verify_with_source_json(packed):
    r = cli("verify", packed, "--source", fixture_dir("deepseek_v3"), "--json", "--tokens", 3)
    assert r.exit_code == 0, r.stderr
    v = json.loads(r.stdout)
    assert v["ok"] is True and v["fingerprint_match"] is True and v["source"] == str(fixture_dir("deepseek_v3"))
    assert [c["index"] for c in v["layers"]] == fixture_info("deepseek_v3")["moe_layers"] == [1]
    (c,) = v["layers"]
    assert c["weights_exact"] is True and c["ok"] is True and c["rel_err"] <= c["tol"]


@pytest.fixture(scope="module")
def packed_mixtral(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("cli") / "mixtral"
    moepack.convert(fixture_dir("mixtral"), dst)
    return dst


def test_python_m_moepack(packed_mixtral, tmp_path):
    """The real entry point, two runs at once (each pays for importing torch): verify --source
    prints the per-layer table (wide terminal); a user error is exactly one line, exit 2."""
    ok = start_module("verify", packed_mixtral, "--source", fixture_dir("mixtral"), env_extra={"COLUMNS": "200"})
    bad = start_module("convert", tmp_path / "missing", tmp_path / "out")
    out, err = ok.communicate(timeout=120)
    assert ok.returncode == 0, err
    lines = out.splitlines()
    assert any("layers against" in ln and str(fixture_dir("mixtral")) in ln for ln in lines), out
    header = next(ln for ln in lines if "weights == source (bf16)" in ln)
    for col in ("layer", "act mode", "output rel. error", "tolerance", "result"):
        assert col in header
    rows = [flat(ln).split() for ln in lines]
    rows = [row for row in rows if row[:1] in (["0"], ["1"])]
    assert [row[0] for row in rows] == ["0", "1"], out
    for row in rows:
        assert row[1] == "yes" and row[2] == "a16" and row[-1] == "ok" and float(row[3]) <= float(row[4]), row

    out, err = bad.communicate(timeout=120)
    assert bad.returncode == 2
    assert err == f"moepack: error: source {tmp_path / 'missing'}: not a directory (expected a Hugging Face checkpoint directory)\n"
    assert out == "" and not (tmp_path / "out").exists()


def test_inspect_names_the_kernel_and_why(packed):
    model = moepack.open(packed)
    layer = model.layers[1]
    isa, reason = layer.kernel
    assert isa in ISAS and reason
    r = cli("inspect", packed)
    assert r.exit_code == 0, r.stderr
    out = flat(r.stdout)
    assert flat(f"kernel for {layer.packed.layout.name}: {reason}") in out
    assert "deepseek_v3" in out and "format v6" in out and "grouped_sigmoid" in out
    r = cli("inspect", packed, "--json")
    assert r.exit_code == 0
    j = json.loads(r.stdout)
    assert j["format_version"] == 6 and j["model_type"] == "deepseek_v3" and j["routing"]["method"] == "grouped_sigmoid"
    (lj,) = j["layers"]
    assert lj["index"] == 1 and lj["kernel"] == isa and lj["reason"] == reason
    assert (lj["experts"], lj["hidden"], lj["intermediate"], lj["activation"]) == (8, 72, 40, "silu")
    assert lj["layout"] == "bf16_n32k2_x86" and lj["bytes"] > 0
    assert set(j["files"]) == set(model.manifest["files"])


def test_exit_codes(packed, tmp_path):
    assert cli("verify", packed).exit_code == 0
    assert cli("inspect", packed).exit_code == 0
    # 2: user errors, one line each
    for args, needle in (
        (("verify", tmp_path / "nope"), "no moepack.json"),
        (("inspect", tmp_path / "nope"), "no moepack.json"),
        (("verify", packed, "--tokens", 0), "--tokens 0: must be positive"),
        (("verify", packed, "--source", tmp_path / "nope"), "not a directory"),
        (("convert", fixture_dir("qwen3_moe"), tmp_path / "a", "--shard-gib", 0), "--shard-gib 0.0: must be positive"),
        (("convert", fixture_dir("qwen3_moe"), tmp_path / "b", "--threads", 0), "threads=0: must be a positive integer"),
        (("convert", fixture_dir("qwen3_moe"), tmp_path / "c", "--target", "riscv"), "--target 'riscv'"),
        (("convert", fixture_dir("qwen3_moe"), tmp_path / "d", "--isa", "riscv"), "--target 'riscv'"),
        (("convert", fixture_dir("qwen3_moe"), packed), "already exists"),
    ):
        r = cli(*args)
        assert r.exit_code == 2, (args, r.stdout, r.stderr, r.exception)
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("moepack: error: ") and needle in lines[0], (args, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # 1: verify --source against another model's checkpoint (same shapes, other weights)
    r = cli("verify", packed, "--source", fixture_dir("qwen3_moe"))
    assert r.exit_code == 1 and "FAIL" in r.stdout and "weights differ" in flat(r.stdout), r.stdout
    assert "fingerprint differs" in flat(r.stderr)
    # 1: a flipped byte (tests/container/test_packdir_errors.py has the details)
    bad = tmp_path / "bad"
    moepack.convert(fixture_dir("olmoe"), bad)
    f = bad / "experts-00001-of-00001.safetensors"
    b = bytearray(f.read_bytes())
    b[-3] ^= 1
    f.write_bytes(bytes(b))
    r = cli("verify", bad)
    assert r.exit_code == 1 and "MISMATCH moepack.layers.1.w2" in r.stdout, r.stdout


def test_debug_raises_instead_of_one_line(tmp_path):
    r = cli("--debug", "convert", tmp_path / "missing", tmp_path / "out")
    assert isinstance(r.exception, MoepackError) and "not a directory" in str(r.exception)
    assert "moepack: error:" not in r.stderr
    r = cli("convert", tmp_path / "missing", tmp_path / "out")  # --debug does not stick
    assert r.exit_code == 2 and r.stderr.startswith("moepack: error: ")
