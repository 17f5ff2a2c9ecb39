"""One table entry per model family: every fact moepack needs about a model_type, in one place.

A ``Family`` says how the family routes (a recipe of ``moepack.routing`` by name, with what that
recipe needs from the family: its defaults, the config keys it reads), where its expert count
sits in config.json, how its checkpoint stores the experts (orientation, interleaving, the
activation its experts compute when the config's ``hidden_act`` does not say it, attention
experts to leave alone, identity experts), and what its transformers MoE block looks like in
memory (the block, router and shared-expert attributes, the layers path, what the block returns:
``moepack.hf`` patches and loads whole models from it). Checkpoint names that transformers renames
on load are not here: they come from transformers' own ``conversion_mapping``
(``moepack.hf.checkpoint_renames``).

This module imports nothing of moepack's: ``routing``, ``hf`` and ``sources`` all read it.
``tests/integrations/test_family_sweep.py::test_family_entry_matches_transformers`` checks every
entry against the family's transformers modules (its routing included); docs/ROUTING.md and
docs/COMPATIBILITY.md describe the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# where most families state their expert count, in the order looked at
DEFAULT_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_LOCAL_FIRST = ("num_local_experts", "num_experts")
_ROUTED_FIRST = ("n_routed_experts", "num_local_experts", "num_experts")


@dataclass(frozen=True)
class Family:
    """What differs between the MoE families (transformers 5 names, in memory and on disk).

    Routing (``moepack.routing.RoutingConfig.from_hf_config``): ``routing`` names the recipe
    (a key of ``moepack.routing.RECIPES``; None: moepack does not route this model_type), and
    ``routing_args`` is what that recipe takes from the family (defaults, the config keys it
    reads, a wrapper's text model_type). ``expert_keys``: the config.json keys of E, in the order
    looked at. ``routed_scale_on_output``: the block multiplies the routed experts' sum by
    routed_scaling_factor after weighting them (beam, minimax_m3_vl_text); the experts being linear
    in their weight, moepack's routing applies that factor to the weights.

    Whole model (``moepack.hf``; ``whole_model`` False: patch / load_model refuse the family):
    ``block_attr``: the decoder layer's MoE block. ``returns``: "tensor" (the block returns hidden
    states [B, S, H]), "gpt_oss" (``(hidden [B, S, H], router_scores [T, k])``) or "llama4"
    (``(hidden [T, H], router_logits [T, E])``). ``router_fp32``: the family computes router logits
    in fp32 (its gate weight is kept fp32); otherwise in the model's dtype, as ``F.linear(x, W, b)``
    does, so that near-ties select the experts transformers would select. ``in_major``: the
    in-memory fused expert weights are ``[E, H, 2I]`` / ``[E, I, H]``. ``shared``: the attribute of
    the shared expert module (None: the family has none). ``router_attr``: the block's router
    module, whose class transformers' OutputRecorder watches to collect ``router_logits``
    (``output_router_logits=True``, the aux loss); ``logits_index``: where the logits sit in that
    router's output tuple. ``layers``: the dotted path of the decoder layers in the causal-LM model
    (DBRX: ``transformer.blocks``). ``experts_attr``: the attribute that marks the block (its
    experts module, or JetMoE's ``input_linear``, whose block holds its expert weights itself).

    Checkpoint (``moepack.sources.dense``): ``stored_in_major``: fused expert tensors stored
    ``[E, H, 2I]`` / ``[E, I, H]``; ``interleaved``: fused gate/up rows stored as interleaved pairs;
    ``activation``: the experts' activation when config.json's ``hidden_act`` does not name it
    ("swigluoai": gpt-oss's clamped gate; "relu2": non-gated up -> relu(x)^2 -> down);
    ``attention_experts``: the module whose experts are attention experts, not MoE experts (carried
    unchanged, run by transformers); ``identity_experts_key``: the config key of Z identity
    (zero-computation) experts, router ids E .. E+Z-1.

    Block shape beyond the experts (``moepack.convert.plan``: recorded per layer, run by the packed
    layer): ``routed_activation``: the routed experts' fixed activation whatever ``hidden_act`` says
    (aria: silu; its shared expert follows hidden_act); ``silu_clamp_key``: the config key of the
    silu experts' clamped SwiGLU (``silu_limit``); ``shared_clamped`` False: that clamp is on the
    routed experts only; ``post_norm``: (the RMSNorm the block applies to its own output, stored
    beside the block in the decoder layer; its eps key); ``out_bias``: the name, under the block, of
    a bias [H] the block adds to its output.
    """

    block_attr: str = "mlp"
    router_attr: str = "gate"
    logits_index: int = 0
    returns: str = "tensor"
    router_fp32: bool = False
    in_major: bool = False
    shared: str | None = None
    layers: str = "model.layers"
    experts_attr: str = "experts"
    whole_model: bool = True
    routing: str | None = None
    routing_args: dict[str, Any] = field(default_factory=dict, hash=False)
    routed_scale_on_output: bool = False
    expert_keys: tuple[str, ...] = DEFAULT_EXPERT_KEYS
    stored_in_major: bool = False
    interleaved: bool = False
    activation: str | None = None
    attention_experts: str | None = None
    identity_experts_key: str | None = None
    routed_activation: str | None = None
    silu_clamp_key: str | None = None
    shared_clamped: bool = True
    post_norm: tuple[str, str] | None = None
    out_bias: str | None = None


def _f(block_attr: str = "mlp", routing: str | None = None, **kw) -> Family:
    return Family(block_attr, routing=routing, **kw)


def _softmax(renormalize, **kw) -> Family:
    """softmax -> top-k (-> / sum: True always, False never, ("norm_topk_prob", default) as the config says)."""
    return _f(kw.pop("block_attr", "mlp"), "softmax", routing_args={"renormalize": renormalize}, **kw)


def _noaux(n_group: int, topk_group: int, rsf: float, norm: bool, **kw) -> Family:
    """DeepSeek-V3's noaux_tc with the family's defaults of n_group, topk_group, routed_scaling_factor, norm_topk_prob."""
    return _f(kw.pop("block_attr", "mlp"), "noaux_tc",
              routing_args={"n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": rsf,
                            "norm_topk_prob": norm}, **kw)  # fmt: skip


def _sigmoid(renormalize=True, correction_bias=True, rsf=None, **kw) -> Family:
    """sigmoid -> top-k (of sigmoid + correction bias when it has one) -> renormalize -> x rsf; each of
    renormalize / correction_bias a constant or (config key, default); rsf None (1.0) or (config key, default)."""
    args = {"renormalize": renormalize, "correction_bias": correction_bias, "routed_scaling_factor": rsf}
    args.update(kw.pop("routing_args", {}))
    return _f(kw.pop("block_attr", "mlp"), "sigmoid", routing_args=args, **kw)


_NORM = ("norm_topk_prob", False)  # renormalize if the config's norm_topk_prob says so (default False)
_DSV3 = dict(router_fp32=True, shared="shared_experts")  # DeepSeek-V3's block (noaux_tc router kept in fp32, shared experts)

# In the order moepack.routing.SUPPORTED_MODEL_TYPES lists them (its refusal quotes that list).
FAMILIES: dict[str, Family] = {
    "mixtral": _softmax(True, expert_keys=_LOCAL_FIRST),
    "qwen2_moe": _softmax(_NORM, shared="shared_expert"),
    "qwen3_moe": _softmax(_NORM),
    "olmoe": _softmax(_NORM),
    "deepseek_v2": _f("mlp", "deepseek_v2", router_fp32=True, shared="shared_experts", expert_keys=_ROUTED_FIRST),
    "deepseek_v3": _noaux(8, 4, 2.5, True, expert_keys=_ROUTED_FIRST, **_DSV3),
    "kimi_k2": _noaux(8, 4, 2.5, True, expert_keys=_ROUTED_FIRST, whole_model=False),
    # a multimodal wrapper: the text model's routing (a text config without a model_type is DeepSeek-V3's)
    "kimi_k25": _f("mlp", "text_model", whole_model=False,
                   routing_args={"text_model_type": "deepseek_v3", "aliases": {"kimi_k2": "deepseek_v3"}}),
    # their q/k/v conv1d weights are concatenated on load (a WeightConverter load_model follows)
    "kimi_linear": _noaux(1, 1, 2.446, True, **_DSV3),
    "glm4_moe": _noaux(1, 1, 1.0, True, expert_keys=_ROUTED_FIRST, **_DSV3),
    # top-k of the logits, softmax over those k
    "granitemoe": _f("block_sparse_moe", "topk_softmax", router_attr="router", expert_keys=_LOCAL_FIRST),
    # the shared MLP of these two sits beside the block in the decoder layer (``shared_mlp``): transformers runs it
    "granitemoeshared": _f("block_sparse_moe", "topk_softmax", router_attr="router", expert_keys=_LOCAL_FIRST),
    "granitemoehybrid": _f("block_sparse_moe", "topk_softmax", router_attr="router", expert_keys=_LOCAL_FIRST),
    # gpt-oss's router Linear has a bias: part of the logits the layer computes, not a routing parameter
    "gpt_oss": _f("mlp", "topk_softmax", router_attr="router", returns="gpt_oss", in_major=True,
                  expert_keys=_LOCAL_FIRST, stored_in_major=True, interleaved=True, activation="swigluoai"),
    # the multimodal config; its causal LM is the text model (a text config without a model_type is llama4_text's)
    "llama4": _f("feed_forward", "text_model", router_attr="router", logits_index=1, returns="llama4", in_major=True,
                 shared="shared_expert", stored_in_major=True, routing_args={"text_model_type": "llama4_text"}),
    "llama4_text": _f("feed_forward", "llama4", router_attr="router", logits_index=1, returns="llama4", in_major=True,
                      shared="shared_expert", expert_keys=_LOCAL_FIRST, stored_in_major=True),
    "phimoe": _f("mlp", "sparsemixer", router_attr="router", expert_keys=_LOCAL_FIRST),
    # DeepseekV3TopkRouter's copies (noaux_tc: grouped sigmoid + correction bias), transformers 5.24
    "deepseek_v32": _noaux(8, 4, 2.5, True, expert_keys=_ROUTED_FIRST, **_DSV3),
    "glm4_moe_lite": _noaux(1, 1, 1.8, True, expert_keys=_ROUTED_FIRST, **_DSV3),
    "glm_moe_dsa": _noaux(1, 1, 2.5, True, expert_keys=_ROUTED_FIRST, **_DSV3),
    "solar_open": _noaux(1, 1, 1.0, True, expert_keys=_ROUTED_FIRST, **_DSV3),
    "exaone_moe": _noaux(1, 1, 2.5, True, **_DSV3),
    "dots1": _noaux(1, 1, 1.0, False, expert_keys=_ROUTED_FIRST, **_DSV3),
    # its routed_scaling_factor multiplies the combined output: the same, the experts being linear in it
    "beam": _noaux(8, 4, 2.5, True, router_fp32=True, routed_scale_on_output=True),
    # Qwen-style softmax top-k
    "qwen3_next": _softmax(_NORM, shared="shared_expert"),
    "qwen3_5_moe": _softmax(True, shared="shared_expert"),
    "qwen3_5_moe_text": _softmax(True, shared="shared_expert"),
    "mellum": _softmax(_NORM, expert_keys=_LOCAL_FIRST),
    "flex_olmo": _softmax(_NORM),
    "minimax": _softmax(True, expert_keys=_LOCAL_FIRST),
    "jamba": _softmax(False, block_attr="feed_forward", router_attr="router"),
    # sigmoid + correction bias, renormalized (MiniMaxM2TopKRouter)
    "minimax_m2": _sigmoid(expert_keys=_LOCAL_FIRST),
    "granitemoe_swa": _f("block_sparse_moe", "topk_softmax", router_attr="router", expert_keys=_LOCAL_FIRST),
    # their attention sinks (and axk2's gated query) are stored under the names transformers renames on load
    "mimo_v2_flash": _noaux(1, 1, 1.0, True, router_fp32=True, expert_keys=_ROUTED_FIRST),
    "lara_mini": _softmax(_NORM, router_fp32=True, shared="shared_expert"),  # an ungated shared expert; in_proj split on load
    "hy_v3": _sigmoid(rsf=("router_scaling_factor", 2.826), **_DSV3),  # x router_scaling_factor
    # x moe_routed_scaling_factor; uncapped router logits, weights on the experts' outputs only
    "laguna": _sigmoid(rsf=("moe_routed_scaling_factor", 1.0), shared="shared_experts",
                       routing_args={"softcap_key": "moe_router_logit_softcapping",
                                     "input_weight_key": "moe_apply_router_weight_on_input"}),
    "hunyuan_v1_moe": _softmax(True, router_fp32=True, shared="shared_mlp"),  # softmax top-k, renormalized
    # AXK1MoE (DeepSeek-V3's block) normalizes its own output: the packed layer's post_norm (format version 7)
    "axk1": _noaux(8, 4, 2.5, True, expert_keys=_ROUTED_FIRST, post_norm=("post_mlp_layernorm", "rms_norm_eps"), **_DSV3),
    "axk2": _noaux(1, 1, 2.5, True, expert_keys=_ROUTED_FIRST, **_DSV3),
    "bailing_hybrid": _noaux(8, 4, 2.5, True, **_DSV3),  # its correction bias stored as gate.expert_bias
    # sigmoid + correction bias (expert_bias), renormalized, x route_scale
    "afmoe": _sigmoid(rsf=("route_scale", 1.0), router_attr="router", shared="shared_experts"),
    # sigmoid top-k (no bias), norm_topk_prob; an ungated shared expert
    "flint": _sigmoid(("norm_topk_prob", True), False, router_fp32=True, shared="shared_expert"),
    # top-k of the logits, softmax over those k
    "aria_text": _f("mlp", "topk_softmax", router_attr="router", in_major=True, shared="shared_experts",
                    expert_keys=("moe_num_experts",), stored_in_major=True, routed_activation="silu"),
    # expert_selection_fn: softmax over the top-k logits, or their sigmoid (norm_topk_prob)
    "cohere2_moe": _f("mlp", "cohere2_moe", shared="shared_experts"),
    # sqrt(softplus) + correction bias, renormalized, x routed_scaling_factor; hash layers routed by the decoder's
    # input_ids; a clamped SwiGLU (silu_limit)
    "deepseek_v4": _f("mlp", "scored_bias", shared="shared_experts", silu_clamp_key="swiglu_limit",
                      routing_args={"scoring": ("sqrtsoftplus", "sigmoid"), "routed_scaling_factor": 1.5}),
    # softmax; top-k of softmax + correction bias (moe_statics, [1, E]); / max(sum, moe_norm_min); the router in fp32
    "ernie4_5_moe": _f("mlp", "ernie4_5_moe", router_fp32=True, shared="shared_experts",
                       expert_keys=("moe_num_experts", "num_experts")),
    # sigmoid; top-k of sigmoid + expert_bias (use_expert_bias); / (sum + 1e-6) if norm_topk_prob; x rsf;
    # its expert_bias beside the gate; short conv layers are transformers' own
    "lfm2_moe": _sigmoid(("norm_topk_prob", True), ("use_expert_bias", True), ("routed_scaling_factor", 1.0),
                         block_attr="feed_forward"),
    # minimax_m2's router; the block multiplies the routed sum by routed_scaling_factor; swigluoai experts (gate then
    # up halves) and a swigluoai shared expert of one gate_up Linear
    "minimax_m3_vl_text": _sigmoid(rsf=("routed_scaling_factor", 2.0), shared="shared_experts", expert_keys=_LOCAL_FIRST,
                                   activation="swigluoai", routed_scale_on_output=True),
    # top-k of logit + e_score_correction_bias; sigmoid(logit) at the ids; / sum if norm_topk_prob; fp32 logits
    "kolibri1": _f("mlp", "biased_logit_sigmoid", router_fp32=True, shared="shared_experts"),
    # noaux_tc (HYV4TopkRouter: DeepSeek-V3's, its groups default to one); its routed experts' clamped SwiGLU
    # (silu_limit), its shared expert unclamped; its hyper-connections and attention sinks are transformers' own
    "hy_v4": _noaux(1, 1, 2.827, True, expert_keys=_ROUTED_FIRST, silu_clamp_key="swiglu_limit", shared_clamped=False,
                    **_DSV3),
    # DbrxFFN: softmax top-k / their p-norm (moe_normalize_expert_weights: 1 = the sum), its keys in ffn_config;
    # its experts stacked [E x I, H] (w1, v1, w2 transposed)
    "dbrx": _f("ffn", "dbrx", router_attr="router", layers="transformer.blocks"),
    # JetMoeTopKGating: top-k of the logits, softmax over those k. JetMoeMoE holds its experts (input_linear,
    # output_linear) and adds its bias (the layer's out_bias); its router returns the logits last; its attention
    # experts (JetMoeMoA, self_attention.experts) are transformers' own
    "jetmoe": _f("mlp", "topk_softmax", router_attr="router", logits_index=4, experts_attr="input_linear",
                 attention_experts=".self_attention.experts", out_bias="bias"),
    # noaux_tc (NemotronHTopkRouter: DeepSeek-V3's, its groups default to one); non-gated relu2 experts and shared
    # expert (NemotronHExperts); its Mamba mixers are transformers' own
    "nemotron_h": _noaux(1, 1, 1.0, True, block_attr="mixer", router_fp32=True, shared="shared_experts",
                         activation="relu2"),
    # softmax over E + Z (Z identity experts); top-k of softmax + correction bias; x routed_scaling_factor.
    # LongcatFlashMoE: the decoder layer adds the block's output as a shortcut after its second dense MLP
    "longcat_flash": _f("mlp", "identity_softmax", router_attr="router", router_fp32=True,
                        identity_experts_key="zero_expert_num", routing_args={"routed_scaling_factor": 6.0}),
    # Aria's multimodal config: no routing or whole model of its own here; its experts stored [E, H, 2I]
    "aria": _f("mlp", None, whole_model=False, stored_in_major=True, routed_activation="silu"),
}  # fmt: skip

# the families moepack.hf runs whole (patch, load_model)
WHOLE_MODEL: dict[str, Family] = {mt: f for mt, f in FAMILIES.items() if f.whole_model}
# the families RoutingConfig.from_hf_config routes, in the table's order
ROUTED: tuple[str, ...] = tuple(mt for mt, f in FAMILIES.items() if f.routing is not None)
# what a model_type outside the table gets: no routing, no whole model, the common checkpoint layout
UNKNOWN = Family(whole_model=False)


def family_of(model_type: str | None) -> Family:
    """The entry of ``model_type`` (``UNKNOWN`` for one outside the table)."""
    return FAMILIES.get(model_type, UNKNOWN) if isinstance(model_type, str) else UNKNOWN
