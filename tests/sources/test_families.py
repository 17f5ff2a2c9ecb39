"""Families as convert reads them (issue 48): the misleading messages replaced by the true reason,
transformers' encoded floats decoded, and every family or block part moepack cannot run refused at
convert in one line (nothing written), which verify --source also names for a pack made without it.

The checkpoints here are hand-written safetensors files of a few tensors (H 16, I 8, E 4): what the
named families store, cut to what each rule reads. tests/integrations/test_family_sweep.py runs the
same rules over every family transformers ships.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import moepack
from moepack.errors import ConvertError, MoepackError, SourceError
from moepack.sources import open_source, text_config
from moepack.sources.checkpoint import Checkpoint, decode_special_floats

H, I, E = 16, 8, 4
BF16 = torch.bfloat16


def _t(*shape, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.2).to(BF16)


def _write(d: Path, tensors: dict, config: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config))
    return d


def _qwen3(prefix: str = "model.layers.0.mlp", layers=(0,), extra: dict | None = None, **cfg) -> tuple[dict, dict]:
    """A qwen3_moe-style checkpoint of fused out-major experts under ``prefix`` (``{i}`` = the layer)."""
    t = {}
    for i in layers:
        p = prefix.format(i=i)
        t[f"{p}.gate.weight"] = _t(E, H, seed=i)
        t[f"{p}.experts.gate_up_proj"] = _t(E, 2 * I, H, seed=10 + i)
        t[f"{p}.experts.down_proj"] = _t(E, H, I, seed=20 + i)
    t.update(extra or {})
    config = {"model_type": "qwen3_moe", "hidden_size": H, "num_experts": E, "num_experts_per_tok": 2,
              "moe_intermediate_size": I, "hidden_act": "silu", "num_hidden_layers": len(layers), **cfg}  # fmt: skip
    return t, config


# --------------------------------------------------------------------------------------------
# the misleading messages


def test_experts_directly_under_a_decoder_layer_have_its_index(tmp_path):
    """gemma4 / mistral_large4 keep the experts at ``model.layers.<i>.experts``: the layer index is
    read from a prefix that ends with it (dense.py defined its pattern twice, the second needing a dot)."""
    t, cfg = _qwen3("model.layers.{i}", layers=(0, 1))
    ckpt, reader = open_source(_write(tmp_path / "src", t, cfg))
    specs = reader.layers(ckpt)
    assert [(s.index, s.prefix) for s in specs] == [(0, "model.layers.0"), (1, "model.layers.1")]
    moepack.convert(tmp_path / "src", tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=tmp_path / "src", tokens=2).ok


def test_dbrx_reads_its_stacked_experts(tmp_path):
    """DBRX states H as ``d_model`` and E as ``ffn_config.moe_num_experts``; its experts are
    ``ffn.experts.mlp.{w1,v1,w2}`` [E*I, H] (expert e's rows e*I..(e+1)*I; w2 the down projection
    transposed, as DbrxExpertGLU computes ``a @ w2``): read into the canonical gate/up and down, the
    whole layer and one expert at a time alike (it used to say hidden_size=None, then "names moepack
    does not read"), and converted and verified."""
    from moepack.sources.dense import read_expert_w13, read_expert_w2, read_layer

    p = "transformer.blocks.0.ffn"
    w1, v1, w2 = _t(E * I, H, seed=1), _t(E * I, H, seed=2), _t(E * I, H, seed=3)
    t = {f"{p}.router.layer.weight": _t(E, H), f"{p}.experts.mlp.w1": w1, f"{p}.experts.mlp.v1": v1, f"{p}.experts.mlp.w2": w2}
    cfg = {"model_type": "dbrx", "d_model": H, "n_layers": 1, "ffn_config": {"moe_num_experts": E, "moe_top_k": 2}}
    src = _write(tmp_path / "src", t, cfg)
    ckpt, reader = open_source(src)
    (spec,) = reader.layers(ckpt)
    assert (spec.kind, spec.index, spec.num_experts, spec.hidden, spec.intermediate) == ("dbrx", 0, E, H, I)
    assert spec.router["weight"] == f"{p}.router.layer.weight"
    whole = read_layer(ckpt, spec)
    for e in range(E):
        rows = slice(e * I, (e + 1) * I)
        assert torch.equal(whole.w13[e], torch.cat([w1[rows], v1[rows]])) and torch.equal(whole.w2[e], w2[rows].T)
        assert torch.equal(read_expert_w13(ckpt, spec, e), whole.w13[e]) and torch.equal(read_expert_w2(ckpt, spec, e), whole.w2[e])
    moepack.convert(src, tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=src).ok
    r = moepack.open(tmp_path / "dst").layers[0].routing
    assert (r.method, r.top_k, r.renormalize) == ("softmax", 2, True)


def test_dbrx_stacked_experts_are_read_from_float_tensors_only(tmp_path):
    """A reader that allows other dtypes (a quantized one) does not get DBRX's stacked experts as codes."""
    from moepack.sources.dense import discover_layers

    p = "transformer.blocks.0.ffn"
    t = {f"{p}.router.layer.weight": _t(E, H), **{f"{p}.experts.mlp.{w}": torch.ones(E * I, H, dtype=torch.int8) for w in ("w1", "v1", "w2")}}
    cfg = {"model_type": "dbrx", "d_model": H, "n_layers": 1, "ffn_config": {"moe_num_experts": E, "moe_top_k": 2}}
    src = _write(tmp_path / "src", t, cfg)
    with pytest.raises(SourceError, match=r"experts\.mlp\.w1' is I8: moepack reads DBRX's stacked experts from float"):
        discover_layers(Checkpoint(src), ({"BF16", "I8"}, "BF16 or I8"))


def test_dbrx_refuses_another_norm_of_its_weights(tmp_path):
    """DBRX divides its top-k weights by their p-norm: p = 1 (the sum) and None (no division) run;
    another p is refused at convert, naming the key."""
    from moepack.routing import RoutingConfig

    ffn = {"moe_num_experts": E, "moe_top_k": 2}
    assert not RoutingConfig.from_hf_config({"model_type": "dbrx", "ffn_config": {**ffn, "moe_normalize_expert_weights": None}}).renormalize
    with pytest.raises(MoepackError, match=r"dbrx ffn_config\.moe_normalize_expert_weights=2\.0: moepack divides"):
        RoutingConfig.from_hf_config({"model_type": "dbrx", "ffn_config": {**ffn, "moe_normalize_expert_weights": 2.0}})


def test_ernie_counts_its_experts_from_moe_num_experts(tmp_path):
    """ernie4_5_moe (and aria) state E as ``moe_num_experts`` (it used to be "number of experts missing")."""
    t, cfg = _qwen3()
    del cfg["num_experts"]
    cfg.update(model_type="ernie4_5_moe", moe_num_experts=E)
    ckpt, reader = open_source(_write(tmp_path, t, cfg))
    assert [s.num_experts for s in reader.layers(ckpt)] == [E]


def test_a_moe_checkpoint_with_unread_expert_names_is_not_called_dense(tmp_path):
    """inkling2 stores ``experts.w13_weight`` / ``w2_weight``: a MoE checkpoint whose names no reader
    knows, said as such (it used to be "not a MoE checkpoint")."""
    p = "model.llm.layers.0.mlp"
    t = {f"{p}.gate.weight": _t(E, H), f"{p}.experts.w13_weight": _t(E, H, 2 * I), f"{p}.experts.w2_weight": _t(E, I, H)}
    ckpt, reader = open_source(_write(tmp_path, t, {"model_type": "inkling2_text", "hidden_size": H, "n_routed_experts": E}))
    with pytest.raises(SourceError, match=r"model_type='inkling2_text' is a MoE model, but its expert tensors "
                                          r"\('model.llm.layers.0.mlp.experts.w13_weight'"):  # fmt: skip
        reader.layers(ckpt)
    dense = {"model.layers.0.mlp.up_proj.weight": _t(I, H)}
    ckpt, reader = open_source(_write(tmp_path / "dense", dense, {"model_type": "llama", "hidden_size": H}))
    with pytest.raises(SourceError, match=r"not a MoE checkpoint \(model_type='llama'\)"):
        reader.layers(ckpt)


# --------------------------------------------------------------------------------------------
# transformers' encoded floats


def test_encoded_floats_are_decoded_and_an_unknown_tag_is_refused(tmp_path):
    cfg = {"a": {"__float__": "Infinity"}, "b": [0.0, {"__float__": "-Infinity"}], "c": {"d": {"__float__": "NaN"}}}
    got = decode_special_floats(cfg)
    assert got["a"] == math.inf and got["b"] == [0.0, -math.inf] and math.isnan(got["c"]["d"])
    assert cfg["a"] == {"__float__": "Infinity"}  # the stored config is left as written
    t, c = _qwen3(time_step_limit={"__float__": "Infinite"})
    with pytest.raises(SourceError, match=r"config.json: time_step_limit=\{'__float__': 'Infinite'\}: .* must be 'Infinity'"):
        Checkpoint(_write(tmp_path, t, c))


def test_an_encoded_infinity_reaches_the_rules_as_a_float(tmp_path):
    """routed_scaling_factor {"__float__": "Infinity"} is refused by the routing rule for what it is
    (a raw dict used to reach float() and the rules as an object)."""
    t, c = _qwen3()
    c.update(model_type="deepseek_v3", n_routed_experts=E, routed_scaling_factor={"__float__": "Infinity"}, n_group=1, topk_group=1)
    src = _write(tmp_path / "src", t, c)
    assert text_config(Checkpoint(src).config)["routed_scaling_factor"] == math.inf
    with pytest.raises(ConvertError, match=r"refused at convert: model_type='deepseek_v3': routing: .*routed_scaling_factor.*inf"):
        moepack.convert(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_load_model_gets_the_decoded_config(tmp_path):
    """A carried config value transformers encoded is decoded before transformers builds the model
    from the pack (as its own from_pretrained does): load_model's config holds the float."""
    pytest.importorskip("transformers", reason="host lacks: transformers")
    from tests.support.ckpt_edit import copy_checkpoint, edit_config
    from tests.support.fixtures_util import fixture_dir

    src = copy_checkpoint(fixture_dir("qwen3_moe"), tmp_path / "src")
    edit_config(src, lambda c: c.update(moepack_test_limit=[0.0, {"__float__": "Infinity"}]))
    moepack.convert(src, tmp_path / "dst")
    model = moepack.load_model(tmp_path / "dst")
    assert model.config.moepack_test_limit == [0.0, math.inf]


# --------------------------------------------------------------------------------------------
# refused at convert: what moepack cannot run


def _refused(tmp_path: Path, t: dict, cfg: dict, pattern: str) -> None:
    src = _write(tmp_path / "src", t, cfg)
    with pytest.raises(ConvertError, match=pattern) as ei:
        moepack.convert(src, tmp_path / "dst")
    assert "\n" not in str(ei.value)
    assert not (tmp_path / "dst").exists()


def test_a_family_whose_block_moepack_lacks_is_refused_before_its_tensors(tmp_path):
    """What a family's block computes that moepack does not run is the first thing convert names
    (nemotron_h's non-gated experts used to be refused as "expert 0 has no gate weight")."""
    p = "model.layers.0.mlp"
    t = {f"{p}.router.weight": _t(E, H), f"{p}.experts.gate_up_proj": _t(E, 2 * I, H), f"{p}.experts.down_proj": _t(E, H, I)}
    _refused(tmp_path, t, {"model_type": "zaya", "hidden_size": H, "num_experts": E, "num_experts_per_tok": 1},
             r"^refused at convert: model_type='zaya': a router that is an MLP carrying its state .*: moepack does not run this family$")
    # a family moepack knows nothing of is refused for its routing
    _refused(tmp_path / "other", t, {"model_type": "no_such_moe", "hidden_size": H, "num_experts": E, "num_experts_per_tok": 2},
             r"^refused at convert: model_type='no_such_moe': routing: moepack does not run this family's routing")


def test_a_clamped_swiglu_on_silu_experts_is_refused(tmp_path):
    """swiglu_limit on the silu experts of a family other than deepseek_v4 (glm5_next, bailing_hybrid):
    the silu kernels run DeepSeek-V4's clamp only (recorded as silu_limit, tests/sources/test_deepseek_v4.py),
    and another family's is not known to be that one."""
    t, c = _qwen3(swiglu_limit=7.0)
    _refused(tmp_path, t, c, r"model_type='qwen3_moe': swiglu_limit=7.0 with silu experts: a clamped SwiGLU")


@pytest.mark.parametrize("names,feature", [
    (("shared_mlp.input_linear.weight", "shared_mlp.output_linear.weight"), "a shared expert under names moepack does not read"),
    (("shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight"), "a shared expert under names"),
    (("post_moe_norm.weight",), "a norm inside the MoE block"),
    (("moe_statics.e_score_correction_bias",), "a bias moepack does not apply"),
])  # fmt: skip
def test_a_block_part_moepack_does_not_pack_is_refused(tmp_path, names, feature):
    """Every tensor inside the MoE block must be packed or recorded (experts, router, a gate/up/down
    shared expert and its gate): hunyuan's ``shared_mlp``, ``shared_experts.w1/w2/w3`` and a
    ``moe_statics`` bias in a family whose transformers mapping does not load them as a shared expert
    and a correction bias (deepseek_v4's and ernie4_5_moe's does: those run), a norm inside the block
    would otherwise be dropped without a word."""
    p = "model.layers.0.mlp"
    t, c = _qwen3(extra={f"{p}.{n}": _t(H, H) for n in names})
    _refused(tmp_path, t, c, rf"model_type='qwen3_moe' layer 0: tensor '{p}.{names[0]}'.* is {feature}")


def _shared(p: str) -> dict:
    return {f"{p}.shared_experts.gate_proj.weight": _t(I, H), f"{p}.shared_experts.up_proj.weight": _t(I, H),
            f"{p}.shared_experts.down_proj.weight": _t(H, I)}  # fmt: skip


def test_an_averaged_shared_expert_is_refused(tmp_path):
    """cohere2_moe's shared_expert_combination_strategy 'average' halves (routed + shared): moepack adds."""
    t, c = _qwen3(extra=_shared("model.layers.0.mlp"), model_type="cohere2_moe", shared_expert_combination_strategy="average")
    _refused(tmp_path, t, c, r"model_type='cohere2_moe': shared_expert_combination_strategy='average': an averaged shared expert")
    c["shared_expert_combination_strategy"] = "sum"
    moepack.convert(_write(tmp_path / "sum", t, c), tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=tmp_path / "sum", tokens=2).ok


def _aria(hidden_act: str) -> tuple[dict, dict]:
    p = "model.layers.0.mlp"
    t = {f"{p}.router.weight": _t(E, H), f"{p}.experts.fc1.weight": _t(E, H, 2 * I), f"{p}.experts.fc2.weight": _t(E, I, H)}
    return t, {"model_type": "aria_text", "hidden_size": H, "moe_num_experts": E, "moe_topk": 2, "intermediate_size": I,
               "hidden_act": hidden_act, "num_hidden_layers": 1}  # fmt: skip


def test_aria_reads_its_in_major_fc1_fc2_experts_and_refuses_another_activation(tmp_path):
    """aria stores its fused experts input-major as experts.fc1 / fc2 (transformers renames them on
    load); its routed experts are always silu and only the shared expert follows hidden_act."""
    t, c = _aria("silu")
    moepack.convert(_write(tmp_path / "src", t, c), tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=tmp_path / "src", tokens=2).ok
    layer = moepack.open(tmp_path / "dst").layers[0]
    assert (layer.num_experts, layer.hidden_size, layer.intermediate_size) == (E, H, I)
    t, c = _aria("gelu")
    _refused(tmp_path / "gelu", t, c, r"model_type='aria_text': hidden_act='gelu': its routed experts are always silu")


def test_identity_experts_are_refused(tmp_path):
    """longcat_flash routes among E real and zero_expert_num identity experts: a pack of the E would
    route among fewer and never return the input."""
    t, c = _qwen3(zero_expert_num=2)
    _refused(tmp_path, t, c, r"model_type='qwen3_moe': zero_expert_num=2: identity \(zero-computation\) experts")


Z = 2  # longcat_flash's identity experts in the checkpoints below


def _longcat(tmp_path) -> tuple[Path, dict]:
    """A longcat_flash checkpoint as transformers saves it: per-expert weights of E experts, gate/up rows
    (no down) for the Z identity experts (LongcatFlashExperts keeps E + Z of them, never used), a router
    classifier [E + Z, H] and its correction bias [E + Z]."""
    p = "model.layers.0.mlp"
    t = {f"{p}.router.classifier.weight": _t(E + Z, H, seed=1) * 4, f"{p}.router.e_score_correction_bias": _t(E + Z, seed=2)}
    for e in range(E + Z):
        t[f"{p}.experts.{e}.gate_proj.weight"] = _t(I, H, seed=10 + e)
        t[f"{p}.experts.{e}.up_proj.weight"] = _t(I, H, seed=20 + e)
        if e < E:
            t[f"{p}.experts.{e}.down_proj.weight"] = _t(H, I, seed=30 + e)
    cfg = {"model_type": "longcat_flash", "hidden_size": H, "n_routed_experts": E, "zero_expert_num": Z,
           "num_experts_per_tok": 2, "expert_ffn_hidden_size": I, "hidden_act": "silu", "num_layers": 1,
           "routed_scaling_factor": 6.0}  # fmt: skip
    return _write(tmp_path / "src", t, cfg), t


def test_longcat_identity_experts_are_recorded_run_and_verified(tmp_path):
    """longcat_flash's router picks among E experts and Z identity (zero-computation) experts, ids
    E .. E+Z-1, which return the token times its routing weight: convert packs the E, records Z as the
    layer's identity_experts (format version 7) and carries the identity experts' unused gate/up rows
    unchanged; the layer equals transformers' LongcatFlashMoE (identity slots included), verify --source
    passes it, and fails a pack whose identity_experts is gone; the manifest sealed as version 6 is refused."""
    from transformers import LongcatFlashConfig
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

    src, t = _longcat(tmp_path)
    moepack.convert(src, tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=src, tokens=2).ok
    m = json.loads((tmp_path / "dst" / "moepack.json").read_text())
    assert m["format_version"] == 7 and m["layers"][0]["identity_experts"] == Z and m["layers"][0]["num_experts"] == E
    assert m["routing"]["num_experts"] == E + Z and m["routing"]["method"] == "softmax" and not m["routing"]["renormalize"]
    kept = [f"model.layers.0.mlp.experts.{e}.{w}_proj.weight" for e in range(E, E + Z) for w in ("gate", "up")]
    assert all(n in m["tensors"] and not n.startswith("moepack.") for n in kept)  # carried as stored
    layer = moepack.open(tmp_path / "dst").layers[0]
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3))
    w, ids = layer.route(layer.router_logits(x), x)
    assert bool((ids >= E).any()) and bool((ids < E).any())  # both kinds of slot are exercised
    cfg = LongcatFlashConfig(hidden_size=H, n_routed_experts=E, zero_expert_num=Z, num_experts_per_tok=2,
                             expert_ffn_hidden_size=I, routed_scaling_factor=6.0)  # fmt: skip
    block = LongcatFlashMoE(cfg).float().eval()
    p = "model.layers.0.mlp"
    with torch.no_grad():
        block.router.classifier.weight.copy_(t[f"{p}.router.classifier.weight"].float())
        block.router.e_score_correction_bias.copy_(t[f"{p}.router.e_score_correction_bias"].float())
        for e in range(E + Z):
            block.experts.gate_up_proj[e].copy_(torch.cat([t[f"{p}.experts.{e}.{w}_proj.weight"] for w in ("gate", "up")]).float())
            if e < E:
                block.experts.down_proj[e].copy_(t[f"{p}.experts.{e}.down_proj.weight"].float())
        want = block(x[None])[0]
    got = layer(x)
    assert float((got - want).norm() / want.norm()) < 1e-5
    # experts() computes the identity slots too: a token routed to identity experts only is its input times their weights
    only = torch.tensor([[E, E + 1]], dtype=torch.int32)
    torch.testing.assert_close(layer.experts(x[:1], torch.tensor([[0.25, 0.5]]), only), 0.75 * x[:1])
    with pytest.raises(MoepackError, match=r"identity experts .*expert_map is not taken"):
        layer.experts(x, w, ids, expert_map=torch.arange(E + Z, dtype=torch.int32))
    edited, as_v6 = _edited_copies(tmp_path / "dst", lambda m: m["layers"][0].pop("identity_experts"))
    with pytest.raises(MoepackError, match=r"layers\[0\]\.num_experts.*must equal routing\.num_experts=6"):
        moepack.open(edited)
    with pytest.raises(MoepackError, match=r"layers\[0\]\.identity_experts.*needs format_version 7"):
        moepack.open(as_v6)


def test_longcat_refuses_a_down_projection_for_an_identity_expert(tmp_path):
    """An identity expert returns its input: a checkpoint that stores a down projection for one of the
    ids E .. E+Z-1 holds an expert moepack would not run, and is refused naming the tensor."""
    src, t = _longcat(tmp_path)
    t[f"model.layers.0.mlp.experts.{E}.down_proj.weight"] = _t(H, I)
    _write(src, t, json.loads((src / "config.json").read_text()))
    with pytest.raises(SourceError, match=rf"extra expert tensors \['model.layers.0.mlp.experts.{E}.down_proj.weight'\]"):
        moepack.convert(src, tmp_path / "dst")


def _nemotron_h(tmp_path, **cfg) -> tuple[Path, dict, dict]:
    """A nemotron_h checkpoint: non-gated per-expert up/down, an fp32 router and correction bias, a
    non-gated shared expert (NemotronHMLP: up and down), under backbone.layers.<n>.mixer."""
    p = "backbone.layers.0.mixer"
    t = {f"{p}.gate.weight": _t(E, H, seed=1).float() * 4, f"{p}.gate.e_score_correction_bias": _t(E, seed=2).float(),
         f"{p}.shared_experts.up_proj.weight": _t(I, H, seed=3), f"{p}.shared_experts.down_proj.weight": _t(H, I, seed=4)}
    for e in range(E):
        t[f"{p}.experts.{e}.up_proj.weight"] = _t(I, H, seed=10 + e) * 4
        t[f"{p}.experts.{e}.down_proj.weight"] = _t(H, I, seed=20 + e)
    c = {"model_type": "nemotron_h", "hidden_size": H, "n_routed_experts": E, "num_experts_per_tok": 2,
         "moe_intermediate_size": I, "moe_shared_expert_intermediate_size": I, "mlp_hidden_act": "relu2",
         "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_hidden_layers": 1, **cfg}
    return _write(tmp_path / "src", t, c), t, c


def test_nemotron_h_runs_its_non_gated_relu2_experts(tmp_path):
    """nemotron_h's experts and shared expert are non-gated (up -> relu(x)^2 -> down): convert packs
    w13 as the up rows alone (activation relu2, format version 7), the layer equals transformers'
    NemotronHMoE (noaux_tc routing, shared expert added), verify --source passes it; the manifest
    sealed as version 6 is refused; a gate tensor, a latent projection and a quantized target are
    refused at convert."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    src, t, c = _nemotron_h(tmp_path)
    moepack.convert(src, tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=src, tokens=2).ok
    m = json.loads((tmp_path / "dst" / "moepack.json").read_text())
    e0 = m["layers"][0]
    assert m["format_version"] == 7 and e0["activation"] == "relu2" and e0["shared"]["intermediate"] == I
    ip = e0["padded_intermediate"]
    assert m["tensors"][e0["tensors"]["w13"]]["shape"][:2] == [E, ip]  # Ip rows: no gate half
    layer = moepack.open(tmp_path / "dst").layers[0]
    cfg = NemotronHConfig(hidden_size=H, n_routed_experts=E, num_experts_per_tok=2, moe_intermediate_size=I,
                          moe_shared_expert_intermediate_size=I, n_group=1, topk_group=1, routed_scaling_factor=2.5)  # fmt: skip
    block = NemotronHMoE(cfg).float().eval()
    p = "backbone.layers.0.mixer"
    with torch.no_grad():
        block.gate.weight.copy_(t[f"{p}.gate.weight"])
        block.gate.e_score_correction_bias.copy_(t[f"{p}.gate.e_score_correction_bias"])
        for e in range(E):
            block.experts.up_proj[e].copy_(t[f"{p}.experts.{e}.up_proj.weight"].float())
            block.experts.down_proj[e].copy_(t[f"{p}.experts.{e}.down_proj.weight"].float())
        block.shared_experts.up_proj.weight.copy_(t[f"{p}.shared_experts.up_proj.weight"].float())
        block.shared_experts.down_proj.weight.copy_(t[f"{p}.shared_experts.down_proj.weight"].float())
        x = torch.randn(1, 11, H, generator=torch.Generator().manual_seed(4))
        want = block(x)[0]
    got = layer(x[0])
    assert float((got - want).norm() / want.norm()) < 1e-5
    _, as_v6 = _edited_copies(tmp_path / "dst", lambda m: None)
    with pytest.raises(MoepackError, match=r"layers\[0\]\.activation='relu2'.*needs format_version 7"):
        moepack.open(as_v6)
    with pytest.raises(ConvertError, match=r"non-gated relu2 experts are packed from float weights into the float layout only"):
        moepack.convert(src, tmp_path / "q", quantize="int8")
    _refused(tmp_path / "latent", t, {**c, "moe_latent_size": 8}, r"moe_latent_size=8: a latent projection around the experts")
    t[f"{p}.experts.0.gate_proj.weight"] = _t(I, H)
    with pytest.raises(SourceError, match=r"experts.0.gate_proj.weight'.*non-gated \(relu2: up and down only\)"):
        moepack.convert(_write(tmp_path / "gated", t, c), tmp_path / "g")


def test_jetmoe_output_bias_is_recorded_applied_and_verified(tmp_path):
    """JetMoeMoE adds a bias [H] to its combined output (mlp.bias) and keeps Granite-style experts
    (input_linear, output_linear) in the block itself; its attention experts (JetMoeMoA) use the same
    names under self_attention.experts: convert packs the MLP's experts only, records the bias as the
    layer's out_bias (format version 7), carries the attention experts; the layer equals transformers'
    JetMoeMoE; verify --source fails a pack without the bias, and the manifest sealed as version 6 is refused."""
    from transformers import JetMoeConfig
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeMoE

    p, a = "model.layers.0.mlp", "model.layers.0.self_attention.experts"
    t = {f"{p}.router.layer.weight": _t(E, H, seed=1) * 4, f"{p}.input_linear.weight": _t(E, 2 * I, H, seed=2) * 4,
         f"{p}.output_linear.weight": _t(E, H, I, seed=3), f"{p}.bias": _t(H, seed=4),
         f"{a}.router.layer.weight": _t(E, H, seed=5), f"{a}.input_linear.weight": _t(E, I, H, seed=6),
         f"{a}.output_linear.weight": _t(E, H, I, seed=7), f"{a}.bias": _t(H, seed=8)}  # fmt: skip
    c = {"model_type": "jetmoe", "hidden_size": H, "num_local_experts": E, "num_experts_per_tok": 2, "intermediate_size": I,
         "activation_function": "silu", "num_hidden_layers": 1}  # fmt: skip
    src = _write(tmp_path / "src", t, c)
    moepack.convert(src, tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=src, tokens=2).ok
    m = json.loads((tmp_path / "dst" / "moepack.json").read_text())
    assert m["format_version"] == 7 and m["layers"][0]["out_bias"] == f"{p}.bias" and [e["prefix"] for e in m["layers"]] == [p]
    assert all(n in m["tensors"] for n in t if n.startswith(a))  # the attention experts, carried as stored
    cfg = JetMoeConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2, intermediate_size=I)
    block = JetMoeMoE(cfg).float().eval()
    with torch.no_grad():
        block.router.layer.weight.copy_(t[f"{p}.router.layer.weight"].float())
        block.input_linear.weight.copy_(t[f"{p}.input_linear.weight"].float())
        block.output_linear.weight.copy_(t[f"{p}.output_linear.weight"].float())
        block.bias.copy_(t[f"{p}.bias"].float())
        x = torch.randn(1, 9, H, generator=torch.Generator().manual_seed(5))
        want = block(x)[0]
    got = moepack.open(tmp_path / "dst").layers[0](x[0])
    assert float((got - want).norm() / want.norm()) < 1e-5
    edited, as_v6 = _edited_copies(tmp_path / "dst", lambda m: m["layers"][0].pop("out_bias"))
    rep = moepack.verify(edited, source=src, tokens=2)
    assert any("layer 0 out_bias (a bias added to the block's output): pack None" in line for line in rep.model), rep.model
    with pytest.raises(MoepackError, match=r"layers\[0\]\.out_bias.*needs format_version 7 .*would not add it"):
        moepack.open(as_v6)


def _edited_copies(dst: Path, edit) -> tuple[Path, Path]:
    """Two copies of the packed directory ``dst``, resealed (tests.support.packdir_edit.reseal): one with
    ``edit`` applied to its manifest, one with the manifest as convert wrote it but format_version 6."""
    import shutil

    from tests.support.packdir_edit import reseal

    out = []
    for name, change in (("edited", edit), ("as_v6", lambda m: m.update(format_version=6))):
        d = dst.parent / name
        shutil.copytree(dst, d)
        m = json.loads((dst / "moepack.json").read_text())
        change(m)
        (d / "moepack.json").write_text(json.dumps(reseal(m)))
        out.append(d)
    return out[0], out[1]


def test_a_norm_after_the_block_is_recorded_applied_and_verified(tmp_path):
    """axk1's block normalizes its output (post_mlp_layernorm), which its checkpoint stores beside the
    block in the decoder layer: convert records it as the layer's post_norm (format version 7) and the
    layer's forward applies it (AXK1RMSNorm's formula) after the routed and shared experts; a pack
    without it fails verify --source, and the same manifest sealed as version 6 is refused."""
    p = "model.layers.0.mlp"
    norm = (1.0 + _t(H, seed=9).float()).to(BF16)
    t, c = _qwen3(extra={f"{p}.gate.e_score_correction_bias": torch.zeros(E), "model.layers.0.post_mlp_layernorm.weight": norm},
                  model_type="axk1", n_routed_experts=E, n_group=1, topk_group=1, rms_norm_eps=1e-5)  # fmt: skip
    src = _write(tmp_path / "src", t, c)
    moepack.convert(src, tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=src, tokens=2).ok
    m = json.loads((tmp_path / "dst" / "moepack.json").read_text())
    assert m["format_version"] == 7
    assert m["layers"][0]["post_norm"] == {"weight": "model.layers.0.post_mlp_layernorm.weight", "eps": 1e-5}
    layer = moepack.open(tmp_path / "dst").layers[0]
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2))
    w, ids = layer.route(layer.router_logits(x), x)
    y = layer.experts(x, w, ids)
    want = norm.float() * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-6)
    edited, as_v6 = _edited_copies(tmp_path / "dst", lambda m: m["layers"][0].pop("post_norm"))
    rep = moepack.verify(edited, source=src, tokens=2)
    assert any("layer 0 post_norm (a norm after the block): pack None" in line for line in rep.model), rep.model
    with pytest.raises(MoepackError, match=r"layers\[0\]\.post_norm.*needs format_version 7 .*would not apply it"):
        moepack.open(as_v6)


def test_verify_fails_a_pack_that_leaves_out_a_part_of_the_block(tmp_path):
    """A pack made before the rule (or edited) whose source has a block part it lacks: verify --source
    names it (it used to pass: the reader did not see the part either)."""
    t, c = _qwen3()
    src = _write(tmp_path / "src", t, c)
    moepack.convert(src, tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=src, tokens=2).ok
    t["model.layers.0.mlp.shared_mlp.input_linear.weight"] = _t(2 * I, H)
    _write(src, t, c)
    rep = moepack.verify(tmp_path / "dst", source=src, tokens=2)
    assert not rep.ok
    assert any("tensor 'model.layers.0.mlp.shared_mlp.input_linear.weight' is a shared expert under names moepack does not read"
               in line for line in rep.model), rep.model
    c.update(swiglu_limit=7.0)
    _write(src, {k: v for k, v in t.items() if "shared_mlp" not in k}, c)
    rep = moepack.verify(tmp_path / "dst", source=src, tokens=2)
    assert any("swiglu_limit=7.0 with silu experts" in line for line in rep.model), rep.model


def _minimax_m3(tmp_path) -> Path:
    """A minimax_m3_vl_text checkpoint: swigluoai experts (gate then up halves) and a shared expert of
    one gate_up Linear [2 x Is, H]."""
    t, cfg = _qwen3()
    t["model.layers.0.mlp.gate.e_score_correction_bias"] = _t(E, seed=3).float()
    t["model.layers.0.mlp.shared_experts.gate_up_proj.weight"] = _t(2 * I, H, seed=4)
    t["model.layers.0.mlp.shared_experts.down_proj.weight"] = _t(H, I, seed=5)
    cfg.update(model_type="minimax_m3_vl_text", num_local_experts=E, intermediate_size=I, swiglu_limit=0.3,
               routed_scaling_factor=2.0)  # fmt: skip
    return _write(tmp_path / "src", t, cfg)


def test_minimax_m3_runs_its_fused_swigluoai_shared_expert_and_guards_its_format(tmp_path):
    """MiniMax-M3: the shared expert's one gate_up Linear is read as gate rows then up rows and run
    in the layer's swigluoai (alpha, limit), as MiniMaxM3VLDenseMLP does; the pack is format version
    7, and the same manifest sealed as version 6 (whose readers run a shared expert as silu) is refused."""
    src = _minimax_m3(tmp_path)
    moepack.convert(src, tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=src).ok
    layer = moepack.open(tmp_path / "dst").layers[0]
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    gu = _t(2 * I, H, seed=4).float()
    gate, up = (x @ gu.T).chunk(2, dim=-1)
    g = gate.clamp(max=0.3)  # MiniMaxM3VLDenseMLP's gate, written out
    want = ((up.clamp(-0.3, 0.3) + 1) * g * torch.sigmoid(1.702 * g)) @ _t(H, I, seed=5).float().T
    got = layer.shared_expert(x.to(BF16)).float()
    assert float((got - want).norm() / want.norm()) < 2e-2  # bf16 activations (SEMANTICS.md §4)
    m = json.loads((tmp_path / "dst" / "moepack.json").read_text())
    assert m["format_version"] == 7 and m["layers"][0]["activation"] == "swigluoai"
    assert m["layers"][0]["shared"]["source_tensors"] == ["model.layers.0.mlp.shared_experts.gate_up_proj.weight",
                                                          "model.layers.0.mlp.shared_experts.down_proj.weight"]  # fmt: skip
    _, as_v6 = _edited_copies(tmp_path / "dst", lambda m: None)
    with pytest.raises(MoepackError, match=r"layers\[0\]\.shared.*swigluoai layer needs format_version 7 .*runs it as silu"):
        moepack.open(as_v6)


def test_a_quantized_fused_shared_expert_is_refused(tmp_path):
    """A fused gate/up shared expert is read from float tensors only: stored as codes (a reader that
    allows I8 weights) it is refused naming it, not split as if it were float."""
    from moepack.sources.dense import discover_layers

    t, cfg = _qwen3()
    t["model.layers.0.mlp.shared_experts.gate_up_proj.weight"] = torch.ones(2 * I, H, dtype=torch.int8)
    t["model.layers.0.mlp.shared_experts.down_proj.weight"] = torch.ones(H, I, dtype=torch.int8)
    src = _write(tmp_path / "src", t, cfg)
    with pytest.raises(SourceError, match=r"shared_experts\.gate_up_proj\.weight' is a fused gate/up shared expert stored as I8"):
        discover_layers(Checkpoint(src), ({"BF16", "I8"}, "BF16 or I8"))


def test_hy_v4_clamps_its_routed_experts_only(tmp_path):
    """hy_v4 clamps its routed experts' SwiGLU (HYV4Experts._apply_gate) and not its shared expert
    (HYV4MLP), whose gate transformers loads from ``shared_experts.linear_gate``: the layer records
    ``silu_limit`` and ``shared.silu_limit`` null (format version 7); the shared expert computes the
    unclamped silu; a pack whose shared expert is clamped fails verify --source, and the manifest
    sealed as version 6 is refused."""
    p = "model.layers.0.mlp"
    g, u, d = _t(I, H, seed=4) * 20, _t(I, H, seed=5) * 20, _t(H, I, seed=6)  # large enough for the clamp to bite
    t, c = _qwen3(extra={f"{p}.gate.e_score_correction_bias": torch.zeros(E), f"{p}.shared_experts.linear_gate.weight": g,
                         f"{p}.shared_experts.up_proj.weight": u, f"{p}.shared_experts.down_proj.weight": d},
                  model_type="hy_v4", n_routed_experts=E, swiglu_limit=0.5)  # fmt: skip
    src = _write(tmp_path / "src", t, c)
    moepack.convert(src, tmp_path / "dst")
    assert moepack.verify(tmp_path / "dst", source=src, tokens=2).ok
    m = json.loads((tmp_path / "dst" / "moepack.json").read_text())
    assert m["format_version"] == 7 and m["layers"][0]["silu_limit"] == 0.5 and m["layers"][0]["shared"]["silu_limit"] is None
    layer = moepack.open(tmp_path / "dst").layers[0]
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    want = (torch.nn.functional.silu(x @ g.float().T) * (x @ u.float().T)) @ d.float().T
    assert float((layer.shared_expert(x) - want).norm() / want.norm()) < 1e-5
    # without shared.silu_limit the layer's clamp applies to the shared expert too
    edited, as_v6 = _edited_copies(tmp_path / "dst", lambda m: m["layers"][0]["shared"].pop("silu_limit"))
    rep = moepack.verify(edited, source=src, tokens=2)
    assert any("layer 0 shared silu_limit: pack 0.5, source None" in line for line in rep.model), rep.model
    with pytest.raises(MoepackError, match=r"layers\[0\]\.shared\.silu_limit.*needs format_version 7"):
        moepack.open(as_v6)
