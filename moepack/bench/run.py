"""The benchmark run: its options (BenchConfig), the weights, the loop over shapes and token
counts, and ``main`` (``python -m moepack.bench``)."""

from __future__ import annotations

import dataclasses
import datetime
import gc
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..isa import host_family
from ..layout import layout_flops
from .probe import MachineProbe, loadavg, describe_limits, kernel_instruction, machine_info, probe_machine
from .report import PLAIN_SCHEME, BenchResult, Row
from .shapes import DEFAULT_SHAPES, DEFAULT_TOKENS, DTYPES, SHAPES, MoeShape
from .timing import BUSY_CPUS, RoutingStream, call_count, CpuMeter, eviction_bytes, measure, time_calls



# --scheme: a weight scheme of moepack.schemes by name or alias; the experts are packed into its
# x86 layout; the scheme says the check tolerance and its notes (Scheme.bench).


@dataclass
class BenchConfig:
    shapes: list[MoeShape] = field(default_factory=lambda: [SHAPES[n] for n in DEFAULT_SHAPES])
    tokens: list[int] = field(default_factory=lambda: list(DEFAULT_TOKENS))
    threads: int = 2
    dtype: str = "bf16"  # activations; the weights are the scheme's
    scheme: str = PLAIN_SCHEME  # packed weights: a scheme name or alias ("bf16", "int8", "int4"); validate() normalizes it
    act_mode: str | None = None  # schemes with two modes: "a16" or "a8"; None: the layout's default
    skip_torch: bool = False
    min_time: float = 1.0  # seconds of timed calls per measurement (adaptive call count)
    calls: int | None = None  # fixed call count instead (still >= 1)
    min_calls: int = 3
    max_calls: int = 1000
    probe: bool = True
    probe_bytes: int = 1 << 30
    probe_passes: int = 3  # best of this many reads per bandwidth pattern
    probe_peak_seconds: float = 0.2  # about this long per dot-product instruction
    seed: int = 0
    wait_quiet: float = 0.0  # before each measurement, wait up to this many s for other processes to go idle
    retries: int = 0  # re-time a measurement (up to this many times) when other processes were busy
    vs: list[str] = field(default_factory=list)  # --vs: other engines timed against moepack in this process (vs.py)

    def validate(self) -> None:
        if not self.shapes:
            raise ValueError("no shapes to benchmark")
        if not self.tokens or any(t <= 0 for t in self.tokens):
            raise ValueError(f"token counts {self.tokens} must be positive")
        if self.threads < 1:
            raise ValueError(f"--threads {self.threads}: must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: must be one of {', '.join(DTYPES)}")
        from ..errors import UnsupportedError
        from ..schemes import get_scheme

        try:
            sch = get_scheme(self.scheme)
        except UnsupportedError as e:
            raise ValueError(f"--scheme: {e}") from None
        self.scheme = sch.name
        if self.act_mode is not None:
            modes = sch.layout_for(host_family()).act_modes
            if self.act_mode not in modes:
                raise ValueError(f"--act-mode {self.act_mode!r}: scheme {sch.name} runs with {' or '.join(modes)} activations")
        if not (self.min_time > 0 and math.isfinite(self.min_time)):
            raise ValueError(f"--min-time {self.min_time}: must be a positive number of seconds")
        if self.calls is not None and self.calls < 1:
            raise ValueError(f"--calls {self.calls}: must be >= 1")
        if self.retries < 0:
            raise ValueError(f"--retries {self.retries}: must be >= 0")
        if self.wait_quiet < 0:
            raise ValueError(f"--wait-quiet {self.wait_quiet}: must be >= 0 seconds")
        if self.probe_bytes < (64 << 20):
            raise ValueError(f"--probe-gib: a probe buffer of {self.probe_bytes} bytes is too small to measure memory (>= 64 MiB)")
        if self.vs:
            from .peers import parse_vs

            self.vs = parse_vs(self.vs)
        if self.probe_passes < 1:
            raise ValueError(f"probe_passes={self.probe_passes}: must be >= 1")
        if not (self.probe_peak_seconds > 0 and math.isfinite(self.probe_peak_seconds)):
            raise ValueError(f"probe_peak_seconds={self.probe_peak_seconds}: must be a positive number of seconds")



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


def start_run(cfg) -> tuple[float, str, dict]:
    """A bench run's start (plain or ``--vs``): its clock, its UTC start time, and the machine
    facts with the thread count set and the load average at the start."""
    t_start = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    torch.set_num_threads(cfg.threads)
    machine = machine_info(cfg.threads)
    machine["torch_num_threads"] = torch.get_num_threads()
    machine["loadavg_start"] = loadavg()
    return t_start, started, machine


def probe_limits(cfg, machine: dict, notes: list[str], log, *, retried: bool) -> MachineProbe:
    """The machine probe of a bench run (a stub saying why when ``--no-probe``), with the CPUs
    other processes used meanwhile in ``machine`` and a note when they were busy. ``retried``:
    through ``measure`` (``--wait-quiet`` / ``--retries``, the plain bench), else timed once
    (``--vs``, which takes neither)."""
    if not cfg.probe:
        return MachineProbe(threads=cfg.threads, note="disabled (--no-probe)")
    log(f"probing the machine: read bandwidth over {cfg.probe_bytes / 2**30:.2f} GiB and dot-product peaks, {cfg.threads} threads")

    def run() -> MachineProbe:
        return probe_machine(cfg.threads, cfg.probe_bytes, cfg.probe_passes, cfg.probe_peak_seconds)

    if retried:
        probe, bg, waited, attempts = measure(cfg, run)
        machine["probe_waited_s"], machine["probe_attempts"] = waited, attempts
    else:
        meter = CpuMeter()
        meter.start()
        probe = run()
        bg = meter.stop()
    for label, text in describe_limits(probe):
        log(f"  {label}: {text}")
    machine["probe_bg_cpus"] = bg
    if bg is not None and bg > BUSY_CPUS:
        notes.append(f"other processes used {bg:.2f} CPUs during the machine probe: its numbers are low")
    return probe


def run_benchmark(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> BenchResult:
    """Run every (shape, T) of ``cfg``; ``log`` gets one line per step (progress)."""
    import moepack
    from .._ops import ops
    from ..reference import torch_loop_moe

    cfg.validate()
    t_start, started, machine = start_run(cfg)
    notes: list[str] = []
    if cfg.threads > (os.cpu_count() or cfg.threads):
        notes.append(f"--threads {cfg.threads} is more than the {os.cpu_count()} logical CPUs")

    probe = probe_limits(cfg, machine, notes, log, retried=True)

    act_dtype = DTYPES[cfg.dtype]
    # read before each plain read of the experts (untimed): evicts what the call left in the cache
    evict_buf = torch.ones(1, eviction_bytes(), dtype=torch.uint8)
    evict_id = torch.zeros(1, dtype=torch.int32)
    rows: list[Row] = []
    from ..schemes import get_scheme

    scheme = get_scheme(cfg.scheme)
    layout = scheme.layout_for(host_family())
    act_mode = cfg.act_mode or layout.act_modes[0]
    kernel_isa = moepack.kernel_choice(layout, act_mode).isa
    instruction = kernel_instruction(layout.weight_dtype, kernel_isa, act_mode)
    peak = probe.peak(instruction.name if instruction else None)
    if cfg.probe and probe.measured and peak is None:
        why = "its scalar level has none" if instruction is None else probe.skipped.get(instruction.name, "not measured")
        notes.append(f"layout {layout.name} runs {kernel_isa}: no dot-product peak to divide by ({why})")
    for si, shape in enumerate(cfg.shapes):
        log(f"{shape.name} ({shape.describe()}): making and packing random bf16 weights" + (f" as {cfg.scheme}" if scheme.quantized else ""))
        w13, w2 = make_weights(shape, cfg.seed + 1000 * si)
        packed = moepack.pack_experts(w13, w2, layout=layout)
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
                return moepack.run_experts(packed, x, w, ids, act_mode=act_mode)

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
            n_m = call_count(cfg, mest)
            n_t = 0
            if base13 is not None:
                tw, test, tout = warm_up(tl)
                n_t = call_count(cfg, test)
                diff = (mout.float() - tout.float()).abs().max().item()
                scale = tout.float().abs().max().item()
                check = diff / scale if scale > 0 else diff
            routings = stream.take(max(n_m, n_t))
            label = f"{shape.name} T={tokens} {cfg.dtype}" + (f" {cfg.scheme}" if scheme.quantized else "")

            def raw(experts):
                return ops().read_experts(packed.w13, packed.w2, experts)

            def evict():
                return ops().read_experts(evict_buf, evict_buf[:, :64], evict_id)

            log(f"{label}: moepack x{n_m} (each followed by a plain read of the same experts' bytes)")
            tm, bg_m, waited_m, att_m = measure(cfg, lambda: time_calls(mp, routings[:n_m], packed_bpe, mw, raw, evict))
            tt = bg_t = waited_t = att_t = None
            if base13 is not None:
                log(f"{label}: torch loop x{n_t}")
                tt, bg_t, waited_t, att_t = measure(cfg, lambda: time_calls(tl, routings[:n_t], canon_bpe, tw))

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
                moepack_peak_frac=m_gflops / peak if peak else None,
                kernel_isa=kernel_isa,
                peak_instruction=instruction.name if instruction else None,
                peak_value=peak,
                raw_read_ms=tm.raw_total_s / tm.calls * 1e3,
                raw_read_gbs=tm.bytes_touched * (raw_bpe / packed_bpe) / tm.raw_total_s / 1e9,
                moepack_raw_frac=tm.raw_total_s / tm.total_s,
                moepack_bg_cpus=bg_m,
                moepack_waited_s=waited_m,
                moepack_attempts=att_m,
                act_mode=act_mode,
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
                if check > scheme.bench.check_tol:
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

    if scheme.bench.notes is not None:
        notes += scheme.bench.notes(kernel_isa, instruction.asm if instruction else None, not cfg.skip_torch)
    machine["loadavg_end"] = loadavg()
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
