"""``moepack bench --vs ENGINE[,ENGINE...]``: moepack and other engines' fused experts in ONE
process, on the same weights and routings, calls alternating (docs/BENCH.md "Side by side").

Why one process with the calls alternating: a shared or virtual machine's memory rate drifts by
minutes (up to 2x seen), more than the differences between engines at decode; two engines timed
in separate processes, or one after the other, can land in different phases. Alternating call by
call gives every engine the same phases.

The method, per (shape, T):

* one set of seeded bf16 weights (``run.make_weights``, the plain bench's seeds); the scheme's
  canonical tensors are made from them once (moepack's quantizer, expert by expert) and every
  engine gets those same codes and scales in its own format (moepack/bench/peers/);
* ``SETS`` = 8 routing sets (activations, softmax/top-k weights and ids), made before timing;
* the arms: each engine, then moepack; when that makes an even number of arms, moepack runs twice
  (``moepack (again)``), so the arm count is odd, hence coprime with 8: call i runs arm
  ``i % arms`` on set ``i % 8``, and every arm sees every set equally often (``schedule``);
* one untimed round, three rounds timing each arm (its median: the call-count estimate), then
  ``calls`` calls per arm (a multiple of 8: ``--calls``, or enough for ``--min-time`` seconds
  of the slowest arm), each timed on its own with ``time.perf_counter``;
* per arm: median, 25th percentile, minimum and mean; moepack's figures pool its arms; the ratio
  is engine median / moepack median ("moepack ÷ engine speed": above 1, moepack is faster);
* at T <= ``CHECK_MAX_TOKENS``, each engine's output on set 0 against an fp32 reference of the
  layer on the same (dequantized) weights, so a wrong path shows as a large error.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..isa import host_family
from ..layout import layout_flops
from .peers import (
    PeerArm,
    PeerUnsupported,
    build_peer,
    check_engine,
    expert_slice,
    prepare_canonical,
    supports,
)
from .probe import loadavg, kernel_instruction
from .report import BenchResult, Row, fmt_value, fmt_pct, machine_line
from .shapes import DTYPES
from .timing import BUSY_CPUS, RoutingStream, CpuMeter, median, wait_quiet

SETS = 8
CHECK_MAX_TOKENS = 8  # output errors are measured at T <= this
ERR_NOTE = 0.05  # an engine whose output is further than this from the fp32 reference gets a note
MOEPACK = "moepack"
MOEPACK_AGAIN = "moepack (again)"


def arm_names(engines: list[str]) -> list[str]:
    """The arms in call order: the engines, moepack, and moepack again when the count is even."""
    names = list(engines) + [MOEPACK]
    if len(names) % 2 == 0:
        names.append(MOEPACK_AGAIN)
    return names


def schedule(n_arms: int, calls_per_arm: int, n_sets: int = SETS) -> list[tuple[int, int]]:
    """(arm, routing set) of each timed call, in order: call i runs arm ``i % n_arms`` on set
    ``i % n_sets``. The counts must be coprime (else an arm would see only some sets)."""
    if n_arms < 1 or calls_per_arm < 1 or n_sets < 1:
        raise ValueError(f"schedule({n_arms}, {calls_per_arm}, {n_sets}): arms, calls and sets must be >= 1")
    if math.gcd(n_arms, n_sets) != 1:
        raise ValueError(f"{n_arms} arms and {n_sets} routing sets share a factor: arm a would only see sets a + k*{math.gcd(n_arms, n_sets)}")
    return [(i % n_arms, i % n_sets) for i in range(n_arms * calls_per_arm)]


def calls_per_arm(cfg, slowest_s: float, n_sets: int = SETS) -> int:
    """``cfg.calls``, or enough calls for ``cfg.min_time`` of the slowest arm (within
    ``cfg.min_calls`` .. ``cfg.max_calls``), rounded up to a multiple of ``n_sets``."""
    n = cfg.calls if cfg.calls is not None else max(cfg.min_calls, min(cfg.max_calls, math.ceil(cfg.min_time / max(slowest_s, 1e-6))))
    return max(n_sets, -(-n // n_sets) * n_sets)


@dataclass
class ArmTimes:
    name: str
    times_s: list[float]
    bytes_touched: float  # sum over the calls of unique experts x the arm's bytes per expert

    def _q(self, f: float) -> float:
        s = sorted(self.times_s)
        return s[min(len(s) - 1, int(f * len(s)))] * 1e3

    @property
    def calls(self) -> int:
        return len(self.times_s)

    @property
    def median_ms(self) -> float:
        return median(self.times_s) * 1e3

    @property
    def p25_ms(self) -> float:
        return self._q(0.25)

    @property
    def min_ms(self) -> float:
        return min(self.times_s) * 1e3

    @property
    def mean_ms(self) -> float:
        return sum(self.times_s) / len(self.times_s) * 1e3

    @property
    def gbs(self) -> float:
        """Bytes of the experts a call touches (mean over the calls) / the median time."""
        return self.bytes_touched / self.calls / (self.median_ms / 1e3) / 1e9

    def summary(self) -> dict:
        return {"arm": self.name, "calls": self.calls, "ms": self.mean_ms, "ms_median": self.median_ms, "ms_p25": self.p25_ms,
                "ms_min": self.min_ms, "gbs": self.gbs}  # fmt: skip


def time_arms(fns: list[Callable[[int], object]], plan: list[tuple[int, int]]) -> list[list[float]]:
    """Runs ``plan`` ((arm, set) per call, in order), each call timed alone; the seconds per arm."""
    out: list[list[float]] = [[] for _ in fns]
    clock = time.perf_counter
    for a, s in plan:
        t0 = clock()
        fns[a](s)
        out[a].append(clock() - t0)
    return out


def fp32_reference(scheme_obj, c: dict, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The MoE layer (silu, gate rows then up rows) in fp32 on the scheme's weights, dequantized
    one routed expert at a time: [T, H] fp32."""
    xf = x.float()
    out = torch.zeros(xf.shape[0], xf.shape[1], dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        w13, w2 = (w[0].float() for w in scheme_obj.dequantize(expert_slice(c, int(e))))
        i = w13.shape[0] // 2
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = xf[tok] @ w13.t()
        a = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
        out.index_add_(0, tok, (a @ w2.t()) * topk_weights[tok, slot, None].float())
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def canonical_from_float(scheme_obj, w13: torch.Tensor, w2: torch.Tensor, layout) -> dict:
    """The scheme's canonical tensors of float weights, quantized one expert at a time (no fp32
    copy of a whole layer)."""
    if not scheme_obj.quantized:
        return {"w13": w13, "w2": w2}
    parts: dict[str, list] = {}
    rest: dict = {}
    for e in range(w13.shape[0]):
        one = scheme_obj.from_float(w13[e : e + 1], w2[e : e + 1], layout=layout)
        for k, v in one.items():
            if torch.is_tensor(v):
                parts.setdefault(k, []).append(v)
            else:
                rest[k] = v
    return {**{k: torch.cat(v) for k, v in parts.items()}, **rest}


def run_vs(cfg, log: Callable[[str], None] = lambda s: None) -> BenchResult:
    """Every (shape, T) of ``cfg`` with moepack against the engines ``cfg.vs`` (see the module)."""
    import moepack
    from ..pack import in_huge_pages
    from ..schemes import get_scheme
    from .run import make_weights, probe_limits, start_run

    cfg.validate()
    if not cfg.vs:
        raise ValueError("run_vs: no engine to compare with (--vs)")
    for eng in cfg.vs:
        check_engine(eng)  # PeerUnavailable: one line naming what is missing and the fix
    t_start, started, machine = start_run(cfg)
    machine["python"] = sys.executable
    notes: list[str] = [n for n in [omp_note(cfg.vs, cfg.threads)] if n]
    probe = probe_limits(cfg, machine, notes, log, retried=False)
    act_dtype = DTYPES[cfg.dtype]
    scheme = get_scheme(cfg.scheme)
    layout = scheme.layout_for(host_family())
    act_mode = cfg.act_mode or layout.act_modes[0]
    kernel_isa = moepack.kernel_choice(layout, act_mode).isa
    instruction = kernel_instruction(layout.weight_dtype, kernel_isa, act_mode)
    peak = probe.peak(instruction.name if instruction else None)
    engines = []
    for eng in cfg.vs:
        why = supports(eng, scheme.name, act_dtype)
        if why is None:
            engines.append(eng)
        else:
            notes.append(f"--vs {eng} left out: {why}")
    if not engines:
        raise ValueError(f"--vs {','.join(cfg.vs)} with --scheme {scheme.name} --dtype {cfg.dtype}: no engine runs it ({'; '.join(notes)})")
    rows: list[Row] = []
    for si, shape in enumerate(cfg.shapes):
        log(f"{shape.name} ({shape.describe()}): making random bf16 weights" + (f", quantizing them as {scheme.name}" if scheme.quantized else ""))
        w13, w2 = make_weights(shape, cfg.seed + 1000 * si)
        c = prepare_canonical(scheme.name, canonical_from_float(scheme, w13, w2, layout))
        del w13, w2
        packed = in_huge_pages(scheme.pack(c, interleaved=False, layout=layout))
        packed_bpe = packed.nbytes // shape.num_experts
        peers: dict[str, PeerArm] = {}
        for eng in engines:
            try:
                peers[eng] = build_peer(eng, scheme, c, shape.num_experts, act_dtype)
            except PeerUnsupported as e:
                notes.append(f"{shape.name}: --vs {eng} left out: {e}")
                continue
            log(f"  {eng}: {peers[eng].path} ({peers[eng].act}); {peers[eng].weights}")
        gc.collect()
        if not peers:
            del packed, c
            continue
        names = arm_names(list(peers))
        for ti, tokens in enumerate(cfg.tokens):
            row = _run_case(cfg, shape, si, ti, tokens, scheme, c, packed, packed_bpe, peers, names, act_dtype, act_mode,
                            kernel_isa, instruction, peak, probe, notes, log)  # fmt: skip
            rows.append(row)
        del packed, c, peers
        gc.collect()
    if scheme.bench.notes is not None:
        notes += [n for n in scheme.bench.notes(kernel_isa, instruction.asm if instruction else None, False)]
    machine["loadavg_end"] = loadavg()
    config = dataclasses.asdict(cfg)
    config["shapes"] = [dataclasses.asdict(s) for s in cfg.shapes]
    return BenchResult(config=config, machine=machine, probe=probe, rows=rows, started=started,
                       seconds=round(time.perf_counter() - t_start, 1), notes=notes)  # fmt: skip


def engine_entry(p: PeerArm, x: ArmTimes, moepack_times: ArmTimes, flops: int, err: float | None) -> dict:
    """One engine's entry of a row's ``vs`` list (docs/BENCH.md)."""
    return {
        "engine": x.name, "path": p.path, "act": p.act, "weights": p.weights, "bytes_per_expert": p.bytes_per_expert,
        "calls": x.calls, "ms": x.mean_ms, "ms_median": x.median_ms, "ms_p25": x.p25_ms, "ms_min": x.min_ms,
        "gbs": x.gbs, "gflops": flops / (x.median_ms / 1e3) / 1e9, "ratio": x.median_ms / moepack_times.median_ms, "rel_err": err,
    }  # fmt: skip


def routing_sets(tokens: int, shape, act_dtype: torch.dtype, seed_x: int, seed_r: int) -> list[tuple]:
    """``SETS`` inputs of a case, made before timing: (activations [T, H], topk weights fp32
    [T, k], topk ids int32 [T, k], unique experts). Routing: ``RoutingStream`` (softmax -> top-k
    -> renormalized; at T=1 each set's experts disjoint from the previous set's where E >= 2k)."""
    gx = torch.Generator().manual_seed(seed_x)
    stream = RoutingStream(tokens, shape.num_experts, shape.topk, seed=seed_r)
    sets = []
    for _ in range(SETS):
        w, ids, uniq = stream.next()
        sets.append((torch.randn(tokens, shape.hidden, generator=gx).to(act_dtype), w, ids, uniq))
    return sets


def _run_case(cfg, shape, si, ti, tokens, scheme, c, packed, packed_bpe, peers, names, act_dtype, act_mode, kernel_isa,
              instruction, peak, probe, notes, log) -> Row:  # fmt: skip
    import moepack

    sets = routing_sets(tokens, shape, act_dtype, seed_x=cfg.seed + 7919 * (si * 101 + ti), seed_r=cfg.seed + 31 * (si * 101 + ti) + 1)

    def engine_arm(arm: PeerArm):
        return lambda s: arm.fn(sets[s][0], sets[s][1], sets[s][2])

    def moepack_arm(s):
        return moepack.run_experts(packed, sets[s][0], sets[s][1], sets[s][2], act_mode=act_mode)

    fns = [engine_arm(peers[n]) if n in peers else moepack_arm for n in names]
    bpe = [peers[n].bytes_per_expert if n in peers else packed_bpe for n in names]
    label = f"{shape.name} T={tokens} {scheme.name}" + (f" {act_mode}" if len(packed.layout.act_modes) > 1 else "")

    errs: dict[str, float] = {}
    if tokens <= CHECK_MAX_TOKENS:  # set 0: the first (untimed) call of each arm doubles as the check
        ref = fp32_reference(scheme, c, sets[0][0], sets[0][1], sets[0][2])
        for n, fn in zip(names, fns):
            if n != MOEPACK_AGAIN:
                errs[n] = rel_err(fn(0), ref)
    for a, fn in enumerate(fns):  # an untimed round (each arm on a different set)
        fn(a % SETS)
    est = time_arms(fns, [(a, (a + r * len(fns)) % SETS) for r in (1, 2, 3) for a in range(len(fns))])
    n = calls_per_arm(cfg, max(sorted(t)[1] for t in est))  # the slowest arm's median of 3
    if cfg.wait_quiet:
        wait_quiet(cfg.wait_quiet)
    meter = CpuMeter()
    meter.start()
    times = time_arms(fns, schedule(len(fns), n))
    bg = meter.stop()
    uniq = [s[3] for s in sets]
    # arm a ran its calls on sets a, a + A, a + 2A, ... (mod 8): each set n / 8 times
    arms = [ArmTimes(name, t, sum(uniq[(a + len(names) * j) % SETS] for j in range(len(t))) * b)
            for a, (name, t, b) in enumerate(zip(names, times, bpe))]  # fmt: skip
    mp = [x for x in arms if x.name in (MOEPACK, MOEPACK_AGAIN)]
    pooled = ArmTimes(MOEPACK, [t for x in mp for t in x.times_s], sum(x.bytes_touched for x in mp))
    flops = layout_flops(tokens, shape.topk, shape.hidden, shape.intermediate)
    m_gflops = flops / (pooled.median_ms / 1e3) / 1e9
    vs = [engine_entry(peers[x.name], x, pooled, flops, errs.get(x.name)) for x in arms if x.name in peers]
    for x in arms:
        e = errs.get(x.name)
        if x.name in peers and e is not None and not e <= ERR_NOTE:
            notes.append(f"{label}: {x.name}'s output is {e:.3g} (relative) from the fp32 reference on the same weights: "
                         "its ratio compares a path that computes something else")  # fmt: skip
    me = errs.get(MOEPACK)
    if me is not None and not me <= ERR_NOTE:
        notes.append(f"{label}: moepack's output is {me:.3g} (relative) from the fp32 reference: check the kernels")
    if bg is not None and bg > BUSY_CPUS:
        notes.append(f"{label}: other processes used {bg:.2f} CPUs while the arms were timed")
    row = Row(
        shape=shape.name, num_experts=shape.num_experts, topk=shape.topk, hidden=shape.hidden, intermediate=shape.intermediate,
        tokens=tokens, dtype=cfg.dtype, threads=cfg.threads, flops_per_call=flops, scheme=scheme.name,
        packed_bytes_per_expert=packed_bpe, unique_experts_mean=round(sum(uniq) / len(uniq), 3),
        moepack_calls=pooled.calls, moepack_ms=pooled.mean_ms, moepack_ms_median=pooled.median_ms,
        moepack_ms_min=pooled.min_ms, moepack_gbs=pooled.gbs, moepack_gflops=m_gflops,
        moepack_bw_frac=pooled.gbs / probe.read_gbs if probe.read_gbs else None,
        moepack_peak_frac=m_gflops / peak if peak else None, moepack_bg_cpus=bg,
        kernel_isa=kernel_isa, peak_instruction=instruction.name if instruction else None, peak_value=peak,
        act_mode=act_mode, moepack_ms_p25=pooled.p25_ms, moepack_rel_err=me,
        moepack_arms=[x.summary() for x in mp], vs=vs,
    )  # fmt: skip
    t = next((x for x in arms if x.name == "torch"), None)
    if t is not None:  # the plain bench's torch columns, from the same run
        row.torch_calls, row.torch_ms, row.torch_ms_median, row.torch_ms_min = t.calls, t.mean_ms, t.median_ms, t.min_ms
        row.torch_gbs, row.torch_gflops = t.gbs, flops * t.calls / sum(t.times_s) / 1e9
        row.torch_weight_dtype = str(act_dtype).replace("torch.", "")
        row.speedup = t.mean_ms / pooled.mean_ms
    log(f"{label}: {n} calls per arm; moepack {pooled.median_ms:.3f} ms"
        + "".join(f", {v['engine']} {v['ms_median']:.3f} ms (x{v['ratio']:.2f})" for v in vs))  # fmt: skip
    return row


# ---------------------------------------------------------------------------------------------
# the table

VS_COLUMNS = (
    "shape", "T", "scheme", "engine", "engine ms", "p25 / min", "moepack ms", "p25 / min", "moepack ÷ engine",
    "engine err", "moepack err", "engine GB/s", "moepack GB/s", "% dot peak",
)


def scheme_label(row: Row) -> str:
    text = row.scheme if row.dtype == "bf16" else f"{row.dtype}/{row.scheme}"
    return text + (f" {row.act_mode}" if row.act_mode and len(_act_modes(row.scheme)) > 1 else "")


def _act_modes(scheme: str) -> tuple[str, ...]:
    """The activation modes of ``scheme``'s layout here (() for a scheme this build lacks)."""
    from ..errors import UnsupportedError
    from ..schemes import get_scheme

    try:
        return tuple(get_scheme(scheme).layout_for(host_family()).act_modes)
    except UnsupportedError:
        return ()


def vs_cells(row: Row, v: dict) -> list[str]:
    short = {"vllm": lambda p: p.split()[-1], "torch": lambda p: "loop"}.get(v["engine"], lambda p: "")
    eng = f"{v['engine']} {short(v['path'])}".strip() + (f" ({v['act']})" if v.get("act") else "")
    return [
        row.shape, str(row.tokens), scheme_label(row), eng,
        f"{v['ms_median']:.3f}", f"{v['ms_p25']:.3f} / {v['ms_min']:.3f}",
        f"{row.moepack_ms_median:.3f}", f"{fmt_value(row.moepack_ms_p25, '.3f')} / {row.moepack_ms_min:.3f}",
        f"{v['ratio']:.2f}x", fmt_value(v.get("rel_err"), ".1e"), fmt_value(row.moepack_rel_err, ".1e"),
        fmt_value(v.get("gbs"), ".1f"), fmt_value(row.moepack_gbs, ".1f"), fmt_pct(row.moepack_peak_frac),
    ]  # fmt: skip


def vs_caption(result: BenchResult) -> str:
    return (machine_line(result) + ". One process, the same weights and 8 rotated routings, calls alternating; medians; "
            "moepack ÷ engine = engine median / moepack median (above 1: moepack faster); err: relative to an fp32 "
            "reference on the same weights (T <= 8)")  # fmt: skip


def render_vs_table(result: BenchResult):
    from rich.table import Table

    table = Table(title="moepack against other engines' fused experts", caption=vs_caption(result))
    for i, name in enumerate(VS_COLUMNS):
        table.add_column(name, justify="left" if i < 4 else "right", no_wrap=True)
    for row in result.rows:
        for v in row.vs or []:
            table.add_row(*vs_cells(row, v))
    return table


def render_vs_markdown(result: BenchResult) -> str:
    from .report import render_compare_markdown

    lines = ["| " + " | ".join(VS_COLUMNS) + " |", "|" + "---|" * len(VS_COLUMNS)]
    lines += ["| " + " | ".join(vs_cells(r, v)) + " |" for r in result.rows for v in r.vs or []]
    out = "\n".join(lines) + "\n\n" + vs_caption(result) + "\n"
    if result.comparison is not None:
        out += "\n" + render_compare_markdown(result.comparison)
    return out


# ---------------------------------------------------------------------------------------------
# vLLM lives in its own python (it pins its own packages), zentorch may (MOEPACK_ZENTORCH_PYTHON):
# re-running the bench there

CHILD_ENV = "MOEPACK_BENCH_VS_CHILD"  # set in the re-run: it must not re-run again
TORCH_ENV = "MOEPACK_BENCH_VS_TORCH"  # the torch version moepack was built against (checked there first)

# what the re-run executes: ``python -c BOOT ARGS_JSON PATH_DIR CLI_DIR``. PATH_DIR holds one
# entry, ``moepack`` -> this moepack package, so nothing else of this interpreter's packages
# comes along; the CLI package is loaded from CLI_DIR when that moepack has no ``moepack.cli``
# of its own (a checkout maps ``cli/`` to it at install time).
BOOT = r"""
import importlib.util, json, os, sys
import torch
want = os.environ.get("MOEPACK_BENCH_VS_TORCH")
if want and torch.__version__ != want:
    sys.exit(f"moepack: error: --vs: {sys.executable} has torch {torch.__version__}; moepack's extension was built "
             f"against torch {want}: install torch=={want} there (make vllm-venv does)")
sys.path.insert(0, sys.argv[2])
import moepack
try:
    import moepack.cli.main
except ModuleNotFoundError:
    d = sys.argv[3]
    spec = importlib.util.spec_from_file_location("moepack.cli", os.path.join(d, "__init__.py"), submodule_search_locations=[d])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["moepack.cli"] = mod
    spec.loader.exec_module(mod)
from moepack.cli.main import app
app(args=json.loads(sys.argv[1]), prog_name="moepack")
"""


def omp_note(engines: list[str], threads: int) -> str | None:
    """A note when vLLM runs in a process whose OpenMP was started without OMP_NUM_THREADS = the
    bench's thread count: measured on a loaded 2-core VM, vLLM's quantized T=1 calls then took
    70-100 ms instead of 0.02 ms (torch.set_num_threads alone did not help; the variable, read
    when OpenMP loads, did). The re-run in vLLM's python sets it; in-process it is too late."""
    have = os.environ.get("OMP_NUM_THREADS")
    if "vllm" not in engines or have == str(threads):
        return None
    return (f"OMP_NUM_THREADS is {'unset' if not have else repr(have)}, not {threads} (--threads): vLLM's OpenMP calls can stall "
            f"without it (docs/BENCH.md); run with OMP_NUM_THREADS={threads}")  # fmt: skip


def vllm_python() -> str | None:
    """The interpreter ``--vs vllm`` re-runs in: ``MOEPACK_VLLM_PYTHON``, else
    ``build/vllm-venv/bin/python`` (``make vllm-venv``) of this checkout or of the current
    directory, when that venv was built to the end (its ``.done`` marker); None otherwise."""
    from pathlib import Path

    p = os.environ.get("MOEPACK_VLLM_PYTHON")
    if p:
        return p
    import moepack

    for root in (Path(moepack.__file__).resolve().parent.parent, Path.cwd()):
        cand = root / "build" / "vllm-venv" / "bin" / "python"
        if cand.exists() and (root / "build" / "vllm-venv" / ".done").exists():
            return str(cand)
    return None


def zentorch_python() -> str | None:
    """The interpreter ``--vs zentorch`` re-runs in when zentorch is not importable here:
    ``MOEPACK_ZENTORCH_PYTHON`` (a python with zentorch 2.13.0.2 and torch 2.13.0, e.g. a venv
    made with --system-site-packages); None when unset."""
    return os.environ.get("MOEPACK_ZENTORCH_PYTHON") or None


# the engines that may live in another python: what that python is called, where it is named
ENGINE_PYTHONS = {"vllm": ("the vLLM python", "MOEPACK_VLLM_PYTHON or build/vllm-venv"),
                  "zentorch": ("the zentorch python", "MOEPACK_ZENTORCH_PYTHON")}  # fmt: skip


def _engine_python(engine: str) -> str | None:
    return vllm_python() if engine == "vllm" else zentorch_python()


def reexec_python(engines: list[str]) -> str | None:
    """None when every engine of ``engines`` can be looked for in this interpreter; the python to
    re-run the bench in when vLLM or zentorch is not importable here but a python for it is known
    (``vllm_python``, ``zentorch_python``). Raises PeerUnavailable (one line: what is missing, the
    fix) when there is none, when the missing engines name two different pythons, or when this is
    already the re-run."""
    from .peers import PeerUnavailable, importable, missing_message

    missing = [e for e in ENGINE_PYTHONS if e in engines and not importable(e)]
    if not missing:
        return None
    if os.environ.get(CHILD_ENV):
        e = missing[0]
        label, named_by = ENGINE_PYTHONS[e]
        raise PeerUnavailable(missing_message(e, f"is not importable in {sys.executable} either ({label} named by {named_by})"))
    found: dict[str, str] = {}
    for e in missing:
        py = _engine_python(e)
        if py is None:
            raise PeerUnavailable(missing_message(e))
        if not (os.path.isfile(py) and os.access(py, os.X_OK)):
            raise PeerUnavailable(missing_message(e, f"is not importable in {sys.executable}, and {ENGINE_PYTHONS[e][0]} "
                                                     f"{py} is not an executable file"))  # fmt: skip
        found[e] = py
    if len(set(found.values())) > 1:
        raise PeerUnavailable(f"--vs {','.join(missing)}: they are in two pythons ({', '.join(f'{e}: {p}' for e, p in found.items())}): "
                              "run one --vs at a time, or install both in one python")  # fmt: skip
    return next(iter(found.values()))


def reexec(python: str, args: list[str], threads: int | None = None) -> int:
    """Runs ``moepack ARGS`` in ``python`` with this moepack (package and CLI) on its path; its
    output goes where ours goes. Returns its exit status. ``threads``: OMP_NUM_THREADS for it
    when the environment does not set one (see ``omp_note``)."""
    import json
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    import moepack

    pkg = Path(moepack.__file__).resolve().parent
    cli = sys.modules.get("moepack.cli")
    cli_dir = str(Path(cli.__path__[0]).resolve()) if cli is not None and getattr(cli, "__path__", None) else str(pkg / "cli")
    tmp = tempfile.mkdtemp(prefix="moepack-vs-")
    try:
        os.symlink(pkg, os.path.join(tmp, "moepack"))
        env = dict(os.environ)
        env[CHILD_ENV] = "1"
        env[TORCH_ENV] = torch.__version__
        if threads is not None and not env.get("OMP_NUM_THREADS"):
            env["OMP_NUM_THREADS"] = str(threads)
        sys.stdout.flush()
        sys.stderr.flush()
        return subprocess.run([python, "-c", BOOT, json.dumps(args), tmp, cli_dir], env=env).returncode
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = [
    "CHECK_MAX_TOKENS", "ERR_NOTE", "SETS", "VS_COLUMNS", "ArmTimes", "arm_names", "calls_per_arm", "canonical_from_float",
    "fp32_reference", "omp_note", "reexec", "reexec_python", "rel_err", "render_vs_markdown", "render_vs_table", "run_vs", "schedule",
    "time_arms", "vllm_python", "vs_cells", "zentorch_python",
]
