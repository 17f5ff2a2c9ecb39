"""Timing on a shared machine: the routings (a fresh one per call), the timed calls, the CPU
that other processes took meanwhile (/proc/stat), waiting for quiet and retrying."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch


def median(values: list[float]) -> float:
    """The median (the mean of the two middle values for an even count)."""
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


if TYPE_CHECKING:
    from .run import BenchConfig

class CpuMeter:
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
    meter = CpuMeter()
    while time.perf_counter() - t0 < max_s:
        meter.start()
        time.sleep(window_s)
        bg = meter.stop()
        if bg is None or bg < threshold:
            break
    return round(time.perf_counter() - t0, 1)



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
        return median(self.times_s) * 1e3

    @property
    def min_ms(self) -> float:
        return min(self.times_s) * 1e3

    @property
    def gbs(self) -> float:
        return self.bytes_touched / self.total_s / 1e9

    @property
    def raw_total_s(self) -> float | None:
        return sum(self.raw_times_s) if self.raw_times_s else None


def time_calls(fn: Callable[[torch.Tensor, torch.Tensor], object], routings, bytes_per_expert: int, warmup_s: float,
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


def eviction_bytes() -> int:
    """Twice the largest CPU cache sysfs reports (at least 16 MiB, at most 512 MiB; 64 MiB when unknown)."""
    from .probe import largest_cache_bytes

    largest = largest_cache_bytes()
    return min(max(2 * largest, 16 * 2**20), 512 * 2**20) if largest else 64 * 2**20


BUSY_CPUS = 0.25  # other processes above this many CPUs during a measurement: flagged (and retried)


def measure(cfg: "BenchConfig", run: Callable[[], object]) -> tuple[object, float | None, float | None, int]:
    """run() under the contention policy: wait for quiet (--wait-quiet), time, and redo up to
    --retries times while other processes used more than BUSY_CPUS; keeps the least disturbed
    attempt. Returns (result, bg_cpus, seconds waited, attempts)."""
    best = None
    waited_total = 0.0
    for attempt in range(1 + cfg.retries):
        if cfg.wait_quiet:
            waited_total += wait_quiet(cfg.wait_quiet)
        meter = CpuMeter()
        meter.start()
        res = run()
        bg = meter.stop()
        if best is None or (bg is not None and best[1] is not None and bg < best[1]):
            best = (res, bg)
        if bg is None or bg <= BUSY_CPUS:
            break
    return best[0], best[1], (round(waited_total, 1) if cfg.wait_quiet else None), attempt + 1


def call_count(cfg: "BenchConfig", est_s: float) -> int:
    if cfg.calls is not None:
        return cfg.calls
    return max(cfg.min_calls, min(cfg.max_calls, math.ceil(cfg.min_time / max(est_s, 1e-6))))
