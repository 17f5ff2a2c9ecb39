"""The machine-limit probe's read-pattern search (tools/bw_probe.c, format 3) and its Python side
(moepack/bench/probe.py): parsing its output, the versioned limits cache, the probe built and run
quickly on a tiny buffer, the split per architecture (no architecture named in the shared files),
and the aarch64 build cross-compiled and run under qemu-user (output format only; qemu is never
timed). No test asserts a speed: the numbers depend on the machine and its load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from moepack.bench import probe as P

TOOLS = P.TOOLS_DIR
EXPERT = 4 << 20


def read(threads, gbs, role="search", load="c", streams=1, prefetch=0, split=0, pages="4k", shape="buffer", nbytes=64 << 20):
    """One read pattern as tools/bw_probe.c prints it."""
    return {"threads": threads, "load": load, "streams": streams, "prefetch": prefetch, "split": split, "pages": pages,
            "shape": shape, "bytes": nbytes, "role": role, "passes": [gbs * 0.9, gbs], "gbs": gbs}


def output(reads, threads=2, peaks=(), errors=None):
    return {"probe": 3, "arch": "test-arch", "threads": threads, "bytes": 64 << 20, "expert_bytes": EXPERT,
            "window_bytes": 8 * EXPERT, "llc_bytes": 32 << 20, "passes": 2, "quick": 0, "loads": ["c", "zmm"],
            "pages": {"4k": {"huge_bytes": 0}, "thp": {"huge_bytes": 60 << 20}}, "read": list(reads), "best": 0,
            "read_seconds": 1.5, "peaks": list(peaks), "errors": errors or {}}


READS = [
    read(2, 27.0, role="plain"),
    read(1, 14.0, role="plain"),
    read(2, 31.0, load="zmm", streams=4),
    read(2, 33.5, load="zmm", streams=4, prefetch=1024, split=1 << 20, pages="thp"),
    read(1, 36.0, load="zmm", streams=8, split=EXPERT, shape="experts", nbytes=8 * EXPERT),  # fewer threads win: still a limit
    read(2, 32.0, load="zmm", streams=4, split=EXPERT, shape="experts", nbytes=8 * EXPERT),
    read(2, 20.0, shape="window", nbytes=8 * EXPERT),
]


def test_parse_the_search():
    p = P.parse_probe_output(output(READS, peaks=[{"name": "fma_zmm", "threads": 2, "instr_per_s": 1.5e10, "passes": [1.5e10]}],
                                    errors={"tdpbssd": "the OS refused"}), 2, 64 << 20)
    assert p.measured and len(p.reads) == len(READS)
    assert p.read_gbs == 36.0 and p.best_read["threads"] == 1 and p.best_read["shape"] == "experts"
    assert p.read_pattern == ("1 thread, zmm loads, 8 streams/thread, no prefetch, expert-sized chunks round-robin, "
                              "4 KiB pages, 8 scattered experts")
    assert p.plain_read_gbs == 27.0 and p.plain_read_1t_gbs == 14.0
    assert p.decode_read_gbs == 36.0 and p.decode_pattern == p.read_pattern
    assert p.arch == "test-arch" and p.loads == ["c", "zmm"] and p.expert_bytes == EXPERT and p.llc_bytes == 32 << 20
    assert p.huge_pages == {"4k": 0, "thp": 60 << 20} and p.read_seconds == 1.5
    names = [r["name"] for r in p.reads]
    assert names[3] == ("2 threads, zmm loads, 4 streams/thread, prefetch 1 KiB ahead, 1 MiB chunks round-robin, "
                        "huge pages, whole buffer")
    assert names[6].endswith("contiguous split, 4 KiB pages, 8-expert window")
    assert p.peak("fma_zmm") == pytest.approx(1.5e10 * 32 / 1e9) and p.skipped["tdpbssd"] == "the OS refused"
    text = dict(P.describe_limits(p))
    assert text["read bandwidth"] == f"36.0 GB/s best ({p.read_pattern})"
    assert text["plain read"].startswith("27.0 GB/s at 2 threads, 14.0 GB/s at 1 thread (the probe's only read before format 3")
    assert text["decode-like read"].startswith("36.0 GB/s best over 8 scattered experts of 4 MiB")
    assert text["read search"] == ("7 patterns in 1.5 s over a 64 MiB buffer, last-level cache 32 MiB; loads c, zmm; "
                                   "huge pages backed 60 MiB of it")
    # a round trip through a result file's dict keeps everything
    import dataclasses

    assert P.MachineProbe.from_dict(json.loads(json.dumps(dataclasses.asdict(p)))) == p


def test_the_best_counts_patterns_at_up_to_the_threads_asked_for():
    p = P.parse_probe_output(output(READS, threads=1), 1, 64 << 20)
    assert p.plain_read_gbs == 14.0 and p.read_gbs == 36.0 and p.plain_read_1t_gbs == 14.0
    no_one = [r for r in READS if r["threads"] == 2]
    p = P.parse_probe_output(output(no_one), 2, 64 << 20)
    assert p.read_gbs == 33.5 and p.plain_read_1t_gbs is None and p.decode_read_gbs == 32.0


def test_output_it_does_not_understand_is_refused_by_name():
    data = output(READS)
    with pytest.raises(ValueError, match=r"'probe' is 2, expected 3 \(tools/bw_probe.c of this moepack\)"):
        P.parse_probe_output({**data, "probe": 2}, 2, 64 << 20)
    with pytest.raises(ValueError, match="no read pattern at 2 threads"):
        P.parse_probe_output({**data, "read": []}, 2, 64 << 20)
    with pytest.raises(ValueError, match="no plain read pattern at 4 threads"):
        P.parse_probe_output(data, 4, 64 << 20)
    with pytest.raises(ValueError, match="lacks shape"):
        P.parse_probe_output({**data, "read": [{k: v for k, v in READS[0].items() if k != "shape"}]}, 2, 64 << 20)
    with pytest.raises(ValueError, match="shape='ring'"):
        P.parse_probe_output({**data, "read": [{**READS[0], "shape": "ring"}]}, 2, 64 << 20)
    with pytest.raises(ValueError, match="peak of unknown instruction 'vfoo'"):
        P.parse_probe_output({**data, "peaks": [{"name": "vfoo", "instr_per_s": 1.0}]}, 2, 64 << 20)


def test_the_buffer_is_raised_above_the_cache():
    size, why = P.cold_buffer_bytes(512 << 20, llc=480 << 20)
    assert size == 23 * (64 << 20)  # 3 x 480 MiB = 1440 MiB, rounded up to 64 MiB
    assert why == "buffer raised from 512 MiB to 1.4 GiB: 3x the 480 MiB last-level cache"
    assert P.cold_buffer_bytes(2 << 30, llc=480 << 20) == (2 << 30, "")  # already cold: as asked
    assert P.cold_buffer_bytes(512 << 20, llc=0) == (512 << 20, "")  # cache unknown: as asked


def test_an_old_cached_record_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake(threads, buffer_bytes):
        calls.append(threads)
        return P.parse_probe_output(output(READS), threads, buffer_bytes)

    monkeypatch.setattr(P, "probe_machine", fake)
    path = P._probe_cache_dir() / f"limits-{P.limits_cache_key(2, 512 << 20)}.json"
    # a record of format 1 (best of 16 stream/prefetch patterns) under today's key: not read as today's
    path.write_text(json.dumps({"format": 1, "measured_at": "2026-01-01T00:00:00+00:00", "bg_cpus": 0.0,
                                "probe": {"threads": 2, "read_gbs": 99.0, "read_pattern": "4 streams/thread + prefetch"}}))
    p, meta = P.machine_limits(2)
    assert calls == [2] and not meta["cached"] and p.read_gbs == 36.0
    assert meta["remeasured"] == f"cached record has format 1, this moepack writes {P.LIMITS_FORMAT}"
    assert json.loads(path.read_text())["format"] == P.LIMITS_FORMAT == 2
    p2, meta2 = P.machine_limits(2)
    assert calls == [2] and meta2["cached"] and meta2["remeasured"] is None and p2 == p
    path.write_text("{not json")
    _, meta3 = P.machine_limits(2)
    assert calls == [2, 2] and meta3["remeasured"].startswith("cached record unreadable")


def test_info_shows_the_best_and_the_plain_read(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(P, "probe_machine", lambda threads, buffer_bytes: P.parse_probe_output(output(READS, threads=threads), threads, buffer_bytes))
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    r = CliRunner().invoke(app, ["info"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "read bandwidth 36.0 GB/s best (1 thread, zmm loads, 8 streams/thread" in out
    assert "plain read 27.0 GB/s at 2 threads, 14.0 GB/s at 1 thread" in out
    assert "decode-like read 36.0 GB/s best over 8 scattered experts of 4 MiB" in out


# ---------------------------------------------------------------------------------------------
# The split per architecture


def test_no_architecture_is_named_outside_its_own_file():
    for name in ("bw_probe.c", "bw_probe.h", "bw_probe_arm.c"):
        text = (TOOLS / name).read_text().lower()
        assert "x86" not in text and "immintrin" not in text and "_mm_" not in text, name
    for name in ("bw_probe.c", "bw_probe.h", "bw_probe_x86.c"):
        text = (TOOLS / name).read_text()
        assert "arm_neon" not in text and "vld1q" not in text, name
    assert "_mm_prefetch" in (TOOLS / "bw_probe_x86.c").read_text()
    assert "__builtin_prefetch" in (TOOLS / "bw_probe_arm.c").read_text()
    assert {a.source for a in P.PROBE_ARCHS} == {"bw_probe_x86.c", "bw_probe_arm.c"}
    assert P.probe_arch("x86_64").name == "x86-64" and P.probe_arch("aarch64").name == "aarch64" and P.probe_arch("riscv64") is None
    ok, skipped = P.runnable_instructions({"avx512f", "avx2", "fma"}, "aarch64")
    assert ok == [] and set(skipped.values()) == {"an instruction of x86-64; this CPU is aarch64"}


@pytest.mark.requires("cc")
def test_the_probe_runs_quickly_on_a_tiny_buffer(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    p = P.probe_machine(2, buffer_bytes=8 << 20, passes=1, peak_seconds=0.01, quick=True)
    assert p.measured, p.note
    assert p.buffer_bytes == 8 << 20 and p.expert_bytes == 512 << 10  # a 16th of the buffer
    assert p.read_gbs >= p.plain_read_gbs > 0 and p.plain_read_1t_gbs > 0
    assert p.read_gbs == max(r["gbs"] for r in p.reads) and p.decode_read_gbs is not None
    assert "quick" in p.note
    # the search tried every value of every axis at least once (from the best pattern so far)
    assert {r["load"] for r in p.reads} == set(p.loads) and "c" in p.loads
    assert {r["streams"] for r in p.reads} == {1, 2, 4, 8}
    assert {r["prefetch"] for r in p.reads} == {0, 1024}  # quick: one distance
    assert {r["split"] for r in p.reads} == {0, 64 << 10, 1 << 20, 512 << 10}
    assert {r["threads"] for r in p.reads} == {1, 2} and {r["shape"] for r in p.reads} == set(P.SHAPES)
    if isinstance(p.huge_pages.get("thp"), int):
        assert {r["pages"] for r in p.reads} == {"4k", "thp"}
    assert all(r["gbs"] > 0 and len(r["passes"]) == 1 for r in p.reads)
    assert [r["role"] for r in p.reads].count("plain") == 2
    have, _ = P.runnable_instructions(P.host_cpu_flags())
    assert set(p.peaks) <= {x.name for x in have} and set(p.peaks) | set(p.skipped) == {x.name for x in P.INSTRUCTIONS}


@pytest.mark.requires("cc")
def test_the_probe_binary_refuses_bad_arguments_and_keeps_to_its_budget(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build = P.build_probe([])
    assert build.binary is not None, build.note
    for args, msg in ((["2", str(1 << 20), "1", "0.01"], "BYTES >= THREADS * 1 MiB"),
                      (["1", str(8 << 20), "1", "0.01", "--fast"], "unknown option --fast"),
                      (["1", str(8 << 20), "1", "0.01", "fma_zmm"], "kernel fma_zmm was not compiled into this probe")):
        r = subprocess.run([str(build.binary), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)
    # out of time at once: the plain reads alone, and the count of patterns left out
    r = subprocess.run([str(build.binary), "2", str(8 << 20), "1", "0.01", "--budget=1e-9"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout.strip().splitlines()[-1])
    p = P.parse_probe_output(data, 2, 8 << 20)
    assert [x["role"] for x in p.reads] == ["plain", "plain"] and p.over_budget > 0
    assert p.huge_pages["thp"] == "not measured: the search's time budget ran out first"
    assert dict(P.describe_limits(p))["read search"].endswith("huge pages: not measured: the search's time budget ran out first")
    assert p.read_gbs == max(p.plain_read_gbs, p.plain_read_1t_gbs)


CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"


@pytest.mark.arm  # the cross compiler and qemu-user (make setup-test; conftest: a failure under CI=true without them)
def test_the_aarch64_probe_cross_built_and_run_under_qemu(monkeypatch, tmp_path):
    """The aarch64 driver + NEON read kernels, built with the cross compiler and run under
    qemu-user on a small buffer: the output's format only (an emulator's speed means nothing)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build = P.build_probe([], cc=CROSS_CC, machine="aarch64", static=True)
    assert build.binary is not None, build.note
    r = subprocess.run([QEMU, "-cpu", "max", str(build.binary), "2", str(8 << 20), "1", "0.01", "--quick"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout.strip().splitlines()[-1])
    assert data["arch"] == "aarch64" and data["loads"] == ["c", "neon"] and data["peaks"] == [] and data["errors"] == {}
    p = P.parse_probe_output(data, 2, 8 << 20)
    assert p.measured and {r["load"] for r in p.reads} == {"c", "neon"} and {r["shape"] for r in p.reads} == set(P.SHAPES)
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:  # the NEON kernel's loads and the prefetch are in the binary
        asm = subprocess.run([objdump, "-d", str(build.binary)], capture_output=True, text=True, timeout=120).stdout
        assert "prfm" in asm and ("ld1" in asm or "ldp\tq" in asm or "ldr\tq" in asm)
