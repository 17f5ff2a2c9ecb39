"""``moepack convert``, ``moepack verify``, ``moepack inspect``: the packed directory commands."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .app import check_range, command, console, err_console

EXIT_MISMATCH = 1


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _quantize_help() -> str:
    """--quantize's help, from the scheme registry: every quantized scheme, its aliases and summary."""
    from moepack.schemes import schemes

    def alias(s) -> str:
        return f" (alias {', '.join(s.aliases)})" if s.aliases else ""

    listed = "; ".join(f"{s.name}{alias(s)}: {s.summary}" for s in schemes() if s.quantized)
    return (f"Quantize a float source's experts into a scheme. {listed}. Options may follow the name: int4:g64:asym, "
            "int4:ch, fp8:ch. A quantized source stays in its own scheme, never re-quantized.")


@command(help="Convert a Hugging Face MoE checkpoint directory SRC into a packed directory DST.")
def convert(
    src: Path = typer.Argument(..., help="Checkpoint directory: config.json + *.safetensors."),
    dst: Path = typer.Argument(..., help="Packed directory to create (must not exist unless --overwrite)."),
    target: str = typer.Option("auto", "--target", help="The CPU family the layouts are blocked for: x86, arm, or auto "
                               "(this machine's). Any family runs everywhere, through the scalar level off its own CPUs."),
    isa: Optional[str] = typer.Option(None, "--isa", hidden=True, help="The old spelling of --target."),
    quantize: Optional[str] = typer.Option(
        None, "--quantize", help=_quantize_help()
    ),
    group_size: Optional[int] = typer.Option(
        None, "--group-size", help="--quantize int4: K values per scale, 32, 64 or 128 (default), or -1 for one scale per "
        "output channel."
    ),
    asym: bool = typer.Option(False, "--asym", help="--quantize int4: asymmetric (scale and zero point from each group's "
                              "min and max, as W4A16_ASYM / AWQ) instead of symmetric (zero point 8)."),
    act_mode: Optional[str] = typer.Option(
        None, "--act-mode", help="Every layer's default activation mode: a16 or a8 (layouts that serve it: int4, mxfp4, nvfp4). "
        "Default: a16 (the checkpoint's meaning), a8 for a compressed-tensors W4A8 checkpoint."
    ),
    threads: Optional[int] = typer.Option(None, "--threads", help="Threads for packing, 1..1024 (default: torch's)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace DST if it exists (atomically)."),
    shard_gib: float = typer.Option(2.0, "--shard-gib", help="Largest shard file, in GiB (positive, finite)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary instead of tables."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree: pack each of N ranks' slice of every expert "
                           "contiguously (w13's gate/up rows, w2's input channels), for vLLM's tensor_parallel_size=N "
                           "(docs/VLLM.md). I/N must be a multiple of the layout's block (32) and group size."),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Continue a hard-killed convert to DST with the same plan from its last complete shard (default); --no-resume deletes its temporary directory and starts over."),
) -> None:
    from moepack.convert.run import convert as do_convert
    from moepack.errors import ConvertError
    from moepack.layout import LAYOUTS
    from moepack.layout import layout_get as moepack_layout_get

    from moepack.schemes import get_scheme

    from moepack.isa import resolve_target

    if isa is not None:  # the old spelling: same meaning
        if target != "auto" and target != isa:
            raise ConvertError(f"--isa {isa!r} and --target {target!r}: --isa is the old spelling of --target; give one")
        target = isa
    family = resolve_target(target)  # a bad value is refused first: one line, no note before it
    if isa is not None:
        err_console.print(f"note: --isa is now spelled --target (--target {isa})")
    # the family's layout for float weights kept as floats (a quantized source or --quantize picks its scheme's)
    family_layouts = [x for x in LAYOUTS if x.family == family and not get_scheme(x).quantized]
    if not family_layouts:
        fams = sorted({x.family for x in LAYOUTS})
        raise ConvertError(f"--target {target!r}: no float layout for that family in this build (available: {', '.join(fams)})")
    layout = family_layouts[0]
    if not (math.isfinite(shard_gib) and shard_gib > 0):
        raise ConvertError(f"--shard-gib {shard_gib}: must be positive and finite (the largest shard file, in GiB)")
    check_range("--tp", tp, 1, 1 << 16, "the tensor-parallel degree")
    quantize = _quantize_spec(quantize, group_size, asym)

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=as_json or not err_console.is_terminal,  # a stopped bar leaves a blank line on a pipe
    ) as bar:
        task = bar.add_task("planning", total=None)

        def progress(event: str, **info) -> None:
            if event == "plan":
                bar.update(task, description="packing layers", total=info["layers"], completed=0)
            elif event == "layer_start":
                bar.update(task, description=f"layer {info['layer']} ({info['num_experts']} experts)")
            elif event == "layer_done":
                bar.advance(task)
            elif event == "other_done":
                bar.update(task, description=f"copied {info['tensors']} other tensors")
            elif event == "resume":
                err_console.print(f"note: resuming the interrupted convert in {info['path']} (same plan; its finished shards are re-checked)", highlight=False)
            elif event == "tp_whole_reused":
                err_console.print(f"note: reslicing the whole pack an interrupted --tp convert left in {info['path']} (same plan; its bytes re-checked)", highlight=False)
            elif event == "tp_reshard":
                bar.update(task, description=f"writing each rank's slices (--tp {info['tp']})", total=None)
            elif event == "stale_removed":
                err_console.print(f"note: removed {info['path']}, left by an interrupted convert: {info['reason']}", highlight=False)

        report = do_convert(
            src, dst, layout=layout, quantize=quantize, overwrite=overwrite, threads=threads,
            shard_bytes=int(shard_gib * 2**30), progress=progress, act_mode=act_mode, resume=resume,
            **({"tp": tp} if tp != 1 else {}),
        )  # fmt: skip
    layout = moepack_layout_get(report.layout or layout.name)

    summary = {
        "dst": str(report.dst),
        "layers": report.layers,
        "layout": layout.name,
        "scheme": report.scheme,
        "quantizer": report.quantize,
        "quant_error": report.quant_error,  # ||dequant(q) - w|| / ||w|| of the weights quantized here
        "quant_error_worst_layer": list(report.quant_error_worst) if report.quant_error_worst else None,
        "act_modes": report.act_modes,
        "shared_float_layers": report.shared_float,  # a quantized source's float shared experts, kept float
        "shared_layout": report.shared_layout or None,
        "shared_quantizer": report.shared_quantize,  # --quantize on those float shared experts
        "expert_bytes": report.experts_bytes,
        "other_bytes": report.other_bytes,
        "seconds": round(report.seconds, 3),
        "mb_per_s": round(report.mb_per_s, 1),
        "files": report.files,
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    t = Table(title=f"moepack convert → {report.dst}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("MoE layers", str(report.layers))
    t.add_row("layout", layout.name)
    t.add_row("act mode", ", ".join(report.act_modes) or "-")
    if report.quantize:
        t.add_row("quantized", report.quantize)
    if report.shared_float:
        t.add_row("shared experts", f"float in the source: kept float, layout {report.shared_layout} (layers "
                  f"{', '.join(map(str, report.shared_float))}); --quantize {report.scheme} would quantize them")  # fmt: skip
    if report.shared_quantize:
        t.add_row("shared experts", f"float in the source: quantized as asked ({report.shared_quantize})")
    if report.quant_error is not None:
        worst = report.quant_error_worst
        t.add_row("weight error", f"{report.quant_error:.3g} (||dequant - w|| / ||w||"
                  + (f"; worst layer {worst[0]}: {worst[1]:.3g}" if worst else "") + "; moepack verify --source judges the output)")
    t.add_row("packed experts", _human(report.experts_bytes))
    t.add_row("other tensors", _human(report.other_bytes))
    t.add_row("files", ", ".join(report.files))
    t.add_row("time", f"{report.seconds:.2f} s ({report.mb_per_s:.0f} MB/s)")
    console.print(t)


def _quantize_spec(quantize: str | None, group_size: int | None, asym: bool) -> str | None:
    """--quantize with --group-size / --asym folded in as options ("int4" + 64 + asym ->
    "int4:g64:asym"); the scheme refuses options it does not take (moepack.convert.run.parse_quantize)."""
    from moepack.errors import ConvertError

    words = []
    if group_size is not None:
        words.append("ch" if group_size == -1 else f"g{group_size}")
    if asym:
        words.append("asym")
    if words and quantize is None:
        raise ConvertError(f"--group-size / --asym ({' '.join(words)}) quantize float weights: give --quantize int4 with them")
    return quantize if not words else ":".join([quantize, *words])


@command(help="Verify a packed directory: checksums of every tensor; with --source, the whole model (MoE layers, experts, "
              "routing, carried-over tensors), the weights and the outputs against the source, one block of experts at a time.")
def verify(
    dst: Path = typer.Argument(..., help="Packed directory."),
    source: Optional[Path] = typer.Option(None, "--source", help="The checkpoint DST was converted from."),
    tokens: int = typer.Option(7, "--tokens", help="Seeded random tokens per layer for the output check (1..65536)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    from rich.markup import escape

    from moepack.verify.run import verify as do_verify

    from moepack.bench.shapes import MAX_TOKENS

    check_range("--tokens", tokens, 1, MAX_TOKENS, "tokens per layer")
    report = do_verify(dst, source=source, tokens=tokens)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        bad = [t for t in report.tensors if not t.ok]
        console.print(
            f"checksums: {len(report.tensors) - len(bad)}/{len(report.tensors)} tensors match the manifest",
            style="green" if not bad else "red",
        )
        for t_ in bad:
            console.print(f"  [red]MISMATCH[/] {t_.name} ({t_.file}): {escape(t_.detail)}", highlight=False)
        console.print(f"values: {report.values_checked} packed expert tensors checked against their value rules "
                      "(scales, e8m0 scales, zero points, column sums, permutations, float weights, fp8 codes and biases)", highlight=False)  # fmt: skip
        badf = [f for f in report.files if not f.ok]
        unsummed = [f for f in report.files if f.ok and f.detail]
        console.print(
            f"carried files: {len(report.files) - len(badf)}/{len(report.files)} present and intact"
            + (f" ({len(unsummed)} without a recorded checksum: presence only)" if unsummed else ""),
            style="green" if not badf else "red", highlight=False,
        )  # fmt: skip
        for f_ in badf:
            console.print(f"  [red]MISMATCH[/] {escape(f_.name)}: {escape(f_.detail)}", highlight=False)
        if report.source is not None:
            console.print(
                "model: the same MoE layers, experts, routing and carried-over tensors as the source"
                if not report.model else f"model: {len(report.model)} difference(s) from the source",
                style="green" if not report.model else "red",
            )
            for line in report.model:
                console.print(f"  [red]DIFFERS[/] {escape(line)}", highlight=False)
        for line in report.notes:  # a deliberate --act-mode, an unsealed (older) manifest
            console.print(f"  [yellow]note:[/] {escape(line)}", highlight=False)
        if report.layers:
            if report.fingerprint_match is False:
                err_console.print("[yellow]note:[/] the source's fingerprint differs from the one recorded at convert time")
            (eq, n), (seq, sn) = report.weights_checked(), report.weights_checked(shared=True)
            console.print(
                f"weights: {eq}/{n} packed expert tensors equal the source" + (f" (shared experts: {seq}/{sn})" if sn else ""),
                style="green" if eq == n else "red",
            )
            t = Table(title=f"layers against {report.source}")
            # the columns each scheme's checks fill (LayerCheck: what the weights were compared as, the
            # fp32 rule of schemes judged against the source's float weights too)
            fp32 = any(c.rel_err_fp32 is not None for c in report.layers)
            shared = any(c.shared_exact is not None for c in report.layers)
            what = sorted({c.weights for c in report.layers if c.weights})
            cols = ["layer", f"weights == source ({', '.join(what) or 'values'})"]
            cols += ["shared expert == source"] if shared else []
            for col in cols + ["act mode", "output rel. error", "tolerance"] + (["vs fp32 reference on the source (tolerance)"] if fp32 else []) + ["result"]:
                t.add_column(col)
            yes_no = {True: "yes", False: "[red]no[/]", None: "-"}
            for c in report.layers:
                t.add_row(
                    str(c.index),
                    yes_no[c.weights_exact],
                    *([yes_no[c.shared_exact]] if shared else []),
                    c.act_mode or "-",
                    f"{c.rel_err:.2e}",
                    f"{c.tol:.1e}" if c.tol != float(f"{c.tol:.0e}") else f"{c.tol:.0e}",
                    *(["-" if c.rel_err_fp32 is None else f"{c.rel_err_fp32:.2e} ({c.fp32_tol:g})"] if fp32 else []),
                    "[green]ok[/]" if c.ok else "[red]FAIL[/]",
                )
            console.print(t)
            for c in report.layers:  # a widened tolerance is never silent
                if c.tol_base is not None and c.tol > c.tol_base:
                    console.print(f"  note: layer {c.index}: tolerance {c.tol:.2e} (base {c.tol_base:g}) widened by the "
                                  f"{c.act_mode} reference's intermediate-code flips (rounding ties it cannot decide)",
                                  highlight=False)  # fmt: skip
            for c in report.layers:  # on lines of their own: a table cell would cut tensor names short
                if not c.ok:
                    console.print(f"  [red]FAIL[/] layer {c.index}: {escape(c.detail)}", highlight=False)
    if not report.ok:
        raise typer.Exit(EXIT_MISMATCH)


@command(help="Show a packed directory: layers, experts, layouts, bytes, and which kernel runs here and why.")
def inspect(
    dst: Path = typer.Argument(..., help="Packed directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    import moepack
    from moepack.schemes import get_scheme

    model = moepack.open(dst)
    m = model.manifest
    layers = []
    for idx in sorted(model.layers):
        layer = model.layers[idx]
        p = layer.packed
        isa, reason = layer.kernel
        layers.append(
            {
                "index": idx,
                "experts": p.num_experts,
                "hidden": p.hidden,
                "intermediate": p.intermediate,
                "padded_intermediate": p.padded_intermediate,  # a --tp pack: one slice's
                "tp": p.tp,  # convert --tp: the experts are stored as tp slices of I/tp channels
                "activation": layer.activation,
                "layout": p.layout.name,
                "act_mode": layer.act_mode,
                "act_mode_recorded": layer.entry.get("act_mode"),
                "act_order": p.w13_perm is not None,
                "scheme": get_scheme(p.layout).name,
                "quantized": get_scheme(p.layout).quantized,
                "scheme_source": layer.entry.get("scheme_source"),
                "quantizer": layer.entry.get("quantizer"),  # the quantizer convert ran on float weights, with its options
                # the shared expert: the layer's layout, or its own (a quantized checkpoint's float one, kept float)
                "shared": None if layer.shared is None else {
                    "layout": layer.shared.layout.name,
                    "scheme": get_scheme(layer.shared.layout).name,
                    "own_layout": layer.shared.layout is not p.layout,
                    "scheme_source": (layer.entry.get("shared") or {}).get("scheme_source"),
                    "quantizer": (layer.entry.get("shared") or {}).get("quantizer"),
                    "bytes": layer.shared.nbytes,
                    "kernel": moepack.kernel_choice(layer.shared.layout, layer.shared_act_mode(None)).isa,
                },
                "bytes": p.nbytes,
                "kernel": isa,
                "reason": reason,
            }
        )
    out = {
        "path": str(dst),
        "format_version": m["format_version"],
        "created_by": m.get("created_by"),
        "model_type": m["model"].get("model_type"),
        "source": m["source"],
        "routing": m.get("routing"),
        "routing_note": m.get("routing_note"),
        "files": m["files"],
        "layers": layers,
    }
    if as_json:
        typer.echo(json.dumps(out, indent=2))
        return
    console.print(
        f"[bold]{dst}[/]: {out['model_type']} packed by {out['created_by']}, format v{out['format_version']}, "
        f"source reader {m['source'].get('reader')}",
        highlight=False,
    )
    if m.get("tp", 1) > 1:
        console.print(f"tensor parallel: --tp {m['tp']}: each expert stored as {m['tp']} slices of I/{m['tp']} channels, "
                      f"one contiguous run per rank (I (padded) shows one slice's padding)", highlight=False)  # fmt: skip
    r = out["routing"]
    console.print(f"routing: {json.dumps(r) if r else 'none (' + str(out['routing_note']) + ')'}", highlight=False)
    t = Table()
    for col in ("layer", "experts", "H", "I (padded)", "activation", "layout", "act mode", "scheme", "bytes", "kernel"):
        t.add_column(col)
    for x in layers:
        t.add_row(
            str(x["index"]),
            str(x["experts"]),
            str(x["hidden"]),
            f"{x['intermediate']} ({x['padded_intermediate']})",
            x["activation"],
            x["layout"],
            x["act_mode"] + (" (act-order)" if x["act_order"] else ""),
            x["scheme"],
            _human(x["bytes"]),
            x["kernel"],
        )
    console.print(t)
    for layout_name, reason in sorted({(x["layout"], x["reason"]) for x in layers}):
        console.print(f"kernel for {layout_name}: {reason}", highlight=False)
    for mode in sorted({x["act_mode"] for x in layers}):
        which = [str(x["index"]) for x in layers if x["act_mode"] == mode]
        console.print(f"act mode {mode}: layers {', '.join(which)}", highlight=False)
    act_order = [str(x["index"]) for x in layers if x["act_order"]]
    if act_order:
        console.print(f"act-order (w13_perm): layers {', '.join(act_order)}", highlight=False)
    for note in sorted({x["scheme_source"] for x in layers if x["scheme_source"] and x["quantized"]}):
        console.print(f"weights: {note}", highlight=False)
    own = {}  # shared experts in their own layout: float ones of a quantized checkpoint, kept float
    for x in layers:
        if x["shared"] and x["shared"]["own_layout"]:
            own.setdefault((x["shared"]["layout"], x["shared"]["scheme_source"], x["shared"]["kernel"]), []).append(str(x["index"]))
    for (lname, note, isa), which in sorted(own.items()):
        console.print(f"shared experts: layout {lname} ({note}): layers {', '.join(which)}; kernel {isa}", highlight=False)
    for q in sorted({x["shared"]["quantizer"] for x in layers if x["shared"] and x["shared"]["quantizer"]}):
        console.print(f"shared experts: quantizer {q} (--quantize, on the checkpoint's float shared experts)", highlight=False)
    skipped = m["source"].get("skipped")
    if isinstance(skipped, dict) and skipped.get("tensors"):
        console.print(f"skipped: {len(skipped['tensors'])} source tensors ({skipped.get('why')})", highlight=False)
    for q in sorted({x["quantizer"] for x in layers if x["quantizer"]}):
        console.print(f"quantizer: {q} (moepack verify --source reports its error)", highlight=False)
    total = sum(v["size"] for v in m["files"].values())
    console.print(f"{len(m['files'])} files, {_human(total)}", highlight=False)


@command(help="Run every MoE layer of a packed directory on seeded random tokens (its own router) and print the results.")
def run(
    dst: Path = typer.Argument(..., help="Packed directory."),
    tokens: int = typer.Option(4, "--tokens", help="Tokens per layer (1..65536)."),
    dtype: str = typer.Option("bf16", "--dtype", help="Activation dtype: bf16, fp16 or fp32."),
    layer: Optional[int] = typer.Option(None, "--layer", help="Run only this layer index."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random tokens."),
    act_mode: Optional[str] = typer.Option(
        None, "--act-mode", help="Activation mode of this run, a16 or a8 (layouts that serve it); default: each layer's own."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    import time

    import torch

    import moepack

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype not in dtypes:
        raise ValueError(f"--dtype {dtype!r}: must be one of {', '.join(dtypes)}")
    from moepack.bench.shapes import MAX_TOKENS

    check_range("--tokens", tokens, 1, MAX_TOKENS, "tokens per layer")
    if act_mode is not None and act_mode not in ("a16", "a8"):
        raise ValueError(f"--act-mode {act_mode!r}: must be a16 or a8")
    model = moepack.open(dst)
    indices = sorted(model.layers) if layer is None else [layer]
    if layer is not None and layer not in model.layers:
        raise ValueError(f"--layer {layer}: not a MoE layer of {dst} (MoE layers: {sorted(model.layers)})")
    g = torch.Generator().manual_seed(seed)
    rows = []
    for idx in indices:
        mod = model.layers[idx]
        from moepack.runtime.experts import resolve_act_mode

        mode = resolve_act_mode(mod.packed.layout, act_mode, mod.packed.act_mode)  # refuses a mode the layout lacks
        x = torch.randn(tokens, mod.hidden_size, generator=g).to(dtypes[dtype])
        logits = mod.router_logits(x)
        weights, ids = mod.route(logits, x)
        t0 = time.perf_counter()
        out = mod(x, logits, act_mode=mode)
        ms = (time.perf_counter() - t0) * 1e3
        rows.append(
            {
                "layer": idx,
                "routing": mod.routing.method if mod.routing else None,
                "token0_experts": ids[0].tolist(),
                "token0_weights": [round(float(v), 4) for v in weights[0]],
                "shared_expert": mod.shared is not None,
                "out_shape": list(out.shape),
                "out_dtype": str(out.dtype).replace("torch.", ""),
                "token0_out_head": [round(float(v), 4) for v in out[0, :4].float()],
                "out_rms": float(out.float().pow(2).mean().sqrt()),
                "ms": round(ms, 3),
                "act_mode": mode,
                "kernel": moepack.kernel_choice(mod.packed.layout, mode).isa,
            }
        )
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    t = Table(title=f"{dst}: {tokens} random tokens per layer ({dtype})")
    for col in ("layer", "routing", "token 0 → experts (weights)", "shared", "out[0, :4]", "rms", "ms", "act mode", "kernel"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            str(r["layer"]),
            str(r["routing"]),
            ", ".join(f"{e} ({w})" for e, w in zip(r["token0_experts"], r["token0_weights"])),
            "yes" if r["shared_expert"] else "no",
            " ".join(f"{v:+.4f}" for v in r["token0_out_head"]),
            f"{r['out_rms']:.4f}",
            f"{r['ms']:.2f}",
            r["act_mode"],
            r["kernel"],
        )
    console.print(t)
