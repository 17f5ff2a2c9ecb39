"""``moepack bench --vs``: other engines' fused experts against moepack's in one process
(moepack/bench/vs.py, moepack/bench/peers/, docs/BENCH.md "Side by side").

No timing is asserted (the machine is shared): the tests hold the arm scheduler's promises
(alternation, every arm on every routing set), the rows and the JSON of a ``--vs torch`` run on
a tiny shape, ``--compare`` on that file, the refusals when an engine is missing, the re-run of
the command in another python, and, when ``MOEPACK_VLLM_PYTHON`` names a python with vLLM 0.32,
every vLLM adapter's output against moepack's on the same weights; the same for zentorch when it
is importable here or ``MOEPACK_ZENTORCH_PYTHON`` names a python with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moepack import bench as B
from moepack.bench import peers as P
from moepack.bench import vs as V
from moepack.bench.peers import vllm as PV
from moepack.cli.main import app
from tests.support import skips

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--shapes", "tiny", "--no-probe", "--calls", "8"]


# ---------------------------------------------------------------------------------------------
# the arm scheduler


@pytest.mark.parametrize("engines", [["torch"], ["vllm", "torch"], ["vllm", "zentorch", "torch"]])
def test_arm_count_is_odd_with_moepack_last(engines):
    names = V.arm_names(engines)
    assert names[: len(engines)] == engines and names[len(engines)] == "moepack"
    assert len(names) % 2 == 1
    assert names.count("moepack") == 1 and names.count("moepack (again)") == (1 if len(engines) % 2 else 0)


@pytest.mark.parametrize("arms, calls", [(3, 8), (3, 16), (5, 24), (1, 8)])
def test_schedule_alternates_and_every_arm_sees_every_set_equally(arms, calls):
    plan = V.schedule(arms, calls)
    assert len(plan) == arms * calls
    assert [a for a, _ in plan] == [i % arms for i in range(arms * calls)]  # round robin, call by call
    for a in range(arms):
        seen = Counter(s for x, s in plan if x == a)
        assert sorted(seen) == list(range(V.SETS)) and set(seen.values()) == {calls // V.SETS}


def test_schedule_refuses_arm_counts_sharing_a_factor_with_the_sets():
    with pytest.raises(ValueError, match="2 arms and 8 routing sets share a factor"):
        V.schedule(2, 8)
    with pytest.raises(ValueError, match="must be >= 1"):
        V.schedule(3, 0)


def test_calls_per_arm_is_a_multiple_of_the_sets():
    cfg = B.BenchConfig(calls=None, min_time=1.0)
    assert V.calls_per_arm(cfg, 0.5) == 8  # 3 calls (min_calls) -> one rotation
    assert V.calls_per_arm(cfg, 0.01) == 104  # 100 -> 104
    cfg.calls = 9
    assert V.calls_per_arm(cfg, 0.01) == 16


def test_time_arms_runs_the_plan_in_order():
    seen = []
    fns = [lambda s, a=a: seen.append((a, s)) for a in range(3)]
    plan = V.schedule(3, 8)
    times = V.time_arms(fns, plan)
    assert seen == plan and [len(t) for t in times] == [8, 8, 8]


def test_parse_vs():
    assert P.parse_vs("vllm, torch,vllm") == ["vllm", "torch"]
    with pytest.raises(ValueError, match=r"--vs 'sglang': not an engine .* vllm, zentorch, torch"):
        P.parse_vs("sglang")
    with pytest.raises(ValueError, match="--vs is empty"):
        P.parse_vs(" , ")


def test_gptq_pack_places_row_8r_plus_j_in_nibble_j():
    q = torch.randint(0, 16, (5, 24), dtype=torch.uint8)  # [N, K]
    w = PV.gptq_pack(q)
    assert w.shape == (3, 5) and w.dtype == torch.int32
    back = torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], 1).reshape(24, 5)
    assert torch.equal(back.t().to(torch.uint8), q)


def test_vllm_group_divides_k_and_the_scheme_group():
    assert PV._vllm_group(2048, 128) == 128 and PV._vllm_group(2880, 128) == 64 and PV._vllm_group(352, 128) == 32


# ---------------------------------------------------------------------------------------------
# --vs torch end to end (always available)


def _bench(args, **kw):
    r = CliRunner().invoke(app, ["bench", *args], env={"COLUMNS": "250"}, **kw)
    return r


def test_vs_torch_rows_ratios_json_and_compare(tmp_path):
    out = tmp_path / "vs.json"
    r = _bench(["--vs", "torch", *TINY, "--tokens", "1,8,16", "--json", str(out), "-q"])
    assert r.exit_code == 0, r.output
    assert "moepack against other engines" in r.output and "torch loop (bf16)" in r.output
    data = B.load_result(out)
    assert data["format"] == "moepack-bench" and data["config"]["vs"] == ["torch"]
    rows = data["rows"]
    assert [(x["shape"], x["tokens"], x["scheme"]) for x in rows] == [("tiny", t, "dense") for t in (1, 8, 16)]
    for row in rows:
        assert [a["arm"] for a in row["moepack_arms"]] == ["moepack", "moepack (again)"]  # torch + moepack: 2 -> 3 arms
        assert all(a["calls"] == 8 for a in row["moepack_arms"]) and row["moepack_calls"] == 16
        (v,) = row["vs"]
        assert v["engine"] == "torch" and v["calls"] == 8
        assert v["ratio"] == pytest.approx(v["ms_median"] / row["moepack_ms_median"])
        assert v["ms_min"] <= v["ms_p25"] <= v["ms_median"] and row["moepack_ms_min"] <= row["moepack_ms_p25"] <= row["moepack_ms_median"]
        assert row["speedup"] == pytest.approx(row["torch_ms"] / row["moepack_ms"])  # the plain bench's columns too
        if row["tokens"] <= V.CHECK_MAX_TOKENS:  # both against the fp32 reference: bf16 rounding only
            assert 0 < v["rel_err"] < 2e-2 and 0 < row["moepack_rel_err"] < 2e-2
        else:
            assert v["rel_err"] is None and row["moepack_rel_err"] is None
    r = _bench(["--vs", "torch", *TINY, "--tokens", "1,8", "--compare", str(out), "--markdown", "-q"])
    assert r.exit_code == 0, r.output
    assert "| moepack ÷ engine |" in r.output and "compared with" in r.output and "only in" in r.output
    r = _bench([*TINY, "--tokens", "1", "--skip-torch", "--compare", str(out), "--markdown", "-q"])  # the plain bench reads it too
    assert r.exit_code == 0, r.output
    assert "1 row in both" in r.output


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_vs_torch_quantized_runs_the_dequantized_weights(scheme):
    cfg = B.BenchConfig(shapes=B.parse_shapes("e8k2h256i320"), tokens=[3], scheme=scheme, vs=["torch"], probe=False, calls=8)
    res = B.run_vs(cfg)
    (row,) = res.rows
    (v,) = row.vs
    assert "dequantized" in v["weights"] and v["bytes_per_expert"] == 3 * 256 * 320 * 2
    # the same weights: the loop differs from the fp32 reference by bf16 rounding, moepack by its activations' rounding
    assert v["rel_err"] < 2e-2 and row.moepack_rel_err < 6e-2


def test_fp32_reference_matches_moepacks_oracle_on_dense_weights():
    from moepack.reference import moe_reference
    from moepack.schemes import get_scheme

    g = torch.Generator().manual_seed(3)
    w13 = (torch.randn(4, 2 * 24, 32, generator=g) / 6).bfloat16()
    w2 = (torch.randn(4, 32, 24, generator=g) / 5).bfloat16()
    x = torch.randn(5, 32, generator=g).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [2, 0]], dtype=torch.int32)
    tw = torch.rand(5, 2, generator=g)
    ref = V.fp32_reference(get_scheme("dense"), {"w13": w13, "w2": w2}, x, tw, ids)
    oracle = moe_reference(x.float(), w13.float(), w2.float(), tw, ids.long()).float()
    assert V.rel_err(ref, oracle) < 1e-5


# ---------------------------------------------------------------------------------------------
# engines that are missing


needs_no_vllm = skips.engine_absent_mark(P.importable("vllm"), "vllm", "importable in this interpreter: nothing to refuse")


@skips.engine_absent_mark(P.importable("zentorch"), "zentorch", "importable in this interpreter: nothing to refuse")
def test_zentorch_missing_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("MOEPACK_ZENTORCH_PYTHON", raising=False)  # no zentorch python to re-run in either
    r = _bench(["--vs", "zentorch", *TINY, "--tokens", "1", "-q"])
    assert r.exit_code == 2
    line = r.output.strip()
    assert "\n" not in line and line.startswith("moepack: error: --vs zentorch: zentorch not importable in")
    assert "pip install zentorch==2.13.0.2" in line


@needs_no_vllm
def test_vllm_missing_without_a_vllm_python_is_refused(monkeypatch):
    monkeypatch.delenv(V.CHILD_ENV, raising=False)
    monkeypatch.setattr(V, "vllm_python", lambda: None)
    with pytest.raises(P.PeerUnavailable, match=r"--vs vllm: vllm not importable in .*make vllm-venv.*MOEPACK_VLLM_PYTHON"):
        V.reexec_python(["vllm"])
    monkeypatch.setenv("MOEPACK_VLLM_PYTHON", "/nonexistent/python")
    monkeypatch.setattr(V, "vllm_python", lambda: os.environ["MOEPACK_VLLM_PYTHON"])
    r = _bench(["--vs", "vllm", *TINY, "--tokens", "1", "-q"])
    assert r.exit_code == 2 and "/nonexistent/python is not an executable file" in r.output
    monkeypatch.setenv(V.CHILD_ENV, "1")  # the re-run itself never re-runs again
    with pytest.raises(P.PeerUnavailable, match="either"):
        V.reexec_python(["vllm"])
    assert V.reexec_python(["torch"]) is None


@needs_no_vllm
def test_vllm_missing_reruns_the_same_options_in_the_vllm_python(monkeypatch):
    calls = []
    monkeypatch.delenv(V.CHILD_ENV, raising=False)
    monkeypatch.setattr(B, "reexec_python", lambda engines: "/venv/bin/python")
    monkeypatch.setattr(B, "reexec", lambda py, args, threads=None: calls.append((py, args, threads)) or 0)
    r = _bench(["--vs", "vllm,torch", "--shapes", "tiny", "--tokens", "1,8", "--scheme", "int4", "--act-mode", "a8",
                "--no-probe", "--calls", "16", "-q"])  # fmt: skip
    assert r.exit_code == 0, r.output
    (py, args, threads), = calls
    assert py == "/venv/bin/python" and args[0] == "bench" and threads == 2  # OMP_NUM_THREADS there, unless set
    a = args[1:]
    pairs = {a[i]: a[i + 1] for i in range(len(a) - 1) if a[i].startswith("--") and not a[i + 1].startswith("-")}
    assert pairs["--shapes"] == "tiny" and pairs["--tokens"] == "1,8" and pairs["--scheme"] == "int4"
    assert pairs["--act-mode"] == "a8" and pairs["--calls"] == "16" and pairs["--vs"] == "vllm,torch"
    assert "--no-probe" in a and "--quiet" in a


def test_omp_note_when_vllm_runs_without_omp_num_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert "OMP_NUM_THREADS is unset, not 2 (--threads)" in V.omp_note(["vllm"], 2)
    assert V.omp_note(["torch"], 2) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert V.omp_note(["vllm", "torch"], 2) is None
    assert "OMP_NUM_THREADS is '2', not 4" in V.omp_note(["vllm"], 4)


def test_reexec_runs_the_cli_in_another_python(tmp_path):
    """The re-run's bootstrap (this moepack, its CLI, the torch check) in a fresh interpreter."""
    out = tmp_path / "child.json"
    rc = V.reexec(sys.executable, ["bench", "--vs", "torch", *TINY, "--tokens", "1", "--json", str(out), "-q"])
    assert rc == 0
    assert json.loads(out.read_text())["rows"][0]["vs"][0]["engine"] == "torch"


def test_reexec_refuses_another_torch(tmp_path):
    r = subprocess.run([sys.executable, "-c", V.BOOT, "[]", str(tmp_path), str(tmp_path)], capture_output=True, text=True,
                       env={**os.environ, V.TORCH_ENV: "0.0.1-other"})  # fmt: skip
    assert r.returncode != 0 and "moepack's extension was built against torch 0.0.1-other" in r.stderr


def test_schemes_an_engine_lacks_are_left_out_with_a_note():
    assert P.supports("zentorch", "fp8_block", torch.bfloat16) == "zentorch has no fp8_block path (it runs dense, int8_channel)"
    assert "bf16 activations" in P.supports("vllm", "dense", torch.float32)
    cfg = B.BenchConfig(shapes=B.parse_shapes("tiny"), tokens=[1], dtype="fp32", vs=["torch"], probe=False, calls=8)
    assert B.run_vs(cfg).rows[0].vs[0]["engine"] == "torch"


# ---------------------------------------------------------------------------------------------
# vLLM's adapters, in vLLM's own python (skipped without one)


VLLM_PY = skips.vllm_python()
needs_vllm = pytest.mark.vllm  # conftest: runs where the vLLM venv is (make vllm-venv), fails under CI=true without it

# every vLLM adapter on the same weights as moepack: outputs on shapes whose K is and is not a
# multiple of 128 (vLLM's int4 then takes moepack's group-128 scales over groups of 64 / 32)
DRIVER = r"""
import json, sys, torch
from moepack.bench import peers as P, vs as V
from moepack.bench.run import make_weights
from moepack.bench.shapes import parse_shapes
from moepack.isa import host_family
from moepack.pack import in_huge_pages
from moepack.runtime.experts import run_experts
from moepack.schemes import get_scheme
from moepack.bench.timing import RoutingStream
torch.set_num_threads(2)
out = []
for shape in parse_shapes("e8k2h256i384,e8k2h384i352"):
    w13, w2 = make_weights(shape, 5)
    for scheme, mode in [("dense", None), ("int8", None), ("int4", "a8"), ("int4", "a16"), ("fp8", None), ("mxfp4", "a16")]:
        s = get_scheme(scheme)
        lay = s.layout_for(host_family())
        c = P.prepare_canonical(s.name, V.canonical_from_float(s, w13, w2, lay))
        packed = in_huge_pages(s.pack(c, interleaved=False, layout=lay))
        arm = P.build_peer("vllm", s, c, shape.num_experts)
        for t in (1, 5):
            w, ids, _ = RoutingStream(t, shape.num_experts, shape.topk, seed=t).next()
            x = torch.randn(t, shape.hidden, generator=torch.Generator().manual_seed(t)).bfloat16()
            ref = V.fp32_reference(s, c, x, w, ids)
            yv, ym = arm.fn(x, w, ids), run_experts(packed, x, w, ids, act_mode=mode)
            out.append(dict(shape=shape.name, scheme=s.name, mode=mode, t=t, path=arm.path, weights=arm.weights,
                            vllm_vs_moepack=V.rel_err(yv, ym.float()), vllm_vs_ref=V.rel_err(yv, ref), moepack_vs_ref=V.rel_err(ym, ref)))
print("RESULT " + json.dumps(out))
"""

# Measured on the development machine (relative errors, T = 1 and 5): vLLM against moepack 2.8e-3
# to 5.4e-3 (dense, int8, fp8, mxfp4: the same weights, and for int8 the same kind of per-token
# activation quantization), 7.9e-3 to 1.2e-2 (int4, both W4A8), 1.8e-2 to 3.3e-2 (vLLM's W4A8
# against moepack's W4A16); against the fp32 reference 2.1e-3 to 4.4e-3 for bf16 activations,
# 1.8e-2 to 3.3e-2 for int8 ones. The bounds leave about 2x; a wrong layout, scale or nibble
# order lands near 1.
PAIR = {("dense", None): 1e-2, ("int8_channel", None): 1e-2, ("int4_group", "a8"): 3e-2, ("int4_group", "a16"): 6e-2,
        ("fp8_block", None): 1e-2, ("mxfp4", "a16"): 1e-2}  # fmt: skip
A8 = {"int8_channel", "int4_group"}  # vLLM quantizes the activations per token


def _cpu_has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


# vLLM 0.32's CPU wheel keeps fused_experts_cpu in its AVX-512 build (vllm._C); on an AVX2-only CPU
# it loads _C_AVX2, which has no fused MoE (seen on a Zen 3 VM, 2026-12-07: `import vllm._C` is an
# illegal instruction there), so there is no vLLM kernel to compare with.
@needs_vllm
@skips.host_lacks_mark(not _cpu_has_avx512f(), "AVX-512 F: vLLM 0.32's CPU fused_experts_cpu is in its AVX-512 build only")
def test_every_vllm_adapter_matches_moepack_on_the_same_weights():
    r = subprocess.run([VLLM_PY, "-c", DRIVER], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"})  # fmt: skip
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(line[7:])
    assert len(res) == 2 * 6 * 2
    for x in res:
        what = f"{x['shape']} {x['scheme']} {x['mode']} T={x['t']} ({x['path']})"
        assert x["vllm_vs_moepack"] < PAIR[(x["scheme"], x["mode"])], what + f": vLLM vs moepack {x['vllm_vs_moepack']:.3g}"
        assert x["vllm_vs_ref"] < (6e-2 if x["scheme"] in A8 else 1e-2), what + f": vLLM vs the fp32 reference {x['vllm_vs_ref']:.3g}"
        moepack_a8 = x["scheme"] == "int8_channel" or x["mode"] == "a8"
        assert x["moepack_vs_ref"] < (6e-2 if moepack_a8 else 1e-2), what + f": moepack vs the fp32 reference {x['moepack_vs_ref']:.3g}"
    assert any("groups of 32" in x["weights"] for x in res if x["scheme"] == "int4_group")  # I = 352


# ---------------------------------------------------------------------------------------------
# zentorch: its python (MOEPACK_ZENTORCH_PYTHON), and its adapters (skipped without zentorch)


def test_zentorch_python_is_where_the_bench_reruns(monkeypatch, tmp_path):
    monkeypatch.delenv(V.CHILD_ENV, raising=False)
    monkeypatch.setattr(P, "importable", lambda m: m not in ("vllm", "zentorch"))  # neither here
    monkeypatch.delenv("MOEPACK_ZENTORCH_PYTHON", raising=False)
    with pytest.raises(P.PeerUnavailable, match=r"--vs zentorch: zentorch not importable in .*pip install zentorch==2\.13\.0\.2.*MOEPACK_ZENTORCH_PYTHON"):
        V.reexec_python(["zentorch", "torch"])
    monkeypatch.setenv("MOEPACK_ZENTORCH_PYTHON", sys.executable)
    assert V.reexec_python(["zentorch", "torch"]) == sys.executable
    monkeypatch.setenv("MOEPACK_ZENTORCH_PYTHON", str(tmp_path / "python"))
    with pytest.raises(P.PeerUnavailable, match=r"the zentorch python .*/python is not an executable file"):
        V.reexec_python(["zentorch"])
    other = tmp_path / "python2"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv("MOEPACK_ZENTORCH_PYTHON", sys.executable)
    monkeypatch.setattr(V, "vllm_python", lambda: str(other))
    with pytest.raises(P.PeerUnavailable, match=r"--vs vllm,zentorch: they are in two pythons .*run one --vs at a time"):
        V.reexec_python(["vllm", "zentorch"])
    monkeypatch.setattr(V, "vllm_python", lambda: sys.executable)  # one python with both: fine
    assert V.reexec_python(["vllm", "zentorch"]) == sys.executable
    monkeypatch.setenv(V.CHILD_ENV, "1")
    with pytest.raises(P.PeerUnavailable, match=r"not importable in .* either \(the zentorch python named by MOEPACK_ZENTORCH_PYTHON\)"):
        V.reexec_python(["zentorch"])


def _zentorch_python() -> str | None:
    p = os.environ.get("MOEPACK_ZENTORCH_PYTHON")
    if p:
        return p
    return sys.executable if P.importable("zentorch") else None


ZT_PY = _zentorch_python()
needs_zentorch = skips.engine_absent_mark(ZT_PY is None, "zentorch", "not installed: set MOEPACK_ZENTORCH_PYTHON to a "
                                          "python with zentorch==2.13.0.2 and torch==2.13.0 to run these")

# both zentorch adapters on the same weights as moepack, T = 1, 5 and 40; the canonical tensors
# must come out of zentorch's calls as they went in (its bf16 path reorders the weights it is
# given in place: the adapter gives it copies)
ZT_DRIVER = r"""
import json, torch
from moepack.bench import peers as P, vs as V
from moepack.bench.run import make_weights
from moepack.bench.shapes import parse_shapes
from moepack.bench.timing import RoutingStream
from moepack.isa import host_family
from moepack.pack import in_huge_pages
from moepack.runtime.experts import run_experts
from moepack.schemes import get_scheme
torch.set_num_threads(2)
out = []
for shape in parse_shapes("e8k2h256i384,e16k4h384i352"):
    w13, w2 = make_weights(shape, 7)
    for scheme in ("dense", "int8"):
        s = get_scheme(scheme)
        lay = s.layout_for(host_family())
        c = P.prepare_canonical(s.name, V.canonical_from_float(s, w13, w2, lay))
        before = {k: v.clone() for k, v in c.items() if torch.is_tensor(v)}
        packed = in_huge_pages(s.pack(c, interleaved=False, layout=lay))
        arm = P.build_peer("zentorch", s, c, shape.num_experts)
        for t in (1, 5, 40):
            w, ids, _ = RoutingStream(t, shape.num_experts, shape.topk, seed=t).next()
            x = torch.randn(t, shape.hidden, generator=torch.Generator().manual_seed(t)).bfloat16()
            yz = arm.fn(x, w, ids)
            yz2 = arm.fn(x, w, ids)  # the second call too (after its first-call reordering)
            ym = run_experts(packed, x, w, ids)
            ref = V.fp32_reference(s, c, x, w, ids)
            out.append(dict(shape=shape.name, scheme=s.name, t=t, zt_vs_moepack=V.rel_err(yz, ym.float()),
                            zt2_vs_moepack=V.rel_err(yz2, ym.float()), zt_vs_ref=V.rel_err(yz, ref),
                            moepack_vs_ref=V.rel_err(ym, ref),
                            canonical_kept=all(torch.equal(before[k], c[k]) for k in before)))
print("RESULT " + json.dumps(out))
"""


# Measured on the development machine (Intel Sapphire Rapids VM, relative errors, T = 1, 5, 40):
# zentorch against moepack 2.3e-3 to 2.8e-3 (dense), 2.3e-3 to 4.5e-3 (int8: both quantize the
# activations per token); against the fp32 reference 2.8e-3 to 2.9e-3 (dense), 1.8e-2 to 2.1e-2
# (int8). Without the adapter's copies the canonical bf16 tensors come back reordered (both
# shapes). The bounds leave about 2x.
ZT_PAIR = {"dense": 1e-2, "int8_channel": 1e-2}
ZT_REF = {"dense": 1e-2, "int8_channel": 5e-2}


@needs_zentorch
def test_zentorch_adapters_match_moepack_on_the_same_weights():
    r = subprocess.run([ZT_PY, "-c", ZT_DRIVER], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"})  # fmt: skip
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(line[7:])
    assert len(res) == 2 * 2 * 3
    for x in res:
        what = f"{x['shape']} {x['scheme']} T={x['t']}"
        assert x["canonical_kept"], what + ": zentorch changed the canonical tensors it was given"
        bound = ZT_PAIR[x["scheme"]]
        assert x["zt_vs_moepack"] < bound and x["zt2_vs_moepack"] < bound, what + f": zentorch vs moepack {x['zt_vs_moepack']:.3g}, {x['zt2_vs_moepack']:.3g}"
        assert x["zt_vs_ref"] < ZT_REF[x["scheme"]], what + f": zentorch vs the fp32 reference {x['zt_vs_ref']:.3g}"
        assert x["moepack_vs_ref"] < ZT_REF[x["scheme"]], what + f": moepack vs the fp32 reference {x['moepack_vs_ref']:.3g}"


# The adapter's own logic without zentorch: a stand-in op with zentorch's contract as measured
# (int32 ids only, fp32 routing weights, per-channel fp32 scales [E, N] for int8 codes, and bf16
# weights rewritten in place on the first call, every expert), computing the layer in fp32 on
# the weights it was given. The adapter must hand it int32 ids, fp32 weights and scales, and
# copies of the bf16 weights, so that the canonical tensors come back as they went in.
class _FakeZentorchMoe:
    def __init__(self):
        self.calls = []
        self.reordered: set[int] = set()  # data_ptr of the weight tensors this op has rewritten

    def __call__(self, out, x, w13, w2, b13, b2, tw, ti, skip_weighted, act, s13, s2):
        if ti.dtype != torch.int32:
            raise RuntimeError(f"expected scalar type Int but found {ti.dtype}")
        self.calls.append(dict(ids=ti.dtype, tw=tw.dtype, act=act, skip=skip_weighted, bias=(b13, b2),
                               s13=None if s13 is None else (s13.dtype, tuple(s13.shape)),
                               s2=None if s2 is None else (s2.dtype, tuple(s2.shape)), w13_ptr=w13.data_ptr()))  # fmt: skip
        w13f, w2f = w13.float(), w2.float()
        if w13.dtype == torch.bfloat16 and w13.data_ptr() in self.reordered:
            w13f, w2f = w13f.flip(-1), w2f.flip(-1)  # its own layout: read back in order
        if s13 is not None:
            w13f, w2f = w13f * s13[..., None], w2f * s2[..., None]
        inter = w13.shape[1] // 2
        y = torch.zeros(x.shape[0], w2.shape[1])
        for t in range(x.shape[0]):
            for j in range(ti.shape[1]):
                e = int(ti[t, j])
                h = w13f[e] @ x[t].float()
                y[t] += float(tw[t, j]) * (w2f[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
        out.copy_(y.to(out.dtype))
        if w13.dtype == torch.bfloat16 and w13.data_ptr() not in self.reordered:  # every expert, routed or not
            w13.copy_(w13.flip(-1))
            w2.copy_(w2.flip(-1))
            self.reordered.add(w13.data_ptr())


@pytest.mark.parametrize("scheme", ["dense", "int8"])
def test_zentorch_adapter_logic_without_zentorch(monkeypatch, scheme):
    from moepack.bench.peers import zentorch as PZ
    from moepack.bench.run import make_weights
    from moepack.bench.shapes import parse_shapes
    from moepack.bench.timing import RoutingStream
    from moepack.isa import host_family
    from moepack.schemes import get_scheme

    fake = _FakeZentorchMoe()
    monkeypatch.setattr(PZ, "check_engine", lambda engine: None)
    monkeypatch.setattr(PZ, "_op", lambda: fake)
    (shape,) = parse_shapes("e8k2h64i96")
    w13, w2 = make_weights(shape, 3)
    s = get_scheme(scheme)
    c = P.prepare_canonical(s.name, V.canonical_from_float(s, w13, w2, s.layout_for(host_family())))
    before = {k: v.clone() for k, v in c.items() if torch.is_tensor(v)}
    arm = P.build_peer("zentorch", s, c, shape.num_experts)
    assert (arm.engine, arm.path) == ("zentorch", "zentorch_fused_moe")
    for t in (1, 5):
        w, ids, _ = RoutingStream(t, shape.num_experts, shape.topk, seed=t).next()
        x = torch.randn(t, shape.hidden, generator=torch.Generator().manual_seed(t)).bfloat16()
        ref = V.fp32_reference(s, c, x, w, ids)
        for ids_given in (ids.long(), ids.int()):  # int64 ids are converted, not refused
            y = arm.fn(x, w.double(), ids_given)
            assert y.dtype == torch.bfloat16 and y.shape == x.shape
            assert V.rel_err(y, ref) < 1e-2, f"{scheme} T={t}: {V.rel_err(y, ref):.3g}"
    assert len(fake.calls) == 4
    for call in fake.calls:
        assert call["ids"] == torch.int32 and call["tw"] == torch.float32 and call["act"] == "silu"
        assert call["skip"] is False and call["bias"] == (None, None)
    e, n13, n2 = shape.num_experts, 2 * shape.intermediate, shape.hidden
    if scheme == "dense":
        assert arm.act == "bf16" and "its own copy" in arm.weights
        assert fake.calls[0]["s13"] is None and fake.calls[0]["w13_ptr"] != c["w13"].data_ptr()
        assert arm.bytes_per_expert == 2 * (n13 * shape.hidden + n2 * shape.intermediate)
    else:
        assert arm.act == "W8A8" and "per-channel scales" in arm.weights
        assert fake.calls[0]["s13"] == (torch.float32, (e, n13)) and fake.calls[0]["s2"] == (torch.float32, (e, n2))
        assert arm.bytes_per_expert == n13 * shape.hidden + n2 * shape.intermediate + 4 * (n13 + n2)
    for k, v in before.items():
        assert torch.equal(v, c[k]), f"{scheme}: the adapter let zentorch change the canonical {k}"


def test_zentorch_adapter_refuses_other_schemes_by_name(monkeypatch):
    from moepack.bench.peers import zentorch as PZ

    monkeypatch.setattr(PZ, "check_engine", lambda engine: None)
    with pytest.raises(P.PeerUnsupported, match=r"zentorch has no int4_group path \(it runs dense, int8_channel\)"):
        PZ.build("int4_group", {})
