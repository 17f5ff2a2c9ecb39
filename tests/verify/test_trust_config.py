"""Issue 29: convert cross-checks config.json against the tensors before writing anything. A
config whose moe_intermediate_size, num_hidden_layers, vocab_size or model_type disagrees with
the tensors, or a shard index that drops a layer's shard, converted and verified; only
``generate`` refused it. Each is now refused by convert in one line naming the key, its value
and the rule, and DST is never created."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import moepack
from moepack.errors import ConvertError
from tests.support.fixtures_util import fixture_dir
from tests.container.test_packdir_errors import cli


def _lying(tmp_path: Path, fixture: str, **changes) -> Path:
    src = tmp_path / "src"
    shutil.copytree(fixture_dir(fixture), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


# fixture, config changes, the words of the refusal
LIES = {
    "moe_intermediate_size": ("qwen3_moe", {"moe_intermediate_size": 48},
                              "config.json: moe_intermediate_size=48: layer 0's experts (model.layers.0.mlp) have "
                              "intermediate size 40"),
    "num_hidden_layers more": ("qwen3_moe", {"num_hidden_layers": 3},
                               "config.json: num_hidden_layers=3: no tensor of decoder layer 2 is in the checkpoint's files"),
    "num_hidden_layers fewer": ("qwen3_moe", {"num_hidden_layers": 1},
                                "config.json: num_hidden_layers=1: the checkpoint has MoE layer 1 (model.layers.1.mlp)"),
    "vocab_size": ("qwen3_moe", {"vocab_size": 100}, "config.json: vocab_size=100: tensor 'model.embed_tokens.weight' has 128 rows"),
    "model_type qwen2_moe": ("qwen3_moe", {"model_type": "qwen2_moe"}, "config.json: model_type='qwen2_moe': a qwen2_moe model "
                                                                      "with this config"),
    "model_type olmoe": ("qwen3_moe", {"model_type": "olmoe"}, "config.json: model_type='olmoe': a olmoe model with this config"),
}


@pytest.mark.parametrize("case", list(LIES))
def test_a_config_that_lies_about_the_tensors_is_refused_at_convert(tmp_path, case):
    fixture, changes, words = LIES[case]
    src = _lying(tmp_path, fixture, **changes)
    dst = tmp_path / "dst"
    with pytest.raises(ConvertError) as ei:
        moepack.convert(src, dst)
    msg = str(ei.value)
    assert len(msg.splitlines()) == 1 and msg.startswith(words), msg
    assert msg.endswith("the config must describe the checkpoint's tensors"), msg
    assert not dst.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".dst")] in ([], [".dst.lock"])
    r = cli("convert", src, dst)
    assert r.exit_code == 2 and words in " ".join(r.stderr.split())


def test_a_shard_index_that_drops_a_layers_shard_is_refused(tmp_path):
    """A two-shard checkpoint whose second shard holds decoder layer 1 whole, and an index that
    does not list it: the reader never sees layer 1 (before: a one-layer pack, verified)."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(fixture_dir("qwen3_moe"), src)
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    one = {k: v for k, v in tensors.items() if k.startswith("model.layers.1.")}
    rest = {k: v for k, v in tensors.items() if k not in one}
    save_file(rest, src / "model-00001-of-00002.safetensors")
    save_file(one, src / "model-00002-of-00002.safetensors")
    idx = {"metadata": {}, "weight_map": dict.fromkeys(rest, "model-00001-of-00002.safetensors")}
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ConvertError, match=r"num_hidden_layers=2: no tensor of decoder layer 1 is in the checkpoint's files "
                                           r"\(model-00001-of-00002.safetensors\)"):  # fmt: skip
        moepack.convert(src, tmp_path / "dst")


def test_true_configs_still_convert(tmp_path):
    for fixture in ("qwen3_moe", "mixtral_sharded", "deepseek_v3"):
        moepack.convert(fixture_dir(fixture), tmp_path / fixture)
        assert moepack.verify(tmp_path / fixture, source=fixture_dir(fixture)).ok
