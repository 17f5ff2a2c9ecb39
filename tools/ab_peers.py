"""moepack and vLLM's ``fused_experts_cpu`` timed in ONE process, calls alternating, on the same
weights and routings (../shared/peers' make_weights_bf16 / make_sets; routing sets rotated).

On a shared machine whose memory rate drifts by minutes, separate processes (the peers'
interleave.sh) can put two engines in different phases; alternating call by call cannot.
Run it with the vLLM venv's python (same torch as moepack's build) and moepack on PYTHONPATH:

    OMP_NUM_THREADS=2 PYTHONPATH=$PWD /tmp/moepack-peers/vllm/bin/python tools/ab_peers.py bf16 1 [N]

SCHEME: bf16, int8 (vLLM's INT8 W8A8), fp8 (vLLM's FP8 W8A16, 128 x 128 blocks, against
moepack's f8g128_n32k2_x86: each quantizes the same bf16 weights with its own quantizer, the same
rule: scale = block amax / 448, round to nearest) or mxfp4 (vLLM's MXFP4 W4A16,
``CPUQuantMethod.MXFP4``, the path vLLM 0.32 runs gpt-oss with on CPU, against moepack's
mx4g32_n32k8_x86 in the mode MOEPACK_ACT_MODE names, a16 by default: both get the SAME codes and
scales, moepack's ``quantize_mxfp4`` of the bf16 weights, handed to vLLM in its checkpoint format,
``uint8 [E, N, K / 2]`` (low nibble = even k) and e8m0 ``uint8 [E, N, K / 32]``, through its own
``convert_weight_packed`` / ``convert_scale_packed``, as its ``prepare_mxfp4_moe_layer_for_cpu``
does). Prints each arm's median, 25th percentile and minimum.
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


def mxfp4_same_weights(w13, w2):
    """(vLLM's fused_experts_cpu MXFP4 call, moepack's PackedExperts) on the same MXFP4 weights:
    moepack quantizes the bf16 weights once (expert by expert: no fp32 copy of a whole layer)."""
    import torch

    from moepack.pack import in_huge_pages
    from moepack.schemes import get_scheme

    scheme = get_scheme("mxfp4")
    lay = scheme.layout_for("x86")
    c = {k: [] for k in ("w13_q", "w13_scale", "w2_q", "w2_scale")}
    for e in range(w13.shape[0]):
        one = scheme.from_float(w13[e : e + 1], w2[e : e + 1], layout=lay)
        for k in c:
            c[k].append(one[k])
    c = {k: torch.cat(v) for k, v in c.items()}
    p = in_huge_pages(scheme.pack(c, interleaved=False, layout=lay))  # as pack_experts gives it

    def nibbles(q):  # [E, N, K] codes -> [E, N, K / 2], low nibble = even k (gpt-oss / vLLM)
        return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()

    C, ops = bv.C, bv.ops
    p13, p2 = C.convert_weight_packed(nibbles(c["w13_q"])), C.convert_weight_packed(nibbles(c["w2_q"]))
    s13, s2 = C.convert_scale_packed(c["w13_scale"].contiguous()), C.convert_scale_packed(c["w2_scale"].contiguous())

    def fn(x, tw, ti):
        out = torch.empty_like(x)
        ops.fused_experts_cpu(out, x, p13, p2, tw, ti, ops.CPUQuantMethod.MXFP4, s13, s2, None, None, None, None, None,
                              None, None, True)  # fmt: skip
        return out

    return fn, p, c


def main() -> None:
    scheme, T = sys.argv[1], int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else (300 if T <= 8 else 30)
    paths = {"bf16": ("fe_bf16", "bf16_n32k2_x86"), "int8": ("fe_int8", "i8_n32k4_x86"), "fp8": ("fe_fp8", "f8g128_n32k2_x86"),
             "mxfp4": (None, "mx4g32_n32k8_x86")}  # fmt: skip
    if scheme not in paths:
        raise SystemExit(f"scheme {scheme!r}: must be one of {', '.join(paths)}")
    shape = os.environ.get("SHAPE", "qwen3-30b-a3b")
    w13, w2 = make_weights_bf16(shape)
    c = None
    if scheme == "mxfp4":
        fn_v, p, c = mxfp4_same_weights(w13, w2)
    else:
        fn_v, _ = bv.build(paths[scheme][0], w13, w2)
        p = moepack.pack_experts(w13, w2, layout=paths[scheme][1])
    del w13, w2
    sets = bv.prep_sets(make_sets(shape, T))
    if c is not None and T <= 8:  # the same weights: both engines against moepack's exact W4A16 oracle
        from moepack.schemes.mxfp4 import moe_reference_mxfp4

        s0 = sets[0]
        ref = moe_reference_mxfp4(s0["x"], c, s0["topk_w"], s0["ti32"]).float()
        for who, out in (("vllm", fn_v(s0["x"], s0["tw32"], s0["ti32"])), ("moepack", moepack.run_experts(p, s0["x"], s0["topk_w"], s0["ti32"]))):
            print(f"  {who} vs the mxfp4 A16 oracle on the same codes: rel err {float((out.float() - ref).norm() / ref.norm()):.2e}")
    del c
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
    mode = f", moepack act_mode {os.environ.get('MOEPACK_ACT_MODE') or p.layout.act_modes[0]}" if len(p.layout.act_modes) > 1 else ""
    print(f"{shape} {scheme} T={T}, {n} calls per arm, decode streams: {moepack._ops.decode_streams()}{mode}")
    for k in names:
        v = sorted(ts[k])
        print(f"  {k:>24}: median {v[len(v) // 2] * 1e3:.3f} ms, p25 {v[len(v) // 4] * 1e3:.3f}, min {v[0] * 1e3:.3f}")


if __name__ == "__main__":
    main()
