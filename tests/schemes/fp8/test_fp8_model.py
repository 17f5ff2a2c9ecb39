"""DeepSeek-style block FP8 (docs/FORMATS.md §4): the checkpoint writer tools/fp8_checkpoint.py,
the exact FP8 decode of the non-expert Linears load_model dequantizes (moepack/sources/fp8_codec.py,
moepack/sources/linears.py), convert's checks of them, MTP layers, and the whole DeepSeek-V3 model.

* the writer's codes and scales against the format's dequantization and against transformers'
  own (``integrations.finegrained_fp8._dequantize_fp8_weight``), bit for bit, with ragged N/K,
  F32/BF16/F16 scales and 128x128 or smaller blocks; fused transformers-5 experts are written per
  expert; the optional MTP layer has DeepSeek's names;
* ``decode_fp8`` equals torch's conversion for all 256 codes (NaN codes where torch has NaN);
* the carried FP8 Linears of a written checkpoint (attention, dense MLP, shared experts) are found
  and dequantized bit for bit as transformers dequantizes them (and as transformers' own FP8
  loader does, with ``FineGrainedFP8Config(dequantize=True)``, where accelerate is installed);
* convert's check refuses NaN codes, zero / negative / Inf scales and scale grids of the wrong
  shape in an attention Linear, naming the tensor;
* the container carries F8_E4M3 tensors unchanged (a float source with an FP8 tensor);
* a packed DeepSeek-V3 directory with an MTP layer packed as an MoE layer loads: the layer and
  its tensors are skipped and recorded (``LoadReport``), tokens equal transformers';
* the whole FP8 DeepSeek-V3 model (needs the FP8 expert reader, moepack/sources/fp8.py):
  convert -> verify -> load_model -> greedy tokens equal transformers' on the dequantized model.
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
from moepack.errors import SourceError  # noqa: E402
from moepack.sources import Checkpoint, linears  # noqa: E402
from moepack.sources.fp8_codec import decode_fp8, nan_codes  # noqa: E402
from tests.support.fixtures_util import fixture_dir  # noqa: E402
from tests.support.ckpt_edit import copy_with_tensor

_spec = importlib.util.spec_from_file_location("fp8_checkpoint", Path(__file__).resolve().parents[3] / "tools" / "fp8_checkpoint.py")
F = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(F)

PROMPT = [5, 77, 23, 101, 9, 64, 3, 120, 44, 17]
N_NEW = 16
SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tf_dequant(codes, scale, block):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    return _dequantize_fp8_weight(codes, scale, list(block), torch.float32)


def _load(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# --------------------------------------------------------------------------- the writer


@pytest.mark.parametrize("n,k", [(300, 200), (128, 128), (1, 5), (129, 257), (40, 72)])
@pytest.mark.parametrize("scale_dtype", sorted(SCALE_DTYPES))
@pytest.mark.parametrize("block", [(128, 128), (32, 48)])
def test_block_quantization_against_the_format_and_transformers(n, k, scale_dtype, block):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, k)  # columns of very different magnitudes
    zero_block = n >= block[0] and k >= block[1]
    if zero_block:
        w[: block[0], : block[1]] = 0  # an all-zero block gets scale 1 (never a zero scale)
    codes, scale = F.quantize_block_fp8(w, block, SCALE_DTYPES[scale_dtype])
    assert codes.dtype == torch.float8_e4m3fn and tuple(codes.shape) == (n, k)
    assert scale.dtype == SCALE_DTYPES[scale_dtype] and tuple(scale.shape) == (math.ceil(n / block[0]), math.ceil(k / block[1]))
    assert not bool(nan_codes(codes).any()) and bool((scale.float() > 0).all())
    deq = F.dequantize_block_fp8(codes, scale, block)
    assert torch.equal(deq, _tf_dequant(codes, scale, block))
    # round to nearest in e4m3 (3 mantissa bits: half an ulp is 2^-4 of the value), plus the
    # subnormal step and a bf16/f16 scale's rounding (clamped at 448) relative to the block amax
    bn, bk = block
    amax = F.dequantize_block_fp8(torch.ones(n, k).to(torch.float8_e4m3fn), scale, block) * 448
    assert bool(((deq - w).abs() <= w.abs() * 2**-4 + amax * 2**-8 + 1e-30).all())
    if zero_block:
        assert scale[0, 0].item() == 1.0 and bool((codes[: block[0], : block[1]].float() == 0).all())
    # scale = amax / 448 (in the scale dtype)
    wp = torch.zeros(math.ceil(n / bn) * bn, math.ceil(k / bk) * bk)
    wp[:n, :k] = w
    am = wp.view(math.ceil(n / bn), bn, math.ceil(k / bk), bk).abs().amax((1, 3))
    want = torch.where(am > 0, am / 448, torch.ones_like(am)).to(SCALE_DTYPES[scale_dtype])
    assert torch.equal(scale, want)


def _bit_decode(byte: int, ebits: int, bias: int, fn: bool) -> float:
    """The FP8 value of ``byte`` from its sign/exponent/mantissa bits (OCP FP8: e4m3fn has no inf
    and only S.1111.111 is NaN; e5m2 follows IEEE: exponent all ones is inf or NaN)."""
    mbits = 7 - ebits
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> mbits) & ((1 << ebits) - 1), byte & ((1 << mbits) - 1)
    emax = (1 << ebits) - 1
    if fn and e == emax and m == (1 << mbits) - 1:
        return math.nan
    if not fn and e == emax:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - mbits)
    return sign * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)


def test_decode_fp8_against_the_bit_level_definition_for_every_code():
    for dt, ebits, bias, fn, nans in ((torch.float8_e4m3fn, 4, 7, True, {0x7F, 0xFF}),
                                      (torch.float8_e5m2, 5, 15, False, set(range(0x7D, 0x80)) | set(range(0xFD, 0x100)))):  # fmt: skip
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt)
        got = decode_fp8(codes)
        want = torch.tensor([_bit_decode(b, ebits, bias, fn) for b in range(256)], dtype=torch.float32)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        ok = ~torch.isnan(want)
        assert torch.equal(got[ok], want[ok])
        assert {int(i) for i in nan_codes(codes).nonzero().flatten()} == nans
    assert decode_fp8(torch.tensor([448.0]).to(torch.float8_e4m3fn)).item() == 448.0


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """(float source, {variant: FP8 directory}) written from fixtures/deepseek_v3 (bf16)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for key, kw in {"mtp": dict(mtp=True), "plain": dict(), "b32-bf16": dict(block=(32, 32), scale_dtype="bfloat16"),
                    "f16": dict(scale_dtype="float16")}.items():  # fmt: skip
        out[key] = root / key
        F.write_fp8_checkpoint(fixture_dir("deepseek_v3"), out[key], **kw)
    return out


def test_written_checkpoint_follows_formats_md(fp8_dirs):
    d = fp8_dirs["mtp"]
    src = _load(fixture_dir("deepseek_v3"))
    got = _load(d)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}  # fmt: skip
    assert cfg["num_nextn_predict_layers"] == 1
    nl = cfg["num_hidden_layers"]
    fp8 = {n for n, t in got.items() if t.dtype == torch.float8_e4m3fn}
    for n in fp8:
        assert got[n + "_scale_inv"].dtype == torch.float32
    kept = {n for n in got if n not in fp8 and not n.endswith("_scale_inv")}
    for n in kept:
        assert got[n].dtype != torch.float8_e4m3fn
        assert got[n].dim() == 1 or any(x in n for x in ("embed_tokens", "lm_head", "shared_head.head", "mlp.gate.weight")), n
    for n, t in src.items():  # every source tensor: quantized exactly when it is a Linear other than router / embeddings
        is_linear = n.endswith(".weight") and t.dim() == 2 and not any(x in n for x in ("embed_tokens", "lm_head", "mlp.gate.weight"))
        assert (n in fp8) == is_linear, n
        if n in fp8:
            w = F.dequantize_block_fp8(got[n], got[n + "_scale_inv"])
            assert float((w - t.float()).norm() / t.float().norm()) < 0.05, n
        else:
            assert torch.equal(got[n], t), n
    assert any(".self_attn." in n for n in fp8) and "model.layers.0.mlp.down_proj.weight" in fp8
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in kept
    mtp = {n for n in got if n.startswith(f"model.layers.{nl}.")}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
                 "embed_tokens.weight", "mlp.experts.7.down_proj.weight", "self_attn.kv_b_proj.weight"):  # fmt: skip
        assert f"model.layers.{nl}.{name}" in mtp, name
    assert f"model.layers.{nl}.eh_proj.weight" in fp8 and f"model.layers.{nl}.shared_head.head.weight" in kept
    h = cfg["hidden_size"]
    assert tuple(got[f"model.layers.{nl}.eh_proj.weight"].shape) == (h, 2 * h)
    plain = json.loads((fp8_dirs["plain"] / "config.json").read_text())
    assert plain["num_nextn_predict_layers"] == 0 and not any(n.startswith(f"model.layers.{nl}.") for n in _load(fp8_dirs["plain"]))


def test_fused_experts_are_written_per_expert(tmp_path, fp8_dirs):
    """A float source with transformers-5 fused experts ([E, 2I, H] gate-then-up, [E, H, I]) gives
    the same bytes as the per-expert source."""
    src = _load(fixture_dir("deepseek_v3"))
    cfg = json.loads((fixture_dir("deepseek_v3") / "config.json").read_text())
    fused = {n: t for n, t in src.items() if ".mlp.experts." not in n}
    e = cfg["n_routed_experts"]
    for L in sorted({int(n.split(".")[2]) for n in src if ".mlp.experts." in n}):
        p = f"model.layers.{L}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([src[f"{p}.{j}.gate_proj.weight"], src[f"{p}.{j}.up_proj.weight"]]) for j in range(e)])
        fused[f"{p}.down_proj"] = torch.stack([src[f"{p}.{j}.down_proj.weight"] for j in range(e)])
    d = tmp_path / "fused"
    d.mkdir()
    save_file(fused, str(d / "model.safetensors"))
    shutil.copy(fixture_dir("deepseek_v3") / "config.json", d / "config.json")
    F.write_fp8_checkpoint(d, tmp_path / "out")
    a, b = _load(tmp_path / "out"), _load(fp8_dirs["plain"])
    assert sorted(a) == sorted(b)
    for n in a:
        assert torch.equal(a[n].view(torch.uint8) if a[n].dtype == torch.float8_e4m3fn else a[n],
                           b[n].view(torch.uint8) if b[n].dtype == torch.float8_e4m3fn else b[n]), n  # fmt: skip


def test_writer_cli_and_refusals(tmp_path, fp8_dirs):
    import subprocess
    import sys

    tool = Path(__file__).resolve().parents[3] / "tools" / "fp8_checkpoint.py"
    r = subprocess.run([sys.executable, str(tool), str(fixture_dir("deepseek_v3")), str(tmp_path / "cli"), "--scale-dtype", "float16"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    a, b = _load(tmp_path / "cli"), _load(fp8_dirs["f16"])
    assert sorted(a) == sorted(b) and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a if a[n].dtype == torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="already quantized"):
        F.write_fp8_checkpoint(fp8_dirs["plain"], tmp_path / "x")
    with pytest.raises(ValueError, match="scale_dtype"):
        F.write_fp8_checkpoint(fixture_dir("deepseek_v3"), tmp_path / "y", scale_dtype="float8")


# --------------------------------------------------------------------------- the carried FP8 linears


def _view(d: Path):
    ckpt = Checkpoint(d)
    return linears.CarriedView(ckpt, [n for n in ckpt.tensors if ".mlp.experts." not in n])


@pytest.mark.parametrize("variant", ["mtp", "b32-bf16", "f16"])
def test_carried_fp8_linears_dequantize_as_transformers_does(fp8_dirs, variant):
    d = fp8_dirs[variant]
    view = _view(d)
    lins = linears.find_linears(view)
    raw = _load(d)
    want = {n[: -len(".weight")] for n, t in raw.items() if t.dtype == torch.float8_e4m3fn and ".mlp.experts." not in n}
    assert set(lins) == want and any(".self_attn." in p for p in lins) and "model.layers.0.mlp.gate_proj" in lins
    block = json.loads((d / "config.json").read_text())["quantization_config"]["weight_block_size"]
    for p, lin in lins.items():
        assert lin.codec == "fp8" and lin.scale_rule == ("block", *block)
        got = linears.dequantize_linear(view, lin)
        assert torch.equal(got, _tf_dequant(raw[p + ".weight"], raw[p + ".weight_scale_inv"], block)), p
        assert torch.equal(got, F.dequantize_block_fp8(raw[p + ".weight"], raw[p + ".weight_scale_inv"], block)), p


def test_transformers_fp8_loader_agrees(fp8_dirs):
    """transformers' own FP8 loader (FineGrainedFP8Config(dequantize=True); needs accelerate)
    dequantizes every Linear of the written checkpoint to the writer's dequantization."""
    import accelerate  # noqa: F401  (transformers\' FP8 loader needs it)
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    d = fp8_dirs["plain"]
    m = AutoModelForCausalLM.from_pretrained(str(d), quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32)
    view = _view(d)
    for p, lin in linears.find_linears(view).items():
        assert torch.equal(m.get_submodule(p).weight, linears.dequantize_linear(view, lin)), p


def _byte(idx, value):
    def fn(t):
        t.view(torch.uint8).view(-1)[idx] = value
        return t

    return fn


def _val(idx, value):
    def fn(t):
        t.view(-1)[idx] = value
        return t

    return fn


BAD = [
    ("model.layers.0.self_attn.q_proj.weight", _byte(5, 0x7F), ["0x7F", "e4m3fn NaN code (0x7F / 0xFF)"]),
    ("model.layers.1.self_attn.o_proj.weight", _byte(0, 0xFF), ["0xFF", "e4m3fn NaN code (0x7F / 0xFF)"]),
    ("model.layers.0.self_attn.kv_b_proj.weight_scale_inv", _val(0, 0.0), ["= 0.0", "finite and > 0"]),
    ("model.layers.0.mlp.down_proj.weight_scale_inv", _val(0, float("nan")), ["nan", "finite and > 0"]),
    ("model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv", _val(0, -1.0), ["-1.0"]),
    ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv", lambda t: torch.ones(2, 1), ["[2, 1]", "expected [1, 1]"]),
]
BAD_IDS = ["nan-code-7f", "nan-code-ff", "zero-scale", "nan-scale", "negative-scale", "scale-grid-shape"]


@pytest.mark.parametrize("name,fn,must", BAD, ids=BAD_IDS)
def test_carried_check_refuses_bad_fp8_linears(tmp_path, fp8_dirs, name, fn, must):
    d = copy_with_tensor(fp8_dirs["plain"], tmp_path / "bad", name, fn)
    ckpt = Checkpoint(d)
    with pytest.raises(SourceError) as ei:
        linears.check_carried(ckpt, [n for n in ckpt.tensors if ".mlp.experts." not in n])
    msg = str(ei.value)
    assert repr(name) in msg and "\n" not in msg, msg
    for m in must:
        assert m in msg, msg


def test_an_fp8_weight_without_scale_inv_is_refused(tmp_path, fp8_dirs):
    d = tmp_path / "noscale"
    shutil.copytree(fp8_dirs["plain"], d)
    t = load_file(d / "model.safetensors")
    del t["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(SourceError, match=r"'model.layers.0.self_attn.o_proj.weight' is F8_E4M3 but .*weight_scale_inv' is missing"):
        linears.find_linears(_view(d))


@pytest.mark.parametrize("name,fn,must", BAD, ids=BAD_IDS)
def test_convert_refuses_bad_fp8_attention(tmp_path, fp8_dirs, name, fn, must):
    d = copy_with_tensor(fp8_dirs["plain"], tmp_path / "bad", name, fn)
    with pytest.raises(SourceError) as ei:
        moepack.convert(d, tmp_path / "out")
    assert repr(name) in str(ei.value)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- container, MTP


def test_container_carries_fp8_tensors_unchanged(tmp_path):
    """A float source with an F8_E4M3 tensor among the non-expert ones: convert carries it byte for
    byte (manifest dtype float8_e4m3fn), moepack.open maps it, verify hashes it."""
    d = tmp_path / "src"
    shutil.copytree(fixture_dir("deepseek_v3"), d)
    t = load_file(d / "model.safetensors")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    t["model.extra.codes"] = codes
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    moepack.convert(d, tmp_path / "out")
    m = json.loads((tmp_path / "out" / "moepack.json").read_text())
    assert m["tensors"]["model.extra.codes"]["dtype"] == "float8_e4m3fn"
    got = moepack.open(tmp_path / "out").tensor("model.extra.codes")
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), codes.view(torch.uint8))
    assert moepack.verify(tmp_path / "out", source=d).ok


def _with_mtp_layer(dst: Path) -> Path:
    """fixtures/deepseek_v3 (bf16, no quantization) plus a DeepSeek MTP layer at index
    num_hidden_layers (the writer's), num_nextn_predict_layers 1."""
    src = fixture_dir("deepseek_v3")
    cfg = json.loads((src / "config.json").read_text())
    t = load_file(src / "model.safetensors")
    t.update(F._mtp_tensors(t, cfg, torch.Generator().manual_seed(0)))
    dst.mkdir()
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_mtp_layer_packed_as_moe_is_skipped_and_recorded(tmp_path):
    src = _with_mtp_layer(tmp_path / "src")
    moepack.convert(src, tmp_path / "out")
    pm = moepack.open(tmp_path / "out")
    nl = pm.config["num_hidden_layers"]
    model = hf.load_model(tmp_path / "out", dtype=torch.float32)
    r = model.moepack_load
    assert not any(n.startswith(f"model.layers.{nl}.") for n in pm.manifest["tensors"])  # neither packed nor carried
    assert r.mtp_layers == [nl] and nl not in pm.layers and r.mtp_tensors == 0
    srct = load_file(src / "model.safetensors")
    skipped = pm.manifest["source"]["skipped"]  # every MTP tensor listed, with the reason (sources.dense.mtp_skipped)
    assert skipped["tensors"] == sorted(n for n in srct if n.startswith(f"model.layers.{nl}.")) and "multi-token" in skipped["why"]
    assert r.convert_skipped == len(skipped["tensors"])
    assert moepack.verify(tmp_path / "out", source=src).ok  # verify leaves the skipped layer out too
    assert any("MTP" in line for line in r.lines())
    from tests.support.fixtures_util import load_hf_model

    ref = load_hf_model("deepseek_v3", dtype=torch.float32)
    ours = hf.greedy_generate(model, PROMPT, N_NEW)
    theirs = hf.greedy_generate(ref, PROMPT, N_NEW)
    assert ours.tokens == theirs.tokens


# --------------------------------------------------------------------------- the whole FP8 model


def _dequantized_state(d: Path) -> dict:
    """The FP8 checkpoint's tensors with every FP8 weight dequantized by the format's rule, in
    transformers' in-memory names (experts fused), without the MTP layer (transformers has none)."""
    raw = _load(d)
    cfg = json.loads((d / "config.json").read_text())
    block = cfg["quantization_config"]["weight_block_size"]
    nl = cfg["num_hidden_layers"]
    st = {}
    for n, t in raw.items():
        if n.endswith("_scale_inv") or (n.startswith("model.layers.") and int(n.split(".")[2]) >= nl):
            continue
        st[n] = F.dequantize_block_fp8(t, raw[n + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn else t.float()
    e = cfg["n_routed_experts"]
    out = {n: t for n, t in st.items() if ".mlp.experts." not in n}
    for L in sorted({int(n.split(".")[2]) for n in st if ".mlp.experts." in n}):
        p = f"model.layers.{L}.mlp.experts"
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([st[f"{p}.{j}.gate_proj.weight"], st[f"{p}.{j}.up_proj.weight"]]) for j in range(e)])
        out[f"{p}.down_proj"] = torch.stack([st[f"{p}.{j}.down_proj.weight"] for j in range(e)])
    return out


def _oracle(d: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    m = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = m.load_state_dict(_dequantized_state(d), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    m.tie_weights()
    return m


@pytest.mark.parametrize("variant", ["mtp", "plain"])
def test_whole_deepseek_v3_fp8_model(tmp_path, fp8_dirs, variant):
    d = fp8_dirs[variant]
    moepack.convert(d, tmp_path / "out")
    assert moepack.verify(tmp_path / "out", source=d).ok
    model = hf.load_model(tmp_path / "out", dtype=torch.float32)
    r = model.moepack_load
    lins = linears.find_linears(_view(d))
    nl = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    run = {p for p in lins if int(p.split(".")[2]) < nl and ".shared_experts." not in p}  # shared experts are packed
    assert set(r.dequantized) == run and set(r.dequantized.values()) == {"fp8"}
    assert r.dequantized_bytes == sum(lins[p].n * lins[p].k * 4 for p in run)
    if variant == "mtp":  # the MTP layer: left out by convert (sources.dense.mtp_skipped), and recorded
        assert r.mtp_layers == [nl] and r.mtp_tensors + r.convert_skipped > 0 and any("MTP" in x for x in r.lines())
    else:
        assert r.mtp_layers == [] and r.mtp_tensors == 0
    ours = hf.greedy_generate(model, PROMPT, N_NEW)
    ref = hf.greedy_generate(_oracle(d), PROMPT, N_NEW)
    assert ours.tokens == ref.tokens
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(ours.logits, ref.logits))
    assert rel <= 1e-4, rel


# --------------------------------------------------------------------------- compressed-tensors float-quantized


def _ct_float_dir(d: Path) -> dict:
    """A compressed-tensors ``float-quantized`` (FP8) checkpoint's attention Linears, written by
    compressed-tensors' own compressor with tensor, channel and (ragged) block scales; returns
    {prefix: the library's own decompression (fp32)}."""
    import compressed_tensors as ct
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    acts = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    groups = {
        "g_channel": ({"strategy": "channel"}, ["re:.*q_proj$"], lambda n, k: (n, 1)),
        "g_block": ({"strategy": "block", "block_structure": [32, 32]}, ["re:.*o_proj$"], lambda n, k: (math.ceil(n / 32), math.ceil(k / 32))),
        "g_tensor": ({"strategy": "tensor"}, ["re:.*k_proj$"], lambda n, k: (1,)),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    tensors, want, cfg_groups = {}, {}, {}
    for gname, (wargs, targets, sshape) in groups.items():
        args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, **wargs}
        cfg_groups[gname] = {"targets": targets, "weights": args, "input_activations": acts, "format": "float-quantized"}
        scheme = QuantizationScheme(targets=targets, weights=QuantizationArgs(**args), input_activations=QuantizationArgs(**acts))
        p = "model.layers.0.self_attn." + targets[0][len("re:.*") : -1]
        n, k = (70, 100) if gname != "g_tensor" else (40, 100)
        w = torch.randn(n, k, generator=gen)
        s = torch.rand(*sshape(n, k), generator=gen) * 0.01 + 1e-3
        out = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": s}, scheme)
        tensors[p + ".weight"], tensors[p + ".weight_scale"] = out["weight"], out["weight_scale"]
        want[p] = FloatQuantizationCompressor.decompress({"weight": out["weight"], "weight_scale": out["weight_scale"]}, scheme)["weight"].float()
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones(100)
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed", "config_groups": cfg_groups}
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 100, "quantization_config": qc}))
    assert ct is not None
    return want


def test_compressed_tensors_float_quantized_linears_match_the_library(tmp_path):
    want = _ct_float_dir(tmp_path / "ct")
    ckpt = Checkpoint(tmp_path / "ct")
    view = linears.CarriedView(ckpt, list(ckpt.tensors))
    lins = linears.find_linears(view)
    assert set(lins) == set(want)
    assert {p.rsplit(".", 1)[1]: lins[p].scale_rule[0] for p in lins} == {"q_proj": "channel", "o_proj": "block", "k_proj": "tensor"}
    for p, lin in lins.items():
        assert torch.equal(linears.dequantize_linear(view, lin), want[p]), p
    # a zero scale: refused naming the tensor
    t = load_file(tmp_path / "ct" / "model.safetensors")
    t["model.layers.0.self_attn.o_proj.weight_scale"][1, 2] = 0.0
    save_file(t, str(tmp_path / "ct" / "model.safetensors"))
    ckpt = Checkpoint(tmp_path / "ct")
    with pytest.raises(SourceError, match=r"'model.layers.0.self_attn.o_proj.weight_scale'\[1, 2\] = 0.0: scales must be finite and > 0"):
        linears.check_carried(ckpt, list(ckpt.tensors))
