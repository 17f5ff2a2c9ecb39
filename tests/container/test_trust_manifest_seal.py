"""The manifest's seal (format version 6, issue 49): ``manifest_sha256`` covers every field of
moepack.json, so a field edited after convert to a value the schema accepts is refused by open
and verify, naming the seal, instead of read. The case the issue found: ``act_mode`` edited
together with ``act_mode_option`` (which had no checksum) turned verify's act-mode check into a
note. Older (version 1-5) manifests have no seal and still open; verify says so in a note.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import moepack
from moepack.errors import ConvertError, PackedDirError
from moepack.manifest import FORMAT_VERSION, MANIFEST, SEALED_FORMAT_VERSION, ManifestError, manifest_digest
from tests.container.test_packdir_errors import cli
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import convert_fixtures


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return convert_fixtures(tmp_path_factory.mktemp("seal"), ("qwen2_moe_w4a16", "gpt_oss"))


def _copy(packs, name: str, tmp_path: Path) -> Path:
    d = tmp_path / name
    shutil.copytree(packs[name], d)
    return d


def _edit(d: Path, fn, *, reseal: bool = False) -> dict:
    m = json.loads((d / MANIFEST).read_text())
    fn(m)
    if reseal:
        m["manifest_sha256"] = manifest_digest(m)
    (d / MANIFEST).write_text(json.dumps(m, indent=1))
    return m


def _act_mode_a8(m: dict) -> None:
    for e in m["layers"]:
        e["act_mode"] = "a8"
    m["act_mode_option"] = "a8"


def test_convert_writes_a_sealed_version_6_manifest(packs):
    for d in packs.values():
        m = json.loads((d / MANIFEST).read_text())
        assert m["format_version"] == FORMAT_VERSION == SEALED_FORMAT_VERSION == 6
        assert m["manifest_sha256"] == manifest_digest(m)


def test_act_mode_edited_with_its_option_is_refused_by_open_and_verify(packs, tmp_path):
    """The issue's case: an int4 (W4A16) pack's layers edited to a8 together with
    act_mode_option "a8". Before the seal, open ran it in a8 and verify --source passed it with a
    note (rc 0)."""
    d = _copy(packs, "qwen2_moe_w4a16", tmp_path)
    _edit(d, _act_mode_a8)
    with pytest.raises(ManifestError, match=r"moepack\.json: manifest_sha256='[0-9a-f]{8}.*': differs from the sha256 of the "
                                            r"manifest's other fields \([0-9a-f]{16}…\): a field was edited after convert"):  # fmt: skip
        moepack.open(d)
    for args in (("verify", d), ("verify", d, "--source", fixture_dir("qwen2_moe_w4a16"))):
        r = cli(*args)
        assert r.exit_code == 2, r.output
        assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "manifest_sha256=" in r.stderr and "edited after convert" in r.stderr, r.stderr


@pytest.mark.parametrize("what,fn", [
    ("activation", lambda m: m["layers"][0].update(activation="gelu")),
    ("interleaved", lambda m: m["layers"][0].update(interleaved=not m["layers"][0]["interleaved"])),
    ("alpha", lambda m: m["layers"][0].update(alpha=1.5)),
    ("routing.top_k", lambda m: m["routing"].update(top_k=1)),
    ("limit", lambda m: m["layers"][0].update(limit=5.0)),
    ("model.config", lambda m: m["model"]["config"].update(rms_norm_eps=0.5)),
    ("act_mode_option", lambda m: m.update(act_mode_option="a16")),
    ("carried_sha256", lambda m: m["carried_sha256"].update({"config.json": "0" * 64})),
])  # fmt: skip
def test_every_field_a_run_reads_is_sealed(packs, tmp_path, what, fn):
    """Each edit keeps the schema (it opens once resealed) and changes what a run reads or
    proves; unsealed, open refuses it."""
    d = _copy(packs, "gpt_oss", tmp_path)
    _edit(d, fn)
    with pytest.raises(ManifestError, match="manifest_sha256=.*edited after convert"):
        moepack.open(d)
    _edit(d, lambda m: None, reseal=True)  # the same manifest resealed: its rules alone decide, and it opens
    moepack.open(d)


def test_the_seal_does_not_depend_on_indentation_or_key_order(packs, tmp_path):
    d = _copy(packs, "gpt_oss", tmp_path)
    m = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).write_text(json.dumps(dict(reversed(list(m.items()))), separators=(",", ":")))
    moepack.open(d)
    assert moepack.verify(d).ok


def test_a_version_6_manifest_needs_its_seal_and_the_fields_convert_always_writes(packs, tmp_path):
    for key in ("manifest_sha256", "act_mode_option", "carried_sha256", "carried_files"):
        d = _copy(packs, "gpt_oss", tmp_path / key)
        _edit(d, lambda m: m.pop(key), reseal=key != "manifest_sha256")
        with pytest.raises(ManifestError, match=rf"moepack\.json: {key} is missing: must be "):
            moepack.open(d)


def test_an_older_unsealed_manifest_opens_and_verify_notes_it(packs, tmp_path):
    """A version-5 manifest (written before the seal) has none: it opens and verifies, and
    verify's notes say that an edit of its fields cannot be told; the act-mode edit is then
    reported as it was (no act_mode_option either: a note, not a pass in silence)."""
    d = _copy(packs, "qwen2_moe_w4a16", tmp_path)
    _edit(d, lambda m: [m.pop("manifest_sha256"), m.pop("act_mode_option"), m.update(format_version=5)])
    moepack.open(d)
    rep = moepack.verify(d)
    assert rep.ok and any("no manifest_sha256 (format_version 5" in n for n in rep.notes), rep.notes
    r = cli("verify", d)
    assert r.exit_code == 0 and "note: moepack.json has no manifest_sha256" in " ".join(r.output.split()), r.output


def test_a_wrong_seal_value_is_named(packs, tmp_path):
    d = _copy(packs, "gpt_oss", tmp_path)
    _edit(d, lambda m: m.update(manifest_sha256="ABC"))
    with pytest.raises(PackedDirError, match=r"manifest_sha256='ABC': must be 64 lowercase hex digits"):
        moepack.open(d)


def test_convert_checks_the_manifest_it_plans_before_writing_anything(tmp_path, monkeypatch):
    """convert runs open's schema on the manifest as planned before it writes a byte: a field
    that breaks a rule (here a layer entry made to name an activation the schema does not know)
    is refused in one line naming it, and nothing is left behind."""
    from moepack.convert import stages as convert_stages

    real = convert_stages.layer_entry
    monkeypatch.setattr(convert_stages, "layer_entry", lambda pl, s: {**real(pl, s), "activation": "relu9"})
    with pytest.raises(ConvertError) as ei:
        moepack.convert(fixture_dir("qwen3_moe"), tmp_path / "dst")
    msg = str(ei.value)
    assert "moepack.json: layers[0].activation='relu9' (layer 0): must be one of" in msg and len(msg.splitlines()) == 1
    assert "nothing was written" in msg
    assert [p.name for p in tmp_path.iterdir()] in ([], [".dst.lock"])
