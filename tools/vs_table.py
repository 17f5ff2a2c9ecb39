#!/usr/bin/env python3
"""The whole "moepack ÷ vLLM" table of docs/BENCH.md on any host, in one command.

    python tools/vs_table.py --out DIR [--engine vllm] [--threads 2] [--decode-shapes ...] [--prefill-shape ...]

Runs ``moepack bench --vs ENGINE`` once per (scheme, act mode) at decode (T=1 and 8 on the three
bench shapes) and once at prefill (T=512 on qwen3-30b-a3b), each in its own process (the bench
re-runs itself in the engine's venv when the engine is not importable here: MOEPACK_VLLM_PYTHON or
build/vllm-venv), writes every run's JSON into DIR, and prints the table as Markdown: each cell
is the engine's median time / moepack's (above 1: moepack faster), T=1 / T=8 per shape.

The kernel variants this host's tune picked apply (moepack/variants.py): run ``moepack tune``
first, or set MOEPACK_TUNE=0 for the build's defaults (a before/after pair: two DIRs, then
``moepack bench --compare`` on any pair of JSON files).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = [("dense", None, "bf16"), ("int8_channel", None, "int8 W8A8"), ("int4_group", "a8", "int4 W4A8"),
        ("int4_group", "a16", "int4 W4A16"), ("fp8_block", None, "fp8 W8A16"), ("mxfp4", "a16", "mxfp4 W4A16"),
        ("mxfp4", "a8", "mxfp4 W4A8")]


def run_one(out: Path, name: str, scheme: str, mode: str | None, shapes: str, tokens: str, engine: str, threads: int) -> dict:
    path = out / f"{name}.json"
    if not path.is_file():
        cmd = [sys.executable, "-m", "moepack", "bench", "--vs", engine, "--shapes", shapes, "--tokens", tokens,
               "--scheme", scheme, "--threads", str(threads), "--no-probe", "--json", str(path), "-q"]
        if mode:
            cmd += ["--act-mode", mode]
        print("$ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr)  # its own table: to stderr
    return json.loads(path.read_text())


def ratios(rec: dict, engine: str) -> dict[tuple[str, int], float]:
    out = {}
    for row in rec["rows"]:
        for v in row.get("vs") or []:
            if v.get("engine") == engine and v.get("ratio") is not None:
                out[(row["shape"], int(row["tokens"]))] = float(v["ratio"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the JSON files (a file already there is reused)")
    ap.add_argument("--engine", default="vllm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-shapes", default="qwen3-30b-a3b,gpt-oss-20b,mixtral-8x7b")
    ap.add_argument("--prefill-shape", default="qwen3-30b-a3b")
    ap.add_argument("--rows", default=",".join(r[2] for r in ROWS), help="which rows, by their label")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    want = {x.strip() for x in a.rows.split(",")}
    shapes = a.decode_shapes.split(",")
    head = "| moepack ÷ " + a.engine + " | " + " | ".join(f"{s} T=1 / 8" for s in shapes) + f" | {a.prefill_shape} T=512 |"
    lines = [head, "|" + "---|" * (len(shapes) + 2)]
    for scheme, mode, label in ROWS:
        if label not in want:
            continue
        stem = f"{scheme}_{mode or 'default'}"
        dec = ratios(run_one(a.out, stem + "_dec", scheme, mode, a.decode_shapes, "1,8", a.engine, a.threads), a.engine)
        pre = ratios(run_one(a.out, stem + "_512", scheme, mode, a.prefill_shape, "512", a.engine, a.threads), a.engine)
        cells = []
        for s in shapes:
            r1, r8 = dec.get((s, 1)), dec.get((s, 8))
            cells.append(" / ".join("-" if r is None else f"{r:.2f}" for r in (r1, r8)))
        p = pre.get((a.prefill_shape, 512))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {'-' if p is None else f'{p:.2f}'} |")
    machine = ""
    for f in sorted(a.out.glob("*.json")):
        m = json.loads(f.read_text()).get("machine") or {}
        machine = f"{m.get('cpu_model', '?')}, {m.get('threads', a.threads)} threads, {m.get('host_isa', '?')}"
        break
    print(f"Machine: {machine}. Tuned: {os.environ.get('MOEPACK_TUNE', '1') != '0'} (MOEPACK_TUNE).\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
