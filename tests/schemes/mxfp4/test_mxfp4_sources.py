"""The MXFP4 source readers (moepack/sources/mxfp4.py) against independent oracles.

* gpt-oss MXFP4 (FORMATS.md §5): a tiny gpt_oss model from a transformers config (H = 64, I = 96,
  E = 3), its experts encoded by tools/mxfp4_checkpoint.py (the OCP reference rule, no moepack
  inside; checked here against a scalar transcription of the rule), decoded by transformers' own
  ``integrations.mxfp4.convert_moe_packed_tensors`` (after its transpose): the reader's canonical
  codes and scales decoded by moepack.schemes.mxfp4.codec equal it bit for bit. The bf16 layout
  the dense reader takes (the same model, its experts dequantized by transformers) gives the same
  layer as the MXFP4 one.
* compressed-tensors ``mxfp4-pack-quantized`` (§3.4): a tiny qwen2_moe (shared expert included)
  whose every Linear but embeddings, norms and routers is compressed by compressed-tensors 0.20.1
  itself on CPU (MXFP4A16); the reader's experts and the carried attention Linears
  (moepack/sources/linears.py) equal the library's own decompression.
* Every refusal: e8m0 = 255 with its first index, blocks / scales whose shapes disagree with each
  other or with config.json, H or I not a multiple of 32 (gpt-oss), unknown quant_method and
  format variants, the config leaving quantized experts unquantized; each one line, and convert
  leaves nothing behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import transformers  # noqa: F401  (a test dependency: fails here, not later, where it is missing)

import moepack  # noqa: E402
from moepack.errors import MoepackError, SourceError  # noqa: E402
from moepack.schemes.mxfp4.codec import E2M1_VALUES, dequantize_mxfp4  # noqa: E402
from moepack.sources import Checkpoint, linears, open_source  # noqa: E402
from tests.support.ct_writer import CT_KEEP, write_ct_checkpoint  # noqa: E402
from tests.support.fixtures_util import fixture_dir  # noqa: E402
from tests.support.ckpt_edit import copy_checkpoint, edit_tensors, edit_config, set_element

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("mxfp4_checkpoint", ROOT / "tools" / "mxfp4_checkpoint.py")
MX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(MX)

GPT_OSS = dict(hidden_size=64, intermediate_size=96, head_dim=32, num_local_experts=3)
QWEN2 = dict(hidden_size=64, moe_intermediate_size=96, shared_expert_intermediate_size=64, intermediate_size=64, num_experts=3)


def float_checkpoint(d: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    """A float checkpoint written by transformers' save_pretrained from a tiny seeded config (the
    fixture's config with ``overrides``)."""
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


def hf_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' own MXFP4 decoding (fp32), back in [E, N, K] (it returns x @ W's [E, K, N])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)


def write_ct_mxfp4(src: Path, dst: Path) -> list[str]:
    """A compressed-tensors mxfp4-pack-quantized checkpoint of ``src``'s Linear weights (every 2-D
    weight but embeddings, lm_head, norms and routers), written by compressed-tensors 0.20.1 on CPU
    (preset MXFP4A16), the scales from each group's amax through its calculate_qparams (its
    observers live in llm-compressor). Returns the quantized module names."""
    return write_ct_checkpoint(src, dst, "MXFP4A16", lambda mod: mod.weight.float().unflatten(1, (-1, 32)).abs().amax(-1))


def ct_oracle(d: Path, module: str) -> torch.Tensor:
    """compressed-tensors' own decompression of one module of the checkpoint ``d`` (bf16)."""
    from compressed_tensors.compressors import decompress_module
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    qc = QuantizationConfig.model_validate(json.loads((d / "config.json").read_text())["quantization_config"])
    sd = load_file(str(d / "model.safetensors"))
    packed = sd[module + ".weight_packed"]
    root = torch.nn.Module()
    root.add_module("m", torch.nn.Linear(2 * packed.shape[1], packed.shape[0], bias=False, dtype=torch.bfloat16))
    qc.config_groups["group_0"].targets = ["Linear"]
    apply_quantization_config(root, qc)
    mod = root.m
    mod.weight_packed = torch.nn.Parameter(packed.clone(), requires_grad=False)
    mod.weight_scale = torch.nn.Parameter(sd[module + ".weight_scale"].clone(), requires_grad=False)
    if hasattr(mod, "weight"):
        del mod.weight
    decompress_module(mod)
    return mod.weight.data


CT_MXFP4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized", "input_activations": None,
                                  "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 32,
                                              "strategy": "group", "dynamic": False, "scale_dtype": "torch.uint8"}}},
    "ignore": ["lm_head"],
}  # fmt: skip


def write_ragged_ct_mxfp4(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """mxfp4-pack-quantized by hand, for K that compressed-tensors itself refuses to compress (not
    a multiple of 32: fixtures/qwen3_moe, H = 72, I = 40): each Linear (as write_ct_mxfp4 picks
    them) zero-padded to whole groups, encoded by tools/mxfp4_checkpoint.py's OCP rule, the codes
    cut back to K (packed two a byte, low nibble = even k), the ceil(K/32) scales kept: the
    format's partial last group. Returns {module: its decoded fp32 weight}."""
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    out, want = {}, {}
    for n, t in sd.items():
        if not (n.endswith(".weight") and t.dim() == 2 and not CT_KEEP.search(n)):
            out[n] = t
            continue
        m, (rows, k) = n[: -len(".weight")], t.shape
        pad = torch.zeros(rows, -(-k // 32) * 32)
        pad[:, :k] = t.float()
        codes, scales = MX.quantize_mxfp4(pad)
        codes = codes[:, :k]
        out[m + ".weight_packed"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        out[m + ".weight_scale"] = scales
        want[m] = MX.dequantize_blocks(MX.pack_blocks(MX.quantize_mxfp4(pad)[0]), scales)[:, :k]
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = CT_MXFP4_CONFIG
    (dst / "config.json").write_text(json.dumps(cfg))
    return want


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> a checkpoint directory, written on first use: "gpt_oss_bf16" (transformers), "gpt_oss"
    (tools/mxfp4_checkpoint.py of it), "gpt_oss_deq" (the MXFP4 experts dequantized by transformers,
    bf16 in the dense layout), "qwen2_bf16", "ct" (compressed-tensors MXFP4A16 of qwen2_bf16),
    "ct_ragged" (write_ragged_ct_mxfp4 of fixtures/qwen3_moe; ``get.ragged``: its decoded weights)."""
    root = tmp_path_factory.mktemp("mxsrc")
    made = {}

    def get(name: str) -> Path:
        if name in made:
            return made[name]
        d = root / name
        if name == "gpt_oss_bf16":
            float_checkpoint(d, "gpt_oss", **GPT_OSS)
        elif name == "gpt_oss":
            MX.write_mxfp4_checkpoint(get("gpt_oss_bf16"), d)
        elif name == "gpt_oss_deq":
            src = get("gpt_oss")
            sd = load_file(str(src / "model.safetensors"))
            out = {}
            for n, t in sd.items():
                if n.endswith("_blocks"):
                    base = n[: -len("_blocks")]
                    out[base] = hf_decode(t, sd[base + "_scales"]).transpose(1, 2).to(torch.bfloat16).contiguous()
                elif not n.endswith("_scales"):
                    out[n] = t
            d.mkdir()
            save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
            cfg = json.loads((src / "config.json").read_text())
            cfg.pop("quantization_config")
            (d / "config.json").write_text(json.dumps(cfg))
        elif name == "qwen2_bf16":
            float_checkpoint(d, "qwen2_moe", **QWEN2)
        elif name == "ct":
            write_ct_mxfp4(get("qwen2_bf16"), d)
        elif name == "ct_gpt_oss":  # llm-compressor's linearized gpt-oss: per expert, gate/up de-interleaved
            lin = d.parent / "gpt_oss_linearized"
            lin.mkdir()
            sd = load_file(str(get("gpt_oss_bf16") / "model.safetensors"))
            out = {}
            for n, t in sd.items():
                m = re.match(r"^(.*\.experts)\.(gate_up_proj|down_proj)(_bias)?$", n)
                if m is None:
                    out[n] = t
                    continue
                for e in range(t.shape[0]):
                    p = f"{m[1]}.{e}."
                    if m[2] == "down_proj":
                        out[p + "down_proj" + (".bias" if m[3] else ".weight")] = (t[e] if m[3] else t[e].t()).contiguous()
                    elif m[3]:
                        out[p + "gate_proj.bias"], out[p + "up_proj.bias"] = t[e, 0::2].contiguous(), t[e, 1::2].contiguous()
                    else:
                        out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t[e][:, 0::2].t().contiguous(), t[e][:, 1::2].t().contiguous()
            save_file(out, str(lin / "model.safetensors"), metadata={"format": "pt"})
            shutil.copy(get("gpt_oss_bf16") / "config.json", lin / "config.json")
            write_ct_mxfp4(lin, d)
        elif name == "ct_ragged":
            get.ragged = write_ragged_ct_mxfp4(fixture_dir("qwen3_moe"), d)
        else:
            raise KeyError(name)
        made[name] = d
        return d

    return get


# --------------------------------------------------------------------------- the writer


def _ocp_scalar(block: list[float]) -> tuple[list[int], int]:
    """The OCP MX v1.0 reference rule for one block of 32, transcribed element by element: e8m0
    byte of floor(log2(amax)) - 2, each element to the nearest e2m1 value, ties to the even code,
    saturating at 6."""
    import math

    amax = max(abs(v) for v in block)
    e = 127 if amax == 0 else min(254, max(0, math.floor(math.log2(amax)) - 2 + 127))
    x = 2.0 ** (e - 127)
    codes = []
    for v in block:
        a = abs(v) / x
        best = None
        for c, g in enumerate(E2M1_VALUES[:8]):
            d = abs(a - g)
            if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
                best = (d, c)
        c = 7 if a >= 6 else best[1]
        codes.append(c | (8 if math.copysign(1.0, v) < 0 else 0))
    return codes, e


def test_writer_follows_the_ocp_rule():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 128, generator=g) * torch.logspace(-4, 2, 128)
    w[0, :32] = 0.0  # an all-zero block: scale 1, codes 0
    w[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.9, 8.0] + [0.0] * 21)  # ties, saturation
    w[2, 32:64] = torch.tensor([2.0**-130] * 32)  # below e8m0's range: scale 2^-127, the elements round
    w[3, 64:96] = -0.0
    codes, scales = MX.quantize_mxfp4(w)
    for r in range(w.shape[0]):
        for b in range(4):
            want_c, want_e = _ocp_scalar(w[r, 32 * b : 32 * b + 32].tolist())
            assert int(scales[r, b]) == want_e, (r, b)
            assert codes[r, 32 * b : 32 * b + 32].tolist() == want_c, (r, b)
    assert int(scales[0, 0]) == 127 and codes[0, :32].tolist() == [0] * 32
    blocks = MX.pack_blocks(codes)
    assert tuple(blocks.shape) == (6, 4, 16) and int(blocks[1, 0, 0]) == codes[1, 0] | codes[1, 1] << 4
    # the writer's decode is the format's: transformers' own
    deq = MX.dequantize_blocks(blocks[None], scales[None])[0]
    assert torch.equal(deq, hf_decode(blocks[None], scales[None])[0])
    assert torch.equal(deq, dequantize_mxfp4(codes, scales))
    with pytest.raises(ValueError, match="K=40 is not a multiple of 32"):
        MX.quantize_mxfp4(torch.ones(2, 40))


def test_writer_checkpoint_follows_formats_md(sources):
    d, src = sources("gpt_oss"), sources("gpt_oss_bf16")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "mxfp4", "modules_to_not_convert": MX.MODULES_TO_NOT_CONVERT}
    sd, bf = load_file(str(d / "model.safetensors")), load_file(str(src / "model.safetensors"))
    e, h, i = 3, 64, 96
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}.mlp.experts."
        assert sd[p + "gate_up_proj_blocks"].dtype == torch.uint8 and tuple(sd[p + "gate_up_proj_blocks"].shape) == (e, 2 * i, h // 32, 16)
        assert tuple(sd[p + "gate_up_proj_scales"].shape) == (e, 2 * i, h // 32)
        assert tuple(sd[p + "down_proj_blocks"].shape) == (e, h, i // 32, 16) and tuple(sd[p + "down_proj_scales"].shape) == (e, h, i // 32)
        assert p + "gate_up_proj" not in sd and torch.equal(sd[p + "gate_up_proj_bias"], bf[p + "gate_up_proj_bias"])
        want = bf[p + "gate_up_proj"].float().transpose(1, 2)
        got = hf_decode(sd[p + "gate_up_proj_blocks"], sd[p + "gate_up_proj_scales"])
        assert float((got - want).norm() / want.norm()) < 0.2  # OCP's floored scale: ~10% on bell-shaped weights
    kept = {n for n in sd if not n.endswith(("_blocks", "_scales"))}
    assert kept == {n for n in bf if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    with pytest.raises(ValueError, match="hidden_size=72 is not a multiple of 32"):
        MX.write_mxfp4_checkpoint(fixture_dir("gpt_oss"), Path(str(d) + "-x"))
    with pytest.raises(ValueError, match="already quantized"):
        MX.write_mxfp4_checkpoint(d, Path(str(d) + "-y"))


def test_transformers_loads_the_written_checkpoint(sources):
    """transformers' own MXFP4 loader (Mxfp4Config(dequantize=True), the CPU path) reads the
    written directory: its experts are the reader's decoded codes."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    d = sources("gpt_oss")
    m = AutoModelForCausalLM.from_pretrained(str(d), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32)
    ckpt, reader = open_source(d)
    for s in reader.layers(ckpt):
        layer = reader.read_layer(ckpt, s)
        ex = m.model.layers[s.index].mlp.experts
        assert torch.equal(ex.gate_up_proj.transpose(1, 2), layer.w13) and torch.equal(ex.down_proj.transpose(1, 2), layer.w2)


# --------------------------------------------------------------------------- gpt-oss reader


def test_gpt_oss_reader_matches_transformers_decoding(sources):
    d = sources("gpt_oss")
    sd = load_file(str(d / "model.safetensors"))
    ckpt, reader = open_source(d)
    assert reader.name == "mxfp4-gpt-oss" and reader.scheme == "mxfp4"
    specs = reader.layers(ckpt)
    assert [s.index for s in specs] == [0, 1]
    for s in specs:
        assert (s.num_experts, s.hidden, s.intermediate, s.interleaved, s.has_bias, s.activation) == (3, 64, 96, True, True, "swigluoai")
        assert s.quant.format == "gpt_oss" and s.quant.group_size == 32 and s.dtype == "E2M1"
        assert s.router == {"weight": f"{s.prefix}.router.weight", "bias": f"{s.prefix}.router.bias"}
        p = s.prefix + ".experts."
        assert set(s.expert_tensors) == {p + x for x in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                                                         "down_proj_blocks", "down_proj_scales", "down_proj_bias")}  # fmt: skip
        layer = reader.read_layer(ckpt, s)
        c = layer.canonical
        assert c["w13_q"].dtype == torch.uint8 and tuple(c["w13_q"].shape) == (3, 192, 64) and int(c["w13_q"].max()) <= 15
        assert tuple(c["w13_scale"].shape) == (3, 192, 2) and tuple(c["w2_q"].shape) == (3, 64, 96) and tuple(c["w2_scale"].shape) == (3, 64, 3)
        for w, which in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            blocks, scales = sd[p + which + "_blocks"], sd[p + which + "_scales"]
            assert torch.equal(MX.pack_blocks(c[f"{w}_q"]), blocks) and torch.equal(c[f"{w}_scale"], scales)  # as stored
            oracle = hf_decode(blocks, scales)
            assert torch.equal(dequantize_mxfp4(c[f"{w}_q"], c[f"{w}_scale"]), oracle)
            assert torch.equal(getattr(layer, w), oracle)
            for e in range(3):
                one = reader.read_expert_w13(ckpt, s, e) if w == "w13" else reader.read_expert_w2(ckpt, s, e)
                assert torch.equal(one, oracle[e])
        b13, b2 = reader.read_biases(ckpt, s)
        assert torch.equal(b13, sd[p + "gate_up_proj_bias"]) and torch.equal(b2, sd[p + "down_proj_bias"])


def test_bf16_and_mxfp4_gpt_oss_give_the_same_layer(sources):
    """The same model as bf16 (the dense reader's layout, its experts transformers' decoding of
    the blocks) and as MXFP4: the same layers, weights, biases, router, activation and order."""
    ck_d, dense = open_source(sources("gpt_oss_deq"))
    ck_m, mx = open_source(sources("gpt_oss"))
    assert dense.name == "dense"
    for sd_, sm in zip(dense.layers(ck_d), mx.layers(ck_m), strict=True):
        for f in ("index", "prefix", "num_experts", "hidden", "intermediate", "interleaved", "has_bias", "activation", "router", "shared"):
            assert getattr(sd_, f) == getattr(sm, f), f
        a, b = dense.read_layer(ck_d, sd_), mx.read_layer(ck_m, sm)
        assert torch.equal(a.w13.float(), b.w13) and torch.equal(a.w2.float(), b.w2)
        assert torch.equal(a.w13_bias, b.w13_bias) and torch.equal(a.w2_bias, b.w2_bias)
        for e in range(sm.num_experts):
            assert torch.equal(dense.read_expert_w13(ck_d, sd_, e).float(), mx.read_expert_w13(ck_m, sm, e))
            assert torch.equal(dense.read_expert_w2(ck_d, sd_, e).float(), mx.read_expert_w2(ck_m, sm, e))


# --------------------------------------------------------------------------- compressed-tensors reader


def test_ct_mxfp4_reader_matches_compressed_tensors(sources):
    d = sources("ct")
    sd = load_file(str(d / "model.safetensors"))
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["config_groups"]["group_0"]["weights"]["scale_dtype"] == "torch.uint8"
    ckpt, reader = open_source(d)
    assert reader.name == "compressed-tensors-mxfp4-pack-quantized" and reader.scheme == "mxfp4"
    specs = reader.layers(ckpt)
    assert [s.index for s in specs] == [0, 1]
    for s in specs:
        assert s.quant.format == "mxfp4-pack-quantized" and s.quant.shared is not None and s.dtype == "E2M1"
        i = s.intermediate
        layer = reader.read_layer(ckpt, s)
        for e in range(s.num_experts):
            for role, rows, w in (("gate", slice(0, i), "w13"), ("up", slice(i, 2 * i), "w13"), ("down", slice(None), "w2")):
                m = s.names[(e, role, "module")]
                assert torch.equal(MX.pack_blocks(layer.canonical[f"{w}_q"][e][rows]).flatten(-2), sd[m + ".weight_packed"])
                assert torch.equal(layer.canonical[f"{w}_scale"][e][rows], sd[m + ".weight_scale"])
                ours = getattr(layer, w)[e][rows]
                oracle = ct_oracle(d, m)
                assert torch.equal(ours.to(oracle.dtype), oracle), f"{m}: differs from compressed-tensors' decompression"
        w13, w2 = reader.read_shared(ckpt, s)
        c = reader.read_shared_canonical(ckpt, s)
        si = s.shared["intermediate"]
        assert tuple(c["w13_q"].shape) == (1, 2 * si, 64) and tuple(c["w2_scale"].shape) == (1, 64, si // 32)
        for name, got in (("gate_proj", w13[0, :si]), ("up_proj", w13[0, si:]), ("down_proj", w2[0])):
            oracle = ct_oracle(d, f"{s.prefix}.shared_expert.{name}")
            assert torch.equal(got.to(oracle.dtype), oracle), name


def test_ct_mxfp4_attention_linears_match_compressed_tensors(sources):
    """The carried attention Linears of the compressed-tensors checkpoint: found as codec mxfp4 and
    dequantized (moepack/sources/linears.py, as load_model does) equal to the library's own."""
    d = sources("ct")
    ckpt = Checkpoint(d)
    view = linears.CarriedView(ckpt, [n for n in ckpt.tensors if ".mlp.experts." not in n and ".shared_expert." not in n])
    lins = linears.find_linears(view)
    assert lins and all(".self_attn." in p for p in lins) and {lin.codec for lin in lins.values()} == {"mxfp4"}
    assert len(lins) == 8  # q, k, v, o of two layers
    for p, lin in lins.items():
        assert torch.equal(linears.dequantize_linear(view, lin).to(torch.bfloat16), ct_oracle(d, p)), p


def test_ct_linearized_gpt_oss_is_re_interleaved(sources):
    """gpt-oss as llm-compressor writes it (per expert, gate and up de-interleaved, biases per
    Linear, the router float): the reader
    re-interleaves codes, scales and biases into swigluoai's order, which is the bf16 layout's."""
    d = sources("ct_gpt_oss")
    bf = load_file(str(sources("gpt_oss_bf16") / "model.safetensors"))
    ckpt, reader = open_source(d)
    assert reader.name == "compressed-tensors-mxfp4-pack-quantized"
    for s in reader.layers(ckpt):
        assert s.interleaved and s.activation == "swigluoai" and s.has_bias and s.router.get("bias")
        layer = reader.read_layer(ckpt, s)
        p = s.prefix + ".experts."
        assert torch.equal(layer.w13_bias, bf[p + "gate_up_proj_bias"]) and torch.equal(layer.w2_bias, bf[p + "down_proj_bias"])
        for e in range(s.num_experts):
            g, u = ct_oracle(d, f"{p}{e}.gate_proj"), ct_oracle(d, f"{p}{e}.up_proj")
            assert torch.equal(layer.w13[e, 0::2].to(g.dtype), g) and torch.equal(layer.w13[e, 1::2].to(u.dtype), u)
            q = reader.read_expert_canonical(ckpt, s, "w13", e)
            assert torch.equal(q["w13_scale"][1::2], load_file(str(d / "model.safetensors"))[f"{p}{e}.up_proj.weight_scale"])


def test_ct_partial_last_group(sources):
    """K not a multiple of 32 (H = 72, I = 40): ceil(K/32) scales, the last group partial; the
    experts and the attention Linears decode to the encoder's values."""
    d = sources("ct_ragged")
    want = sources.ragged
    ckpt, reader = open_source(d)
    specs = reader.layers(ckpt)
    assert specs and all((s.hidden, s.intermediate) == (72, 40) for s in specs)
    for s in specs:
        i = s.intermediate
        layer = reader.read_layer(ckpt, s)
        assert tuple(layer.canonical["w13_scale"].shape[1:]) == (80, 3) and tuple(layer.canonical["w2_scale"].shape[1:]) == (72, 2)
        for e in range(s.num_experts):
            for role, rows, w in (("gate", slice(0, i), "w13"), ("up", slice(i, 2 * i), "w13"), ("down", slice(None), "w2")):
                assert torch.equal(getattr(layer, w)[e][rows], want[s.names[(e, role, "module")]])
    view = linears.CarriedView(ckpt, [n for n in ckpt.tensors if ".self_attn." in n])
    lins = linears.find_linears(view)
    assert len(lins) == 8 and {lin.codec for lin in lins.values()} == {"mxfp4"}
    for p, lin in lins.items():
        assert torch.equal(linears.dequantize_linear(view, lin), want[p]), p


# --------------------------------------------------------------------------- refusals


def _refused(tmp_path: Path, src: Path, words: list[str]) -> str:
    """The reader refuses ``src`` (opening it, listing or reading its layers) in one line holding
    ``words``, and so does convert, which leaves nothing behind."""
    with pytest.raises(MoepackError) as ei:
        ckpt, reader = open_source(src)
        for s in reader.layers(ckpt):
            reader.read_layer(ckpt, s)
    msg = str(ei.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg}"
    with pytest.raises(MoepackError) as ei2:
        moepack.convert(src, tmp_path / "dst")
    for w in words:
        assert w in str(ei2.value), f"{w!r} not in {ei2.value}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "a refused convert leaves nothing behind"
    return msg


GU = "model.layers.1.mlp.experts.gate_up_proj"
DN = "model.layers.0.mlp.experts.down_proj"


GPT_OSS_BAD = {
    "nan scale": (set_element(GU + "_scales", (1, 5, 0), 255), [f"'{GU}_scales'[1, 5, 0] = 255", "e8m0 NaN scale"]),
    "nan down scale": (set_element(DN + "_scales", (2, 63, 2), 255), [f"'{DN}_scales'[2, 63, 2] = 255"]),
    "scales disagree with blocks": (lambda sd: sd.update({GU + "_scales": sd[GU + "_scales"][:, :, :1].contiguous()}),
                                    [f"'{GU}_scales' has shape [3, 192, 1]: expected [3, 192, 2]", "one e8m0 scale per block"]),
    "block of 15 bytes": (lambda sd: sd.update({DN + "_blocks": sd[DN + "_blocks"][..., :15].contiguous()}),
                          [f"'{DN}_blocks' has shape [3, 64, 3, 15]", "16 bytes = 32 e2m1 codes per block"]),
    "blocks disagree with H": (lambda sd: sd.update({GU + "_blocks": sd[GU + "_blocks"][:, :, :1].contiguous(),
                                                     GU + "_scales": sd[GU + "_scales"][:, :, :1].contiguous()}),
                               [f"'{GU}_blocks' has shape [3, 192, 1, 16]: expected [3, 192, 2, 16]", "hidden_size=64"]),
    "blocks disagree with I": (lambda sd: sd.update({DN + "_blocks": sd[DN + "_blocks"][:, :, :2].contiguous(),
                                                     DN + "_scales": sd[DN + "_scales"][:, :, :2].contiguous()}),
                               [f"'{DN}_blocks' has shape [3, 64, 2, 16]: expected [3, 64, 3, 16]"]),
    "fewer experts than the config": (lambda sd: sd.update({k: sd[k][:2].contiguous() for k in list(sd) if ".layers.1.mlp.experts." in k}),
                                      [f"'{GU}_blocks' has shape [2, 192, 2, 16]: 2 experts, config.json says 3"]),
    "scales missing": (lambda sd: sd.pop(GU + "_scales"), [f"'{GU}_blocks' has no '{GU}_scales'"]),
    "scales of another dtype": (lambda sd: sd.update({GU + "_scales": sd[GU + "_scales"].to(torch.int16)}),
                                [f"'{GU}_scales' has dtype I16", "e8m0 bytes"]),
    "float experts in an MXFP4 checkpoint": (
        lambda sd: sd.update({GU: torch.zeros(3, 64, 192, dtype=torch.bfloat16), DN: torch.zeros(3, 96, 64, dtype=torch.bfloat16)}),
        ["is present next to the MXFP4"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(GPT_OSS_BAD))
def test_gpt_oss_bad_tensors_are_refused_by_name(tmp_path, sources, case):
    edit, words = GPT_OSS_BAD[case]
    src = copy_checkpoint(sources("gpt_oss"), tmp_path / "src")
    edit_tensors(src, edit)
    _refused(tmp_path, src, words)


def test_a_float_expert_layer_is_refused(tmp_path, sources):
    """One layer of bf16 experts (say the config leaves it unconverted) among MXFP4 ones: one
    directory, one scheme; refused naming the tensor."""
    src = copy_checkpoint(sources("gpt_oss"), tmp_path / "src")
    bf = load_file(str(sources("gpt_oss_bf16") / "model.safetensors"))

    def fn(sd):
        for w in ("gate_up_proj", "down_proj"):
            sd.pop(f"{GU[: -len('gate_up_proj')]}{w}_blocks")
            sd.pop(f"{GU[: -len('gate_up_proj')]}{w}_scales")
            sd[GU[: -len("gate_up_proj")] + w] = bf[GU[: -len("gate_up_proj")] + w]

    edit_tensors(src, fn)
    _refused(tmp_path, src, [f"'{GU}' has dtype BF16", "gpt-oss MXFP4 experts are stored as *_blocks / *_scales"])


GPT_OSS_BAD_CONFIGS = {
    "hidden not a multiple of 32": (lambda c: c.update(hidden_size=72), ["hidden_size=72", "must be a multiple of 32"]),
    "intermediate disagrees": (lambda c: c.update(intermediate_size=64),
                               ["gate_up_proj_blocks' has shape [3, 192, 2, 16]: expected [3, 128, 2, 16]", "intermediate_size=64"]),
    "experts disagree": (lambda c: c.update(num_local_experts=4), ["3 experts, config.json says 4"]),
    "mxfp8": (lambda c: c["quantization_config"].update(quant_method="mxfp8"),
              ["no reader handles it", "quant_method='mxfp8': MXFP8 (8-bit elements) is not MXFP4"]),
    "nvfp4": (lambda c: c["quantization_config"].update(quant_method="nvfp4"), ["quant_method='nvfp4': NVFP4"]),
    "experts left unconverted": (lambda c: c["quantization_config"].update(modules_to_not_convert=["model.layers.*.mlp.router",
                                                                                                   r"model\.layers\.1\.mlp"]),
                                 [f"'{GU}_blocks' is MXFP4, but the config leaves 'model.layers.1.mlp.experts' unquantized",
                                  "modules_to_not_convert entry 'model\\\\.layers\\\\.1\\\\.mlp'"]),
    "not a list": (lambda c: c["quantization_config"].update(modules_to_not_convert="lm_head"),
                   ["modules_to_not_convert='lm_head': must be a list"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(GPT_OSS_BAD_CONFIGS))
def test_gpt_oss_bad_configs_are_refused_with_the_reason(tmp_path, sources, case):
    edit, words = GPT_OSS_BAD_CONFIGS[case]
    src = copy_checkpoint(sources("gpt_oss"), tmp_path / "src")
    edit_config(src, edit)
    _refused(tmp_path, src, words)


def test_gpt_oss_modules_to_not_convert_naming_float_modules_is_fine(sources):
    """The list gpt-oss ships (attention, router, embeddings, lm_head: all float) and names that are
    no module boundary of the experts ("model.layers.1.mlp.exp") leave the experts MXFP4."""
    ckpt, reader = open_source(sources("gpt_oss"))
    assert len(reader.layers(ckpt)) == 2


def test_gpt_oss_intermediate_not_a_multiple_of_32(tmp_path, sources):
    """I = 40 (blocks [E, 80, 2, 16] pad nothing: gpt-oss has no partial block): refused."""
    src = copy_checkpoint(sources("gpt_oss"), tmp_path / "src")

    def fn(sd):
        for L in (0, 1):
            p = f"model.layers.{L}.mlp.experts."
            sd[p + "gate_up_proj_blocks"] = sd[p + "gate_up_proj_blocks"][:, :80].contiguous()
            sd[p + "gate_up_proj_scales"] = sd[p + "gate_up_proj_scales"][:, :80].contiguous()
            sd[p + "gate_up_proj_bias"] = sd[p + "gate_up_proj_bias"][:, :80].contiguous()

    edit_tensors(src, fn)
    edit_config(src, lambda c: c.update(intermediate_size=40))
    _refused(tmp_path, src, ["intermediate size I=40", "must be a multiple of 32"])


CT_M = "model.layers.1.mlp.experts.2.up_proj"

CT_BAD = {
    "nan scale": (set_element(CT_M + ".weight_scale", (7, 1), 255), [f"'{CT_M}.weight_scale'[7, 1] = 255", "e8m0 NaN scale"]),
    "scale shape": (lambda sd: sd.update({CT_M + ".weight_scale": sd[CT_M + ".weight_scale"][:, :1].contiguous()}),
                    [f"'{CT_M}.weight_scale' has shape [96, 1]: expected [96, 2]", "one e8m0 scale per 32 K values"]),
    "scale missing": (lambda sd: sd.pop(CT_M + ".weight_scale"), [f"'{CT_M}.weight_packed' has no '{CT_M}.weight_scale'"]),
    "global scale": (lambda sd: sd.update({CT_M + ".weight_global_scale": torch.ones(1)}),
                     [f"'{CT_M}.weight_global_scale' is present", "neither a global scale"]),
    "packed of another dtype": (lambda sd: sd.update({CT_M + ".weight_packed": sd[CT_M + ".weight_packed"].to(torch.int32)}),
                                [f"'{CT_M}.weight_packed' has dtype I32"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CT_BAD))
def test_ct_bad_tensors_are_refused_by_name(tmp_path, sources, case):
    edit, words = CT_BAD[case]
    src = copy_checkpoint(sources("ct"), tmp_path / "src")
    edit_tensors(src, edit)
    _refused(tmp_path, src, words)


def _g(c):
    return c["quantization_config"]["config_groups"]["group_0"]


CT_BAD_CONFIGS = {
    "nvfp4 format": (lambda c: (c["quantization_config"].update(format="nvfp4-pack-quantized"), _g(c).pop("format", None)),
                     ["the reader of quantization_config format 'nvfp4-pack-quantized'", "group_size=32: NVFP4 has one e4m3 scale"]),
    "group of 16": (lambda c: _g(c)["weights"].update(group_size=16), ["group_size=16: MXFP4 has one scale per group of 32"]),
    "8-bit": (lambda c: _g(c)["weights"].update(num_bits=8), ["num_bits=8, type='float': MXFP4 weights are 4-bit float"]),
    "float scales": (lambda c: _g(c)["weights"].update(scale_dtype="torch.bfloat16"), ["scale_dtype='torch.bfloat16'"]),
    "static activations": (lambda c: _g(c).update(input_activations={"num_bits": 8, "type": "float", "dynamic": False}),
                           ["static activation scales are not supported"]),
    "experts ignored": (lambda c: c["quantization_config"].update(ignore=["lm_head", "re:.*experts\\.2\\.up_proj$"]),
                        [f"'{CT_M.replace('layers.1', 'layers.0')}.weight_packed' is MXFP4, but the config leaves"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CT_BAD_CONFIGS))
def test_ct_bad_configs_are_refused_with_the_reason(tmp_path, sources, case):
    edit, words = CT_BAD_CONFIGS[case]
    src = copy_checkpoint(sources("ct"), tmp_path / "src")
    edit_config(src, edit)
    _refused(tmp_path, src, words)


def test_ct_quantized_router_is_refused(tmp_path, sources):
    src = copy_checkpoint(sources("ct_gpt_oss"), tmp_path / "src")
    r = "model.layers.1.mlp.router"

    def fn(sd):
        sd.pop(r + ".weight")
        sd[r + ".weight_packed"] = torch.zeros(3, 32, dtype=torch.uint8)
        sd[r + ".weight_scale"] = torch.full((3, 2), 127, dtype=torch.uint8)

    edit_tensors(src, fn)
    _refused(tmp_path, src, [f"router tensor '{r}.weight_packed' is MXFP4: the router must stay in float"])


def test_ct_nan_scale_in_an_attention_linear_is_refused(tmp_path, sources):
    """convert's check of the carried Linears (moepack/sources/linears.py) refuses an e8m0 255 in
    an mxfp4 attention Linear, naming it, before anything is written."""
    src = copy_checkpoint(sources("ct"), tmp_path / "src")
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    edit_tensors(src, set_element(name, (3, 1), 255))
    ckpt = Checkpoint(src)
    with pytest.raises(SourceError, match=re.escape(f"'{name}'[3, 1] = 255: an e8m0 NaN scale")):
        linears.check_carried(ckpt, [n for n in ckpt.tensors if ".self_attn." in n])
    with pytest.raises(SourceError, match=re.escape(f"'{name}'[3, 1] = 255")):
        moepack.convert(src, tmp_path / "dst")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
