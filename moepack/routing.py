"""Routing: router logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int32).

SEMANTICS.md §1 is the contract and docs/ROUTING.md the full description (formulas, families,
ties, -inf). This module holds:

* ``RoutingConfig``: how one model family routes, derived from a Hugging Face ``config.json``
  dict (``RoutingConfig.from_hf_config``, by the recipe of ``RECIPES`` the family's
  ``moepack.families`` entry names) and stored in a packed model's manifest
  (``to_dict`` / ``from_dict``, JSON round-trippable).
* ``route(logits, cfg, ...)``: what a packed layer calls; it runs the native op
  ``torch.ops.moepack.route`` (csrc/routing.cpp), or a user-supplied Python routing function.
* ``apply_router_weight_on_input``: the Llama-4 way of applying a top-1 weight.
* ``route_reference``: plain torch, written from the models' own definitions (transformers 5.x
  modeling code). It is the oracle of tests/engine/test_routing.py and shares no code with the op.

``python tools/bench_routing.py`` prints the per-call cost of the op.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import UnsupportedError
from .families import ROUTED, Family, family_of

# Methods of the native op, in the order of csrc/include/moepack/routing.h RouteMethod.
METHODS = ("softmax", "sigmoid", "grouped_softmax", "grouped_sigmoid", "topk_softmax", "llama4", "sparsemixer",
           "sqrtsoftplus", "biased_logit_sigmoid")
# "custom": a Python callable supplied to route(); not an op method.
CONFIG_METHODS = METHODS + ("custom",)
GROUPED_METHODS = ("grouped_softmax", "grouped_sigmoid")
# Methods whose weights are fully defined by the method (no renormalize, no correction bias).
FIXED_WEIGHT_METHODS = ("topk_softmax", "llama4", "sparsemixer")
SCORING = {
    "softmax": "softmax",
    "sigmoid": "sigmoid",
    "grouped_softmax": "softmax",
    "grouped_sigmoid": "sigmoid",
    "topk_softmax": "softmax",
    "llama4": "sigmoid",
    "sparsemixer": "softmax",
    "sqrtsoftplus": "sqrtsoftplus",
    "biased_logit_sigmoid": "sigmoid",  # the bias on the logits (selection), the weights sigmoid(logit)
    "custom": "custom",
}

RoutingFn = Callable[[torch.Tensor | None, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------------------------
# RoutingConfig


@dataclass(frozen=True)
class RoutingConfig:
    """How one MoE layer turns router logits into (weights, ids). docs/ROUTING.md has the table.

    method: one of ``CONFIG_METHODS``; top_k: experts per token; renormalize: divide the chosen
    weights by their sum (+1e-20); num_expert_group / topk_group: grouped methods only (0
    otherwise); scoring_func: "softmax" | "sigmoid" (implied by the method, kept for readers of
    the manifest); routed_scaling_factor: multiplies the final weights; has_correction_bias: the
    layer has an ``e_score_correction_bias`` [E] (DeepSeek-V3 family) that ``route`` must be given;
    apply_router_weight_on_input: the weight scales the expert input, not its output (Llama-4,
    k = 1 only); sparsemixer_eps: Phi-3.5-MoE ``router_jitter_noise``; num_experts: E (routed,
    global), checked against the logits when set; model_type: where the config came from.
    """

    method: str
    top_k: int
    renormalize: bool = False
    num_expert_group: int = 0
    topk_group: int = 0
    scoring_func: str = ""
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False
    apply_router_weight_on_input: bool = False
    sparsemixer_eps: float = 0.01
    num_experts: int | None = None
    model_type: str | None = None

    def __post_init__(self):
        m = self.method
        if m not in CONFIG_METHODS:
            raise UnsupportedError(f"RoutingConfig method={m!r} is not one of {', '.join(CONFIG_METHODS)}")
        if not self.scoring_func:
            object.__setattr__(self, "scoring_func", SCORING[m])
        if self.scoring_func != SCORING[m]:
            raise UnsupportedError(
                f"RoutingConfig scoring_func={self.scoring_func!r} contradicts method={m!r} (which scores with "
                f"{SCORING[m]!r})"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1:
            raise UnsupportedError(f"RoutingConfig top_k={self.top_k!r}: must be an int >= 1")
        if self.num_experts is not None and not (1 <= self.top_k <= self.num_experts):
            raise UnsupportedError(f"RoutingConfig top_k={self.top_k} with num_experts={self.num_experts}: "
                                   "must be in [1, num_experts]")  # fmt: skip
        if m in GROUPED_METHODS:
            g, tg = self.num_expert_group, self.topk_group
            if g < 1 or not (1 <= tg <= g):
                raise UnsupportedError(f"RoutingConfig num_expert_group={g}, topk_group={tg}: method {m} needs "
                                       "num_expert_group >= 1 and 1 <= topk_group <= num_expert_group")  # fmt: skip
            if self.num_experts is not None:
                if self.num_experts % g:
                    raise UnsupportedError(f"RoutingConfig num_experts={self.num_experts} is not a multiple of "
                                           f"num_expert_group={g}")  # fmt: skip
                if self.top_k > tg * (self.num_experts // g):
                    raise UnsupportedError(f"RoutingConfig top_k={self.top_k} exceeds the {tg * (self.num_experts // g)} "
                                           f"experts of the topk_group={tg} kept groups")  # fmt: skip
        elif self.num_expert_group > 1 or self.topk_group > 1:
            raise UnsupportedError(f"RoutingConfig num_expert_group={self.num_expert_group}, "
                                   f"topk_group={self.topk_group}: method {m} takes no groups")  # fmt: skip
        if m in FIXED_WEIGHT_METHODS and (self.renormalize or self.has_correction_bias):
            raise UnsupportedError(f"RoutingConfig method={m} takes neither renormalize nor a correction bias")
        if m == "llama4" and self.top_k != 1:
            raise UnsupportedError(f"RoutingConfig top_k={self.top_k}: method llama4 is top-1")
        if m == "sparsemixer" and self.top_k != 2:
            raise UnsupportedError(f"RoutingConfig top_k={self.top_k}: method sparsemixer is defined for top_k=2")
        if self.apply_router_weight_on_input and self.top_k != 1:
            raise UnsupportedError(f"RoutingConfig apply_router_weight_on_input=True with top_k={self.top_k}: "
                                   "only defined for top_k=1 (the experts are not linear)")  # fmt: skip
        rsf = self.routed_scaling_factor
        if not (isinstance(rsf, (int, float)) and math.isfinite(rsf) and rsf > 0):
            raise UnsupportedError(f"RoutingConfig routed_scaling_factor={rsf!r}: must be finite and > 0")
        if not (math.isfinite(self.sparsemixer_eps) and self.sparsemixer_eps >= 0):
            raise UnsupportedError(f"RoutingConfig sparsemixer_eps={self.sparsemixer_eps!r}: must be finite and >= 0")
        # the op's arguments before and after correction_bias, computed once (route() is per call)
        object.__setattr__(self, "_op_head", (self.top_k, m, bool(self.renormalize), self.num_expert_group,
                                              self.topk_group))  # fmt: skip
        object.__setattr__(self, "_op_tail", (float(rsf), float(self.sparsemixer_eps)))

    # -- manifest round trip --

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-serializable dict (every field)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RoutingConfig:
        """Inverse of ``to_dict``; unknown keys are refused (a newer manifest, or a typo)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise UnsupportedError(f"RoutingConfig.from_dict: unknown keys {unknown} (known: {sorted(names)})")
        kw = dict(d)
        if "routed_scaling_factor" in kw:
            kw["routed_scaling_factor"] = float(kw["routed_scaling_factor"])
        return cls(**kw)

    # -- Hugging Face config.json --

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> RoutingConfig:
        """The routing of a Hugging Face ``config.json`` (as a dict), per ``model_type``: the
        recipe its ``moepack.families`` entry names (``RECIPES``), given that entry (its defaults,
        the keys it reads). Families: ``SUPPORTED_MODEL_TYPES`` (transformers 5.x modeling code;
        docs/ROUTING.md has the table). Any other model_type is refused. Missing keys take the
        transformers config class defaults.
        """
        return _from_hf_config(cls, config)


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


def _need(cfg: Mapping[str, Any], mt: str, *names: str) -> Any:
    v = _get(cfg, *names)
    if v is None:
        raise UnsupportedError(f"config.json (model_type={mt!r}) has none of {list(names)}: cannot derive routing")
    return v


# The model types RoutingConfig.from_hf_config routes: moepack.families' entries with a routing recipe.
SUPPORTED_MODEL_TYPES = ROUTED


def _from_hf_config(cls, config: Mapping[str, Any]) -> RoutingConfig:
    mt = config.get("model_type")
    fam = family_of(mt)
    if fam.routing is None:
        raise UnsupportedError(
            f"config.json model_type={mt!r}: moepack does not know how this family routes "
            f"(known: {', '.join(SUPPORTED_MODEL_TYPES)}); pass a RoutingConfig(method='custom') and a custom_fn"
        )
    return RECIPES[fam.routing](cls, config, mt, fam)


def _k_e(config: Mapping[str, Any], mt: str, fam: Family) -> tuple[int, int]:
    """(top_k, E) from config.json: E under the family's ``expert_keys``."""
    k = int(_need(config, mt, "num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"))
    e = int(_need(config, mt, *fam.expert_keys))
    return k, e


def _arg(config: Mapping[str, Any], spec: Any) -> Any:
    """A family's routing argument: a constant, or (config key, default) read from config.json."""
    if isinstance(spec, tuple):
        key, default = spec
        return _get(config, key, default=default)
    return spec


def _text_model(cls, config, mt, fam) -> RoutingConfig:
    """Multimodal wrappers (llama4, kimi_k25): the routing is the text model's; a text config without
    a model_type is the family's ``text_model_type`` (``aliases``: text model types read as another)."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise UnsupportedError(f"config.json model_type={mt!r} has no text_config dict: cannot derive routing")
    inner = dict(text)
    inner.setdefault("model_type", fam.routing_args["text_model_type"])
    inner["model_type"] = fam.routing_args.get("aliases", {}).get(inner["model_type"], inner["model_type"])
    r = _from_hf_config(cls, inner)
    return dataclasses.replace(r, model_type=mt)


def _softmax_recipe(cls, config, mt, fam) -> RoutingConfig:
    """softmax -> top-k (-> / sum: always, never, or if norm_topk_prob: the entry's ``renormalize``)."""
    k, e = _k_e(config, mt, fam)
    renorm = bool(_arg(config, fam.routing_args["renormalize"]))
    return cls("softmax", k, renormalize=renorm, num_experts=e, model_type=mt)


def _sigmoid_recipe(cls, config, mt, fam) -> RoutingConfig:
    """The routers that score with a sigmoid outside DeepSeek's groups (minimax_m2 / m3, hy_v3,
    laguna, afmoe, lfm2_moe: top-k of sigmoid + correction bias, renormalized, x their factor;
    flint: top-k of the logits). lfm2_moe renormalizes by sum + 1e-6 where moepack adds 1e-20:
    weights differ by a factor sum / (sum + 1e-6), at most 1e-6 / sum relative (docs/ROUTING.md,
    "differs on purpose"). The entry's ``softcap_key`` / ``input_weight_key`` (laguna) name config
    keys moepack runs only at their off value."""
    k, e = _k_e(config, mt, fam)
    args = fam.routing_args
    if "softcap_key" in args:
        key = args["softcap_key"]
        cap = _get(config, key, default=0.0)
        if cap:
            raise UnsupportedError(f"config.json {mt} {key}={cap!r}: moepack routes uncapped logits only (0.0)")
    if "input_weight_key" in args and _get(config, args["input_weight_key"], default=False):
        raise UnsupportedError(f"config.json {mt} {args['input_weight_key']}=True: moepack weights the experts' outputs "
                               "only (False)")  # fmt: skip
    rsf = args["routed_scaling_factor"]
    return cls("sigmoid", k, renormalize=bool(_arg(config, args["renormalize"])),
               has_correction_bias=bool(_arg(config, args["correction_bias"])),
               routed_scaling_factor=1.0 if rsf is None else float(_arg(config, rsf)), num_experts=e,
               model_type=mt)  # fmt: skip


def _biased_logit_sigmoid(cls, config, mt, fam) -> RoutingConfig:
    """Kolibri1TopKRouter: fp32 logits; top-k of logits + correction bias; sigmoid at the ids; / sum
    if norm_topk_prob (moepack: / (sum + 1e-20): the same for sums of k sigmoids, >= 1e-20)."""
    k, e = _k_e(config, mt, fam)
    return cls("biased_logit_sigmoid", k, renormalize=bool(_get(config, "norm_topk_prob", default=False)),
               has_correction_bias=True, num_experts=e, model_type=mt)  # fmt: skip


def _cohere2_moe(cls, config, mt, fam) -> RoutingConfig:
    """top-k of the logits; softmax over those k, or their sigmoid (/ sum if norm_topk_prob), per expert_selection_fn."""
    k, e = _k_e(config, mt, fam)
    fn = _get(config, "expert_selection_fn", default="softmax")
    if fn == "softmax":
        return cls("topk_softmax", k, num_experts=e, model_type=mt)
    if fn == "sigmoid":
        return cls("sigmoid", k, renormalize=bool(_get(config, "norm_topk_prob", default=True)), num_experts=e,
                   model_type=mt)  # fmt: skip
    raise UnsupportedError(f"config.json {mt} expert_selection_fn={fn!r}: expected softmax or sigmoid")


def _ernie4_5_moe(cls, config, mt, fam) -> RoutingConfig:
    """Ernie4_5_MoeTopKRouter: softmax(fp32 logits); top-k of softmax + e_score_correction_bias
    (moe_statics); the unbiased softmax at the ids / clamp(sum, min=moe_norm_min). The same as
    renormalize's / (sum + 1e-20) in fp32 whenever the sum is >= moe_norm_min."""
    k, e = _k_e(config, mt, fam)
    norm_min = float(_get(config, "moe_norm_min", default=1e-12))
    if not 0 < norm_min <= 1e-6:
        raise UnsupportedError(f"config.json {mt} moe_norm_min={norm_min!r}: moepack renormalizes by "
                               "sum + 1e-20, the same only for a floor in (0, 1e-6]")  # fmt: skip
    return cls("softmax", k, renormalize=True, has_correction_bias=True, num_experts=e, model_type=mt)


def _identity_softmax(cls, config, mt, fam) -> RoutingConfig:
    """LongcatFlashTopkRouter: softmax of the fp32 logits over the E routed and the Z identity
    (zero-computation) experts alike (Z: the entry's ``identity_experts_key``); top-k of softmax +
    e_score_correction_bias; the unbiased softmax at the ids, not renormalized, x
    routed_scaling_factor. The ids >= E are identity experts (the layer's identity_experts):
    num_experts here is E + Z, the router's width."""
    k, e = _k_e(config, mt, fam)
    z = _get(config, fam.identity_experts_key, default=0)
    return cls("softmax", k, has_correction_bias=True, num_experts=e + int(z),
               routed_scaling_factor=float(_get(config, "routed_scaling_factor",
                                                default=fam.routing_args["routed_scaling_factor"])), model_type=mt)  # fmt: skip


def _scored_bias(cls, config, mt, fam) -> RoutingConfig:
    """DeepseekV4TopKRouter: score_fn(logits) (scoring_func: the entry's ``scoring``, the first its
    default); top-k of score + e_score_correction_bias; / (sum + 1e-20) always (norm_topk_prob is
    not read); x routed_scaling_factor. Its hash_moe layers (DeepseekV4HashRouter) take the ids
    from the layer's token-id table instead and weigh them alike (PackedMoELayer.route's token_ids)."""
    k, e = _k_e(config, mt, fam)
    allowed = fam.routing_args["scoring"]
    scoring = _get(config, "scoring_func", default=allowed[0])
    if scoring not in allowed:
        raise UnsupportedError(f"config.json {mt} scoring_func={scoring!r}: moepack routes {' or '.join(allowed)}")
    return cls(scoring, k, renormalize=True, has_correction_bias=True,
               routed_scaling_factor=float(_get(config, "routed_scaling_factor",
                                                default=fam.routing_args["routed_scaling_factor"])), num_experts=e,
               model_type=mt)  # fmt: skip


def _deepseek_v2(cls, config, mt, fam) -> RoutingConfig:
    """transformers' DeepseekV2TopkRouter: softmax; greedy or group_limited_greedy (group score =
    max); x routed_scaling_factor; it does not read norm_topk_prob (nor does moepack)."""
    k, e = _k_e(config, mt, fam)
    scoring = _get(config, "scoring_func", default="softmax")
    if scoring != "softmax":
        raise UnsupportedError(f"config.json {mt} scoring_func={scoring!r}: only softmax is defined")
    method = _get(config, "topk_method", default="greedy")
    rsf = float(_get(config, "routed_scaling_factor", default=1.0))
    if method == "greedy":
        return cls("softmax", k, routed_scaling_factor=rsf, num_experts=e, model_type=mt)
    if method == "group_limited_greedy":
        g = int(_need(config, mt, "n_group", "num_expert_group"))
        tg = int(_need(config, mt, "topk_group"))
        return cls("grouped_softmax", k, num_expert_group=g, topk_group=tg, routed_scaling_factor=rsf,
                   num_experts=e, model_type=mt)  # fmt: skip
    raise UnsupportedError(f"config.json {mt} topk_method={method!r}: expected greedy or group_limited_greedy")


def _noaux_tc(cls, config, mt, fam) -> RoutingConfig:
    """noaux_tc: sigmoid + e_score_correction_bias (selection only), group score = sum of the
    top-2, renormalize if norm_topk_prob, x routed_scaling_factor; the entry holds the family's
    defaults of n_group, topk_group, routed_scaling_factor and norm_topk_prob. transformers' router
    does this whatever topk_method / scoring_func say; moepack refuses a config that says otherwise."""
    k, e = _k_e(config, mt, fam)
    scoring = _get(config, "scoring_func", default="sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedError(f"config.json {mt} scoring_func={scoring!r}: this family routes with sigmoid")
    tm = _get(config, "topk_method", default="noaux_tc")
    if tm != "noaux_tc":
        raise UnsupportedError(f"config.json {mt} topk_method={tm!r}: this family routes with noaux_tc")
    d = fam.routing_args
    g = int(_get(config, "n_group", "num_expert_group", default=d["n_group"]))
    tg = int(_get(config, "topk_group", default=d["topk_group"]))
    rsf = float(_get(config, "routed_scaling_factor", default=d["routed_scaling_factor"]))
    renorm = bool(_get(config, "norm_topk_prob", "moe_renormalize", default=d["norm_topk_prob"]))
    return cls("grouped_sigmoid", k, renormalize=renorm, num_expert_group=g, topk_group=tg,
               routed_scaling_factor=rsf, has_correction_bias=True, num_experts=e, model_type=mt)  # fmt: skip


def _topk_softmax(cls, config, mt, fam) -> RoutingConfig:
    """top-k of the logits, softmax over those k (GraniteMoe, gpt-oss, Aria, JetMoE). gpt-oss's
    router Linear has a bias: it is part of the logits the layer computes, not a routing parameter."""
    k, e = _k_e(config, mt, fam)
    return cls("topk_softmax", k, num_experts=e, model_type=mt)


def _llama4(cls, config, mt, fam) -> RoutingConfig:
    k, e = _k_e(config, mt, fam)
    if k != 1:
        raise UnsupportedError(f"config.json llama4 num_experts_per_tok={k}: moepack routes Llama-4 top-1 only "
                               "(the weight scales the expert input, which is only defined per token for k=1)")  # fmt: skip
    return cls("llama4", 1, apply_router_weight_on_input=True, num_experts=e, model_type=mt)


def _sparsemixer(cls, config, mt, fam) -> RoutingConfig:
    k, e = _k_e(config, mt, fam)
    if k != 2:
        raise UnsupportedError(f"config.json {mt} num_experts_per_tok={k}: sparsemixer is defined for 2")
    eps = float(_get(config, "router_jitter_noise", default=0.01))
    return cls("sparsemixer", 2, sparsemixer_eps=eps, num_experts=e, model_type=mt)


def _dbrx(cls, config, mt, fam) -> RoutingConfig:
    """DbrxFFN.route_tokens_to_experts: its MoE keys nest in ffn_config (DbrxFFNConfig: moe_top_k,
    moe_num_experts); softmax over the experts; top-k; the k weights divided by their p-norm, p =
    moe_normalize_expert_weights (None: not divided). The weights being positive, p = 1 is the sum
    (renormalize, moepack's / (sum + 1e-20)); another p is refused."""
    ffn = config.get("ffn_config")
    ffn = ffn if isinstance(ffn, Mapping) else {}
    k = int(_need(ffn, mt, "moe_top_k"))
    e = int(_need(ffn, mt, "moe_num_experts"))
    p = ffn.get("moe_normalize_expert_weights", 1.0)
    if p is not None and float(p) != 1.0:
        raise UnsupportedError(f"config.json {mt} ffn_config.moe_normalize_expert_weights={p!r}: moepack divides the "
                               "top-k weights by their sum (p = 1) or not at all (None)")  # fmt: skip
    return cls("softmax", k, renormalize=p is not None, num_experts=e, model_type=mt)


# Family.routing -> the recipe: (RoutingConfig class, config.json dict, model_type, Family) -> RoutingConfig
RECIPES: dict[str, Callable[..., RoutingConfig]] = {
    "text_model": _text_model,
    "softmax": _softmax_recipe,
    "sigmoid": _sigmoid_recipe,
    "biased_logit_sigmoid": _biased_logit_sigmoid,
    "cohere2_moe": _cohere2_moe,
    "ernie4_5_moe": _ernie4_5_moe,
    "identity_softmax": _identity_softmax,
    "scored_bias": _scored_bias,
    "deepseek_v2": _deepseek_v2,
    "noaux_tc": _noaux_tc,
    "topk_softmax": _topk_softmax,
    "llama4": _llama4,
    "sparsemixer": _sparsemixer,
    "dbrx": _dbrx,
}

# --------------------------------------------------------------------------------------------
# route(): what a packed layer calls


_route_op = None


def _ops():
    from ._ops import ops

    return ops()


def _op():
    """torch.ops.moepack.route (the extension loaded once)."""
    global _route_op
    if _route_op is None:
        _route_op = _ops().route
    return _route_op


def route_op(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    *,
    renormalize: bool = False,
    num_expert_group: int = 0,
    topk_group: int = 0,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    sparsemixer_eps: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.moepack.route`` with keyword arguments (the op checks every one)."""
    return _op()(
        logits, top_k, method, renormalize, num_expert_group, topk_group, correction_bias,
        float(routed_scaling_factor), float(sparsemixer_eps),
    )  # fmt: skip


def route(
    logits: torch.Tensor,
    cfg: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    custom_fn: RoutingFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route one layer's tokens: logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int32).

    ``correction_bias`` [E] fp32 is required exactly when ``cfg.has_correction_bias``. With
    ``custom_fn`` (required when ``cfg.method == "custom"``) the routing is
    ``custom_fn(hidden, logits, cfg.top_k)``, its output cast to fp32 / int32 contiguous and
    validated. ``cfg.apply_router_weight_on_input`` is not applied here: the layer calls
    ``apply_router_weight_on_input(hidden, weights, ids)`` on the result (docs/ROUTING.md).
    """
    e = cfg.num_experts
    if e is not None and logits.dim() == 2 and logits.shape[1] != e:
        raise UnsupportedError(f"router_logits has {logits.shape[1]} experts (shape {list(logits.shape)}) but the "
                               f"RoutingConfig says num_experts={e}")  # fmt: skip
    if custom_fn is not None or cfg.method == "custom":
        if custom_fn is None:
            raise UnsupportedError("RoutingConfig method='custom' needs a custom_fn(hidden, logits, k) -> (weights, ids)")
        return route_custom(custom_fn, hidden, logits, cfg.top_k)
    if (correction_bias is None) == cfg.has_correction_bias:
        if correction_bias is None:
            raise UnsupportedError(f"RoutingConfig ({cfg.model_type or cfg.method}) has an e_score_correction_bias: "
                                   "route() needs correction_bias [E] fp32")  # fmt: skip
        raise UnsupportedError(f"correction_bias given but RoutingConfig ({cfg.model_type or cfg.method}) has "
                               "has_correction_bias=False")  # fmt: skip
    return (_route_op or _op())(logits, *cfg._op_head, correction_bias, *cfg._op_tail)


def route_by_token(
    logits: torch.Tensor, cfg: RoutingConfig, table: torch.Tensor, token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing (DeepSeek-V4's ``hash_moe`` layers, ``DeepseekV4HashRouter``): token t goes to
    the experts ``table[token_ids[t]]`` (``table`` [vocab, k], the checkpoint's ``gate.tid2eid``),
    weighted as the method weighs its chosen experts: the scores of the logits at those ids
    (sqrt(softplus), sigmoid or softmax, fp32), then renormalize (/ (sum + 1e-20)) and
    routed_scaling_factor. No correction bias (the ids are given). ``token_ids``: one per row of
    ``logits`` (any integer dtype, any shape with that many elements). Returns (weights [T, k]
    fp32, ids [T, k] int32) as ``route`` does."""
    t, e = logits.shape
    if not isinstance(token_ids, torch.Tensor) or token_ids.is_floating_point() or token_ids.numel() != t:
        what = f"{token_ids.dtype} {list(token_ids.shape)}" if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
        raise UnsupportedError(f"token_ids is {what}: hash routing needs one integer token id per row of router_logits ({t})")
    tok = token_ids.reshape(-1).long()
    vocab, k = table.shape
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= vocab):
        raise UnsupportedError(f"token_ids in [{int(tok.min())}, {int(tok.max())}]: the layer's hash table has {vocab} rows")
    if k != cfg.top_k:
        raise UnsupportedError(f"the layer's hash table is [{vocab}, {k}]: the routing picks top_k={cfg.top_k}")
    ids = table[tok].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= e):
        raise UnsupportedError(f"the layer's hash table holds expert ids in [{int(ids.min())}, {int(ids.max())}]: "
                               f"router_logits has {e} experts")  # fmt: skip
    x = logits.float()
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise UnsupportedError(f"router_logits[{bad[0]}, {bad[1]}] is {float(x[bad[0], bad[1]])}: hash routing weighs "
                               "finite logits only")  # fmt: skip
    scores = _scores(x, cfg.scoring_func)
    w = _finish(scores.gather(1, ids), cfg.renormalize, cfg.routed_scaling_factor)
    return w.contiguous(), ids.to(torch.int32).contiguous()


def _scores(x: torch.Tensor, scoring: str) -> torch.Tensor:
    """The scores a method weighs its chosen experts with (fp32)."""
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(x).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(x)
    if scoring == "softmax":
        return _softmax0(x)
    raise UnsupportedError(f"hash routing weighs sqrtsoftplus, sigmoid or softmax scores, not {scoring!r}")


def route_custom(
    fn: RoutingFn, hidden: torch.Tensor | None, logits: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call a user routing function ``fn(hidden, logits, k) -> (weights, ids)`` and check it.

    The result must be two tensors of shape [T, k] (T = logits rows); ids of an integer dtype in
    [0, E); weights finite and floating. They are returned as fp32 / int32 contiguous.
    """
    t, e = logits.shape
    out = fn(hidden, logits, top_k)
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(v, torch.Tensor) for v in out)):
        raise UnsupportedError(f"custom routing function returned {type(out).__name__}: must return "
                               "(topk_weights, topk_ids) tensors")  # fmt: skip
    w, ids = out
    if tuple(w.shape) != (t, top_k) or tuple(ids.shape) != (t, top_k):
        raise UnsupportedError(f"custom routing function returned weights {list(w.shape)} and ids {list(ids.shape)}: "
                               f"both must be [tokens={t}, k={top_k}]")  # fmt: skip
    if not w.is_floating_point():
        raise UnsupportedError(f"custom routing function returned weights of dtype {w.dtype}: must be floating")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise UnsupportedError(f"custom routing function returned ids of dtype {ids.dtype}: must be an integer dtype")
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= e:
            raise UnsupportedError(f"custom routing function returned ids in [{lo}, {hi}]: must be in [0, {e}) "
                                   f"(router_logits has {e} experts)")  # fmt: skip
    w = w.to(torch.float32).contiguous()
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise UnsupportedError("custom routing function returned non-finite weights")
    return w, ids.to(torch.int32).contiguous()


def apply_router_weight_on_input(
    hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-4 style: scale each token's input by its (single) routing weight.

    hidden [T, H], weights [T, 1] fp32, ids [T, 1]. Returns (hidden * weight, cast back to the
    hidden dtype after an fp32 multiply; ones [T, 1] fp32): pass both to ``fused_experts`` with
    the same ids, so the combine does not weight again. k > 1 is refused: the experts are not
    linear, so a per-slot input scale is not a per-token one.
    """
    if weights.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape:
        raise UnsupportedError(f"apply_router_weight_on_input: weights {list(weights.shape)} and ids "
                               f"{list(ids.shape)} must both be [T, k]")  # fmt: skip
    if weights.shape[1] != 1:
        raise UnsupportedError(f"apply_router_weight_on_input with top_k={weights.shape[1]}: only defined for "
                               "top_k=1 (scale the input, do not weight the output again)")  # fmt: skip
    if hidden.dim() != 2 or hidden.shape[0] != weights.shape[0]:
        raise UnsupportedError(f"apply_router_weight_on_input: hidden {list(hidden.shape)} must be [T={weights.shape[0]}, H]")
    scaled = (hidden.float() * weights.float()).to(hidden.dtype)
    return scaled, torch.ones_like(weights, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Reference (plain torch, from the models' definitions; the test oracle)


def _topk_ids(key: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Ids of the k largest keys per row; equal keys: the lower id first (torch.topk leaves ties
    unspecified: on CPU, topk of 16 zeros picks [10, 11, 12, 9]). With ``allowed`` [T, E] bool,
    allowed experts rank before all others."""
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    if allowed is not None:
        first = torch.sort(allowed.gather(-1, order).to(torch.int8), dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, first)
    return order[..., :k]


def _softmax0(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim; rows that are all -inf give 0 (torch gives NaN)."""
    p = torch.softmax(x, dim=-1)
    return torch.where(torch.isneginf(x).all(dim=-1, keepdim=True), torch.zeros_like(p), p)


def _finish(w: torch.Tensor, renormalize: bool, rsf: float) -> torch.Tensor:
    if renormalize:  # DeepseekV3TopkRouter: / (sum + 1e-20); Mixtral/Qwen: / sum (same when sum >= 1/E)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * rsf


def _sparsemixer_reference(scores: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers phimoe ``sparsemixer(scores, jitter_eps, training=False)``, in fp32, plus the
    moepack rules for rows with nothing finite left (weight 0, the lowest unused id)."""
    # expert 1
    mask_logits_threshold = scores.max(dim=-1, keepdim=True).values
    max_ind = _topk_ids(scores, 1)
    factor = scores.abs().clamp(min=mask_logits_threshold)
    mask_logits_threshold = ((mask_logits_threshold - scores) / factor) > (2 * jitter_eps)
    masked_gates = scores.masked_fill(mask_logits_threshold, float("-inf"))
    selected_experts = max_ind
    multiplier = _softmax0(masked_gates).gather(dim=-1, index=selected_experts)
    # expert 2: the same with expert 1 removed
    masked_scores = torch.scatter(scores, -1, selected_experts, float("-inf"))
    mask_logits_threshold = masked_scores.max(dim=-1, keepdim=True).values
    not_first = torch.ones_like(scores, dtype=torch.bool).scatter(-1, selected_experts, False)
    max_ind = _topk_ids(masked_scores, 1, allowed=not_first)
    factor = scores.abs().clamp(min=mask_logits_threshold)
    mask_logits_threshold = ((mask_logits_threshold - scores) / factor) > (2 * jitter_eps)
    masked_gates_top2 = masked_scores.masked_fill(mask_logits_threshold, float("-inf"))
    multiplier_top2 = _softmax0(masked_gates_top2).gather(dim=-1, index=max_ind)
    return torch.cat((multiplier, multiplier_top2), dim=-1), torch.cat((selected_experts, max_ind), dim=-1)


def route_reference(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    *,
    renormalize: bool = False,
    num_expert_group: int = 0,
    topk_group: int = 0,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    sparsemixer_eps: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's semantics in plain torch (fp32), written from transformers' routers:
    Mixtral/Qwen2-MoE/Qwen3-MoE/OLMoE ``*TopKRouter`` (softmax), DeepseekV2TopkRouter
    (grouped_softmax), DeepseekV3/Glm4Moe/KimiLinear ``TopkRouter`` (grouped_sigmoid),
    GptOss/GraniteMoe ``TopKRouter`` (topk_softmax), Llama4Router (llama4), phimoe
    ``sparsemixer`` (sparsemixer), DeepseekV4TopKRouter (sqrtsoftplus: sqrt(softplus(x)) scores), Kolibri1TopKRouter
    (biased_logit_sigmoid: the bias added to the logits, sigmoid weights). moepack's own rules on top: ties -> lower id; without a bias
    the logits are the selection keys (same order as the scores, finer where fp32 scores
    saturate); rows with nothing finite get weight 0. No argument checking: see the op."""
    x = logits.float()
    t, e = x.shape
    b = correction_bias.float() if correction_bias is not None else None
    if method == "sparsemixer":
        w, ids = _sparsemixer_reference(x, sparsemixer_eps)
        return (w * routed_scaling_factor).contiguous(), ids.to(torch.int32).contiguous()
    if method == "topk_softmax":  # GptOssTopKRouter: topk(logits) -> softmax over the k
        ids = _topk_ids(x, top_k)
        w = _softmax0(x.gather(-1, ids))
        return (w * routed_scaling_factor).contiguous(), ids.to(torch.int32).contiguous()
    if method == "llama4":  # Llama4Router: topk(logits, 1) -> sigmoid
        ids = _topk_ids(x, 1)
        w = torch.sigmoid(x.gather(-1, ids))
        return (w * routed_scaling_factor).contiguous(), ids.to(torch.int32).contiguous()
    scores = (_softmax0(x) if method in ("softmax", "grouped_softmax")
              else torch.nn.functional.softplus(x).sqrt() if method == "sqrtsoftplus" else torch.sigmoid(x))  # fmt: skip
    if method == "biased_logit_sigmoid":  # Kolibri1TopKRouter: the bias on the logits
        key = x + b if b is not None else x
    else:
        key = scores + b if b is not None else x
    allowed = None
    if method in GROUPED_METHODS:
        g = num_expert_group
        grouped = key.view(t, g, e // g)
        if b is not None:  # DeepseekV3TopkRouter: sum of the top-2 (biased) scores of each group
            group_scores = grouped.topk(min(2, e // g), dim=-1)[0].sum(dim=-1)
        else:  # DeepseekV2TopkRouter group_limited_greedy: the group's max
            group_scores = grouped.max(dim=-1).values
        group_idx = _topk_ids(group_scores, topk_group)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_idx, True)
        allowed = group_mask.unsqueeze(-1).expand(t, g, e // g).reshape(t, e)
        key = key.masked_fill(~allowed, float("-inf"))
    ids = _topk_ids(key, top_k, allowed)
    w = _finish(scores.gather(1, ids), renormalize, routed_scaling_factor)
    return w.contiguous(), ids.to(torch.int32).contiguous()
