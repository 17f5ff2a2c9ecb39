"""int8 checkpoints end to end: the compressed-tensors ``int-quantized`` reader (against
compressed-tensors' own decompression), ``moepack convert`` of it and ``--quantize int8`` of dense
fixtures, verify / inspect / open on the result, and every bad input refused by name.

fixtures/qwen3_moe_w8a8 was written by compressed-tensors 0.20.1 itself from fixtures/qwen3_moe's
weights (tools/make_fixtures.py ``write_quantized_fixture``): int8 codes including -128, bf16
per-channel scales, attention projections quantized too, routers left in bf16.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moepack
from moepack.convert.run import MANIFEST
from moepack.errors import MoepackError
from moepack.isa import ISAS
from moepack.layout import INT8_LAYOUT
from moepack.reference import moe_reference
from moepack.schemes.int8 import moe_reference_int8, quantize_int8_per_channel
from moepack.sources import open_source
from tests.support.fixtures_util import fixture_dir, quantized_fixture_names

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

CT = "qwen3_moe_w8a8"


def test_quantized_fixtures_are_listed_apart():
    assert CT in quantized_fixture_names()
    info = json.loads((fixture_dir(CT) / "FIXTURE.json").read_text())
    assert info["base_fixture"] == "qwen3_moe" and info["versions"]["compressed_tensors"] == "0.20.1"


def _ct_modules(d: Path):
    """Every quantized Linear of the checkpoint as compressed-tensors sees it: modules built from
    the file, the file's quantization_config applied, the stored int8 weight and scale loaded."""
    import compressed_tensors as ct
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    assert ct.__version__ == "0.20.1"
    qc = QuantizationConfig.model_validate(json.loads((d / "config.json").read_text())["quantization_config"])
    sd = load_file(str(d / "model.safetensors"))
    root = torch.nn.Module()
    names = [n[: -len(".weight_scale")] for n in sd if n.endswith(".weight_scale")]
    for m in names:
        w = sd[m + ".weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=sd[m + ".weight_scale"].dtype)
        cur = root
        for p in m.split(".")[:-1]:
            if not hasattr(cur, p):
                cur.add_module(p, torch.nn.Module())
            cur = getattr(cur, p)
        cur.add_module(m.split(".")[-1], lin)
    apply_quantization_config(root, qc)
    for m in names:
        mod = root.get_submodule(m)
        mod.weight = torch.nn.Parameter(sd[m + ".weight"].clone(), requires_grad=False)  # the int8 codes
        mod.weight_scale.data.copy_(sd[m + ".weight_scale"])
    return root, names, sd


def test_reader_matches_compressed_tensors_decompression():
    from compressed_tensors.compressors import decompress_module

    d = fixture_dir(CT)
    root, names, sd = _ct_modules(d)
    ckpt, reader = open_source(d)
    assert reader.name == "compressed-tensors" and reader.scheme == "int8_channel"
    specs = reader.layers(ckpt)
    assert [s.index for s in specs] == [0, 1]
    seen = set()
    n_min = 0
    for s in specs:
        layer = reader.read_layer(ckpt, s)
        c = layer.canonical  # scheme int8_channel's canonical tensors
        i = s.intermediate
        for e in range(s.num_experts):
            for role, rows, q, sc in (
                ("gate_proj", slice(0, i), c["w13_q"][e], c["w13_scale"][e]),
                ("up_proj", slice(i, 2 * i), c["w13_q"][e], c["w13_scale"][e]),
                ("down_proj", slice(None), c["w2_q"][e], c["w2_scale"][e]),
            ):
                m = f"{s.prefix}.experts.{e}.{role}"
                mod = root.get_submodule(m)
                decompress_module(mod)
                oracle = mod.weight.data  # compressed-tensors' own q * scale
                assert torch.equal(q[rows], sd[m + ".weight"]), m
                assert torch.equal(sc[rows], sd[m + ".weight_scale"].float().view(-1)), m
                ours = (q[rows].float() * sc[rows].view(-1, 1)).to(oracle.dtype)
                assert torch.equal(ours, oracle), f"{m}: dequantized weights differ from compressed-tensors'"
                assert torch.equal(
                    (layer.w13 if role != "down_proj" else layer.w2)[e][rows].to(oracle.dtype), oracle
                ), m
                n_min += int((q[rows] == -128).sum())
                seen.add(m)
    assert len(seen) == 2 * 8 * 3
    assert n_min > 0, "the fixture should exercise -128 codes"


@cache
def converted(tmp_root: str, src: str, quantize: str | None) -> Path:
    dst = Path(tmp_root) / f"{src}-{quantize}"
    moepack.convert(fixture_dir(src), dst, quantize=quantize)
    return dst


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("int8conv"))


@pytest.mark.parametrize(
    "src,quantize,note",
    [
        (CT, None, "compressed-tensors int-quantized"),
        (CT, "int8", "compressed-tensors int-quantized"),
        ("qwen3_moe", "int8", "quantized by moepack from BF16"),
        ("deepseek_v3", "int8", "quantized by moepack from BF16"),  # a shared expert
        ("gpt_oss", "int8", "quantized by moepack from BF16"),  # swigluoai: interleaved rows + biases
    ],
)
def test_convert_verify_open(tmp_root, src, quantize, note):
    dst = converted(tmp_root, src, quantize)
    m = json.loads((dst / MANIFEST).read_text())
    assert list(m["layouts"]) == [str(INT8_LAYOUT.id)]
    for L in m["layers"]:
        assert L["layout_id"] == INT8_LAYOUT.id and L["scheme"] == "int8_channel"
        assert L["scheme_source"].startswith(note)
        assert m["tensors"][L["tensors"]["w13"]]["dtype"] == "int8"
        assert m["tensors"][L["tensors"]["w13_scale"]]["dtype"] == "float32"
        assert m["tensors"][L["tensors"]["w2_colsum"]]["dtype"] == "int32"
    report = moepack.verify(dst, source=fixture_dir(src))
    assert report.ok, report.failures()
    assert report.layers and all(c.weights_exact for c in report.layers)
    assert all(c.rel_err_fp32 is not None and c.rel_err_fp32 < 3e-2 for c in report.layers)
    model = moepack.open(dst)
    for layer in model.layers.values():
        assert layer.packed.layout is INT8_LAYOUT and layer.kernel[0] in ISAS
        x = torch.randn(5, layer.hidden_size, generator=torch.Generator().manual_seed(layer.index))
        out = layer(x)
        assert out.shape == x.shape and bool(torch.isfinite(out).all())
        if layer.shared is not None:
            assert layer.shared.layout is INT8_LAYOUT and layer.shared.w13_scale is not None


def test_ct_layer_against_independent_references(tmp_root):
    """The packed layer's experts vs (a) moe_reference_int8 on the FILE's codes and scales and
    (b) the fp32 reference on compressed-tensors' own decompressed weights."""
    from compressed_tensors.compressors import decompress_module

    d = fixture_dir(CT)
    root, names, sd = _ct_modules(d)
    model = moepack.open(converted(tmp_root, CT, None))
    g = torch.Generator().manual_seed(3)
    for layer in model.layers.values():
        pre = layer.entry["prefix"]
        q13 = torch.stack([torch.cat([sd[f"{pre}.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")]) for e in range(8)])
        s13 = torch.stack([torch.cat([sd[f"{pre}.experts.{e}.{p}.weight_scale"] for p in ("gate_proj", "up_proj")]) for e in range(8)])
        q2 = torch.stack([sd[f"{pre}.experts.{e}.down_proj.weight"] for e in range(8)])
        s2 = torch.stack([sd[f"{pre}.experts.{e}.down_proj.weight_scale"] for e in range(8)])
        deq = {}
        for e in range(8):
            for p in ("gate_proj", "up_proj", "down_proj"):
                mod = root.get_submodule(f"{pre}.experts.{e}.{p}")
                decompress_module(mod)
                deq[e, p] = mod.weight.data.float()
        w13 = torch.stack([torch.cat([deq[e, "gate_proj"], deq[e, "up_proj"]]) for e in range(8)])
        w2 = torch.stack([deq[e, "down_proj"] for e in range(8)])
        x = torch.randn(9, layer.hidden_size, generator=g)
        w, ids = torch.softmax(torch.randn(9, 8, generator=g), -1).topk(2)
        w, ids = w.contiguous(), ids.int().contiguous()
        out = layer.experts(x, w, ids)
        ref, flip = moe_reference_int8(x, q13, s13.float().squeeze(-1), q2, s2.float().squeeze(-1), w, ids, return_flip=True)
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel <= max(1e-5, 2 * flip / ref.norm().item()), rel
        ref32 = moe_reference(x, w13, w2, w, ids)
        assert ((out - ref32).norm() / ref32.norm()).item() < 3e-2


def test_dense_quantized_codes_are_moepack_quantization(tmp_root):
    model = moepack.open(converted(tmp_root, "qwen3_moe", "int8"))
    ckpt, reader = open_source(fixture_dir("qwen3_moe"))
    spec = {s.index: s for s in reader.layers(ckpt)}
    layer = model.layers[1]
    w13 = reader.read_expert_w13(ckpt, spec[1], 5)
    q, s = quantize_int8_per_channel(w13)
    ip = layer.packed.padded_intermediate
    assert torch.equal(layer.packed.w13_scale[5, :40], s[:40]) and torch.equal(layer.packed.w13_scale[5, ip : ip + 40], s[40:])
    assert torch.equal(layer.packed.w13_colsum[5, :40], q[:40].int().sum(-1, dtype=torch.int32))


def cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_inspect_and_cli(tmp_root, tmp_path):
    dst = converted(tmp_root, CT, None)
    r = cli("inspect", dst, "--json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert {x["scheme"] for x in info["layers"]} == {"int8_channel"} and {x["layout"] for x in info["layers"]} == {INT8_LAYOUT.name}
    r = cli("inspect", dst)
    assert r.exit_code == 0 and "compressed-tensors int-quantized" in " ".join(r.stdout.split())
    r = cli("convert", fixture_dir("qwen3_moe"), tmp_path / "cli", "--quantize", "int8", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["layout"] == INT8_LAYOUT.name
    r = cli("verify", tmp_path / "cli", "--source", fixture_dir("qwen3_moe"))
    assert r.exit_code == 0, r.stdout
    r = cli("convert", fixture_dir("qwen3_moe"), tmp_path / "x", "--quantize", "int3")
    assert r.exit_code == 2 and "quantize='int3'" in r.stderr and not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# Bad input: refused with the tensor's name (or the config's reason), nothing written
# ---------------------------------------------------------------------------------------------

E3 = "model.layers.1.mlp.experts.3"


def _broken_copy(tmp_path: Path, edit_tensors=None, edit_config=None) -> Path:
    d = tmp_path / "src"
    shutil.copytree(fixture_dir(CT), d)
    if edit_tensors:
        sd = load_file(str(d / "model.safetensors"))
        edit_tensors(sd)
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        cfg = json.loads((d / "config.json").read_text())
        edit_config(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def _set(name, value):
    def f(sd):
        sd[name] = value(sd[name]) if callable(value) else value

    return f


def _scale_at(name, idx, v):
    def f(sd):
        t = sd[name].clone()
        t.view(-1)[idx] = v
        sd[name] = t

    return f


BAD_TENSORS = {
    "bf16 expert weight": (_set(f"{E3}.up_proj.weight", lambda t: t.to(torch.bfloat16)), [f"{E3}.up_proj.weight", "BF16", "I8"]),
    "missing scale": (lambda sd: sd.pop(f"{E3}.down_proj.weight_scale"), [f"{E3}.down_proj.weight_scale", "missing"]),
    "zero scale": (_scale_at(f"{E3}.gate_proj.weight_scale", 7, 0.0), [f"{E3}.gate_proj.weight_scale", "[7] = 0.0", "finite and > 0"]),
    "negative scale": (_scale_at(f"{E3}.gate_proj.weight_scale", 2, -0.5), [f"{E3}.gate_proj.weight_scale", "[2] = -0.5"]),
    "nan scale": (_scale_at(f"{E3}.down_proj.weight_scale", 0, float("nan")), [f"{E3}.down_proj.weight_scale", "nan"]),
    "inf scale": (_scale_at(f"{E3}.up_proj.weight_scale", 39, float("inf")), [f"{E3}.up_proj.weight_scale", "inf"]),
    "per-tensor scale": (_set(f"{E3}.up_proj.weight_scale", lambda t: t[:1, 0].contiguous()), [f"{E3}.up_proj.weight_scale", "[1]", "[40, 1]"]),
    "group scales": (_set(f"{E3}.up_proj.weight_scale", lambda t: t.repeat(1, 2)), [f"{E3}.up_proj.weight_scale", "[40, 2]"]),
    "int32 scale": (_set(f"{E3}.up_proj.weight_scale", lambda t: t.int()), [f"{E3}.up_proj.weight_scale", "I32"]),
    "zero point": (_set(f"{E3}.up_proj.weight_zero_point", torch.zeros(40, 1, dtype=torch.int8)), [f"{E3}.up_proj.weight_zero_point"]),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_tensors_are_refused_by_name(tmp_path, case):
    edit, words = BAD_TENSORS[case]
    src = _broken_copy(tmp_path, edit_tensors=edit)
    with pytest.raises(MoepackError) as ei:
        moepack.convert(src, tmp_path / "dst")
    for w in words:
        assert w in str(ei.value), f"{case}: {w!r} not in {ei.value}"
    assert not (tmp_path / "dst").exists()


def _group(qc):
    return qc["config_groups"]["group_0"]


BAD_CONFIGS = {
    "pack-quantized": (lambda qc: (qc.update(format="pack-quantized"), _group(qc).update(format="pack-quantized")), "format 'pack-quantized'"),
    "weight-only int8": (lambda qc: _group(qc).update(input_activations=None), "W8A8"),
    "static activations": (lambda qc: _group(qc)["input_activations"].update(dynamic=False), "W8A8"),
    "per-tensor weights": (lambda qc: _group(qc)["weights"].update(strategy="tensor"), "strategy='tensor'"),
    "asymmetric": (lambda qc: _group(qc)["weights"].update(symmetric=False), "symmetric=False"),
    "4-bit": (lambda qc: _group(qc)["weights"].update(num_bits=4), "num_bits=4"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_unsupported_configs_are_refused_with_the_reason(tmp_path, case):
    edit, words = BAD_CONFIGS[case]
    src = _broken_copy(tmp_path, edit_config=edit)
    with pytest.raises(MoepackError, match="no reader handles it") as ei:
        moepack.convert(src, tmp_path / "dst")
    assert words in str(ei.value) and not (tmp_path / "dst").exists()


def test_quantize_option_is_checked(tmp_path):
    with pytest.raises(MoepackError, match="quantize='fp6'"):
        moepack.convert(fixture_dir("qwen3_moe"), tmp_path / "dst", quantize="fp6")
    assert not (tmp_path / "dst").exists()


# ---------------------------------------------------------------------------------------------
# Other families' names: the reader uses the dense reader's per-expert patterns
# ---------------------------------------------------------------------------------------------


def _renamed_copy(tmp_path: Path, rename, config_update: dict, extra=None) -> Path:
    d = tmp_path / "renamed"
    shutil.copytree(fixture_dir(CT), d)
    sd = load_file(str(d / "model.safetensors"))
    # relabelled, it is no whole model of its new type (its attention stays Qwen3's), which
    # convert's config cross-check would refuse; without the embedding it is packed as experts
    # and carried-over tensors, which is what these tests are about
    sd = {rename(k): v for k, v in sd.items() if not k.endswith("embed_tokens.weight")}
    if extra:
        extra(sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(config_update)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_mixtral_names(tmp_path):
    """w1 / w3 / w2 under block_sparse_moe (Mixtral, Phi-3.5-MoE)."""
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def rename(k):
        k = k.replace(".mlp.", ".block_sparse_moe.")
        for a, b in names.items():
            k = k.replace(f".{a}.", f".{b}.")
        return k

    src = _renamed_copy(tmp_path, rename, {"model_type": "mixtral"})
    ckpt, reader = open_source(src)
    s = reader.layers(ckpt)[0]
    assert reader.name == "compressed-tensors" and s.prefix.endswith("block_sparse_moe")
    assert s.names[(3, "up", "scale")].endswith("experts.3.w3.weight_scale")
    moepack.convert(src, tmp_path / "dst")
    report = moepack.verify(tmp_path / "dst", source=src)
    assert report.ok and all(c.weights_exact for c in report.layers), report.failures()


def test_gpt_oss_rows_are_reinterleaved(tmp_path):
    """gpt-oss linearized by llm-compressor: per-expert gate_proj / up_proj (de-interleaved) +
    biases; swigluoai wants rows 2j = gate_j, 2j+1 = up_j, and the biases likewise."""
    g = torch.Generator().manual_seed(9)

    def biases(sd):
        for k in [k for k in sd if ".experts." in k and k.endswith(".weight")]:
            sd[k[: -len(".weight")] + ".bias"] = torch.randn(sd[k].shape[0], generator=g).to(torch.bfloat16)

    src = _renamed_copy(tmp_path, lambda k: k, {"model_type": "gpt_oss"}, extra=biases)
    ckpt, reader = open_source(src)
    s = reader.layers(ckpt)[1]
    assert s.interleaved and s.activation == "swigluoai" and s.has_bias
    sd = load_file(str(src / "model.safetensors"))
    c = reader.read_expert_canonical(ckpt, s, "w13", 6)
    q, sc = c["w13_q"], c["w13_scale"]
    p = f"{s.prefix}.experts.6"
    assert torch.equal(q[0::2], sd[f"{p}.gate_proj.weight"]) and torch.equal(q[1::2], sd[f"{p}.up_proj.weight"])
    assert torch.equal(sc[0::2], sd[f"{p}.gate_proj.weight_scale"].float().view(-1))
    b13, _ = reader.read_biases(ckpt, s)
    assert torch.equal(b13[6, 0::2], sd[f"{p}.gate_proj.bias"]) and torch.equal(b13[6, 1::2], sd[f"{p}.up_proj.bias"])
    moepack.convert(src, tmp_path / "dst")
    report = moepack.verify(tmp_path / "dst", source=src)
    assert report.ok, report.failures()
    assert moepack.open(tmp_path / "dst").layers[1].activation == "swigluoai"
