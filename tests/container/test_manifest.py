"""The manifest's schema (moepack/manifest.py, docs/PACKED_FORMAT.md §4): a moepack.json with a
field missing, of the wrong type or out of range is refused by ``moepack.open`` and by ``inspect``,
``run`` and ``verify`` with ONE line naming the file, the field, the value and the rule (exit 2),
never a traceback and never a silently different model. Each case below is one that the issue-12
probe found accepted or crashing before the schema existed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import moepack
from moepack.convert.run import MANIFEST
from moepack.errors import PackedDirError
from moepack.manifest import ManifestError, check_manifest
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import convert_fixtures, edited
from tests.container.test_packdir_errors import assert_one_error_line, cli


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    """qwen3_moe (two layers, 8 experts, top-2) and deepseek_v3 (shared expert, correction
    bias, grouped routing), converted once; tests edit copies."""
    return convert_fixtures(tmp_path_factory.mktemp("manifest"), ("qwen3_moe", "deepseek_v3"))


def assert_refused_everywhere(d: Path, *needles: str) -> str:
    """open raises a ManifestError (a PackedDirError) naming ``needles``; inspect, run and verify
    (with and without the source) say the same in one line, exit status 2."""
    with pytest.raises(ManifestError) as ei:
        moepack.open(d)
    msg = str(ei.value)
    assert isinstance(ei.value, PackedDirError) and "\n" not in msg
    assert f"{d}: {MANIFEST}: " in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    for args in (("inspect", d), ("run", d), ("verify", d)):
        assert_one_error_line(cli(*args), *needles)
    return msg


def _del(path: list):
    def fn(m):
        obj = m
        for k in path[:-1]:
            obj = obj[k]
        del obj[path[-1]]

    return fn


def _set(path: list, value):
    def fn(m):
        obj = m
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value

    return fn


W13 = "moepack.layers.1.w13"
# fmt: off
CASES = {
    # defect 2 of the issue: well-formed JSON, missing or mistyped field -> was a traceback or accepted
    "del tensors[w13].shape": ("qwen3_moe", _del(["tensors", W13, "shape"]), [f"tensors['{W13}'].shape is missing", "array of integers"]),
    "missing routing.method": ("qwen3_moe", _del(["routing", "method"]), ["routing.method is missing", "must be a string"]),
    "missing layers[0].prefix": ("qwen3_moe", _del(["layers", 0, "prefix"]), ["layers[0].prefix is missing (layer 0)", "must be a string"]),
    "activation true": ("qwen3_moe", _set(["layers", 1, "activation"], True), ["layers[1].activation=True (layer 1)", "must be a string"]),
    "activation relu9": ("qwen3_moe", _set(["layers", 1, "activation"], "relu9"),
                         ["layers[1].activation='relu9' (layer 1)", "must be one of 'silu', 'gelu', 'gelu_tanh', 'swigluoai'"]),
    "renormalize deleted": ("qwen3_moe", _del(["routing", "renormalize"]), ["routing.renormalize is missing", "must be a boolean"]),
    "renormalize []": ("qwen3_moe", _set(["routing", "renormalize"], []), ["routing.renormalize=[]", "must be a boolean"]),
    "format_version '2'": ("qwen3_moe", _set(["format_version"], "2"), ["format_version='2' (a string: the version is a JSON integer)"]),
    "format_version true": ("qwen3_moe", _set(["format_version"], True), ["format_version=True (a boolean"]),
    "format_version 2.0": ("qwen3_moe", _set(["format_version"], 2.0), ["format_version=2.0 (a number"]),
    "top_k a string": ("qwen3_moe", _set(["routing", "top_k"], "2"), ["routing.top_k='2'", "must be an integer"]),
    "unknown routing key": ("qwen3_moe", _set(["routing", "top_p"], 0.9), ["routing.top_p=0.9", "is not a routing field"]),
    "interleaved 0": ("qwen3_moe", _set(["layers", 0, "interleaved"], 0), ["layers[0].interleaved=0 (layer 0)", "must be a boolean"]),
    "num_experts a string": ("qwen3_moe", _set(["layers", 0, "num_experts"], "8"), ["layers[0].num_experts='8' (layer 0)", "must be an integer"]),
    "hidden 0": ("qwen3_moe", _set(["layers", 0, "hidden"], 0), ["layers[0].hidden=0 (layer 0)", "must be >= 1"]),
    "layers an object": ("qwen3_moe", _set(["layers"], {}), ["layers={}", "must be an array"]),
    "sha256 not hex": ("qwen3_moe", _set(["tensors", W13, "sha256"], "xyz"), [f"tensors['{W13}'].sha256='xyz'", "64 lowercase hex"]),
    "dtype unknown": ("qwen3_moe", _set(["tensors", W13, "dtype"], "bfloat17"), [f"tensors['{W13}'].dtype='bfloat17'", "must be one of"]),
    "file size negative": ("qwen3_moe", _set(["files", "model-00001-of-00001.safetensors", "size"], -1), ["size=-1", "must be >= 0"]),
    "limit 0 (fuzz)": ("qwen3_moe", _set(["layers", 0, "limit"], 0), ["layers[0].limit=0 (layer 0)", "must be > 0"]),
    "limit -0.0 (fuzz)": ("qwen3_moe", _set(["layers", 0, "limit"], -0.0), ["layers[0].limit=-0.0 (layer 0)", "must be > 0"]),
    "alpha NaN-like string": ("qwen3_moe", _set(["layers", 0, "alpha"], "1.7"), ["layers[0].alpha='1.7' (layer 0)", "finite number"]),
    "model missing": ("qwen3_moe", _del(["model"]), ["model is missing", "must be an object"]),
    # defect 1: a duplicated layer index was caught by verify but opened as one layer by open/inspect/run
    "duplicate layer index": ("qwen3_moe", lambda m: m["layers"][1].update(index=0),
                              ["layers[1].index=0", "duplicates layer 0", "must be unique and ascending"]),
    "layers out of order": ("qwen3_moe", lambda m: m["layers"].reverse(), ["layers[1].index=0", "comes after layer 1"]),
    "layer beyond the model": ("qwen3_moe", _set(["layers", 1, "index"], 7), ["layers[1].index=7", "must be < 2, the model's num_hidden_layers"]),
    "duplicate prefix": ("qwen3_moe", lambda m: m["layers"][1].update(prefix=m["layers"][0]["prefix"]),
                         ["layers[1].prefix='model.layers.0.mlp' (layer 1)", "is also layer 0's"]),
    # defect 4: top_k 99 with 8 experts was refused only by run
    "top_k 99": ("qwen3_moe", _set(["routing", "top_k"], 99), ["routing.top_k=99 with num_experts=8", "must be in [1, num_experts]"]),
    "top_k 99 without routing.num_experts": ("qwen3_moe", lambda m: m["routing"].update(top_k=99, num_experts=None),
                                            ["routing.top_k=99 (layer 0)", "must be in 1..8 (layer 0 has num_experts=8)"]),
    "routing.num_experts differs": ("qwen3_moe", _set(["routing", "num_experts"], 16), ["layers[0].num_experts=8 (layer 0)", "routing.num_experts=16"]),
    # defect 5: layout_id / intermediate errors name the file and the layer
    "layout_id a string": ("qwen3_moe", _set(["layers", 1, "layout_id"], "1"), ["layers[1].layout_id='1' (layer 1)", "must be an integer"]),
    "layout_id not described": ("qwen3_moe", _set(["layers", 1, "layout_id"], 2), ["layers[1].layout_id=2", "is not described in the manifest's 'layouts'"]),
    "intermediate": ("qwen3_moe", _set(["layers", 1, "intermediate"], 100),
                     [f"layers[1].tensors.w13: layer 1: tensor '{W13}' is bfloat16 [8, 128, 72], layout math says bfloat16 [8, 256, 72]"]),
    # cross-field rules of the layer's companions
    "router weight of another shape": ("deepseek_v3", lambda m: m["layers"][0]["router"].update(weight="model.embed_tokens.weight"),
                                       ["layers[0].router.weight='model.embed_tokens.weight' (layer 1)", "must be a float tensor of shape [8, 72]"]),
    "correction bias dropped": ("deepseek_v3", lambda m: m["layers"][0]["router"].pop("correction_bias"),
                                ["layers[0].router.correction_bias=None (layer 1)", "routing.has_correction_bias=True"]),
    "router names an unlisted tensor": ("qwen3_moe", _set(["layers", 0, "router", "weight"], "nope"),
                                        ["layers[0].router.weight='nope' (layer 0)", "names a tensor that 'tensors' does not list"]),
    "shared intermediate a float": ("deepseek_v3", _set(["layers", 0, "shared", "intermediate"], 40.0),
                                    ["layers[0].shared.intermediate=40.0 (layer 1)", "must be an integer"]),
    "w13_perm in a dense layer": ("qwen3_moe", _set(["layers", 0, "tensors", "w13_perm"], "moepack.layers.0.w13"),
                                  ["layers[0].w13_perm='moepack.layers.0.w13' (layer 0)", "carries no act-order permutation"]),
    # files: never a path out of the directory
    "file outside the directory": ("qwen3_moe", lambda m: m["files"].update({"../x.safetensors": {"size": 0}}),
                                   ["files='../x.safetensors'", "plain file name"]),
}
# fmt: on


@pytest.mark.parametrize("case", list(CASES))
def test_a_bent_manifest_is_refused_by_open_inspect_run_and_verify(packs, tmp_path, case):
    fixture, edit, needles = CASES[case]
    d = edited(packs, tmp_path, fixture, edit)
    assert_refused_everywhere(d, *needles)


def test_verify_with_the_source_goes_through_the_schema_too(packs, tmp_path):
    d = edited(packs, tmp_path, "qwen3_moe", lambda m: m["layers"][1].update(index=0))
    assert_one_error_line(cli("verify", d, "--source", fixture_dir("qwen3_moe")), "duplicates layer 0")


def test_json_that_is_not_plain_json_is_refused(packs, tmp_path):
    d = tmp_path / "p"
    shutil.copytree(packs["qwen3_moe"], d)
    text = (d / MANIFEST).read_text()
    (d / MANIFEST).write_text(text.replace('"limit": 7.0', '"limit": NaN', 1))
    assert_one_error_line(cli("inspect", d), "moepack.json is not valid JSON", "NaN")
    (d / MANIFEST).write_text(text.replace('"format": "moepack",', '"format": "moepack", "format": "gguf",', 1))
    assert_one_error_line(cli("inspect", d), "moepack.json is not valid JSON", "key 'format' appears twice")


def test_the_unedited_manifests_pass_and_unknown_keys_are_ignored(packs, tmp_path):
    for d in packs.values():
        check_manifest(d, json.loads((d / MANIFEST).read_text()))
    d = edited(packs, tmp_path, "deepseek_v3", lambda m: (m.update(future_key=[1]), m["layers"][0].update(note={"x": 1})))
    assert sorted(moepack.open(d).layers) == [1]


def test_a_shard_that_is_a_folder_is_called_one(packs, tmp_path):
    d = tmp_path / "p"
    shutil.copytree(packs["qwen3_moe"], d)
    f = d / "model-00001-of-00001.safetensors"
    f.unlink()
    f.mkdir()
    with pytest.raises(PackedDirError, match=r"shard model-00001-of-00001.safetensors listed in moepack.json is not a regular "
                                             r"file \(a folder\)"):  # fmt: skip
        moepack.open(d)


@pytest.mark.parametrize("fixture", ["qwen3_moe", "deepseek_v3"])
def test_a_layer_traces_on_the_meta_device(packs, fixture):
    """Shape tracing (meta hidden states, as torch.compile / FakeTensor do) runs the whole block,
    router and shared expert included, instead of failing on a CPU weight times a meta input."""
    model = moepack.open(packs[fixture])
    for layer in model.layers.values():
        x = torch.empty(5, layer.hidden_size, device="meta", dtype=torch.bfloat16)
        out = layer(x)
        assert out.device.type == "meta" and out.shape == (5, layer.hidden_size) and out.dtype == torch.bfloat16
        w = torch.empty(5, 2, device="meta")
        ids = torch.empty(5, 2, device="meta", dtype=torch.int32)
        assert layer.experts(x, w, ids).shape == (5, layer.hidden_size)
