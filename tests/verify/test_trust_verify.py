"""Issue 29, "trust the whole directory": verify proves every manifest field that changes what
is computed (act mode, the stored model config), every carried file's bytes, and, without the
source, every packed value's rule; ``moepack.open`` refuses a hostile value in the small
per-group tensors (scales, zero points, permutations) so no byte pattern makes a result depend
on the ISA level. Each test failed before the fix (verify passed, open ran)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import moepack
from moepack.convert.run import MANIFEST
from moepack.errors import PackedDirError
from moepack.manifest import ManifestError
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import edited, rewrite_tensor, set_element, set_unpacked, reseal
from tests.container.test_packdir_errors import cli

W4A16 = "qwen2_moe_w4a16"


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trust")
    out = {}
    for key, fixture, kw in (("w4a16", W4A16, {}), ("w4a16_a8", W4A16, {"act_mode": "a8"}), ("bf16", "qwen3_moe", {}),
                             ("int8", "qwen3_moe", {"quantize": "int8"})):  # fmt: skip
        moepack.convert(fixture_dir(fixture), root / key, **kw)
        out[key] = root / key
    return out


def _flat(s: str) -> str:
    return " ".join(s.split())


def _fails_with_source(d: Path, fixture: str, line: str) -> None:
    """verify DST passes (the manifest is well formed, the checksums agree), verify --source
    fails naming ``line`` among the model differences, and the CLI exits 1 printing it."""
    assert moepack.verify(d).ok, moepack.verify(d).failures()
    report = moepack.verify(d, source=fixture_dir(fixture))
    assert not report.ok and line in report.model, report.model
    r = cli("verify", d, "--source", fixture_dir(fixture))
    assert r.exit_code == 1 and line in _flat(r.stdout), r.stdout


# ---------------------------------------------------------------- act mode


def test_act_mode_switched_a16_to_a8_fails_verify(packs, tmp_path):
    def switch(m):
        for e in m["layers"]:
            e["act_mode"] = "a8"

    d = edited(packs, tmp_path, "w4a16", switch)
    idx = json.loads((d / MANIFEST).read_text())["layers"][0]["index"]
    _fails_with_source(d, W4A16, f"layer {idx} act_mode: pack 'a8', source 'a16' (the source's meaning; another mode is "
                                 "recorded only by convert --act-mode)")  # fmt: skip


def test_act_mode_switched_a8_to_a16_fails_verify(packs, tmp_path):
    """A pack converted with --act-mode a8 whose layer is switched back to a16: the pack's
    recorded option no longer matches the layer."""

    def switch(m):
        m["layers"][0]["act_mode"] = "a16"

    d = edited(packs, tmp_path, "w4a16_a8", switch)
    idx = json.loads((d / MANIFEST).read_text())["layers"][0]["index"]
    _fails_with_source(d, W4A16, f"layer {idx} act_mode: pack 'a16', but the pack records convert --act-mode 'a8'")


def test_a_deliberate_act_mode_passes_and_is_reported(packs):
    report = moepack.verify(packs["w4a16_a8"], source=fixture_dir(W4A16))
    assert report.ok, report.failures()
    assert {c.act_mode for c in report.layers} == {"a8"}
    assert len(report.notes) == len(report.layers) and all("convert --act-mode a8" in n and "the source means a16" in n
                                                            for n in report.notes)  # fmt: skip
    r = cli("verify", packs["w4a16_a8"], "--source", fixture_dir(W4A16))
    assert r.exit_code == 0 and "convert --act-mode a8" in _flat(r.stdout) and "act mode" in r.stdout


def test_deliberate_act_mode_erased_fails_verify(packs, tmp_path):
    d = edited(packs, tmp_path, "w4a16_a8", lambda m: m.update(act_mode_option=None))
    idx = json.loads((d / MANIFEST).read_text())["layers"][0]["index"]
    _fails_with_source(d, W4A16, f"layer {idx} act_mode: pack 'a8', source 'a16' (the source's meaning; another mode is "
                                 "recorded only by convert --act-mode)")  # fmt: skip


def test_an_older_manifest_without_act_mode_option_is_reported_not_failed(packs, tmp_path):
    """A pack written before convert recorded act_mode_option (no key at all) cannot tell a
    deliberate --act-mode from an edit: verify reports the other mode instead of failing it.
    Such a manifest is older than version 6, which requires the key (and seals it)."""
    d = edited(packs, tmp_path, "w4a16_a8", lambda m: [m.pop("act_mode_option"), m.pop("manifest_sha256"), m.update(format_version=5)])
    report = moepack.verify(d, source=fixture_dir(W4A16))
    assert report.ok, report.failures()
    assert {c.act_mode for c in report.layers} == {"a8"}
    modes = [n for n in report.notes if "no manifest_sha256" not in n]
    assert len(modes) == len(report.layers) and all("predates act_mode_option" in n for n in modes), report.notes
    with pytest.raises(ManifestError, match="act_mode_option is missing"):  # version 6 requires it
        moepack.open(edited(packs, tmp_path / "v6", "w4a16_a8", lambda m: m.pop("act_mode_option")))


def test_verify_runs_the_manifests_mode_not_the_environments(packs, monkeypatch):
    monkeypatch.setenv("MOEPACK_ACT_MODE", "a8")
    report = moepack.verify(packs["w4a16"], source=fixture_dir(W4A16))
    assert report.ok and {c.act_mode for c in report.layers} == {"a16"}


# ---------------------------------------------------------------- the stored model config


@pytest.mark.parametrize("key,value", [("rms_norm_eps", 1e-3), ("vocab_size", 77), ("num_attention_heads", 3)])
def test_model_config_edit_fails_verify(packs, tmp_path, key, value):
    d = edited(packs, tmp_path, "bf16", lambda m: m["model"]["config"].update({key: value}))
    src = json.loads((fixture_dir("qwen3_moe") / "config.json").read_text())
    _fails_with_source(d, "qwen3_moe", f"model.config.{key}: pack {value!r}, source config.json {src.get(key, '(absent)')!r}")


def test_model_config_key_removed_fails_verify(packs, tmp_path):
    d = edited(packs, tmp_path, "bf16", lambda m: m["model"]["config"].pop("rms_norm_eps"))
    src = json.loads((fixture_dir("qwen3_moe") / "config.json").read_text())
    _fails_with_source(d, "qwen3_moe", f"model.config.rms_norm_eps: pack '(absent)', source config.json {src['rms_norm_eps']!r}")


# ---------------------------------------------------------------- carried files


def test_convert_records_every_carried_files_sha256(packs):
    import hashlib

    m = json.loads((packs["bf16"] / MANIFEST).read_text())
    assert m["carried_files"] and sorted(m["carried_sha256"]) == sorted(m["carried_files"])
    for name, sha in m["carried_sha256"].items():
        assert hashlib.sha256((fixture_dir("qwen3_moe") / name).read_bytes()).hexdigest() == sha


def test_an_edited_carried_file_fails_verify_without_the_source(packs, tmp_path):
    d = tmp_path / "p"
    shutil.copytree(packs["bf16"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 0.5
    (d / "config.json").write_text(json.dumps(cfg))
    report = moepack.verify(d)
    assert not report.ok
    (bad,) = report.failures()
    assert bad.startswith("carried file 'config.json': sha256 ") and "differs from the manifest's" in bad
    r = cli("verify", d)
    assert r.exit_code == 1 and "config.json" in r.stdout and "MISMATCH" in r.stdout


def test_a_missing_carried_file_fails_verify(packs, tmp_path):
    d = tmp_path / "p"
    shutil.copytree(packs["bf16"], d)
    (d / "generation_config.json").unlink()
    assert moepack.verify(d).failures() == ["carried file 'generation_config.json': is missing (listed in carried_files; it "
                                            "must be a regular file of the directory)"]  # fmt: skip


def test_a_carried_file_and_its_checksum_edited_together_fail_against_the_source(packs, tmp_path):
    import hashlib

    d = tmp_path / "p"
    shutil.copytree(packs["bf16"], d)
    (d / "generation_config.json").write_text("{}\n")
    m = json.loads((d / MANIFEST).read_text())
    m["carried_sha256"]["generation_config.json"] = hashlib.sha256(b"{}\n").hexdigest()
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    _fails_with_source(d, "qwen3_moe", "carried file 'generation_config.json': its sha256 in the manifest differs from the "
                                       "source file's")  # fmt: skip


@pytest.mark.parametrize("name", ["../config.json", "sub/x.json", ".hidden", "moepack.json"])
def test_carried_file_names_must_be_plain(packs, tmp_path, name):
    def edit(m):
        m["carried_files"].append(name)
        m["carried_sha256"][name] = "0" * 64

    d = edited(packs, tmp_path, "bf16", edit)
    with pytest.raises(ManifestError, match=r"carried_files=.*every entry must be the plain name of a file"):
        moepack.open(d)


def test_carried_checksums_must_match_the_list(packs, tmp_path):
    d = edited(packs, tmp_path, "bf16", lambda m: m["carried_sha256"].pop("config.json"))
    with pytest.raises(ManifestError, match=r"carried_sha256='config.json': must hold one sha256 for each name"):
        moepack.open(d)


# ---------------------------------------------------------------- value rules (hostile packs)


def _copy(packs, key, tmp_path) -> Path:
    d = tmp_path / key
    shutil.copytree(packs[key], d)
    return d


def _layer0(d: Path) -> dict:
    return json.loads((d / MANIFEST).read_text())["layers"][0]


@pytest.mark.parametrize("role,value,rule", [
    ("w13_zero", 16, "zero points must be in 0..15"),
    ("w2_zero", 255, "zero points must be in 0..15"),
    ("w13_scale", float("nan"), "scales must be finite and >= 0"),
    ("w2_scale", float("inf"), "scales must be finite and >= 0"),
    ("w13_scale", -1.0, "scales must be finite and >= 0"),
])  # fmt: skip
def test_a_hostile_int4_value_is_refused_by_open_and_verify(packs, tmp_path, role, value, rule):
    d = _copy(packs, "w4a16", tmp_path)
    name = _layer0(d)["tensors"][role]
    rewrite_tensor(d, name, set_element((1, 0, 3), value))  # sha256 kept consistent: only the value rule tells
    with pytest.raises(PackedDirError, match=rf"tensor '{name}' \[1, 0, 3\] = .*: {rule}") as ei:
        moepack.open(d)
    assert len(str(ei.value).splitlines()) == 1
    report = moepack.verify(d)
    (bad,) = report.failures()
    assert bad.startswith(f"tensor {name!r} in ") and rule in bad
    r = cli("run", d, "--tokens", "2")
    assert r.exit_code != 0 and rule in _flat(r.stderr + r.stdout)


def test_a_hostile_int8_scale_is_refused(packs, tmp_path):
    d = _copy(packs, "int8", tmp_path)
    name = _layer0(d)["tensors"]["w2_scale"]
    rewrite_tensor(d, name, set_element((0, 2), float("nan")))
    with pytest.raises(PackedDirError, match=rf"tensor '{name}' \[0, 2\] = nan: scales must be finite and >= 0"):
        moepack.open(d)


def test_an_int8_column_sum_that_is_not_its_codes_sum_fails_verify(packs, tmp_path):
    d = _copy(packs, "int8", tmp_path)
    name = _layer0(d)["tensors"]["w13_colsum"]
    rewrite_tensor(d, name, set_element((1, 4), 1000))
    (bad,) = moepack.verify(d).failures()
    assert f"tensor {name!r} [expert 1, channel 4] = 1000, the sum of " in bad and "column sums must equal it" in bad


def test_a_nan_bf16_weight_fails_verify(packs, tmp_path):
    d = _copy(packs, "bf16", tmp_path)
    e = _layer0(d)
    layout = moepack.open(d).layers[e["index"]].packed.layout
    rewrite_tensor(d, e["tensors"]["w2"], set_unpacked(layout, (0, 1, 2), float("nan")))
    (bad,) = moepack.verify(d).failures()
    assert f"tensor {e['tensors']['w2']!r}" in bad and "= nan: weights must be finite" in bad


def test_every_value_rule_holds_on_converted_packs(packs):
    for key, d in packs.items():
        report = moepack.verify(d)
        assert report.ok and report.values_checked > 0, (key, report.failures())
        assert all(f.ok and not f.detail for f in report.files)


def test_a_widened_tolerance_is_reported(packs):
    """The output tolerance may widen above the scheme's base by the A8 reference's code flips;
    verify reports the base next to it, and the CLI prints a note for every widened layer."""
    for key in ("int8", "w4a16_a8", "w4a16"):
        src = fixture_dir("qwen3_moe" if key == "int8" else W4A16)
        report = moepack.verify(packs[key], source=src)
        assert report.ok and all(c.tol_base is not None and c.tol >= c.tol_base for c in report.layers)
        widened = [c.index for c in report.layers if c.tol > c.tol_base]
        out = _flat(cli("verify", packs[key], "--source", src).stdout)
        for i in widened:
            assert f"note: layer {i}: tolerance" in out and "widened by the" in out
        assert out.count("widened by the") == len(widened)


def test_a_type_only_config_change_fails_verify(packs, tmp_path):
    """A config value of another JSON type (2 -> 2.0) is a difference."""
    d = edited(packs, tmp_path, "bf16", lambda m: m["model"]["config"].update(num_experts_per_tok=2.0))
    _fails_with_source(d, "qwen3_moe", "model.config.num_experts_per_tok: pack 2.0, source config.json 2")


def test_a_nested_type_only_config_change_fails_verify(packs, tmp_path):
    """Found by tools/fuzz_manifest.py (10^5 cases, 5 missed): 8 -> 8.0, false -> 0 inside a
    nested config value (quantization_config, rope_parameters, moe_layers) passed verify
    --source: Python's == calls them equal, a config reader may not."""
    def edit(m):
        m["model"]["config"]["zz_nested"] = {"a": [1, {"b": True}]}

    d = edited(packs, tmp_path, "bf16", edit)
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("qwen3_moe"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["zz_nested"] = {"a": [1, {"b": 1}]}
    (src / "config.json").write_text(json.dumps(cfg))
    report = moepack.verify(d, source=src)
    assert "model.config.zz_nested.a[1].b: pack True, source config.json 1" in report.model, report.model
