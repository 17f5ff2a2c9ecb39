"""Families as convert reads them (issue 48): the misleading messages replaced by the true reason,
and transformers' encoded floats decoded.

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
from moepack.errors import SourceError
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


def test_dbrx_is_named_by_its_expert_names_not_a_missing_hidden_size(tmp_path):
    """DBRX states H as ``d_model`` and E as ``ffn_config.moe_num_experts``; its experts are
    ``ffn.experts.mlp.{w1,v1,w2}`` [E*I, H]: the reader says so (it used to say hidden_size=None)."""
    p = "transformer.blocks.0.ffn"
    t = {f"{p}.router.layer.weight": _t(E, H), f"{p}.experts.mlp.w1": _t(E * I, H), f"{p}.experts.mlp.v1": _t(E * I, H),
         f"{p}.experts.mlp.w2": _t(E * I, H)}  # fmt: skip
    cfg = {"model_type": "dbrx", "d_model": H, "n_layers": 1, "ffn_config": {"moe_num_experts": E, "moe_top_k": 2}}
    ckpt, reader = open_source(_write(tmp_path, t, cfg))
    with pytest.raises(SourceError) as ei:
        reader.layers(ckpt)
    msg = str(ei.value)
    assert "model_type='dbrx' is a MoE model" in msg and "'transformer.blocks.0.ffn.experts.mlp.v1'" in msg
    assert "names moepack does not read" in msg and "hidden_size" not in msg and "not a MoE checkpoint" not in msg


def test_ernie_counts_its_experts_from_moe_num_experts(tmp_path):
    """ernie4_5_moe (and aria) state E as ``moe_num_experts`` (it used to be "number of experts missing")."""
    t, cfg = _qwen3()
    del cfg["num_experts"]
    cfg.update(model_type="ernie4_5_moe", moe_num_experts=E)
    ckpt, reader = open_source(_write(tmp_path, t, cfg))
    assert [s.num_experts for s in reader.layers(ckpt)] == [E]


def test_a_moe_checkpoint_with_unread_expert_names_is_not_called_dense(tmp_path):
    """aria stores ``experts.fc1.weight`` / ``fc2.weight``, inkling2 ``experts.w13_weight``: MoE
    checkpoints whose names no reader knows, said as such (it used to be "not a MoE checkpoint")."""
    p = "model.layers.0.mlp"
    t = {f"{p}.router.weight": _t(E, H), f"{p}.experts.fc1.weight": _t(E, H, 2 * I), f"{p}.experts.fc2.weight": _t(E, I, H)}
    ckpt, reader = open_source(_write(tmp_path, t, {"model_type": "aria_text", "hidden_size": H, "moe_num_experts": E}))
    with pytest.raises(SourceError, match=r"model_type='aria_text' is a MoE model, but its expert tensors "
                                          r"\('model.layers.0.mlp.experts.fc1.weight'"):  # fmt: skip
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
