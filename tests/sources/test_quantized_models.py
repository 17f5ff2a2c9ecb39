"""Whole models from quantized sources whose attention is quantized too (GPTQ, AWQ,
compressed-tensors), and convert's checks of the quantized Linears it carries.

* fixtures: a tiny seeded transformers qwen2_moe / qwen3_moe (written by ``save_pretrained``)
  whose every Linear except the router, the shared-expert gate and lm_head is round-to-nearest
  quantized to 4 bits and packed by tools/int4_packers.py (GPTQ v1 / v2, act-order; AWQ GEMM
  with and without zero points); the oracle is ``dequant_lookup`` of the packer's inputs.
* the dequantized non-expert weights ``load_model`` builds equal the oracle's bit for bit;
* convert -> verify -> load_model (fp32) -> 16 greedy tokens equal transformers' own model
  carrying the oracle's weights (fp32), and the logits agree to SEMANTICS.md §4's fp32 bound;
* convert refuses, naming the tensor and writing nothing, NaN / zero / negative scales and
  out-of-range zero points in an attention Linear (GPTQ, AWQ, compressed-tensors int8 and int4),
  as it refuses them in an expert.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import transformers  # noqa: F401  (a test dependency: fails here, not later, where it is missing)

import moepack  # noqa: E402
import moepack.hf as hf  # noqa: E402
from moepack.errors import MoepackError, SourceError  # noqa: E402
from tests.support.fixtures_util import fixture_dir  # noqa: E402
from tests.support.ckpt_edit import copy_with_tensor

_spec = importlib.util.spec_from_file_location("int4_packers", Path(__file__).resolve().parents[2] / "tools" / "int4_packers.py")
P = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(P)

PROMPT = [5, 77, 23, 101, 9, 64, 3, 120, 44, 17]
N_NEW = 16
_KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "shared_expert_gate")


def _config(family: str) -> dict:
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=48, tie_word_embeddings=False, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    if family == "qwen2_moe":
        return dict(common, model_type="qwen2_moe", intermediate_size=64, shared_expert_intermediate_size=40, qkv_bias=True,
                    norm_topk_prob=False)  # fmt: skip
    return dict(common, model_type="qwen3_moe", intermediate_size=64, norm_topk_prob=True)


def _float_model(family: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _config(family)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _rtn(w: torch.Tensor, g_idx: torch.Tensor, ng: int, *, sym: bool, zero_lo: int) -> dict:
    """Round-to-nearest 4-bit of ``w [N, K]`` over the groups ``g_idx`` names (fp16 scales)."""
    n = w.shape[0]
    scale = torch.empty(n, ng)
    zero = torch.empty(n, ng, dtype=torch.uint8)
    for j in range(ng):
        cols = w[:, g_idx == j]
        if sym:
            s = (cols.abs().amax(1) / 7.5).clamp_min(1e-5)
            z = torch.full((n,), 8)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-5)
            z = torch.round(-lo / s.half().float()).clamp(zero_lo, 15)
        scale[:, j] = s.half().float()
        zero[:, j] = z.to(torch.uint8)
    g = g_idx.long()
    q = torch.round(w / scale[:, g]) + zero.float()[:, g]
    return {"q": q.clamp(0, 15).to(torch.uint8), "scale": scale, "zero": zero, "g_idx": g_idx.to(torch.int32)}


def write_int4_model(d: Path, family: str, fmt: str, *, group_size: int = 32, sym: bool = False, version: str = "gptq",
                     act_order: bool = False, seed: int = 0) -> tuple[dict, dict]:  # fmt: skip
    """A whole quantized checkpoint in ``d``; returns (the float state the oracle model loads, with
    every quantized Linear dequantized by the packer's oracle, {prefix: its fp32 weight})."""
    model = _float_model(family, seed)
    tmp = d.parent / (d.name + "-float")
    model.save_pretrained(tmp)
    try:
        return quantize_checkpoint(tmp, d, fmt, group_size=group_size, sym=sym, version=version, act_order=act_order,
                                   seed=seed)  # fmt: skip
    finally:
        shutil.rmtree(tmp)


def quantize_checkpoint(src: Path, d: Path, fmt: str, *, group_size: int = 32, sym: bool = False, version: str = "gptq",
                        act_order: bool = False, seed: int = 0) -> tuple[dict, dict]:  # fmt: skip
    """The float checkpoint ``src`` quantized into ``d`` as a GPTQ or AWQ checkpoint: every 2-D
    weight but ``_KEEP``'s rounded to 4 bits per group (``_rtn``; act-order g_idx drawn from
    ``seed`` + 1) and packed by tools/int4_packers.py; returns what ``write_int4_model`` does."""
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    cfg = json.loads((src / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed + 1)
    zero_lo = 1 if (fmt == "gptq" and version == "gptq") else 0
    out, oracle, deq = {}, {}, {}
    gidx_of = {}  # gate_proj's g_idx, reused by up_proj (the same input), as GPTQ act-order gives
    for name in sorted(state):
        w = state[name]
        if not (name.endswith(".weight") and w.dim() == 2) or any(k in name for k in _KEEP):
            out[name] = w
            continue
        p = name[: -len(".weight")]
        n, k = w.shape
        ng = P.ngroups(k, group_size)
        if act_order and fmt == "gptq":
            sib = p.replace("up_proj", "gate_proj")
            if sib in gidx_of:
                g_idx = gidx_of[sib]
            else:
                gs = k if group_size == -1 else group_size
                perm = torch.randperm(k, generator=gen)
                g_idx = torch.empty(k, dtype=torch.int32)
                g_idx[perm] = (torch.arange(k) // gs).to(torch.int32)
            gidx_of[p] = g_idx
        else:
            g_idx = P.trivial_g_idx(k, group_size)
        ql = _rtn(w.float(), g_idx, ng, sym=sym, zero_lo=zero_lo)
        packed = P.pack_gptq(ql["q"], ql["scale"], ql["zero"], ql["g_idx"], version) if fmt == "gptq" else P.pack_awq(ql["q"], ql["scale"], ql["zero"])
        if fmt == "awq" and sym:
            del packed["qzeros"]
        for kname, t in packed.items():
            out[f"{p}.{kname}"] = t
        deq[p] = P.dequant_lookup(ql)
        oracle[name] = deq[p]
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = P.quantization_config(fmt, group_size, sym=sym, version=version, desc_act=act_order)
    (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    float_state = {k: (oracle.get(k, v)).float() for k, v in state.items()}
    return float_state, deq


def _oracle_model(family: str, float_state: dict):
    """transformers' own model (fp32) carrying the dequantized weights, loaded the way
    from_pretrained maps the on-disk names (per-expert Linears fused)."""
    tmp_model = _float_model(family)
    fused = {}
    for k, v in float_state.items():
        if ".mlp.experts." not in k:
            fused[k] = v
    layers = sorted({int(k.split(".")[2]) for k in float_state if ".mlp.experts." in k})
    e = tmp_model.config.num_experts
    for L in layers:
        pre = f"model.layers.{L}.mlp.experts"
        fused[f"{pre}.gate_up_proj"] = torch.stack(
            [torch.cat([float_state[f"{pre}.{j}.gate_proj.weight"], float_state[f"{pre}.{j}.up_proj.weight"]]) for j in range(e)])
        fused[f"{pre}.down_proj"] = torch.stack([float_state[f"{pre}.{j}.down_proj.weight"] for j in range(e)])
    missing, unexpected = tmp_model.load_state_dict(fused, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return tmp_model.eval()


CASES = [
    pytest.param("qwen2_moe", "gptq", dict(version="gptq"), id="qwen2_moe-gptq_v1-g32-asym"),
    pytest.param("qwen3_moe", "gptq", dict(version="gptq_v2", act_order=True), id="qwen3_moe-gptq_v2-g32-actorder"),
    pytest.param("qwen2_moe", "gptq", dict(version="gptq", sym=True, group_size=-1), id="qwen2_moe-gptq_v1-channel-sym"),
    pytest.param("qwen2_moe", "awq", dict(), id="qwen2_moe-awq-g32-asym"),
    pytest.param("qwen3_moe", "awq", dict(sym=True), id="qwen3_moe-awq-g32-sym"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("qmodels")
    made = {}

    def get(family, fmt, kw):
        key = (family, fmt, tuple(sorted(kw.items())))
        if key not in made:
            src = root / f"{family}-{fmt}-{len(made)}"
            float_state, deq = write_int4_model(src, family, fmt, **kw)
            dst = root / (src.name + "-packed")
            moepack.convert(src, dst)
            made[key] = (src, dst, float_state, deq)
        return made[key]

    return get


@pytest.mark.parametrize("family,fmt,kw", CASES)
def test_whole_model_tokens_equal_transformers_on_the_dequantized_model(built, family, fmt, kw):
    src, dst, float_state, deq = built(family, fmt, kw)
    rep = moepack.verify(dst, source=src)
    assert rep.ok, rep
    model = hf.load_model(dst, dtype=torch.float32)
    # the non-expert quantized linears: dequantized through the source's codec, bit for bit the oracle's
    attn = [p for p in deq if ".self_attn." in p]
    assert attn and set(model.moepack_load.dequantized) >= set(attn)
    for p in attn:
        got = model.get_submodule(p).weight
        assert torch.equal(got, deq[p]), p
    r = model.moepack_load
    assert r.dequantized_bytes == sum(deq[p].numel() * 4 for p in r.dequantized)
    assert 0 < r.quantized_bytes < r.dequantized_bytes
    oracle = _oracle_model(family, float_state)
    ours = hf.greedy_generate(model, PROMPT, N_NEW)
    ref = hf.greedy_generate(oracle, PROMPT, N_NEW)
    assert ours.tokens == ref.tokens
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(ours.logits, ref.logits))
    assert rel <= 1e-4, rel


def test_generate_cli_reports_the_dequantized_linears(built):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    src, dst, float_state, _ = built("qwen2_moe", "gptq", dict(version="gptq"))
    res = CliRunner().invoke(app, ["generate", str(dst), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "4",
                                   "--dtype", "float32", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    ref = hf.greedy_generate(_oracle_model("qwen2_moe", float_state), PROMPT, 4)
    assert out["tokens"] == ref.tokens
    assert out["load"]["dequantized_codecs"] == ["int4"] and out["load"]["dequantized_linears"] >= 8


# --------------------------------------------------------------------------- convert refusals


def _refused(src: Path, tmp_path: Path, must: list[str]):
    dst = tmp_path / "out"
    with pytest.raises(SourceError) as ei:
        moepack.convert(src, dst)
    msg = str(ei.value)
    assert "\n" not in msg
    for m in must:
        assert m in msg, msg
    assert not dst.exists() and not any(p.name.startswith(".out") or "out." in p.name for p in tmp_path.iterdir() if p != src), list(tmp_path.iterdir())
    return msg


def _set(idx, value):
    def fn(t):
        t.view(-1)[idx] = value
        return t

    return fn


@pytest.mark.parametrize("fmt,kw,tensor,fn,must", [
    ("gptq", dict(version="gptq"), "model.layers.0.self_attn.q_proj.scales", _set(3, float("nan")), ["nan", "finite and > 0"]),
    ("gptq", dict(version="gptq"), "model.layers.1.self_attn.o_proj.scales", _set(0, 0.0), ["= 0.0", "finite and > 0"]),
    ("gptq", dict(version="gptq"), "model.layers.0.mlp.shared_expert.down_proj.scales", _set(1, -0.5), ["-0.5"]),
    ("gptq", dict(version="gptq"), "model.layers.0.self_attn.k_proj.qzeros", _set(0, 0x7777777F), ["zero point 16", "0..15"]),
    ("awq", dict(), "model.layers.0.self_attn.v_proj.scales", _set(2, float("inf")), ["inf"]),
], ids=["gptq-nan", "gptq-zero", "gptq-shared-negative", "gptq-v1-zero-16", "awq-inf"])  # fmt: skip
def test_convert_refuses_bad_values_in_a_quantized_attention_linear(tmp_path, fmt, kw, tensor, fn, must):
    good = tmp_path / "good"
    write_int4_model(good, "qwen2_moe", fmt, **kw)
    bad = tmp_path / "bad"
    copy_with_tensor(good, bad, tensor, fn)
    shutil.rmtree(good)
    _refused(bad, tmp_path, [repr(tensor), *must])


def test_convert_refuses_an_attention_g_idx_that_is_not_a_grouping(tmp_path):
    good = tmp_path / "good"
    write_int4_model(good, "qwen3_moe", "gptq", version="gptq_v2", act_order=True)
    bad = tmp_path / "bad"
    copy_with_tensor(good, bad, "model.layers.0.self_attn.q_proj.g_idx", _set(0, 999))
    shutil.rmtree(good)
    _refused(bad, tmp_path, ["'model.layers.0.self_attn.q_proj.g_idx'", "999"])


@pytest.mark.parametrize("fixture,tensor,value,must", [
    ("qwen3_moe_w8a8", "model.layers.0.self_attn.q_proj.weight_scale", float("nan"), ["nan"]),
    ("qwen3_moe_w8a8", "model.layers.1.self_attn.o_proj.weight_scale", 0.0, ["= 0.0"]),
    ("qwen2_moe_w4a16", "model.layers.0.self_attn.k_proj.weight_scale", float("nan"), ["nan"]),
    ("qwen2_moe_w4a16", "model.layers.1.self_attn.q_proj.weight_scale", 0.0, ["= 0.0"]),
], ids=["ct-int8-nan", "ct-int8-zero", "ct-pack-nan", "ct-pack-zero"])  # fmt: skip
def test_convert_refuses_bad_scales_in_a_compressed_tensors_attention_linear(tmp_path, fixture, tensor, value, must):
    bad = tmp_path / "bad"
    copy_with_tensor(fixture_dir(fixture), bad, tensor, _set(1, value))
    msg = _refused(bad, tmp_path, [repr(tensor), "finite and > 0", *must])
    assert "[" in msg  # the element's index


def test_ct_fixtures_with_quantized_attention_still_load(tmp_path):
    """compressed-tensors int8 (qwen3_moe_w8a8) and int4 (qwen2_moe_w4a16) attention: the
    dequantized weights equal compressed-tensors' own decompression (fp32 scales) bit for bit."""
    from tests.integrations.test_transformers import _ct_dequantized_state

    for name in ("qwen3_moe_w8a8", "qwen2_moe_w4a16"):
        dst = tmp_path / name
        moepack.convert(fixture_dir(name), dst)
        model = hf.load_model(dst, dtype=torch.float32)
        want = _ct_dequantized_state(name)
        n = 0
        for p in model.moepack_load.dequantized:
            assert torch.equal(model.get_submodule(p).weight, want[p + ".weight"]), p
            n += ".self_attn." in p
        assert n == 8, model.moepack_load.dequantized  # 4 attention linears x 2 layers


def test_an_int8_weight_no_codec_claims_is_refused_at_load(tmp_path, monkeypatch):
    """A carried int8 ``*.weight`` that no codec pairs with a scale is refused by load_model,
    naming it, instead of running its raw codes as weights."""
    from moepack.errors import UnsupportedError

    dst = tmp_path / "w8a8"
    moepack.convert(fixture_dir("qwen3_moe_w8a8"), dst)
    pm = moepack.open(dst)
    assert hf._quantized_weight(pm, "model.layers.0.self_attn.q_proj") is not None
    monkeypatch.setattr(hf, "_carried_linears", lambda pm: (None, {}))
    with pytest.raises(UnsupportedError, match=r"'model.layers.0.self_attn.q_proj.weight' is int8"):
        hf._quantized_weight(pm, "model.layers.0.self_attn.q_proj")
    assert hf._quantized_weight(pm, "model.layers.0.self_attn.q_norm") is None  # a float weight: mapped as it is
