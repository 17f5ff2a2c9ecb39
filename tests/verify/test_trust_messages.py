"""Issue 29, messages: every error through the Python API and the CLI is moepack's own one
line naming the thing, the value and the rule; transformers' warnings stay off the screen unless
``--debug`` (MOEPACK_DEBUG=1). Each case failed before (a torch or transformers traceback, the
wrong thing blamed)."""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import moepack
from moepack.convert.run import MANIFEST
from moepack.errors import MoepackError, UnsupportedError
from tests.support.fixtures_util import fixture_dir
from tests.container.test_packdir_errors import cli
from tests.support.packdir_edit import reseal

import transformers  # noqa: F401


@pytest.fixture(scope="module")
def pack(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("msg") / "q"
    moepack.convert(fixture_dir("qwen3_moe"), d)
    return d


@pytest.mark.parametrize("shape", [(3, 50), (72,), (2, 3, 72), (3, 73)])
def test_layer_call_with_a_wrong_hidden_states_names_it(pack, shape):
    layer = moepack.open(pack).layers[0]
    with pytest.raises(UnsupportedError) as ei:
        layer(torch.randn(*shape))
    msg = str(ei.value)
    assert msg.startswith(f"layer 0: hidden_states is float32 {list(shape)}: must be a floating [tokens, H=72] tensor"), msg
    assert "router_logits" not in msg and len(msg.splitlines()) == 1


def test_layer_call_with_integer_hidden_states_names_the_dtype(pack):
    with pytest.raises(UnsupportedError, match=r"hidden_states is int64 \[2, 72\]: must be a floating"):
        moepack.open(pack).layers[0](torch.ones(2, 72, dtype=torch.long))


def _with_config(tmp_path: Path, **changes) -> Path:
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("qwen3_moe"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_dtype_auto_converts_and_loads(tmp_path):
    src = _with_config(tmp_path, dtype="auto")
    moepack.convert(src, tmp_path / "p")
    model = moepack.load_model(tmp_path / "p")
    assert model.dtype == moepack.open(tmp_path / "p").tensor("model.embed_tokens.weight").dtype
    r = cli("generate", tmp_path / "p", "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert r.exit_code == 0, r.stderr


def test_an_unknown_dtype_word_is_refused_in_one_line(tmp_path):
    src = _with_config(tmp_path, dtype="float4")
    moepack.convert(src, tmp_path / "p")
    with pytest.raises(UnsupportedError, match=r"model.config dtype='float4': must be one of bfloat16, float16, float32 or "
                                               r"'auto'"):  # fmt: skip
        moepack.load_model(tmp_path / "p")
    r = cli("generate", tmp_path / "p", "--prompt-ids", "1")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "dtype='float4'" in r.stderr


def test_a_config_transformers_cannot_build_is_moepacks_error(pack, tmp_path):
    d = tmp_path / "p"
    shutil.copytree(pack, d)
    m = json.loads((d / MANIFEST).read_text())
    m["model"]["config"]["rope_parameters"] = {"rope_type": "no-such-rope"}
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    with pytest.raises(MoepackError) as ei:
        moepack.load_model(d)
    assert len(str(ei.value).splitlines()) == 1 and "model.config" in str(ei.value)


def test_generate_prompt_without_tokenizer_names_the_tokenizer(pack):
    r = cli("generate", pack, "--prompt", "hello")
    assert r.exit_code == 2
    assert "carries no tokenizer files" in r.stderr and "a text prompt needs the source's tokenizer" in r.stderr and r.stderr.count("\n") == 1


def test_generate_prompt_with_a_deleted_tokenizer_file_names_it(pack, tmp_path):
    d = tmp_path / "p"
    shutil.copytree(pack, d)
    (d / "tokenizer.json").write_text("{}")
    m = json.loads((d / MANIFEST).read_text())
    m["carried_files"].append("tokenizer.json")
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    (d / "tokenizer.json").unlink()
    r = cli("generate", d, "--prompt", "hello")
    assert r.exit_code == 2 and "tokenizer file tokenizer.json is listed in carried_files but missing" in r.stderr


def test_transformers_warnings_are_quiet_unless_debug(monkeypatch, capsys):
    from moepack.hf import quiet_transformers

    log = logging.getLogger("transformers.tokenization_utils_base")
    monkeypatch.delenv("MOEPACK_DEBUG", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_transformers():
            warnings.warn("a transformers deprecation")
            log.warning("a tokenizer notice")
    assert seen == [] and "a tokenizer notice" not in capsys.readouterr().err
    monkeypatch.setenv("MOEPACK_DEBUG", "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_transformers():
            warnings.warn("a transformers deprecation")
    assert [str(w.message) for w in seen] == ["a transformers deprecation"]
