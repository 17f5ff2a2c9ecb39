"""Measures the errors that tests/reference/tolerances.py bounds (run it after a kernel change):

    python -m tests.reference.measure_errors [--draws N]

For every case of the kernel test matrix (tests/support/kernel_cases.py; and N extra random draws of
it, other seeds) it prints, per tolerance entry, the worst relative norm error and the worst
element in units of eps*rms(expected) and of (ulp(|expected|) + eps*rms(expected)), next to the
current bounds.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from moepack.isa import KERNEL_ISAS, available_isas
from moepack.reference import moe_reference
from tests.conftest import isa_cap, reference, run_packed
from tests.support.kernel_cases import CASES
from tests.reference.tolerances import TOL, elem_ratio, errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=0, help="extra random draws of the matrix (other seeds)")
    args = ap.parse_args()
    simd = [i for i in available_isas() if i != "scalar" and i in KERNEL_ISAS["bf16"]]
    worst: dict[str, dict[str, float]] = {}

    def record(kind: str, dtype: torch.dtype, actual: torch.Tensor, expected: torch.Tensor, case) -> None:
        tol = TOL[kind, dtype]
        e = errors(actual, expected, dtype)
        probe = dataclasses.replace(tol, elem_ulps=1.0, rms_eps=1.0)
        eps_only = dataclasses.replace(tol, elem_ulps=0.0, rms_eps=1.0)
        w = worst.setdefault(tol.name, {"rel_norm": 0.0, "eps*rms": 0.0, "ulp+eps*rms": 0.0, "vs bound": 0.0})
        w["rel_norm"] = max(w["rel_norm"], e.rel_norm)
        w["eps*rms"] = max(w["eps*rms"], elem_ratio(actual, expected, eps_only))
        w["ulp+eps*rms"] = max(w["ulp+eps*rms"], elem_ratio(actual, expected, probe))
        r = elem_ratio(actual, expected, tol)
        if r > w["vs bound"]:
            w["vs bound"] = r
            w["worst case"] = case.id
        w["n"] = w.get("n", 0) + 1

    for draw in range(args.draws + 1):
        for case in CASES:
            case = dataclasses.replace(case, seed=case.seed + 100_000 * draw)
            inp = case.inputs()
            packed = inp.pack()
            with isa_cap("scalar"):
                scalar = run_packed(packed, inp, **case.act_kwargs)
            ref = reference(inp, **case.act_kwargs)
            ref32 = moe_reference(inp.x.float(), inp.w13, inp.w2, inp.topk_weights, inp.topk_ids,
                                  w13_bias=inp.w13_bias, w2_bias=inp.w2_bias, **case.act_kwargs)  # fmt: skip
            record("scalar_vs_reference", case.dtype, scalar, ref, case)
            if case.dtype != torch.float32:
                record("half_vs_fp32_pipeline", case.dtype, scalar, ref32, case)
            for isa in simd:
                with isa_cap(isa):
                    out = run_packed(packed, inp, **case.act_kwargs)
                record("simd_vs_scalar", case.dtype, out, scalar, case)
                if case.dtype != torch.float32:
                    record("half_vs_fp32_pipeline", case.dtype, out, ref32, case)
    for (kind, dtype), tol in TOL.items():
        if tol.name not in worst:
            continue
        w = worst[tol.name]
        print(f"{tol.name:32s} n={w['n']:4d} rel_norm {w['rel_norm']:.3g} (bound {tol.rel_norm:.3g})  "
              f"worst elem: {w['eps*rms']:.3g} eps*rms, {w['ulp+eps*rms']:.3g} x (ulp+eps*rms), "
              f"{w['vs bound']:.3g} x bound [{w.get('worst case', '')}]")  # fmt: skip


if __name__ == "__main__":
    main()
