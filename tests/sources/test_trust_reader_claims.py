"""When no reader handles a checkpoint, the reader its quantization_config names (or the format
moepack recognises and does not read yet) speaks first and alone on the one line a user sees;
the other readers' reasons are a note on the error, which ``moepack --verbose`` prints after the line
and moepack --debug's traceback shows (issue 49:
33 refusals listed every reader's reason in 580-1050 characters, a compressed-tensors NVFP4
checkpoint's first reason was about W8A8 and a ModelOpt NVFP4 refusal never said NVFP4)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import moepack
from moepack.errors import SourceError
from moepack.sources import open_source
from tests.support.fixtures_util import fixture_dir


def _cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _src(tmp_path: Path, fixture: str, edit) -> Path:
    src = tmp_path / "src"
    shutil.copytree(fixture_dir(fixture), src)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def _ct_nvfp4(cfg):
    qc = cfg["quantization_config"]
    qc["format"] = "nvfp4-pack-quantized"
    for g in qc["config_groups"].values():
        g["format"] = "nvfp4-pack-quantized"
        g["weights"].update(num_bits=4, type="float", strategy="tensor_group", group_size=32)


def _ct_int8_per_tensor(cfg):
    for g in cfg["quantization_config"]["config_groups"].values():
        g["weights"]["strategy"] = "tensor"


CASES = {  # fixture, config edit, the first line's words (after "source <path>: "), a word it must not hold
    "compressed-tensors NVFP4": ("qwen3_moe_w8a8", _ct_nvfp4,
                                 "compressed-tensors-nvfp4-pack-quantized, the reader of quantization_config format "
                                 "'nvfp4-pack-quantized': config group 'group_0' weights group_size=32: NVFP4", "W8A8"),
    "ModelOpt NVFP4": ("qwen3_moe", lambda c: c.update(quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                                            "group_size": 32}),
                       "modelopt-nvfp4, the reader of ModelOpt quant_algo 'NVFP4': config.json quantization_config "
                       "group_size=32: NVFP4", "gptq"),
    "ModelOpt FP8": ("qwen3_moe", lambda c: c.update(quantization_config={"quant_method": "modelopt", "quant_algo": "FP8"}),
                     "ModelOpt quant_algo='FP8': a ModelOpt checkpoint is not supported yet", "gptq"),
    "compressed-tensors W8A8 per tensor": ("qwen3_moe_w8a8", _ct_int8_per_tensor,
                                           "compressed-tensors, the reader of quantization_config format 'int-quantized': ",
                                           "awq"),
    "fp8 without F8 weights": ("qwen3_moe", lambda c: c.update(quantization_config={"quant_method": "fp8",
                                                                                    "weight_block_size": [128, 128]}),
                               "fp8-block, the reader of quantization_config quant_method 'fp8': ", "mxfp4"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_reader_that_recognises_the_format_speaks_alone(tmp_path, case):
    fixture, edit, words, absent = CASES[case]
    src = _src(tmp_path, fixture, edit)
    with pytest.raises(SourceError) as ei:
        open_source(src)
    first = str(ei.value)
    assert first.startswith(f"source {src}: {words}") and "\n" not in first, first
    assert absent not in first and first.count(": ") <= 6, first  # alone: no other reader's reason
    assert len(first) - len(str(src)) < 400, first
    notes = getattr(ei.value, "__notes__", [])  # what a traceback (moepack --debug) shows
    assert len(notes) == 1 and notes[0].startswith("the other readers: ") and absent in notes[0], notes
    dst = tmp_path / "dst"
    r = _cli("convert", src, dst)
    assert r.exit_code == 2 and r.stderr.splitlines() == [f"moepack: error: {first}"], r.stderr
    assert not dst.exists()
    r = _cli("--debug", "convert", src, dst)  # --debug: the traceback, the other readers' reasons with it
    assert isinstance(r.exception, SourceError) and r.exception.__notes__ == notes
    r = _cli("--verbose", "convert", src, dst)  # --verbose: the line, then the other readers' reasons as a note
    lines = r.stderr.splitlines()
    assert r.exit_code == 2 and lines[0] == f"moepack: error: {first}" and len(lines) == 2, r.stderr
    assert lines[1].startswith("moepack: note: the other readers: ") and absent in lines[1], lines[1]
    assert not dst.exists()
    with pytest.raises(SourceError):
        moepack.convert(src, dst)


def test_modelopt_hf_quant_config_is_recognised_without_a_quantization_config(tmp_path):
    """ModelOpt's own file, hf_quant_config.json: not read as a dense checkpoint."""
    src = _src(tmp_path, "qwen3_moe", lambda c: None)
    (src / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"},
                                                          "quantization": {"quant_algo": "NVFP4", "group_size": 16}}))  # fmt: skip
    ckpt, reader = open_source(src)  # ModelOpt NVFP4's reader; these weights are float, not NVFP4
    assert reader.name == "modelopt-nvfp4"
    with pytest.raises(SourceError, match=r"an NVFP4 \(modelopt\) config but no '\*\.weight' U8 tensors"):
        reader.layers(ckpt)


def test_an_unclaimed_format_still_lists_every_reader(tmp_path):
    src = _src(tmp_path, "qwen3_moe", lambda c: c.update(quantization_config={"quant_method": "fp6"}))
    with pytest.raises(SourceError, match=r"no reader handles it \(compressed-tensors: .*; dense: ") as ei:
        open_source(src)
    assert "\n" not in str(ei.value)


def test_an_hf_quant_config_naming_no_algorithm_leaves_a_dense_checkpoint_dense(tmp_path):
    src = _src(tmp_path, "qwen3_moe", lambda c: None)
    (src / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": None}}))
    assert open_source(src)[1].name == "dense"
