"""The kernel test matrix (shared by tests/engine/test_kernels.py, tests/schemes/int8/test_int8.py and
tests/reference/measure_errors.py; not a test module).

The full product of (dtype x activation x input scale) - the axes that change which code runs
inside the kernels - and every PAIR of values of all seven axes covered at least once (a greedy
covering array, built deterministically below). tests/engine/test_kernels.py's
``test_matrix_is_what_it_claims`` pins its size and proves the coverage, so an axis cannot
silently lose a value.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tests.conftest import MoeInputs, make_moe_inputs

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
E = 5  # experts: not a multiple of the 2 CI threads, nor of anything else

# activation variant -> fused_experts keyword arguments. The non-default swigluoai clamps
# hard (limit 0.75 is inside the N(0,1) range of the gate/up values at input scale 1 and 4).
ACTIVATIONS = {
    "silu": dict(activation="silu"),
    "gelu": dict(activation="gelu"),
    "gelu_tanh": dict(activation="gelu_tanh"),
    "swigluoai": dict(activation="swigluoai"),
    "swigluoai_a1.2_l0.75": dict(activation="swigluoai", alpha=1.2, limit=0.75),
}

# (H, I): neither a multiple of 16 or 32; H=93 is odd (K padding of w13 inside a k_pack pair),
# I=176 is 5.5 blocks of 32 (I padding inside the last block), I=40/88 pad to 64/96.
SHAPES = ((200, 88), (72, 40), (130, 176), (93, 88))

AXES = dict(
    dtype=(F32, BF16, F16),
    activation=tuple(ACTIVATIONS),
    x_scale=("1/sqrt(H)", "1", "4"),
    shape=SHAPES,
    tokens=(1, 3, 67),  # 67 with k=E: 67 rows per expert > one 64-row task chunk
    topk=(1, 2, E),
    bias=(False, True),
)
FULL_PRODUCT_AXES = ("dtype", "activation", "x_scale")


def covering_rows(axes: dict[str, tuple], full: tuple[str, ...]) -> list[dict]:
    """Rows (axis -> value) containing the full product of the ``full`` axes and covering
    every pair of values of any two axes. Greedy and deterministic: each row takes the
    candidate covering the most uncovered pairs, ties going to the values used least so far
    (so the cases spread over every value), then to the first candidate."""
    names = list(axes)
    uncovered = {
        (a, va, b, vb)
        for a, b in itertools.combinations(names, 2)
        for va in range(len(axes[a]))
        for vb in range(len(axes[b]))
    }

    def pairs(row: dict[str, int]):
        return {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}

    rest = [n for n in names if n not in full]
    used = {(n, v): 0 for n in names for v in range(len(axes[n]))}
    rows: list[dict[str, int]] = []

    def take(candidates) -> None:
        best, best_score = None, None
        for row in candidates:
            score = (len(pairs(row) & uncovered), -sum(used[n, row[n]] for n in names))
            if best_score is None or score > best_score:
                best, best_score = row, score
        rows.append(best)
        uncovered.difference_update(pairs(best))
        for n in names:
            used[n, best[n]] += 1

    for fixed in itertools.product(*(range(len(axes[n])) for n in full)):
        base = dict(zip(full, fixed))
        take({**base, **dict(zip(rest, other))} for other in itertools.product(*(range(len(axes[n])) for n in rest)))
    while uncovered:
        take(dict(zip(names, values)) for values in itertools.product(*(range(len(axes[n])) for n in names)))
    return [{n: axes[n][row[n]] for n in names} for row in rows]


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    activation: str  # key of ACTIVATIONS
    x_scale: str
    hidden: int
    intermediate: int
    tokens: int
    topk: int
    bias: bool
    seed: int

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        scale = self.x_scale.replace("/", "over").replace("(", "").replace(")", "")
        b = "bias" if self.bias else "nobias"
        return f"{dt}-{self.activation}-x{scale}-H{self.hidden}I{self.intermediate}-T{self.tokens}-k{self.topk}-{b}"

    @property
    def act_kwargs(self) -> dict:
        return ACTIVATIONS[self.activation]

    @property
    def interleaved(self) -> bool:
        return self.act_kwargs["activation"] == "swigluoai"

    def inputs(self) -> MoeInputs:
        return make_moe_inputs(
            tokens=self.tokens,
            hidden=self.hidden,
            intermediate=self.intermediate,
            experts=E,
            topk=self.topk,
            dtype=self.dtype,
            bias=self.bias,
            interleaved=self.interleaved,
            x_scale=self.x_scale,
            seed=self.seed,
        )


ROWS = covering_rows(AXES, FULL_PRODUCT_AXES)
CASES = [
    Case(
        dtype=r["dtype"],
        activation=r["activation"],
        x_scale=r["x_scale"],
        hidden=r["shape"][0],
        intermediate=r["shape"][1],
        tokens=r["tokens"],
        topk=r["topk"],
        bias=r["bias"],
        seed=1000 + n,
    )
    for n, r in enumerate(ROWS)
]
EXPECTED_CASES = 45  # 3 dtypes x 5 activations x 3 scales; their other axes already cover every pair
