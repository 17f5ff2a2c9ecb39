"""Every decoder MoE family of the installed transformers, as a new user would try it (issue 48).

For each model type that has a causal-LM class and MoE experts, a tiny seeded model is built from its
own config class (hidden 64, 3 layers, 4 experts, top-2, the family's MoE options on: shared experts,
a first dense layer, expert groups), saved in bf16, and then: ``convert`` -> ``verify --source`` ->
either ``load_model`` and greedy tokens against transformers' own model (families moepack runs
whole, ``moepack.hf.FAMILIES``) or every packed layer against the transformers block. Each family
must end in exactly one of two ways, written down in ``EXPECTED``:

* ``WORKS``: converts, verifies, and computes what transformers computes;
* refused at convert, in one line naming the feature (the substring in ``EXPECTED``).

A family that converts and then fails (verify, load_model, a layer, the tokens) is a failure, and
so is a family whose outcome differs from ``EXPECTED`` (a family that starts working updates the
table). ``test_sweep_covers_every_family`` keeps the table equal to what transformers ships, so a
new transformers with new families fails here until each is classified.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

import pytest
import torch

import transformers

import moepack
import moepack.hf as hf
from moepack.errors import MoepackError

N_LAYERS = 3
# Every key a family's config class has among these is set (the rest keep the class defaults).
SMALL = dict(
    hidden_size=64, d_model=64, num_hidden_layers=N_LAYERS, n_layers=N_LAYERS, num_layers=N_LAYERS, num_attention_heads=2,
    n_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=96, intermediate_size_mlp=96, ffn_dim=96,
    moe_intermediate_size=32, expert_ffn_hidden_size=32, ffn_hidden_size=32, vocab_size=128, unpadded_vocab_size=128,
    vocab_size_per_layer_input=128, hidden_size_per_layer_input=0, max_position_embeddings=128,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, zero_expert_num=2,
    num_experts_per_tok=2, num_experts_per_token=2, moe_k=2, moe_topk=2, top_k_experts=2,
    n_shared_experts=1, num_shared_experts=1, shared_expert_intermediate_size=32, shared_experts_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, moe_intermediate_size_shared=32, first_k_dense_replace=1, num_dense_layers=1,
    n_group=2, num_expert_group=2, topk_group=1, enable_moe_block=True, initializer_range=0.1, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=24,
    swa_head_dim=32, swa_num_attention_heads=2, swa_num_key_value_heads=1, index_head_dim=16, index_n_heads=2, index_topk=8,
    sliding_window=16, sliding_window_size=16, kv_channels=32,
    linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_head_dim=16, linear_num_heads=2,
    mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16, mamba_d_conv=4, mamba_expand=2,
    ssm_state_size=8, n_mamba_heads=2, mamba_head_dim=16, expand=1,
)  # fmt: skip
# What the common recipe gets wrong for a family (its config class's own rules).
OVERRIDES = {
    "zaya": dict(num_experts_per_tok=1),  # "ZAYA currently supports num_experts_per_tok=1 only"
    "llama4_text": dict(num_experts_per_tok=1),  # Llama-4 routes top-1
    "llama4": dict(text_config=dict(num_experts_per_tok=1)),
    "bamba": dict(mamba_n_heads=4, mamba_d_head=32),  # heads x head dim = expand x hidden
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=32, layer_types=["mamba", "attention", "mamba"]),
    "lfm2_moe": dict(layer_types=["full_attention", "conv", "full_attention"]),
    # its default "average" is refused at convert (tests/sources/test_families.py); "sum" is what runs
    "cohere2_moe": dict(shared_expert_combination_strategy="sum"),
    "deepseek_v4": dict(swiglu_limit=0.5),  # its default 10.0 never bites at this size: the clamp must be tested
    "minimax_m3_vl_text": dict(swiglu_limit=0.5),
    "hy_v4": dict(swiglu_limit=0.5),  # its default 10.0 never bites (routed experts only; its shared expert is unclamped)  # its default 7.0 never bites at this size (routed and shared experts)
    # clip_qkv: DBRX's own 8.0 (its default None fails in DbrxAttention: clamp(min=None, max=None))
    "dbrx": dict(attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(moe_num_experts=4, moe_top_k=2, ffn_hidden_size=32)),
}  # fmt: skip
# Model types the recipe cannot make tiny, each with why (test_unbuilt_and_dense_model_types_are_what_they_say checks it).
UNBUILT = {
    "dots3_note": "its config requires num_key_value_heads == num_attention_heads per layer of a per-layer config",
    "dots3_note_text": "the per-layer attention config keeps its full size (38M parameters at hidden 64)",
    "gemma4_assistant": "a draft model: its config validator needs hidden_size_per_layer_input from the target model",
    "qwen4_exp": "an n-gram embedding of 20M rows (ngram_vocab_size_base) whatever the hidden size",
    "qwen4_exp_text": "an n-gram embedding of 20M rows (ngram_vocab_size_base) whatever the hidden size",
}
# Model types in a MoE folder whose tiny model has no experts (a dense sibling): not swept.
NOT_MOE = {"bamba", "doge", "gemma4_unified", "gemma4_unified_assistant", "gemma4_unified_text"}

# the feature each refused family's transformers block has that moepack does not run (moepack.convert.plan.UNSUPPORTED_FEATURES)
_GEMMA4 = "a MoE block woven into the decoder layer"
_SOFTCAP = "a softcapped SwiGLU on the experts"
EXPECTED = {
    "afmoe": "WORKS", "aria_text": "WORKS", "axk1": "WORKS", "axk2": "WORKS", "bailing_hybrid": "WORKS",
    "beam": "WORKS", "cohere2_moe": "WORKS", "dbrx": "WORKS", "deepseek_v2": "WORKS", "deepseek_v3": "WORKS",
    "deepseek_v32": "WORKS", "deepseek_v4": "WORKS", "dots1": "WORKS", "ernie4_5_moe": "WORKS",
    "exaone_moe": "WORKS", "flex_olmo": "WORKS", "flint": "WORKS", "gemma4": _GEMMA4, "gemma4_text": _GEMMA4,
    "glm4_moe": "WORKS", "glm4_moe_lite": "WORKS", "glm_moe_dsa": "WORKS", "gpt_oss": "WORKS", "granitemoe": "WORKS",
    "granitemoe_swa": "WORKS", "granitemoehybrid": "WORKS", "granitemoeshared": "WORKS", "hunyuan_v1_moe": "WORKS",
    "hy_v3": "WORKS", "hy_v4": "WORKS", "inkling2_loop_text": _SOFTCAP, "inkling2_text": _SOFTCAP,
    "inkling_text": "shared experts weighted by the router", "jamba": "WORKS", "jetmoe": "WORKS", "kimi_linear": "WORKS", "kolibri1": "WORKS", "llama4": "WORKS",
    "laguna": "WORKS", "lara_mini": "WORKS", "lfm2_moe": "WORKS", "llama4_text": "WORKS", "longcat_flash": "WORKS",
    "mellum": "WORKS", "mimo_v2_flash": "WORKS", "minimax": "WORKS", "minimax_m2": "WORKS",
    "minimax_m3_vl_text": "WORKS", "mixtral": "WORKS", "nemotron_h": "WORKS", "olmoe": "WORKS", "phimoe": "WORKS",
    "qwen2_moe": "WORKS", "qwen3_5_moe": "WORKS", "qwen3_5_moe_text": "WORKS", "qwen3_moe": "WORKS",
    "qwen3_next": "WORKS", "solar_open": "WORKS", "zaya": "a router that is an MLP carrying its state",
}  # fmt: skip
PROMPT = [5, 17, 3, 9]
N_NEW = 3
REL = 1e-4  # the packed bf16 experts in an fp32 pipeline against transformers in fp32 (SEMANTICS.md §4: 1e-5 per block)


def moe_model_types() -> list[str]:
    """Every model type of the installed transformers that has a causal-LM class and sits in a model
    folder whose modeling code has experts."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal

    root = os.path.dirname(transformers.__file__)
    dirs = sorted({os.path.basename(os.path.dirname(p)) for p in glob.glob(f"{root}/models/*/modeling_*.py")
                   if "experts" in Path(p).read_text()})  # fmt: skip
    return sorted({mt for d in dirs for mt, cls in causal.items() if cls and (mt == d or mt.startswith(d + "_"))})


def _sample(v: list) -> list:
    """A per-layer list cut to N_LAYERS: its first entry (often the dense or the odd layer) and its last ones."""
    return [v[0], *v[len(v) - (N_LAYERS - 1) :]] if len(v) >= N_LAYERS else v


def _small(cfg) -> dict:
    base = cfg.to_dict()
    n0 = base.get("num_hidden_layers") or base.get("n_layers") or base.get("num_layers")
    d = {k: v for k, v in SMALL.items() if k in base}
    if "qk_rope_head_dim" in base and "head_dim" in base:
        d["head_dim"] = d["qk_rope_head_dim"]  # MLA: the rotary part's width
    if "kv_lora_rank" in base:
        d["num_key_value_heads"] = d.get("num_attention_heads", 2)  # MLA: one key/value per head
    for k, v in base.items():
        if isinstance(v, list) and n0 and len(v) == n0 and k not in d:
            d[k] = _sample(v)
        if k in ("text_config", "language_config") and hasattr(getattr(cfg, k, None), "to_dict"):
            d[k] = _small(getattr(cfg, k))
    return d


def tiny_config(mt: str):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = _small(CONFIG_MAPPING[mt]())
    for k, v in OVERRIDES.get(mt, {}).items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return AutoConfig.for_model(mt, **d)


def _meta_model(mt: str):
    from transformers import AutoModelForCausalLM

    with hf.quiet_transformers(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(mt), dtype=torch.bfloat16)


def _has_experts(model) -> bool:
    return any(".experts." in n or n.endswith(".experts") for n, _ in model.named_parameters())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@torch.no_grad()
def _greedy(model, n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens without a cache (hybrid families' caches need an attention layer), and the
    logits of the prompt."""
    ids = torch.tensor([PROMPT])
    first = None
    for _ in range(n):
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        first = logits if first is None else first
        ids = torch.cat([ids, logits[-1].argmax().reshape(1, 1)], 1)
    return ids[0, len(PROMPT) :].tolist(), first


def _block_of(model, idx: int):
    """The transformers MoE block of decoder layer ``idx`` (the child that holds ``experts``; a family
    moepack runs whole: its ``block_attr``, JetMoE's attention holding experts too)."""
    layer = hf._decoder_layers(model)[idx]
    fam = hf.FAMILIES.get(model.config.model_type)
    if fam is not None and hasattr(getattr(layer, fam.block_attr, None), fam.experts_attr):
        return getattr(layer, fam.block_attr)
    for _, child in layer.named_children():
        if hasattr(child, "experts"):
            return child
    raise AssertionError(f"decoder layer {idx} has no child with experts")


@torch.no_grad()
def _check_layers(model32, dst: Path, mt: str) -> None:
    """Every packed layer (its own router, experts, shared expert) against the transformers block, in fp32."""
    packed = moepack.open(dst)
    assert packed.layers, f"{mt}: the pack has no MoE layer"
    for idx, layer in sorted(packed.layers.items()):
        g = torch.Generator().manual_seed(idx)
        x = torch.randn(7, layer.hidden_size, generator=g)
        kw, pkw = {}, {}
        if layer.hash_table is not None:  # a layer that routes by token id (DeepSeek-V4's hash layers)
            tok = torch.randint(0, layer.hash_table.shape[0], (7,), generator=g)
            kw, pkw = dict(input_ids=tok[None]), dict(token_ids=tok)
        y = _block_of(model32, idx)(x[None], **kw)
        y = (y[0] if isinstance(y, tuple) else y).reshape(7, -1)
        got = layer.forward(x, **pkw)
        assert _rel(got, y) <= REL, f"{mt} layer {idx}: packed layer vs the transformers block: rel {_rel(got, y):.2e}"


@torch.no_grad()
def _spread(model) -> None:
    """Noise on every parameter a family initializes to one value (routers to zeros, correction
    biases to zeros, norms to ones): zero router logits tie every expert, and a tie is where
    moepack and transformers choose differently on purpose (docs/ROUTING.md, lower id wins), so
    the comparison would test nothing; zero correction biases would not test their use."""
    g = torch.Generator().manual_seed(1)
    for _, p in model.named_parameters():
        if p.numel() > 1 and p.is_floating_point() and bool((p == p.flatten()[0]).all()):
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    # correction biases kept as buffers (DeepSeek-V3/V4's e_score_correction_bias, lfm2_moe's expert_bias)
    for name, b in model.named_buffers():
        if name.endswith(("e_score_correction_bias", "expert_bias")) and b.numel() > 1 and bool((b == b.flatten()[0]).all()):
            b.add_((torch.randn(b.shape, generator=g) * 0.05).to(b.dtype))
    # a token-id routing table of zeros (DeepSeek-V4's tid2eid: "real values come from the checkpoint")
    # would send every token to expert 0 twice: k distinct experts per token id, as a trained table
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(_n_experts(model), generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))


def _n_experts(model) -> int:
    c = model.config
    return next(v for k in ("n_routed_experts", "num_local_experts", "num_experts") if (v := getattr(c, k, None)))


def outcome(mt: str, tmp: Path) -> str:
    """"WORKS" or "refused at convert: <the one line>"; anything after a successful convert that
    does not match transformers raises (an assertion naming the family)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with hf.quiet_transformers():
        model = AutoModelForCausalLM.from_config(tiny_config(mt), dtype=torch.bfloat16).eval()
        _spread(model)
        model.save_pretrained(tmp / "src")
    try:
        moepack.convert(tmp / "src", tmp / "dst")
    except MoepackError as e:
        line = str(e)
        assert "\n" not in line.strip(), f"{mt}: the refusal is not one line: {line!r}"
        return line if line.startswith("refused at convert: ") else f"refused at convert: {line}"
    rep = moepack.verify(tmp / "dst", source=tmp / "src", tokens=3)
    assert rep.ok, f"{mt}: converted, then verify --source failed: {rep.model + [str(x) for x in rep.layers if not x.ok]}"
    model32 = model.float()
    _check_layers(model32, tmp / "dst", mt)
    if mt in hf.FAMILIES:
        loaded = hf.load_model(tmp / "dst", dtype=torch.float32)
        want, want_logits = _greedy(model32, N_NEW)
        got, got_logits = _greedy(loaded, N_NEW)
        assert got == want, f"{mt}: load_model's greedy tokens {got}, transformers' {want}"
        assert _rel(got_logits, want_logits) <= REL, f"{mt}: load_model's logits vs transformers': rel {_rel(got_logits, want_logits):.2e}"
    return "WORKS"


SWEPT = sorted(set(moe_model_types()) - set(UNBUILT) - NOT_MOE)


def test_sweep_covers_every_family():
    """EXPECTED classifies exactly the model types swept; a new family in transformers must be added."""
    assert sorted(EXPECTED) == SWEPT
    works = [m for m, v in EXPECTED.items() if v == "WORKS"]
    refused = [m for m, v in EXPECTED.items() if v != "WORKS"]
    assert (len(works), len(refused)) == (53, 6), (len(works), len(refused))


def test_unbuilt_and_dense_model_types_are_what_they_say():
    """UNBUILT ones fail the tiny recipe (or stay big); NOT_MOE ones build without experts."""
    for mt in sorted(UNBUILT):
        try:
            n = sum(p.numel() for p in _meta_model(mt).parameters())
        except Exception:  # noqa: BLE001 - transformers' config validators raise many kinds
            continue
        assert n > 4_000_000, f"{mt} builds tiny ({n} parameters): sweep it (remove it from UNBUILT)"
    for mt in sorted(NOT_MOE):
        assert not _has_experts(_meta_model(mt)), f"{mt} has experts: sweep it (remove it from NOT_MOE)"


@pytest.mark.parametrize("mt", SWEPT)
def test_family(mt, tmp_path):
    got = outcome(mt, tmp_path)
    want = EXPECTED[mt]
    if want == "WORKS":
        assert got == "WORKS", f"{mt}: expected to work, got {got}"
    else:
        assert got.startswith("refused at convert: ") and want in got, f"{mt}: expected a refusal naming {want!r}, got {got}"
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_checkpoint_renames_follow_transformers_own_mapping():
    """load_model and convert's model check find a parameter transformers renames on load under its
    stored name (mimo_v2_flash's sinks), concatenates from parts (kimi_linear's conv1d) or splits
    (lara_mini's in_proj), by transformers' own rules; families without a mapping get nothing."""
    names = ["model.layers.0.self_attn.attention_sink_bias", "model.layers.0.self_attn.q_proj.weight"]
    assert hf.checkpoint_renames("mimo_v2_flash", names) == {"model.layers.0.self_attn.sinks": names[0]}
    conv = [f"model.layers.0.self_attn.{x}_conv1d.weight" for x in "qkv"]
    assert hf.checkpoint_renames("kimi_linear", conv)["model.layers.0.self_attn.conv1d.weight"] == tuple(conv)
    src = "model.layers.0.linear_attn.in_proj.weight"  # lara_mini splits it on load, by the parameters' rows
    got = hf.checkpoint_renames("lara_mini", [src])
    parts = [f"model.layers.0.linear_attn.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]
    assert got == {p: hf.SplitPart(src, tuple(parts), i) for i, p in enumerate(parts)}
    assert hf.checkpoint_renames("qwen3_moe", names) == {}
    assert hf.checkpoint_renames("no_such_family", names) == {}


def _router_logits_out(router, block, x: torch.Tensor, ids: torch.Tensor, fam) -> torch.Tensor:
    """The router's logits for ``x`` [T, H]; a router whose forward takes more (its block's correction
    bias, DeepSeek-V4's token ids) is given what its block gives it."""
    import inspect

    extra = {}
    for name, par in list(inspect.signature(router.forward).parameters.items())[1:]:
        if par.kind is par.POSITIONAL_OR_KEYWORD and (name == "input_ids" or hasattr(block, name)):
            extra[name] = ids if name == "input_ids" else getattr(block, name)
    try:
        out = router(x, **extra)
    except RuntimeError:  # a router of flat tokens only (JetMoeTopKGating: its block flattens them first)
        out = router(x.reshape(-1, x.shape[-1]), **extra)
    return out[fam.logits_index] if isinstance(out, tuple) else out


def _linear_params(router, e: int, h: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The router's [E, H] weight and its [E] bias (if any), whatever the attribute names."""
    w = [p for p in router.parameters() if tuple(p.shape) == (e, h)]
    b = [p for n, p in router.named_parameters() if n.endswith("bias") and tuple(p.shape) == (e,)]
    assert len(w) == 1, f"{type(router).__name__}: {len(w)} parameters of shape [{e}, {h}]"
    return w[0], (b[0] if b else None)


@pytest.mark.parametrize("mt", sorted(set(hf.FAMILIES) & set(SWEPT)))
@torch.no_grad()
def test_family_entry_matches_transformers(mt):
    """Each ``moepack.hf.FAMILIES`` entry's claims, against the transformers modules of the family's
    tiny model (bf16, as checkpoints are run): the MoE block sits at ``block_attr`` in every decoder
    layer that has experts (and nowhere else), its router at ``router_attr`` returns [T, E] logits
    at ``logits_index``, in fp32 exactly when ``router_fp32`` says so; the shared expert is at
    ``shared`` (and a block without that entry has no shared child); ``in_major`` is the fused
    weights' orientation; and the block returns what ``returns`` says."""
    from transformers import AutoModelForCausalLM

    fam = hf.FAMILIES[mt]
    torch.manual_seed(0)
    with hf.quiet_transformers():
        model = AutoModelForCausalLM.from_config(tiny_config(mt), dtype=torch.bfloat16).eval()
    blocks = hf._moe_blocks(model, fam)
    assert blocks, f"{mt}: no decoder layer has a block with experts at {fam.block_attr!r}"
    for i, layer in enumerate(hf._decoder_layers(model)):
        holders = [n for n, c in layer.named_children() if hasattr(c, fam.experts_attr)]
        assert holders == ([fam.block_attr] if i in blocks else []), f"{mt} layer {i}: experts under {holders}"
    h = model.config.get_text_config().hidden_size
    x = torch.randn(1, 7, h, dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, 7))
    for i, block in blocks.items():
        router = getattr(block, fam.router_attr, None)
        assert isinstance(router, torch.nn.Module), f"{mt} layer {i}: no router module at {fam.router_attr!r}"
        logits = _router_logits_out(router, block, x, ids, fam)  # [1, 7, H]: routers flatten it (afmoe needs it 3-D)
        logits = logits.reshape(-1, logits.shape[-1])
        e = logits.shape[-1]
        assert tuple(logits.shape) == (7, e), f"{mt} layer {i}: router output {fam.logits_index} is {list(logits.shape)}"
        # router_fp32: the logits are the fp32 product (else the product in the model's dtype, as PackedMoEBlock computes)
        w, b = _linear_params(router, e, h)
        in32 = torch.nn.functional.linear(x.reshape(7, h).float(), w.float(), None if b is None else b.float())
        in16 = torch.nn.functional.linear(x.reshape(7, h), w.to(x.dtype), None if b is None else b.to(x.dtype)).float()
        assert torch.equal(logits.float(), in32 if fam.router_fp32 else in16), f"{mt} layer {i}: router_fp32={fam.router_fp32}"
        shared_children = [n for n, _ in block.named_children() if "shared" in n and n != "shared_expert_gate"]
        assert shared_children == ([fam.shared] if fam.shared else []), f"{mt} layer {i}: shared children {shared_children}"
        gu = getattr(getattr(block, "experts", None), "gate_up_proj", None)
        if isinstance(gu, torch.Tensor) and gu.dim() == 3:
            assert (gu.shape[1] == h and gu.shape[2] != h) == fam.in_major, f"{mt} layer {i}: gate_up_proj {list(gu.shape)}"
        out = block(x, **({"input_ids": ids} if mt == "deepseek_v4" else {}))
        if fam.returns == "tensor":
            assert isinstance(out, torch.Tensor) and out.shape == x.shape, f"{mt} layer {i}: the block returns {type(out)}"
        else:
            assert isinstance(out, tuple) and out[0].numel() == x.numel(), f"{mt} layer {i}: the block returns {type(out)}"
            want = (7, e) if fam.returns == "llama4" else (7, model.config.get_text_config().num_experts_per_tok)
            assert tuple(out[1].shape) == want, f"{mt} layer {i}: the block's second output is {list(out[1].shape)}"


def _transformers_routing(block, fam, x: torch.Tensor, ids: torch.Tensor | None, e: int, method: str) -> torch.Tensor:
    """What transformers' block routes ``x`` [1, T, H] to, as a dense [T, E] matrix of weights (0 where
    an expert is not chosen): the ids and weights its experts module is called with (``experts(hidden,
    top_k_index, top_k_weights)``); Llama-4's experts get the scaled input instead, so its router's
    scores [T, E] are taken; JetMoE's experts (``input_linear``) get tokens sorted by expert, so its
    router's (sorted positions, token of each, gate of each, count per expert) are unsorted. ``ids``:
    the token ids a block that routes by token id is given (None: none)."""
    got = {}
    mod = getattr(block, fam.experts_attr)
    hook = mod.register_forward_pre_hook(lambda m, a, k: got.update(args=a), with_kwargs=True)
    rhook = getattr(block, fam.router_attr).register_forward_hook(lambda m, a, out: got.update(router=out))
    try:
        block(x, **({"input_ids": ids} if ids is not None else {}))
    finally:
        hook.remove()
        rhook.remove()
    t = x.shape[0] * x.shape[1]
    if method == "llama4":  # Llama4Router: (sigmoid of the top-k logits scattered into -inf, logits)
        return got["router"][0].reshape(t, -1).float()
    if fam.experts_attr == "input_linear":  # JetMoeTopKGating: (index_sorted_experts, batch_index, batch_gates, expert_size, logits)
        _, token, gates, sizes, _ = got["router"]
        expert = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        return torch.zeros(t, e).index_put_((token, expert), gates.float())
    _, top_ids, top_w = got["args"][:3]
    return torch.zeros(t, e).scatter_(1, top_ids.reshape(t, -1).long(), top_w.reshape(t, -1).float())


def _correction_bias(block, e: int) -> torch.Tensor | None:
    """The block's correction bias [E] (under whatever name its family keeps it in memory), or None."""
    found = [b for n, b in [*block.named_buffers(), *block.named_parameters()]
             if n.endswith(("e_score_correction_bias", "expert_bias")) and b.numel() == e]  # fmt: skip
    assert len(found) <= 1, f"{type(block).__name__}: {len(found)} correction biases"
    return found[0].detach().reshape(-1).float() if found else None


@pytest.mark.parametrize("mt", sorted(set(hf.FAMILIES) & set(SWEPT)))
@torch.no_grad()
def test_family_routing_matches_transformers(mt):
    """Each entry's routing recipe (``moepack.families``: ``RoutingConfig.from_hf_config`` of the
    tiny model's config) against what transformers' own router computes, in fp32, in every MoE
    layer: the same experts chosen for every token and the same weights (the recipe's correction
    bias the block's; a hash layer routed by the same token ids through its table). An entry with
    ``routed_scale_on_output`` is a block that multiplies the experts' sum by routed_scaling_factor
    after weighting them: its experts get the weights divided by that factor."""
    from moepack.routing import RoutingConfig, route, route_by_token
    from transformers import AutoModelForCausalLM

    fam = hf.FAMILIES[mt]
    torch.manual_seed(0)
    with hf.quiet_transformers():
        model = AutoModelForCausalLM.from_config(tiny_config(mt), dtype=torch.float32).eval()
    _spread(model)
    cfg = RoutingConfig.from_hf_config(model.config.to_dict())
    text = model.config.get_text_config()
    x = torch.randn(1, 7, text.hidden_size)
    ids = torch.randint(0, text.vocab_size, (1, 7))
    blocks = hf._moe_blocks(model, fam)
    assert blocks, f"{mt}: no MoE block"
    # a family with token-id routed layers (DeepSeek-V4) gives every block the token ids
    by_token = any(hasattr(getattr(b, fam.router_attr), "tid2eid") for b in blocks.values())
    for i, block in blocks.items():
        logits = _router_logits_out(getattr(block, fam.router_attr), block, x, ids, fam).reshape(7, -1).float()
        e = logits.shape[1]
        table = getattr(getattr(block, fam.router_attr), "tid2eid", None)
        if table is not None:  # DeepSeek-V4's hash layers
            w, top = route_by_token(logits, cfg, table, ids.reshape(-1))
        else:
            w, top = route(logits, cfg, _correction_bias(block, e) if cfg.has_correction_bias else None)
        if fam.routed_scale_on_output:
            w = w / cfg.routed_scaling_factor
        ours = torch.zeros(7, e).scatter_(1, top.long(), w)
        theirs = _transformers_routing(block, fam, x, ids if by_token else None, e, cfg.method)
        assert torch.equal(ours != 0, theirs != 0), f"{mt} layer {i}: experts {top.tolist()}, transformers' " \
                                                      f"{[r.nonzero().flatten().tolist() for r in theirs]}"  # fmt: skip
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m: f"{mt} layer {i}: weights: {m}")
