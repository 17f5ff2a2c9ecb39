"""The FP8 source readers (moepack/sources/fp8.py) against independent oracles: DeepSeek/Qwen
block FP8 written here from real transformers checkpoints (tiny deepseek_v3 / qwen3_moe configs,
ragged N and K on purpose) and dequantized by transformers' own ``_dequantize_fp8_weight``;
compressed-tensors float-quantized FP8_BLOCK / FP8_DYNAMIC / FP8 written by compressed-tensors
0.20.1 itself on CPU and dequantized by its ``decompress_module``. Every refusal of the reader is
here too, each checked to leave nothing behind at convert.

The writers here are the test sources of tests/schemes/fp8/test_fp8_convert.py as well.
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
from moepack.errors import MoepackError, SourceError
from moepack.sources import open_source
from tests.support.ct_writer import write_ct_checkpoint
from tests.support.fixtures_util import fixture_dir
from tests.support.ckpt_edit import copy_checkpoint, edit_tensors, edit_quantization_config, set_element

F8 = torch.float8_e4m3fn
ROOT = Path(__file__).resolve().parents[3]


def _tool():
    """tools/fp8_checkpoint.py (the whole-model engineer's DeepSeek-style writer: no moepack inside)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp8_checkpoint", ROOT / "tools/fp8_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def float_checkpoint(d: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    """A float checkpoint written by transformers' save_pretrained from a tiny seeded config
    (the fixture's config with ``overrides``: e.g. hidden_size=320, moe_intermediate_size=200)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((fixture_dir(model_type) / "config.json").read_text())
    for k in ("architectures", "transformers_version", "dtype"):
        cfg.pop(k, None)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.bfloat16).eval()
    model.save_pretrained(str(d))
    return d


def write_block_fp8(src: Path, dst: Path, *, scale_dtype="float32", block=(128, 128), mtp: bool = False) -> dict:
    """DeepSeek-V3-style FP8 of the float checkpoint ``src`` (tools/fp8_checkpoint.py)."""
    return _tool().write_fp8_checkpoint(src, dst, scale_dtype=scale_dtype, block=block, mtp=mtp)


_CT_KEEP = re.compile(r"(embed_tokens|lm_head|norm|\.mlp\.gate\.weight$|shared_expert_gate)")


def write_ct_fp8(src: Path, dst: Path, preset: str, dtype=torch.bfloat16) -> None:
    """A compressed-tensors float-quantized checkpoint of ``src``'s Linear weights (every 2-D
    weight but embeddings, lm_head, norms and routers), written by compressed-tensors 0.20.1 on
    CPU: ``preset`` FP8_BLOCK / FP8_DYNAMIC / FP8; the scales filled from each block's /
    channel's / tensor's amax (its observers live in llm-compressor), FP8's static input_scale 1."""

    def amax(mod):
        w, sh = mod.weight.float(), tuple(mod.weight_scale.shape)
        if preset == "FP8_BLOCK":
            bn, bk = mod.quantization_scheme.weights.block_structure
            pad = torch.zeros(sh[0] * bn, sh[1] * bk)
            pad[: w.shape[0], : w.shape[1]] = w
            return pad.unflatten(0, (sh[0], bn)).unflatten(2, (sh[1], bk)).abs().amax(dim=(1, 3))
        if preset == "FP8_DYNAMIC":
            return w.abs().amax(dim=1, keepdim=True)
        return w.abs().amax().reshape(sh)

    write_ct_checkpoint(src, dst, preset, amax, keep=_CT_KEEP, dtype=dtype)


def ct_oracle(dst: Path, module: str, preset: str, dtype=torch.bfloat16) -> torch.Tensor:
    """compressed-tensors' own decompression of one module of the checkpoint ``dst``."""
    from compressed_tensors.compressors import decompress_module
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    qc = QuantizationConfig.model_validate(json.loads((dst / "config.json").read_text())["quantization_config"])
    sd = load_file(str(dst / "model.safetensors"))
    w = sd[module + ".weight"]
    root = torch.nn.Module()
    root.add_module("m", torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype))
    qc.config_groups["group_0"].targets = ["Linear"]
    apply_quantization_config(root, qc)
    mod = root.m
    mod.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    mod.weight_scale.data.copy_(sd[module + ".weight_scale"])
    decompress_module(mod)
    return mod.weight.data


def hf_dequant(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """transformers' own block-FP8 dequantization (finegrained_fp8._dequantize_fp8_weight), fp32."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    return _dequantize_fp8_weight(q, s, list(block) if block else None, torch.float32)
# ---------------------------------------------------------------------------------------------
# The test sources, written once per module
# ---------------------------------------------------------------------------------------------

RAGGED = dict(hidden_size=320, moe_intermediate_size=200)  # N and K not multiples of 128
BLOCK_SOURCES = {
    # name: (base family, config overrides, scale dtype, block, MTP layer)
    "deepseek_v3_f32": ("deepseek_v3", dict(RAGGED, n_routed_experts=4), "float32", (128, 128), True),
    "qwen3_moe_bf16": ("qwen3_moe", dict(RAGGED, num_experts=4), "bfloat16", (96, 128), False),
    "qwen3_moe_f16": ("qwen3_moe", {}, "float16", (128, 128), False),
}
CT_PRESETS = ("FP8_BLOCK", "FP8_DYNAMIC", "FP8")


@pytest.fixture(scope="session")
def fp8_sources(tmp_path_factory):
    """name -> an FP8 checkpoint directory (BLOCK_SOURCES and ct_<preset>), written on first use."""
    root = tmp_path_factory.mktemp("fp8src")
    made = {}

    def get(name: str) -> Path:
        if name in made:
            return made[name]
        d = root / name
        if name.startswith("ct_"):
            base = get_float("qwen3_moe", dict(RAGGED, num_experts=4))
            write_ct_fp8(base, d, name[3:])
        else:
            fam, over, sdt, block, mtp = BLOCK_SOURCES[name]
            write_block_fp8(get_float(fam, over), d, scale_dtype=sdt, block=block, mtp=mtp)
        made[name] = d
        return d

    floats = {}

    def get_float(fam: str, over: dict) -> Path:
        key = (fam, tuple(sorted(over.items())))
        if key not in floats:
            floats[key] = float_checkpoint(root / f"float-{fam}-{len(floats)}", fam, **over) if over else fixture_dir(fam)
        return floats[key]

    get.float = get_float
    return get


def _modules(spec, e: int):
    return [(r, spec.names[(e, r, "weight")][: -len(".weight")]) for r in ("gate", "up", "down")]


@pytest.mark.parametrize("name", sorted(BLOCK_SOURCES))
def test_block_fp8_reader_matches_transformers_dequantization(fp8_sources, name):
    """Codes as stored, scales expanded per row, and the dequantized weights bit-equal to
    transformers' own _dequantize_fp8_weight (fp32), routed and shared experts."""
    d = fp8_sources(name)
    block = BLOCK_SOURCES[name][3]
    sd = load_file(str(d / "model.safetensors"))
    ckpt, reader = open_source(d)
    assert reader.name == "fp8-block" and reader.scheme == "fp8_block"
    specs = reader.layers(ckpt)
    assert specs and all(s.dtype == "F8_E4M3" and s.quant.strategy == "block" and s.quant.block == block for s in specs)
    checked = 0
    for s in specs:
        i = s.intermediate
        for e in range(s.num_experts):
            c13, c2 = reader.read_expert_canonical(ckpt, s, "w13", e), reader.read_expert_canonical(ckpt, s, "w2", e)
            w13, w2 = reader.read_expert_w13(ckpt, s, e), reader.read_expert_w2(ckpt, s, e)
            for (role, m), rows in zip(_modules(s, e), (slice(0, i), slice(i, 2 * i), slice(None))):
                q, sc = sd[m + ".weight"], sd[m + ".weight_scale_inv"]
                codes = (c2 if role == "down" else c13)["w2_q" if role == "down" else "w13_q"][rows]
                assert torch.equal(codes, q.view(torch.uint8)), m
                oracle = hf_dequant(q, sc, block)
                ours = (w2 if role == "down" else w13)[rows]
                assert ours.dtype == torch.float32 and torch.equal(ours, oracle), f"{m}: dequantized weights differ"
                checked += 1
        if s.shared:
            w13, w2 = reader.read_shared(ckpt, s)
            c = reader.read_shared_canonical(ckpt, s)
            si = s.shared["intermediate"]
            for name_, got, q in (("gate_proj", w13[0, :si], c["w13_q"][0, :si]), ("up_proj", w13[0, si:], c["w13_q"][0, si:]),
                                  ("down_proj", w2[0], c["w2_q"][0])):  # fmt: skip
                m = f"{s.prefix}.shared_experts.{name_}"
                assert torch.equal(q, sd[m + ".weight"].view(torch.uint8))
                assert torch.equal(got, hf_dequant(sd[m + ".weight"], sd[m + ".weight_scale_inv"], block)), m
                checked += 1
    assert checked >= 12


@pytest.mark.parametrize("preset", CT_PRESETS)
def test_ct_float_quantized_reader_matches_compressed_tensors(fp8_sources, preset):
    """compressed-tensors FP8_BLOCK (block scales), FP8_DYNAMIC (channel) and FP8 (tensor):
    the codes as stored, and the dequantized weights equal to compressed-tensors' own
    decompression (bf16, the model dtype: our fp32 products are exact and round to its)."""
    d = fp8_sources(f"ct_{preset}")
    sd = load_file(str(d / "model.safetensors"))
    ckpt, reader = open_source(d)
    assert reader.name == "compressed-tensors-float-quantized"
    specs = reader.layers(ckpt)
    strategy = {"FP8_BLOCK": "block", "FP8_DYNAMIC": "channel", "FP8": "tensor"}[preset]
    assert all(s.quant.strategy == strategy and s.quant.fp8_activations for s in specs)
    for s in specs:
        i = s.intermediate
        layer = reader.read_layer(ckpt, s)
        for e in (0, s.num_experts - 1):
            for (role, m), rows in zip(_modules(s, e), (slice(0, i), slice(i, 2 * i), slice(None))):
                q = (layer.canonical["w2_q"] if role == "down" else layer.canonical["w13_q"])[e][rows]
                assert torch.equal(q, sd[m + ".weight"].view(torch.uint8)), m
                ours = (layer.w2 if role == "down" else layer.w13)[e][rows]
                oracle = ct_oracle(d, m, preset)
                assert torch.equal(ours.to(oracle.dtype), oracle), f"{m}: differs from compressed-tensors' decompression"
                assert torch.equal(ours, reader.read_expert_w2(ckpt, s, e) if role == "down" else reader.read_expert_w13(ckpt, s, e)[rows])


def test_every_code_decodes_through_the_reader(tmp_path, fp8_sources):
    """All 256 codes stored in one expert: the finite ones dequantize to torch's float8_e4m3fn
    value times the scale; the NaN ones (0x7F, 0xFF) are refused with their first index."""
    src = copy_checkpoint(fp8_sources("qwen3_moe_f16"), tmp_path / "src")
    sd = load_file(str(src / "model.safetensors"))
    m = "model.layers.0.mlp.experts.1.down_proj"
    q = sd[m + ".weight"].view(torch.uint8).clone()
    finite = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    q.view(-1)[: finite.numel()] = finite[: q.numel()] if q.numel() < finite.numel() else finite
    sd[m + ".weight"] = q.view(F8)
    save_file(sd, str(src / "model.safetensors"))
    ckpt, reader = open_source(src)
    s = reader.layers(ckpt)[0]
    got = reader.read_expert_w2(ckpt, s, 1).view(-1)[: finite.numel()]
    sc = sd[m + ".weight_scale_inv"].float()[0, 0]
    want = finite.view(F8).float()[: got.numel()] * sc
    assert torch.equal(got, want)
    for nan in (0x7F, 0xFF):
        q2 = q.clone()
        q2.view(-1)[5] = nan
        sd[m + ".weight"] = q2.view(F8)
        save_file(sd, str(src / "model.safetensors"))
        with pytest.raises(MoepackError, match=rf"{re.escape(m)}\.weight'\[0, 5\] = 0x{nan:02X}: an e4m3fn NaN code"):
            moepack.convert(src, tmp_path / "dst")
        assert not (tmp_path / "dst").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ---------------------------------------------------------------------------------------------
# Refusals: one line naming the tensor / config key, the value and the rule; nothing written
# ---------------------------------------------------------------------------------------------


E1 = "model.layers.1.mlp.experts.1.up_proj"  # deepseek_v3_f32: layer 0 is dense


def _retype(name, dtype):
    def fn(sd):
        sd[name] = sd[name].float().to(dtype)

    return fn


BAD_TENSORS = {
    "nan scale": (set_element(E1 + ".weight_scale_inv", (1, 2), float("nan")), [E1 + ".weight_scale_inv'[1, 2] = nan", "finite and > 0"]),
    "inf scale": (set_element(E1 + ".weight_scale_inv", (0, 0), float("inf")), ["[0, 0] = inf", "finite and > 0"]),
    "zero scale": (set_element(E1 + ".weight_scale_inv", (1, 0), 0.0), ["[1, 0] = 0.0", "finite and > 0"]),
    "negative scale": (set_element(E1 + ".weight_scale_inv", (0, 1), -0.5), ["[0, 1] = -0.5", "finite and > 0"]),
    "scale shape": (lambda sd: sd.update({E1 + ".weight_scale_inv": sd[E1 + ".weight_scale_inv"][:, :2].contiguous()}),
                    [E1 + ".weight_scale_inv' has shape [2, 2]", "expected [2, 3]", "ceil(N=200 / 128) x ceil(K=320 / 128)"]),
    "scale missing": (lambda sd: sd.pop(E1 + ".weight_scale_inv"), [E1 + ".weight_scale_inv' is missing"]),
    "scale dtype": (lambda sd: sd.update({E1 + ".weight_scale_inv": sd[E1 + ".weight_scale_inv"].to(torch.float64)}),
                    ["has dtype F64", "F32, BF16, F16 or F8_E8M0 (UE8M0)"]),
    "e5m2 weight": (_retype(E1 + ".weight", torch.float8_e5m2), [E1 + ".weight' has dtype F8_E5M2", "e5m2 keeps 2 mantissa bits"]),
    "nan code": (lambda sd: sd.update({E1 + ".weight": _nan_at(sd[E1 + ".weight"], (3, 17), 0xFF)}),
                 [E1 + ".weight'[3, 17] = 0xFF", "NaN code"]),
}  # fmt: skip


def _nan_at(t, idx, code):
    q = t.view(torch.uint8).clone()
    q[idx] = code
    return q.view(F8)


@pytest.mark.parametrize("case", sorted(BAD_TENSORS))
def test_bad_tensors_are_refused_by_name(tmp_path, fp8_sources, case):
    edit, words = BAD_TENSORS[case]
    src = copy_checkpoint(fp8_sources("deepseek_v3_f32"), tmp_path / "src")
    edit_tensors(src, edit)
    with pytest.raises(MoepackError) as ei:
        moepack.convert(src, tmp_path / "dst")
    msg = str(ei.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, f"{case}: {w!r} not in {msg}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "a refused convert leaves nothing behind"


BAD_CONFIGS = {
    "e5m2": (lambda qc: qc.update(fmt="e5m2"), "fmt='e5m2': e5m2 keeps 2 mantissa bits"),
    "e4m3fnuz": (lambda qc: qc.update(fmt="e4m3fnuz"), "its +-240 (0x7F/0xFF) have an exact e4m3fn code only at the same scale"),
    "unknown fmt": (lambda qc: qc.update(fmt="e3m4"), "fmt='e3m4': moepack reads e4m3"),
    "unknown scale_fmt": (lambda qc: qc.update(scale_fmt="mx"), "scale_fmt='mx'"),
    "block 64 wide": (lambda qc: qc.update(weight_block_size=[128, 64]), "weight_block_size=[128, 64]: a block 64 columns wide"),
    "block not a pair": (lambda qc: qc.update(weight_block_size=[128]), "weight_block_size=[128]: must be [rows, columns]"),
    "unknown method": (lambda qc: qc.update(quant_method="fp6"), "quant_method='fp6'"),
    "fp4 experts": (lambda qc: qc.update(expert_dtype="fp4"), "expert_dtype='fp4'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_unsupported_configs_are_refused_with_the_reason(tmp_path, fp8_sources, case):
    edit, words = BAD_CONFIGS[case]
    src = copy_checkpoint(fp8_sources("deepseek_v3_f32"), tmp_path / "src")
    edit_quantization_config(src, edit)
    with pytest.raises(MoepackError, match="no reader handles it") as ei:
        moepack.convert(src, tmp_path / "dst")
    assert words in str(ei.value), str(ei.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_any_block_height_and_edge_blocks(tmp_path, fp8_sources):
    """bn = 96 (qwen3_moe_bf16): a block's scale covers its 96 rows, the edge block its real
    rows only; every row's canonical scale is its block's, bit for bit."""
    d = fp8_sources("qwen3_moe_bf16")
    sd = load_file(str(d / "model.safetensors"))
    ckpt, reader = open_source(d)
    s = reader.layers(ckpt)[0]
    m = s.names[(2, "down", "weight")][: -len(".weight")]
    c = reader.read_expert_canonical(ckpt, s, "w2", 2)
    sc = sd[m + ".weight_scale_inv"].float()  # [ceil(320 / 96) = 4, ceil(200 / 128) = 2]
    assert tuple(sc.shape) == (4, 2) and tuple(c["w2_scale"].shape) == (320, 2)
    for r in (0, 95, 96, 191, 288, 319):
        assert torch.equal(c["w2_scale"][r], sc[r // 96]), r


def test_modules_the_config_leaves_in_float(tmp_path, fp8_sources):
    """modules_to_not_convert naming a module stored in FP8 is refused (config and weights
    disagree); naming float modules (the router) is fine, and so is a float shared expert."""
    src = copy_checkpoint(fp8_sources("deepseek_v3_f32"), tmp_path / "src")
    edit_quantization_config(src, lambda qc: qc.update(modules_to_not_convert=["lm_head", "mlp.gate", "gate", "model.layers.0.mlp",
                                                                       "re:nothing"]))  # fmt: skip
    ckpt, reader = open_source(src)
    assert reader.layers(ckpt)  # the router, lm_head and the dense layer 0 are float; "gate" is not "gate_proj"
    for key in ("experts.2.down_proj", "model.layers.1", r"model\.layers\.\d+\.mlp\.experts\.2"):
        edit_quantization_config(src, lambda qc: qc.update(modules_to_not_convert=[key]))
        with pytest.raises(MoepackError, match=r"experts\.[0-9]\.(gate|down)_proj.weight' is F8_E4M3, but the config leaves"):
            moepack.convert(src, tmp_path / "dst")
        assert not (tmp_path / "dst").exists()


def test_mtp_layer_is_skipped_and_recorded(fp8_sources):
    d = fp8_sources("deepseek_v3_f32")
    ckpt, reader = open_source(d)
    assert [s.index for s in reader.layers(ckpt)] == [1]  # layer 2 (MTP) has experts too, deliberately not a layer
    names, why = reader.skipped(ckpt)
    assert names == sorted(n for n in ckpt.tensors if n.startswith("model.layers.2."))
    assert any(".mlp.experts." in n for n in names) and "num_nextn_predict_layers=1" in why


def _ct_group(qc):
    return qc["config_groups"]["group_0"]


CT_BAD_CONFIGS = {
    "group strategy": (lambda qc: _ct_group(qc)["weights"].update(strategy="group", group_size=128, block_structure=None),
                       "strategy='group': moepack reads FP8 weights with block, channel or tensor scales"),
    "block 64 wide": (lambda qc: _ct_group(qc)["weights"].update(block_structure=[128, 64]), "block_structure=[128, 64]: a block 64 columns wide"),
    "int weights": (lambda qc: _ct_group(qc)["weights"].update(type="int"), "type='int': float-quantized FP8 weights are 8-bit float"),
    "4-bit float": (lambda qc: _ct_group(qc)["weights"].update(num_bits=4), "num_bits=4"),
    "not compressed": (lambda qc: qc.update(quantization_status="frozen"), "quantization_status='frozen'"),
    "group not an object": (lambda qc: qc["config_groups"].update(group_0=["Linear"]),
                            "config group 'group_0' is list ['Linear']: a config group is a JSON object"),
    "weights not an object": (lambda qc: _ct_group(qc).update(weights=8),
                              "config group 'group_0' weights is int 8: the weights' quantization args are a JSON object"),
    "activations not an object": (lambda qc: _ct_group(qc).update(input_activations="fp8"),
                                  "config group 'group_0' input_activations is str 'fp8': a JSON object or null"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CT_BAD_CONFIGS))
def test_ct_unsupported_configs_are_refused_with_the_reason(tmp_path, fp8_sources, case):
    edit, words = CT_BAD_CONFIGS[case]
    src = copy_checkpoint(fp8_sources("ct_FP8_BLOCK"), tmp_path / "src")
    edit_quantization_config(src, edit)
    with pytest.raises(MoepackError, match="no reader handles it") as ei:
        moepack.convert(src, tmp_path / "dst")
    assert words in str(ei.value), str(ei.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_ct_channel_scale_shape_is_checked(tmp_path, fp8_sources):
    src = copy_checkpoint(fp8_sources("ct_FP8_DYNAMIC"), tmp_path / "src")
    m = "model.layers.1.mlp.experts.3.gate_proj"
    edit_tensors(src, lambda sd: sd.update({m + ".weight_scale": sd[m + ".weight_scale"].repeat(1, 2)}))
    with pytest.raises(SourceError, match=rf"{re.escape(m)}.weight_scale' has shape \[200, 2\]: expected \[200, 1\] \(one scale per output channel"):
        moepack.convert(src, tmp_path / "dst")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_weight_block_size_absent_or_null_as_transformers_reads_it(tmp_path, fp8_sources):
    """The key absent is transformers' default [128, 128] for the experts and the carried Linears
    alike (the Linears took it as per-tensor and refused the block scales); an explicit null is
    per-tensor for both (the experts took it as [128, 128])."""
    from moepack.sources import linears

    src = copy_checkpoint(fp8_sources("deepseek_v3_f32"), tmp_path / "src")
    edit_quantization_config(src, lambda qc: qc.pop("weight_block_size"))
    ckpt, reader = open_source(src)
    specs = reader.layers(ckpt)
    assert specs and all(s.quant.block == (128, 128) for s in specs)
    attn = [lin for lin in linears.find_linears(ckpt).values() if ".self_attn." in lin.prefix]
    assert attn and {lin.scale_rule for lin in attn} == {("block", 128, 128)}
    src2 = tmp_path / "null"
    shutil.copytree(src, src2)
    edit_quantization_config(src2, lambda qc: qc.update(weight_block_size=None))
    ckpt2, reader2 = open_source(src2)
    with pytest.raises(SourceError, match=r"weight_scale_inv' has shape \[\d+, \d+\]: expected \[1\] \(one scale for the tensor"):
        reader2.layers(ckpt2)
    with pytest.raises(SourceError, match=r"with weight_block_size null a scale_inv is one value per tensor"):
        linears.find_linears(ckpt2)
    # per-tensor scale_inv [1] everywhere: converts exactly into the per-channel layout
    edit_tensors(src2, lambda sd: sd.update({k: v.float().amax().reshape(1) for k, v in sd.items() if k.endswith("_scale_inv")}))
    report = moepack.convert(src2, tmp_path / "dst")
    assert report.layout == "f8ch_n32k2_x86"
    assert moepack.verify(tmp_path / "dst", source=src2).ok


@pytest.mark.parametrize("where", ["ignore", "targets"])
def test_ct_regex_that_is_not_one_is_refused_by_name(tmp_path, fp8_sources, where):
    """A compressed-tensors 're:' entry that is not a regular expression (in ``ignore``, or a
    config group's ``targets``, which the carried-Linear reader matches) is a one-line
    SourceError naming it, nothing written (it was a raw re.error)."""
    src = copy_checkpoint(fp8_sources("ct_FP8_BLOCK"), tmp_path / "src")
    if where == "ignore":
        edit_quantization_config(src, lambda qc: qc.update(ignore=["lm_head", "re:(unclosed"]))
        words = "quantization_config ignore entry 're:(unclosed': not a regular expression"
    else:
        edit_quantization_config(src, lambda qc: _ct_group(qc).update(targets=["re:(unclosed", "Linear"]))
        words = "config_groups target 're:(unclosed': not a regular expression"
    with pytest.raises(SourceError) as ei:
        moepack.convert(src, tmp_path / "dst")
    assert words in str(ei.value), str(ei.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _pow2(t: torch.Tensor) -> torch.Tensor:
    """Each scale rounded up to a power of two (what a UE8M0 byte holds), as float32."""
    return torch.exp2(torch.ceil(torch.log2(t.float())))


def test_ue8m0_expert_scales_read_as_their_powers_of_two(tmp_path, fp8_sources):
    """DeepSeek-style UE8M0 scales (``scale_fmt: "ue8m0"``, F8_E8M0 tensors: one byte 2^(b-127)),
    experts and attention alike: the pack is the one of the same checkpoint with those powers of
    two stored as F32, tensor for tensor but the carried scales (kept as stored, bytes of their
    own dtype); verify --source passes; an 0xFF byte (NaN) is refused by name."""
    base = fp8_sources("deepseek_v3_f32")
    scales = [n for n in load_file(str(base / "model.safetensors")) if n.endswith(".weight_scale_inv")]
    assert any(".mlp.experts." in n for n in scales) and any(".self_attn." in n for n in scales)  # the premise
    srcs = {}
    for name, dt in (("f32", torch.float32), ("e8m0", torch.float8_e8m0fnu)):
        d = copy_checkpoint(base, tmp_path / f"src_{name}")
        edit_tensors(d, lambda sd, dt=dt: sd.update({n: _pow2(sd[n]).to(dt) for n in scales}))
        edit_quantization_config(d, lambda qc: qc.update(scale_fmt="ue8m0"))
        srcs[name] = d
    e8 = load_file(str(srcs["e8m0"] / "model.safetensors"))
    assert all(e8[n].dtype == torch.float8_e8m0fnu for n in scales)
    packs = {k: tmp_path / f"pack_{k}" for k in srcs}
    for k, v in srcs.items():
        moepack.convert(v, packs[k])
    m32, m8 = (json.loads((packs[k] / "moepack.json").read_text())["tensors"] for k in ("f32", "e8m0"))
    assert m32.keys() == m8.keys()
    experts = [n for n in m32 if n.startswith("moepack.")]
    assert experts and all(m32[n]["sha256"] == m8[n]["sha256"] for n in experts)
    carried = [n for n in m32 if n in scales]
    assert carried and all((m32[n]["dtype"], m8[n]["dtype"]) == ("float32", "float8_e8m0fnu") for n in carried)
    assert moepack.verify(packs["e8m0"], source=srcs["e8m0"]).ok
    bad = copy_checkpoint(srcs["e8m0"], tmp_path / "bad")
    name = next(n for n in scales if ".mlp.experts." in n)

    def nan_byte(sd):
        q = sd[name].view(torch.uint8).clone()
        q[0, 0] = 0xFF
        sd[name] = q.view(torch.float8_e8m0fnu)

    edit_tensors(bad, nan_byte)
    with pytest.raises(MoepackError, match=re.escape(f"tensor {name!r}[0, 0] = nan: scales must be finite and > 0")):
        moepack.convert(bad, tmp_path / "bad_pack")


@pytest.mark.parametrize("key,entry", [("modules_to_not_convert", "experts"), ("modules_to_not_convert", "mlp.experts"),
                                       ("ignored_layers", "experts")])  # fmt: skip
def test_config_leaving_the_fused_experts_in_float_is_refused(tmp_path, fp8_sources, key, entry):
    """transformers 5 holds modules_to_not_convert against the fused ``<block>.experts`` module: an
    entry naming it leaves every expert in float there, so FP8 expert weights beside it are a
    contradiction, refused naming the tensor, the module and the entry; nothing is written."""
    src = copy_checkpoint(fp8_sources("deepseek_v3_f32"), tmp_path / "src")
    edit_quantization_config(src, lambda qc: qc.update({key: [entry]}))
    with pytest.raises(MoepackError) as ei:
        moepack.convert(src, tmp_path / "dst")
    msg = str(ei.value)
    assert "'model.layers.1.mlp.experts' (the experts, as transformers fuses them) unquantized" in msg, msg
    assert f"({entry!r})" in msg and "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("value", [0, 3])
def test_ct_fp8_expert_zero_point_must_be_zero(tmp_path, fp8_sources, value):
    """A compressed-tensors FP8 expert carrying a ``weight_zero_point``: all zero is consumed (the
    same pack as without it, not carried); a nonzero one was accepted and silently dropped, and is
    now refused naming the tensor, the index and the value, nothing written (issue 49)."""
    base = fp8_sources("ct_FP8_DYNAMIC")
    src = copy_checkpoint(base, tmp_path / "src")
    mod = "model.layers.0.mlp.experts.1.up_proj"
    n = load_file(str(base / "model.safetensors"))[mod + ".weight"].shape[0]

    def add(sd):
        z = torch.zeros(n, 1, dtype=torch.int8)
        z[2, 0] = value
        sd[mod + ".weight_zero_point"] = z

    edit_tensors(src, add)
    if value:
        with pytest.raises(MoepackError, match=re.escape(f"tensor '{mod}.weight_zero_point'[2, 0] = 3.0: FP8 weights have no zero point")):
            moepack.convert(src, tmp_path / "dst")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
        return
    moepack.convert(src, tmp_path / "dst")
    moepack.convert(base, tmp_path / "ref")
    m, ref = (json.loads((tmp_path / d / "moepack.json").read_text())["tensors"] for d in ("dst", "ref"))
    assert m.keys() == ref.keys() and all(m[k]["sha256"] == ref[k]["sha256"] for k in m)
