"""Packed directories written by the previous release (manifest format_version 1, whose layouts
did not yet declare their tensors) still open and verify; an unknown version is refused with
what to do; a version-2 layout descriptor that disagrees with this build's (its tensor
declaration included) is refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch

import moepack
from moepack.errors import PackedDirError
from moepack.layout import V1_FIELDS
from moepack.runtime.model import FORMAT_VERSION, MANIFEST
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import reseal


def _as_v1(d) -> None:
    """What release 1 wrote: format_version 1 and the eleven-field layout descriptor."""
    m = json.loads((d / MANIFEST).read_text())
    m["format_version"] = 1
    m["layouts"] = {lid: {k: desc[k] for k in V1_FIELDS} for lid, desc in m["layouts"].items()}
    del m["manifest_sha256"]  # the seal came with version 6
    (d / MANIFEST).write_text(json.dumps(m, indent=1))


@pytest.mark.parametrize("fixture,quantize", [("deepseek_v3", None), ("gpt_oss", None), ("qwen3_moe", "int8"),
                                              ("qwen3_moe_w8a8", None)])  # fmt: skip
def test_a_version_1_directory_opens_and_verifies(tmp_path, fixture, quantize):
    d = tmp_path / "packed"
    moepack.convert(fixture_dir(fixture), d, quantize=quantize)
    assert json.loads((d / MANIFEST).read_text())["format_version"] == FORMAT_VERSION == 6
    x = torch.randn(3, moepack.open(d).layers[min(moepack.open(d).layers)].hidden_size)
    new = {i: layer(x) for i, layer in moepack.open(d).layers.items()}
    _as_v1(d)
    model = moepack.open(d)
    for i, layer in model.layers.items():
        assert torch.equal(layer(x), new[i]), f"layer {i}: a v1 manifest runs differently"
    report = moepack.verify(d, source=fixture_dir(fixture))
    assert report.ok, report


def test_an_unknown_version_is_refused_with_what_to_do(tmp_path):
    d = tmp_path / "packed"
    moepack.convert(fixture_dir("olmoe"), d)
    m = json.loads((d / MANIFEST).read_text())
    m["format_version"] = 8
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    with pytest.raises(PackedDirError, match=r"format_version=8; this moepack reads versions 1, 2, 3, 4, 5, 6, 7: convert the checkpoint "
                                             r"again with this moepack \(`moepack convert SRC DST --overwrite`\)"):  # fmt: skip
        moepack.open(d)


@pytest.mark.parametrize("field", ["tensors", "scheme", "act_modes"])
def test_a_version_2_layout_must_match_this_build_in_every_field(tmp_path, field):
    d = tmp_path / "packed"
    moepack.convert(fixture_dir("olmoe"), d)
    m = json.loads((d / MANIFEST).read_text())
    desc = next(iter(m["layouts"].values()))
    desc[field] = {"tensors": [], "scheme": "int8_channel", "act_modes": ["a8"]}[field]
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    with pytest.raises(PackedDirError, match=rf"layout bf16_n32k2_x86 \(id 1\) in the file has {field}="):
        moepack.open(d)


def test_every_layer_layout_must_be_described(tmp_path):
    d = tmp_path / "packed"
    moepack.convert(fixture_dir("olmoe"), d)
    m = json.loads((d / MANIFEST).read_text())
    m["layouts"] = {}
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    with pytest.raises(PackedDirError, match=r"layout_id=1 is not described in the manifest's 'layouts' \(\[\]\)"):
        moepack.open(d)


def test_a_tensor_note_is_words_not_format(tmp_path):
    """The tensors' ``note`` strings document; a directory written before a note was reworded
    still opens."""
    d = tmp_path / "packed"
    moepack.convert(fixture_dir("qwen3_moe_w8a8"), d)
    m = json.loads((d / MANIFEST).read_text())
    for desc in m["layouts"].values():
        for t in desc["tensors"]:
            t["note"] = "worded differently by an older release"
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    assert moepack.open(d).layers


def test_verify_fails_when_the_source_has_a_bias_the_packed_layer_lacks(tmp_path):
    d = tmp_path / "packed"
    moepack.convert(fixture_dir("gpt_oss"), d)
    m = json.loads((d / MANIFEST).read_text())
    layer = m["layers"][0]
    del layer["tensors"]["w13_bias"]  # the tensor stays in its shard, the layer no longer names it
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    report = moepack.verify(d, source=fixture_dir("gpt_oss"))
    assert not report.ok
    check = next(c for c in report.layers if c.index == layer["index"])
    assert not check.weights_exact and "w13_bias (missing from the packed experts)" in check.tensors
    assert "w13_bias: the source has one and the packed experts does not" in check.detail
