"""A quantized checkpoint whose shared experts the recipe left in float (compressed-tensors'
``ignore``, ``modules_to_not_convert``, a GPTQ / AWQ file whose quantizer skipped them): convert
never changes the model unasked, so the shared expert stays float.

For an FP8 (compressed-tensors FP8_BLOCK), an int4 (compressed-tensors W4A16 and GPTQ), an
MXFP4 (compressed-tensors MXFP4A16) and an NVFP4 (compressed-tensors nvfp4-pack-quantized)
checkpoint of one tiny qwen2_moe, written by the libraries'
own compressors (tests/support/ct_writer.py) or tools/int4_packers.py, with the shared experts
kept BF16:

* the pack keeps the routed experts' codes and packs each shared expert in the float layout
  (``shared.layout_id``, format version 5), its tensors bit-equal to the source's BF16 values;
* the packed layer equals the checkpoint's meaning (transformers' block carrying the float
  shared expert as stored and the routed experts dequantized) within the fp32 reference
  tolerance, through ``moepack.open``, ``run_experts`` and ``load_model``; ``verify --source``
  passes it and ``inspect`` shows the shared expert's layout;
* ``--quantize <the source's scheme>`` is the one way to quantize it (recorded as the shared
  expert's ``quantizer``), and its layer is measurably further from the checkpoint's meaning;
* a pack that quantized the float shared expert without a recorded quantizer (moepack before
  this rule) fails ``verify --source`` by name;
* an F16 shared expert kept float is packed when every value has a bf16 form and refused, naming
  the tensor and element, when one has none (nothing written).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moepack
from moepack.errors import MoepackError
from moepack.pack import unpack_codes
from moepack.sources import open_source
from tests.reference.tolerances import TOL, assert_close
from tests.schemes.mxfp4.test_mxfp4_sources import float_checkpoint
from tests.support.ct_writer import CT_KEEP, write_ct_checkpoint
from tests.support.fixtures_util import moe_block, route
from tests.support.packdir_edit import reseal

F32 = torch.float32
SHAPE = dict(hidden_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=128, intermediate_size=128,
             num_experts=4, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
KEEP_SHARED = re.compile(CT_KEEP.pattern + r"|\.shared_expert\.")
IGNORE = ["lm_head", "re:.*shared_expert[.].*"]


def _amax(preset: str):
    def fn(mod):
        w = mod.weight.float()
        if preset == "FP8_BLOCK":
            bn, bk = mod.quantization_scheme.weights.block_structure
            sh = tuple(mod.weight_scale.shape)
            pad = torch.zeros(sh[0] * bn, sh[1] * bk)
            pad[: w.shape[0], : w.shape[1]] = w
            return pad.unflatten(0, (sh[0], bn)).unflatten(2, (sh[1], bk)).abs().amax(dim=(1, 3))
        g = 32 if preset == "MXFP4A16" else 128
        return w.abs().unflatten(1, (-1, g)).amax(-1)

    return fn


# name -> (how it is written, the scheme it packs into, its layout)
SOURCES = {
    "ct_fp8_block": ("FP8_BLOCK", "fp8_block", "f8g128_n32k2_x86"),
    "ct_w4a16": ("W4A16", "int4_group", "u4g128_n32k8_x86"),
    "ct_mxfp4": ("MXFP4A16", "mxfp4", "mx4g32_n32k8_x86"),
    "gptq": ("gptq", "int4_group", "u4g128_n32k8_x86"),
    "ct_nvfp4": ("nvfp4", "nvfp4", "nv4g16_n32k8_x86"),
}


def _float_shared_nvfp4(src: Path, d: Path) -> None:
    """compressed-tensors' own nvfp4-pack-quantized checkpoint of ``src`` (tests/schemes/nvfp4/
    nvfp4_writers.py), then its shared experts put back as the float source stores them and named
    in the recipe's ``ignore``, as a recipe that left them float writes it."""
    from tests.schemes.nvfp4.nvfp4_writers import write_ct_nvfp4

    write_ct_nvfp4(src, d)
    fsd = load_file(str(src / "model.safetensors"))
    sd = {n: t for n, t in load_file(str(d / "model.safetensors")).items() if ".shared_expert." not in n}
    sd.update({n: t for n, t in fsd.items() if ".shared_expert." in n})
    save_file({k: sd[k] for k in sorted(sd)}, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = list(cfg["quantization_config"].get("ignore") or []) + IGNORE
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def _float_shared_gptq(src: Path, d: Path) -> None:
    """GPTQ (v1, symmetric, g128) of ``src`` by tests/sources/test_quantized_models.py, then its
    shared experts put back as the float source stores them (a quantizer that skipped them)."""
    from tests.sources.test_quantized_models import quantize_checkpoint

    quantize_checkpoint(src, d, "gptq", group_size=128, sym=True)
    fsd = load_file(str(src / "model.safetensors"))
    files = sorted(d.glob("*.safetensors"))
    for f in files:
        sd = load_file(str(f))
        for n in [n for n in sd if ".shared_expert." in n]:
            del sd[n]
        if f == files[0]:
            sd.update({n: t for n, t in fsd.items() if ".shared_expert." in n})
        save_file(sd, str(f), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("float_shared")
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            d = root / name
            if name == "bf16":
                float_checkpoint(d, "qwen2_moe", seed=5, **SHAPE)
            elif name == "gptq":
                _float_shared_gptq(get("bf16"), d)
            elif name == "ct_nvfp4":
                _float_shared_nvfp4(get("bf16"), d)
            else:
                preset = SOURCES[name][0]
                write_ct_checkpoint(get("bf16"), d, preset, _amax(preset), keep=KEEP_SHARED, ignore=IGNORE)
            made[name] = d
        return made[name]

    return get


@pytest.fixture(scope="module")
def packed(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("float_shared_packed")
    made = {}

    def get(name: str, quantize: str | None = None) -> Path:
        key = (name, quantize)
        if key not in made:
            made[key] = root / (name + ("_q" if quantize else ""))
            moepack.convert(sources(name), made[key], quantize=quantize)
        return made[key]

    return get


def _state(src: Path) -> dict:
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def _meaning(src: Path):
    """The checkpoint's meaning: transformers' qwen2_moe (fp32) whose MoE blocks carry the routed
    experts dequantized (the reader's float view, which tests/schemes/*/test_*_sources.py hold to
    the quantization libraries' own decompression) and the shared expert, its gate and the router
    exactly as the checkpoint stores them."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=F32, experts_implementation="eager").eval()
    sd = _state(src)
    ckpt, reader = open_source(src)
    for spec in reader.layers(ckpt):
        block, _ = moe_block(model, spec.index)
        canon = reader.read_layer(ckpt, spec)
        p = spec.prefix
        with torch.no_grad():
            ex = block.experts
            ex.gate_up_proj.copy_(canon.w13.float() if ex.gate_up_proj.shape == canon.w13.shape else canon.w13.float().transpose(1, 2))
            ex.down_proj.copy_(canon.w2.float() if ex.down_proj.shape == canon.w2.shape else canon.w2.float().transpose(1, 2))
            block.gate.weight.copy_(sd[f"{p}.gate.weight"].float())
            for q in ("gate_proj", "up_proj", "down_proj"):
                getattr(block.shared_expert, q).weight.copy_(sd[f"{p}.shared_expert.{q}.weight"].float())
            block.shared_expert_gate.weight.copy_(sd[f"{p}.shared_expert_gate.weight"].float())
    return model


def _layer_errors(src: Path, dst: Path) -> dict[int, float]:
    """Each packed layer's relative error against the checkpoint's meaning (13 seeded tokens)."""
    model = _meaning(src)
    pm = moepack.open(dst)
    g = torch.Generator().manual_seed(3)
    out = {}
    for idx, layer in pm.layers.items():
        block, run = moe_block(model, idx)
        x = torch.randn(13, layer.hidden_size, generator=g)
        y = run(x)
        got = layer(x, route(block, x)[0].float())
        assert_close(got, y, TOL["scalar_vs_reference", F32], f"{dst.name} layer {idx} vs the checkpoint's meaning")
        out[idx] = float((got.double() - y.double()).norm() / y.double().norm())
    return out


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_float_shared_expert_stays_float(sources, packed, name):
    src, dst = sources(name), packed(name)
    _, scheme, layout = SOURCES[name]
    m = json.loads((dst / "moepack.json").read_text())
    assert m["format_version"] == 6  # (sealed; version 5 brought the shared layout)
    sd = _state(src)
    pm = moepack.open(dst)
    for x in m["layers"]:
        assert x["scheme"] == scheme and moepack.layout_get(x["layout_id"]).name == layout and x["quantizer"] is None
        sh = x["shared"]
        slay = moepack.layout_get(sh["layout_id"])
        assert slay.name == "bf16_n32k2_x86" and sh["scheme_source"] == "BF16 weights packed as bf16" and "quantizer" not in sh
        layer = pm.layers[x["index"]]
        assert layer.shared.layout is slay and layer.packed.layout.name == layout
        # bit for bit: the pack's shared w13 (gate rows, then up rows at the padded offset) and w2
        si, h, ip = sh["intermediate"], x["hidden"], sh["padded_intermediate"]
        w13 = unpack_codes(slay, pm.tensor(sh["w13"]))[0]
        w2 = unpack_codes(slay, pm.tensor(sh["w2"]))[0]
        p = x["prefix"] + ".shared_expert."
        for got, want in ((w13[:si, :h], sd[p + "gate_proj.weight"]), (w13[ip:ip + si, :h], sd[p + "up_proj.weight"]),
                          (w2[:h, :si], sd[p + "down_proj.weight"])):  # fmt: skip
            assert want.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert not w13[si:ip].any() and not w13[ip + si:].any() and not w13[:, h:].any() and not w2[h:].any() and not w2[:, si:].any()
    report = moepack.verify(dst, source=src)
    assert report.ok, report.failures()
    assert all(c.shared_exact and c.weights_exact for c in report.layers)
    js = json.loads(_cli("inspect", dst, "--json").output)
    assert {(x["shared"]["layout"], x["shared"]["scheme"]) for x in js["layers"]} == {("bf16_n32k2_x86", "dense")}
    out = " ".join(_cli("inspect", dst).output.split())
    assert "shared experts: layout bf16_n32k2_x86 (BF16 weights packed as bf16)" in out, out


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_layer_equals_the_checkpoint_meaning_and_quantize_is_the_one_way(sources, packed, name, capsys):
    """The layer within fp32 reference tolerance of the checkpoint's meaning; ``--quantize`` of
    the source's scheme quantizes the shared expert (recorded, verify passes it as asked), which
    moves the layer measurably away from that meaning."""
    src = sources(name)
    kept = _layer_errors(src, packed(name))
    scheme = SOURCES[name][1]
    q = packed(name, scheme)
    m = json.loads((q / "moepack.json").read_text())
    for x in m["layers"]:
        assert "layout_id" not in x["shared"] and x["shared"]["quantizer"].split(":")[0] == scheme
        assert x["shared"]["scheme_source"].startswith("quantized by moepack from BF16")
    assert m["format_version"] == 6
    report = moepack.verify(q, source=src)
    assert report.ok, report.failures()
    model = _meaning(src)
    pm = moepack.open(q)
    g = torch.Generator().manual_seed(3)
    quantized = {}
    for idx, layer in pm.layers.items():
        block, run = moe_block(model, idx)
        x = torch.randn(13, layer.hidden_size, generator=g)
        y = run(x)
        got = layer(x, route(block, x)[0].float())
        quantized[idx] = float((got.double() - y.double()).norm() / y.double().norm())
    with capsys.disabled():
        print(f"\n{name}: layer rel. error vs the checkpoint's meaning: shared kept float "
              f"{max(kept.values()):.2e}, shared quantized (--quantize {scheme}) {max(quantized.values()):.2e}")
    assert max(kept.values()) < 1e-5 < min(quantized.values())


def test_run_experts_and_load_model_use_the_float_shared_expert(sources, packed):
    """``run_experts`` on the layer's shared pack is the float expert (its own layout, a16), and
    ``load_model`` runs the same block as ``moepack.open``."""
    src, dst = sources("ct_w4a16"), packed("ct_w4a16")
    pm = moepack.open(dst)
    layer = pm.layers[0]
    sd = _state(src)
    p = layer.prefix + ".shared_expert."
    x = torch.randn(5, layer.hidden_size, generator=torch.Generator().manual_seed(1))
    g, u, d = (sd[p + q + ".weight"].float() for q in ("gate_proj", "up_proj", "down_proj"))
    want = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
    ones, ids = torch.ones(5, 1), torch.zeros(5, 1, dtype=torch.int32)
    got = moepack.run_experts(layer.shared, x, ones, ids)
    assert_close(got, want, TOL["scalar_vs_reference", F32], "run_experts on the float shared expert")
    # a W4A8 call of the layer runs the float shared expert in its own (a16) mode
    assert layer.shared_act_mode("a8") == "a16" and layer.shared_act_mode(None) == "a16"
    model = moepack.load_model(dst, dtype=F32)
    blk = model.model.layers[0].mlp
    with torch.no_grad():
        y = blk(x[None])
    y = y[0] if isinstance(y, tuple) else y
    assert_close(y.reshape(5, -1), layer(x), TOL["scalar_vs_reference", F32], "load_model's block vs moepack.open's layer")


def test_an_older_pack_that_quantized_it_unasked_fails_verify(sources, packed, tmp_path):
    """A pack whose float shared expert was quantized with no quantizer recorded (what moepack
    wrote before this rule) fails ``verify --source``, naming the layer and the rule."""
    src = sources("ct_fp8_block")
    d = tmp_path / "old"
    shutil.copytree(packed("ct_fp8_block", "fp8_block"), d)
    m = json.loads((d / "moepack.json").read_text())
    for x in m["layers"]:
        del x["shared"]["quantizer"]
    (d / "moepack.json").write_text(json.dumps(reseal(m), indent=1))
    report = moepack.verify(d, source=src)
    assert not report.ok
    fails = " ".join(report.failures())
    assert "layer 0 shared expert: the source's is float (BF16" in fails and "with no quantizer recorded" in fails, fails


def test_f16_shared_expert_packed_when_exact_refused_when_not(sources, tmp_path):
    """An F16 float shared expert is packed (as bf16) only when every value has a bf16 form;
    otherwise refused naming the tensor, the element and the rule, with nothing written."""
    base = sources("ct_mxfp4")
    src = tmp_path / "f16"
    shutil.copytree(base, src)
    sd = load_file(str(src / "model.safetensors"))
    for n in [n for n in sd if ".shared_expert." in n]:
        sd[n] = sd[n].to(torch.float16)  # bf16 values of moderate size: exact in f16
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    moepack.convert(src, tmp_path / "ok")
    report = moepack.verify(tmp_path / "ok", source=src)
    assert report.ok and all(c.shared_exact for c in report.layers), report.failures()
    name = "model.layers.1.mlp.shared_expert.down_proj.weight"
    sd[name][3, 5] = 0.1  # no bf16 form
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MoepackError) as ei:
        moepack.convert(src, tmp_path / "bad")
    msg = str(ei.value)
    assert f"shared-expert tensor {name!r} is F16" in msg and "at [3, 5] has no bf16 form" in msg and "--quantize mxfp4" in msg, msg
    assert not (tmp_path / "bad").exists()
    moepack.convert(src, tmp_path / "q", quantize="mxfp4")  # asked: quantized
    assert moepack.verify(tmp_path / "q", source=src).ok


def test_a_quantized_shared_expert_keeps_its_scheme(tmp_path, sources):
    """The opposite case: a shared expert the checkpoint quantized stays in its scheme, in the
    layer's layout (no layout_id, format version 2), its codes as stored."""
    d = tmp_path / "ct"
    write_ct_checkpoint(sources("bf16"), d, "W4A16", _amax("W4A16"))
    moepack.convert(d, tmp_path / "p")
    m = json.loads((tmp_path / "p" / "moepack.json").read_text())
    assert m["format_version"] == 6
    for x in m["layers"]:
        assert "layout_id" not in x["shared"] and "w13_scale" in x["shared"] and "quantizer" not in x["shared"]
    report = moepack.verify(tmp_path / "p", source=d)
    assert report.ok and all(c.shared_exact for c in report.layers), report.failures()


def test_cli_convert_says_what_it_did_with_the_shared_experts(sources, tmp_path):
    r = _cli("convert", sources("ct_mxfp4"), tmp_path / "a", "--json")
    assert r.exit_code == 0, r.output
    js = json.loads(r.output)
    assert js["shared_float_layers"] == [0, 1] and js["shared_layout"] == "bf16_n32k2_x86" and js["shared_quantizer"] is None
    r = _cli("convert", sources("ct_mxfp4"), tmp_path / "b", "--quantize", "mxfp4")
    out = " ".join(r.output.split())
    assert r.exit_code == 0 and "float in the source: quantized as asked (mxfp4)" in out, r.output
    r = _cli("convert", sources("ct_mxfp4"), tmp_path / "c")
    out = " ".join(r.output.split())
    assert "float in the source: kept float, layout bf16_n32k2_x86" in out, r.output
    assert "(layers 0, 1); --quantize mxfp4 would quantize them" in out, r.output


def _edit(src: Path, d: Path, fn) -> Path:
    shutil.copytree(src, d)
    m = json.loads((d / "moepack.json").read_text())
    fn(m)
    (d / "moepack.json").write_text(json.dumps(reseal(m), indent=1))
    return d


@pytest.mark.parametrize("what,edit,words", [
    ("an older version", lambda m: m.update(format_version=4),
     "layers[0].shared.layout_id=1 (layer 0): a shared expert in a layout other than its layer's (mx4g32_n32k8_x86) needs "
     "format_version 5 (the file says 4)"),
    ("an undescribed layout", lambda m: m["layouts"].pop("1"),
     "layers[0].shared.layout_id=1 (layer 0): is not described in the manifest's 'layouts' (['9'])"),
    ("another family's layout", lambda m: [x["shared"].update(layout_id=10) for x in m["layers"]] and m["layouts"].update(
        {"10": moepack.layout_get(10).to_dict()}),
     "layout bf16_n16k4_arm is of the arm family, the layer's mx4g32_n32k8_x86 of x86"),
    ("the layer's layout named with float tensors", lambda m: [x["shared"].update(layout_id=9) for x in m["layers"]],
     "layers[0].shared.w13: layer 0: shared tensor 'moepack.layers.0.shared_w13' is bfloat16 [1, 256, 128], layout math "
     "says uint8 [1, 256, 64]"),
], ids=["older-version", "undescribed", "other-family", "float-tensors-in-the-layer-layout"])  # fmt: skip
def test_the_manifest_rules_of_a_shared_layout(packed, tmp_path, what, edit, words):
    """Version 5's one new key, ``shared.layout_id``: described, of the layer's family, only in
    version 5, and the shared tensors must be that layout's; each break refused in one line."""
    d = _edit(packed("ct_mxfp4"), tmp_path / "p", edit)
    with pytest.raises(MoepackError) as ei:
        moepack.open(d)
    assert words in str(ei.value), str(ei.value)


def test_a_tp_pack_keeps_the_float_shared_expert_and_version_5(sources, packed, tmp_path):
    """``convert --tp 2``: the routed experts sliced, the float shared expert whole in its own
    layout, format version 6 (5 brought the shared layout); each layer equals the whole pack's."""
    moepack.convert(sources("ct_mxfp4"), tmp_path / "tp", tp=2)
    m = json.loads((tmp_path / "tp" / "moepack.json").read_text())
    assert m["format_version"] == 6 and m["tp"] == 2
    assert all(moepack.layout_get(x["shared"]["layout_id"]).name == "bf16_n32k2_x86" for x in m["layers"])
    whole, tp = moepack.open(packed("ct_mxfp4")), moepack.open(tmp_path / "tp")
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(2))
    for idx, layer in whole.layers.items():
        assert_close(tp.layers[idx](x), layer(x), TOL["scalar_vs_reference", F32], f"--tp 2 layer {idx}")
    assert moepack.verify(tmp_path / "tp", source=sources("ct_mxfp4")).ok


def _cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])
