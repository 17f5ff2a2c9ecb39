"""Memory of ``moepack.load_model`` on a synthetic MoE model with GBs of experts (issue 13).

Writes a random qwen3_moe checkpoint in transformers' on-disk naming (one safetensors shard per
decoder layer, streamed, so this script never holds all the experts either), converts it with
``moepack convert``, then, in a CHILD process (a clean address space), reads /proc/self/status
(VmRSS, VmHWM = peak RSS, RssAnon = heap, RssFile = mapped file pages) after importing,
after loading and running the family's tiny fixture (so that lazily imported code is counted
before, not in, the big model's figures), after ``load_model``, after a 1-token forward (touches top_k experts per layer) and after a 64-token
forward (touches nearly all), and prints them against the expert and non-expert bytes.

    nice -n 10 python3 tools/measure_load_model.py --work /work/hf-big [--layers 8 --experts 64] [--keep]

The work directory is deleted at the end unless --keep. Results are a JSON line on stdout.
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

REPO = Path(__file__).resolve().parents[1]


def write_checkpoint(dst: Path, args) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(
        num_hidden_layers=args.layers, hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
        intermediate_size=args.intermediate, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
        num_attention_heads=16, num_key_value_heads=4, head_dim=args.hidden // 16, vocab_size=args.vocab,
        tie_word_embeddings=False, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    config = AutoConfig.for_model("qwen3_moe", **cfg)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    dst.mkdir(parents=True)
    config.dtype = torch.bfloat16
    config.save_pretrained(dst)
    gen = torch.Generator().manual_seed(0)

    def rnd(shape, fan_in):
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(torch.bfloat16)

    weight_map, sizes = {}, {"expert": 0, "other": 0}
    shards: dict[str, dict] = {}
    for name, p in meta.state_dict().items():
        if ".mlp.experts." in name:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        t = torch.ones(p.shape, dtype=torch.bfloat16) if name.endswith("norm.weight") else rnd(p.shape, p.shape[-1])
        shards.setdefault(layer, {})[name] = t
        sizes["other"] += t.numel() * 2
    h, i = args.hidden, args.intermediate
    for layer in range(args.layers):
        part = shards.pop(str(layer))
        for e in range(args.experts):
            pre = f"model.layers.{layer}.mlp.experts.{e}"
            part[f"{pre}.gate_proj.weight"] = rnd((i, h), h)
            part[f"{pre}.up_proj.weight"] = rnd((i, h), h)
            part[f"{pre}.down_proj.weight"] = rnd((h, i), i)
            sizes["expert"] += 3 * i * h * 2
        fname = f"model-{layer + 1:05d}-of-{args.layers + 1:05d}.safetensors"
        save_file(part, dst / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
        del part
    fname = f"model-{args.layers + 1:05d}-of-{args.layers + 1:05d}.safetensors"
    save_file(shards.pop("rest"), dst / fname, metadata={"format": "pt"})
    weight_map.update({n: fname for n in meta.state_dict() if not n.startswith("model.layers.")})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sizes


CHILD = r"""
import json, sys, time
def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out
import torch, moepack, moepack.hf, transformers
torch.set_num_threads(int(sys.argv[2]))
marks = {"imported": status()}
warm = moepack.load_model(sys.argv[3])  # the tiny fixture of the family: loads every code path once
with torch.no_grad():
    warm(torch.tensor([[5, 6]]))
del warm
marks["code warm (tiny model run)"] = status()
t = time.perf_counter(); model = moepack.load_model(sys.argv[1]); load_s = time.perf_counter() - t
marks["after load_model"] = status()
with torch.no_grad():
    t = time.perf_counter(); model(torch.tensor([[5]])); f1 = time.perf_counter() - t
    marks["after a 1-token forward"] = status()
    t = time.perf_counter(); model(torch.randint(3, 1000, (1, 64))); f64 = time.perf_counter() - t
    marks["after a 64-token forward"] = status()
print(json.dumps({"marks": marks, "load_s": load_s, "forward1_s": f1, "forward64_s": f64}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/work/hf-big"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    if args.work.exists():
        sys.exit(f"{args.work} exists: remove it or choose another --work")
    src, dst = args.work / "src", args.work / "packed"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1")
    try:
        t = time.perf_counter()
        sizes = write_checkpoint(src, args)
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "moepack", "convert", str(src), str(dst)], check=True, env=env,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        convert_s = time.perf_counter() - t
        shutil.rmtree(src)  # the child sees only the packed directory
        files = {p.name: p.stat().st_size for p in dst.glob("*.safetensors")}
        warm = args.work / "warm"
        subprocess.run([sys.executable, "-m", "moepack", "convert", str(REPO / "fixtures" / "qwen3_moe"), str(warm)],
                       check=True, env=env, stdout=subprocess.DEVNULL)  # fmt: skip
        r = subprocess.run([sys.executable, "-c", CHILD, str(dst), str(args.threads), str(warm)], check=True, env=env,
                           capture_output=True, text=True)  # fmt: skip
        child = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    mib = 2**20
    base = child["marks"]["code warm (tiny model run)"]
    print(f"synthetic qwen3_moe: {args.layers} layers, E={args.experts}, top_k={args.top_k}, H={args.hidden}, "
          f"I={args.intermediate}, vocab={args.vocab}, bf16")  # fmt: skip
    print(f"expert bytes {sizes['expert'] / mib:.0f} MiB (packed shards {sum(v for k, v in files.items() if k.startswith('experts')) / mib:.0f} MiB), "
          f"non-expert bytes {sizes['other'] / mib:.0f} MiB; write {write_s:.0f} s, convert {convert_s:.0f} s, "
          f"load_model {child['load_s']:.2f} s, forward 1 token {child['forward1_s']:.2f} s, 64 tokens {child['forward64_s']:.2f} s")  # fmt: skip
    for mark, st in child["marks"].items():
        print(f"  {mark:26s} VmRSS {st['VmRSS'] / mib:7.0f} MiB  VmHWM {st['VmHWM'] / mib:7.0f} MiB  "
              f"RssAnon {st['RssAnon'] / mib:7.0f} MiB  RssFile {st['RssFile'] / mib:7.0f} MiB  "
              f"(VmRSS - warm {(st['VmRSS'] - base['VmRSS']) / mib:7.0f} MiB)")  # fmt: skip
    print(json.dumps({"args": vars(args) | {"work": str(args.work)}, "sizes": sizes, "files": files, **child}))


if __name__ == "__main__":
    main()
