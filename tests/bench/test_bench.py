"""The benchmark's plain-read baseline (torch.ops.moepack.read_experts) and the rows that use it.

read_experts reads every byte of the listed experts of two packed tensors; its checksum (the sum
of the bytes as little-endian uint64 words, then the tail bytes, modulo 2**64) proves every byte
was read, and bad input is refused by name. The bench times it right after each moepack call on
the same experts: '% raw read' = how close moepack is to merely reading its weights, measured in
the same run (robust to a noisy machine, unlike a bandwidth probed at another moment).

Also: the versioned result file and ``--compare`` (on synthetic files), which instructions the
machine-limit probe runs per CPU and which one each kernel is divided by (no timing), and
``moepack info`` without a compiler. The probe's read search itself: tests/bench/test_probe.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import moepack
from moepack import bench as B

moepack.load_extension()
OPS = torch.ops.moepack


def checksum(t: torch.Tensor, ids) -> int:
    total = 0
    per = t.numel() * t.element_size() // t.shape[0]
    raw = t.contiguous().view(torch.uint8).reshape(t.shape[0], per).numpy()
    for e in ids:
        b = raw[int(e)]
        for off in range(0, per, 65536):  # the op's 64 KiB pieces, each with its own uint8 tail
            piece = b[off : off + 65536]
            n8 = len(piece) // 32 * 32
            total += int(piece[:n8].view("<u8").astype(np.uint64).sum(dtype=np.uint64))
            total += int(piece[n8:].astype(np.uint64).sum())
    return total % 2**64


@pytest.mark.parametrize("shape", [(5, 70001), (3, 64, 33)], ids=["odd-bytes", "3d"])
def test_read_experts_reads_every_byte(shape):
    g = torch.Generator().manual_seed(1)
    w13 = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
    w2 = torch.randint(0, 2**15, (shape[0], 1000), dtype=torch.int16, generator=g)
    ids = torch.tensor([4 if shape[0] > 4 else 2, 0, 1], dtype=torch.int32)
    got = OPS.read_experts(w13, w2, ids) % 2**64
    assert got == (checksum(w13, ids.tolist()) + checksum(w2, ids.tolist())) % 2**64
    assert OPS.read_experts(w13, w2, ids.long()) == OPS.read_experts(w13, w2, ids)
    assert OPS.read_experts(w13, w2, torch.empty(0, dtype=torch.int32)) == 0


def test_read_experts_refuses():
    w13, w2 = torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(IndexError, match=r"ids\[1\] = 4 is out of range \[0, 4\)"):
        OPS.read_experts(w13, w2, torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="same leading expert dimension"):
        OPS.read_experts(w13, torch.zeros(3, 8, dtype=torch.int8), torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D int32 or int64"):
        OPS.read_experts(w13, w2, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="contiguous"):
        OPS.read_experts(w13.t(), w2, torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("scheme", ["bf16", "int8"])
def test_bench_rows_carry_the_plain_read_baseline(scheme):
    cfg = B.BenchConfig(shapes=B.parse_shapes("tiny"), tokens=[1, 3], threads=1, scheme=scheme, calls=2, probe=False,
                        skip_torch=True)
    result = B.run_benchmark(cfg)
    for r in result.rows:
        assert r.raw_read_ms is not None and r.raw_read_ms > 0 and r.raw_read_gbs > 0
        assert r.moepack_raw_frac == pytest.approx(r.raw_read_ms / r.moepack_ms)
    md = B.render_markdown(result)
    assert "% raw read" in md
    assert all(f"{100 * r.moepack_raw_frac:.0f}%" in md for r in result.rows)


# ---------------------------------------------------------------------------------------------
# Result files and --compare (synthetic files: no timing is asserted)

from moepack.bench import probe as P  # noqa: E402
from moepack.bench import report as R  # noqa: E402


def _row(shape="qwen3-30b-a3b", tokens=1, ms=10.0, gbs=20.0, scheme="dense", dtype="bf16", **kw):
    return {"shape": shape, "tokens": tokens, "scheme": scheme, "dtype": dtype, "moepack_ms": ms, "moepack_gbs": gbs, **kw}


def _result(rows, version=R.FORMAT_VERSION, **machine):
    return {"format": R.FORMAT, "format_version": version, "rows": rows,
            "machine": {"cpu_model": "cpu", "threads": 2, **machine}}


def test_compare_flags_rows_slower_than_the_threshold():
    old = _result([_row(tokens=1, ms=10.0, gbs=20.0), _row(tokens=8, ms=10.0), _row(tokens=64, ms=10.0),
                   _row(tokens=512, ms=10.0), _row(shape="mixtral-8x7b", tokens=1, ms=5.0)])
    new = _result([_row(tokens=1, ms=11.0, gbs=18.0), _row(tokens=8, ms=9.0), _row(tokens=64, ms=10.3),
                   _row(tokens=512, ms=10.5), _row(shape="gpt-oss-20b", tokens=1, ms=5.0)])
    cmp = R.compare_results(new, old, against="old.json", threshold=0.05)
    by_t = {r.key[3]: r for r in cmp.rows if r.key[0] == "qwen3-30b-a3b"}
    assert {t: r.verdict for t, r in by_t.items()} == {1: "slower", 8: "faster", 64: "same", 512: "same"}
    assert by_t[1].ms_ratio == pytest.approx(1.1) and by_t[1].gbs_ratio == pytest.approx(0.9)
    assert by_t[512].ms_ratio == pytest.approx(1.05)  # exactly at the threshold: not flagged
    assert cmp.only_new == [("gpt-oss-20b", "dense", "bf16", 1)]
    assert cmp.only_old == [("mixtral-8x7b", "dense", "bf16", 1)]
    assert [r.key for r in cmp.slower] == [("qwen3-30b-a3b", "dense", "bf16", 1)]
    s = cmp.summary()
    assert "4 rows in both, 1 slower by more than 5% (qwen3-30b-a3b T=1 bf16)" in s
    assert "1 faster" in s and "only in this run: gpt-oss-20b T=1 bf16" in s and "only in old.json: mixtral-8x7b T=1 bf16" in s
    md = R.render_compare_markdown(cmp)
    line = next(ln for ln in md.splitlines() if ln.startswith("| qwen3-30b-a3b | 1 |"))
    assert line.split(" | ")[5:] == ["1.100", "18.0", "20.0", "0.900", "SLOWER |"]
    assert R.compare_results(new, old, threshold=0.15).slower == []  # a looser threshold
    assert len(R.compare_results(new, old, threshold=0.0).slower) == 3  # 0: every slower row


def test_compare_keys_rows_by_shape_scheme_dtype_and_tokens():
    old = _result([_row(scheme="dense"), _row(dtype="fp32")])
    new = _result([_row(scheme="int8_channel"), _row(dtype="fp32", ms=20.0)])
    cmp = R.compare_results(new, old)
    assert [r.key for r in cmp.rows] == [("qwen3-30b-a3b", "dense", "fp32", 1)] and cmp.rows[0].verdict == "slower"
    assert cmp.only_new == [("qwen3-30b-a3b", "int8_channel", "bf16", 1)]
    assert cmp.only_old == [("qwen3-30b-a3b", "dense", "bf16", 1)]


def test_compare_notes_what_changed_between_the_runs():
    old = _result([_row(kernel_isa="avx512_bf16", hidden=2048)], threads=2)
    new = _result([_row(kernel_isa="amx_bf16", hidden=4096)], threads=4, cpu_model="cpu")
    notes = " | ".join(R.compare_results(new, old).notes)
    assert "kernel ran at avx512_bf16 then, amx_bf16 now" in notes
    assert "hidden=2048->4096" in notes and "threads: 2 then, 4 now" in notes


def test_load_result_reads_both_versions_and_refuses_bad_files(tmp_path):
    unversioned = {"rows": [{"shape": "tiny", "tokens": 1, "moepack_ms": 1.5, "moepack_gbs": 2.0}], "machine": {}}
    p = tmp_path / "v0.json"
    p.write_text(json.dumps(unversioned))
    got = R.load_result(p)
    assert got["format_version"] == 0 and got["rows"][0]["scheme"] == "dense" and got["rows"][0]["dtype"] == "bf16"

    def refused(data, match):
        q = tmp_path / "bad.json"
        q.write_text(data if isinstance(data, str) else json.dumps(data))
        with pytest.raises(ValueError, match=match):
            R.load_result(q)

    refused("{not json", r"bad.json: is not JSON")
    refused([1, 2], r"is a JSON list, not an object")
    refused({"format": "safetensors", "rows": []}, r"format is 'safetensors', not 'moepack-bench'")
    refused(_result([], version=R.FORMAT_VERSION + 1), rf"format_version {R.FORMAT_VERSION + 1} is newer than this moepack reads")
    refused(_result([], version="1"), r"format_version is '1': must be an integer")
    refused({"format": R.FORMAT, "format_version": 1}, r"has no 'rows' list")
    refused(_result([{"shape": "tiny", "tokens": 1}]), r"rows\[0\]\.moepack_ms is None: must be a number")
    refused(_result([_row(ms=-1.0)]), r"rows\[0\]\.moepack_ms is -1\.0: must be a positive time")
    refused(_result([_row(tokens="8")]), r"rows\[0\]\.tokens is '8': must be a number")
    with pytest.raises(ValueError, match=r"bench result .*missing.json: cannot be read"):
        R.load_result(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=r"--compare-threshold -1: must be a percentage >= 0"):
        R.threshold_from_percent(-1)
    assert R.threshold_from_percent(5) == pytest.approx(0.05)


def _fake_probe(threads=1):
    """A measured MachineProbe with made-up numbers (the structure parse_probe_output builds)."""
    def read(gbs, role, **kw):
        return {"threads": threads, "load": "c", "streams": 1, "prefetch": 0, "split": 0, "pages": "4k", "shape": "buffer",
                "bytes": 1 << 20, "role": role, "passes": [gbs], "gbs": gbs, **kw}

    data = {"probe": 3, "threads": threads, "bytes": 1 << 20, "expert_bytes": 64 << 10,
            "read": [read(10.0, "plain"), read(12.5, "search", streams=4, prefetch=1024)],
            "peaks": [{"name": x.name, "threads": threads, "instr_per_s": 1e9, "passes": [1e9]} for x in P.INSTRUCTIONS],
            "errors": {}}
    return P.parse_probe_output(data, threads, 1 << 20)


def test_bench_divides_by_the_peak_of_the_kernels_instruction(monkeypatch, tmp_path):
    from moepack.bench import run as run_mod

    monkeypatch.setattr(run_mod, "probe_machine", lambda *a, **k: _fake_probe())
    for scheme, lay in (("bf16", "bf16_n32k2_x86"), ("int8", "i8_n32k4_x86")):
        cfg = B.BenchConfig(shapes=B.parse_shapes("tiny"), tokens=[1, 3], threads=1, scheme=scheme, calls=1, skip_torch=True)
        result = B.run_benchmark(cfg)
        isa = moepack.kernel_choice(lay).isa
        ins = P.kernel_instruction(moepack.layout_get(lay).weight_dtype, isa)
        for r in result.rows:
            assert r.kernel_isa == isa
            assert r.moepack_bw_frac == pytest.approx(r.moepack_gbs / 12.5)  # the best pattern, not the plain 10
            if ins is None:
                assert r.peak_instruction is None and r.moepack_peak_frac is None
            else:
                assert r.peak_instruction == ins.name and r.peak_value == pytest.approx(ins.ops)  # 1e9 instr/s
                assert r.moepack_peak_frac == pytest.approx(r.moepack_gflops / ins.ops)
        line = B.machine_line(result)
        assert "best read: 1 thread, c loads, 4 streams/thread, prefetch 1 KiB ahead, contiguous split, 4 KiB pages, whole buffer; plain 10.0 GB/s" in line
        # the result file round-trips, with its format, and compares with itself as unchanged
        path = tmp_path / f"{scheme}.json"
        B.write_json(result, path)
        data = B.load_result(path)
        assert data["format"] == "moepack-bench" and data["format_version"] == B.FORMAT_VERSION
        assert data["probe"]["read_pattern"] == "1 thread, c loads, 4 streams/thread, prefetch 1 KiB ahead, contiguous split, 4 KiB pages, whole buffer"
        assert B.MachineProbe.from_dict(data["probe"]) == result.probe
        cmp = B.compare_results(result, data, against=str(path))
        assert [r.verdict for r in cmp.rows] == ["same", "same"] and not cmp.only_new and not cmp.only_old
        result.comparison = cmp
        B.write_json(result, path)
        assert B.load_result(path)["compare"]["rows"][0]["ms_ratio"] == pytest.approx(1.0)
        assert "2 rows in both, 0 slower by more than 5%" in B.render_markdown(result)


def test_cli_bench_compare(tmp_path):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "moepack-bench", "format_version": 99, "rows": []}')
    r = CliRunner().invoke(app, ["bench", "--shapes", "tiny", "--compare", str(bad)])
    assert r.exit_code == 2 and f"--compare: bench result {bad}: format_version 99 is newer" in r.output
    r = CliRunner().invoke(app, ["bench", "--shapes", "tiny", "--compare-threshold", "-5"])
    assert r.exit_code == 2 and "--compare-threshold -5.0: must be a percentage" in r.output
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_result([_row(shape="tiny", tokens=1, ms=1e-6), _row(shape="tiny", tokens=2, ms=1e6)])))
    out = tmp_path / "new.json"
    args = ["bench", "--shapes", "tiny", "--tokens", "1,3", "--calls", "1", "--threads", "1", "--no-probe", "--skip-torch",
            "--quiet", "--markdown", "--json", str(out), "--compare", str(old)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "| tiny | 1 | bf16 |" in r.output and "SLOWER" in r.output  # a call cannot take 1 ns
    assert "1 row in both, 1 slower by more than 5% (tiny T=1 bf16)" in r.output
    assert "only in this run: tiny T=3 bf16" in r.output and f"only in {old}: tiny T=2 bf16" in r.output
    saved = B.load_result(out)
    assert saved["compare"]["against"] == str(old) and saved["compare"]["rows"][0]["verdict"] == "slower"


# ---------------------------------------------------------------------------------------------
# The machine-limit probe


ZEN3 = {"avx", "avx2", "fma", "f16c", "sse4_2"}
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}


@pytest.mark.parametrize(
    "flags, expected",
    [
        (ZEN3, {"fma_ymm", "vpmaddubsw_ymm"}),
        (ZEN4, {"fma_ymm", "vpmaddubsw_ymm", "fma_zmm", "vdpbf16ps", "vpdpbusd_zmm", "vpmaddubsw_zmm"}),
        (SAPPHIRE_RAPIDS, {x.name for x in P.INSTRUCTIONS}),
    ],
    ids=["zen3", "zen4", "sapphire-rapids"],
)
def test_probe_runs_only_what_the_cpu_has(flags, expected):
    ok, skipped = P.runnable_instructions(flags, "x86_64")
    assert {x.name for x in ok} == expected
    assert set(skipped) == {x.name for x in P.INSTRUCTIONS} - expected
    for name, why in skipped.items():
        missing = [f for f in P.INSTRUCTION_BY_NAME[name].needs if f not in flags]
        assert why == "the CPU lacks " + ", ".join(missing)
    ok, skipped = P.runnable_instructions(SAPPHIRE_RAPIDS, "aarch64")
    assert ok == [] and set(skipped.values()) == {"an instruction of x86-64; this CPU is aarch64"}


# The hand-kept (weight kind[:act mode], ISA level) -> instruction table moepack/bench/probe.py held
# until the instruction became a fact of each level (moepack/isa_levels.py float_instruction /
# int_instruction): a frozen record the derived mapping must reproduce.
KERNEL_INSTRUCTIONS_BEFORE_LEVEL_FACTS = {
    ("bf16", "avx2"): "fma_ymm", ("bf16", "avx512"): "fma_zmm",
    ("bf16", "avx512_bf16"): "vdpbf16ps", ("bf16", "amx_bf16"): "tdpbf16ps",
    ("i8", "avx2"): "vpmaddubsw_ymm", ("i8", "avx512"): "vpmaddubsw_zmm", ("i8", "avx_vnni"): "vpdpbusd_ymm",
    ("i8", "avx512_vnni"): "vpdpbusd_zmm", ("i8", "amx_int8"): "tdpbssd",
    ("f8e4m3", "avx2"): "fma_ymm", ("f8e4m3", "avx512"): "fma_zmm",
    ("f8e4m3", "avx512_bf16"): "vdpbf16ps", ("f8e4m3", "amx_bf16"): "tdpbf16ps",
    ("u4:a16", "avx2"): "fma_ymm", ("u4:a16", "avx512"): "fma_zmm",
    ("u4:a16", "avx512_bf16"): "vdpbf16ps", ("u4:a16", "amx_bf16"): "tdpbf16ps",
    ("u4:a8", "avx2"): "vpmaddubsw_ymm", ("u4:a8", "avx512"): "vpmaddubsw_zmm", ("u4:a8", "avx_vnni"): "vpdpbusd_ymm",
    ("u4:a8", "avx512_vnni"): "vpdpbusd_zmm", ("u4:a8", "amx_int8"): "tdpbssd",
    ("e2m1:a16", "avx2"): "fma_ymm", ("e2m1:a16", "avx512"): "fma_zmm",
    ("e2m1:a16", "avx512_bf16"): "vdpbf16ps", ("e2m1:a16", "amx_bf16"): "tdpbf16ps",
    ("e2m1:a8", "avx2"): "vpmaddubsw_ymm", ("e2m1:a8", "avx512"): "vpmaddubsw_zmm", ("e2m1:a8", "avx_vnni"): "vpdpbusd_ymm",
    ("e2m1:a8", "avx512_vnni"): "vpdpbusd_zmm", ("e2m1:a8", "amx_int8"): "tdpbssd",
}  # fmt: skip


def _served_pairs():
    """(layout, act mode, level) for every layout a level of its family serves in that mode."""
    from moepack import isa_levels as L
    from moepack.layout import LAYOUTS

    return [(lay, m, lv) for lay in LAYOUTS for m in lay.act_modes for lv in L.arch_levels(lay.family)
            if L.serves_kind(lv, lay.weight_dtype, m)]  # fmt: skip


def test_kernel_instruction_derived_from_the_levels_equals_the_old_table():
    """The instruction derived from the level facts is the old table's, entry for entry; the x86
    pairs served are exactly the old table's keys; the scalar level, the ARM levels (no ARM peak
    in INSTRUCTIONS) and unserved pairs have none."""
    got = {}
    for lay, m, lv in _served_pairs():
        ins = P.kernel_instruction(lay.weight_dtype, lv.name, m)
        if lay.family == "arm":
            assert ins is None, (lay.name, m, lv.name)
            continue
        key = (lay.weight_dtype if len(lay.act_modes) == 1 else f"{lay.weight_dtype}:{m}", lv.name)
        got[key] = ins.name
    assert got == KERNEL_INSTRUCTIONS_BEFORE_LEVEL_FACTS
    for (kind, isa), name in KERNEL_INSTRUCTIONS_BEFORE_LEVEL_FACTS.items():
        k, _, mode = kind.partition(":")
        assert P.kernel_instruction(k, isa, mode or None) is P.INSTRUCTION_BY_NAME[name]
    assert P.kernel_instruction("bf16", "scalar") is None and P.kernel_instruction("i8", "scalar") is None
    assert P.kernel_instruction("u4", "avx_vnni", "a16") is None  # avx_vnni serves u4 in A8 only
    assert P.kernel_instruction("bf16", "avx512_vnni") is None and P.kernel_instruction("i8", "amx_bf16") is None
    assert P.kernel_instruction("u4", "avx512", None) is P.kernel_instruction("u4", "avx512", "a16")  # a plain call
    assert P.kernel_instruction("bf16", "avx2", "a8") is P.INSTRUCTION_BY_NAME["fma_ymm"]  # bf16 has no A8


def test_level_instructions_are_probed_instructions_the_level_can_run():
    """Each level's float/int instruction is one the probe measures, needs nothing the level does
    not (its peak exists wherever the level runs), counts in the unit of its mode, and is named
    exactly where the level serves some kind in that mode."""
    from moepack import isa_levels as L

    served_modes = {(lv.name, m) for _, m, lv in _served_pairs()}
    for lv in L.LEVELS:
        for attr, mode, unit in (("float_instruction", "a16", "GFLOP/s"), ("int_instruction", "a8", "GOP/s")):
            name = getattr(lv, attr)
            if lv.arch != "x86":  # scalar and ARM: no peak to divide by
                assert name is None, (lv.name, attr)
                continue
            served = (lv.name, mode) in served_modes
            assert (name is not None) == served, (lv.name, attr)
            if name is not None:
                ins = P.INSTRUCTION_BY_NAME[name]
                assert set(ins.needs) <= set(L.features_of(lv, "cpu")), (lv.name, ins.needs)
                assert ins.unit == unit, (lv.name, attr)


def test_nvfp4_layouts_take_mxfp4s_instructions():
    """nvfp4 and mxfp4 layouts (both e2m1 codes) meet the rows in the same dot product at every
    level that serves them, in each mode."""
    from moepack.layout import LAYOUTS

    checked = 0
    for nv in (lay for lay in LAYOUTS if lay.scheme == "nvfp4"):
        mx = next(lay for lay in LAYOUTS if lay.scheme == "mxfp4" and lay.family == nv.family)
        for lay, m, lv in _served_pairs():
            if lay is nv:
                assert m in mx.act_modes
                want = P.kernel_instruction(mx.weight_dtype, lv.name, m)
                assert P.kernel_instruction(nv.weight_dtype, lv.name, m) is want, (nv.name, m, lv.name)
                checked += want is not None
    assert checked == 9  # x86: avx2, avx512 (A16 and A8), avx512_bf16, amx_bf16, avx_vnni, avx512_vnni, amx_int8


def test_machine_limits_are_cached_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake(threads, buffer_bytes):
        calls.append(threads)
        return _fake_probe(threads)

    monkeypatch.setattr(P, "probe_machine", fake)
    p1, m1 = P.machine_limits(1)
    p2, m2 = P.machine_limits(1)
    assert calls == [1] and not m1["cached"] and m2["cached"] and p2 == p1 and m2["measured_at"] == m1["measured_at"]
    P.machine_limits(2)  # another thread count: another entry
    P.machine_limits(1, refresh=True)
    assert calls == [1, 2, 1]
    monkeypatch.setattr(P, "probe_machine", lambda threads, buffer_bytes: P.MachineProbe(threads=threads, note="no C compiler"))
    P.machine_limits(3)
    p4, m4 = P.machine_limits(3)
    assert not m4["cached"] and p4.note == "no C compiler"  # a failure is not cached


def test_info_without_a_compiler_says_why_there_are_no_limits(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    r = CliRunner().invoke(app, ["info"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    # the row as printed, its wrapped continuation joined (the console's width is fixed when the
    # CLI module is first imported in the process: COLUMNS here may come too late)
    text = r.output[r.output.index("machine limits") :]
    assert "not measured: no C compiler (cc/gcc/clang) on PATH" in " ".join(text.split()), r.output
    r = CliRunner().invoke(app, ["info", "--json"])
    assert r.exit_code == 0, r.output
    limits = json.loads(r.output)["machine_limits"]
    assert limits["read_gbs"] is None and limits["peaks"] == {} and "no C compiler" in limits["note"]
