"""moepack and vLLM's ``fused_experts_cpu`` timed in ONE process, calls alternating, on the same
weights and routings (../shared/peers' make_weights_bf16 / make_sets; routing sets rotated).

On a shared machine whose memory rate drifts by minutes, separate processes (the peers'
interleave.sh) can put two engines in different phases; alternating call by call cannot.
Run it with the vLLM venv's python (same torch as moepack's build) and moepack on PYTHONPATH:

    OMP_NUM_THREADS=2 PYTHONPATH=$PWD /tmp/moepack-peers/vllm/bin/python tools/ab_peers.py bf16 1 [N]

SCHEME: bf16, int8 (vLLM's INT8 W8A8) or fp8 (vLLM's FP8 W8A16, 128 x 128 blocks, against
moepack's f8g128_n32k2_x86: each quantizes the same bf16 weights with its own quantizer, the same
rule: scale = block amax / 448, round to nearest). Prints each arm's median, 25th percentile and minimum.
docs/BENCH.md ("In one process") says what it takes from the harness and how to set it up.
A third arm (moepack again) keeps the arm count odd, so every arm sees every one of the 8
routing sets. Env: SHAPE (default qwen3-30b-a3b), PEERS (default ../shared/peers)."""

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.environ.get("PEERS", str(ROOT.parent / "shared" / "peers")))
import bench_vllm as bv  # noqa: E402  (sets 2 threads, loads vllm._C)
from moe_common import make_sets, make_weights_bf16  # noqa: E402

import moepack  # noqa: E402


def main() -> None:
    scheme, T = sys.argv[1], int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else (300 if T <= 8 else 30)
    paths = {"bf16": ("fe_bf16", "bf16_n32k2_x86"), "int8": ("fe_int8", "i8_n32k4_x86"), "fp8": ("fe_fp8", "f8g128_n32k2_x86")}
    if scheme not in paths:
        raise SystemExit(f"scheme {scheme!r}: must be one of {', '.join(paths)}")
    shape = os.environ.get("SHAPE", "qwen3-30b-a3b")
    w13, w2 = make_weights_bf16(shape)
    fn_v, _ = bv.build(paths[scheme][0], w13, w2)
    p = moepack.pack_experts(w13, w2, layout=paths[scheme][1])
    del w13, w2
    sets = bv.prep_sets(make_sets(shape, T))
    mp = lambda i: moepack.run_experts(p, sets[i]["x"], sets[i]["topk_w"], sets[i]["ti32"])  # noqa: E731
    arms = {"vllm fused_experts_cpu": lambda i: fn_v(sets[i]["x"], sets[i]["tw32"], sets[i]["ti32"]),
            "moepack": mp, "moepack (again)": mp}  # fmt: skip
    names = list(arms)
    for i in range(3 * len(names)):
        arms[names[i % len(names)]](i % 8)
    ts: dict[str, list[float]] = {k: [] for k in names}
    for i in range(n * len(names)):
        k = names[i % len(names)]
        t0 = time.perf_counter()
        arms[k](i % 8)
        ts[k].append(time.perf_counter() - t0)
    print(f"{shape} {scheme} T={T}, {n} calls per arm, decode streams: {moepack._ops.decode_streams()}")
    for k in names:
        v = sorted(ts[k])
        print(f"  {k:>24}: median {v[len(v) // 2] * 1e3:.3f} ms, p25 {v[len(v) // 4] * 1e3:.3f}, min {v[0] * 1e3:.3f}")


if __name__ == "__main__":
    main()
