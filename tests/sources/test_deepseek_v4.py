"""DeepSeek-V4 end to end on a tiny seeded model of transformers' own class (the sweep's recipe,
tests/integrations/test_family_sweep.py): what convert records (sqrt-softplus routing, the hash
layers' token-id table, ``gate.bias`` as a correction bias, the ``shared_experts.w1/w2/w3`` shared
expert, the clamped SwiGLU as ``silu_limit``, format version 6), what open and verify --source
refuse when a part is missing, and the token-id API of a hash layer."""

from __future__ import annotations

import json

import pytest
import torch

import moepack
import moepack.hf as hf
from moepack.errors import PackedDirError, UnsupportedError
from moepack.manifest import MANIFEST, SILU_LIMIT_FORMAT_VERSION
from tests.integrations.test_family_sweep import _spread, tiny_config
from tests.support.packdir_edit import edited_copy


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("v4")
    torch.manual_seed(0)
    with hf.quiet_transformers():
        model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v4"), dtype=torch.bfloat16).eval()
        _spread(model)
        model.save_pretrained(tmp / "src")
    moepack.convert(tmp / "src", tmp / "dst")
    return tmp, model


def _manifest(d):
    return json.loads((d / MANIFEST).read_text())


def test_what_convert_records(v4):
    tmp, _ = v4
    m = _manifest(tmp / "dst")
    assert m["format_version"] == SILU_LIMIT_FORMAT_VERSION
    r = m["routing"]
    assert (r["method"], r["renormalize"], r["has_correction_bias"], r["routed_scaling_factor"]) == ("sqrtsoftplus", True, True, 1.5)
    layers = {e["index"]: e for e in m["layers"]}
    assert sorted(layers) == [0, 1, 2]
    # layer 0 is a hash layer: its table, as stored (int64), and no correction bias
    assert layers[0]["router"] == {"weight": "model.layers.0.ffn.gate.weight", "hash": "model.layers.0.ffn.gate.tid2eid"}
    assert m["tensors"]["model.layers.0.ffn.gate.tid2eid"]["dtype"] == "int64"
    # gate.bias is the correction bias (transformers loads it as e_score_correction_bias), never a logit bias
    assert layers[1]["router"] == {"weight": "model.layers.1.ffn.gate.weight", "correction_bias": "model.layers.1.ffn.gate.bias"}
    for e in layers.values():
        assert e["activation"] == "silu" and e["silu_limit"] == 0.5
        assert e["shared"]["source_tensors"] == [f"model.layers.{e['index']}.ffn.shared_experts.{w}.weight" for w in ("w1", "w3", "w2")]


def test_verify_passes_and_fails_a_pack_without_the_clamp(v4, tmp_path):
    tmp, _ = v4
    assert moepack.verify(tmp / "dst", source=tmp / "src").ok
    d = edited_copy(tmp / "dst", tmp_path / "noclamp", lambda m: [e.pop("silu_limit") for e in m["layers"]])
    rep = moepack.verify(d, source=tmp / "src")
    assert not rep.ok
    assert any("silu_limit (clamped SwiGLU): pack None, source 0.5" in p for p in rep.model), rep.model


def test_verify_fails_a_pack_that_routes_a_hash_layer_by_its_logits(v4, tmp_path):
    tmp, _ = v4
    d = edited_copy(tmp / "dst", tmp_path / "nohash", lambda m: m["layers"][0]["router"].pop("hash"))
    with pytest.raises(PackedDirError, match=r"layers\[0\].router.correction_bias=None .*routing.has_correction_bias=True"):
        moepack.open(d)


@pytest.mark.parametrize("what", ["silu_limit", "router.hash"])
def test_version_5_with_a_version_6_feature_is_refused(v4, tmp_path, what):
    tmp, _ = v4

    def edit(m):
        m["format_version"] = 5
        if what == "router.hash":
            for e in m["layers"]:
                e.pop("silu_limit")

    d = edited_copy(tmp / "dst", tmp_path / "v5", edit)
    with pytest.raises(PackedDirError, match=rf"layers\[0\].{what.replace('.', '[.]')}=.*needs format_version 6 \(the file says 5\)"):
        moepack.open(d)


def test_silu_limit_on_a_gelu_layer_is_refused(v4, tmp_path):
    tmp, _ = v4
    d = edited_copy(tmp / "dst", tmp_path / "gelu", lambda m: m["layers"][1].update(activation="gelu"))
    with pytest.raises(PackedDirError, match=r"layers\[1\].silu_limit=0.5 \(layer 1\): is an option of silu experts only"):
        moepack.open(d)


@torch.no_grad()
def test_hash_layer_needs_token_ids_and_matches_transformers(v4):
    tmp, model = v4
    layer = moepack.open(tmp / "dst").layers[0]
    assert layer.hash_table is not None and "hash routing" in repr(layer)
    x = torch.randn(5, layer.hidden_size, generator=torch.Generator().manual_seed(3))
    with pytest.raises(UnsupportedError, match="layer 0 routes by token id .*pass token_ids="):
        layer(x)
    tok = torch.tensor([3, 9, 3, 100, 0])
    want = model.float().model.layers[0].mlp(x[None], input_ids=tok[None])[0]
    got = layer(x, token_ids=tok)
    assert float((got - want).norm() / want.norm()) <= 1e-4
    # the other layers ignore token ids
    l1 = moepack.open(tmp / "dst").layers[1]
    assert torch.equal(l1(x), l1(x, token_ids=tok))
