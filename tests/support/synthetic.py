"""The synthetic checkpoint of the convert-streaming and open-memory tests (tests/sources/test_convert.py,
tests/container/test_open.py; not a test module), and the child process those tests measure peak RSS in: a dense BF16 Qwen3-MoE-style checkpoint of ~190 MB.
The session fixtures ``synthetic_checkpoint`` / ``synthetic_packed`` (tests/conftest.py) write it
and convert it once per test session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

BF16 = torch.bfloat16

SYNTH = {"layers": 5, "experts": 16, "hidden": 1024, "intermediate": 384}


def write_synthetic_checkpoint(path: Path, *, layers: int, experts: int, hidden: int, intermediate: int, seed: int = 0) -> int:
    """A dense BF16 Qwen3-MoE-style checkpoint, one safetensors shard per layer + index (like
    tools/bench_packdir.py's make_checkpoint, at a size a test can afford). Returns its tensor bytes."""
    from safetensors.torch import save_file

    e, h, i = experts, hidden, intermediate
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    # Cheap distinct weights: windows of one random buffer (randn of the whole model is slow).
    base = (torch.randn(max(1 << 20, h * i) + 4096, generator=g) * 0.03).to(BF16)
    weight_map, total = {}, 0
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp"
        t = {f"{p}.gate.weight": torch.randn(e, h, generator=g).to(BF16)}
        for x in range(e):
            for k, (proj, shape) in enumerate((("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))):
                off = (layer * 977 + x * 131 + k * 17) % 4096
                t[f"{p}.experts.{x}.{proj}.weight"] = base[off : off + shape[0] * shape[1]].reshape(shape).clone()
        fname = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(t, str(path / fname), metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in t.values())
        weight_map.update(dict.fromkeys(t, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": h,
        "num_experts": e,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": i,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "num_hidden_layers": layers,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return total


def mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


REPO = Path(__file__).resolve().parents[2]

# The child's own peak RSS: VmHWM of /proc/self/status, reset after the setup through
# /proc/self/clear_refs where the kernel allows it. NOT getrusage's ru_maxrss: Linux carries the
# PARENT's peak over fork+exec into it, so a child of this (large) pytest process would report
# pytest's size.
_CHILD = """
import json, sys, time

def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])

import torch
torch.set_num_threads(2)  # per-thread stacks and arenas of a many-core CI box are not the model
import moepack
moepack.load_extension()
{setup}
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    reset = True
except OSError:
    reset = False
base = status_kib("VmRSS")
{measured}
print(json.dumps(dict(result, base_kib=base, hwm_kib=status_kib("VmHWM"), reset=reset)))
"""


def peak_rss_child(setup: str, measured: str, args: list, timeout: float) -> dict:
    """Run ``setup`` (imports: before the baseline) then ``measured`` (which sets ``result``, a
    dict) in a child python with ``args`` as sys.argv[1:]; returns ``result`` plus ``base_kib``
    (RSS after the setup), ``hwm_kib`` (peak RSS) and ``reset`` (whether VmHWM was reset)."""
    code = _CHILD.format(setup=textwrap.dedent(setup).strip(), measured=textwrap.dedent(measured).strip())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
