"""The NVFP4 source readers (moepack/sources/nvfp4.py) against independent oracles.

* compressed-tensors ``nvfp4-pack-quantized`` (FORMATS.md §3.4, §5.5): a tiny qwen2_moe (routed and
  shared experts, attention) compressed by compressed-tensors 0.20.1 itself (nvfp4_writers.py):
  the reader's canonical tensors decoded by moepack equal the library's own decompression bit for
  bit (its bf16 ``decompress`` and its fp32 ``dequantize``), experts, shared expert and the carried
  attention Linears (moepack/sources/linears.py) alike;
* ModelOpt NVFP4 (§5.5): the same model written per ModelOpt's formula with ``exclude_modules``:
  equal to the formula in vLLM's order; the config in hf_quant_config.json or in config.json;
* every refusal: NaN and negative e4m3 scales with their index, a zero / negative / NaN global
  scale, a group size other than 16, shapes that disagree, formats that are not NVFP4, experts
  the config leaves unquantized; each one line, and convert leaves nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import moepack
from moepack.errors import MoepackError
from moepack.schemes.nvfp4 import dequantize_nvfp4
from moepack.sources import linears, open_source
from tests.schemes.mxfp4.test_mxfp4_sources import float_checkpoint
from tests.schemes.nvfp4.nvfp4_writers import ct_decompress, write_ct_nvfp4, write_modelopt_nvfp4
from tests.support.ckpt_edit import copy_checkpoint, edit_config, edit_tensors

QWEN2 = dict(hidden_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=32, intermediate_size=64, num_experts=3)
ATTN = "model.layers.*.self_attn.*"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvsrc")
    bf = float_checkpoint(root / "bf16", "qwen2_moe", seed=7, **QWEN2)
    d = {"bf16": bf, "ct": root / "ct", "mo": root / "mo", "mo_cfg": root / "mo_cfg"}
    write_ct_nvfp4(bf, d["ct"])
    d["mo_want"] = write_modelopt_nvfp4(bf, d["mo"], exclude=["lm_head", ATTN])
    write_modelopt_nvfp4(bf, d["mo_cfg"], exclude=["lm_head"], in_config=True)
    return d


def _modules(d: Path, suffix: str) -> list[str]:
    return sorted(n[: -len(suffix)] for n in load_file(str(d / "model.safetensors")) if n.endswith(suffix))


def test_ct_reader_equals_compressed_tensors_decompress(sources):
    src = sources["ct"]
    ckpt, reader = open_source(src)
    assert reader.name == "compressed-tensors-nvfp4-pack-quantized" and reader.scheme == "nvfp4"
    specs = reader.layers(ckpt)
    assert len(specs) == 2 and all(s.quant.format == "nvfp4-pack-quantized" and s.quant.shared is not None for s in specs)
    for s in specs:
        for e in range(s.num_experts):
            for w, roles in (("w13", ("gate", "up")), ("w2", ("down",))):
                c = reader.read_expert_canonical(ckpt, s, w, e)
                deq = dequantize_nvfp4(c[f"{w}_q"], c[f"{w}_scale"], c[f"{w}_global"])
                mods = [s.names[(e, r, "module")] for r in roles]
                assert torch.equal(deq, torch.cat([ct_decompress(src, m, torch.float32) for m in mods]))
                assert torch.equal(deq.to(torch.bfloat16), torch.cat([ct_decompress(src, m) for m in mods]))
                assert (c[f"{w}_global"] > 0).all()  # compressed-tensors' divisor, as stored
        sh = reader.read_shared_canonical(ckpt, s)
        g, u, dn = s.shared["modules"]
        assert torch.equal(dequantize_nvfp4(sh["w13_q"][0], sh["w13_scale"][0], sh["w13_global"][0]),
                           torch.cat([ct_decompress(src, g, torch.float32), ct_decompress(src, u, torch.float32)]))
        assert torch.equal(dequantize_nvfp4(sh["w2_q"][0], sh["w2_scale"][0], sh["w2_global"][0]), ct_decompress(src, dn, torch.float32))


def test_ct_carried_attention_linears_equal_the_library(sources):
    src = sources["ct"]
    ckpt, reader = open_source(src)
    consumed = {t for s in reader.layers(ckpt) for t in s.expert_tensors}
    view = linears.CarriedView(ckpt, [n for n in ckpt.tensors if n not in consumed])
    lins = linears.find_linears(view)
    attn = {p for p in lins if ".self_attn." in p}
    assert len(attn) == 8 and {lins[p].codec for p in lins} == {"nvfp4"}
    for p in attn:
        assert torch.equal(linears.dequantize_linear(view, lins[p]), ct_decompress(src, p, torch.float32))


@pytest.mark.parametrize("which", ["mo", "mo_cfg"])
def test_modelopt_reader_equals_the_formula(sources, which):
    src = sources[which]
    ckpt, reader = open_source(src)
    assert reader.name == "modelopt-nvfp4"
    sd = load_file(str(src / "model.safetensors"))
    from tests.schemes.nvfp4.nvfp4_writers import modelopt_decode

    for s in reader.layers(ckpt):
        assert s.quant.format == "modelopt" and s.quant.shared is not None
        for e in range(s.num_experts):
            c = reader.read_expert_canonical(ckpt, s, "w13", e)
            assert (c["w13_global"] < 0).all()  # ModelOpt's multiplier, negated
            mods = [s.names[(e, r, "module")] for r in ("gate", "up")]
            want = torch.cat([modelopt_decode(sd[m + ".weight"], sd[m + ".weight_scale"].view(torch.uint8), sd[m + ".weight_scale_2"])
                              for m in mods])  # fmt: skip
            assert torch.equal(dequantize_nvfp4(c["w13_q"], c["w13_scale"], c["w13_global"]), want)
            assert torch.equal(reader.read_expert_w2(ckpt, s, e), sources["mo_want"][s.names[(e, "down", "module")]]) if which == "mo" else True
    consumed = {t for s in reader.layers(ckpt) for t in s.expert_tensors}
    lins = linears.find_linears(linears.CarriedView(ckpt, [n for n in ckpt.tensors if n not in consumed]))
    attn = [p for p in lins if ".self_attn." in p]
    assert len(attn) == (0 if which == "mo" else 8) and {lins[p].codec for p in lins} == {"nvfp4"}  # attention excluded / not
    for p in attn:
        want = modelopt_decode(sd[p + ".weight"], sd[p + ".weight_scale"].view(torch.uint8), sd[p + ".weight_scale_2"])
        assert torch.equal(linears.dequantize_linear(linears.CarriedView(ckpt, list(ckpt.tensors)), lins[p]), want)


def _refused(tmp_path: Path, src: Path, words: list[str]) -> None:
    """The reader refuses ``src`` in one line holding ``words`` (a carried Linear's values: convert
    only), and so does convert, which leaves nothing behind."""
    if "self_attn" not in words[0]:
        with pytest.raises(MoepackError) as ei:
            ckpt, reader = open_source(src)
            for s in reader.layers(ckpt):
                reader.read_layer(ckpt, s)
                reader.read_shared(ckpt, s)
        msg = str(ei.value)
        assert "\n" not in msg
        for w in words:
            assert w in msg, f"{w!r} not in {msg}"
    with pytest.raises(MoepackError) as ei2:
        moepack.convert(src, tmp_path / "dst")
    for w in words:
        assert w in str(ei2.value), f"{w!r} not in {ei2.value}"
    assert "\n" not in str(ei2.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "a refused convert leaves nothing behind"


def _set(name, idx, value, view=None):
    def fn(sd):
        t = sd[name].clone()
        (t.view(view) if view else t)[idx] = value
        sd[name] = t

    return fn


E0 = "model.layers.1.mlp.experts.2.up_proj"
BAD_CT = {
    "nan scale": (_set(E0 + ".weight_scale", (5, 2), 0x7F, torch.uint8), [f"'{E0}.weight_scale'[5, 2] = 0x7f: an e4m3 NaN scale"]),
    "negative scale": (_set(E0 + ".weight_scale", (1, 3), 0xC0, torch.uint8),
                       [f"'{E0}.weight_scale'[1, 3] = 0xc0 (-2.0): a negative e4m3 scale"]),
    "zero global": (_set(E0 + ".weight_global_scale", 0, 0.0), [f"'{E0}.weight_global_scale' = 0.0: an NVFP4 global scale must be finite and positive"]),
    "negative global": (_set(E0 + ".weight_global_scale", 0, -3.0), ["= -3.0: an NVFP4 global scale must be finite and positive"]),
    "nan global": (_set(E0 + ".weight_global_scale", 0, float("nan")), ["= nan: an NVFP4 global scale"]),
    "scale shape": (lambda sd: sd.update({E0 + ".weight_scale": sd[E0 + ".weight_scale"][:, :-1].contiguous()}),
                    [f"'{E0}.weight_scale' has shape [48, 3]: expected [48, 4]"]),
    "global missing": (lambda sd: sd.pop(E0 + ".weight_global_scale"), [f"has no '{E0}.weight_global_scale'"]),
    "attention nan scale": (_set("model.layers.0.self_attn.q_proj.weight_scale", (0, 0), 0xFF, torch.uint8),
                            ["'model.layers.0.self_attn.q_proj.weight_scale'[0, 0] = 0xff: an e4m3 NaN scale"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CT))
def test_ct_bad_tensors_are_refused_by_name(tmp_path, sources, case):
    edit, words = BAD_CT[case]
    src = copy_checkpoint(sources["ct"], tmp_path / "src")
    edit_tensors(src, edit)
    _refused(tmp_path, src, words)


def _group(fn):
    return lambda c: fn(c["quantization_config"]["config_groups"]["group_0"]["weights"])


BAD_CT_CONFIG = {
    "group 32": (_group(lambda w: w.update(group_size=32)), ["group_size=32: NVFP4 has one e4m3 scale per group of 16"]),
    "strategy": (_group(lambda w: w.update(strategy="group")), ["strategy='group': NVFP4 weights are strategy 'tensor_group'"]),
    "8 bits": (_group(lambda w: w.update(num_bits=8)), ["num_bits=8, type='float': NVFP4 weights are 4-bit float"]),
    "experts ignored": (lambda c: c["quantization_config"].update(ignore=["re:.*mlp[.]experts[.]1[.].*"]),
                        ["is NVFP4, but the config leaves 'model.layers.0.mlp.experts.1.gate_proj' unquantized"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_CT_CONFIG))
def test_ct_bad_configs_are_refused(tmp_path, sources, case):
    edit, words = BAD_CT_CONFIG[case]
    src = copy_checkpoint(sources["ct"], tmp_path / "src")
    edit_config(src, edit)
    _refused(tmp_path, src, words)


M0 = "model.layers.0.mlp.experts.1.down_proj"
BAD_MO = {
    "zero scale_2": (_set(M0 + ".weight_scale_2", (), 0.0), [f"'{M0}.weight_scale_2' = 0.0: an NVFP4 global scale must be finite and positive"]),
    "inf scale_2": (_set(M0 + ".weight_scale_2", (), float("inf")), ["= inf: an NVFP4 global scale"]),
    "negative scale": (_set(M0 + ".weight_scale", (7, 1), 0xB0, torch.uint8), [f"'{M0}.weight_scale'[7, 1] = 0xb0 (-0.5): a negative"]),
    "packed shape": (lambda sd: sd.update({M0 + ".weight": sd[M0 + ".weight"][:, :-8].contiguous()}),
                     [f"'{M0}.weight_scale' has shape [64, 3]: expected [64, 2]"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_MO))
def test_modelopt_bad_tensors_are_refused_by_name(tmp_path, sources, case):
    edit, words = BAD_MO[case]
    src = copy_checkpoint(sources["mo"], tmp_path / "src")
    edit_tensors(src, edit)
    _refused(tmp_path, src, words)


def test_modelopt_bad_configs_are_refused(tmp_path, sources):
    src = copy_checkpoint(sources["mo"], tmp_path / "src")
    q = json.loads((src / "hf_quant_config.json").read_text())
    q["quantization"]["group_size"] = 32
    (src / "hf_quant_config.json").write_text(json.dumps(q))
    _refused(tmp_path, src, ["hf_quant_config.json group_size=32: NVFP4 has one e4m3 scale per group of 16"])
    q["quantization"].update(group_size=16, exclude_modules=["lm_head", "model.layers.1.mlp.experts.*"])
    (src / "hf_quant_config.json").write_text(json.dumps(q))
    _refused(tmp_path, src, ["is NVFP4, but the config leaves 'model.layers.1.mlp.experts.0.gate_proj' unquantized "
                             "('model.layers.1.mlp.experts.*')"])  # fmt: skip
    q["quantization"].update(exclude_modules=["lm_head"], quant_algo="FP8")
    (src / "hf_quant_config.json").write_text(json.dumps(q))
    _refused(tmp_path, src, ["ModelOpt quant_algo='FP8'"])
