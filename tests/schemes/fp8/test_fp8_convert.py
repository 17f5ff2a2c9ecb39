"""FP8 checkpoints end to end: ``moepack convert`` of DeepSeek-style block FP8 (F32 / BF16 / F16
scales, any block height, ragged N and K, an MTP layer) and compressed-tensors float-quantized
(block / channel / tensor scales), ``verify --source`` (exact codes and scales, outputs against
the fp8 reference), tampered codes and scales caught, the packed layers against the transformers
MoE block carrying the oracle's dequantized weights, ``--quantize fp8`` of float checkpoints, and
the CLI (convert, verify, inspect, run, bench).

The sources are tests/schemes/fp8/test_fp8_sources.py's (written by tools/fp8_checkpoint.py and by
compressed-tensors itself).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moepack
from moepack.errors import MoepackError
from moepack.sources import open_source
from tests.support.fixtures_util import fixture_dir, moe_block, route
from tests.support.packdir_edit import rewrite_tensor
from tests.reference.tolerances import TOL, assert_close
from tests.schemes.fp8.test_fp8_sources import BLOCK_SOURCES, CT_PRESETS, fp8_sources, hf_dequant  # noqa: F401 (fixture)

F32 = torch.float32
SOURCES = [*sorted(BLOCK_SOURCES), *(f"ct_{p}" for p in CT_PRESETS)]
LAYOUT_OF = {"ct_FP8_DYNAMIC": "f8ch_n32k2_x86", "ct_FP8": "f8ch_n32k2_x86"}  # the others: f8g128_n32k2_x86


def cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def packed(fp8_sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8packed")
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = root / name
            moepack.convert(fp8_sources(name), made[name])
        return made[name]

    return get


def _oracle(src: Path, prefix: str, e: int | None, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, H], w2 [H, I]) fp32 of routed expert ``e`` (or the shared expert, None) from the
    source library's own dequantization: transformers' (block FP8) or the module's rule."""
    sd = load_file(str(src / "model.safetensors"))
    sub = f"experts.{e}" if e is not None else ("shared_experts" if f"{prefix}.shared_experts.gate_proj.weight" in sd else "shared_expert")

    def one(p):
        m = f"{prefix}.{sub}.{p}"
        if sd[m + ".weight"].dtype != torch.float8_e4m3fn:
            return sd[m + ".weight"].float()
        s = sd.get(m + ".weight_scale_inv", sd.get(m + ".weight_scale"))
        if s.dim() == 2 and s.shape[1] > 1 or block and s.numel() > 1 and s.shape != (s.shape[0], 1):
            return hf_dequant(sd[m + ".weight"], s, block)
        return sd[m + ".weight"].float() * s.float().reshape(-1, 1)  # channel [N, 1] or tensor [1]

    return torch.cat([one("gate_proj"), one("up_proj")]), one("down_proj")


@pytest.mark.parametrize("name", SOURCES)
def test_convert_verify_and_inspect(packed, fp8_sources, name):
    src, dst = fp8_sources(name), packed(name)
    m = json.loads((dst / "moepack.json").read_text())
    ckpt, reader = open_source(src)
    assert m["source"]["reader"] == reader.name
    for x in m["layers"]:
        assert x["scheme"] == "fp8_block" and x["act_mode"] == "a16" and x["quantizer"] is None
        assert moepack.layout_get(x["layout_id"]).name == LAYOUT_OF.get(name, "f8g128_n32k2_x86")
        assert "activations run in 16 bits" in x["scheme_source"]
    if name == "deepseek_v3_f32":  # the MTP layer: skipped, recorded, neither packed nor carried
        skipped = m["source"]["skipped"]
        assert "num_nextn_predict_layers=1" in skipped["why"] and len(skipped["tensors"]) > 20
        assert [x["index"] for x in m["layers"]] == [1]
        assert not [n for n in m["tensors"] if n.startswith("model.layers.2.")]
    else:
        assert "skipped" not in m["source"]
    report = moepack.verify(dst, source=src)
    assert report.ok, report.failures()
    assert all(x.weights_exact and x.rel_err <= 1e-5 for x in report.layers)
    r = cli("inspect", dst)
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "activations run in 16 bits" in out
    js = json.loads(cli("inspect", dst, "--json").output)
    assert {x["scheme"] for x in js["layers"]} == {"fp8_block"} and all(x["quantized"] for x in js["layers"])
    if name == "deepseek_v3_f32":
        assert "skipped:" in out and "multi-token-prediction" in out


def _hf_model(src: Path, block):
    """The transformers model of ``src``'s config (no quantization), fp32, each MoE block carrying
    the oracle's dequantized experts and the checkpoint's float router."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=F32, experts_implementation="eager").eval()
    sd = load_file(str(src / "model.safetensors"))
    for idx in range(len(model.model.layers)):
        try:
            blk, _ = moe_block(model, idx)
        except ValueError:
            continue
        p = f"model.layers.{idx}.mlp"
        per = [_oracle(src, p, e, block) for e in range(blk.experts.gate_up_proj.shape[0])]
        with torch.no_grad():
            blk.experts.gate_up_proj.copy_(torch.stack([w for w, _ in per]))
            blk.experts.down_proj.copy_(torch.stack([w for _, w in per]))
            blk.gate.weight.copy_(sd[f"{p}.gate.weight"].float())
            if hasattr(blk.gate, "e_score_correction_bias"):
                blk.gate.e_score_correction_bias.copy_(sd[f"{p}.gate.e_score_correction_bias"].float())
            if hasattr(blk, "shared_experts"):
                w13, w2 = _oracle(src, p, None, block)
                si = w13.shape[0] // 2
                blk.shared_experts.gate_proj.weight.copy_(w13[:si])
                blk.shared_experts.up_proj.weight.copy_(w13[si:])
                blk.shared_experts.down_proj.weight.copy_(w2)
    return model


@pytest.mark.parametrize("name", SOURCES)
def test_packed_layers_match_transformers_on_the_oracle_weights(packed, fp8_sources, name):
    src, dst = fp8_sources(name), packed(name)
    block = BLOCK_SOURCES[name][3] if name in BLOCK_SOURCES else (128, 128)
    model = _hf_model(src, block)
    pm = moepack.open(dst)
    g = torch.Generator().manual_seed(3)
    assert pm.layers
    for idx, layer in pm.layers.items():
        blk, run = moe_block(model, idx)
        x = torch.randn(13, layer.hidden_size, generator=g)
        y = run(x)
        out = layer(x, route(blk, x)[0].float())
        assert_close(out, y, TOL["scalar_vs_reference", F32], f"{name} layer {idx} vs transformers")


@pytest.mark.parametrize("what,name,edit,words", [
    ("code", "moepack.layers.1.w13", lambda t: t.view(-1).__setitem__(5, t.view(-1)[5] ^ 1), "e4m3fn codes"),
    ("scale", "moepack.layers.1.w2_scale", lambda t: t.__setitem__((0, 0, 3), t[0, 0, 3] * 2), "w2_scale"),
    ("shared scale", "moepack.layers.1.shared_w13_scale", lambda t: t.__setitem__((0, 1, 7), t[0, 1, 7] * 0.5), "shared_w13_scale"),
])  # fmt: skip
def test_tampered_codes_and_scales_fail_verify(tmp_path, packed, fp8_sources, what, name, edit, words):
    d = tmp_path / "p"
    shutil.copytree(packed("deepseek_v3_f32"), d)
    rewrite_tensor(d, name, edit)
    assert moepack.verify(d).ok  # the sha256s agree: only the source can tell
    report = moepack.verify(d, source=fp8_sources("deepseek_v3_f32"))
    assert not report.ok
    fails = " ".join(report.failures())
    assert name in fails and "differ" in fails, fails


def test_nan_code_in_a_checksum_consistent_pack_fails_verify_without_source(tmp_path, packed):
    """verify DST checks the value rules: an fp8 code 0x7F / 0xFF (NaN) written with its sha256
    fixed is named by tensor, element and value (it passed before: one-byte codes had no rule)."""
    d = tmp_path / "p"
    shutil.copytree(packed("deepseek_v3_f32"), d)
    name = "moepack.layers.1.w2"
    rewrite_tensor(d, name, lambda t: t.view(-1).__setitem__(70, 0xFF))
    report = moepack.verify(d)
    assert not report.ok
    fails = " ".join(report.failures())
    assert f"{name!r} element 70 = 0xFF: e4m3fn codes 0x7F / 0xFF are NaN" in fails, fails
    assert moepack.verify(packed("deepseek_v3_f32")).ok  # the untouched pack keeps the rule


@pytest.mark.parametrize("name,quantize,layout", [
    ("qwen3_moe", "fp8", "f8g128_n32k2_x86"),
    ("qwen3_moe", "fp8:ch", "f8ch_n32k2_x86"),
    ("deepseek_v3", "fp8_block", "f8g128_n32k2_x86"),  # a float shared expert, quantized too
    ("gpt_oss", "fp8", "f8g128_n32k2_x86"),  # swigluoai: interleaved rows, biases
])  # fmt: skip
def test_quantize_fp8_from_float(tmp_path, name, quantize, layout):
    src, dst = fixture_dir(name), tmp_path / "p"
    moepack.convert(src, dst, quantize=quantize)
    m = json.loads((dst / "moepack.json").read_text())
    assert all(moepack.layout_get(x["layout_id"]).name == layout for x in m["layers"])
    assert all(x["quantizer"] == ("fp8_block:ch" if quantize.endswith(":ch") else "fp8_block:g128") for x in m["layers"])
    assert all(x["scheme_source"].startswith("quantized by moepack from BF16 (fp8 e4m3fn") for x in m["layers"])
    report = moepack.verify(dst, source=src)
    assert report.ok, report.failures()
    for x in report.layers:
        assert x.weights_exact and x.rel_err <= 1e-5 and x.fp32_tol is not None and x.rel_err_fp32 < 0.08, x


def test_mixtral_names_w1_w3_w2(tmp_path, fp8_sources):
    """Mixtral's experts.<e>.{w1,w3,w2} through the dense reader's discovery, BF16 scales."""
    from tests.schemes.fp8.test_fp8_sources import write_block_fp8

    src = tmp_path / "src"
    write_block_fp8(fixture_dir("mixtral"), src, scale_dtype="bfloat16")
    ckpt, reader = open_source(src)
    specs = reader.layers(ckpt)
    assert [s.index for s in specs] == [0, 1] and specs[0].names[(0, "up", "weight")].endswith("experts.0.w3.weight")
    moepack.convert(src, tmp_path / "p")
    report = moepack.verify(tmp_path / "p", source=src)
    assert report.ok and all(x.weights_exact for x in report.layers), report.failures()


def test_float_shared_expert_in_an_fp8_source(tmp_path, fp8_sources):
    """A shared expert the checkpoint keeps in BF16 (modules_to_not_convert) stays BF16: packed in
    the float layout beside the routed experts' own codes (format version 5), exact in verify;
    ``--quantize fp8`` quantizes it, as asked, and records the quantizer."""
    src = tmp_path / "src"
    shutil.copytree(fp8_sources("deepseek_v3_f32"), src)
    sd = load_file(str(src / "model.safetensors"))
    for p in ("gate_proj", "up_proj", "down_proj"):
        m = f"model.layers.1.mlp.shared_experts.{p}"
        sd[m + ".weight"] = hf_dequant(sd[m + ".weight"], sd.pop(m + ".weight_scale_inv"), (128, 128)).to(torch.bfloat16)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["shared_experts"]
    (src / "config.json").write_text(json.dumps(cfg))
    moepack.convert(src, tmp_path / "p")
    m = json.loads((tmp_path / "p" / "moepack.json").read_text())
    (x,) = m["layers"]
    assert "activations run in 16 bits" in x["scheme_source"]
    assert x["shared"]["scheme_source"] == "BF16 weights packed as bf16" and m["format_version"] == 6
    assert moepack.layout_get(x["shared"]["layout_id"]).name == "bf16_n32k2_x86" and "quantizer" not in x["shared"]
    report = moepack.verify(tmp_path / "p", source=src)
    assert report.ok and report.layers[0].shared_exact, report.failures()
    moepack.convert(src, tmp_path / "q", quantize="fp8")  # asked: quantized by moepack's quantizer, recorded
    (y,) = json.loads((tmp_path / "q" / "moepack.json").read_text())["layers"]
    assert y["shared"]["scheme_source"].startswith("quantized by moepack from BF16") and "layout_id" not in y["shared"]
    assert y["shared"]["quantizer"] == "fp8_block:g128" and y["quantizer"] is None
    report = moepack.verify(tmp_path / "q", source=src)
    assert report.ok and report.layers[0].shared_exact, report.failures()


def test_an_fp8_source_is_never_requantized(tmp_path, fp8_sources):
    src = fp8_sources("qwen3_moe_f16")
    with pytest.raises(MoepackError, match="never re-quantizes"):
        moepack.convert(src, tmp_path / "a", quantize="int4")
    with pytest.raises(MoepackError, match="never re-quantized"):
        moepack.convert(src, tmp_path / "b", quantize="fp8:ch")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    moepack.convert(src, tmp_path / "c", quantize="fp8")  # its own scheme: packed as stored
    assert json.loads((tmp_path / "c" / "moepack.json").read_text())["layers"][0]["quantizer"] is None


def test_cli_convert_verify_run_bench(tmp_path, fp8_sources):
    src, dst = fp8_sources("ct_FP8_BLOCK"), tmp_path / "p"
    r = cli("convert", src, dst, "--json")
    assert r.exit_code == 0, r.output
    r = cli("verify", dst, "--source", src)
    assert r.exit_code == 0, r.output
    r = cli("run", dst, "--tokens", "3", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert [x["layer"] for x in res] == [0, 1] and all(x["out_shape"] == [3, 320] and x["act_mode"] == "a16" for x in res)
    assert all(0 < x["out_rms"] < float("inf") for x in res)
    r = cli("bench", "--scheme", "fp8", "--shapes", "e4k2h320i200", "--tokens", "1,5", "--no-probe", "--calls", "3",
            "--min-time", "0.01", "--json", tmp_path / "b.json", "-q")  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert {x["scheme"] for x in rows} == {"fp8_block"} and len(rows) == 2
    assert all(x["check_rel_diff"] is not None and x["check_rel_diff"] < moepack.schemes.get_scheme("fp8").bench.check_tol for x in rows)
