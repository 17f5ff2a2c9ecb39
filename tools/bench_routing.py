#!/usr/bin/env python3
"""The per-call cost of moepack's routing op (docs/ROUTING.md, "Cost"): the op and route() at
T=1 and the kernel per token, interleaved over the cases.

    python tools/bench_routing.py [--calls N] [--repeats R]
"""

from __future__ import annotations

import torch

from moepack.routing import RoutingConfig, _op, route




def _time_us(fn, calls: int) -> float:
    import time

    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1000.0


def bench(calls: int = 2000, repeats: int = 25) -> list[tuple[str, float, float, float, float]]:
    """Per-call cost of routing: the op at T=1 (Python dispatch and output allocation included),
    route() at T=1, and the kernel per token (T=4096 on one thread, / 4096). Repeats are
    interleaved over the cases so that a burst of other load hits them all alike. Prints and
    returns (case, op median, op min, route() median, kernel per token median) in µs."""
    g = torch.Generator().manual_seed(0)
    cases = [
        ("grouped_sigmoid E=256 k=8 (DeepSeek-V3: 8 groups, topk_group 4, bias, renorm, x2.5)",
         RoutingConfig("grouped_sigmoid", 8, renormalize=True, num_expert_group=8, topk_group=4,
                       routed_scaling_factor=2.5, has_correction_bias=True, num_experts=256), 256),
        ("softmax E=128 k=8 (Qwen3-MoE, renormalize)", RoutingConfig("softmax", 8, renormalize=True), 128),
        ("softmax E=128 k=8 (no renormalize)", RoutingConfig("softmax", 8), 128),
        ("topk_softmax E=32 k=4 (gpt-oss-20b)", RoutingConfig("topk_softmax", 4), 32),
        ("sparsemixer E=16 k=2 (Phi-3.5-MoE)", RoutingConfig("sparsemixer", 2), 16),
    ]  # fmt: skip
    op = _op()
    fns = []
    for _, cfg, e in cases:
        x = torch.randn(1, e, generator=g)
        xb = torch.randn(4096, e, generator=g)
        bias = (torch.randn(e, generator=g) * 0.1) if cfg.has_correction_bias else None
        args = (*cfg._op_head, bias, *cfg._op_tail)
        fns.append(((lambda x=x, a=args: op(x, *a)), (lambda x=x, c=cfg, b=bias: route(x, c, b)),
                    (lambda x=xb, a=args: op(x, *a))))  # fmt: skip
    threads = torch.get_num_threads()
    times = [([], [], []) for _ in cases]
    big_calls = max(1, calls // 400)
    for rep in range(repeats + 1):  # the first round warms up
        for (f_op, f_route, f_big), (t_op, t_route, t_big) in zip(fns, times):
            a, b = _time_us(f_op, calls), _time_us(f_route, calls)
            torch.set_num_threads(1)
            try:
                c = _time_us(f_big, big_calls) / 4096
            finally:
                torch.set_num_threads(threads)
            if rep:
                t_op.append(a), t_route.append(b), t_big.append(c)

    def med(v):
        return sorted(v)[len(v) // 2]

    rows = []
    print(f"torch {torch.__version__}, {threads} threads; {repeats} interleaved rounds of {calls} calls; µs per call")
    print(f"{'case':<86} {'op T=1 (min)':>16} {'route() T=1':>12} {'kernel/token':>13}")
    for (name, _, _), (t_op, t_route, t_big) in zip(cases, times):
        row = (name, med(t_op), min(t_op), med(t_route), med(t_big))
        rows.append(row)
        print(f"{name:<86} {row[1]:>7.2f} ({row[2]:>5.2f}) {row[3]:>12.2f} {row[4]:>13.3f}")
    return rows


def _main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python tools/bench_routing.py", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=25)
    a = p.parse_args(argv)
    bench(a.calls, a.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
