"""The benchmark's results: the row and result records, and their renderings (rich table,
Markdown, JSON)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .probe import MachineProbe

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
