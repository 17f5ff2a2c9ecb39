"""The >= 8 GB scale test of issue 12: a synthetic DeepSeek-V3-style checkpoint sharded like the
Hub's, converted, verified, opened and run, each step in its own child process whose peak RSS
(VmHWM of /proc/self/status, read by the child at its end) is reported; then kill -9 at three
points + resume, compared byte for byte with the uninterrupted convert.

    python3 tools/scale_test.py --root /work/scale-data/scale [--layers 21] [--experts 64] [--keep]

Not a test module (the suite has small versions: tests/sources/test_convert_resume.py). Writes
~2 x the source size of output under --root and deletes everything unless --keep. The source is
written one tensor at a time (the writer never holds a shard). Uses only public entry points
(moepack.convert / verify / open, the layer module), so it runs unchanged when verify changes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def config(layers: int, experts: int, hidden: int, inter: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": hidden,
        "intermediate_size": 4 * inter, "moe_intermediate_size": inter, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 1,
        "num_hidden_layers": layers, "hidden_act": "silu", "vocab_size": 1024, "rms_norm_eps": 1e-6,
    }  # fmt: skip


def tensor_list(cfg: dict) -> list[tuple[str, str, tuple]]:
    """(name, dtype, shape) of every tensor, in file order."""
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    out = [("model.embed_tokens.weight", "BF16", (cfg["vocab_size"], h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [(f"{p}.input_layernorm.weight", "BF16", (h,)), (f"{p}.post_attention_layernorm.weight", "BF16", (h,))]
        if layer < cfg["first_k_dense_replace"]:
            di = cfg["intermediate_size"]
            out += [(f"{p}.mlp.gate_proj.weight", "BF16", (di, h)), (f"{p}.mlp.up_proj.weight", "BF16", (di, h)),
                    (f"{p}.mlp.down_proj.weight", "BF16", (h, di))]  # fmt: skip
            continue
        out += [(f"{p}.mlp.gate.weight", "BF16", (e, h)), (f"{p}.mlp.gate.e_score_correction_bias", "F32", (e,))]
        for x in range(e):
            out += [(f"{p}.mlp.experts.{x}.gate_proj.weight", "BF16", (i, h)), (f"{p}.mlp.experts.{x}.up_proj.weight", "BF16", (i, h)),
                    (f"{p}.mlp.experts.{x}.down_proj.weight", "BF16", (h, i))]  # fmt: skip
        out += [(f"{p}.mlp.shared_experts.gate_proj.weight", "BF16", (i, h)), (f"{p}.mlp.shared_experts.up_proj.weight", "BF16", (i, h)),
                (f"{p}.mlp.shared_experts.down_proj.weight", "BF16", (h, i))]  # fmt: skip
    return out + [("model.norm.weight", "BF16", (h,))]


def write_checkpoint(path: Path, cfg: dict, shard_bytes: int) -> int:
    """model-0000N-of-0000M.safetensors + index + config.json, streamed: each tensor is a window
    of one random bf16 buffer (~0.03 scale), written as it is made."""
    import torch

    path.mkdir(parents=True)
    tl = tensor_list(cfg)
    size = {"BF16": 2, "F32": 4}
    shards, cur, cur_b = [], [], 0
    for t in tl:
        b = size[t[1]] * int(torch.Size(t[2]).numel())
        if cur and cur_b + b > shard_bytes:
            shards.append(cur)
            cur, cur_b = [], 0
        cur.append(t)
        cur_b += b
    shards.append(cur)
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(64 << 20, generator=g) * 0.03).to(torch.bfloat16)
    weight_map, total = {}, 0
    for si, ts in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        hdr, off = {"__metadata__": {"format": "pt"}}, 0
        for n, dt, shape in ts:
            b = size[dt] * int(torch.Size(shape).numel())
            hdr[n] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + b]}
            off += b
            weight_map[n] = fname
        js = json.dumps(hdr).encode()
        js += b" " * (-len(js) % 8)
        with open(path / fname, "wb") as f:
            f.write(struct.pack("<Q", len(js)) + js)
            for k, (n, dt, shape) in enumerate(ts):
                numel = int(torch.Size(shape).numel())
                if dt == "F32":
                    t = torch.zeros(numel) + 0.01 * k
                else:
                    start = (k * 7919) % (base.numel() - numel) if numel < base.numel() else 0
                    t = base[start : start + numel]
                f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
        total += off
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return total


# ---------------------------------------------------------------- child steps (own process each)
def _hwm() -> dict:
    st = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmHWM", "VmRSS"):
            st[k] = int(v.split()[0]) * 1024
    return st


def child(step: str, src: str, dst: str, arg: str) -> None:
    import torch

    import moepack

    out: dict = {"step": step}
    t = time.perf_counter()
    if step == "convert":
        kill_at = json.loads(arg) if arg else None
        seen = [0]

        def progress(ev, **kw):
            if kill_at and ev == kill_at[0]:
                seen[0] += 1
                if seen[0] == kill_at[1]:
                    os.kill(os.getpid(), signal.SIGKILL)

        r = moepack.convert(src, dst, progress=progress)
        out.update(seconds=r.seconds, experts_bytes=r.experts_bytes, other_bytes=r.other_bytes)
    elif step == "verify":
        r = moepack.verify(dst, source=src)
        out.update(ok=bool(r.ok), tensors=len(r.tensors), layers=len(r.layers))
    elif step == "verify_checksums":
        r = moepack.verify(dst)
        out.update(ok=bool(r.ok), tensors=len(r.tensors))
    elif step == "open":
        rss0 = _hwm()["VmRSS"]
        t0 = time.perf_counter()
        m = moepack.open(dst)
        out["open_s"] = time.perf_counter() - t0
        out["rss_growth"] = _hwm()["VmRSS"] - rss0
        layer = m.layers[sorted(m.layers)[0]] if isinstance(m.layers, dict) else m.layers[0]
        x = torch.randn(16, json.loads(Path(src, "config.json").read_text())["hidden_size"]).to(torch.bfloat16)
        t1 = time.perf_counter()
        y = layer(x)
        out["run_layer_s"] = time.perf_counter() - t1
        out["run_finite"] = bool(torch.isfinite(y.float()).all())
    out["wall_s"] = time.perf_counter() - t
    out.update(_hwm())
    print("RESULT " + json.dumps(out), flush=True)


def run_child(step: str, src: Path, dst: Path, arg: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--child", step, str(src), str(dst), arg], capture_output=True, text=True, env=env)
    res = {"step": step, "rc": p.returncode, "parent_wall_s": time.perf_counter() - t}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res.update(json.loads(line[7:]))
    if p.returncode not in (0, -signal.SIGKILL):
        res["stderr"] = p.stderr[-2000:]
    return res


def shard_digests(d: Path) -> dict:
    out = {}
    for f in sorted(d.iterdir()):
        if f.name == "moepack.json":
            continue
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while b := fh.read(64 << 20):
                h.update(b)
        out[f.name] = h.hexdigest()
    return out


def manifest_wo_time(d: Path) -> dict:
    m = json.loads((d / "moepack.json").read_text())
    m.pop("created_at")
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("/work/scale-data/scale"))
    ap.add_argument("--layers", type=int, default=21, help="decoder layers (the first is dense)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--shard-gib", type=float, default=3.0, help="source shard size")
    ap.add_argument("--no-resume-test", action="store_true")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    root = a.root
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    src, dst, dst2 = root / "src", root / "packed", root / "packed-resumed"
    results: dict = {"machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}}
    try:
        t = time.perf_counter()
        cfg = config(a.layers, a.experts, a.hidden, a.intermediate)
        total = write_checkpoint(src, cfg, int(a.shard_gib * 2**30))
        results["source"] = {"bytes": total, "files": sorted(p.name for p in src.iterdir()), "write_s": time.perf_counter() - t}
        print(json.dumps(results["source"]), flush=True)
        subprocess.run(["sync"])
        r = run_child("convert", src, dst)
        r["source_MB_per_s"] = total / 1e6 / r["seconds"]
        results["convert"] = r
        print(json.dumps(r), flush=True)
        pack = sum(f.stat().st_size for f in dst.iterdir())
        results["pack_bytes"] = pack
        for step in ("verify_checksums", "verify", "open"):
            r = run_child(step, src, dst)
            if step == "open":
                r["rss_growth_pct_of_pack"] = 100 * r.get("rss_growth", 0) / pack
            results[step] = r
            print(json.dumps(r), flush=True)
        if not a.no_resume_test:
            n_moe = a.layers - 1
            kills = []
            # counted within each run (a resumed run emits events only for what it writes): a kill
            # mid-shard, one right after a shard completes, one mid-shard after two resumes
            for point in (["layer_done", max(1, n_moe // 5)], ["shard_done", 1], ["layer_done", 2]):
                r = run_child("convert", src, dst2, json.dumps(point))
                left = sorted(p.name for p in root.iterdir() if ".tmp-" in p.name)
                kills.append({"point": point, "rc": r["rc"], "temps_left": left})
                print(json.dumps(kills[-1]), flush=True)
            r = run_child("convert", src, dst2) if not dst2.exists() else {"note": "the third run finished"}
            same = shard_digests(dst) == shard_digests(dst2) and manifest_wo_time(dst) == manifest_wo_time(dst2)
            v = run_child("verify_checksums", src, dst2)
            results["resume"] = {"kills": kills, "final": r, "byte_identical": same, "verify_ok": v.get("ok")}
            print(json.dumps(results["resume"]), flush=True)
    finally:
        results["machine"]["load_after"] = os.getloadavg()
        (Path("/tmp") / "scale_test_results.json").write_text(json.dumps(results, indent=1))
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:6])
    else:
        main()
