#!/usr/bin/env python3
"""A/B of moepack builds (or of schemes in one build), call by call, by thread CPU time.

Two builds of the extension cannot be loaded in one process, so each build gets a worker
process (``PYTHONPATH`` = that checkout, ``OMP_NUM_THREADS=1``: the call runs on the worker's own
thread) holding the same seeded weights, packs and routings; the driver sends one call to each
(build, arm) in turn, rotating the order every round, and each worker times its call with
``time.thread_time()``, which does not count the time other processes held the core (the method
of docs/BENCH.md "A/B on a loaded machine"). Reported per (arm, T): median, p25 and min ms over
the rounds after a warm-up, the ratio to the first build's median of the same arm (one build:
to its first arm's), and whether every build gave the same output for the same arm and routing
(a kernel change that should be exact must).

    python3 tools/ab_builds.py --shape qwen3-30b-a3b --tokens 64,512 --arms int8 \\
        --env MOEPACK_MAX_ISA=avx512_vnni --no-huge old=/path/to/main new=.
    python3 tools/ab_builds.py --tokens 64,512,2048 --arms dense,int4:a16 \\
        --env MOEPACK_MAX_ISA=avx512_bf16 --no-huge --rounds 13 this=.

An arm is a scheme (``get_scheme`` names and aliases) with an optional ``:act_mode``.
``--no-huge`` leaves the packs in 4 KiB pages: with THP ``madvise`` on a fragmented machine
``in_huge_pages`` gives each worker a different share of huge pages, and a memory-bound call's
time follows that share (docs/BENCH.md "Prefill without AMX"). On 4 KiB pages the two workers'
memory differs too (where their pages and page tables land): for a change whose effect is on
page walks, compare inside one process instead (docs/KERNELS.md "Page touch").
``--threads N`` (N > 1) runs each call on N threads and times it by the wall clock (the workers
take turns, so a call has the machine); ``--copies C`` keeps C copies of each pack and rotates
the calls over them, and ``--sets S`` rotates S routing sets, so that decode reads its experts
from memory rather than from the last-level cache of an earlier call (4 sets of one copy fit a
480 MiB LLC); call i takes copy i mod C and set i mod S, so C and S must be coprime (else a set
always meets the same copy), and each copy holds the pack again (a qwen3-30b-a3b bf16 layer:
1.1 GiB per copy, arm and build). Needs each build's extension built in place. Timings only: nothing here is a test."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time


def worker(shape_name: str, arms_spec: str, tokens: list[int], huge: bool, dtype: str = "bf16", threads: int = 1, copies: int = 1,
           nsets: int = 4) -> None:
    import torch

    from moepack.bench import vs as V
    from moepack.bench.run import make_weights
    from moepack.bench.shapes import parse_shapes
    from moepack.bench.timing import RoutingStream
    from moepack.isa import host_family
    from moepack.pack import in_huge_pages
    from moepack.runtime.experts import run_experts
    from moepack.schemes import get_scheme

    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter  # one thread: its CPU time; more: the wall clock
    (shape,) = parse_shapes(shape_name)
    w13, w2 = make_weights(shape, 0)
    arms = {}
    for spec in arms_spec.split(","):
        scheme, _, mode = spec.partition(":")
        s = get_scheme(scheme)
        lay = s.layout_for(host_family())
        packed = s.pack(V.canonical_from_float(s, w13, w2, lay), interleaved=False, layout=lay)
        # `copies` copies of the pack, the calls rotating over them: a call's experts are then rarely
        # still in the last-level cache from an earlier call (480 MiB on the SPR-class guest)
        arms[spec] = ([in_huge_pages(packed) if huge else packed] + [copy_pack(packed, huge) for _ in range(copies - 1)], mode or None)
    del w13, w2
    sets = {}
    for t in tokens:
        rs = RoutingStream(t, shape.num_experts, shape.topk, seed=t)
        g = torch.Generator().manual_seed(1000 + t)
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        sets[t] = [(torch.randn(t, shape.hidden, generator=g).to(dt), *rs.next()[:2]) for _ in range(nsets)]
    info = {a: list(torch.ops.moepack.kernel_choice(int(p[0].layout.id), m or ""))[:2] for a, (p, m) in arms.items()}
    with open("/proc/self/smaps") as f:  # Linux; the huge pages this worker got
        info["anon_huge_mib"] = sum(int(x.split()[1]) for x in f if x.startswith("AnonHugePages:")) // 1024
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        arm, t, i = line.split()
        packs, mode = arms[arm]
        packed = packs[int(i) % len(packs)]
        x, w, ids = sets[int(t)][int(i) % nsets]
        t0 = clock()
        y = run_experts(packed, x, w, ids, act_mode=mode) if mode else run_experts(packed, x, w, ids)
        dt = clock() - t0
        digest = hashlib.sha1(y.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()[:12]
        print(f"{dt:.6f} {digest}", flush=True)


def copy_pack(packed, huge: bool):
    """Another copy of ``packed``'s tensors (on huge pages where ``huge``, as ``in_huge_pages``)."""
    import dataclasses

    from moepack.pack import in_huge_pages

    c = dataclasses.replace(packed, tensors={k: v.clone() for k, v in packed.tensors.items()})
    return in_huge_pages(c) if huge else c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="*", metavar="NAME=CHECKOUT", help="a name and the checkout whose moepack to load")
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="64,512")
    ap.add_argument("--arms", default="int8", help="comma-separated scheme[:act_mode], e.g. dense,int4:a16")
    ap.add_argument("--rounds", type=int, default=21, help="rounds, the first a warm-up (at least 2)")
    ap.add_argument("--env", action="append", default=[], metavar="VAR=VALUE", help="set in every worker (e.g. MOEPACK_MAX_ISA=avx512_vnni)")
    ap.add_argument("--no-huge", action="store_true", help="leave the packs in 4 KiB pages")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="the activations' dtype")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads per call; above 1 a call is timed by the wall clock (the workers take turns, so it has the machine)")
    ap.add_argument("--copies", type=int, default=1, help="copies of each pack, the calls rotating over them (keeps decode out of the LLC)")
    ap.add_argument("--sets", type=int, default=4, help="routing sets per token count, rotated")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.worker:
        worker(a.shape, a.arms, tokens, not a.no_huge, a.dtype, a.threads, a.copies, a.sets)
        return 0
    if not a.builds:
        ap.error("name at least one build: NAME=CHECKOUT")
    if a.rounds < 2:
        ap.error(f"--rounds {a.rounds}: at least 2 (the first is a warm-up)")
    for opt in ("threads", "copies", "sets"):
        if getattr(a, opt) < 1:
            ap.error(f"--{opt} {getattr(a, opt)}: at least 1")
    if math.gcd(a.copies, a.sets) != 1:
        ap.error(f"--copies {a.copies} and --sets {a.sets}: must be coprime (call i takes copy i mod C and set i mod S)")
    env_extra = {}
    for kv in a.env:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            ap.error(f"--env {kv!r}: VAR=VALUE")
        env_extra[k] = v
    procs, arms = [], []
    for b in a.builds:
        name, sep, path = b.partition("=")
        if not sep or not name or not os.path.isdir(os.path.join(path, "moepack")):
            ap.error(f"build {b!r}: NAME=CHECKOUT, a folder holding the moepack package")
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONPATH": os.path.abspath(path), **env_extra}
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--shape", a.shape, "--tokens", a.tokens, "--arms", a.arms,
               "--dtype", a.dtype, "--threads", str(a.threads), "--copies", str(a.copies), "--sets", str(a.sets)]
        p = subprocess.Popen(cmd + (["--no-huge"] if a.no_huge else []), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append((name, p))
        arms += [(name, arm, p) for arm in a.arms.split(",")]
    for name, p in procs:
        line = p.stdout.readline()
        if not line.startswith("READY"):
            print(f"build {name}: the worker did not start (exit {p.wait()})", file=sys.stderr)
            return 1
        print(f"{name}: {line[6:].strip()}", flush=True)
    times = {(n, arm, t): [] for n, arm, _ in arms for t in tokens}
    digests: dict[tuple, dict] = {}
    for r in range(a.rounds):
        order = arms[r % len(arms):] + arms[: r % len(arms)]
        for t in tokens:
            for n, arm, p in order:
                p.stdin.write(f"{arm} {t} {r}\n")
                p.stdin.flush()
                dt, digest = p.stdout.readline().split()
                if r:
                    times[(n, arm, t)].append(float(dt) * 1e3)
                digests.setdefault((arm, t, r % a.sets), {})[n] = digest
    for _, p in procs:
        p.stdin.close()
        p.wait()
    first, first_arm = arms[0][0], arms[0][1]
    for t in tokens:
        for n, arm, _ in arms:
            v = sorted(times[(n, arm, t)])
            # several builds: each arm against the first build's; one build: each arm against its first arm
            ref = (first, arm) if len(procs) > 1 else (first, first_arm)
            base = statistics.median(times[(*ref, t)])
            print(f"T={t:5d} {arm:10s} {n:12s} median {statistics.median(v):9.2f} ms  p25 {v[len(v) // 4]:9.2f}  "
                  f"min {v[0]:9.2f}  n={len(v)}  {'/'.join(ref)} / this = {base / statistics.median(v):.3f}")
    differ = sorted({f"{arm} T={t}" for (arm, t, _), d in digests.items() if len(set(d.values())) > 1})
    print("outputs identical across builds" if not differ else f"outputs differ across builds: {', '.join(differ)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
