"""Whole MXFP4 models: convert -> verify --source -> load_model -> greedy tokens equal to
transformers' on the same weights.

* gpt-oss MXFP4 (tools/mxfp4_checkpoint.py of a tiny gpt_oss model: E = 3, H = 64, I = 96, a
  sliding and a full attention layer with sinks, router bias, swiglu_limit 1.5 and swiglu_alpha 1.2
  from the config so that the clamp binds): the oracle is transformers' own MXFP4 loader on the
  same directory (``Mxfp4Config(dequantize=True)``, its CPU path), in fp32; the packed experts run
  in A16 (the checkpoint's exact meaning) and in opt-in A8; ``moepack generate`` too.
* compressed-tensors mxfp4-pack-quantized (a tiny qwen2_moe written by compressed-tensors 0.20.1:
  routed and shared experts and the attention Linears in MXFP4): the attention Linears are
  dequantized on load (codec mxfp4), the experts packed; the oracle is transformers' model on the
  library's own decompression of every Linear; and fixtures/qwen3_moe (H = 72, I = 40) in the same
  format with partial last groups, written by hand (the library only compresses K multiples of 32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import transformers

import moepack  # noqa: E402
import moepack.hf as hf  # noqa: E402
from tests.support.fixtures_util import fixture_dir  # noqa: E402
from tests.schemes.mxfp4.test_mxfp4_sources import MX, QWEN2, ct_oracle, float_checkpoint, write_ct_mxfp4, write_ragged_ct_mxfp4  # noqa: E402

PROMPT = [5, 77, 23, 101, 9, 64, 3, 120, 44, 17]
N_NEW = 12
GPT_OSS = dict(hidden_size=64, intermediate_size=96, head_dim=32, num_local_experts=3, swiglu_limit=1.5, swiglu_alpha=1.2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxmodel")
    out = {"gpt_oss": root / "gpt_oss", "qwen2": root / "qwen2_mx"}
    MX.write_mxfp4_checkpoint(float_checkpoint(root / "gpt_oss_bf16", "gpt_oss", seed=3, **GPT_OSS), out["gpt_oss"])
    write_ct_mxfp4(float_checkpoint(root / "qwen2_bf16", "qwen2_moe", seed=4, **QWEN2), out["qwen2"])
    return out


def _hf_mxfp4(d: Path):
    """transformers' own reading of a gpt-oss MXFP4 directory (dequantized on the CPU), fp32."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(str(d), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32).eval()


def _same_tokens(model, oracle, tol: float = 1e-4):
    ours = hf.greedy_generate(model, PROMPT, N_NEW)
    ref = hf.greedy_generate(oracle, PROMPT, N_NEW)
    assert ours.tokens == ref.tokens
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(ours.logits, ref.logits))
    assert rel <= tol, rel
    return ours, ref


def test_whole_gpt_oss_mxfp4_model(tmp_path, dirs):
    src = dirs["gpt_oss"]
    report = moepack.convert(src, tmp_path / "out")
    assert report.layout == "mx4g32_n32k8_x86"
    man = json.loads((tmp_path / "out" / "moepack.json").read_text())
    for entry in man["layers"]:
        assert entry["scheme"] == "mxfp4" and entry["interleaved"] is True and entry["activation"] == "swigluoai"
        assert (entry["alpha"], entry["limit"]) == (1.2, 1.5) and entry["act_mode"] == "a16" and entry["source_dtype"] == "E2M1"
    carried = set(man["tensors"])
    assert not any(n.endswith(("_blocks", "_scales")) for n in carried)  # packed, not carried
    assert {"model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias", "model.embed_tokens.weight"} <= carried
    v = moepack.verify(tmp_path / "out", source=src)
    assert v.ok, v
    model = hf.load_model(tmp_path / "out", dtype=torch.float32)
    assert model.moepack_load.dequantized == {}  # gpt-oss keeps every non-expert tensor in float
    assert len(hf.packed_blocks(model)) == 2
    _same_tokens(model, _hf_mxfp4(src))


def test_gpt_oss_mxfp4_a8_runs_close_to_a16(tmp_path, dirs):
    """The opt-in A8 mode (per-token int8 activations, e2m1 x 2 as exact integers): convert records
    it, verify checks it against the scheme's A8 reference, and the whole model's logits stay close
    to the exact A16 ones."""
    src = dirs["gpt_oss"]
    moepack.convert(src, tmp_path / "a8", act_mode="a8")
    man = json.loads((tmp_path / "a8" / "moepack.json").read_text())
    assert {e["act_mode"] for e in man["layers"]} == {"a8"}
    assert moepack.verify(tmp_path / "a8", source=src).ok
    a8 = hf.greedy_generate(hf.load_model(tmp_path / "a8", dtype=torch.float32), PROMPT, N_NEW)
    ref = hf.greedy_generate(_hf_mxfp4(src), PROMPT, N_NEW)
    rel = float((a8.logits[0] - ref.logits[0]).norm() / ref.logits[0].norm())  # the prompt's logits (same inputs)
    assert 0 < rel < 0.05, rel  # 0.012 measured (SEMANTICS.md §4 bounds A8 layers at 3e-2)


def test_generate_cli_on_a_gpt_oss_mxfp4_pack(tmp_path, dirs):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    src = dirs["gpt_oss"]
    moepack.convert(src, tmp_path / "out")
    res = CliRunner().invoke(app, ["generate", str(tmp_path / "out"), "--prompt-ids", ",".join(map(str, PROMPT)),
                                   "--max-new-tokens", "6", "--dtype", "float32", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["tokens"] == hf.greedy_generate(_hf_mxfp4(src), PROMPT, 6).tokens


def _oracle_model(d: Path, weights: dict, tmp: Path):
    """transformers' model of the compressed-tensors checkpoint ``d`` carrying ``weights`` ({module:
    fp32 weight}) for its MXFP4 Linears, in fp32."""
    from transformers import AutoModelForCausalLM

    sd = load_file(str(d / "model.safetensors"))
    out = {n: t.float() for n, t in sd.items() if not n.endswith((".weight_packed", ".weight_scale"))}
    out.update({m + ".weight": w.float().contiguous() for m, w in weights.items()})
    tmp.mkdir()
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config")
    (tmp / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()


def test_whole_compressed_tensors_mxfp4_model(tmp_path, dirs):
    src = dirs["qwen2"]
    report = moepack.convert(src, tmp_path / "out")
    assert report.layout == "mx4g32_n32k8_x86"
    assert moepack.verify(tmp_path / "out", source=src).ok
    model = hf.load_model(tmp_path / "out", dtype=torch.float32)
    r = model.moepack_load
    assert set(r.dequantized.values()) == {"mxfp4"} and len(r.dequantized) == 8  # q, k, v, o of two layers
    assert all(".self_attn." in p for p in r.dequantized) and 0 < r.quantized_bytes < r.dequantized_bytes
    mods = [n[: -len(".weight_packed")] for n in load_file(str(src / "model.safetensors")) if n.endswith(".weight_packed")]
    _same_tokens(model, _oracle_model(src, {m: ct_oracle(src, m) for m in mods}, tmp_path / "oracle"))


def test_whole_mxfp4_model_with_partial_groups(tmp_path):
    """fixtures/qwen3_moe (H = 72, I = 40: neither a multiple of 32, nor of the layout's 32-wide
    column blocks) in mxfp4-pack-quantized with partial last groups: the padding is exact."""
    src = tmp_path / "src"
    want = write_ragged_ct_mxfp4(fixture_dir("qwen3_moe"), src)
    moepack.convert(src, tmp_path / "out")
    assert moepack.verify(tmp_path / "out", source=src).ok
    model = hf.load_model(tmp_path / "out", dtype=torch.float32)
    assert set(model.moepack_load.dequantized.values()) == {"mxfp4"}
    _same_tokens(model, _oracle_model(src, want, tmp_path / "oracle"))
