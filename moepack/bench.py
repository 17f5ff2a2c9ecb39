"""Benchmark: moepack's fused experts against the plain torch per-expert loop, on real MoE shapes.

    python -m moepack.bench --shapes qwen3-30b-a3b --tokens 1,8,64,512 --threads 2 --json out.json
    moepack bench ...                       # the same command through the CLI

For each shape, random bf16 weights are made once and packed; then, for each token count T, both
implementations run in the same process, on the same activations and the same routings:

* routings are pre-generated (random logits -> softmax -> top-k, renormalized; ids int32,
  weights fp32), a new one for every call, so each call touches other experts than the one
  before (for T=1 the experts of consecutive calls are disjoint whenever E >= 2k): the weights
  come from memory, as in decoding, not from a cache warmed by the previous call;
* each implementation is warmed up once, then timed over N calls with ``time.perf_counter``
  (N adaptive: enough calls for ``min_time`` seconds, at least 3), each call timed on its own.

Per row: ms per call (mean over the timed calls), effective weight bandwidth (bytes of the
experts the call touched -- unique ids x bytes per expert, summed over calls -- / total time),
GFLOP/s (``2*T*k*3*H*I`` per call / time) and torch_ms / moepack_ms. The same run measures the
machine with tools/bw_probe.c (compiled on the fly, see ``probe_machine``): stream-read
bandwidth and fp32 FMA peak with the same thread count, and moepack's fraction of each.

``--scheme int8_channel`` (alias ``int8``) packs the same weights as W8A8 int8 experts (``quantize_int8_per_channel``,
layout ``i8_n32k4_x86``): GB/s then counts the int8 packed bytes (codes + fp32 scales + int32
column sums) and GFLOP/s reads as GOP/s (the same ``2*T*k*3*H*I`` operations, done as int8
multiply-adds). The "% FMA peak" column stays relative to the machine's fp32 FMA peak, which is
not the int8 peak (see the note the run prints).

The run also records how much CPU other processes took while each measurement ran
(``*_bg_cpus``, from /proc/stat): on a shared machine a number taken while another process
used a whole CPU is not a measurement of the code. ``--wait-quiet S`` waits (up to S seconds)
for the other processes to go idle before each measurement, and ``--retries N`` re-times a
measurement that was disturbed anyway, keeping the least disturbed attempt.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .layout import layout_flops

# ---------------------------------------------------------------------------------------------
# Shapes and options


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer: E experts, top-k routing, hidden size H, intermediate size I."""

    name: str
    num_experts: int  # E
    topk: int  # k
    hidden: int  # H
    intermediate: int  # I

    @property
    def canonical_bytes_per_expert(self) -> int:
        """bf16 bytes of one expert's w13 [2I, H] + w2 [H, I]."""
        return 3 * self.hidden * self.intermediate * 2

    def describe(self) -> str:
        return f"E={self.num_experts} k={self.topk} H={self.hidden} I={self.intermediate}"


SHAPES: dict[str, MoeShape] = {
    s.name: s
    for s in (
        MoeShape("qwen3-30b-a3b", 128, 8, 2048, 768),
        MoeShape("gpt-oss-20b", 32, 4, 2880, 2880),
        MoeShape("mixtral-8x7b", 8, 2, 4096, 14336),
        MoeShape("tiny", 8, 2, 256, 352),  # seconds, for demos and tests
    )
}
DEFAULT_SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b")
DEFAULT_TOKENS = (1, 8, 64, 512)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_CUSTOM_SHAPE = re.compile(r"^e(\d+)k(\d+)h(\d+)i(\d+)$", re.IGNORECASE)


def parse_shapes(spec: str | list[str] | tuple[str, ...]) -> list[MoeShape]:
    """'qwen3-30b-a3b,tiny' (or a list) -> shapes; 'all' = every named shape; a custom shape is
    written E<e>K<k>H<h>I<i>, e.g. 'e16k4h1024i512'."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise ValueError("--shapes is empty: name at least one of " + ", ".join(SHAPES))
    out: list[MoeShape] = []
    for name in names:
        if name == "all":
            out += [SHAPES[n] for n in SHAPES if SHAPES[n] not in out]
            continue
        if name in SHAPES:
            shape = SHAPES[name]
        elif m := _CUSTOM_SHAPE.match(name):
            e, k, h, i = (int(g) for g in m.groups())
            if min(e, k, h, i) <= 0 or k > e:
                raise ValueError(f"shape {name!r}: sizes must be positive and k <= E")
            shape = MoeShape(name.lower(), e, k, h, i)
        else:
            raise ValueError(
                f"shape {name!r} is unknown: use one of {', '.join(SHAPES)}, 'all', or E<e>K<k>H<h>I<i> (e.g. e16k4h1024i512)"
            )
        if shape not in out:
            out.append(shape)
    return out


def parse_tokens(spec: str | list[int] | tuple[int, ...]) -> list[int]:
    """'1,8,64' (or a list) -> positive token counts, in the given order, duplicates dropped."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[int] = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            t = int(text)
        except ValueError:
            raise ValueError(f"--tokens: {text!r} is not an integer (write e.g. 1,8,64,512)") from None
        if t <= 0:
            raise ValueError(f"--tokens: {t} is not a positive token count")
        if t not in out:
            out.append(t)
    if not out:
        raise ValueError("--tokens is empty: give at least one token count, e.g. 1,8,64,512")
    return out


# --scheme: a weight scheme of moepack.schemes by name or alias (dense = "bf16", int8_channel =
# "int8"); the experts are packed into its x86 layout.


@dataclass
class BenchConfig:
    shapes: list[MoeShape] = field(default_factory=lambda: [SHAPES[n] for n in DEFAULT_SHAPES])
    tokens: list[int] = field(default_factory=lambda: list(DEFAULT_TOKENS))
    threads: int = 2
    dtype: str = "bf16"  # activations; weights are bf16 (scheme dense) or int8 (scheme int8_channel)
    scheme: str = "dense"  # packed weights: a scheme name or alias ("bf16", "int8"); validate() normalizes it
    skip_torch: bool = False
    min_time: float = 1.0  # seconds of timed calls per measurement (adaptive call count)
    calls: int | None = None  # fixed call count instead (still >= 1)
    min_calls: int = 3
    max_calls: int = 1000
    probe: bool = True
    probe_bytes: int = 1 << 30
    seed: int = 0
    wait_quiet: float = 0.0  # before each measurement, wait up to this many s for other processes to go idle
    retries: int = 0  # re-time a measurement (up to this many times) when other processes were busy

    def validate(self) -> None:
        if not self.shapes:
            raise ValueError("no shapes to benchmark")
        if not self.tokens or any(t <= 0 for t in self.tokens):
            raise ValueError(f"token counts {self.tokens} must be positive")
        if self.threads < 1:
            raise ValueError(f"--threads {self.threads}: must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: must be one of {', '.join(DTYPES)}")
        from .errors import UnsupportedError
        from .schemes import get_scheme

        try:
            self.scheme = get_scheme(self.scheme).name
        except UnsupportedError as e:
            raise ValueError(f"--scheme: {e}") from None
        if not (self.min_time > 0 and math.isfinite(self.min_time)):
            raise ValueError(f"--min-time {self.min_time}: must be a positive number of seconds")
        if self.calls is not None and self.calls < 1:
            raise ValueError(f"--calls {self.calls}: must be >= 1")
        if self.retries < 0:
            raise ValueError(f"--retries {self.retries}: must be >= 0")
        if self.wait_quiet < 0:
            raise ValueError(f"--wait-quiet {self.wait_quiet}: must be >= 0 seconds")
        if self.probe_bytes < (64 << 20):
            raise ValueError(f"probe buffer of {self.probe_bytes} bytes is too small to measure memory (>= 64 MiB)")


# ---------------------------------------------------------------------------------------------
# Machine info and probes


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
    root = Path(__file__).resolve().parent.parent
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
    from .isa import host_isa, max_isa

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


class _CpuMeter:
    """CPU used by *other* processes between start() and stop(), in CPUs (from /proc/stat minus
    this process's own user+system time). None where /proc/stat is unavailable."""

    def __init__(self) -> None:
        self._t0 = None

    @staticmethod
    def _busy_s() -> float | None:
        try:
            with open("/proc/stat") as f:
                parts = f.readline().split()
        except OSError:
            return None
        if not parts or parts[0] != "cpu":
            return None
        vals = [int(x) for x in parts[1:]]
        total = sum(vals[:8])  # user nice system idle iowait irq softirq steal
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return (total - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        t = os.times()  # this process's threads, and its waited-for children (the probe)
        return t.user + t.system + t.children_user + t.children_system

    def start(self) -> None:
        self._t0 = (self._busy_s(), self._own_s(), time.perf_counter())

    def stop(self) -> float | None:
        busy1 = self._busy_s()
        own1 = self._own_s()
        busy0, own0, wall0 = self._t0
        wall = time.perf_counter() - wall0
        if busy0 is None or busy1 is None or wall <= 0:
            return None
        other = (busy1 - busy0) - (own1 - own0)
        return round(max(0.0, other / wall), 2)


def wait_quiet(max_s: float, threshold: float = 0.15, window_s: float = 0.5) -> float:
    """Wait (up to ``max_s`` seconds) until other processes use less than ``threshold`` CPUs
    over a ``window_s`` window; returns the seconds waited. For shared machines."""
    t0 = time.perf_counter()
    meter = _CpuMeter()
    while time.perf_counter() - t0 < max_s:
        meter.start()
        time.sleep(window_s)
        bg = meter.stop()
        if bg is None or bg < threshold:
            break
    return round(time.perf_counter() - t0, 1)


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


PROBE_SOURCE = Path(__file__).resolve().parent.parent / "tools" / "bw_probe.c"


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
        from ._ops import cpu_flags

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


# ---------------------------------------------------------------------------------------------
# Routings and timing


class RoutingStream:
    """Distinct routings, one per call: random logits -> softmax -> top-k (renormalized).

    For T=1 the experts of each routing are disjoint from the previous routing's whenever
    E >= 2k, so consecutive single-token calls never reuse an expert's weights from cache.
    """

    def __init__(self, tokens: int, num_experts: int, topk: int, seed: int) -> None:
        self.tokens, self.num_experts, self.topk = tokens, num_experts, topk
        self.gen = torch.Generator().manual_seed(seed)
        self._prev: torch.Tensor | None = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(topk_weights fp32 [T, k], topk_ids int32 [T, k], unique experts)."""
        logits = torch.randn(self.tokens, self.num_experts, generator=self.gen)
        if self.tokens == 1 and self._prev is not None and self.num_experts >= 2 * self.topk:
            logits[:, self._prev] = float("-inf")
        w, ids = torch.softmax(logits, dim=-1).topk(self.topk, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).float().contiguous()
        ids = ids.to(torch.int32).contiguous()
        uniq = ids.unique()
        self._prev = uniq.long()
        return w, ids, int(uniq.numel())

    def take(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        return [self.next() for _ in range(n)]


@dataclass
class Timing:
    calls: int
    total_s: float
    times_s: list[float]
    bytes_touched: int  # sum over the timed calls
    warmup_s: float
    raw_times_s: list[float] | None = None  # read_experts of the same experts after each call (and an untimed cache eviction)

    @property
    def mean_ms(self) -> float:
        return self.total_s / self.calls * 1e3

    @property
    def median_ms(self) -> float:
        s = sorted(self.times_s)
        n = len(s)
        return (s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])) * 1e3

    @property
    def min_ms(self) -> float:
        return min(self.times_s) * 1e3

    @property
    def gbs(self) -> float:
        return self.bytes_touched / self.total_s / 1e9

    @property
    def raw_total_s(self) -> float | None:
        return sum(self.raw_times_s) if self.raw_times_s else None


def _time_calls(fn: Callable[[torch.Tensor, torch.Tensor], object], routings, bytes_per_expert: int, warmup_s: float,
                raw: Callable[[torch.Tensor], object] | None = None, evict: Callable[[], object] | None = None) -> Timing:
    """Times fn on each routing; with ``raw``, also times raw(unique expert ids) after each call
    (a plain read of the same weight bytes: the baseline for '% raw read'), after ``evict()`` (a read
    of an unrelated buffer larger than the last-level cache, untimed) so that the plain read does
    not find what the call left in the cache."""
    times = []
    raw_times = [] if raw is not None else None
    touched = 0
    for w, ids, uniq in routings:
        t0 = time.perf_counter()
        fn(w, ids)
        times.append(time.perf_counter() - t0)
        touched += uniq * bytes_per_expert
        if raw is not None:
            experts = ids.unique()
            if evict is not None:
                evict()
            t0 = time.perf_counter()
            raw(experts)
            raw_times.append(time.perf_counter() - t0)
    return Timing(len(times), sum(times), times, touched, warmup_s, raw_times)


def _eviction_bytes() -> int:
    """Twice the largest CPU cache sysfs reports (at least 16 MiB, at most 512 MiB; 64 MiB when unknown)."""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            largest = max(largest, int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return min(max(2 * largest, 16 * 2**20), 512 * 2**20) if largest else 64 * 2**20


BUSY_CPUS = 0.25  # other processes above this many CPUs during a measurement: flagged (and retried)


def _measure(cfg: BenchConfig, run: Callable[[], object]) -> tuple[object, float | None, float | None, int]:
    """run() under the contention policy: wait for quiet (--wait-quiet), time, and redo up to
    --retries times while other processes used more than BUSY_CPUS; keeps the least disturbed
    attempt. Returns (result, bg_cpus, seconds waited, attempts)."""
    best = None
    waited_total = 0.0
    for attempt in range(1 + cfg.retries):
        if cfg.wait_quiet:
            waited_total += wait_quiet(cfg.wait_quiet)
        meter = _CpuMeter()
        meter.start()
        res = run()
        bg = meter.stop()
        if best is None or (bg is not None and best[1] is not None and bg < best[1]):
            best = (res, bg)
        if bg is None or bg <= BUSY_CPUS:
            break
    return best[0], best[1], (round(waited_total, 1) if cfg.wait_quiet else None), attempt + 1


def _call_count(cfg: BenchConfig, est_s: float) -> int:
    if cfg.calls is not None:
        return cfg.calls
    return max(cfg.min_calls, min(cfg.max_calls, math.ceil(cfg.min_time / max(est_s, 1e-6))))


# ---------------------------------------------------------------------------------------------
# The benchmark


@dataclass
class Row:
    shape: str
    num_experts: int
    topk: int
    hidden: int
    intermediate: int
    tokens: int
    dtype: str
    threads: int
    flops_per_call: int
    packed_bytes_per_expert: int
    unique_experts_mean: float
    moepack_calls: int
    moepack_ms: float  # mean
    moepack_ms_median: float
    moepack_ms_min: float
    moepack_gbs: float  # bytes of touched (packed) experts / time
    moepack_gflops: float
    moepack_bw_frac: float | None  # moepack_gbs / machine read bandwidth
    moepack_peak_frac: float | None  # moepack_gflops / machine fp32 FMA peak
    scheme: str = "dense"  # dense: GFLOP/s; int8_channel: the same count is int8 GOP/s
    moepack_bg_cpus: float | None = None  # CPUs other processes used while moepack was timed
    moepack_waited_s: float | None = None  # seconds waited for other processes to go idle (--wait-quiet)
    moepack_attempts: int = 1  # timings made (--retries)
    raw_read_ms: float | None = None  # mean time of a plain read of the same experts' packed bytes (interleaved)
    raw_read_gbs: float | None = None
    moepack_raw_frac: float | None = None  # raw_read time / moepack time: moepack's rate as a fraction of the plain read's
    torch_calls: int | None = None
    torch_ms: float | None = None
    torch_ms_median: float | None = None
    torch_ms_min: float | None = None
    torch_gbs: float | None = None  # bytes of touched (canonical) experts / time
    torch_gflops: float | None = None
    torch_weight_dtype: str | None = None
    speedup: float | None = None  # torch_ms / moepack_ms
    check_rel_diff: float | None = None  # max|moepack - torch| / max|torch| on the warm-up call
    torch_bg_cpus: float | None = None
    torch_waited_s: float | None = None
    torch_attempts: int | None = None


@dataclass
class BenchResult:
    config: dict
    machine: dict
    probe: MachineProbe
    rows: list[Row]
    started: str
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "config": self.config,
            "machine": self.machine,
            "probe": dataclasses.asdict(self.probe),
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "started": self.started,
            "seconds": self.seconds,
            "notes": self.notes,
        }


def make_weights(shape: MoeShape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random canonical bf16 experts: w13 [E, 2I, H], w2 [E, H, I] (scaled like trained weights)."""
    g = torch.Generator().manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    w13 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16)
    w2 = torch.empty(e, h, i, dtype=torch.bfloat16)
    for x in range(e):  # expert by expert: no fp32 temporary of the whole tensor
        w13[x] = torch.randn(2 * i, h, generator=g).mul_(h**-0.5)
        w2[x] = torch.randn(h, i, generator=g).mul_(i**-0.5)
    return w13, w2


def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> BenchResult:
    """Run every (shape, T) of ``cfg``; ``log`` gets one line per step (progress)."""
    import moepack
    from ._ops import ops
    from .reference import torch_loop_moe

    cfg.validate()
    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    torch.set_num_threads(cfg.threads)
    machine = machine_info(cfg.threads)
    machine["torch_num_threads"] = torch.get_num_threads()
    machine["loadavg_start"] = _loadavg()
    notes: list[str] = []
    if cfg.threads > (os.cpu_count() or cfg.threads):
        notes.append(f"--threads {cfg.threads} is more than the {os.cpu_count()} logical CPUs")

    if cfg.probe:
        log(f"probing the machine: read bandwidth over {cfg.probe_bytes / 2**30:.2f} GiB and fp32 FMA peak, {cfg.threads} threads")
        probe, bg, waited, attempts = _measure(cfg, lambda: probe_machine(cfg.threads, cfg.probe_bytes))
        machine["probe_waited_s"], machine["probe_attempts"] = waited, attempts
        if probe.measured:
            log(f"  read {probe.read_gbs:.1f} GB/s, FMA {probe.fma_gflops:.1f} GFLOP/s ({probe.isa}, {probe.seconds:.1f} s)")
        else:
            log(f"  not measured: {probe.note}")
        machine["probe_bg_cpus"] = bg
        if bg is not None and bg > BUSY_CPUS:
            notes.append(f"other processes used {bg:.2f} CPUs during the machine probe: its numbers are low")
    else:
        probe = MachineProbe(threads=cfg.threads, note="disabled (--no-probe)")

    act_dtype = DTYPES[cfg.dtype]
    # read before each plain read of the experts (untimed): evicts what the call left in the cache
    evict_buf = torch.ones(1, _eviction_bytes(), dtype=torch.uint8)
    evict_id = torch.zeros(1, dtype=torch.int32)
    rows: list[Row] = []
    for si, shape in enumerate(cfg.shapes):
        log(f"{shape.name} ({shape.describe()}): making and packing random bf16 weights" + (f" as {cfg.scheme}" if cfg.scheme != "dense" else ""))
        w13, w2 = make_weights(shape, cfg.seed + 1000 * si)
        from .schemes import get_scheme

        packed = moepack.pack_experts(w13, w2, layout=get_scheme(cfg.scheme).layout_for("x86"))
        packed_bpe = packed.nbytes // shape.num_experts
        raw_bpe = (packed.w13.nbytes + packed.w2.nbytes) / shape.num_experts  # what read_experts reads (no scales)
        if cfg.skip_torch:
            del w13, w2
            base13 = base2 = None
        elif act_dtype != torch.bfloat16:
            # the torch loop multiplies in the activation dtype: give it weights of that dtype
            base13, base2 = w13.to(act_dtype), w2.to(act_dtype)
            del w13, w2
        else:
            base13, base2 = w13, w2
        gc.collect()
        canon_bpe = None if base13 is None else (base13[0].nbytes + base2[0].nbytes)
        for ti, tokens in enumerate(cfg.tokens):
            gx = torch.Generator().manual_seed(cfg.seed + 7919 * (si * 101 + ti))
            x = torch.randn(tokens, shape.hidden, generator=gx).to(act_dtype)
            stream = RoutingStream(tokens, shape.num_experts, shape.topk, seed=cfg.seed + 31 * (si * 101 + ti) + 1)
            warm_w, warm_ids, _ = stream.next()  # the warm-up call (also the correctness check)

            def mp(w, ids):
                return moepack.run_experts(packed, x, w, ids)

            def tl(w, ids):
                return torch_loop_moe(x, base13, base2, w, ids)

            def warm_up(fn) -> tuple[float, float, torch.Tensor]:
                """(warm-up s, per-call estimate s, warm-up output): one warm-up call, then calls on
                fresh routings for ~10% of min_time (at most 5) to estimate the call time."""
                t0 = time.perf_counter()
                out = fn(warm_w, warm_ids)
                t_warm = time.perf_counter() - t0
                if cfg.calls is not None or t_warm * cfg.min_calls >= cfg.min_time:
                    return t_warm, t_warm, out
                est = []
                while len(est) < 5 and sum(est) < 0.1 * cfg.min_time:
                    w, ids, _ = stream.next()
                    t0 = time.perf_counter()
                    fn(w, ids)
                    est.append(time.perf_counter() - t0)
                return t_warm, sorted(est)[len(est) // 2], out

            mw, mest, mout = warm_up(mp)
            n_m = _call_count(cfg, mest)
            n_t = 0
            if base13 is not None:
                tw, test, tout = warm_up(tl)
                n_t = _call_count(cfg, test)
                diff = (mout.float() - tout.float()).abs().max().item()
                scale = tout.float().abs().max().item()
                check = diff / scale if scale > 0 else diff
            routings = stream.take(max(n_m, n_t))
            label = f"{shape.name} T={tokens} {cfg.dtype}" + (f" {cfg.scheme}" if cfg.scheme != "dense" else "")

            def raw(experts):
                return ops().read_experts(packed.w13, packed.w2, experts)

            def evict():
                return ops().read_experts(evict_buf, evict_buf[:, :64], evict_id)

            log(f"{label}: moepack x{n_m} (each followed by a plain read of the same experts' bytes)")
            tm, bg_m, waited_m, att_m = _measure(cfg, lambda: _time_calls(mp, routings[:n_m], packed_bpe, mw, raw, evict))
            tt = bg_t = waited_t = att_t = None
            if base13 is not None:
                log(f"{label}: torch loop x{n_t}")
                tt, bg_t, waited_t, att_t = _measure(cfg, lambda: _time_calls(tl, routings[:n_t], canon_bpe, tw))

            flops = layout_flops(tokens, shape.topk, shape.hidden, shape.intermediate)
            m_gflops = flops * tm.calls / tm.total_s / 1e9
            row = Row(
                shape=shape.name,
                num_experts=shape.num_experts,
                topk=shape.topk,
                hidden=shape.hidden,
                intermediate=shape.intermediate,
                tokens=tokens,
                dtype=cfg.dtype,
                threads=cfg.threads,
                flops_per_call=flops,
                scheme=cfg.scheme,
                packed_bytes_per_expert=packed_bpe,
                unique_experts_mean=round(sum(r[2] for r in routings[:n_m]) / n_m, 3),
                moepack_calls=tm.calls,
                moepack_ms=tm.mean_ms,
                moepack_ms_median=tm.median_ms,
                moepack_ms_min=tm.min_ms,
                moepack_gbs=tm.gbs,
                moepack_gflops=m_gflops,
                moepack_bw_frac=tm.gbs / probe.read_gbs if probe.read_gbs else None,
                moepack_peak_frac=m_gflops / probe.fma_gflops if probe.fma_gflops else None,
                raw_read_ms=tm.raw_total_s / tm.calls * 1e3,
                raw_read_gbs=tm.bytes_touched * (raw_bpe / packed_bpe) / tm.raw_total_s / 1e9,
                moepack_raw_frac=tm.raw_total_s / tm.total_s,
                moepack_bg_cpus=bg_m,
                moepack_waited_s=waited_m,
                moepack_attempts=att_m,
            )
            if tt is not None:
                row.torch_calls = tt.calls
                row.torch_ms = tt.mean_ms
                row.torch_ms_median = tt.median_ms
                row.torch_ms_min = tt.min_ms
                row.torch_gbs = tt.gbs
                row.torch_gflops = flops * tt.calls / tt.total_s / 1e9
                row.torch_weight_dtype = str(base13.dtype).replace("torch.", "")
                row.speedup = tt.mean_ms / tm.mean_ms
                row.check_rel_diff = check
                row.torch_bg_cpus, row.torch_waited_s, row.torch_attempts = bg_t, waited_t, att_t
                if check > (0.08 if cfg.scheme != "dense" else 0.05):
                    notes.append(f"{label}: moepack and the torch loop differ by {check:.3g} (relative): check the kernels")
            for who, bg in (("moepack", bg_m), ("torch loop", bg_t)):
                if bg is not None and bg > BUSY_CPUS:
                    notes.append(f"{label}: other processes used {bg:.2f} CPUs while the {who} was timed")
            rows.append(row)
            log(
                f"{label}: moepack {row.moepack_ms:.3f} ms ({row.moepack_gbs:.1f} GB/s, {row.moepack_gflops:.1f} GFLOP/s)"
                + (f", torch {row.torch_ms:.3f} ms, x{row.speedup:.2f}" if row.torch_ms is not None else "")
            )
            del routings, x
        del packed, base13, base2
        gc.collect()

    if cfg.scheme == "int8_channel":
        notes.append(
            "--scheme int8_channel: GFLOP/s is int8 GOP/s and '% FMA peak' is against the fp32 FMA peak; "
            f"the int8 kernel here is {moepack.kernel_choice('i8_n32k4_x86')[0]} (avx2: vpsignb + vpmaddubsw + vpmaddwd "
            "+ vpaddd, 32 int8 multiply-adds per 4 ops per row; avx512: the same on zmm, 64; avx_vnni: vpdpbusd on ymm, "
            "32 per op; avx512_vnni: vpdpbusd on zmm, 64 per op)"
        )
        if not cfg.skip_torch:
            notes.append("--scheme int8_channel: the torch loop runs the bf16 weights (the check column includes the int8 quantization error)")
    machine["loadavg_end"] = _loadavg()
    config = dataclasses.asdict(cfg)
    config["shapes"] = [dataclasses.asdict(s) for s in cfg.shapes]
    return BenchResult(
        config=config,
        machine=machine,
        probe=probe,
        rows=rows,
        started=started,
        seconds=round(time.perf_counter() - t_start, 1),
        notes=notes,
    )


# ---------------------------------------------------------------------------------------------
# Output


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


TABLE_COLUMNS = (
    "shape", "T", "dtype", "moepack ms", "torch ms", "speedup",
    "moepack GB/s", "% read BW", "% raw read", "moepack GFLOP/s", "% FMA peak", "torch GB/s", "torch GFLOP/s", "experts/call",
)


def table_cells(row: Row) -> list[str]:
    return [
        row.shape,
        str(row.tokens),
        row.dtype if row.scheme == "dense" else f"{row.dtype}/{row.scheme}",
        _f(row.moepack_ms, ".3f"),
        _f(row.torch_ms, ".3f"),
        "-" if row.speedup is None else f"{row.speedup:.2f}x",
        _f(row.moepack_gbs, ".1f"),
        _pct(row.moepack_bw_frac),
        _pct(row.moepack_raw_frac),
        _f(row.moepack_gflops, ".1f"),
        _pct(row.moepack_peak_frac),
        _f(row.torch_gbs, ".1f"),
        _f(row.torch_gflops, ".1f"),
        f"{row.unique_experts_mean:.1f}",
    ]


def machine_line(result: BenchResult) -> str:
    m, p = result.machine, result.probe
    head = f"{m['cpu_model']}, {m['threads']} threads, kernel {m['kernel_isa']}, torch {m['torch_version']}"
    if p.measured:
        return (
            f"{head}; machine: read {p.read_gbs:.1f} GB/s (best of {len(p.read_gbs_passes)} passes over "
            f"{p.buffer_bytes / 2**30:.2f} GiB), fp32 FMA peak {p.fma_gflops:.1f} GFLOP/s ({p.isa})"
        )
    return f"{head}; machine bandwidth/peak not measured: {p.note}"


def render_table(result: BenchResult):
    """A rich Table of the rows."""
    from rich.table import Table

    table = Table(title="moepack fused experts vs torch per-expert loop", caption=machine_line(result))
    for i, name in enumerate(TABLE_COLUMNS):
        table.add_column(name, justify="left" if i < 3 else "right", no_wrap=True)
    for row in result.rows:
        table.add_row(*table_cells(row))
    return table


def render_markdown(result: BenchResult) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in result.rows]
    return "\n".join(lines) + "\n\n" + machine_line(result) + "\n"


def write_json(result: BenchResult, path: str | os.PathLike) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result.to_dict(), indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """``python -m moepack.bench [--debug] [options]``: the CLI's ``bench`` command (same options
    as ``moepack bench``)."""
    import typer

    from moepack.cli.app import state
    from moepack.cli.main import app

    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        args.remove("--debug")
        state.debug = True
    group = typer.main.get_command(app)
    group.commands["bench"].main(args, prog_name="python -m moepack.bench")


if __name__ == "__main__":
    main()
