"""Whole NVFP4 models: convert -> verify --source -> load_model -> greedy tokens equal to
transformers' on the dequantized weights.

Two families NVIDIA ships in NVFP4, each a tiny seeded model with every quantized K a multiple of 16:
qwen3_moe (H = 64, I = 48, head_dim 32, 8 experts) and deepseek_v3 (H = 64, I = 48, MLA attention,
one dense layer before the MoE layer, a shared expert, grouped sigmoid routing with a correction
bias), each written in both flavours (nvfp4_writers.py): compressed-tensors ``nvfp4-pack-quantized``
by compressed-tensors 0.20.1 itself (every Linear but the router and lm_head: experts, the shared
expert, attention, the dense MLP), and ModelOpt NVFP4 by its formula with the attention quantized
too (config.json) or excluded (hf_quant_config.json). The oracle is
transformers' model carrying, for every NVFP4 Linear, the source library's own dequantization in
fp32 (compressed-tensors' ``dequantize``; the ModelOpt formula in vLLM's order). The packed
experts run in A16 (the checkpoint's exact meaning); A8 stays within SEMANTICS.md §4's bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moepack
import moepack.hf as hf
from tests.schemes.mxfp4.test_mxfp4_sources import float_checkpoint
from tests.schemes.nvfp4.nvfp4_writers import ct_decompress, modelopt_decode, write_ct_nvfp4, write_modelopt_nvfp4

PROMPT = [5, 77, 23, 101, 9, 64, 3, 120, 44, 17]
N_NEW = 12
# family: (config overrides of its fixture, MoE blocks, NVFP4 attention Linears, NVFP4 dense-MLP Linears)
FAMILIES = {
    "qwen3_moe": (dict(hidden_size=64, moe_intermediate_size=48, intermediate_size=64, head_dim=32), 2, 8, 0),
    "deepseek_v3": (dict(hidden_size=64, moe_intermediate_size=48, intermediate_size=64), 1, 8, 3),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> its three NVFP4 checkpoints (written once per module)."""
    cache = {}

    def get(family: str) -> dict[str, Path]:
        if family not in cache:
            root = tmp_path_factory.mktemp(f"nv_{family}")
            bf = float_checkpoint(root / "bf16", family, seed=11, **FAMILIES[family][0])
            out = {"ct": root / "ct", "mo": root / "mo", "mo_attn": root / "mo_attn"}
            write_ct_nvfp4(bf, out["ct"])
            write_modelopt_nvfp4(bf, out["mo"], exclude=["lm_head", "model.layers.*.self_attn.*"])
            write_modelopt_nvfp4(bf, out["mo_attn"], exclude=["lm_head"], in_config=True)
            cache[family] = out
        return cache[family]

    return get


def _oracle(src: Path, tmp: Path, flavour: str):
    """transformers' model of ``src`` with every NVFP4 Linear replaced by the source library's own
    fp32 dequantization, in fp32."""
    from transformers import AutoModelForCausalLM

    sd = load_file(str(src / "model.safetensors"))
    out = {}
    if flavour == "ct":
        mods = [n[: -len(".weight_packed")] for n in sd if n.endswith(".weight_packed")]
        drop = (".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale")
        out = {n: t.float() for n, t in sd.items() if not n.endswith(drop)}
        out.update({m + ".weight": ct_decompress(src, m, torch.float32) for m in mods})
    else:
        mods = [n[: -len(".weight_scale_2")] for n in sd if n.endswith(".weight_scale_2")]
        out = {n: t.float() for n, t in sd.items() if not n.endswith((".weight_scale", ".weight_scale_2", ".input_scale"))
               and n[: -len(".weight")] not in mods}  # fmt: skip
        out.update({m + ".weight": modelopt_decode(sd[m + ".weight"], sd[m + ".weight_scale"].view(torch.uint8), sd[m + ".weight_scale_2"])
                    for m in mods})  # fmt: skip
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()


def _same_tokens(model, oracle, tol: float = 1e-4):
    ours = hf.greedy_generate(model, PROMPT, N_NEW)
    ref = hf.greedy_generate(oracle, PROMPT, N_NEW)
    assert ours.tokens == ref.tokens
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(ours.logits, ref.logits))
    assert rel <= tol, rel
    return ours, ref


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("flavour,key,attn", [("ct", "ct", True), ("modelopt", "mo", False), ("modelopt", "mo_attn", True)])
def test_whole_nvfp4_model(tmp_path, made, family, flavour, key, attn):
    src = made(family)[key]
    _, blocks, n_attn, n_dense = FAMILIES[family]
    report = moepack.convert(src, tmp_path / "out")
    assert report.layout == "nv4g16_n32k8_x86"
    man = json.loads((tmp_path / "out" / "moepack.json").read_text())
    assert len(man["layers"]) == blocks
    assert all(e["scheme"] == "nvfp4" and e["act_mode"] == "a16" for e in man["layers"])
    assert all("activations run in 16 bits" in e["scheme_source"] for e in man["layers"])  # never in FP4
    if family == "deepseek_v3":  # its shared expert packed as NVFP4 beside the routed ones, its router's correction bias read
        assert all(e["shared"]["w13_global"] and e["router"]["correction_bias"] for e in man["layers"])
    v = moepack.verify(tmp_path / "out", source=src)
    assert v.ok, v.failures()
    assert all(x.weights_exact for x in v.layers)
    model = hf.load_model(tmp_path / "out", dtype=torch.float32)
    r = model.moepack_load
    assert len(r.dequantized) == (n_attn if attn else 0) + n_dense and set(r.dequantized.values()) <= {"nvfp4"}
    assert len(hf.packed_blocks(model)) == blocks
    _same_tokens(model, _oracle(src, tmp_path / "oracle", flavour))


def test_nvfp4_a8_runs_close_to_a16(tmp_path, made):
    src = made("qwen3_moe")["ct"]
    moepack.convert(src, tmp_path / "a8", act_mode="a8")
    assert moepack.verify(tmp_path / "a8", source=src).ok
    a8 = hf.greedy_generate(hf.load_model(tmp_path / "a8", dtype=torch.float32), PROMPT, N_NEW)
    ref = hf.greedy_generate(_oracle(src, tmp_path / "oracle", "ct"), PROMPT, N_NEW)
    rel = float((a8.logits[0] - ref.logits[0]).norm() / ref.logits[0].norm())
    assert 0 < rel < 0.05, rel
