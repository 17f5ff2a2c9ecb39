"""``moepack tune``: time the kernel variants on this host and keep the fastest (moepack/bench/tune.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .app import command, console, err_console


@command(
    help="Time the kernel variants (how the kernels walk the weights: task order, gate and up as two streams, "
    "decode streams, prefetch) on this machine, on the bench shapes or a packed directory, and keep the fastest "
    "per layout and token class. The picks are cached per machine and build and used by every later run "
    "(moepack.open, pack_experts, run_experts) with no action; `moepack info` shows them (docs/KERNELS.md "
    "\"Variants and the tuner\")."
)
def tune(
    shapes: str = typer.Option(
        "qwen3-30b-a3b,gpt-oss-20b", "--shapes",
        help="Comma-separated bench shapes (qwen3-30b-a3b, gpt-oss-20b, mixtral-8x7b, tiny, E<e>K<k>H<h>I<i>); "
        "random weights of each, at most 1 GiB of bf16 experts per shape."),
    packed: Optional[Path] = typer.Option(
        None, "--packed", help="A packed directory: tune on its first MoE layers' own experts, layout and act mode "
        "instead of --shapes/--scheme."),
    scheme: Optional[str] = typer.Option(
        None, "--scheme", help="Comma-separated scheme[:act_mode] to tune (default: every scheme and mode: dense, "
        "int8_channel, int4_group:a16, int4_group:a8, fp8_block, mxfp4:a16, mxfp4:a8)."),
    tokens: str = typer.Option("1,8", "--tokens", help="Comma-separated token counts, one per class tuned: T=1, "
                               "T=2..16, T>16 (add 512 to tune prefill too)."),
    threads: int = typer.Option(2, "--threads", help="torch.set_num_threads while timing (the picks are used at any count)."),
    seconds: float = typer.Option(1.5, "--seconds", help="Timing per (scheme, shape, T) and phase; more is steadier."),
    show: bool = typer.Option(False, "--show", help="Print this machine's cached picks and exit (nothing timed)."),
    clear: bool = typer.Option(False, "--clear", help="Delete this machine's cache (the build's defaults from then on) and exit."),
    no_write: bool = typer.Option(False, "--no-write", help="Time and print, but do not write the cache."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
) -> None:
    from moepack import variants as V
    from moepack._ops import load_extension
    from moepack.bench.shapes import parse_shapes, parse_tokens
    from moepack.bench.tune import TuneConfig, default_schemes, run_tune
    from moepack.schemes import get_scheme

    load_extension()  # (applies this machine's cache, if any: --show reports what it did)
    path = V.cache_path()
    if clear:
        if path.is_file():
            path.unlink()
            console.print(f"deleted {path}: the build's defaults from the next process on", highlight=False)
        else:
            console.print(f"no tune cache at {path}", highlight=False)
        return
    if show:
        a = V.applied()
        if a.record is None:
            console.print(a.message or f"no tune cache at {path}", highlight=False, soft_wrap=True)
            return
        console.print(f"{a.path}: measured {a.record.measured_at} at {a.record.threads} threads on "
                      f"{', '.join(a.record.shapes)}", highlight=False, soft_wrap=True)
        for c in a.record.choices:
            console.print(f"  {c.layout} {c.act_mode} {c.tclass}: {c.spec or 'default'}"
                          + (f" ({c.gain:.3f}x)" if c.spec else "") + (f"; {c.note}" if c.note else ""), highlight=False, soft_wrap=True)
        return
    if not seconds > 0 or seconds > 60:
        raise ValueError(f"--seconds {seconds}: must be a number of seconds in (0, 60]")
    if threads < 1:
        raise ValueError(f"--threads {threads}: must be at least 1")
    schemes = default_schemes()
    if scheme:
        schemes = []
        for part in filter(None, (p.strip() for p in scheme.split(","))):
            name, _, mode = part.partition(":")
            get_scheme(name)  # an unknown scheme: the registry's one-line refusal
            if mode and mode not in ("a16", "a8"):
                raise ValueError(f"--scheme {part}: act mode {mode!r} must be a16 or a8")
            schemes.append((name, mode or None))
    if packed is not None and not packed.is_dir():
        raise ValueError(f"--packed {packed}: not a directory")
    cfg = TuneConfig(shapes=parse_shapes(shapes) if packed is None else [], schemes=schemes,
                     tokens=parse_tokens(tokens), threads=threads, seconds_per_case=seconds,
                     packed=str(packed) if packed else None)

    def log(line: str) -> None:
        if not quiet:
            err_console.print(f"[dim]{line}[/]", highlight=False, soft_wrap=True)

    if quiet:
        results, rec, written = run_tune(cfg, log, write=not no_write)
    else:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("tune"), BarColumn(), TextColumn("{task.completed}/{task.total} cases"),
                      TimeElapsedColumn(), console=err_console, transient=True) as bar:
            task = bar.add_task("tune", total=len(cfg.tokens) * (1 if packed else len(cfg.schemes)))
            results, rec, written = run_tune(cfg, lambda s: bar.console.print(f"[dim]{s}[/]", highlight=False, soft_wrap=True),
                                             lambda done, total: bar.update(task, completed=done), write=not no_write)
    if as_json:
        typer.echo(json.dumps({"cache": str(written) if written else None, "record": json.loads(rec.to_json()),
                               "ratios": {f"{r.layout} {r.act_mode} {r.tclass}": r.ratios for r in results}}, indent=1))
        return
    for r in results:
        console.print(f"{r.layout} {r.act_mode} {r.tclass}: {r.pick or 'default'}"
                      + (f" ({r.gain:.3f}x the default's speed)" if r.pick else "")
                      + f"  [dim]noise {r.noise:.3f}{'; ' + r.note if r.note else ''}[/]", highlight=False, soft_wrap=True)
    if written:
        console.print(f"wrote {written}: used by every later run on this machine and build", highlight=False, soft_wrap=True)
