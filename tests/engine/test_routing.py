"""torch.ops.moepack.route and moepack.routing: every method against the plain-torch reference
(moepack.routing.route_reference) and against transformers' own routers when transformers is
installed; the tie / -inf / NaN rules; refusals; opcheck; RoutingConfig.from_hf_config for every
family; route() with a custom function; apply_router_weight_on_input."""

from __future__ import annotations

import dataclasses
import importlib
import json
from types import SimpleNamespace

import pytest
import torch

import moepack
from moepack.errors import UnsupportedError
from moepack.routing import (
    METHODS,
    RoutingConfig,
    apply_router_weight_on_input,
    route,
    route_custom,
    route_op,
    route_reference,
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OPS = torch.ops.moepack
NEG_INF = float("-inf")
WEIGHT_ATOL = 1e-6  # per unit of routed_scaling_factor

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

RENORM_METHODS = ("softmax", "sigmoid", "grouped_softmax", "grouped_sigmoid")


def make_logits(kind: str, t: int, e: int, g: torch.Generator) -> torch.Tensor:
    """fp32 logits of one of four kinds: normal, ties (a coarse grid: many exact ties), large
    (+-1e4: softmax underflows, sigmoid saturates), neginf (60% -inf, row 0 all -inf, row 1 one
    finite)."""
    if kind == "normal":
        return torch.randn(t, e, generator=g) * 3
    if kind == "ties":
        return torch.round(torch.randn(t, e, generator=g) * 2) / 2
    if kind == "large":
        return torch.randn(t, e, generator=g) * 1e4
    assert kind == "neginf"
    x = torch.randn(t, e, generator=g) * 3
    x[torch.rand(t, e, generator=g) < 0.6] = NEG_INF
    x[0] = NEG_INF
    if t > 1:
        x[1, 1:] = NEG_INF
    return x


def assert_same_routing(w, ids, rw, rids, *, scale: float = 1.0, what: str = ""):
    """Identical id sets per token, weights (matched by id) within WEIGHT_ATOL * scale, no NaN."""
    assert w.dtype == F32 and ids.dtype == torch.int32 and w.is_contiguous() and ids.is_contiguous(), what
    assert w.shape == rw.shape and ids.shape == rids.shape, what
    assert not torch.isnan(w).any(), what
    si, so = torch.sort(ids.long(), dim=-1)
    ri, ro = torch.sort(rids.long(), dim=-1)
    bad = (si != ri).any(dim=-1).nonzero().flatten().tolist()
    assert not bad, f"{what}: id sets differ at tokens {bad[:5]}: {ids[bad[0]].tolist()} vs {rids[bad[0]].tolist()}"
    torch.testing.assert_close(w.gather(-1, so), rw.float().gather(-1, ro), atol=WEIGHT_ATOL * scale, rtol=0, msg=what)


def method_variants(method: str, e: int):
    """(k, kwargs) cases for one method and expert count: k in {1, 2, E} where allowed, with and
    without renormalize / correction bias / routed_scaling_factor / groups."""
    if method == "llama4":
        yield 1, {}
        return
    if method == "sparsemixer":
        yield 2, {}
        yield 2, {"sparsemixer_eps": 0.0}
        yield 2, {"sparsemixer_eps": 0.3, "routed_scaling_factor": 2.0}
        return
    for k in sorted({1, 2, e}):
        if method == "topk_softmax":
            yield k, {}
            continue
        for renorm in (False, True):
            for bias in (False, True):
                kw = {"renormalize": renorm, "routed_scaling_factor": 2.5 if renorm else 1.0, "bias": bias}
                if method in ("grouped_softmax", "grouped_sigmoid"):
                    groups = 4 if e == 16 else 8
                    per = e // groups
                    kw.update(num_expert_group=groups, topk_group=groups // 2 if k <= groups // 2 * per else groups)
                yield k, kw


KINDS = ("normal", "ties", "large", "neginf")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", METHODS)
def test_route_matches_reference(method, kind):
    g = torch.Generator().manual_seed(METHODS.index(method) * 10 + KINDS.index(kind))
    grouped = method.startswith("grouped")
    count = 0
    for dtype in (F32, BF16, F16):
        for t in (1, 7, 67):
            for e in (16, 24) if grouped else (2, 8, 13):
                x = make_logits(kind, t, e, g).to(dtype)
                for k, kw in method_variants(method, e):
                    kw = dict(kw)
                    if kw.pop("bias", False):
                        # with "ties", a zero bias keeps the exact ties exact: a bias on a grid
                        # makes ties of real numbers (p1 + 0.2 + p2 + 0.1 vs p1 + 0.1 + p2 + 0.2)
                        # that fp32 rounding breaks by 1 ulp, differently in any two implementations
                        b = torch.randn(e, generator=g) * 0.1
                        kw["correction_bias"] = torch.zeros(e) if kind == "ties" else b
                    w, ids = route_op(x, k, method, **kw)
                    rw, rids = route_reference(x, k, method, **kw)
                    what = f"{method} {kind} {dtype} T={t} E={e} k={k} {sorted(kw)}"
                    scale = kw.get("routed_scaling_factor", 1.0)
                    if method == "sqrtsoftplus":  # unbounded scores (sqrt(x) ~ 100 at 1e4): 1e-6 of the largest weight
                        scale *= max(1.0, float(rw.abs().max()))
                    assert_same_routing(w, ids, rw, rids, scale=scale, what=what)
                    count += 1
    # every (dtype, T, E, variant) combination ran: a filtering bug cannot silently drop a column
    assert count == EXPECTED_CASES[method]


# 3 dtypes x 3 T x (sum over E of the variants): E in {2, 8, 13} has k sets {1,2}, {1,2,8},
# {1,2,13} (8 k); grouped E in {16, 24} has 6 k; x4 for renormalize x bias.
EXPECTED_CASES = {"softmax": 9 * 8 * 4, "sigmoid": 9 * 8 * 4, "grouped_softmax": 9 * 6 * 4, "grouped_sigmoid": 9 * 6 * 4,
                  "topk_softmax": 9 * 8, "llama4": 9 * 3, "sparsemixer": 9 * 3 * 3, "sqrtsoftplus": 9 * 8 * 4,
                  "biased_logit_sigmoid": 9 * 8 * 4}  # fmt: skip


def test_route_large_t_parallel_equals_serial(threads):
    """T*E above the parallel threshold: the thread pool gives exactly the serial result."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3001, 64, generator=g)
    b = torch.randn(64, generator=g) * 0.1
    args = (8, "grouped_sigmoid", True, 8, 4, b, 2.5, 0.01)
    torch.set_num_threads(1)
    w1, i1 = OPS.route(x, *args)
    torch.set_num_threads(2)
    w2, i2 = OPS.route(x, *args)
    assert torch.equal(i1, i2) and torch.equal(w1, w2)
    rw, rids = route_reference(x, 8, "grouped_sigmoid", renormalize=True, num_expert_group=8, topk_group=4,
                               correction_bias=b, routed_scaling_factor=2.5)  # fmt: skip
    assert_same_routing(w2, i2, rw, rids, scale=2.5)
    # a NaN late in a large call is still reported at its own position
    x[2500, 7] = float("nan")
    with pytest.raises(ValueError, match=r"router_logits\[2500, 7\] is nan"):
        OPS.route(x, *args)


def test_route_strided_logits():
    """Rows of a wider tensor (row stride != E) and a transposed (non-unit column stride) view."""
    g = torch.Generator().manual_seed(4)
    big = torch.randn(9, 40, generator=g)
    view = big[:, 3:19]
    w, ids = route_op(view, 3, "softmax", renormalize=True)
    w2, ids2 = route_op(view.contiguous(), 3, "softmax", renormalize=True)
    assert torch.equal(w, w2) and torch.equal(ids, ids2)
    tv = torch.randn(16, 9, generator=g).t()
    w, ids = route_op(tv, 3, "sigmoid")
    w2, ids2 = route_op(tv.contiguous(), 3, "sigmoid")
    assert torch.equal(w, w2) and torch.equal(ids, ids2)


# --------------------------------------------------------------------------------------------
# The rules (ties, -inf, order, NaN), stated as examples


def test_ties_lower_id_wins_and_order_is_descending():
    x = torch.tensor([[0.5, 1.0, 0.5, 1.0, 0.0, 1.0]])
    w, ids = route_op(x, 4, "softmax")
    assert ids.tolist() == [[1, 3, 5, 0]]  # 1.0 x3 by id, then the first 0.5
    assert w[0, 0] == w[0, 1] == w[0, 2] and w[0, 0] > w[0, 3]
    w, ids = route_op(torch.zeros(2, 16), 3, "topk_softmax")
    assert ids.tolist() == [[0, 1, 2]] * 2
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3))
    # groups tie too: the lower group wins
    w, ids = route_op(torch.zeros(1, 8), 2, "grouped_sigmoid", num_expert_group=4, topk_group=1)
    assert ids.tolist() == [[0, 1]]


def test_selection_uses_logits_where_scores_saturate():
    """sigmoid(20) == sigmoid(30) == 1.0 in fp32; the larger logit still wins."""
    x = torch.tensor([[20.0, 30.0, -200.0, -300.0]])
    w, ids = route_op(x, 1, "sigmoid")
    assert ids.tolist() == [[1]] and w.tolist() == [[1.0]]
    w, ids = route_op(x, 3, "softmax")  # softmax(-200 - 30) and softmax(-300 - 30) are both 0.0
    assert ids.tolist() == [[1, 0, 2]] and w[0, 2] == 0.0


def test_neg_inf_rules():
    x = torch.full((1, 6), NEG_INF)
    for method, k, kw in [("softmax", 3, {}), ("softmax", 3, {"renormalize": True}), ("sigmoid", 2, {"renormalize": True}),
                          ("topk_softmax", 2, {}), ("llama4", 1, {}), ("sparsemixer", 2, {}),
                          ("grouped_softmax", 2, {"num_expert_group": 3, "topk_group": 2}),
                          ("grouped_sigmoid", 2, {"num_expert_group": 3, "topk_group": 1,
                                                  "correction_bias": torch.zeros(6)})]:  # fmt: skip
        w, ids = route_op(x, k, method, **kw)
        assert ids.tolist() == [list(range(k))], method  # all tie at -inf: the lowest ids
        assert w.tolist() == [[0.0] * k], method  # no NaN: nothing to weight
    # fewer than k finite: the finite ones first, then the lowest -inf ids with weight 0
    x = torch.tensor([[NEG_INF, 2.0, NEG_INF, 1.0, NEG_INF]])
    w, ids = route_op(x, 4, "softmax")
    assert ids.tolist() == [[1, 3, 0, 2]]
    assert w[0, 2:].tolist() == [0.0, 0.0] and abs(float(w[0, :2].sum()) - 1) < 1e-6
    w, ids = route_op(x, 2, "sparsemixer")
    assert ids.tolist() == [[1, 3]] and w[0, 0] == 1.0  # 1.0 is masked for expert 1: (2-1)/2 > 0.02
    x1 = torch.tensor([[NEG_INF, 2.0, NEG_INF]])
    w, ids = route_op(x1, 2, "sparsemixer")
    assert ids.tolist() == [[1, 0]] and w.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_nan_and_pos_inf_refused(bad, dtype):
    x = torch.randn(5, 12)
    x[3, 9] = bad
    x[4, 2] = bad
    with pytest.raises(ValueError, match=r"router_logits\[3, 9\] is (nan|inf).*refuses NaN and \+inf"):
        route_op(x.to(dtype), 2, "softmax")


def test_sparsemixer_by_hand():
    # eps = 0.01: the mask keeps s with (max - s) / max(|s|, max) <= 0.02
    x = torch.tensor([[1.0, 0.99, 0.5, 0.985]])
    w, ids = route_op(x, 2, "sparsemixer")
    e = torch.exp(torch.tensor([0.0, -0.01, -0.015]))
    w1 = 1 / e.sum()  # 1.0, 0.99 and 0.985 survive the mask around 1.0
    e2 = torch.exp(torch.tensor([0.0, -0.005]))  # around 0.99: 0.99 and 0.985 survive, 1.0 is expert 1
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.stack([w1, 1 / e2.sum()]).view(1, 2), atol=1e-7, rtol=0)


# --------------------------------------------------------------------------------------------
# Refusals: ONE clear error naming the argument, value and rule


X16 = torch.randn(3, 16)
B16 = torch.randn(16)
REFUSALS = {
    "unknown method": ((X16, 2, "softmaxx"), ValueError, ["method='softmaxx'", "grouped_sigmoid"]),
    "k = 0": ((X16, 0, "softmax"), ValueError, ["top_k=0", "[1, experts]"]),
    "k > E": ((X16, 17, "softmax"), ValueError, ["top_k=17", "16 experts"]),
    "E not a multiple of groups": ((X16, 2, "grouped_sigmoid", False, 3, 1), ValueError,
                                   ["num_expert_group=3", "does not divide", "16 experts", "multiple"]),
    "groups = 0 for grouped": ((X16, 2, "grouped_softmax", False, 0, 0), ValueError, ["num_expert_group=0", ">= 1"]),
    "topk_group > groups": ((X16, 2, "grouped_softmax", False, 4, 5), ValueError, ["topk_group=5", "num_expert_group=4"]),
    "topk_group = 0": ((X16, 2, "grouped_softmax", False, 4, 0), ValueError, ["topk_group=0"]),
    "k > kept experts": ((X16, 9, "grouped_sigmoid", False, 4, 2), ValueError, ["top_k=9", "8 experts", "topk_group=2"]),
    "groups with a non-grouped method": ((X16, 2, "sigmoid", False, 4, 2), ValueError, ["num_expert_group=4", "takes no groups"]),
    "llama4 k = 2": ((X16, 2, "llama4"), ValueError, ["top_k=2", "llama4", "top_k=1"]),
    "sparsemixer k = 3": ((X16, 3, "sparsemixer"), ValueError, ["top_k=3", "sparsemixer", "top_k=2"]),
    "sparsemixer eps < 0": ((X16, 2, "sparsemixer", False, 0, 0, None, 1.0, -0.1), ValueError, ["sparsemixer_eps=-0.1"]),
    "renormalize topk_softmax": ((X16, 2, "topk_softmax", True), ValueError, ["renormalize=True", "topk_softmax"]),
    "bias with llama4": ((X16, 1, "llama4", False, 0, 0, B16), ValueError, ["correction_bias", "llama4"]),
    "bias shape": ((X16, 2, "grouped_sigmoid", True, 4, 2, torch.randn(8)), ValueError, ["correction_bias", "[8]", "[16]"]),
    "bias dtype": ((X16, 2, "grouped_sigmoid", True, 4, 2, B16.bfloat16()), TypeError, ["correction_bias", "BFloat16"]),
    "bias non-finite": ((X16, 2, "grouped_sigmoid", True, 4, 2, torch.full((16,), float("nan"))), ValueError,
                        ["correction_bias[0]", "finite"]),
    "rsf = 0": ((X16, 2, "softmax", False, 0, 0, None, 0.0), ValueError, ["routed_scaling_factor=0", "> 0"]),
    "rsf = inf": ((X16, 2, "softmax", False, 0, 0, None, float("inf")), ValueError, ["routed_scaling_factor=inf"]),
    "logits float64": ((X16.double(), 2, "softmax"), TypeError, ["router_logits", "Double", "float32, bfloat16 or float16"]),
    "logits 3-D": ((X16.view(1, 3, 16), 2, "softmax"), ValueError, ["router_logits", "[1, 3, 16]", "2-D"]),
    "logits E = 0": ((torch.randn(3, 0), 1, "softmax"), ValueError, ["router_logits", "[3, 0]", "at least one expert"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refusals(name):
    args, exc, parts = REFUSALS[name]
    with pytest.raises(exc) as ei:
        OPS.route(*args)
    msg = str(ei.value).split("\n")[0]
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"
    # the Meta kernel refuses the same way (shapes only)
    meta_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) and name != "bias non-finite" else a for a in args)
    if name != "bias non-finite":  # a data check: only the CPU kernel sees values
        with pytest.raises(exc):
            OPS.route(*meta_args)


# --------------------------------------------------------------------------------------------
# opcheck / compile


OPCHECK_CASES = {
    "softmax f32": (torch.randn(5, 16), 4, "softmax", True),
    "sigmoid bf16": (torch.randn(3, 8).bfloat16(), 2, "sigmoid"),
    "grouped_sigmoid bias": (torch.randn(4, 16), 4, "grouped_sigmoid", True, 4, 2, torch.randn(16), 2.5, 0.01),
    "grouped_softmax f16": (torch.randn(2, 24).half(), 3, "grouped_softmax", False, 8, 3, None, 16.0),
    "topk_softmax": (torch.randn(6, 32), 4, "topk_softmax"),
    "llama4": (torch.randn(2, 16), 1, "llama4"),
    "sparsemixer": (torch.randn(3, 16), 2, "sparsemixer", False, 0, 0, None, 1.0, 0.05),
    "zero tokens": (torch.randn(0, 8), 2, "softmax"),
}


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck_route(name):
    torch.library.opcheck(OPS.route.default, OPCHECK_CASES[name])


def test_route_meta_and_compile():
    w, ids = OPS.route(torch.empty(7, 16, device="meta"), 3, "softmax")
    assert w.shape == (7, 3) and w.dtype == F32 and ids.shape == (7, 3) and ids.dtype == torch.int32
    x = torch.randn(5, 16)
    f = torch.compile(lambda x: OPS.route(x, 2, "topk_softmax"), fullgraph=True, backend="eager")
    w, ids = f(x)
    w2, ids2 = OPS.route(x, 2, "topk_softmax")
    assert torch.equal(w, w2) and torch.equal(ids, ids2)


# --------------------------------------------------------------------------------------------
# RoutingConfig.from_hf_config, one hand-written config.json per family


HF_CONFIGS = {
    "mixtral": ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0},
                dict(method="softmax", top_k=2, renormalize=True, num_experts=8)),
    "qwen2_moe": ({"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False},
                  dict(method="softmax", top_k=4, renormalize=False, num_experts=60)),
    "qwen3_moe": ({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True},
                  dict(method="softmax", top_k=8, renormalize=True, num_experts=128)),
    "olmoe": ({"model_type": "olmoe", "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False},
              dict(method="softmax", top_k=8, renormalize=False, num_experts=64)),
    "deepseek_v2": ({"model_type": "deepseek_v2", "n_routed_experts": 160, "num_experts_per_tok": 6, "n_group": 8,
                     "topk_group": 3, "topk_method": "group_limited_greedy", "scoring_func": "softmax",
                     "norm_topk_prob": False, "routed_scaling_factor": 16.0},
                    dict(method="grouped_softmax", top_k=6, num_expert_group=8, topk_group=3,
                         routed_scaling_factor=16.0, num_experts=160)),
    "deepseek_v2_lite": ({"model_type": "deepseek_v2", "n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 1,
                          "topk_group": 1, "topk_method": "greedy", "routed_scaling_factor": 1.0},
                         dict(method="softmax", top_k=6, num_experts=64)),
    "deepseek_v3": ({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
                     "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                     "routed_scaling_factor": 2.5},
                    dict(method="grouped_sigmoid", top_k=8, renormalize=True, num_expert_group=8, topk_group=4,
                         routed_scaling_factor=2.5, has_correction_bias=True, num_experts=256)),
    "kimi_k2": ({"model_type": "kimi_k2", "n_routed_experts": 384, "num_experts_per_tok": 8, "n_group": 1,
                 "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.827},
                dict(method="grouped_sigmoid", top_k=8, renormalize=True, num_expert_group=1, topk_group=1,
                     routed_scaling_factor=2.827, has_correction_bias=True, num_experts=384)),
    "kimi_k25": ({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", "n_routed_experts": 384,
                  "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                  "routed_scaling_factor": 2.827}},
                 dict(method="grouped_sigmoid", top_k=8, renormalize=True, num_expert_group=1, topk_group=1,
                      routed_scaling_factor=2.827, has_correction_bias=True, num_experts=384)),
    "kimi_linear": ({"model_type": "kimi_linear", "num_experts": 256, "num_experts_per_token": 8,
                     "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446},
                    dict(method="grouped_sigmoid", top_k=8, renormalize=True, num_expert_group=1, topk_group=1,
                         routed_scaling_factor=2.446, has_correction_bias=True, num_experts=256)),
    "glm4_moe": ({"model_type": "glm4_moe", "n_routed_experts": 160, "num_experts_per_tok": 8, "n_group": 1,
                  "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
                 dict(method="grouped_sigmoid", top_k=8, renormalize=True, num_expert_group=1, topk_group=1,
                      routed_scaling_factor=2.5, has_correction_bias=True, num_experts=160)),
    "granitemoe": ({"model_type": "granitemoe", "num_local_experts": 40, "num_experts_per_tok": 8},
                   dict(method="topk_softmax", top_k=8, num_experts=40)),
    "granitemoeshared": ({"model_type": "granitemoeshared", "num_local_experts": 32, "num_experts_per_tok": 8},
                         dict(method="topk_softmax", top_k=8, num_experts=32)),
    "gpt_oss": ({"model_type": "gpt_oss", "num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0},
                dict(method="topk_softmax", top_k=4, num_experts=32)),
    "llama4": ({"model_type": "llama4", "text_config": {"model_type": "llama4_text", "num_local_experts": 16,
                "num_experts_per_tok": 1}},
               dict(method="llama4", top_k=1, apply_router_weight_on_input=True, num_experts=16)),
    "llama4_text": ({"model_type": "llama4_text", "num_local_experts": 128, "num_experts_per_tok": 1},
                    dict(method="llama4", top_k=1, apply_router_weight_on_input=True, num_experts=128)),
    "phimoe": ({"model_type": "phimoe", "num_local_experts": 16, "num_experts_per_tok": 2, "router_jitter_noise": 0.01},
               dict(method="sparsemixer", top_k=2, sparsemixer_eps=0.01, num_experts=16)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_from_hf_config(name):
    cfg_json, want = HF_CONFIGS[name]
    cfg = RoutingConfig.from_hf_config(cfg_json)
    for key, value in want.items():
        assert getattr(cfg, key) == value, f"{name}: {key}={getattr(cfg, key)!r}, want {value!r}"
    # fields not named keep their defaults
    defaults = {f.name: f.default for f in dataclasses.fields(RoutingConfig)}
    for key in ("renormalize", "num_expert_group", "topk_group", "routed_scaling_factor", "has_correction_bias",
                "apply_router_weight_on_input", "sparsemixer_eps"):  # fmt: skip
        if key not in want:
            assert getattr(cfg, key) == defaults[key], f"{name}: {key}"
    assert cfg.model_type == cfg_json["model_type"]
    # JSON round trip (the manifest stores it)
    back = RoutingConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg


HF_REFUSED = {
    "unknown family": ({"model_type": "llama", "num_experts_per_tok": 2}, ["model_type='llama'", "known:"]),
    "no model_type": ({"num_experts_per_tok": 2}, ["model_type=None"]),
    "llama4 k=2": ({"model_type": "llama4_text", "num_local_experts": 16, "num_experts_per_tok": 2},
                   ["num_experts_per_tok=2", "top-1"]),
    "phimoe k=4": ({"model_type": "phimoe", "num_local_experts": 16, "num_experts_per_tok": 4}, ["sparsemixer"]),
    "deepseek_v2 noaux_tc": ({"model_type": "deepseek_v2", "n_routed_experts": 64, "num_experts_per_tok": 6,
                              "topk_method": "noaux_tc"}, ["topk_method='noaux_tc'"]),
    "deepseek_v3 softmax": ({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8,
                             "scoring_func": "softmax"}, ["scoring_func='softmax'"]),
    "deepseek_v3 E % groups": ({"model_type": "deepseek_v3", "n_routed_experts": 100, "num_experts_per_tok": 8,
                                "n_group": 8, "topk_group": 4}, ["num_experts=100", "num_expert_group=8"]),
    "no top_k": ({"model_type": "mixtral", "num_local_experts": 8}, ["num_experts_per_tok"]),
    "no experts": ({"model_type": "qwen3_moe", "num_experts_per_tok": 8}, ["num_experts"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HF_REFUSED))
def test_from_hf_config_refused(name):
    cfg_json, parts = HF_REFUSED[name]
    with pytest.raises(UnsupportedError) as ei:
        RoutingConfig.from_hf_config(cfg_json)
    for p in parts:
        assert p in str(ei.value), f"{p!r} not in {str(ei.value)!r}"


def test_routing_config_validation_and_dict():
    with pytest.raises(UnsupportedError, match="method='nope'"):
        RoutingConfig("nope", 2)
    with pytest.raises(UnsupportedError, match="scoring_func='sigmoid' contradicts"):
        RoutingConfig("softmax", 2, scoring_func="sigmoid")
    with pytest.raises(UnsupportedError, match="apply_router_weight_on_input=True with top_k=2"):
        RoutingConfig("sigmoid", 2, apply_router_weight_on_input=True)
    with pytest.raises(UnsupportedError, match="takes no groups"):
        RoutingConfig("softmax", 2, num_expert_group=4, topk_group=2)
    with pytest.raises(UnsupportedError, match="unknown keys"):
        RoutingConfig.from_dict({"method": "softmax", "top_k": 2, "typo": 1})
    c = RoutingConfig("grouped_sigmoid", 8, True, 8, 4, routed_scaling_factor=2.5, has_correction_bias=True)
    assert c.scoring_func == "sigmoid"
    d = c.to_dict()
    assert set(d) >= {"method", "top_k", "renormalize", "num_expert_group", "topk_group", "scoring_func",
                      "routed_scaling_factor", "has_correction_bias", "apply_router_weight_on_input",
                      "sparsemixer_eps"}  # fmt: skip
    assert RoutingConfig.from_dict(json.loads(json.dumps(d))) == c


# --------------------------------------------------------------------------------------------
# route(), custom functions, apply_router_weight_on_input


def test_route_with_config():
    g = torch.Generator().manual_seed(5)
    cfg = RoutingConfig.from_hf_config(HF_CONFIGS["deepseek_v3"][0])
    x = torch.randn(4, 256, generator=g).bfloat16()
    b = torch.randn(256, generator=g) * 0.1
    w, ids = route(x, cfg, b)
    rw, rids = route_reference(x, 8, "grouped_sigmoid", renormalize=True, num_expert_group=8, topk_group=4,
                               correction_bias=b, routed_scaling_factor=2.5)  # fmt: skip
    assert_same_routing(w, ids, rw, rids, scale=2.5)
    with pytest.raises(UnsupportedError, match="needs correction_bias"):
        route(x, cfg)
    with pytest.raises(UnsupportedError, match="has_correction_bias=False"):
        route(x[:, :8].float(), RoutingConfig("softmax", 2), torch.zeros(8))
    with pytest.raises(UnsupportedError, match="num_experts=256"):
        route(x[:, :128], cfg, b[:128])
    with pytest.raises(UnsupportedError, match="needs a custom_fn"):
        route(x, RoutingConfig("custom", 2))


def test_route_custom_function():
    x = torch.randn(5, 8)
    hidden = torch.randn(5, 12)
    seen = {}

    def fn(h, logits, k):
        seen["args"] = (h, logits, k)
        v, i = torch.topk(logits, k)
        return v.double().t().contiguous().t(), i  # float64, non-contiguous; int64 ids

    w, ids = route(x, RoutingConfig("custom", 3), hidden=hidden, custom_fn=fn)
    assert seen["args"][0] is hidden and seen["args"][1] is x and seen["args"][2] == 3
    assert w.dtype == F32 and ids.dtype == torch.int32 and w.is_contiguous() and ids.is_contiguous()
    assert torch.equal(ids.long(), torch.topk(x, 3).indices)
    bad = {
        "not a tuple": (lambda h, x, k: torch.zeros(5, k), "must return (topk_weights, topk_ids)"),
        "weights shape": (lambda h, x, k: (torch.zeros(5, k + 1), torch.zeros(5, k, dtype=torch.long)), "[tokens=5, k=3]"),
        "ids shape": (lambda h, x, k: (torch.zeros(5, k), torch.zeros(4, k, dtype=torch.long)), "[tokens=5, k=3]"),
        "ids float": (lambda h, x, k: (torch.zeros(5, k), torch.zeros(5, k)), "integer dtype"),
        "ids >= E": (lambda h, x, k: (torch.zeros(5, k), torch.full((5, k), 8)), "[8, 8]: must be in [0, 8)"),
        "ids < 0": (lambda h, x, k: (torch.zeros(5, k), torch.full((5, k), -1)), "must be in [0, 8)"),
        "weights int": (lambda h, x, k: (torch.zeros(5, k, dtype=torch.long), torch.zeros(5, k, dtype=torch.long)),
                        "must be floating"),
        "weights nan": (lambda h, x, k: (torch.full((5, k), float("nan")), torch.zeros(5, k, dtype=torch.long)),
                        "non-finite"),
    }  # fmt: skip
    for name, (f, part) in bad.items():
        with pytest.raises(UnsupportedError) as ei:
            route_custom(f, hidden, x, 3)
        assert part in str(ei.value), f"{name}: {part!r} not in {str(ei.value)!r}"
    # a custom_fn overrides the configured method
    w2, ids2 = route(x, RoutingConfig("softmax", 3), hidden=hidden, custom_fn=fn)
    assert torch.equal(ids2, ids)


def test_apply_router_weight_on_input_with_fused_experts():
    """Llama-4 layer: scale the input by the top-1 weight, run the experts with weight 1."""
    from moepack.reference import moe_reference
    from tests.conftest import make_moe_inputs

    inp = make_moe_inputs(tokens=5, hidden=64, intermediate=32, experts=4, topk=1, dtype=F32, seed=7)
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(8))
    cfg = RoutingConfig.from_hf_config({"model_type": "llama4_text", "num_local_experts": 4, "num_experts_per_tok": 1})
    w, ids = route(logits, cfg)
    scaled, ones = apply_router_weight_on_input(inp.x, w, ids)
    assert ones.dtype == F32 and torch.equal(ones, torch.ones(5, 1))
    torch.testing.assert_close(scaled, inp.x * torch.sigmoid(logits.max(dim=-1, keepdim=True).values))
    out = moepack.fused_experts(scaled, *(lambda p: (p.w13, p.w2))(inp.pack()), ones, ids)
    # HF Llama4TextMoe: experts(x * score), summed with no further weight
    want = moe_reference(inp.x * w, inp.w13, inp.w2, torch.ones(5, 1), ids)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(UnsupportedError, match="top_k=2"):
        apply_router_weight_on_input(inp.x, torch.ones(5, 2), torch.zeros(5, 2, dtype=torch.int32))
    with pytest.raises(UnsupportedError, match="hidden"):
        apply_router_weight_on_input(inp.x[:3], w, ids)


def test_bench_smoke():
    """tools/bench_routing.py (the routing benchmark, kept out of the library) runs and prints
    every case; its numbers are not judged here."""
    import pathlib
    import subprocess
    import sys

    import os

    root = pathlib.Path(__file__).resolve().parents[2]
    tool = root / "tools" / "bench_routing.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))  # this checkout
    r = subprocess.run([sys.executable, str(tool), "--calls", "3", "--repeats", "1"], capture_output=True, text=True,
                       timeout=300, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "grouped_sigmoid E=256" in r.stdout and "sparsemixer E=16" in r.stdout


# --------------------------------------------------------------------------------------------
# Against transformers' own routers (when transformers is installed)


def _hf_router(module: str, cls: str, **attrs):
    """A transformers router module on a duck-typed config whose weight is the identity, so that
    its router logits are exactly its input (the hidden size is E)."""
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    e = attrs["num_experts"]
    cfg = SimpleNamespace(hidden_size=e, num_local_experts=e, n_routed_experts=e, router_jitter_noise=0.0,
                          input_jitter_noise=0.0, **attrs)  # fmt: skip
    router = getattr(mod, cls)(cfg).eval()
    with torch.no_grad():
        router.weight.copy_(torch.eye(e))
    return router


def _hf_logits(t, e, seed):
    # continuous values: no exact ties (transformers' torch.topk breaks ties its own way)
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * 2


HF_ROUTERS = {
    # name: (module, class, attrs, op method, op kwargs, family config.json for from_hf_config)
    "mixtral": ("mixtral", "MixtralTopKRouter", dict(num_experts=8, num_experts_per_tok=2), "softmax",
                dict(renormalize=True), {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeTopKRouter", dict(num_experts=60, num_experts_per_tok=4, norm_topk_prob=False),
                  "softmax", {}, {"model_type": "qwen2_moe", "num_experts": 60, "num_experts_per_tok": 4}),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeTopKRouter", dict(num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),
                  "softmax", dict(renormalize=True),
                  {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True}),
    "olmoe": ("olmoe", "OlmoeTopKRouter", dict(num_experts=64, num_experts_per_tok=8, norm_topk_prob=False), "softmax",
              {}, {"model_type": "olmoe", "num_experts": 64, "num_experts_per_tok": 8}),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2TopkRouter",
                    dict(num_experts=160, num_experts_per_tok=6, routed_scaling_factor=16.0,
                         topk_method="group_limited_greedy", n_group=8, topk_group=3),
                    "grouped_softmax", dict(num_expert_group=8, topk_group=3, routed_scaling_factor=16.0),
                    {"model_type": "deepseek_v2", "n_routed_experts": 160, "num_experts_per_tok": 6, "n_group": 8,
                     "topk_group": 3, "topk_method": "group_limited_greedy", "routed_scaling_factor": 16.0}),
    "deepseek_v2_greedy": ("deepseek_v2", "DeepseekV2TopkRouter",
                           dict(num_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.0, topk_method="greedy",
                                n_group=1, topk_group=1),
                           "softmax", {}, {"model_type": "deepseek_v2", "n_routed_experts": 64,
                                           "num_experts_per_tok": 6, "topk_method": "greedy"}),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3TopkRouter",
                    dict(num_experts=256, num_experts_per_tok=8, routed_scaling_factor=2.5, n_group=8, topk_group=4,
                         norm_topk_prob=True),
                    "grouped_sigmoid", dict(renormalize=True, num_expert_group=8, topk_group=4,
                                            routed_scaling_factor=2.5),
                    {"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8}),
    "glm4_moe": ("glm4_moe", "Glm4MoeTopkRouter",
                 dict(num_experts=128, num_experts_per_tok=8, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                      norm_topk_prob=True),
                 "grouped_sigmoid", dict(renormalize=True, num_expert_group=1, topk_group=1),
                 {"model_type": "glm4_moe", "n_routed_experts": 128, "num_experts_per_tok": 8}),
    "kimi_linear": ("kimi_linear", "KimiLinearTopkRouter",
                    dict(num_experts=64, num_experts_per_tok=6, routed_scaling_factor=2.446, n_group=4, topk_group=2,
                         norm_topk_prob=True),
                    "grouped_sigmoid", dict(renormalize=True, num_expert_group=4, topk_group=2,
                                            routed_scaling_factor=2.446),
                    {"model_type": "kimi_linear", "num_experts": 64, "num_experts_per_token": 6,
                     "num_expert_group": 4, "topk_group": 2}),
    "gpt_oss": ("gpt_oss", "GptOssTopKRouter", dict(num_experts=32, num_experts_per_tok=4), "topk_softmax", {},
                {"model_type": "gpt_oss", "num_local_experts": 32, "num_experts_per_tok": 4}),
    "granitemoe": ("granitemoe", "GraniteMoeTopKRouter", dict(num_experts=40, num_experts_per_tok=8), "topk_softmax",
                   {}, {"model_type": "granitemoe", "num_local_experts": 40, "num_experts_per_tok": 8}),
    "llama4": ("llama4", "Llama4Router", dict(num_experts=16, num_experts_per_tok=1), "llama4", {},
               {"model_type": "llama4_text", "num_local_experts": 16, "num_experts_per_tok": 1}),
    "deepseek_v4": ("deepseek_v4", "DeepseekV4TopKRouter",
                    dict(num_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus"),
                    "sqrtsoftplus", dict(renormalize=True, routed_scaling_factor=1.5),
                    {"model_type": "deepseek_v4", "n_routed_experts": 64, "num_experts_per_tok": 6}),
    "kolibri1": ("kolibri1", "Kolibri1TopKRouter", dict(num_experts=32, num_experts_per_tok=4, norm_topk_prob=True),
                 "biased_logit_sigmoid", dict(renormalize=True),
                 {"model_type": "kolibri1", "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True}),
    "phimoe": ("phimoe", "PhimoeTopKRouter", dict(num_experts=16, num_experts_per_tok=2), "sparsemixer",
               dict(sparsemixer_eps=0.0), {"model_type": "phimoe", "num_local_experts": 16, "num_experts_per_tok": 2,
                                           "router_jitter_noise": 0.0}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HF_ROUTERS))
def test_route_matches_transformers(name):
    module, cls, attrs, method, kw, family = HF_ROUTERS[name]
    router = _hf_router(module, cls, **attrs)
    e, k = attrs["num_experts"], attrs["num_experts_per_tok"]
    if name == "phimoe":  # the eps of the test config: the sparsemixer mask threshold
        router.router_jitter_noise = kw["sparsemixer_eps"] = 0.01
        family = dict(family, router_jitter_noise=0.01)
    x = _hf_logits(67, e, seed=len(name))
    bias = None
    if hasattr(router, "e_score_correction_bias"):
        bias = torch.randn(e, generator=torch.Generator().manual_seed(1)) * 0.1
        router.e_score_correction_bias.copy_(bias)
        kw = dict(kw, correction_bias=bias)
    if hasattr(router, "bias") and isinstance(router.bias, torch.Tensor):  # gpt-oss: the router Linear's bias
        router.bias.data.copy_(torch.randn(e, generator=torch.Generator().manual_seed(2)))
    with torch.no_grad():
        out = router(x)
    if name == "llama4":  # (scores [T, E] with 0 off the chosen expert, logits)
        scores, logits = out
        hf_ids = scores.argmax(dim=-1, keepdim=True)
        hf_w = scores.gather(-1, hf_ids)
    else:
        logits, hf_w, hf_ids = out
    assert torch.equal(logits, x @ torch.eye(e).t() + (router.bias if name == "gpt_oss" else 0))
    w, ids = route_op(logits, k, method, **kw)
    scale = kw.get("routed_scaling_factor", 1.0)
    assert_same_routing(w, ids, hf_w.float(), hf_ids, scale=scale, what=f"op vs transformers {cls}")
    rw, rids = route_reference(logits, k, method, **kw)
    assert_same_routing(rw, rids, hf_w.float(), hf_ids, scale=scale, what=f"reference vs transformers {cls}")
    # from_hf_config on the family's config.json gives the same routing
    cfg = RoutingConfig.from_hf_config(family)
    w2, ids2 = route(logits, cfg, bias)
    assert torch.equal(w2, w) and torch.equal(ids2, ids)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_route_by_token_matches_transformers_hash_router(scoring):
    """DeepSeek-V4's hash layers (DeepseekV4HashRouter): the ids are tid2eid[input_ids], the
    weights the scores at those ids, renormalized, x routed_scaling_factor."""
    from moepack.routing import route_by_token

    e, k, vocab = 16, 4, 50
    router = _hf_router("deepseek_v4", "DeepseekV4HashRouter", num_experts=e, num_experts_per_tok=k,
                        routed_scaling_factor=1.5, scoring_func=scoring, vocab_size=vocab)  # fmt: skip
    g = torch.Generator().manual_seed(7)
    table = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(vocab)])
    router.tid2eid.copy_(table)
    x = _hf_logits(23, e, seed=3)
    tok = torch.randint(0, vocab, (1, 23), generator=g)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x, tok)
    cfg = RoutingConfig.from_hf_config({"model_type": "deepseek_v4", "n_routed_experts": e, "num_experts_per_tok": k,
                                        "scoring_func": scoring})  # fmt: skip
    w, ids = route_by_token(logits, cfg, table, tok)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(w, hf_w.float(), atol=WEIGHT_ATOL * 1.5, rtol=0)
    # the table's dtype as stored (int64 in the checkpoint) or int32 routes alike
    assert torch.equal(route_by_token(logits, cfg, table.int(), tok[0])[1], ids)


def test_ernie_and_lfm2_routers_match_transformers():
    """ernie4_5_moe (softmax + moe_statics correction bias, / max(sum, 1e-12)) and lfm2_moe (sigmoid +
    expert_bias, / (sum + 1e-6), x rsf) through from_hf_config against transformers' own routers:
    the same ids, weights within 1e-6 (lfm2's 1e-6 in the denominator is at most 1e-6 / sum relative)."""
    e, k = 16, 4
    g = torch.Generator().manual_seed(11)
    x = _hf_logits(31, e, seed=9)
    bias = torch.randn(e, generator=g) * 0.05
    ernie = _hf_router("ernie4_5_moe", "Ernie4_5_MoeTopKRouter", num_experts=e, num_experts_per_tok=k, moe_norm_min=1e-12)
    ernie.moe_statics.e_score_correction_bias.data.copy_(bias[None])
    with torch.no_grad():
        logits, hf_w, hf_ids = ernie(x)
    cfg = RoutingConfig.from_hf_config({"model_type": "ernie4_5_moe", "moe_num_experts": e, "moe_k": k})
    assert_same_routing(*route(logits, cfg, bias), hf_w.float(), hf_ids, what="ernie4_5_moe")
    lfm = _hf_router("lfm2_moe", "Lfm2MoeTopKRouter", num_experts=e, num_experts_per_tok=k, norm_topk_prob=True,
                     routed_scaling_factor=2.0, use_expert_bias=True)  # fmt: skip
    with torch.no_grad():
        logits, hf_w, hf_ids = lfm(x, bias)
    cfg = RoutingConfig.from_hf_config({"model_type": "lfm2_moe", "num_experts": e, "num_experts_per_tok": k,
                                        "routed_scaling_factor": 2.0})  # fmt: skip
    assert_same_routing(*route(logits, cfg, bias), hf_w.float(), hf_ids, scale=2.0, what="lfm2_moe")


def test_route_by_token_refusals():
    from moepack.routing import route_by_token

    cfg = RoutingConfig.from_hf_config({"model_type": "deepseek_v4", "n_routed_experts": 8, "num_experts_per_tok": 2})
    table = torch.tensor([[0, 1], [2, 3], [4, 9]])
    x = torch.randn(2, 8)
    with pytest.raises(UnsupportedError, match=r"token_ids is torch.float32 \[2\]: hash routing needs one integer token id"):
        route_by_token(x, cfg, table, torch.zeros(2))
    with pytest.raises(UnsupportedError, match=r"token_ids in \[0, 3\]: the layer's hash table has 3 rows"):
        route_by_token(x, cfg, table, torch.tensor([0, 3]))
    with pytest.raises(UnsupportedError, match=r"expert ids in \[4, 9\]: router_logits has 8 experts"):
        route_by_token(x, cfg, table, torch.tensor([2, 2]))
    with pytest.raises(UnsupportedError, match="hash table is \\[3, 2\\]: the routing picks top_k=3"):
        route_by_token(x, dataclasses.replace(cfg, top_k=3), table, torch.tensor([0, 1]))


def test_sparsemixer_matches_transformers_function():
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    g = torch.Generator().manual_seed(11)
    for eps in (0.0, 0.01, 0.1, 0.5):
        # near-equal logits so that the mask keeps several experts
        x = torch.randn(67, 16, generator=g) * 0.05 + 1.0
        x[::3] = torch.randn(23, 16, generator=g) * 2
        hf_w, hf_ids = sparsemixer(x.clone(), jitter_eps=eps, training=False)
        w, ids = route_op(x, 2, "sparsemixer", sparsemixer_eps=eps)
        assert torch.equal(ids.long(), hf_ids), eps  # same order too: expert 1, then expert 2
        torch.testing.assert_close(w, hf_w, atol=1e-6, rtol=0)


def test_from_hf_config_on_transformers_config_classes():
    """config.json as transformers writes it (to_dict of the config classes, with their defaults)."""
    import transformers as tf

    cases = [
        (tf.MixtralConfig(), dict(method="softmax", renormalize=True, top_k=2, num_experts=8)),
        (tf.Qwen3MoeConfig(), dict(method="softmax", renormalize=False, top_k=8, num_experts=128)),
        (tf.DeepseekV3Config(), dict(method="grouped_sigmoid", renormalize=True, num_expert_group=8, topk_group=4,
                                     routed_scaling_factor=2.5, has_correction_bias=True, num_experts=256)),
        (tf.Glm4MoeConfig(), dict(method="grouped_sigmoid", num_expert_group=1, topk_group=1, num_experts=128)),
        (tf.GptOssConfig(), dict(method="topk_softmax", top_k=4, num_experts=128)),
        (tf.PhimoeConfig(), dict(method="sparsemixer", top_k=2, sparsemixer_eps=0.01, num_experts=16)),
        (tf.Llama4TextConfig(), dict(method="llama4", top_k=1, apply_router_weight_on_input=True, num_experts=16)),
        (tf.Llama4Config(), dict(method="llama4", top_k=1, num_experts=16)),
    ]  # fmt: skip
    for config, want in cases:
        cfg = RoutingConfig.from_hf_config(json.loads(config.to_json_string()))
        for key, value in want.items():
            assert getattr(cfg, key) == value, f"{type(config).__name__}: {key}={getattr(cfg, key)!r}"


# --------------------------------------------------------------------------------------------
# Against the tiny real checkpoints under fixtures/ (transformers' router with real weights)


def _fixture_names():
    from tests.support.fixtures_util import fixture_names

    try:
        return fixture_names()
    except Exception:  # pragma: no cover - fixtures missing
        return []


@pytest.mark.parametrize("name", _fixture_names())
def test_route_matches_fixture_models(name):
    from tests.support.fixtures_util import fixture_dir, fixture_info, load_hf_model, moe_block
    from tests.support.fixtures_util import route as hf_route

    config = json.loads((fixture_dir(name) / "config.json").read_text())
    cfg = RoutingConfig.from_hf_config(config)
    assert "quantization_config" not in config  # fixture_names(): the dense fixtures (the quantized ones' routers are theirs)
    model = load_hf_model(name, dtype=F32)  # the fp32 oracle: bf16 near-ties would be noise
    g = torch.Generator().manual_seed(12)
    for layer in fixture_info(name)["moe_layers"]:
        block, _ = moe_block(model, layer)
        x = torch.randn(67, model.config.hidden_size, generator=g)
        logits, hf_w, hf_ids = hf_route(block, x)
        gate = getattr(block, "gate", None)
        bias = getattr(gate, "e_score_correction_bias", None)
        w, ids = route(logits.float(), cfg, None if bias is None else bias.detach().float())
        assert_same_routing(w, ids, hf_w.float(), hf_ids, scale=cfg.routed_scaling_factor,
                            what=f"{name} layer {layer} ({cfg.method})")  # fmt: skip
        if cfg.method == "sparsemixer":  # order matters there: expert 1, then expert 2
            assert torch.equal(ids.long(), hf_ids)
