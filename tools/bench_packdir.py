#!/usr/bin/env python3
"""Measure convert streaming and packed-directory opening on a large synthetic checkpoint.

    python tools/bench_packdir.py --gib 2.2 --work /tmp/moepack-bench

1. writes a synthetic dense bf16 Qwen3-MoE-style checkpoint of about --gib GiB (sharded),
2. converts it in a child process and reports wall time, MB/s and the child's peak RSS
   (convert streams one expert at a time, so the peak should be a fixed overhead, not the model),
3. opens the packed directory in a fresh child process and reports the open time and the RSS
   growth it caused, relative to the packed size (the shards are memory-mapped, not read),
4. runs one layer (T=1) and reports the RSS growth after that.
Each step runs in its own process so that RSS figures are its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# VmHWM (this process's own peak RSS; ru_maxrss can carry the parent's peak over fork+exec)
CHILD_CONVERT = r"""
import json, sys, time
import moepack
def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
moepack.load_extension()
base = hwm_kib()
t0 = time.perf_counter()
r = moepack.convert(sys.argv[1], sys.argv[2])
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "bytes": r.experts_bytes + r.other_bytes, "layers": r.layers,
                  "peak_rss_kib": hwm_kib(), "rss_before_kib": base}))
"""

CHILD_OPEN = r"""
import json, os, sys, time
import torch, moepack
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
moepack.load_extension()
r0 = rss()
t0 = time.perf_counter()
m = moepack.open(sys.argv[1])
t_open = time.perf_counter() - t0
r1 = rss()
layer = m.layers[sorted(m.layers)[0]]
x = torch.randn(1, layer.hidden_size, dtype=torch.bfloat16)
logits = torch.randn(1, layer.num_experts)
w, ids = torch.softmax(logits, -1).topk(min(8, layer.num_experts))
layer.experts(x, w.contiguous(), ids.int().contiguous())
r2 = rss()
print(json.dumps({"open_seconds": t_open, "rss_before": r0, "rss_after_open": r1, "rss_after_one_call": r2}))
"""


def make_checkpoint(path: Path, gib: float, seed: int = 0) -> int:
    import torch
    from safetensors.torch import save_file

    e, h, i, k = 64, 2048, 768, 8
    per_layer = 3 * e * h * i * 2
    layers = max(1, round(gib * 2**30 / per_layer))
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weight_map = {}
    total = 0
    for layer in range(layers):
        t = {}
        p = f"model.layers.{layer}.mlp"
        t[f"{p}.gate.weight"] = torch.randn(e, h, generator=g).bfloat16()
        for x in range(e):
            for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
                t[f"{p}.experts.{x}.{name}.weight"] = (torch.randn(shape, generator=g) * 0.02).bfloat16()
        fname = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(t, str(path / fname))
        total += sum(v.numel() * v.element_size() for v in t.values())
        weight_map.update({n: fname for n in t})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": h,
        "num_experts": e,
        "num_experts_per_tok": k,
        "moe_intermediate_size": i,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "num_hidden_layers": layers,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.2, help="size of the synthetic checkpoint")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moepack-bench-packdir"))
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args()
    src, dst = args.work / "src", args.work / "packed"
    shutil.rmtree(args.work, ignore_errors=True)
    t0 = time.perf_counter()
    total = make_checkpoint(src, args.gib)
    print(f"synthetic checkpoint: {total / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
    env = dict(os.environ)
    conv = json.loads(subprocess.run([sys.executable, "-c", CHILD_CONVERT, str(src), str(dst)], check=True, capture_output=True, text=True, env=env).stdout)
    mb_s = conv["bytes"] / 1e6 / conv["seconds"]
    print(
        f"convert: {conv['layers']} layers, {conv['bytes'] / 2**30:.2f} GiB in {conv['seconds']:.1f} s = {mb_s:.0f} MB/s; "
        f"peak RSS {conv['peak_rss_kib'] / 2**20:.2f} GiB ({conv['rss_before_kib'] / 2**20:.2f} GiB after importing torch)",
        flush=True,
    )
    op = json.loads(subprocess.run([sys.executable, "-c", CHILD_OPEN, str(dst)], check=True, capture_output=True, text=True, env=env).stdout)
    packed = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    grow_open = op["rss_after_open"] - op["rss_before"]
    grow_call = op["rss_after_one_call"] - op["rss_before"]
    print(
        f"open: {op['open_seconds'] * 1e3:.1f} ms for {packed / 2**30:.2f} GiB packed; RSS +{grow_open / 2**20:.1f} MiB "
        f"({100 * grow_open / packed:.2f}% of the packed size); after one T=1 call +{grow_call / 2**20:.1f} MiB",
        flush=True,
    )
    print(
        json.dumps(
            {
                "checkpoint_bytes": total,
                "packed_bytes": packed,
                "convert": conv,
                "convert_mb_per_s": mb_s,
                "open": op,
                "open_rss_growth_fraction": grow_open / packed,
            }
        )
    )
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
