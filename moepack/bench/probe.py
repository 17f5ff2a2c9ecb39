"""Where the numbers come from: machine facts (CPU, flags, kernels, versions) and the machine
limits the benchmark divides by, measured by tools/bw_probe.c (compiled on the fly, cached)."""

from __future__ import annotations

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


@dataclass
class MachineProbe:
    read_gbs: float | None = None  # best stream-read bandwidth over the probe buffer
    fma_gflops: float | None = None  # best fp32 FMA throughput
    threads: int = 0
    isa: str | None = None  # what the probe was compiled for ("avx2", "generic")
    buffer_bytes: int = 0
    read_gbs_passes: list[float] = field(default_factory=list)
    fma_gflops_passes: list[float] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""  # why it was not measured, or anything odd

    @property
    def measured(self) -> bool:
        return self.read_gbs is not None


PROBE_SOURCE = Path(__file__).resolve().parents[2] / "tools" / "bw_probe.c"


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


def build_probe(source: Path = PROBE_SOURCE) -> tuple[Path | None, str]:
    """Compile tools/bw_probe.c (cached by hash of source, flags and compiler). Returns (binary,
    note); binary is None, with the reason in note, when it cannot be built."""
    if not source.is_file():
        return None, f"probe source {source} not found (it ships with the source tree, not the wheel)"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None, "no C compiler (cc/gcc/clang) on PATH"
    try:
        from .._ops import cpu_flags

        flags_host = set(cpu_flags())
    except Exception:  # noqa: BLE001 - the probe must not fail the benchmark
        flags_host = set()
    simd = ["-mavx2", "-mfma"] if {"avx2", "fma"} <= flags_host and platform.machine().lower() in ("x86_64", "amd64") else []
    flags = ["-O2", *simd, "-fopenmp"]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"C compiler {cc} does not run: {e}"
    src = source.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *flags, version]).encode()).hexdigest()[:16]
    binary = _probe_cache_dir() / f"bw_probe-{key}"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary, ""
    tmp = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
    try:
        res = subprocess.run([cc, *flags, "-o", str(tmp), str(source)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"compiling the probe failed: {e}"
    if res.returncode != 0:
        first = (res.stderr.strip().splitlines() or ["?"])[0]
        return None, f"compiling the probe with {cc} {' '.join(flags)} failed: {first}"
    os.replace(tmp, binary)  # atomic: concurrent runs never see a half-written binary
    return binary, ""


def probe_machine(threads: int, buffer_bytes: int = 1 << 30, passes: int = 8, fma_iters: int = 100_000_000) -> MachineProbe:
    """Read bandwidth and fp32 FMA peak with ``threads`` threads, or a MachineProbe whose note
    says why they were not measured (no compiler, no source, ...)."""
    probe = MachineProbe(threads=threads, buffer_bytes=buffer_bytes)
    t0 = time.perf_counter()
    binary, note = build_probe()
    if binary is None:
        probe.note = note
        return probe
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND=os.environ.get("OMP_PROC_BIND", "close"))
    try:
        res = subprocess.run(
            [str(binary), str(threads), str(buffer_bytes), str(passes), str(fma_iters)],
            capture_output=True, text=True, timeout=300, env=env,
        )
    except (OSError, subprocess.SubprocessError) as e:
        probe.note = f"probe did not run: {e}"
        return probe
    if res.returncode != 0:
        probe.note = f"probe exited {res.returncode}: {res.stderr.strip()[:200]}"
        return probe
    try:
        data = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        probe.note = f"probe printed no JSON: {res.stdout[:200]!r}"
        return probe
    probe.read_gbs = float(data["read_gbs"])
    probe.fma_gflops = float(data["fma_gflops"])
    probe.isa = data.get("isa")
    probe.buffer_bytes = int(data.get("bytes", buffer_bytes))
    probe.read_gbs_passes = [float(x) for x in data.get("read_gbs_passes", [])]
    probe.fma_gflops_passes = [float(x) for x in data.get("fma_gflops_passes", [])]
    probe.seconds = round(time.perf_counter() - t0, 2)
    if probe.isa != "avx2":
        probe.note = "probe built without AVX2/FMA: FMA number is what plain C reaches, not the peak"
    return probe
