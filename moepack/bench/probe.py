"""Where the numbers come from: machine facts (CPU, flags, kernels, versions) and the machine
limits the benchmark divides by, measured by tools/bw_probe.c.

The probe is a small C program compiled on the fly (``build_probe``; never part of the
extension): one object for its main (read bandwidth, no ISA flags) and one object per
instruction of ``INSTRUCTIONS``, each with its own ``-m`` flags, built only when the CPU has the
instruction (/proc/cpuinfo flags) and the compiler accepts the flags; the binary is cached by
hash of source, compiler and parts. ``probe_machine`` runs it; ``machine_limits`` caches its
result on disk per machine (``moepack info``). ``KERNEL_INSTRUCTIONS`` says which instruction's
peak a layout's kernel is measured against at each ISA level.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _loadavg() -> list[float] | None:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(threads: int | None = None) -> dict:
    """What the closing note needs to say where numbers come from."""
    import moepack
    from ..isa import host_isa, max_isa

    isa, reason, _ = moepack.kernel_choice()
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "mem_total_bytes": _mem_total_bytes(),
        "cpu_flags": moepack.cpu_flags(),
        "host_isa": host_isa(),
        "max_isa": max_isa(),
        "kernel_isa": isa,
        "kernel_reason": reason,
        "moepack_version": moepack.__version__,
        "git_commit": _git_commit(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "threads": threads if threads is not None else torch.get_num_threads(),
    }



# ---------------------------------------------------------------------------------------------
# The instructions whose peaks the probe measures, and which one each kernel uses


@dataclass(frozen=True)
class Instruction:
    """One dot-product instruction the kernels use; ``name`` is its part of tools/bw_probe.c
    (``probe_peak_<name>``, compiled with ``-DPROBE_PART_<name>`` and ``flags``)."""

    name: str
    asm: str  # what one counted instruction is
    needs: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have
    flags: tuple[str, ...]  # compiler flags of its part
    ops: int  # operations per instruction: 2 per multiply-add (flops for float, ops for int)
    unit: str  # "GFLOP/s" (float) or "GOP/s" (int)


INSTRUCTIONS: tuple[Instruction, ...] = (
    # 8 fp32 lanes x 1 multiply-add = 16 flops
    Instruction("fma_ymm", "vfmadd231ps ymm (AVX2 FMA)", ("avx2", "fma"), ("-mavx2", "-mfma"), 16, "GFLOP/s"),
    Instruction("fma_zmm", "vfmadd231ps zmm (AVX-512F)", ("avx512f",), ("-mavx512f",), 32, "GFLOP/s"),
    # 16 fp32 lanes x 2 bf16 pairs
    Instruction("vdpbf16ps", "vdpbf16ps zmm (AVX512_BF16)", ("avx512f", "avx512_bf16"), ("-mavx512f", "-mavx512bf16"), 64, "GFLOP/s"),
    # 16 int32 lanes x 4 u8*s8 products
    Instruction("vpdpbusd_zmm", "vpdpbusd zmm (AVX512_VNNI)", ("avx512f", "avx512_vnni"), ("-mavx512f", "-mavx512vnni"), 128, "GOP/s"),
    Instruction("vpdpbusd_ymm", "{vex} vpdpbusd ymm (AVX-VNNI)", ("avx2", "avx_vnni"), ("-mavx2", "-mavxvnni"), 64, "GOP/s"),
    # one vpmaddubsw + vpmaddwd (by ones) + vpaddd: 32 (ymm) / 64 (zmm) u8*s8 multiply-adds
    Instruction("vpmaddubsw_ymm", "vpmaddubsw+vpmaddwd+vpaddd ymm (AVX2)", ("avx2",), ("-mavx2",), 64, "GOP/s"),
    Instruction("vpmaddubsw_zmm", "vpmaddubsw+vpmaddwd+vpaddd zmm (AVX-512BW)", ("avx512f", "avx512bw"), ("-mavx512f", "-mavx512bw"), 128, "GOP/s"),
    # a 16x16 fp32 tile += 16x32 bf16 . 32x16 bf16: 8192 multiply-adds
    Instruction("tdpbf16ps", "AMX tdpbf16ps (16x16x32 bf16)", ("amx_tile", "amx_bf16"), ("-mamx-tile", "-mamx-bf16"), 16384, "GFLOP/s"),
    # a 16x16 int32 tile += 16x64 s8 . 64x16 s8: 16384 multiply-adds
    Instruction("tdpbssd", "AMX tdpbssd (16x16x64 int8)", ("amx_tile", "amx_int8"), ("-mamx-tile", "-mamx-int8"), 32768, "GOP/s"),
)
INSTRUCTION_BY_NAME = {x.name: x for x in INSTRUCTIONS}

# (layout weight_dtype, ISA level its kernel runs at) -> the instruction its inner product uses
# (docs/KERNELS.md). scalar: none (no peak to divide by).
KERNEL_INSTRUCTIONS: dict[tuple[str, str], str] = {
    ("bf16", "avx2"): "fma_ymm",  # bf16 widened to fp32 in registers
    ("bf16", "avx512"): "fma_zmm",
    ("bf16", "avx512_bf16"): "vdpbf16ps",
    ("bf16", "amx_bf16"): "tdpbf16ps",
    ("i8", "avx2"): "vpmaddubsw_ymm",
    ("i8", "avx512"): "vpmaddubsw_zmm",
    ("i8", "avx_vnni"): "vpdpbusd_ymm",
    ("i8", "avx512_vnni"): "vpdpbusd_zmm",
    ("i8", "amx_int8"): "tdpbssd",
    # fp8 (f8 layouts, A16): the codes decoded to bf16 meet the rows in the bf16 kernels' dot product
    ("f8e4m3", "avx2"): "fma_ymm",
    ("f8e4m3", "avx512"): "fma_zmm",
    ("f8e4m3", "avx512_bf16"): "vdpbf16ps",
    ("f8e4m3", "amx_bf16"): "tdpbf16ps",
    # int4 (u4 layouts), per activation mode: A16 meets the weights in the bf16 kernels' dot
    # product, A8 in the int8 kernels'
    ("u4:a16", "avx2"): "fma_ymm",
    ("u4:a16", "avx512"): "fma_zmm",
    ("u4:a16", "avx512_bf16"): "vdpbf16ps",
    ("u4:a16", "amx_bf16"): "tdpbf16ps",
    ("u4:a8", "avx2"): "vpmaddubsw_ymm",
    ("u4:a8", "avx512"): "vpmaddubsw_zmm",
    ("u4:a8", "avx_vnni"): "vpdpbusd_ymm",
    ("u4:a8", "avx512_vnni"): "vpdpbusd_zmm",
    ("u4:a8", "amx_int8"): "tdpbssd",  # tdpbsud on chunks of 4+ rows (tdpbssd's rate); vpdpbusd below
    # mxfp4 (mx4 layout), per activation mode, on the levels that serve it (moepack/isa_levels.py):
    # the codes sit where u4's do and meet the rows in the same dot products as int4's of the same
    # mode (A16: decoded to bf16 / fp32, the float kernels' FMA; A8: 2 * e2m1(q) as int8)
    ("e2m1:a16", "avx2"): "fma_ymm",
    ("e2m1:a16", "avx512"): "fma_zmm",
    ("e2m1:a8", "avx2"): "vpmaddubsw_ymm",
    ("e2m1:a8", "avx512"): "vpmaddubsw_zmm",
}


def kernel_instruction(weight_dtype: str, isa: str, act_mode: str | None = None) -> Instruction | None:
    """The instruction a kernel for ``weight_dtype`` weights (called in ``act_mode``, for kinds
    whose layouts have two) uses at ISA level ``isa``; None for the scalar level (or a pair
    without a table entry)."""
    name = KERNEL_INSTRUCTIONS.get((f"{weight_dtype}:{act_mode}", isa)) or KERNEL_INSTRUCTIONS.get((weight_dtype, isa))
    return None if name is None else INSTRUCTION_BY_NAME[name]


def host_cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo), less what the OS does not
    enable as the extension's probe (xgetbv) reports it; the extension's list where there is no
    /proc/cpuinfo."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    try:
        from .._ops import cpu_flags

        ext = [f for f in cpu_flags() if "=" not in f]
    except Exception:  # noqa: BLE001 - no extension: /proc/cpuinfo alone
        return flags
    if not flags:
        flags = {f for f in ext if not f.startswith("os_")}
    if "os_avx512" not in ext:
        flags = {f for f in flags if not f.startswith("avx512")}
    if "os_amx" not in ext:
        flags = {f for f in flags if not f.startswith("amx")}
    return flags


def runnable_instructions(flags: set[str], machine: str | None = None) -> tuple[list[Instruction], dict[str, str]]:
    """(instructions this CPU has, {name: why not} for the others)."""
    machine = (machine or platform.machine()).lower()
    ok: list[Instruction] = []
    skipped: dict[str, str] = {}
    for ins in INSTRUCTIONS:
        if machine not in ("x86_64", "amd64"):
            skipped[ins.name] = f"not an x86-64 CPU ({machine})"
        elif missing := [f for f in ins.needs if f not in flags]:
            skipped[ins.name] = "the CPU lacks " + ", ".join(missing)
        else:
            ok.append(ins)
    return ok, skipped


# ---------------------------------------------------------------------------------------------
# The probe: build, run, parse


@dataclass
class MachineProbe:
    """The machine's limits at ``threads`` threads. A number is present only when it was
    measured; ``skipped`` says why each instruction without a number has none."""

    threads: int = 0
    buffer_bytes: int = 0
    read_gbs: float | None = None  # best read pattern at `threads` threads
    read_pattern: str | None = None  # which pattern gave read_gbs
    plain_read_gbs: float | None = None  # the plain read (1 stream, no prefetch) at `threads` threads
    reads: list[dict] = field(default_factory=list)  # every pattern: threads, streams, prefetch, gbs, passes
    prefetch_bytes: int = 0
    peaks: dict[str, dict] = field(default_factory=dict)  # instruction -> asm, unit, ops, threads, value, passes
    skipped: dict[str, str] = field(default_factory=dict)  # instruction -> why it has no number
    fma_gflops: float | None = None  # best fp32 FMA peak (zmm or ymm)
    seconds: float = 0.0
    note: str = ""  # why nothing was measured, or anything odd

    @property
    def measured(self) -> bool:
        return self.read_gbs is not None

    def peak(self, name: str | None) -> float | None:
        """The peak of instruction ``name`` in its unit (GFLOP/s or GOP/s), None if unmeasured."""
        p = self.peaks.get(name) if name else None
        return None if p is None else p["value"]

    @classmethod
    def from_dict(cls, d: dict) -> MachineProbe:
        """From to_dict/asdict output (a result file); unknown keys (other versions) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def pattern_name(streams: int, prefetch: bool) -> str:
    return ("plain" if streams == 1 else f"{streams} streams/thread") + (" + prefetch" if prefetch else "")


def parse_probe_output(data: dict, threads: int, buffer_bytes: int) -> MachineProbe:
    """The probe binary's JSON line -> MachineProbe (peaks converted from instructions/s with
    ``INSTRUCTIONS``' operation counts). Refuses output it does not understand, by name."""
    if not isinstance(data, dict) or data.get("probe") != 2:
        raise ValueError(f"probe output: 'probe' is {data.get('probe') if isinstance(data, dict) else data!r}, expected 2 (tools/bw_probe.c of this moepack)")
    probe = MachineProbe(threads=threads, buffer_bytes=int(data.get("bytes", buffer_bytes)),
                         prefetch_bytes=int(data.get("prefetch_bytes", 0)))
    for r in data.get("read", []):
        probe.reads.append({"threads": int(r["threads"]), "streams": int(r["streams"]), "prefetch": bool(r["prefetch"]),
                            "gbs": float(r["gbs"]), "passes": [float(x) for x in r.get("passes", [])]})
    at_n = [r for r in probe.reads if r["threads"] == threads]
    if not at_n:
        raise ValueError(f"probe output: no read pattern at {threads} threads")
    best = max(at_n, key=lambda r: r["gbs"])
    probe.read_gbs = best["gbs"]
    probe.read_pattern = pattern_name(best["streams"], best["prefetch"])
    plain = [r for r in at_n if r["streams"] == 1 and not r["prefetch"]]
    probe.plain_read_gbs = plain[0]["gbs"] if plain else None
    for p in data.get("peaks", []):
        ins = INSTRUCTION_BY_NAME.get(p.get("name"))
        if ins is None:
            raise ValueError(f"probe output: peak of unknown instruction {p.get('name')!r}")
        rate = float(p["instr_per_s"])
        if not rate > 0:
            raise ValueError(f"probe output: {ins.name} ran at {rate} instructions/s")
        probe.peaks[ins.name] = {
            "asm": ins.asm, "unit": ins.unit, "ops_per_instruction": ins.ops, "threads": int(p.get("threads", threads)),
            "value": round(rate * ins.ops / 1e9, 3),
            "passes": [round(float(x) * ins.ops / 1e9, 3) for x in p.get("passes", [])],
        }
    for name, why in (data.get("errors") or {}).items():
        probe.skipped[name] = str(why)
    fma = [probe.peak(n) for n in ("fma_zmm", "fma_ymm") if probe.peak(n) is not None]
    probe.fma_gflops = max(fma) if fma else None
    return probe


PROBE_SOURCE = Path(__file__).resolve().parents[2] / "tools" / "bw_probe.c"
_PROBE_CFLAGS = ("-O2",)
_PROBE_MAIN_FLAGS = ("-fopenmp",)


def _probe_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    d = Path(base) / "moepack" / "probe"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = Path(tempfile.gettempdir()) / f"moepack-probe-{os.getuid() if hasattr(os, 'getuid') else 0}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _first_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower()]
    return (errs or lines or ["?"])[0][:200]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class ProbeBuild:
    binary: Path | None  # None: not built (note says why)
    note: str = ""
    built: list[str] = field(default_factory=list)  # instruction parts compiled in
    failed: dict[str, str] = field(default_factory=dict)  # instruction -> why its part did not compile


def build_probe(instructions: list[Instruction] | None = None, source: Path = PROBE_SOURCE) -> ProbeBuild:
    """Compile tools/bw_probe.c with a part for each of ``instructions`` (default: those this CPU
    has) that the compiler accepts; cached by hash of source, compiler and parts."""
    if instructions is None:
        instructions = runnable_instructions(host_cpu_flags())[0]
    if not source.is_file():
        return ProbeBuild(None, f"probe source {source} not found (it ships with the source tree, not the wheel)")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return ProbeBuild(None, "no C compiler (cc/gcc/clang) on PATH: set CC or install one")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return ProbeBuild(None, f"C compiler {cc} does not run: {e}")
    parts = [(x.name, x.flags) for x in instructions]
    key = hashlib.sha256(source.read_bytes() + repr((cc, version, _PROBE_CFLAGS, _PROBE_MAIN_FLAGS, parts)).encode()).hexdigest()[:16]
    cache = _probe_cache_dir()
    binary, meta = cache / f"bw_probe-{key}", cache / f"bw_probe-{key}.json"
    if binary.is_file() and os.access(binary, os.X_OK) and meta.is_file():
        try:
            m = json.loads(meta.read_text())
            return ProbeBuild(binary, "", list(m["built"]), dict(m["failed"]))
        except (ValueError, KeyError, TypeError, OSError):
            pass  # rebuild
    with tempfile.TemporaryDirectory(prefix="moepack-probe-") as tmpd:
        procs = {}
        for ins in instructions:  # the parts, in parallel
            obj = os.path.join(tmpd, f"{ins.name}.o")
            cmd = [cc, *_PROBE_CFLAGS, *ins.flags, f"-DPROBE_PART_{ins.name}", "-c", str(source), "-o", obj]
            try:
                procs[ins.name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), obj, ins)
            except OSError as e:
                return ProbeBuild(None, f"compiling the probe failed: {e}")
        built, failed, objs = [], {}, []
        for name, (proc, obj, ins) in procs.items():
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                failed[name] = f"{cc} took over 120 s compiling it"
                continue
            if proc.returncode == 0:
                built.append(name)
                objs.append(obj)
            else:
                failed[name] = f"{cc} {' '.join(ins.flags)} does not compile it: {_first_error(err)}"
        main_obj = os.path.join(tmpd, "main.o")
        kernels = "".join(f"X({n})" for n in built)
        tmp_bin = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
        for cmd in (
            [cc, *_PROBE_CFLAGS, *_PROBE_MAIN_FLAGS, f"-DPROBE_KERNELS={kernels}", "-c", str(source), "-o", main_obj],
            [cc, *_PROBE_MAIN_FLAGS, main_obj, *objs, "-o", str(tmp_bin)],
        ):
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                return ProbeBuild(None, f"compiling the probe failed: {e}")
            if res.returncode != 0:
                return ProbeBuild(None, f"compiling the probe with {cc} {' '.join(_PROBE_MAIN_FLAGS)} failed: {_first_error(res.stderr)}")
    os.replace(tmp_bin, binary)  # atomic: concurrent runs never see a half-written binary
    _write_atomic(meta, json.dumps({"built": built, "failed": failed}))
    return ProbeBuild(binary, "", built, failed)


def probe_machine(threads: int, buffer_bytes: int = 512 << 20, passes: int = 3, peak_seconds: float = 0.2,
                  prefetch_bytes: int = 1024) -> MachineProbe:
    """Read bandwidth (every pattern, at 1 and ``threads`` threads) and the peak of every
    dot-product instruction this CPU has, at ``threads`` threads; or a MachineProbe whose note
    says why nothing was measured (no compiler, no source, ...)."""
    if threads < 1:
        raise ValueError(f"probe threads={threads}: must be >= 1")
    if buffer_bytes < threads * (1 << 20):
        raise ValueError(f"probe buffer of {buffer_bytes} bytes: must be at least 1 MiB per thread ({threads} threads)")
    if passes < 1 or not peak_seconds > 0 or prefetch_bytes <= 0:
        raise ValueError(f"probe passes={passes}, peak_seconds={peak_seconds}, prefetch_bytes={prefetch_bytes}: must be >= 1, > 0, > 0")
    t0 = time.perf_counter()
    have, skipped = runnable_instructions(host_cpu_flags())
    build = build_probe(have)
    skipped.update(build.failed)
    if build.binary is None:
        return MachineProbe(threads=threads, buffer_bytes=buffer_bytes, skipped=skipped, note=build.note)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND=os.environ.get("OMP_PROC_BIND", "close"))
    cmd = [str(build.binary), str(threads), str(buffer_bytes), str(passes), str(peak_seconds), str(prefetch_bytes), *build.built]
    probe = MachineProbe(threads=threads, buffer_bytes=buffer_bytes, skipped=skipped)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.SubprocessError) as e:
        probe.note = f"probe did not run: {e}"
        return probe
    if res.returncode != 0:
        probe.note = f"probe exited {res.returncode}: {res.stderr.strip()[:200]}"
        return probe
    try:
        data = json.loads(res.stdout.strip().splitlines()[-1])
        parsed = parse_probe_output(data, threads, buffer_bytes)
    except (ValueError, IndexError, KeyError, TypeError) as e:
        probe.note = f"probe output not understood ({e}): {res.stdout[:200]!r}"
        return probe
    parsed.skipped = {**skipped, **parsed.skipped}
    parsed.seconds = round(time.perf_counter() - t0, 2)
    return parsed


# ---------------------------------------------------------------------------------------------
# Machine limits cached on disk (moepack info)

LIMITS_FORMAT = 1  # bump when the cached record changes meaning


def limits_cache_key(threads: int, buffer_bytes: int) -> str:
    """Machine (CPU model, flags, CPU count) + probe (source, instruction table) + sizes."""
    src = PROBE_SOURCE.read_bytes() if PROBE_SOURCE.is_file() else b""
    facts = (LIMITS_FORMAT, cpu_model(), sorted(host_cpu_flags()), os.cpu_count(), threads, buffer_bytes, INSTRUCTIONS)
    return hashlib.sha256(src + repr(facts).encode()).hexdigest()[:16]


def machine_limits(threads: int, refresh: bool = False, buffer_bytes: int = 512 << 20) -> tuple[MachineProbe, dict]:
    """The machine's limits at ``threads`` threads: from the on-disk cache, or measured now (and
    cached) when there is none or ``refresh``. Returns (probe, {"cached": bool, "measured_at":
    iso time, "bg_cpus": CPUs other processes used while it was measured, "cache_file": path})."""
    from .timing import _CpuMeter

    path = _probe_cache_dir() / f"limits-{limits_cache_key(threads, buffer_bytes)}.json"
    if not refresh and path.is_file():
        try:
            rec = json.loads(path.read_text())
            if rec.get("format") == LIMITS_FORMAT:
                meta = {"cached": True, "measured_at": rec.get("measured_at"), "bg_cpus": rec.get("bg_cpus"), "cache_file": str(path)}
                return MachineProbe.from_dict(rec["probe"]), meta
        except (ValueError, KeyError, TypeError, OSError):
            pass  # measure again
    meter = _CpuMeter()
    meter.start()
    probe = probe_machine(threads, buffer_bytes)
    bg = meter.stop()
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = {"cached": False, "measured_at": when, "bg_cpus": bg, "cache_file": None}
    if probe.measured:
        rec = {"format": LIMITS_FORMAT, "measured_at": when, "bg_cpus": bg, "probe": dataclasses.asdict(probe)}
        try:
            _write_atomic(path, json.dumps(rec, indent=1))
            meta["cache_file"] = str(path)
        except OSError:
            pass
    return probe, meta


def describe_limits(probe: MachineProbe) -> list[tuple[str, str]]:
    """(label, text) lines for ``moepack info`` and the bench's notes."""
    if not probe.measured:
        return [("machine limits", f"not measured: {probe.note}")]
    lines = []
    one = [r for r in probe.reads if r["threads"] == 1]
    threads = f"{probe.threads} thread" + ("s" if probe.threads != 1 else "")
    text = f"{probe.read_gbs:.1f} GB/s best ({probe.read_pattern}), plain {probe.plain_read_gbs:.1f} GB/s, {threads}"
    if one and probe.threads != 1:
        b1 = max(one, key=lambda r: r["gbs"])
        p1 = next((r["gbs"] for r in one if r["streams"] == 1 and not r["prefetch"]), None)
        text += f"; 1 thread: {b1['gbs']:.1f} best ({pattern_name(b1['streams'], b1['prefetch'])})" + (f", plain {p1:.1f}" if p1 else "")
    lines.append(("read bandwidth", text))
    for ins in INSTRUCTIONS:
        p = probe.peaks.get(ins.name)
        if p is not None:
            lines.append((f"peak {ins.name}", f"{p['value']:.0f} {p['unit']}, {p['threads']} thread{'s' if p['threads'] != 1 else ''}: {ins.asm}"))
        elif ins.name in probe.skipped:
            lines.append((f"peak {ins.name}", f"- ({probe.skipped[ins.name]})"))
    return lines
