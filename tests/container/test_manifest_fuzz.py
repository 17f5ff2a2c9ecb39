"""A small, seeded fuzz of packed directories (tests/support/manifest_fuzz.py): bent manifests (fields
deleted, retyped, replaced, swapped, renamed, duplicated, out of range, at every depth) and bent
shard headers (dtype, shape, offsets, metadata, raw bytes, length prefix, truncation). Every
outcome must be a MoepackError, a result bit-for-bit identical to the unbent directory's, or a
well-formed directory of another model (its manifest's meaning differs, and verify --source
fails it; for a header case verify's checksums fail). tools/fuzz_manifest.py runs the long version."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

import moepack
from tests.support.fixtures_util import fixture_dir
from tests.support.manifest_fuzz import fuzz, make_target
from tests.support.packdir_edit import reseal

FIXTURES = ("deepseek_v3", "gpt_oss", "qwen2_moe", "qwen3_moe_w8a8", "qwen2_moe_w4a16", "qwen2_moe_w4a16@a8")  # @a8: --act-mode a8
CASES = 480  # about 20 s (verify --source runs on every case whose model config changed)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    out = []
    for name in FIXTURES:
        fixture, _, mode = name.partition("@")
        moepack.convert(fixture_dir(fixture), root / name, act_mode=mode or None)
        out.append(make_target(root / name, fixture_dir(fixture)))
    return out


def test_bent_directories_are_refused_or_compute_the_same(targets, tmp_path):
    res = fuzz(targets, tmp_path, CASES, seed=12)
    counts = res["counts"]
    assert res["bugs"] == [], "\n".join(f"{k} case {i} on {name}: {edits}: {detail}" for k, name, i, edits, detail in res["bugs"])
    assert sum(counts.values()) == CASES
    # the fuzzer reaches every outcome it must (a fuzzer whose cases are all refused at the first
    # field, or all ignored, tests nothing)
    for kind in ("manifest", "header"):
        assert counts[(kind, "refused")] > 0 and counts[(kind, "identical")] > 0, counts
    assert counts[("manifest", "refused")] > counts[("manifest", "identical")], counts
    assert counts[("manifest", "other_config")] > 0, counts  # model.config edits, which verify --source must catch


def test_the_fuzzer_sees_a_silent_change(targets, tmp_path):
    """The oracle works: were the runtime to read a field that ``meaning`` leaves out (here a
    meaning blind to the activation), a case changing it would be reported as ``silent``."""
    from tests.support import manifest_fuzz

    def blind(m: dict) -> str:
        m = copy.deepcopy(m)
        for e in m["layers"]:
            e["activation"] = "silu"
        return manifest_fuzz.meaning(m)

    t = dataclasses.replace(targets[0], meaning=blind(json.loads(targets[0].text)))
    d = manifest_fuzz.case_dir(t, tmp_path)
    m = json.loads(t.text)
    m["layers"][0]["activation"] = "gelu"
    m["format_version"] = 7  # a shared expert on a gelu layer is version 7's (a version-6 file with one is refused)
    (d / "moepack.json").write_text(json.dumps(reseal(m)))
    assert manifest_fuzz._classify(t, d, lambda: blind(m)).cls == "silent"
    assert manifest_fuzz._classify(t, d, lambda: manifest_fuzz.meaning(m)).cls == "other_model"
