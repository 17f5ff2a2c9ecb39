#!/usr/bin/env python3
"""Load and speed of vLLM + moepack against vLLM's own CPU experts (docs/VLLM.md "Measure").

One command (the lead runs it on a quiet machine)::

    MOEPACK_VLLM_PYTHON=build/vllm-venv/bin/python PYTHONPATH=$PWD \\
        python3 tools/vllm_load_speed.py --layers 4 --out build/vllm-bench

What it does:

1. writes a synthetic Qwen3-MoE checkpoint (seeded random bf16 weights) with qwen3-30b-a3b's
   expert shapes (hidden 2048, moe_intermediate 768, 128 experts, top-8, 32 query / 4 KV heads
   of 128) and ``--layers`` layers, a vocabulary of ``--vocab``; converts it with moepack into a
   bf16, an int8 (``--quantize int8``) and an int4 (``--quantize int4``, group 128) pack;
2. runs each configuration in its own vLLM engine (``MOEPACK_VLLM_PYTHON``), in-process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model lives in the measured process):
   ``own-bf16`` is vLLM loading the source checkpoint with its own CPU experts (it repacks them
   at load), ``moepack-<scheme>`` is vLLM + moepack on the pack. vLLM has no CPU path for a
   bf16 source quantized at load to int8/int4 (its int8/int4 CPU experts need a quantized
   checkpoint: compressed-tensors W8A8 / W4A16), so int8 and int4 run with moepack only and
   the table says so;
3. per run: load (``LLM(...)`` wall time, vLLM's "Loading weights took" line, the process's RSS
   before / after the engine is built and its peak, next to the size of the experts' bytes),
   decode tokens/s at batch 1 (one prompt of 16 tokens, ``--decode`` new tokens, the time of a
   1-token run subtracted) and prefill tokens/s (``--prefill-prompts`` prompts of
   ``--prefill-len`` tokens, 1 new token each, one batch). Greedy, ``ignore_eos``, token-id
   prompts, best of ``--repeat`` timings.

Prints one table and writes ``results.json`` under ``--out``. Timings on a machine shared with
other work are indicative only. ``--same-process ROUNDS`` builds each pair of engines (vLLM's own
experts and vLLM + moepack on the same weights) in one process and alternates their calls
instead (``same_process.json``): separate processes meet the machine's read rate in different
phases, more than the engines differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DRIVER = r'''
import json, os, re, resource, sys, time


def rss_mb():
    with open("/proc/self/status") as f:
        d = dict(l.split(":", 1) for l in f if ":" in l)
    return int(d["VmRSS"].split()[0]) / 1024, int(d["VmHWM"].split()[0]) / 1024


def main(a):
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    r0, _ = rss_mb()
    kw = dict(skip_tokenizer_init=True, max_model_len=a["max_len"], dtype="bfloat16", max_num_seqs=max(4, a["prefill_prompts"]),
              max_num_batched_tokens=max(a["max_len"], a["prefill_len"] * a["prefill_prompts"]), seed=0)
    if a["quant"]:
        kw["quantization"] = a["quant"]
    t0 = time.time()
    llm = LLM(a["model"], **kw)
    load_s = time.time() - t0
    r1, hwm = rss_mb()
    g = torch.Generator().manual_seed(0)
    V = a["vocab"]

    def run(prompts, n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, detokenize=False, ignore_eos=True)
        t = time.time()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return time.time() - t, [list(o.outputs[0].token_ids) for o in outs]

    short = [torch.randint(0, V, (16,), generator=g).tolist()]
    long = [torch.randint(0, V, (a["prefill_len"],), generator=g).tolist() for _ in range(a["prefill_prompts"])]
    run(short, 4)  # warm-up
    first_s, _ = run(long, 1)  # the first prefill: every expert's first touch (page faults) included
    dec, pre, toks = [], [], None
    for _ in range(a["repeat"]):
        t1, _ = run(short, 1)
        tn, toks = run(short, a["decode"] + 1)
        dec.append(a["decode"] / max(tn - t1, 1e-9))
        tp, _ = run(long, 1)
        pre.append(a["prefill_len"] * a["prefill_prompts"] / tp)
    r2, hwm2 = rss_mb()
    pmd = mrss = 0  # how the pack's mapped expert pages are backed by now: 2 MiB (FilePmdMapped) of all (Rss)
    cur = None
    for line in open("/proc/self/smaps").read().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            cur = line
        elif cur and "experts-" in cur and line.startswith(("FilePmdMapped:", "Rss:")):
            n = int(line.split()[1]) // 1024
            pmd, mrss = (pmd + n, mrss) if line.startswith("FilePmdMapped") else (pmd, mrss + n)
    experts_ms = experts_dec = None
    if a["profile"]:  # one more prefill and one more decode under torch.profiler: the experts' op time in the engine
        from torch.profiler import ProfilerActivity, profile

        def ops(prof) -> dict:
            ev = {e.key: e for e in prof.key_averages()}
            return {k: {"ms": e.self_cpu_time_total / 1e3, "calls": e.count} for k, e in ev.items()
                    if re.search(r"fused_experts|fused_moe|moepack_vllm", k) and e.self_cpu_time_total > 0}

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t_prof, _ = run(long, 1)
        experts_ms = ops(prof)
        experts_ms["prefill_ms"] = t_prof * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t_prof, _ = run(short, a["decode"] + 1)
        experts_dec = ops(prof)
        experts_dec["decode_ms"] = t_prof * 1e3
    print("RESULT " + json.dumps({"load_s": load_s, "threads": torch.get_num_threads(), "rss0_mb": r0, "rss_loaded_mb": r1, "peak_loaded_mb": hwm,
                                  "rss_end_mb": r2, "peak_end_mb": hwm2, "decode_tok_s": max(dec), "prefill_tok_s": max(pre),
                                  "prefill_first_tok_s": a["prefill_len"] * a["prefill_prompts"] / first_s,
                                  "mapped_experts_mb": mrss, "mapped_experts_2m_mb": pmd,
                                  "decode_all": dec, "prefill_all": pre, "experts_ops": experts_ms,
                                  "experts_ops_decode": experts_dec, "tokens": toks}), flush=True)


main(json.loads(sys.argv[1]))
'''


# --kernel-ab: one MoE layer, the kernels alone, calls alternating in one process (fair under load)
KERNEL_AB = r'''
import ctypes, dataclasses, json, re, statistics, sys, time
import torch

torch._C._cpu._init_amx()  # vLLM's worker asks for AMX state before its kernels run; so does this
import moepack
import vllm._custom_ops as vops
from moepack._ops import load_extension
from moepack.runtime.experts import run_experts
from safetensors import safe_open

a = json.loads(sys.argv[1])
load_extension()
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def small_pages(t):  # an anonymous copy kept on 4 KiB pages (MADV_NOHUGEPAGE before the first touch)
    out = torch.empty(t.numel() * t.element_size() + 8192, dtype=torch.uint8)
    lo = (out.data_ptr() + 4095) & ~4095
    libc.madvise(lo, (out.numel() - (lo - out.data_ptr())) & ~4095, 15)
    off = lo - out.data_ptr()
    v = out[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    v.copy_(t)
    return v


packed = moepack.open(a["pack"]).layers[0].packed
E, H = packed.num_experts, packed.hidden
pmd = rss = 0
cur = None
for k, t in packed.tensors.items():
    t.view(torch.uint8).reshape(-1)[::4096].sum()  # fault the mapping in before reading smaps
for line in open("/proc/self/smaps").read().splitlines():
    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
        cur = line
    elif cur and "experts-" in cur and line.startswith(("FilePmdMapped", "Rss")):
        n = int(line.split()[1])
        pmd, rss = (pmd + n, rss) if line.startswith("FilePmdMapped") else (pmd, rss + n)
variants = {"moepack mapped": packed,
            "moepack 4K anon": dataclasses.replace(packed, tensors={k: small_pages(v) for k, v in packed.tensors.items()}),
            "moepack 2M anon": dataclasses.replace(packed, tensors={k: torch.ops.moepack.huge_page_copy(v) for k, v in packed.tensors.items()})}
f = safe_open(a["src_file"], "pt")
p = "model.layers.0.mlp.experts."
w13 = torch.stack([torch.cat([f.get_tensor(f"{p}{e}.gate_proj.weight"), f.get_tensor(f"{p}{e}.up_proj.weight")]) for e in range(E)])
w2 = torch.stack([f.get_tensor(f"{p}{e}.down_proj.weight") for e in range(E)])
w13p, w2p = vops.cpu_prepack_moe_weight(w13, "amx"), vops.cpu_prepack_moe_weight(w2, "amx")
del w13, w2


def own(x, tw, ti):  # what vLLM 0.32's engine runs for bf16 experts on AMX hosts (CPUUnquantizedExperts, isa amx)
    out = torch.empty_like(x)
    vops.cpu_fused_moe(out, x, w13p, w2p, None, None, tw, ti, "silu", "amx")
    return out


fns = {"vLLM cpu_fused_moe amx": own, **{n: (lambda pk: lambda x, w, i: run_experts(pk, x, w, i))(pk) for n, pk in variants.items()}}
print("RESULT " + json.dumps({"threads": torch.get_num_threads(), "mapped_rss_kb": rss, "mapped_pmd_kb": pmd}), flush=True)
g = torch.Generator().manual_seed(0)
for T in a["tokens"]:
    x = (torch.randn(T, H, generator=g) * 0.5).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    logits[:, a["route_experts"]:] = float("-inf")  # routing over the first route_experts experts only (skew)
    tw, ti = torch.topk(torch.softmax(logits, -1), a["topk"], -1)
    tw, ti = (tw / tw.sum(-1, keepdim=True)).float().contiguous(), ti.to(torch.int32).contiguous()
    ref = own(x, tw, ti).float()
    diff = {n: float((fn(x, tw, ti).float() - ref).abs().max()) for n, fn in fns.items()}
    ts = {n: [] for n in fns}
    for _ in range(a["reps"]):
        for n, fn in fns.items():
            t = time.perf_counter()
            fn(x, tw, ti)
            ts[n].append(time.perf_counter() - t)
    print("RESULT " + json.dumps({"T": T, "median_ms": {n: statistics.median(v) * 1e3 for n, v in ts.items()},
                                  "min_ms": {n: min(v) * 1e3 for n, v in ts.items()}, "maxdiff": diff}), flush=True)
'''


def kernel_ab(py: str, src: Path, pack: Path, a) -> None:
    """``--kernel-ab``: layer 0's experts, vLLM's bf16 kernel against moepack's on the mapped pack
    and on anonymous copies kept on 4 KiB and on 2 MiB pages (calls alternating, medians)."""
    drv = a.out / "vllm_kernel_ab.py"
    drv.write_text(KERNEL_AB)
    env = dict(os.environ)
    sys.path.insert(0, str(ROOT / "tests"))
    from test_vllm_plugin import _env

    env.update({k: v for k, v in _env(a.out).items() if k == "PYTHONPATH"})
    src_file = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]["model.layers.0.mlp.experts.0.gate_proj.weight"]
    args = {"pack": str(pack), "src_file": str(src / src_file), "tokens": [1, 16, 512, 1024], "reps": a.repeat * 4,
            "topk": a.topk, "route_experts": a.route_experts or a.experts}  # fmt: skip
    p = subprocess.run([py, str(drv), json.dumps(args)], capture_output=True, text=True, env=env)
    rows = [json.loads(ln[7:]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    (a.out / "kernel_ab.json").write_text(json.dumps(rows, indent=1))
    if not rows:
        print(f"kernel A/B failed (rc {p.returncode}): {(p.stdout + p.stderr)[-2000:]}")
        return
    head = rows[0]
    print(f"kernel A/B, layer 0, routing over {args['route_experts']} experts, {head['threads']} threads; the mapped pack: {head['mapped_pmd_kb'] / 1024:.0f} of "
          f"{head['mapped_rss_kb'] / 1024:.0f} MiB mapped with 2 MiB pages")  # fmt: skip
    for r in rows[1:]:
        print(f"  T={r['T']:<5}" + "  ".join(f"{n}: {v:.2f} ms" for n, v in r["median_ms"].items()))


def write_source(d: Path, layers: int, vocab: int, hidden: int, inter: int, experts: int, topk: int, seed: int) -> None:
    """A Qwen3-MoE checkpoint written tensor by tensor (no model in memory): seeded N(0, 0.02)
    bf16 weights, ones for the norms, one safetensors file per layer plus an index."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    if (d / "model.safetensors.index.json").exists():  # written last: a source cut off midway is rewritten
        return
    d.mkdir(parents=True, exist_ok=True)
    nh, nkv, hd = 32, 4, 128
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=6144, moe_intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
                         num_experts=experts, num_experts_per_tok=topk, max_position_embeddings=4096, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, dtype="bfloat16")  # fmt: skip
    cfg.architectures = ["Qwen3MoeForCausalLM"]  # what model.save_pretrained writes; vLLM picks its runner by it
    cfg.save_pretrained(d)
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    index = {}

    def save(name: str, tensors: dict) -> None:
        save_file(tensors, str(d / name), metadata={"format": "pt"})
        index.update({k: name for k in tensors})

    save("model-embed.safetensors", {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
                                     "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)})  # fmt: skip
    for L in range(layers):
        p = f"model.layers.{L}."
        t = {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
             p + "self_attn.q_proj.weight": w(nh * hd, hidden), p + "self_attn.k_proj.weight": w(nkv * hd, hidden),
             p + "self_attn.v_proj.weight": w(nkv * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, nh * hd),
             p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             p + "mlp.gate.weight": w(experts, hidden)}  # fmt: skip
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = w(inter, hidden)
            t[q + "up_proj.weight"] = w(inter, hidden)
            t[q + "down_proj.weight"] = w(hidden, inter)
        save(f"model-layer{L:03d}.safetensors", t)
    total = sum(os.path.getsize(d / f) for f in set(index.values()))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": index}))


# compressed-tensors checkpoints of the synthetic source, experts only (attention, router, lm_head
# stay bf16 and are listed in `ignore`), in the two schemes vLLM 0.32 runs on x86 CPU with its own
# MoE kernels: W8A8 int8 (per-channel weights, dynamic per-token activations: CPUExpertsInt8) and
# W4A16 int4, group 128, symmetric (CPUExpertsInt4: fused_experts_cpu INT4_W4A8, int8 activations)
CT_SCHEMES = {
    "int8": ("W8A8", lambda mod: mod.weight.float().abs().amax(1, keepdim=True)),
    "int4": ("W4A16", lambda mod: mod.weight.float().unflatten(1, (-1, 128)).abs().amax(-1)),
}
CT_TARGETS = [r"re:.*mlp[.]experts[.].*"]
CT_IGNORE = ["lm_head", r"re:.*self_attn[.].*", r"re:.*mlp[.]gate$"]


def write_ct_source(src: Path, dst: Path, scheme: str) -> None:
    """``src`` with its experts quantized by compressed-tensors itself (tests/support/ct_writer.py)."""
    import re

    if (dst / "config.json").exists():
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from ct_writer import write_ct_checkpoint

    preset, amax = CT_SCHEMES[scheme]
    write_ct_checkpoint(src, dst, preset, amax, keep=re.compile(r"^(?!.*[.]mlp[.]experts[.])"), targets=CT_TARGETS,
                        ignore=CT_IGNORE)  # fmt: skip


def experts_bytes(pack: Path) -> int:
    m = json.loads((pack / "moepack.json").read_text())
    return sum(int(_nbytes(m["tensors"][n])) for x in m["layers"] for n in x["tensors"].values())


def _nbytes(e: dict) -> int:
    import math

    size = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int8": 1, "uint8": 1}[e["dtype"]]
    return math.prod(e["shape"]) * size


# (vLLM's own run, the moepack run on the same weights) whose ratios the summary prints
PAIRS = [("own-bf16", "moepack-bf16"), ("own-ct-int8", "moepack-ct-int8"), ("own-ct-int4", "moepack-ct-int4"),
         ("own-ct-int4", "moepack-ct-int4-a8")]


# --same-process: the two engines of a pair (vLLM's own experts, vLLM + moepack) built in one process
# and their calls alternated, so that both meet the same machine (this VM's read rate moves by
# 10% between minutes, more than the difference measured); medians and per-round ratios
AB_DRIVER = r'''
import json, os, statistics, sys, time
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

a = json.loads(sys.argv[1])
llms = {}
for name, model, quant, env in a["arms"]:
    os.environ.update(env)  # read by the plugin while this engine loads
    kw = dict(skip_tokenizer_init=True, max_model_len=a["max_len"], dtype="bfloat16", max_num_seqs=max(4, a["prefill_prompts"]),
              max_num_batched_tokens=max(a["max_len"], a["prefill_len"] * a["prefill_prompts"]), seed=0)
    if quant:
        kw["quantization"] = quant
    llms[name] = LLM(model, **kw)
g = torch.Generator().manual_seed(0)
short = [TokensPrompt(prompt_token_ids=torch.randint(0, a["vocab"], (16,), generator=g).tolist())]
long = [TokensPrompt(prompt_token_ids=torch.randint(0, a["vocab"], (a["prefill_len"],), generator=g).tolist())
        for _ in range(a["prefill_prompts"])]
spn = SamplingParams(temperature=0.0, max_tokens=a["decode"] + 1, detokenize=False, ignore_eos=True)
sp1 = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
for llm in llms.values():  # warm-up, and the first touch of every expert
    llm.generate(short, spn, use_tqdm=False)
    llm.generate(long, sp1, use_tqdm=False)
dec = {n: [] for n in llms}
pre = {n: [] for n in llms}
toks = {}
for r in range(a["rounds"]):
    for n in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
        t = time.perf_counter()
        o = llms[n].generate(short, spn, use_tqdm=False)
        tn = time.perf_counter() - t
        t = time.perf_counter()
        llms[n].generate(short, sp1, use_tqdm=False)
        t1 = time.perf_counter() - t
        dec[n].append(a["decode"] / max(tn - t1, 1e-9))
        toks[n] = list(o[0].outputs[0].token_ids)
        t = time.perf_counter()
        llms[n].generate(long, sp1, use_tqdm=False)
        pre[n].append(a["prefill_len"] * a["prefill_prompts"] / (time.perf_counter() - t))
print("RESULT " + json.dumps({"decode": dec, "prefill": pre, "tokens": toks, "threads": torch.get_num_threads()}), flush=True)
'''


def drive(py: str, driver: str, name: str, args: dict, log: Path, env: dict) -> tuple[dict | None, int]:
    """Runs ``driver`` (saved as ``name`` next to ``log``) in the vLLM python with ``args`` as JSON,
    in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the tests' entry-point shims on
    PYTHONPATH, ``env`` over the rest; writes its output to ``log`` (vLLM logs to stdout
    in-process) and returns its ``RESULT`` line (None without one) and its exit status."""
    drv = log.parent / name
    drv.write_text(driver)
    full = dict(os.environ)
    full.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    sys.path.insert(0, str(ROOT / "tests"))
    from test_vllm_plugin import _env  # the entry point / sitecustomize shims the tests use

    full.update({k: v for k, v in _env(log.parent).items() if k == "PYTHONPATH"})
    full.update(env)
    p = subprocess.run([py, str(drv), json.dumps(args)], capture_output=True, text=True, env=full)
    log.write_text(p.stdout + p.stderr)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]), p.returncode
    return None, p.returncode


def same_process(py: str, pair: list, a, log: Path) -> dict:
    """One process, both engines of ``pair`` ([(name, model, quant, env)] * 2), calls alternating."""
    args = {"arms": [[n, str(m), q, e] for n, m, q, e in pair], "max_len": a.prefill_len + 64, "prefill_len": a.prefill_len,
            "prefill_prompts": a.prefill_prompts, "decode": a.decode, "vocab": a.vocab, "rounds": a.same_process}  # fmt: skip
    r, rc = drive(py, AB_DRIVER, "vllm_ab_driver.py", args, log, {"VLLM_CPU_KVCACHE_SPACE": str(max(1, a.kv_gib // 2))})
    return r if r is not None else {"error": f"no result (rc {rc}; log {log})"}


def decode_op_ms(r: dict) -> float:
    """The experts' kernel op time per call in a run's profiled decode (NaN without --profile):
    vLLM's own op, or moepack's fused_experts (in results from before 2026-12-06, the
    moepack_vllm::experts wrapper around it not counted)."""
    ops = r.get("experts_ops_decode") or {}
    got = [(v["ms"], v["calls"]) for k, v in ops.items() if k != "decode_ms" and not k.startswith("moepack_vllm")]
    return sum(m for m, _ in got) / max(sum(c for _, c in got), 1) if got else float("nan")


def run_vllm(py: str, model: Path, quant: str | None, a, log: Path, extra_env: dict | None = None) -> dict:
    args = {"model": str(model), "quant": quant, "max_len": a.prefill_len + 64, "prefill_len": a.prefill_len,
            "prefill_prompts": a.prefill_prompts, "decode": a.decode, "repeat": a.repeat, "vocab": a.vocab, "profile": a.profile}  # fmt: skip
    r, rc = drive(py, DRIVER, "vllm_bench_driver.py", args, log, {"VLLM_CPU_KVCACHE_SPACE": str(a.kv_gib), **(extra_env or {})})
    if r is None:
        return {"error": f"rc {rc}, see {log}: " + " | ".join(log.read_text().splitlines()[-3:])}
    for ln in log.read_text().splitlines():
        if "Loading weights took" in ln:
            r["weights_line"] = ln.split("Loading weights took", 1)[1].strip()
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "vllm-bench")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--schemes", default="bf16,int8,int4")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-prompts", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--kv-gib", type=int, default=2)
    ap.add_argument("--skip-own", action="store_true", help="do not run vLLM's own experts")
    ap.add_argument("--ct", default="int8,int4", help="compressed-tensors schemes to run with vLLM's own int8/int4 "
                    "experts and moepack's pack of the same checkpoint ('' for none)")  # fmt: skip
    ap.add_argument("--pages", default="advise", help="MOEPACK_VLLM_PAGES modes for the bf16 pack (comma list; the "
                    "first is the plain moepack-bf16 run, others run as moepack-bf16@MODE)")  # fmt: skip
    ap.add_argument("--kernel-ab", action="store_true", help="only the one-layer kernel A/B (vLLM's bf16 kernel, "
                    "moepack's on the mapped pack, on 4 KiB and on 2 MiB anonymous copies), no engine")  # fmt: skip
    ap.add_argument("--route-experts", type=int, default=0, help="--kernel-ab: route every token among the first N "
                    "experts only (skewed routing: more tokens per expert); default all")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="one more prefill and one more decode under torch.profiler: "
                    "the experts' op time inside the engine (results.json experts_ops, experts_ops_decode; the table's "
                    "'experts ms' is the prefill's, 'dec op ms' the decode's per call)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1, help="run the arms this many times, back to back, every second "
                    "round in the reverse order (the ratios are reported per round: fair on a shared machine)")  # fmt: skip
    ap.add_argument("--same-process", type=int, default=0, metavar="ROUNDS", help="instead of one engine per run: "
                    "each pair (vLLM's own, vLLM + moepack on the same weights) built in one process, their decode and "
                    "prefill calls alternating for ROUNDS rounds; medians and per-round ratios")  # fmt: skip
    a = ap.parse_args()
    py = os.environ.get("MOEPACK_VLLM_PYTHON") or str(ROOT / "build" / "vllm-venv" / "bin" / "python")
    if not Path(py).exists():
        print(f"no vLLM python at {py}: set MOEPACK_VLLM_PYTHON or run `make vllm-venv`", file=sys.stderr)
        return 2
    import moepack

    a.out.mkdir(parents=True, exist_ok=True)
    src = a.out / f"src-L{a.layers}"
    t = time.time()
    write_source(src, a.layers, a.vocab, a.hidden, a.inter, a.experts, a.topk, seed=0)
    print(f"source {src} ({time.time() - t:.0f} s)", flush=True)
    if a.kernel_ab:
        pack = a.out / f"pack-L{a.layers}-bf16"
        if not (pack / "moepack.json").exists():
            moepack.convert(src, pack)
        kernel_ab(py, src, pack, a)
        return 0
    runs = []  # (name, model dir, quantization, pack, extra environment)
    pages = [m for m in a.pages.split(",") if m]
    if not a.skip_own and "bf16" in a.schemes.split(","):
        runs.append(("own-bf16", src, None, None, {}))
    for s in [x for x in a.schemes.split(",") if x]:
        pack = a.out / f"pack-L{a.layers}-{s}"
        if not (pack / "moepack.json").exists():
            t = time.time()
            moepack.convert(src, pack, quantize=None if s == "bf16" else s)
            print(f"convert {s}: {time.time() - t:.0f} s", flush=True)
        for i, m in enumerate(pages if s == "bf16" else pages[:1]):
            runs.append((f"moepack-{s}" + (f"@{m}" if i else ""), pack, "moepack", pack, {"MOEPACK_VLLM_PAGES": m}))
    for s in [x for x in a.ct.split(",") if x]:
        ct = a.out / f"src-L{a.layers}-ct-{s}"
        pack = a.out / f"pack-L{a.layers}-ct-{s}"
        t = time.time()
        write_ct_source(src, ct, s)
        if not (pack / "moepack.json").exists():
            moepack.convert(ct, pack)  # the checkpoint's own codes and scales, packed as they are
        print(f"compressed-tensors {s} source and its pack: {time.time() - t:.0f} s", flush=True)
        if not a.skip_own:
            runs.append((f"own-ct-{s}", ct, None, None, {}))
        runs.append((f"moepack-ct-{s}", pack, "moepack", pack, {"MOEPACK_VLLM_PAGES": pages[0] if pages else "advise"}))
        if s == "int4":  # vLLM's int4 kernel quantizes activations to int8: moepack's a8 mode is its like
            runs.append((f"moepack-ct-{s}-a8", pack, "moepack", pack,
                         {"MOEPACK_VLLM_PAGES": pages[0] if pages else "advise", "MOEPACK_ACT_MODE": "a8"}))
    if a.same_process:
        import statistics

        byname = {name: (name, model, quant, extra) for name, model, quant, _, extra in runs}
        out = {}
        for own, ours in PAIRS:
            if own not in byname or ours not in byname:
                continue
            print(f"same process: {ours} against {own}, {a.same_process} rounds ...", flush=True)
            r = same_process(py, [byname[own], byname[ours]], a, a.out / f"{ours}.same-process.log")
            out[ours] = r
            (a.out / "same_process.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                                                 "results": out}, indent=1))  # fmt: skip
            if "error" in r:
                print(f"  {r['error']}")
                continue
            for what in ("decode", "prefill"):
                o, m = r[what][own], r[what][ours]
                q = [y / x for x, y in zip(o, m)]
                print(f"  {what:<8} {own}: {statistics.median(o):9.1f} tok/s, {ours}: {statistics.median(m):9.1f} tok/s; "
                      f"{ours} / {own} per round: median {statistics.median(q):.3f}, range {min(q):.3f}-{max(q):.3f}, "
                      f"ahead in {sum(x > 1 for x in q)} of {len(q)}")  # fmt: skip
            print(f"  greedy tokens equal: {r['tokens'][own] == r['tokens'][ours]}")
        return 0
    results: dict[str, list[dict]] = {}
    for rnd in range(a.rounds):
        for name, model, quant, pack, extra in (runs if rnd % 2 == 0 else runs[::-1]):
            print(f"round {rnd + 1}: running {name} ...", flush=True)
            r = run_vllm(py, model, quant, a, a.out / f"{name}.r{rnd + 1}.log", extra)
            r["round"] = rnd + 1
            if pack is not None:
                r["experts_mb"] = experts_bytes(pack) / 2**20
            results.setdefault(name, []).append(r)
            print(json.dumps({name: r}), flush=True)
            (a.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                                            "order": [x[0] for x in runs], "results": results}, indent=1))  # fmt: skip
    hdr = (f"{'run':<22}{'rnd':>4}{'load s':>8}{'weights':>12}{'RSS +MB':>9}{'peak +MB':>9}{'experts MB':>11}"
           f"{'decode t/s':>11}{'prefill t/s':>12}{'1st prefill':>12}{'experts ms':>11}{'dec op ms':>10}")  # fmt: skip
    print(hdr)
    for name, rs in results.items():
        for r in rs:
            if "error" in r:
                print(f"{name:<22}{r['round']:>4} {r['error']}")
                continue
            ops = r.get("experts_ops") or {}
            kern = [v["ms"] for k, v in ops.items() if k != "prefill_ms" and not k.startswith("moepack_vllm")]
            dec_call = decode_op_ms(r)
            print(f"{name:<22}{r['round']:>4}{r['load_s']:>8.1f}{r.get('weights_line', '?')[:11]:>12}"
                  f"{r['rss_loaded_mb'] - r['rss0_mb']:>9.0f}{r['peak_loaded_mb'] - r['rss0_mb']:>9.0f}"
                  f"{r.get('experts_mb', float('nan')):>11.0f}{r['decode_tok_s']:>11.2f}{r['prefill_tok_s']:>12.1f}"
                  f"{r['prefill_first_tok_s']:>12.1f}{(sum(kern) if kern else float('nan')):>11.1f}{dec_call:>10.3f}")  # fmt: skip
    print("moepack / vLLM's own, per round (decode, prefill):")
    for own, ours in PAIRS:
        for i, (o, m) in enumerate(zip(results.get(own, []), results.get(ours, []))):
            if "error" in o or "error" in m:
                continue
            op = decode_op_ms(o) / decode_op_ms(m)
            print(f"  {ours:<22} / {own:<12} round {i + 1}: decode {m['decode_tok_s'] / o['decode_tok_s']:.2f}x, "
                  f"prefill {m['prefill_tok_s'] / o['prefill_tok_s']:.2f}x"
                  + ("" if op != op else f", the experts op at decode {op:.2f}x"))  # fmt: skip
    for s in ("int8", "int4"):
        if s in a.schemes.split(",") and s not in a.ct.split(","):
            print(f"own-{s}: not run (vLLM's CPU int8/int4 experts need a quantized checkpoint: --ct {s})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
