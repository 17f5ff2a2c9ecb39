"""int4 end to end: convert + verify + run (``moepack.open`` and the CLI) for the int4 fixtures
and for GPTQ (v1 sym g128, v2 asym g32, act-order) and AWQ (g64) checkpoints written by
tools/int4_packers.py; the per-layer ``act_mode`` (manifest default, ``convert --act-mode``,
``run --act-mode``, inspect); bad input refused before anything is written; verify catching a
tampered packed zero point and a tampered w13_perm.

The oracle: a transformers MoE block (``AutoModelForCausalLM.from_config`` of the checkpoint's
config, fp32) carrying the dequantized expert weights: for the tools/int4_packers checkpoints the
packers' own inputs (``dequant_lookup``, ORIGINAL column order, no sorting or folding); for the
fixtures the reader's float view (which tests/schemes/int4/test_int4_sources.py holds to compressed-tensors'
own decompression). Its routing and shared expert are transformers' own.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moepack
from moepack.errors import ConvertError, MoepackError
from moepack.sources import open_source
from tests.support.fixtures_util import fixture_dir, moe_block, route
from tests.support.packdir_edit import rewrite_tensor, reseal
from tests.reference.tolerances import TOL, assert_close, assert_close_int8

F32 = torch.float32
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

_spec = importlib.util.spec_from_file_location("int4_packers", Path(__file__).resolve().parents[3] / "tools" / "int4_packers.py")
P = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(P)

FIXTURES = ["qwen2_moe_w4a16", "qwen2_moe_w4a16_asym", "qwen3_moe_w4a16_channel"]
H, I, E, SHARED = 96, 64, 4, 32
WRITTEN = {  # name -> write_moe_checkpoint kwargs
    "gptq_v1_sym_g128": dict(fmt="gptq", group_size=128, sym=True, version="gptq"),
    "gptq_v2_asym_g32": dict(fmt="gptq", group_size=32, sym=False, version="gptq_v2"),
    "gptq_v2_asym_g32_actorder": dict(fmt="gptq", group_size=32, sym=False, version="gptq_v2", act_order=True),
    "gptq_v1_sym_g32_actorder": dict(fmt="gptq", group_size=32, sym=True, version="gptq", act_order=True),
    "awq_g64": dict(fmt="awq", group_size=64, sym=False),
}


def cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _write(d: Path, name: str) -> dict:
    kw = dict(WRITTEN[name])
    return P.write_moe_checkpoint(d, kw.pop("fmt"), h=H, i=I, e=E, layers=2, shared=SHARED, seed=len(name), **kw)


def _oracle_weights(orc: dict | None, src: Path, layer: int):
    """(w13 [E, 2I, H], w2 [E, H, I], shared w13 [1, 2Is, H], shared w2) in fp32."""
    if orc is not None:
        p = f"model.layers.{layer}.mlp"
        dq = lambda m: P.dequant_lookup(orc[m])  # noqa: E731
        w13 = torch.stack([torch.cat([dq(f"{p}.experts.{x}.gate_proj"), dq(f"{p}.experts.{x}.up_proj")]) for x in range(E)])
        w2 = torch.stack([dq(f"{p}.experts.{x}.down_proj") for x in range(E)])
        s13 = torch.cat([dq(f"{p}.shared_expert.gate_proj"), dq(f"{p}.shared_expert.up_proj")])[None]
        return w13, w2, s13, dq(f"{p}.shared_expert.down_proj")[None]
    ckpt, reader = open_source(src)
    spec = next(s for s in reader.layers(ckpt) if s.index == layer)
    canon = reader.read_layer(ckpt, spec)
    sh = reader.read_shared(ckpt, spec) if spec.shared else (None, None)
    return canon.w13.float(), canon.w2.float(), sh[0], sh[1]


def _hf_model(src: Path, orc: dict | None):
    """The transformers model of ``src``'s config (no quantization), fp32, its MoE blocks carrying
    the oracle's dequantized experts and the checkpoint's float routers / shared-expert gates."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=F32, experts_implementation="eager").eval()
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    for idx, layer in enumerate(model.model.layers):
        try:
            block, _ = moe_block(model, idx)
        except ValueError:
            continue
        w13, w2, s13, s2 = _oracle_weights(orc, src, idx)
        with torch.no_grad():
            ex = block.experts
            ex.gate_up_proj.copy_(w13 if ex.gate_up_proj.shape == w13.shape else w13.transpose(1, 2))
            ex.down_proj.copy_(w2 if ex.down_proj.shape == w2.shape else w2.transpose(1, 2))
            block.gate.weight.copy_(sd[f"model.layers.{idx}.mlp.gate.weight"].float())
            if s13 is not None and hasattr(block, "shared_expert"):
                si = s13.shape[1] // 2
                block.shared_expert.gate_proj.weight.copy_(s13[0, :si])
                block.shared_expert.up_proj.weight.copy_(s13[0, si:])
                block.shared_expert.down_proj.weight.copy_(s2[0])
                block.shared_expert_gate.weight.copy_(sd[f"model.layers.{idx}.mlp.shared_expert_gate.weight"].float())
    return model


def _check_vs_transformers(dst: Path, src: Path, orc: dict | None, what: str):
    model = _hf_model(src, orc)
    packed = moepack.open(dst)
    g = torch.Generator().manual_seed(3)
    for idx, layer in packed.layers.items():
        block, run = moe_block(model, idx)
        x = torch.randn(13, layer.hidden_size, generator=g)
        y = run(x)
        logits = route(block, x)[0].float()
        for mode in ("a16", "a8"):
            out = layer(x, logits, act_mode=mode)
            if mode == "a16":
                assert_close(out, y, TOL["scalar_vs_reference", F32], f"{what} layer {idx} a16 vs transformers")
            else:
                assert_close_int8(out, y, TOL["int8_vs_fp32_dequantized", F32], 0.0, f"{what} layer {idx} a8 vs transformers")


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_converts_verifies_and_matches_transformers(tmp_path, name):
    src, dst = fixture_dir(name), tmp_path / "packed"
    moepack.convert(src, dst)
    m = json.loads((dst / "moepack.json").read_text())
    assert m["format_version"] == 6 and all(x["act_mode"] == "a16" and "w13_perm" not in x["tensors"] for x in m["layers"])
    report = moepack.verify(dst, source=src)
    assert report.ok, report.failures()
    _check_vs_transformers(dst, src, None, name)


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_written_checkpoint_converts_verifies_and_matches_transformers(tmp_path, name):
    src, dst = tmp_path / "src", tmp_path / "packed"
    orc = _write(src, name)
    moepack.convert(src, dst)
    m = json.loads((dst / "moepack.json").read_text())
    act = WRITTEN[name].get("act_order", False)
    assert m["format_version"] == 6
    assert all(("w13_perm" in x["tensors"]) == act and x["act_mode"] == "a16" for x in m["layers"])
    assert moepack.layout_get(m["layers"][0]["layout_id"]).group_size == WRITTEN[name]["group_size"]
    report = moepack.verify(dst, source=src)
    assert report.ok, report.failures()
    _check_vs_transformers(dst, src, orc, name)


def test_cli_convert_verify_inspect_run_with_act_modes(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "packed"
    _write(src, "gptq_v2_asym_g32_actorder")
    r = cli("convert", src, dst, "--act-mode", "a8", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["act_modes"] == ["a8"]
    m = json.loads((dst / "moepack.json").read_text())
    assert {x["act_mode"] for x in m["layers"]} == {"a8"}
    assert all(layer.packed.act_mode == "a8" and layer.shared.act_mode == "a8" for layer in moepack.open(dst).layers.values())
    r = cli("verify", dst, "--source", src)
    assert r.exit_code == 0, r.output
    r = cli("inspect", dst, "--json")
    assert r.exit_code == 0, r.output
    layers = json.loads(r.output)["layers"]
    assert all(x["act_mode"] == "a8" and x["act_order"] for x in layers)
    out = cli("inspect", dst).output
    assert "act mode a8: layers 0, 1" in out and "act-order (w13_perm): layers 0, 1" in out, out
    runs = {}
    for mode in (None, "a16", "a8"):
        r = cli("run", dst, "--dtype", "fp32", "--json", *(["--act-mode", mode] if mode else []))
        assert r.exit_code == 0, r.output
        runs[mode] = json.loads(r.output)
        assert {x["act_mode"] for x in runs[mode]} == {mode or "a8"}
    assert runs[None] == [dict(x, ms=y["ms"]) for x, y in zip(runs["a8"], runs[None])]
    assert runs["a16"][0]["token0_out_head"] != runs["a8"][0]["token0_out_head"]
    r = cli("run", dst, "--act-mode", "a4")
    assert r.exit_code != 0 and "--act-mode 'a4': must be a16 or a8" in r.output


def test_act_mode_refusals_and_w4a8_default(tmp_path):
    # a layout that does not serve the mode: refused before anything is written, naming layout and modes
    dst = tmp_path / "d"
    with pytest.raises(ConvertError, match=r"act_mode='a8': layout bf16_n32k2_x86 \(scheme dense\) runs with a16 activations only"):
        moepack.convert(fixture_dir("qwen2_moe"), dst, act_mode="a8")
    with pytest.raises(ConvertError, match=r"act_mode='a16': layout i8_n32k4_x86 \(scheme int8_channel\) runs with a8"):
        moepack.convert(fixture_dir("qwen3_moe_w8a8"), dst, act_mode="a16")
    assert not dst.exists() and not list(tmp_path.iterdir())
    r = cli("convert", fixture_dir("qwen2_moe"), dst, "--act-mode", "a8")
    assert r.exit_code == 2 and "act_mode='a8': layout bf16_n32k2_x86" in " ".join(r.output.split())
    # a compressed-tensors W4A8 checkpoint (input activations dynamic per-token int8) defaults to a8
    src = tmp_path / "w4a8"
    import shutil

    shutil.copytree(fixture_dir("qwen2_moe_w4a16"), src)
    cfg = json.loads((src / "config.json").read_text())
    act = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    for grp in cfg["quantization_config"]["config_groups"].values():
        grp["input_activations"] = act
    (src / "config.json").write_text(json.dumps(cfg))
    moepack.convert(src, tmp_path / "p8")
    assert {x["act_mode"] for x in json.loads((tmp_path / "p8" / "moepack.json").read_text())["layers"]} == {"a8"}
    model = moepack.open(tmp_path / "p8")
    assert all(x.act_mode == "a8" for x in model.layers.values())
    assert moepack.verify(tmp_path / "p8", source=src).ok
    # a manifest act_mode the layout does not serve is refused at open; absent = the layout's default
    m = json.loads((tmp_path / "p8" / "moepack.json").read_text())
    m["layers"][0]["act_mode"] = "a4"
    (tmp_path / "p8" / "moepack.json").write_text(json.dumps(reseal(m)))
    with pytest.raises(MoepackError, match=r"layers\[0\]\.act_mode='a4' \(layer 0\): must be one of 'a16', 'a8' \(layout u4g32_n32k8_x86 runs with a16 or a8 "
                                              r"activations\)"):
        moepack.open(tmp_path / "p8")
    for x in m["layers"]:
        del x["act_mode"]
    (tmp_path / "p8" / "moepack.json").write_text(json.dumps(reseal(m)))
    assert all(x.act_mode == "a16" for x in moepack.open(tmp_path / "p8").layers.values())


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    src = tmp_path / "g16"
    P.write_moe_checkpoint(src, "gptq", h=H, i=I, e=2, group_size=16, sym=True)
    dst = tmp_path / "out" / "packed"
    dst.parent.mkdir()
    with pytest.raises(ConvertError, match=r"layer 0 \(model.layers.0.mlp\): int4 group_size=16: moepack has int4 layouts "
                                           r"for group sizes 32, 64, 128, -1"):  # fmt: skip
        moepack.convert(src, dst)
    assert not list(dst.parent.iterdir())
    # a corrupted zero point: refused at convert with the tensor named, nothing left behind
    src = tmp_path / "z"
    P.write_moe_checkpoint(src, "gptq", h=H, i=I, e=2, group_size=32, sym=False, version="gptq")
    sd = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.mlp.experts.1.down_proj.qzeros"
    sd[name] = torch.full_like(sd[name], -1)  # every nibble 15: v1 zero 16
    save_file(sd, str(src / "model.safetensors"))
    with pytest.raises(MoepackError, match=rf"{name}'\[\d+, \d+\]: zero point 16 is outside 0..15"):
        moepack.convert(src, dst)
    assert not list(dst.parent.iterdir())


@pytest.mark.parametrize("tensor,edit", [
    ("w2_zero", lambda t: t.view(-1).__setitem__(5, (int(t.view(-1)[5]) + 1) % 16)),
    ("w13_zero", lambda t: t.view(-1).__setitem__(0, (int(t.view(-1)[0]) + 3) % 16)),
    ("w13_perm", lambda t: t[1, :2].copy_(t[1, :2].flip(0))),
    ("shared_w13_perm", lambda t: t[0, 3:5].copy_(t[0, 3:5].flip(0))),
])  # fmt: skip
def test_verify_catches_a_tampered_zero_point_or_perm(tmp_path, tensor, edit):
    src, dst = tmp_path / "src", tmp_path / "packed"
    _write(src, "gptq_v2_asym_g32_actorder")
    moepack.convert(src, dst)
    assert moepack.verify(dst, source=src).ok
    full = f"moepack.layers.0.{tensor}"
    rewrite_tensor(dst, full, edit)  # the manifest's sha256 follows: only the source can tell
    report = moepack.verify(dst, source=src)
    assert not report.ok and all(t.ok for t in report.tensors)
    detail = " ".join(report.failures())
    assert f"tensor {full!r}" in detail and "packed values must equal it exactly" in detail, detail
    if tensor.endswith("perm"):
        assert "code column" in detail
