"""``moepack`` command line: ``moepack info``, ``moepack bench`` (console script ``moepack.cli.main:app``).

The app and the shared error handling live in cli/app.py; each command registers itself with
``@command()``. Commands kept in other modules register when imported: import them below.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

import typer

from .app import app, check_range, command, console, err_console, state

__all__ = ["app"]


@command(
    help="Show what moepack sees on this machine: CPU, flags, ISA levels, the kernel it picks per layout and why, "
    "and the machine's limits (read bandwidth, dot-product peaks; measured once, then cached)."
)
def info(
    as_json: bool = typer.Option(False, "--json", help="Print the information as JSON."),
    probe: bool = typer.Option(False, "--probe", help="Measure the machine's limits again (the read-pattern search and the peaks: about 20 s) instead of using the cached ones."),
) -> None:
    import torch

    from moepack.bench import describe_limits, kernel_instruction, machine_info, machine_limits
    from moepack import kernel_choice
    from moepack._ops import decode_streams, mx4_a16_dot
    from moepack.isa import available_isas, host_family
    from moepack.layout import DEFAULT_LAYOUT, LAYOUTS

    info = machine_info()
    info["available_isas"] = available_isas()
    info["max_isa_env"] = os.environ.get("MOEPACK_MAX_ISA") or None
    info["decode_streams"] = decode_streams()
    info["mx4_a16_dot"] = mx4_a16_dot()
    info["default_layout"] = DEFAULT_LAYOUT.name
    info["layouts"] = [f"{x.name} (id {x.id})" for x in LAYOUTS]
    info["kernels"] = {}  # per layout: the ISA level its kernel runs at here, why, and whether that is a fallback
    limits, meta = machine_limits(torch.get_num_threads(), refresh=probe)
    for lay in LAYOUTS:
        for mode in lay.act_modes:  # layouts with two modes: one entry each, "<name> (<mode>)" after the default's
            choice = kernel_choice(lay, mode)
            ins = kernel_instruction(lay.weight_dtype, choice.isa, mode)
            key = lay.name if mode == lay.act_modes[0] else f"{lay.name} ({mode})"
            info["kernels"][key] = {
                "isa": choice.isa, "reason": choice.reason, "is_fallback": choice.is_fallback, "act_mode": mode,
                "instruction": ins.name if ins else None, "peak": limits.peak(ins.name if ins else None),
            }
    info["machine_limits"] = {**dataclasses.asdict(limits), **meta}
    from moepack import variants

    a = variants.applied()
    info["variants"] = {"tune_cache": str(a.path) if a.path else None, "tuned": a.record is not None,
                        "note": a.message or f"measured {a.record.measured_at} at {a.record.threads} threads",
                        "env": os.environ.get("MOEPACK_VARIANT") or None, "choices": {}}
    for lay in LAYOUTS:
        if lay.family != host_family():
            continue
        for mode in lay.act_modes:
            info["variants"]["choices"][f"{lay.name} ({mode})"] = dict(variants.describe(lay, mode))
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    from rich.table import Table

    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    rows = [
        ("moepack", f"{info['moepack_version']} ({info['git_commit'] or 'no git'})"),
        ("torch", f"{info['torch_version']}, {info['threads']} threads"),
        ("cpu", f"{info['cpu_model']}, {info['logical_cpus']} logical CPUs"),
        ("cpu flags", " ".join(f for f in info["cpu_flags"] if "=" not in f)),
        ("host ISA", info["host_isa"]),
        ("ISAs usable", ", ".join(info["available_isas"])),
        ("MOEPACK_MAX_ISA", info["max_isa_env"] or "(unset)"),
        ("decode streams", info["decode_streams"]),
        ("mxfp4 W4A16 dot (AVX-512)", info["mx4_a16_dot"]),
    ]
    for name, k in info["kernels"].items():
        rows.append((f"kernel {name}", k["reason"]))
    v = info["variants"]
    rows.append(("variants", (f"MOEPACK_VARIANT={v['env']} for every call; " if v["env"] else "") + v["note"]))
    for name, per in v["choices"].items():
        rows.append((f"variant {name}", "; ".join(f"{tc}: {what}" for tc, what in per.items())))
    rows.append(("layouts", ", ".join(info["layouts"])))
    rows += describe_limits(limits)
    for name, k in info["kernels"].items():
        if k["peak"] is not None:
            unit = limits.peaks[k["instruction"]]["unit"]
            rows.append((f"limit {name}", f"{k['isa']} kernel: {k['instruction']} {k['peak']:.0f} {unit}"))
    if limits.measured:
        when = f"measured {meta['measured_at']}" + (", cached (moepack info --probe measures again)" if meta["cached"] else "")
        if meta.get("bg_cpus") is not None and meta["bg_cpus"] > 0.25:
            when += f"; other processes used {meta['bg_cpus']:.2f} CPUs meanwhile: the numbers are low"
        if meta.get("remeasured"):
            when += f"; measured again because the {meta['remeasured']}"
        rows.append(("limits", when))
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t, highlight=False)


@command(help="Time moepack's fused experts against the plain torch per-expert loop on real MoE shapes, or (--vs) against "
         "other engines' fused experts in the same process.")
def bench(
    ctx: typer.Context,
    shapes: str = typer.Option(
        "qwen3-30b-a3b,gpt-oss-20b,mixtral-8x7b",
        "--shapes",
        help="Comma-separated: qwen3-30b-a3b, gpt-oss-20b, mixtral-8x7b, tiny, all, or E<e>K<k>H<h>I<i> (e.g. e16k4h1024i512).",
    ),
    tokens: str = typer.Option("1,8,64,512", "--tokens", help="Comma-separated token counts T, each 1..65536."),
    threads: int = typer.Option(2, "--threads", help="torch.set_num_threads, and the machine probe's threads (1..1024)."),
    dtype: str = typer.Option("bf16", "--dtype", help="Activation dtype: bf16, fp32 or fp16 (weights are bf16)."),
    scheme: Optional[str] = typer.Option(
        None, "--scheme", help="Packed experts (default: dense): dense (alias bf16), int8_channel (alias int8; W8A8: the bf16 weights quantized per channel; GB/s of int8 bytes, GOP/s), int4_group (alias int4: symmetric group 128; GB/s of packed int4 bytes), fp8_block (alias fp8: e4m3fn, 128x128 blocks; GB/s of codes and scales), mxfp4 (OCP MX e2m1 + e8m0 per 32, round to nearest even; GB/s of codes and scales), or nvfp4 (e2m1 + e4m3 per 16 + fp32 global, compressed-tensors' rule; GB/s of codes, scales and globals)."
    ),
    act_mode: Optional[str] = typer.Option(
        None, "--act-mode", help="Schemes with two activation modes (int4, mxfp4, nvfp4): a16 (default, W4A16) or a8 (W4A8)."
    ),
    skip_torch: bool = typer.Option(False, "--skip-torch", help="Time only moepack (no torch loop baseline)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write all rows and machine info to this JSON file (format: docs/BENCH.md)."),
    compare: Optional[Path] = typer.Option(
        None, "--compare", help="An earlier --json file: show new/old ms and GB/s per row in both, flag rows slower than --compare-threshold."
    ),
    compare_threshold: float = typer.Option(5.0, "--compare-threshold", help="Percent: a row more than this much slower than in --compare is flagged."),
    calls: Optional[int] = typer.Option(None, "--calls", help="Timed calls per measurement (default: adaptive, see --min-time)."),
    min_time: float = typer.Option(1.0, "--min-time", help="Seconds of timed calls per measurement (at least 3 calls)."),
    probe: bool = typer.Option(True, "--probe/--no-probe", help="Measure read bandwidth and dot-product peaks (tools/bw_probe.c)."),
    probe_gib: float = typer.Option(1.0, "--probe-gib", help="Size of the bandwidth probe's buffer in GiB."),
    seed: int = typer.Option(0, "--seed", help="Seed of weights, activations and routings."),
    wait_quiet: float = typer.Option(
        0.0, "--wait-quiet", help="Shared machines: before each measurement wait up to this many seconds for other processes to go idle."
    ),
    retries: int = typer.Option(0, "--retries", help="Re-time a measurement up to N times when other processes were busy during it."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the table as Markdown instead of a rich table."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines on stderr."),
    vs: Optional[str] = typer.Option(
        None, "--vs", help="Comma-separated engines to time against moepack in this process, on the same weights, calls "
        "alternating (docs/BENCH.md): vllm (vLLM 0.32 fused_experts_cpu; run in MOEPACK_VLLM_PYTHON or build/vllm-venv "
        "when vllm is not importable here), zentorch (zentorch_fused_moe), torch (the per-expert loop)."
    ),
) -> None:
    from moepack import bench as B
    from moepack.convert.run import MAX_THREADS

    check_range("--threads", threads, 1, MAX_THREADS, "torch threads")
    cfg = B.BenchConfig(
        shapes=B.parse_shapes(shapes),
        tokens=B.parse_tokens(tokens),
        threads=threads,
        dtype=dtype,
        **({"scheme": scheme} if scheme else {}),  # default: BenchConfig's (the float layout's scheme)
        act_mode=act_mode,
        skip_torch=skip_torch,
        min_time=min_time,
        calls=calls,
        probe=probe,
        probe_bytes=int(probe_gib * 2**30),
        seed=seed,
        wait_quiet=wait_quiet,
        retries=retries,
        vs=B.parse_vs(vs) if vs is not None else [],
    )
    cfg.validate()  # before minutes of work
    if cfg.vs:
        python = B.reexec_python(cfg.vs)  # vLLM / zentorch in their own venv: the same command there
        if python is not None:
            if not quiet:
                gone = ",".join(e for e in ("vllm", "zentorch") if e in cfg.vs and not B.peers.importable(e))
                err_console.print(f"[dim]--vs {gone}: not importable here; running this bench in {python}[/]", highlight=False, soft_wrap=True)
            raise typer.Exit(B.reexec(python, (["--debug"] if state.debug else []) + ["bench"] + _given_args(ctx), cfg.threads))
    if json_path is not None and json_path.parent and not json_path.parent.exists():
        raise ValueError(f"--json {json_path}: folder {json_path.parent} does not exist")
    threshold = B.threshold_from_percent(compare_threshold)
    old = None
    if compare is not None:
        try:
            old = B.load_result(compare)  # before minutes of work
        except ValueError as e:
            raise ValueError(f"--compare: {e}") from None

    def log(line: str) -> None:
        if not quiet:
            err_console.print(f"[dim]{line}[/]", highlight=False, soft_wrap=True)

    result = B.run_vs(cfg, log=log) if cfg.vs else B.run_benchmark(cfg, log=log)
    if old is not None:
        result.comparison = B.compare_results(result, old, against=str(compare), threshold=threshold)
    if markdown:
        typer.echo((B.render_vs_markdown if cfg.vs else B.render_markdown)(result), nl=False)
    else:
        from rich.console import Console

        out = console if console.is_terminal else Console(width=max(console.width, 240 if cfg.vs else 220))
        out.print((B.render_vs_table if cfg.vs else B.render_table)(result))
        if result.comparison is not None:
            out.print(B.render_compare_table(result.comparison))
    if result.comparison is not None and not markdown:  # (the Markdown carries them)
        for note in result.comparison.notes:
            err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    for note in result.notes:
        err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    from moepack import variants

    hint = variants.untuned_hint()  # after the run: a refusal stays one line
    if hint:
        err_console.print(f"[yellow]note:[/] {hint}", highlight=False, soft_wrap=True)
    if json_path is not None:
        B.write_json(result, json_path)
        if not quiet:
            err_console.print(f"[dim]wrote {json_path}[/]", highlight=False, soft_wrap=True)
def _given_args(ctx: typer.Context) -> list[str]:
    """The options a command was given (those not at their defaults), as command-line words."""
    args: list[str] = []
    for p in ctx.command.params:
        if not p.opts or not p.opts[0].startswith("-"):
            continue
        v = ctx.params.get(p.name)
        if v is None or v == p.default:
            continue
        if getattr(p, "is_flag", False):
            if p.secondary_opts:
                args.append(p.opts[0] if v else p.secondary_opts[0])
            elif v:
                args.append(p.opts[0])
        else:
            args += [p.opts[0], str(v)]
    return args


from . import packdir  # noqa: E402,F401  (registers convert, verify, inspect)
from . import generate  # noqa: E402,F401  (registers generate)
from . import tune  # noqa: E402,F401  (registers tune)
