"""The benchmark's results: the row and result records, the versioned JSON file (write, read
back), the renderings (rich table, Markdown) and the comparison with an earlier result file.

The JSON format is specified in docs/BENCH.md: ``"format": "moepack-bench"`` and an integer
``"format_version"`` (``FORMAT_VERSION``). Within a version, fields are only ever added; readers
ignore keys they do not know. A file without ``format`` is the output of moepack before the
format was versioned (version 0): its rows have the same names and are compared as well.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from .probe import INSTRUCTION_BY_NAME, MachineProbe
from ..layout import DEFAULT_LAYOUT

FORMAT = "moepack-bench"
FORMAT_VERSION = 1


# The scheme of float weights kept as floats (the default layout's): rows of it carry no scheme in
# their labels, and result files from before --scheme, whose rows have none, were of it.
PLAIN_SCHEME = DEFAULT_LAYOUT.scheme

@dataclass
class Row:
    """One (shape, scheme, dtype, T) measurement; its fields are the JSON rows (docs/BENCH.md)."""

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
    moepack_bw_frac: float | None  # moepack_gbs / machine read bandwidth (best pattern)
    moepack_peak_frac: float | None  # moepack_gflops / peak of the kernel's dot-product instruction
    scheme: str = PLAIN_SCHEME  # float weights: GFLOP/s; a quantized scheme: the same count of its integer ops
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
    kernel_isa: str | None = None  # the ISA level the layout's kernel ran at
    peak_instruction: str | None = None  # probe.INSTRUCTIONS name the peak fraction divides by
    peak_value: float | None = None  # its peak here (GFLOP/s or GOP/s), at `threads` threads
    act_mode: str | None = None  # the activation mode moepack ran (schemes with two: "a16" / "a8"); --vs rows record it
    # --vs (moepack/bench/vs.py): moepack's arms pooled into the moepack_* fields above, plus
    moepack_ms_p25: float | None = None
    moepack_rel_err: float | None = None  # ||out - ref|| / ||ref||, ref: fp32 on the same weights (T <= 8)
    moepack_arms: list | None = None  # per moepack arm: {arm, calls, ms, ms_median, ms_p25, ms_min, gbs}
    vs: list | None = None  # per engine: {engine, path, act, weights, bytes_per_expert, calls, ms, ms_median, ms_p25, ms_min, gbs, gflops, ratio, rel_err}


@dataclass
class BenchResult:
    config: dict
    machine: dict
    probe: MachineProbe
    rows: list[Row]
    started: str
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    comparison: Comparison | None = None  # --compare: against an earlier result file

    def to_dict(self) -> dict:
        d = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "started": self.started,
            "seconds": self.seconds,
            "config": self.config,
            "machine": self.machine,
            "probe": dataclasses.asdict(self.probe),
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "notes": self.notes,
        }
        if self.comparison is not None:
            d["compare"] = self.comparison.to_dict()
        return d


def fmt_value(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


TABLE_COLUMNS = (
    "shape", "T", "dtype", "moepack ms", "torch ms", "speedup",
    "moepack GB/s", "% read BW", "% raw read", "moepack GFLOP/s", "% dot peak", "torch GB/s", "torch GFLOP/s", "experts/call",
)


def table_cells(row: Row) -> list[str]:
    return [
        row.shape,
        str(row.tokens),
        row.dtype if row.scheme == PLAIN_SCHEME else f"{row.dtype}/{row.scheme}",
        fmt_value(row.moepack_ms, ".3f"),
        fmt_value(row.torch_ms, ".3f"),
        "-" if row.speedup is None else f"{row.speedup:.2f}x",
        fmt_value(row.moepack_gbs, ".1f"),
        fmt_pct(row.moepack_bw_frac),
        fmt_pct(row.moepack_raw_frac),
        fmt_value(row.moepack_gflops, ".1f"),
        fmt_pct(row.moepack_peak_frac),
        fmt_value(row.torch_gbs, ".1f"),
        fmt_value(row.torch_gflops, ".1f"),
        f"{row.unique_experts_mean:.1f}",
    ]


def machine_line(result: BenchResult) -> str:
    """Where the numbers come from, and what the '%' columns divide by."""
    m, p = result.machine, result.probe
    head = f"{m['cpu_model']}, {m['threads']} threads, torch {m['torch_version']}"
    if not p.measured:
        return f"{head}; machine limits not measured: {p.note}"
    text = (f"{head}; % read BW of {p.read_gbs:.1f} GB/s (best read: {p.read_pattern}; plain {fmt_value(p.plain_read_gbs, '.1f')} GB/s, "
            f"{p.buffer_bytes / 2**30:.2f} GiB)")
    seen = []
    for r in result.rows:
        key = (r.kernel_isa, r.peak_instruction)
        if key in seen:
            continue
        seen.append(key)
        ins = INSTRUCTION_BY_NAME.get(r.peak_instruction or "")
        if ins is None:
            text += f"; kernel {r.kernel_isa}: no dot-product peak"
        elif r.peak_value is None:
            text += f"; kernel {r.kernel_isa}: {ins.asm} not measured ({p.skipped.get(ins.name, '?')})"
        else:
            text += f"; % dot peak of {ins.asm} {r.peak_value:.0f} {ins.unit} (kernel {r.kernel_isa})"
    return text


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
    out = "\n".join(lines) + "\n\n" + machine_line(result) + "\n"
    if result.comparison is not None:
        out += "\n" + render_compare_markdown(result.comparison)
    return out


def write_json(result: BenchResult | dict, path: str | os.PathLike) -> None:
    """The result as JSON (format in docs/BENCH.md), written to a sibling temp file, then renamed."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    data = result.to_dict() if isinstance(result, BenchResult) else result
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, p)


# ---------------------------------------------------------------------------------------------
# Reading a result file back, and comparing two


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {what}")


def load_result(path: str | os.PathLike) -> dict:
    """A result file (any format version this moepack reads: 0 and 1) as a dict with
    ``format_version`` set; its rows checked for what a comparison needs. Errors name the file,
    the row and the rule."""
    p = Path(path)
    where = f"bench result {p}"
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"{where}: cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: is not JSON ({e})") from None
    return check_result(data, where)


def check_result(data: object, where: str = "bench result") -> dict:
    """``data`` (a parsed result file) checked and normalized in place: see ``load_result``."""
    _need(isinstance(data, dict), where, f"is a JSON {type(data).__name__}, not an object")
    fmt = data.get("format")
    if fmt is None:
        version = 0  # before the format was versioned: same row names
    else:
        _need(fmt == FORMAT, where, f"format is {fmt!r}, not {FORMAT!r} (not a moepack bench result)")
        version = data.get("format_version")
        _need(isinstance(version, int) and not isinstance(version, bool), where,
              f"format_version is {version!r}: must be an integer")
        _need(0 <= version <= FORMAT_VERSION, where,
              f"format_version {version} is newer than this moepack reads ({FORMAT_VERSION}): update moepack to compare with it")
    rows = data.get("rows")
    _need(isinstance(rows, list), where, "has no 'rows' list (not a moepack bench result)")
    for i, r in enumerate(rows):
        _need(isinstance(r, dict), where, f"rows[{i}] is a {type(r).__name__}, not an object")
        for key, kind in (("shape", str), ("tokens", int), ("moepack_ms", (int, float))):
            v = r.get(key)
            _need(isinstance(v, kind) and not isinstance(v, bool), where,
                  f"rows[{i}].{key} is {v!r}: must be {'a string' if kind is str else 'a number'}")
        _need(r["moepack_ms"] > 0 and math.isfinite(r["moepack_ms"]), where,
              f"rows[{i}].moepack_ms is {r['moepack_ms']!r}: must be a positive time")
        r.setdefault("scheme", PLAIN_SCHEME)
        r.setdefault("dtype", "bf16")
    data["format_version"] = version
    return data


def row_key(r: dict) -> tuple[str, str, str, int]:
    """What makes two rows the same measurement: (shape, scheme, activation dtype, T)."""
    return (r["shape"], r.get("scheme", PLAIN_SCHEME), r.get("dtype", "bf16"), int(r["tokens"]))


def key_label(key: tuple[str, str, str, int]) -> str:
    shape, scheme, dtype, tokens = key
    return f"{shape} T={tokens} {dtype}" + ("" if scheme == PLAIN_SCHEME else f"/{scheme}")


@dataclass
class CompareRow:
    key: tuple[str, str, str, int]
    new_ms: float
    old_ms: float
    ms_ratio: float  # new / old: above 1 = slower
    new_gbs: float | None
    old_gbs: float | None
    gbs_ratio: float | None  # new / old: below 1 = slower
    verdict: str  # "slower", "faster" or "same" (within the threshold)


@dataclass
class Comparison:
    against: str  # the old file
    threshold: float  # fraction: slower by more than this is flagged
    rows: list[CompareRow]
    only_new: list[tuple[str, str, str, int]]
    only_old: list[tuple[str, str, str, int]]
    notes: list[str] = field(default_factory=list)

    @property
    def slower(self) -> list[CompareRow]:
        return [r for r in self.rows if r.verdict == "slower"]

    def summary(self) -> str:
        pct = f"{100 * self.threshold:g}%"
        n = len(self.rows)
        text = f"compared with {self.against}: {n} row{'s' if n != 1 else ''} in both, {len(self.slower)} slower by more than {pct}"
        if self.slower:
            text += " (" + ", ".join(key_label(r.key) for r in self.slower) + ")"
        faster = [r for r in self.rows if r.verdict == "faster"]
        text += f", {len(faster)} faster by more than {pct}"
        if self.only_new:
            text += f"; only in this run: {', '.join(key_label(k) for k in self.only_new)}"
        if self.only_old:
            text += f"; only in {self.against}: {', '.join(key_label(k) for k in self.only_old)}"
        return text

    def to_dict(self) -> dict:
        return {
            "against": self.against,
            "threshold": self.threshold,
            "rows": [{**dataclasses.asdict(r), "key": dict(zip(("shape", "scheme", "dtype", "tokens"), r.key))} for r in self.rows],
            "only_new": [dict(zip(("shape", "scheme", "dtype", "tokens"), k)) for k in self.only_new],
            "only_old": [dict(zip(("shape", "scheme", "dtype", "tokens"), k)) for k in self.only_old],
            "notes": self.notes,
        }


DEFAULT_COMPARE_THRESHOLD = 0.05


def threshold_from_percent(pct: float) -> float:
    """``--compare-threshold PCT`` -> the fraction compare_results takes."""
    if not (isinstance(pct, (int, float)) and math.isfinite(pct) and 0 <= pct < 1000):
        raise ValueError(f"--compare-threshold {pct!r}: must be a percentage >= 0 and < 1000 (e.g. 5 for 5%)")
    return pct / 100


def check_threshold(threshold: float) -> float:
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and 0 <= threshold < 10):
        raise ValueError(f"compare threshold {threshold!r}: must be a fraction >= 0 and < 10 (0.05 = 5%)")
    return float(threshold)


def compare_results(new: dict | BenchResult, old: dict, against: str = "old", threshold: float = DEFAULT_COMPARE_THRESHOLD) -> Comparison:
    """For each (shape, scheme, dtype, T) row in both: new/old of the mean ms and of GB/s, marked
    "slower" when new ms > old ms x (1 + threshold) and "faster" when new ms < old ms x (1 -
    threshold); rows only in one of them are listed. ``new`` and ``old`` are result dicts (as
    ``load_result`` returns) or a BenchResult."""
    check_threshold(threshold)
    new = check_result(new.to_dict() if isinstance(new, BenchResult) else new, "this run")
    old = check_result(old, against)
    new_rows = {row_key(r): r for r in new["rows"]}
    old_rows = {row_key(r): r for r in old["rows"]}
    out = Comparison(against=against, threshold=threshold, rows=[], only_new=[], only_old=[])
    for key, n in new_rows.items():
        o = old_rows.get(key)
        if o is None:
            out.only_new.append(key)
            continue
        ratio = n["moepack_ms"] / o["moepack_ms"]
        ng, og = n.get("moepack_gbs"), o.get("moepack_gbs")
        gratio = ng / og if isinstance(ng, (int, float)) and isinstance(og, (int, float)) and og > 0 else None
        verdict = "slower" if ratio > 1 + threshold else "faster" if ratio < 1 - threshold else "same"
        out.rows.append(CompareRow(key, n["moepack_ms"], o["moepack_ms"], ratio, ng, og, gratio, verdict))
        dims = ("num_experts", "topk", "hidden", "intermediate")
        if any(k in n and k in o and n[k] != o[k] for k in dims):
            out.notes.append(f"{key_label(key)}: the shape's sizes differ between the runs "
                             f"({' '.join(f'{k}={o.get(k)}->{n.get(k)}' for k in dims if n.get(k) != o.get(k))})")
        if n.get("kernel_isa") and o.get("kernel_isa") and n["kernel_isa"] != o["kernel_isa"]:
            out.notes.append(f"{key_label(key)}: the kernel ran at {o['kernel_isa']} then, {n['kernel_isa']} now")
    out.only_old = [k for k in old_rows if k not in new_rows]
    nm, om = new.get("machine") or {}, old.get("machine") or {}
    for k in ("cpu_model", "threads"):
        if k in nm and k in om and nm[k] != om[k]:
            out.notes.append(f"the runs differ in {k}: {om[k]!r} then, {nm[k]!r} now")
    return out


COMPARE_COLUMNS = ("shape", "T", "dtype", "ms", "old ms", "ms new/old", "GB/s", "old GB/s", "GB/s new/old", "")


def compare_cells(r: CompareRow) -> list[str]:
    shape, scheme, dtype, tokens = r.key
    flag = {"slower": "SLOWER", "faster": "faster", "same": ""}[r.verdict]
    return [
        shape, str(tokens), dtype if scheme == PLAIN_SCHEME else f"{dtype}/{scheme}",
        f"{r.new_ms:.3f}", f"{r.old_ms:.3f}", f"{r.ms_ratio:.3f}",
        fmt_value(r.new_gbs, ".1f"), fmt_value(r.old_gbs, ".1f"), fmt_value(r.gbs_ratio, ".3f"), flag,
    ]


def render_compare_table(cmp: Comparison):
    from rich.table import Table

    table = Table(title=f"against {cmp.against} (flagged: more than {100 * cmp.threshold:g}% slower)", caption=cmp.summary())
    for i, name in enumerate(COMPARE_COLUMNS):
        table.add_column(name, justify="left" if i < 3 or i == len(COMPARE_COLUMNS) - 1 else "right", no_wrap=True)
    for r in cmp.rows:
        cells = compare_cells(r)
        style = "bold red" if r.verdict == "slower" else "green" if r.verdict == "faster" else None
        table.add_row(*cells, style=style)
    return table


def render_compare_markdown(cmp: Comparison) -> str:
    lines = ["| " + " | ".join(COMPARE_COLUMNS) + " |", "|" + "---|" * len(COMPARE_COLUMNS)]
    lines += ["| " + " | ".join(compare_cells(r)) + " |" for r in cmp.rows]
    return "\n".join(lines) + "\n\n" + cmp.summary() + "\n" + "".join(f"note: {n}\n" for n in cmp.notes)
