"""Property tests (hypothesis, issue 49): one validation of the manifest, used by convert and by
open, so convert cannot write a pack that open refuses.

convert runs ``moepack.manifest.check_manifest`` on the manifest it plans before writing anything
(``convert_stages.check_draft_manifest``) and on the one it writes (``write_manifest``); open
runs the same function (``load_manifest``). Over random edits of convert-written manifests
(tests/support/manifest_fuzz.py's mutations: fields deleted, retyped, replaced, swapped,
renamed, duplicated, at any depth; no edit at all in some cases), convert's validation and open
give the same verdict: both accept, or both refuse with the same one line. The one difference
allowed is the directory's shards, which a hand edit of ``tensors`` / ``files`` can contradict
and convert's writer never does (it writes the shards its manifest lists). And over random
config.json edits, convert either refuses before writing anything or writes a pack open accepts.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moepack
from moepack.errors import MoepackError, PackedDirError
from moepack.manifest import MANIFEST, ManifestError, manifest_digest, write_manifest
from tests.support.fixtures_util import fixture_dir
from tests.support.manifest_fuzz import mutate_manifest
from tests.support.packdir_edit import convert_fixtures

FIXTURES = ("qwen3_moe", "gpt_oss", "qwen2_moe_w4a16", "deepseek_v3")
_FIXTURE_SCOPED = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return convert_fixtures(tmp_path_factory.mktemp("verdict"), FIXTURES)


def _case_dir(pack: Path, work: Path) -> Path:
    d = work / "case"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    for f in pack.iterdir():
        if f.name != MANIFEST:
            (d / f.name).symlink_to(f.resolve())
    return d


def _convert_verdict(m: dict, d: Path, work: Path) -> str | None:
    """What convert's validation (``write_manifest``: seal, then open's schema) says of ``m``, with
    the directory named ``d`` as open names it; None: it would write it."""
    scratch = work / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        write_manifest(scratch, copy.deepcopy(m), d)
    except ManifestError as e:
        return str(e)
    return None


def _open_verdict(d: Path) -> tuple[str, str | None]:
    """("manifest", line) when open refuses the manifest, ("shards", line) when it refuses the
    directory's files, ("ok", None) when it opens."""
    try:
        moepack.open(d)
    except ManifestError as e:
        return "manifest", str(e)
    except PackedDirError as e:
        return "shards", str(e)
    return "ok", None


@given(data=st.data())
@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=_FIXTURE_SCOPED)
def test_convert_and_open_give_one_verdict_on_random_manifest_edits(packs, tmp_path, data):
    name = data.draw(st.sampled_from(FIXTURES), label="pack")
    rng = data.draw(st.randoms(use_true_random=False), label="rng")
    m = json.loads((packs[name] / MANIFEST).read_text())
    edits = mutate_manifest(rng, m) if data.draw(st.integers(0, 9), label="edit") else []  # one case in ten: as written
    try:
        text = json.dumps(m, allow_nan=False)
    except ValueError:  # an edit JSON cannot hold: not a manifest anyone could write
        return
    d = _case_dir(packs[name], tmp_path)
    sealed = "manifest_sha256" in m and isinstance(m["manifest_sha256"], str)
    if sealed:  # the content as a writer that recomputes the seal writes it
        m["manifest_sha256"] = manifest_digest(m)
        text = json.dumps(m)
    (d / MANIFEST).write_text(text)
    conv = _convert_verdict(m, d, tmp_path)
    kind, line = _open_verdict(d)
    if not sealed:  # the edit took the seal itself (convert writes its own): open must refuse the file
        assert kind == "manifest", f"{name} {edits}: an unsealed version-6 manifest: {kind} {line}"
    elif conv is not None:
        assert line == conv, f"{name} {edits}: convert refuses with\n  {conv}\nopen says {kind}:\n  {line}"
        assert len(conv.splitlines()) == 1
    elif kind != "ok":
        assert kind == "shards" and any("['tensors'" in x or "['files'" in x for x in edits), (
            f"{name} {edits}: convert would write this manifest, open refuses it: {line}")  # fmt: skip
    if not edits:
        assert conv is None and kind == "ok", f"{name}: a convert-written manifest: {conv} / {line}"


_CONFIG_EDITS = {  # config.json keys that reach the manifest, with values on both sides of their rules
    "qwen3_moe": {"num_experts_per_tok": [0, 1, 2, 8, 9, -1, 2.5, "2", None], "norm_topk_prob": [True, False, 1, None],
                  "num_hidden_layers": [0, 1, 2, 3, 99], "hidden_act": ["silu", "gelu", "relu9", ""],
                  "num_experts": [8, 7, 0], "decoder_sparse_step": [0, 1, 2]},
    "gpt_oss": {"swiglu_limit": [7.0, 0.0, -1.0, 1e-30, 3.5e38, 1e300, "7"], "num_experts_per_tok": [1, 2, 4, 5, 0],
                "experts_per_token": [1, 2, 5]},
}  # fmt: skip


@given(data=st.data())
@settings(max_examples=16, deadline=None, derandomize=True, suppress_health_check=_FIXTURE_SCOPED)
def test_convert_refuses_or_writes_a_pack_open_accepts(tmp_path, data):
    """Random config.json edits: convert refuses before writing anything (one line, no directory
    left) or writes a pack that open accepts; never a pack that open refuses."""
    name = data.draw(st.sampled_from(sorted(_CONFIG_EDITS)), label="fixture")
    keys = data.draw(st.lists(st.sampled_from(sorted(_CONFIG_EDITS[name])), min_size=1, max_size=3, unique=True), label="keys")
    src = tmp_path / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(fixture_dir(name), src)
    cfg = json.loads((src / "config.json").read_text())
    for k in keys:
        cfg[k] = data.draw(st.sampled_from(_CONFIG_EDITS[name][k]), label=k)
    (src / "config.json").write_text(json.dumps(cfg))
    dst = tmp_path / "dst"
    shutil.rmtree(dst, ignore_errors=True)
    try:
        moepack.convert(src, dst)
    except MoepackError as e:
        assert len(str(e).splitlines()) == 1, str(e)
        assert not dst.exists(), f"{keys}: convert refused ({e}) and left {dst}"
        return
    except Exception as e:  # noqa: BLE001 - a traceback for the user is what this looks for
        pytest.fail(f"{name} {({k: cfg[k] for k in keys})}: convert crashed: {type(e).__name__}: {e}")
    try:
        moepack.open(dst)
    except MoepackError as e:
        pytest.fail(f"{name} {({k: cfg[k] for k in keys})}: convert wrote a pack that open refuses: {e}")


def test_the_mutations_reach_every_verdict(packs, tmp_path):
    """The edits the property draws from are not all refused at the first field, nor all
    harmless: over 60 seeded edits, convert's validation accepts some and refuses some."""
    seen = set()
    for i in range(60):
        name = FIXTURES[i % len(FIXTURES)]
        m = json.loads((packs[name] / MANIFEST).read_text())
        mutate_manifest(random.Random(i), m)
        try:
            json.dumps(m, allow_nan=False)
        except ValueError:
            continue
        seen.add(_convert_verdict(m, tmp_path / "d", tmp_path) is None)
    assert seen == {True, False}
