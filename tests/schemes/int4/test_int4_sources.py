"""int4 source readers (scheme int4_group): GPTQ, AWQ GEMM, compressed-tensors pack-quantized.

* compressed-tensors: fixtures/qwen2_moe_w4a16{,_asym} and qwen3_moe_w4a16_channel were written by
  compressed-tensors 0.20.1 itself (tools/make_fixtures.py); its own decompression is the oracle:
  ``PackedQuantizationCompressor.decompress`` returns bf16 (it computes in the scale dtype), so the
  reader's fp32 weights rounded to bf16 must equal it bit for bit; the library's ``unpack_from_int32``
  + ``dequantize`` run in fp32 must equal the reader's fp32 weights bit for bit. Partial last
  groups, K and N not multiples of 8 and legacy ``weight_g_idx`` cannot be written by 0.20.1 (it
  refuses K % group_size != 0 and dropped actorder "group"), so those checkpoints are packed
  with the library's ``pack_to_int32`` from random codes here, with the g_idx-lookup oracle.
* GPTQ / AWQ: tools/int4_packers.py packs random codes (seeded) by the format rules; the oracle is
  ``dequant_lookup`` of the packer's inputs (g_idx lookup, no sorting). The AWQ packer is
  cross-checked against compressed-tensors' AutoAWQConverter.
* every refusal the readers make names the tensor or config key.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moepack.errors import SourceError
from moepack.schemes.int4.facts import Int4Facts
from moepack.sources import Checkpoint, open_source
from moepack.sources import awq as awq_mod
from moepack.sources import ct_pack_quantized as ctpq
from moepack.sources import gptq as gptq_mod
from tests.support.fixtures_util import fixture_dir, quantized_fixture_names
from tests.support.ckpt_edit import edit_quantization_config, edit_tensors

_spec = importlib.util.spec_from_file_location("int4_packers", Path(__file__).resolve().parents[3] / "tools" / "int4_packers.py")
P = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(P)

CT_FIXTURES = ["qwen2_moe_w4a16", "qwen2_moe_w4a16_asym", "qwen3_moe_w4a16_channel"]
ROLES = ("gate_proj", "up_proj", "down_proj")


def _reader_impl(name):
    return {"gptq": gptq_mod.READER, "awq": awq_mod.READER, ctpq.NAME: ctpq.READER}[name]


def _expected_layer(reader, ckpt, s, oracle: dict):
    """(w13 [E, 2I, H], w2 [E, H, I]) from the oracle's per-module fp32 weights, in the reader's
    folded intermediate order (down_proj's act-order folded into gate/up rows)."""
    i = s.intermediate
    w13, w2 = [], []
    for e in range(s.num_experts):
        ip = _reader_impl(reader.name).intermediate_perm(ckpt, s, e)
        ip = torch.arange(i) if ip is None else ip
        g, u, d = (oracle[f"{s.prefix}.experts.{e}.{r}"] for r in ROLES)
        g, u, d = g[ip], u[ip], d[:, ip]
        w13.append(torch.stack([g, u], 1).reshape(2 * i, -1) if s.interleaved else torch.cat([g, u]))
        w2.append(d)
    return torch.stack(w13), torch.stack(w2)


def _check_canonical(layer, s):
    c = layer.canonical
    e, i, h = s.num_experts, s.intermediate, s.hidden
    g = s.quant.group_size
    ng13, ng2 = (1, 1) if g == -1 else (math.ceil(h / g), math.ceil(i / g))
    assert c["w13_q"].shape == (e, 2 * i, h) and c["w13_q"].dtype == torch.uint8 and int(c["w13_q"].max()) <= 15
    assert c["w13_scale"].shape == (e, 2 * i, ng13) and c["w13_scale"].dtype == torch.float32
    assert c["w13_zero"].shape == (e, 2 * i, ng13) and c["w13_zero"].dtype == torch.uint8 and int(c["w13_zero"].max()) <= 15
    assert c["w2_q"].shape == (e, h, i) and c["w2_scale"].shape == (e, h, ng2) and c["w2_zero"].shape == (e, h, ng2)
    assert ("w13_perm" in c) == s.quant.act_order and "w2_perm" not in c
    if s.quant.sym:
        assert bool((c["w13_zero"] == 8).all() and (c["w2_zero"] == 8).all())
    if "w13_perm" in c:
        assert c["w13_perm"].dtype == torch.int32 and c["w13_perm"].shape == (e, h)
        for x in range(e):
            assert torch.equal(c["w13_perm"][x].sort().values, torch.arange(h, dtype=torch.int32))
    # the canonical codes dequantize (k // G, after sorting) to the float weights (original order)
    from moepack.sources.int4_common import dequantize

    for x in range(e):
        w = dequantize(c["w13_q"][x], c["w13_scale"][x], c["w13_zero"][x], g)
        if "w13_perm" in c:
            w = w[:, torch.argsort(c["w13_perm"][x].long())]
        assert torch.equal(w, layer.w13[x])
        assert torch.equal(dequantize(c["w2_q"][x], c["w2_scale"][x], c["w2_zero"][x], g), layer.w2[x])


# --------------------------------------------------------------------------- compressed-tensors fixtures


def _ct_scheme(d: Path):
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate(json.loads((d / "config.json").read_text())["quantization_config"])
    return next(iter(qc.config_groups.values()))


def _ct_oracles(d: Path, prefixes):
    """{prefix: (bf16 weight from PackedQuantizationCompressor.decompress, fp32 from unpack_from_int32
    + dequantize in fp32, signed codes, signed zero points or None)}."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    scheme = _ct_scheme(d)
    sd = load_file(str(d / "model.safetensors"))
    out = {}
    for p in prefixes:
        local = {k[len(p) + 1 :]: v for k, v in sd.items() if k.startswith(p + ".") and k[len(p) + 1 :].startswith("weight")}
        bf16 = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        shape = local["weight_shape"]
        q = unpack_from_int32(local["weight_packed"], 4, shape)
        zp = None
        if "weight_zero_point" in local:
            zp = unpack_from_int32(local["weight_zero_point"], 4, (shape[0], local["weight_scale"].shape[-1]), packed_dim=0)
        f32 = dequantize(q, local["weight_scale"].float(), zp, scheme.weights, dtype=torch.float32)
        out[p] = (bf16, f32, q, zp, local["weight_scale"])
    return out


def test_ct_fixtures_are_listed_apart():
    for n in CT_FIXTURES:
        assert n in quantized_fixture_names()
        info = json.loads((fixture_dir(n) / "FIXTURE.json").read_text())
        assert info["versions"]["compressed_tensors"] == "0.20.1"
        assert info["quantization_config"]["format"] == "pack-quantized"


@pytest.mark.parametrize("name", CT_FIXTURES)
def test_ct_reader_matches_compressed_tensors_decompression(name):
    d = fixture_dir(name)
    ckpt, reader = open_source(d)
    assert reader.name == ctpq.NAME and reader.scheme == "int4_group"
    specs = reader.layers(ckpt)
    assert [s.index for s in specs] == [0, 1]
    n_mod = 0
    for s in specs:
        assert s.quant.format == "pack-quantized" and s.quant.sym == (name == "qwen2_moe_w4a16")
        assert s.quant.group_size == (-1 if "channel" in name else 32) and s.quant.scale_dtype == "BF16"
        for n in s.expert_tensors:
            assert n in ckpt.tensors
        layer = reader.read_layer(ckpt, s)
        _check_canonical(layer, s)
        prefixes = [f"{s.prefix}.experts.{e}.{r}" for e in range(s.num_experts) for r in ROLES]
        orc = _ct_oracles(d, prefixes)
        i = s.intermediate
        for e in range(s.num_experts):
            for r, ours, rows in (
                ("gate_proj", layer.w13[e], slice(0, i)),
                ("up_proj", layer.w13[e], slice(i, 2 * i)),
                ("down_proj", layer.w2[e], slice(None)),
            ):
                bf16, f32, q, zp, sc = orc[f"{s.prefix}.experts.{e}.{r}"]
                assert torch.equal(ours[rows], f32), (name, e, r)
                assert torch.equal(ours[rows].to(bf16.dtype), bf16), (name, e, r)
                w = "w2" if r == "down_proj" else "w13"
                c = layer.canonical
                assert torch.equal(c[f"{w}_q"][e][rows].to(torch.int16), q.to(torch.int16) + 8)
                assert torch.equal(c[f"{w}_scale"][e][rows], sc.float())
                if zp is not None:
                    assert torch.equal(c[f"{w}_zero"][e][rows].to(torch.int16), zp.to(torch.int16) + 8)
                n_mod += 1
        if s.shared:
            c = reader.read_shared_canonical(ckpt, s)
            sw13, sw2 = reader.read_shared(ckpt, s)
            so = _ct_oracles(d, [f"{s.prefix}.shared_expert.{r}" for r in ROLES])
            si = s.shared["intermediate"]
            assert c["w13_q"].shape == (1, 2 * si, s.hidden) and c["w2_q"].shape == (1, s.hidden, si)
            assert torch.equal(sw13[0], torch.cat([so[f"{s.prefix}.shared_expert.{r}"][1] for r in ROLES[:2]]))
            assert torch.equal(sw2[0], so[f"{s.prefix}.shared_expert.down_proj"][1])
    assert n_mod == sum(3 * s.num_experts for s in specs)


def _write_ct_synthetic(d: Path, *, h, i, e, group_size, sym, act_order=False, seed=0, bias=False):
    """A qwen2_moe-named checkpoint whose experts are packed by compressed-tensors' own pack_to_int32
    from random codes (shapes 0.20.1's quantizer refuses: partial groups, K/N not multiples of 8,
    legacy weight_g_idx). Returns {prefix: fp32 oracle}."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(seed)
    tensors, oracle = {}, {}
    p = "model.layers.0.mlp"
    tensors[f"{p}.gate.weight"] = torch.randn(e, h, generator=gen).to(torch.bfloat16)
    for x in range(e):
        g_gate = None
        for r, n, k in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
            ql = P.random_qlinear(n, k, group_size, sym=sym, act_order=act_order, gen=gen, scale_dtype=torch.bfloat16)
            if r == "up_proj":
                ql["g_idx"] = g_gate
            g_gate = ql["g_idx"]
            m = f"{p}.experts.{x}.{r}"
            tensors[m + ".weight_packed"] = pack_to_int32((ql["q"].to(torch.int16) - 8).to(torch.int8), 4)
            tensors[m + ".weight_scale"] = ql["scale"].to(torch.bfloat16)
            tensors[m + ".weight_shape"] = torch.tensor([n, k])
            if not sym:
                tensors[m + ".weight_zero_point"] = pack_to_int32((ql["zero"].to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0)
            if act_order:
                tensors[m + ".weight_g_idx"] = ql["g_idx"].to(torch.int32).clone()
            if bias:
                tensors[m + ".bias"] = torch.randn(n, generator=gen).to(torch.bfloat16)
            oracle[m] = P.dequant_lookup(ql)
    save_file(tensors, str(d / "model.safetensors"))
    strategy = {"strategy": "channel", "group_size": None} if group_size == -1 else {"strategy": "group", "group_size": group_size}
    w = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False, **strategy}
    if act_order:
        w["actorder"] = "group"
    cfg = {"model_type": "qwen2_moe", "hidden_size": h, "moe_intermediate_size": i, "num_experts": e, "num_experts_per_tok": 2,
           "num_hidden_layers": 1, "hidden_act": "silu",
           "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                                   "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": w,
                                                                 "input_activations": None, "output_activations": None}},
                                   "ignore": ["lm_head"]}}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    return oracle


@pytest.mark.parametrize(
    "h,i,group_size,sym,act_order",
    [
        (90, 44, 32, False, False),  # K and N not multiples of 8; partial last groups
        (90, 44, 32, True, True),  # legacy weight_g_idx (act-order), partial groups
        (136, 88, 64, False, True),
        (90, 44, -1, False, False),
        (136, 88, 128, True, False),
    ],
)
def test_ct_synthetic_shapes_exact(tmp_path, h, i, group_size, sym, act_order):
    orc = _write_ct_synthetic(tmp_path, h=h, i=i, e=2, group_size=group_size, sym=sym, act_order=act_order, bias=True)
    ckpt, reader = open_source(tmp_path)
    assert reader.name == ctpq.NAME
    (s,) = reader.layers(ckpt)
    assert s.quant.act_order == act_order and s.quant.w2_act_order == act_order
    layer = reader.read_layer(ckpt, s)
    _check_canonical(layer, s)
    w13, w2 = _expected_layer(reader, ckpt, s, orc)
    assert torch.equal(layer.w13, w13) and torch.equal(layer.w2, w2)
    _check_biases_folded(tmp_path, reader, ckpt, s)


def _check_biases_folded(d, reader, ckpt, s):
    sd = load_file(str(Path(d) / "model.safetensors"))
    b13, _ = reader.read_biases(ckpt, s)
    i = s.intermediate
    for e in range(s.num_experts):
        ip = _reader_impl(reader.name).intermediate_perm(ckpt, s, e)
        ip = torch.arange(i) if ip is None else ip
        g, u = (sd[f"{s.prefix}.experts.{e}.{r}.bias"][ip] for r in ROLES[:2])
        want = torch.stack([g, u], 1).reshape(-1) if s.interleaved else torch.cat([g, u])
        assert torch.equal(b13[e], want)


# --------------------------------------------------------------------------- GPTQ


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("version", ["gptq", "gptq_v2"])
def test_gptq_exact(tmp_path, version, sym, act_order, group_size):
    orc = P.write_moe_checkpoint(tmp_path, "gptq", h=136, i=88, e=2, group_size=group_size, sym=sym, version=version,
                                 act_order=act_order, shared=40, bias=True, seed=group_size % 7)  # fmt: skip
    ckpt, reader = open_source(tmp_path)
    assert reader.name == "gptq" and reader.scheme == "int4_group"
    (s,) = reader.layers(ckpt)
    def perm(k):  # a g_idx of one group (G = -1, or G >= K) is trivial whatever the act-order
        return act_order and group_size != -1 and k > group_size

    assert s.quant == Int4Facts(group_size=group_size, sym=sym, scale_dtype="F16", format=version, act_order=perm(136),
                                w2_act_order=perm(88), input_activations=None,
                                shared=Int4Facts(group_size=group_size, sym=sym, scale_dtype="F16", format=version,
                                                 act_order=perm(136), w2_act_order=perm(40)))  # fmt: skip
    layer = reader.read_layer(ckpt, s)
    _check_canonical(layer, s)
    fo = {p: P.dequant_lookup(ql) for p, ql in orc.items()}
    w13, w2 = _expected_layer(reader, ckpt, s, fo)
    assert torch.equal(layer.w13, w13) and torch.equal(layer.w2, w2)
    for e in range(2):
        assert torch.equal(reader.read_expert_w13(ckpt, s, e), w13[e]) and torch.equal(reader.read_expert_w2(ckpt, s, e), w2[e])
    _check_biases_folded(tmp_path, reader, ckpt, s)
    sw13, sw2 = reader.read_shared(ckpt, s)
    sp = f"{s.prefix}.shared_expert"
    ip = gptq_mod.READER._ip(ckpt, sp + ".down_proj")
    ip = torch.arange(40) if ip is None else ip
    assert torch.equal(sw13[0], torch.cat([fo[f"{sp}.gate_proj"][ip], fo[f"{sp}.up_proj"][ip]]))
    assert torch.equal(sw2[0], fo[f"{sp}.down_proj"][:, ip])
    c = reader.read_shared_canonical(ckpt, s)
    assert ("w13_perm" in c) == s.quant.shared.act_order and c["w13_q"].shape == (1, 80, 136)
    real = {n for n in ckpt.tensors if ".experts." in n}
    assert set(s.expert_tensors) == real


def test_gptq_gpt_oss_interleaved(tmp_path):
    orc = P.write_moe_checkpoint(tmp_path, "gptq", h=72, i=40, e=2, group_size=32, sym=False, version="gptq_v2", act_order=True,
                                 family="gpt_oss", bias=True)  # fmt: skip
    ckpt, reader = open_source(tmp_path)
    (s,) = reader.layers(ckpt)
    assert s.interleaved and s.activation == "swigluoai"
    layer = reader.read_layer(ckpt, s)
    w13, w2 = _expected_layer(reader, ckpt, s, {p: P.dequant_lookup(q) for p, q in orc.items()})
    assert torch.equal(layer.w13, w13) and torch.equal(layer.w2, w2)
    _check_biases_folded(tmp_path, reader, ckpt, s)


def test_gptq_packer_bit_patterns():
    q = torch.arange(8, dtype=torch.uint8).repeat(8, 1)  # [N=8, K=8]: k in column k
    z = torch.full((8, 1), 8, dtype=torch.uint8)
    t = P.pack_gptq(q, torch.ones(8, 1), z, P.trivial_g_idx(8, -1), "gptq")
    assert t["qweight"].shape == (1, 8) and bool((t["qweight"] == 0x76543210).all())
    assert t["qzeros"].shape == (1, 1) and int(t["qzeros"][0, 0]) == 0x77777777  # sym v1: 8 - 1 per nibble
    assert int(P.pack_gptq(q, torch.ones(8, 1), z, P.trivial_g_idx(8, -1), "gptq_v2")["qzeros"][0, 0]) == -0x77777778  # 0x88888888


def test_gptq_quantize_config_json_and_synonyms(tmp_path):
    P.write_moe_checkpoint(tmp_path, "gptq", h=72, i=40, e=2, group_size=32, sym=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 32, "sym": True, "desc_act": False}))
    ckpt, reader = open_source(tmp_path)
    assert reader.name == "gptq" and reader.layers(ckpt)[0].quant.group_size == 32
    cfg["quantization_config"] = {**qc, "group_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match=r"quantization_config.group_size=64 but quantize_config.json q_group_size=32"):
        gptq_mod.config(Checkpoint(tmp_path))


# --------------------------------------------------------------------------- AWQ


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("sym", [False, True])
def test_awq_exact_and_matches_autoawq_converter(tmp_path, group_size, sym):
    orc = P.write_moe_checkpoint(tmp_path, "awq", h=136, i=88, e=2, group_size=group_size, sym=sym, bias=True, shared=24)
    ckpt, reader = open_source(tmp_path)
    assert reader.name == "awq"
    (s,) = reader.layers(ckpt)
    assert s.quant.format == "awq" and s.quant.sym == sym and s.quant.group_size == group_size and not s.quant.act_order
    layer = reader.read_layer(ckpt, s)
    _check_canonical(layer, s)
    w13, w2 = _expected_layer(reader, ckpt, s, {p: P.dequant_lookup(q) for p, q in orc.items()})
    assert torch.equal(layer.w13, w13) and torch.equal(layer.w2, w2)
    _check_biases_folded(tmp_path, reader, ckpt, s)
    # compressed-tensors' own AWQ converter decodes the same files to the same codes / zeros / scales
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    conv = AutoAWQConverter(bits=4, group_size=group_size, zero_point=not sym)
    sd = load_file(str(tmp_path / "model.safetensors"))
    for e in range(2):
        m = f"{s.prefix}.experts.{e}.down_proj"
        cq, cs, cz = conv._convert_gemm_module(sd[m + ".qweight"], sd[m + ".scales"], sd.get(m + ".qzeros"))
        c = reader.read_expert_canonical(ckpt, s, "w2", e)
        assert torch.equal(c["w2_q"].to(torch.int16), cq.to(torch.int16) + 8)
        assert torch.equal(c["w2_scale"], cs.float())
        assert torch.equal(c["w2_zero"].to(torch.int16), (cz.to(torch.int16) + 8) if cz is not None else torch.full_like(c["w2_zero"], 8, dtype=torch.int16))
        assert torch.equal(c["w2_q"], orc[m]["q"])  # the packer's input codes (packer == converter rule)


# --------------------------------------------------------------------------- detection


def test_detection_routes_each_format(tmp_path):
    want = {}
    P.write_moe_checkpoint(tmp_path / "g", "gptq", h=72, i=40, e=2, group_size=32, sym=True)
    P.write_moe_checkpoint(tmp_path / "a", "awq", h=72, i=40, e=2, group_size=32, sym=False)
    want.update({tmp_path / "g": "gptq", tmp_path / "a": "awq", fixture_dir("qwen3_moe_w8a8"): "compressed-tensors",
                 fixture_dir("qwen3_moe"): "dense"})  # fmt: skip
    for n in CT_FIXTURES:
        want[fixture_dir(n)] = ctpq.NAME
    for d, name in want.items():
        ckpt, reader = open_source(d)
        assert reader.name == name, d
    ck = Checkpoint(fixture_dir("qwen3_moe_w8a8"))
    ok, why = ctpq.READER.detect(ck)
    assert not ok and "'int-quantized'" in why
    ok, why = gptq_mod.READER.detect(ck)
    assert not ok and "quant_method='compressed-tensors'" in why
    from moepack.sources import READERS

    int8 = next(r for r in READERS if r.name == "compressed-tensors")
    ok, why = int8.detect(Checkpoint(fixture_dir("qwen2_moe_w4a16")))
    assert not ok and "'pack-quantized'" in why
    assert [r.name for r in READERS][-1] == "dense"


# --------------------------------------------------------------------------- refusals


def _edit(d: Path, tensors=None, config=None, drop=()):
    def fn(sd):
        for k in drop:
            del sd[k]
        for k, v in (tensors or {}).items():
            sd[k] = v(sd[k]) if callable(v) else v

    edit_tensors(d, fn)
    if config:
        edit_quantization_config(d, config)


def _read_all(d):
    ckpt, reader = open_source(d)
    for s in reader.layers(ckpt):
        reader.read_layer(ckpt, s)
        reader.read_shared_canonical(ckpt, s)


def _gptq(tmp_path, **kw):
    args = dict(h=72, i=40, e=2, group_size=32, sym=False, version="gptq_v2", act_order=True)
    args.update(kw)
    P.write_moe_checkpoint(tmp_path, "gptq", **args)
    return tmp_path


M = "model.layers.0.mlp.experts.1.down_proj"


def _set(key, value):
    return lambda qc: qc.__setitem__(key, value)


@pytest.mark.parametrize(
    "edit,pattern",
    [
        (_set("bits", 8), r"quantization_config.bits=8: 8-bit GPTQ weights with 16-bit activations: not supported yet"),
        (_set("bits", 3), r"quantization_config.bits=3: moepack reads 4-bit GPTQ only"),
        (_set("bits", 2), r"quantization_config.bits=2"),
        (_set("checkpoint_format", "marlin"), r"quantization_config.checkpoint_format='marlin'"),
        (_set("checkpoint_format", "bitblas"), r"checkpoint_format='bitblas'"),
        (_set("checkpoint_format", "gptq_p"), r"checkpoint_format='gptq_p'"),
        (_set("checkpoint_format", "qqq"), r"checkpoint_format='qqq'"),
        (lambda qc: qc.update(format="gptq_v2", checkpoint_format="gptq"), r"format='gptq_v2' but checkpoint_format='gptq': synonyms must agree"),
        (_set("group_size", 0), r"quantization_config.group_size=0: a GPTQ group size is a positive integer or -1"),
        (_set("dynamic", {"+:.*down.*": {"bits": 8}}), r"quantization_config.dynamic\['\+:\.\*down\.\*'\]: per-module overrides"),
        (_set("group_size", 64), r"tensor '.*scales' has shape \[\d+, \d+\]: expected \[\d+, \d+\] \(ceil\(K=\d+ / group_size=64\)"),
    ],
)
def test_gptq_config_refusals(tmp_path, edit, pattern):
    d = _gptq(tmp_path)
    _edit(d, config=edit)
    with pytest.raises(SourceError, match=pattern):
        _read_all(d)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -0.5])
def test_refuses_bad_scales(tmp_path, value):
    d = _gptq(tmp_path)
    _edit(d, {M + ".scales": lambda t: t.index_put_((torch.tensor([1]), torch.tensor([5])), torch.tensor(value, dtype=t.dtype))})
    with pytest.raises(SourceError, match=rf"tensor '{M}.scales'\[1, 5\] = .*: scales must be finite and > 0"):
        _read_all(d)


def test_refuses_gptq_v1_zero_overflow(tmp_path):
    d = tmp_path
    P.write_moe_checkpoint(d, "gptq", h=72, i=40, e=2, group_size=32, sym=False, version="gptq", zero_lo=0, seed=3)
    with pytest.raises(SourceError, match=r"qzeros'\[\d+, \d+\]: zero point 16 is outside 0..15 \(GPTQ v1 stores zero - 1"):
        _read_all(d)


def test_refuses_sym_with_zero_not_8(tmp_path):
    d = _gptq(tmp_path, sym=True, act_order=False)
    _edit(d, {M + ".qzeros": lambda t: t + 1})
    with pytest.raises(SourceError, match=rf"tensor '{M}.qzeros'\[0, 0\]: zero point 9 in a symmetric checkpoint \(sym=true\)"):
        _read_all(d)


def test_refuses_bad_g_idx(tmp_path):
    d = _gptq(tmp_path)
    g = load_file(str(d / "model.safetensors"))[M + ".g_idx"]
    _edit(d, {M + ".g_idx": g.clone().index_fill_(0, torch.tensor([3]), 7)})
    with pytest.raises(SourceError, match=rf"tensor '{M}.g_idx'\[3\] = 7: group indices must lie in 0..1"):
        _read_all(d)
    # a valid assignment (in range), but group 0 gets 33 channels and group 1 only 7
    bad = g.clone()
    bad[int((g == 1).nonzero()[0])] = 0
    _edit(d, {M + ".g_idx": bad})
    with pytest.raises(SourceError, match=rf"tensor '{M}.g_idx': group 0 has 33 input channels, expected 32: a g_idx must give every group exactly group_size=32"):
        _read_all(d)
    _edit(d, {M + ".g_idx": g[:-1].clone()})
    with pytest.raises(SourceError, match=rf"tensor '{M}.qweight' \(as a 4-bit \[N, K\] Linear\) has shape \[72, 39\]: expected \[72, 40\]"):
        _read_all(d)


def test_refuses_gate_up_with_different_g_idx(tmp_path):
    d = _gptq(tmp_path)
    pre = "model.layers.0.mlp.experts.0"
    g = load_file(str(d / "model.safetensors"))[pre + ".up_proj.g_idx"]
    _edit(d, {pre + ".up_proj.g_idx": g.flip(0).contiguous()})
    with pytest.raises(SourceError, match=rf"tensors '{pre}.gate_proj.g_idx' and '{pre}.up_proj.g_idx' differ"):
        _read_all(d)


def test_refuses_non_int32_packed(tmp_path):
    d = _gptq(tmp_path)
    _edit(d, {M + ".qweight": lambda t: t.to(torch.int64)})
    with pytest.raises(SourceError, match=rf"tensor '{M}.qweight' has dtype I64: GPTQ packs codes and zero points in I32"):
        _read_all(d)
    d2 = tmp_path / "ct"
    d2.mkdir()
    _write_ct_synthetic(d2, h=72, i=40, e=2, group_size=32, sym=False)
    _edit(d2, {M + ".weight_zero_point": lambda t: t.to(torch.int16)})
    with pytest.raises(SourceError, match=rf"tensor '{M}.weight_zero_point' has dtype I16: pack-quantized codes and zero points are packed in I32"):
        _read_all(d2)


def test_refuses_gptq_n_not_multiple_of_8(tmp_path):
    d = _gptq(tmp_path)
    m = "model.layers.0.self_attn.k_proj"
    _edit(d, {m + ".qweight": torch.zeros(9, 44, dtype=torch.int32), m + ".qzeros": torch.zeros(3, 6, dtype=torch.int32),
              m + ".scales": torch.ones(3, 44, dtype=torch.float16)})  # fmt: skip
    with pytest.raises(SourceError, match=rf"tensor '{m}.qweight': N=44 outputs is not a multiple of 8, which '{m}.qzeros' packs along N"):
        _read_all(d)


def test_awq_refusals(tmp_path):
    P.write_moe_checkpoint(tmp_path, "awq", h=72, i=40, e=2, group_size=32, sym=False)
    for key, val, pat in [
        ("version", "gemv", r"quantization_config.version='gemv': moepack reads the AWQ 'gemm' layout only"),
        ("version", "gemv_fast", r"version='gemv_fast'"),
        ("version", "marlin", r"version='marlin'"),
        ("version", "llm-awq", r"version='llm-awq'"),
        ("version", "exllama", r"version='exllama'"),
        ("bits", 8, r"quantization_config.bits=8: AWQ GEMM is 4-bit"),
        ("group_size", -1, r"quantization_config.group_size=-1: an AWQ GEMM group size is a positive integer"),
    ]:
        d = tmp_path / f"{key}-{val}"
        import shutil

        shutil.copytree(tmp_path, d, ignore=lambda *_: [x for x in _[1] if x not in ("config.json", "model.safetensors")])
        _edit(d, config=_set(key, val))
        with pytest.raises(SourceError, match=pat):
            awq_mod.config(Checkpoint(d))
        with pytest.raises(SourceError, match="no reader handles it"):
            open_source(d)
    _edit(tmp_path, {M + ".scales": lambda t: t[:, :36].contiguous()})
    with pytest.raises(SourceError, match=rf"tensor '{M}.scales' has N=36 columns but '{M}.qweight' holds 9 words of 8: AWQ packs along N"):
        _read_all(tmp_path)


def test_ct_refusals(tmp_path):
    _write_ct_synthetic(tmp_path, h=72, i=40, e=2, group_size=32, sym=False)

    def grp(**upd):
        return lambda qc: qc["config_groups"]["group_0"]["weights"].update(upd)

    cases = [
        (grp(num_bits=8), r"config group 'group_0' weights num_bits=8: 8-bit weights with 16-bit activations \(W8A16\) are not supported yet"),
        (grp(num_bits=3), r"weights num_bits=3: moepack reads 4-bit"),
        (grp(strategy="tensor", group_size=None), r"weights strategy='tensor'"),
        (grp(group_size=64), rf"tensor '.*weight_scale' has shape \[\d+, 2\]: expected \[\d+, 1\] \(ceil\(K=\d+ / group_size=64\)"),
        (lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}),
         r"input_activations=.*static activation scales are not supported"),
    ]  # fmt: skip
    import shutil

    for n, (edit, pat) in enumerate(cases):
        d = tmp_path / f"c{n}"
        shutil.copytree(tmp_path, d, ignore=lambda *_: [x for x in _[1] if x not in ("config.json", "model.safetensors")])
        _edit(d, config=edit)
        with pytest.raises(SourceError, match=pat):
            _read_all(d)
    # a weight_zero_point shaped for another N
    _edit(tmp_path, {M + ".weight_zero_point": lambda t: t[:4].contiguous()})
    with pytest.raises(SourceError, match=rf"tensor '{M}.weight_zero_point' has shape \[4, 2\]: expected \[9, 2\]"):
        _read_all(tmp_path)


def test_w4a8_activations_are_recorded(tmp_path):
    _write_ct_synthetic(tmp_path, h=72, i=40, e=2, group_size=32, sym=True)
    act = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    _edit(tmp_path, config=lambda qc: qc["config_groups"]["group_0"].update(input_activations=act))
    ckpt, reader = open_source(tmp_path)
    assert reader.name == ctpq.NAME and reader.layers(ckpt)[0].quant.input_activations == act
