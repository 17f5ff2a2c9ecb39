"""``moepack tune``: the kernel variants timed on this host, the fastest kept (moepack/variants.py).

What it measures, per (layout, activation mode, token class) and per shape:

* random bf16 experts of the shape (``run.make_weights``; at most ``MAX_TUNE_BF16_BYTES`` of
  them, made once: the reads still come from memory, not the caches, and quantizing them stays
  quick), packed once per layout for this CPU (``pack_experts``);
* the candidates: the build's default twice (``default`` and ``default (again)``: their spread is
  the run's noise), then one change of one knob at a time (the knobs the selected kernel reads,
  ``variants.knobs``, plus the driver's ``walk`` and ``touch``);
* calls in rounds; in every round each candidate runs once, in a shuffled order, each call on its
  own routing (``RoutingStream``: consecutive single-token calls share no expert, so no call
  finds its weights in the cache from the one before); per candidate the median time;
* per candidate the geometric mean over the shapes of its median over the default's; a candidate
  wins only when it beats the better default by more than the two defaults' spread plus
  ``MARGIN``. The single-knob winners are then combined and timed the same way against the best
  single change; the faster is kept.

The picks go to the machine's tune cache (variants.write_cache) and into this process's table.
"""

from __future__ import annotations

import gc
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import variants as V
from ..isa import host_family
from .run import make_weights
from .shapes import DTYPES, MoeShape
from .timing import RoutingStream, median

MARGIN = 0.015  # a candidate must be this much faster than the default, beyond the run's noise
MAX_TUNE_BF16_BYTES = 512 << 20  # the experts made per shape (bf16): fewer experts when a shape has more
DEFAULT_TOKENS = (1, 8)  # the decode classes; T > 16 (prefill) on request (--tokens 1,8,512)
DEFAULT_SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b")

# The values each knob is tried at (the defaults are the build's: walk=guided, pair=0, streams=0
# (the process's choice), touch=0, pf=-1 (each kernel's own)).
KNOB_VALUES = {
    "walk": ("static", "stride"),
    "touch": ("16", "64"),
    "pair": ("1",),
    "streams": ("1", "4"),
    "pf": ("0", "512", "2048", "4096"),
    "nta": ("1",),  # tried where the kernel reads pf
    "dot": ("fp32", "bf16"),
}


def default_schemes() -> list[tuple[str, str]]:
    """Every scheme of the registry, in each activation mode its layout for this CPU serves."""
    from ..schemes import schemes

    out = []
    for sc in schemes():
        out += [(sc.name, mode) for mode in sc.layout_for(host_family()).act_modes]
    return out


@dataclass
class TuneConfig:
    shapes: list[MoeShape]
    schemes: list[tuple[str, str | None]] = field(default_factory=default_schemes)
    tokens: list[int] = field(default_factory=lambda: list(DEFAULT_TOKENS))
    threads: int = 2
    dtype: str = "bf16"
    seconds_per_case: float = 1.5  # timing per (scheme, shape, T) and phase, at least MIN_ROUNDS rounds
    seed: int = 0
    extra: list[str] = field(default_factory=list)  # more candidates (tests: a deliberately slow one)
    only: list[str] | None = None  # tests: exactly these candidates instead of the knobs' values
    base: str = ""  # tests: the spec the two default arms run (a deliberately slow default)
    packed: str | None = None  # a packed directory: its layers' experts, layout and act mode instead of shapes/schemes
    max_layers: int = 2  # from a packed directory, the first this many MoE layers (each a "shape")


MIN_ROUNDS = 9
MAX_ROUNDS = 400


@dataclass
class CaseResult:
    """One (layout, act mode, token class): the candidates' ratios and the pick."""

    layout: str
    act_mode: str
    tclass: str
    ratios: dict[str, float]  # candidate spec -> geometric mean over shapes of its median / default's
    noise: float  # the two defaults' spread (a ratio - 1)
    pick: str  # "" = the default
    gain: float  # default time / pick time
    note: str = ""


def candidates(knobs: list[str], extra: list[str]) -> list[str]:
    """The single-knob changes for a kernel that reads ``knobs`` (walk and touch always)."""
    out = []
    for k in ("walk", "touch", *[x for x in ("pair", "streams", "pf", "dot") if x in knobs]):
        out += [f"{k}={v}" for v in KNOB_VALUES[k]]
        if k == "pf":
            out += [f"nta={v}" for v in KNOB_VALUES["nta"]]
    return out + list(extra)


def _time_arms(arms: dict[str, Callable[[int], object]], rounds: int, rng: random.Random) -> dict[str, list[float]]:
    """Each arm once per round in a shuffled order; arm(i) runs routing i (fresh per call)."""
    times: dict[str, list[float]] = {a: [] for a in arms}
    names = list(arms)
    call = 0
    for _ in range(rounds):
        rng.shuffle(names)
        for a in names:
            t0 = time.perf_counter()
            arms[a](call)
            times[a].append(time.perf_counter() - t0)
            call += 1
    return times


class _Case:
    """One shape and T of one layout: packed experts, activations, routings, and a runner that
    sets the variant before each call (the table entry of this layout, mode and class)."""

    def __init__(self, packed, layout, act_mode: str, shape: MoeShape, tokens: int, dtype, seed: int,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
        from ..runtime.experts import run_experts

        self.layout, self.act_mode, self.tokens, self.tc = layout, act_mode, tokens, V.token_class(tokens)
        self.act = {"activation": activation, "alpha": alpha, "limit": limit}
        gx = torch.Generator().manual_seed(seed)
        self.x = torch.randn(tokens, shape.hidden, generator=gx).to(dtype)
        stream = RoutingStream(tokens, shape.num_experts, shape.topk, seed=seed + 1)
        self.routings = [stream.next()[:2] for _ in range(64)]
        self.packed = packed
        self._run = run_experts

    def call(self, spec: str, i: int):
        V.set_variant(self.layout, self.act_mode, self.tc, spec or None)
        w, ids = self.routings[i % len(self.routings)]
        return self._run(self.packed, self.x, w, ids, act_mode=self.act_mode, **self.act)

    def estimate(self, spec: str = "") -> float:
        for i in range(3):
            self.call(spec, i)
        t0 = time.perf_counter()
        for i in range(5):
            self.call(spec, i)
        return (time.perf_counter() - t0) / 5


def _measure(cases: list[_Case], specs: list[str], cfg: TuneConfig, rng: random.Random) -> tuple[dict[str, float], float]:
    """Geometric mean over ``cases`` of each spec's median / the default's (the better of the two
    default arms), and the noise (the defaults' spread, averaged over the cases)."""
    logs: dict[str, list[float]] = {s: [] for s in specs}
    spreads = []
    for case in cases:
        est = case.estimate(cfg.base)
        arms_specs = [cfg.base, cfg.base, *specs]
        names = ["default", "default (again)", *specs]
        rounds = int(min(MAX_ROUNDS, max(MIN_ROUNDS, cfg.seconds_per_case / max(est * len(names), 1e-6))))
        arms = {n: (lambda i, s=s: case.call(s, i)) for n, s in zip(names, arms_specs)}
        t = _time_arms(arms, rounds, rng)
        d1, d2 = median(t["default"]), median(t["default (again)"])
        base = min(d1, d2)
        spreads.append(abs(d1 - d2) / base)
        for s in specs:
            logs[s].append(math.log(median(t[s]) / base))
        V.set_variant(case.layout, case.act_mode, case.tc, None)
    ratios = {s: math.exp(sum(v) / len(v)) for s, v in logs.items()}
    return ratios, sum(spreads) / len(spreads)


def _groups_from_shapes(cfg: TuneConfig, log):
    """(layout, act_mode, [(shape, packed experts, activation kwargs)]) per scheme and mode of
    ``cfg``: random bf16 experts of each shape, made once, packed once per layout (a layout's two
    activation modes share its pack; packing is most of a tune's time)."""
    import moepack
    from ..schemes import get_scheme

    weights: dict[str, tuple] = {}  # shape name -> (trimmed shape, w13, w2)

    def canonical(shi: int, shape: MoeShape):
        if shape.name not in weights:
            e = max(2 * shape.topk, min(shape.num_experts, MAX_TUNE_BF16_BYTES // shape.canonical_bytes_per_expert))
            sh = MoeShape(shape.name, e, shape.topk, shape.hidden, shape.intermediate)
            weights[shape.name] = (sh, *make_weights(sh, cfg.seed + 1000 * shi))
        return weights[shape.name]

    by_layout: dict[str, list[str]] = {}  # layout name -> act modes asked, in order
    layouts = {}
    for scheme_name, mode in cfg.schemes:
        layout = get_scheme(scheme_name).layout_for(host_family())
        act_mode = mode or layout.act_modes[0]
        if act_mode not in layout.act_modes:
            log(f"{layout.name}: no {act_mode} mode, skipped")
            yield layout, act_mode, None
            continue
        layouts[layout.name] = layout
        modes = by_layout.setdefault(layout.name, [])
        if act_mode not in modes:
            modes.append(act_mode)
    for name, modes in by_layout.items():
        layout = layouts[name]
        packs = []
        for shi, shape in enumerate(cfg.shapes):
            sh, w13, w2 = canonical(shi, shape)
            log(f"{layout.name}: packing {sh.name} ({sh.describe()})")
            packs.append((sh, moepack.pack_experts(w13, w2, layout=layout), {}))
        for act_mode in modes:
            yield layout, act_mode, packs
        del packs
        gc.collect()


def _groups_from_packed(cfg: TuneConfig, log):
    """The first ``cfg.max_layers`` MoE layers of a packed directory, grouped by (layout, act mode)."""
    import moepack

    model = moepack.open(cfg.packed)
    topk = int((model.routing or {}).get("top_k") or (model.routing or {}).get("topk") or
               model.config.get("num_experts_per_tok") or 8)
    groups: dict[tuple[str, str], list] = {}
    for idx in sorted(model.layers)[: cfg.max_layers]:
        layer = model.layers[idx]
        pe = layer.packed
        k = min(topk, pe.num_experts)
        sh = MoeShape(f"layer {idx}", pe.num_experts, k, pe.hidden, pe.intermediate)
        act = {"activation": layer.activation, "alpha": layer.alpha, "limit": layer.limit}
        groups.setdefault((pe.layout.name, layer.act_mode), []).append((sh, pe, act))
    for (lay, mode), packs in groups.items():
        log(f"{lay} {mode}: {len(packs)} layer(s) of {cfg.packed}")
        yield lay, mode, packs


def tune(cfg: TuneConfig, log: Callable[[str], None] = lambda s: None,
         progress: Callable[[int, int], None] = lambda done, total: None) -> list[CaseResult]:
    """Time the candidates of every (layout, act mode, T) of ``cfg`` and pick per token class."""
    from ..layout import layout_get

    torch.set_num_threads(cfg.threads)
    rng = random.Random(cfg.seed)
    dtype = DTYPES[cfg.dtype]
    n_groups = 1 if cfg.packed else len(cfg.schemes)
    total = n_groups * len(cfg.tokens)
    done = 0
    results: list[CaseResult] = []
    groups = _groups_from_packed(cfg, log) if cfg.packed else _groups_from_shapes(cfg, log)
    for si, (layout, act_mode, packs) in enumerate(groups):
        layout = layout_get(layout)
        if packs is None:
            done += len(cfg.tokens)
            progress(done, total)
            continue
        knobs = V.knobs(layout, act_mode)
        for tokens in cfg.tokens:
            tc = V.TOKEN_CLASSES[V.token_class(tokens)]
            cases = [_Case(p, layout, act_mode, sh, tokens, dtype, cfg.seed + 7 * si + tokens, **act) for sh, p, act in packs]
            singles = list(cfg.only) if cfg.only is not None else candidates(knobs, cfg.extra)
            log(f"{layout.name} {act_mode} T={tokens}: {len(singles)} single-knob candidates")
            ratios, noise = _measure(cases, singles, cfg, rng)
            bar = 1.0 - noise - MARGIN
            winners: dict[str, tuple[str, float]] = {}  # knob -> its best value, where it beats the bar
            for s, r in ratios.items():
                k = s.split("=", 1)[0]
                if r < bar and (k not in winners or r < winners[k][1]):
                    winners[k] = (s, r)
            pick, pick_ratio, note = "", 1.0, ""
            if winners:
                # confirm in a second run against the default: the single winners combined (when
                # several knobs won) and the best single change; the fastest that beats the bar again
                best = min(winners.values(), key=lambda x: x[1])
                trial = [best[0]]
                if len(winners) > 1:
                    trial.insert(0, ",".join(v[0] for v in winners.values()))
                log(f"{layout.name} {act_mode} T={tokens}: confirming {' and '.join(trial)}")
                r2, noise2 = _measure(cases, trial, cfg, rng)
                ok = [(r2[t], t) for t in trial if r2[t] < 1.0 - noise2 - MARGIN]
                if ok:
                    pick_ratio, pick = min(ok)
                    if pick != best[0]:
                        note = f"combined; the best single change ({best[0]}) {1 / r2[best[0]]:.3f}x"
                else:
                    note = f"{best[0]} measured {1 / best[1]:.3f}x, then {1 / r2[best[0]]:.3f}x: kept the default"
            res = CaseResult(layout.name, act_mode, tc, ratios, noise, pick, 1.0 / pick_ratio if pick else 1.0, note)
            results.append(res)
            shown = ", ".join(f"{s} {r:.3f}" for s, r in sorted(ratios.items(), key=lambda x: x[1])[:4])
            log(f"{layout.name} {act_mode} T={tokens} ({tc}): noise {noise:.3f}; fastest {shown}; pick "
                f"{pick or 'default'}" + (f" ({res.gain:.3f}x)" if pick else ""))
            done += 1
            progress(done, total)
        del packs
        gc.collect()
    return results


def record_of(results: list[CaseResult], cfg: TuneConfig) -> V.TuneRecord:
    """The cache record of a tune: one choice per (layout, act mode, token class); where several
    token counts fall in one class, the first one tuned decides."""
    seen = set()
    choices = []
    for r in results:
        key = (r.layout, r.act_mode, r.tclass)
        if key in seen:
            continue
        seen.add(key)
        choices.append(V.Choice(r.layout, r.act_mode, r.tclass, r.pick, round(r.gain, 4), True,
                                r.note or f"noise {r.noise:.3f}"))
    return V.TuneRecord(facts=V.machine_facts(), threads=cfg.threads, measured_at=V.now_iso(),
                        shapes=[s.name for s in cfg.shapes], choices=choices)


def run_tune(cfg: TuneConfig, log: Callable[[str], None] = lambda s: None,
             progress: Callable[[int, int], None] = lambda done, total: None, write: bool = True):
    """tune, then write the cache (``write``) and apply the picks in this process. Returns
    (results, record, cache path or None)."""
    V.reset_table()
    results = tune(cfg, log, progress)
    rec = record_of(results, cfg)
    path = V.write_cache(rec) if write else None
    V.reset_table()
    V.apply_record(rec)
    return results, rec, path
