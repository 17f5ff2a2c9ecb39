"""``moepack verify --source`` checks the shared experts (DeepSeek-V3 / GLM-4.5
``mlp.shared_experts``, Qwen2-MoE ``mlp.shared_expert`` + ``shared_expert_gate``, Llama-4
``feed_forward.shared_expert``) like the routed ones:

* ``shared_w13`` / ``shared_w2`` equal the source rounded to bf16, bit for bit, padding included;
  int8 packs (``--quantize int8``, or a compressed-tensors source) also their scales and column
  sums; the gate bit for bit; the report counts them (``weights_checked`` /
  ``shared_weights_checked``, the CLI's ``weights:`` line and ``shared expert == source`` column).
* One element changed in a packed shared-expert tensor, WITH the manifest's sha256 updated so that
  the checksum pass is clean, fails verify by the numeric check: the message names the layer, the
  tensor, the element ([expert, row, col] of the unpacked values), both values and the rule.
* The layer-output check includes the shared expert's (gated) output.
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
from moepack.runtime.model import PackedMoELayer
from tests.support.fixtures_util import fixture_dir, fixture_info
from tests.support.packdir_edit import rewrite_tensor, set_element, set_unpacked, reseal

QUANT_ROLES = ("w13_scale", "w2_scale", "w13_colsum", "w2_colsum")


def cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def flat(text: str) -> str:
    return " ".join(text.translate({c: " " for c in range(0x2500, 0x2580)}).split())


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("verify_shared"))


@cache
def converted(tmp_root: str, name: str, quantize: str | None) -> Path:
    dst = Path(tmp_root) / f"{name}-{quantize}"
    moepack.convert(fixture_dir(name), dst, quantize=quantize)
    return dst


def copy_of(tmp_root: str, name: str, quantize: str | None, tmp_path: Path) -> Path:
    d = tmp_path / "packed"
    shutil.copytree(converted(tmp_root, name, quantize), d)
    return d


def shared_names(entry: dict, quantized: bool) -> set[str]:
    """Every tensor of a manifest layer entry's shared expert that verify compares."""
    sh = entry["shared"]
    roles = ("w13", "w2") + (QUANT_ROLES if quantized else ())
    return {sh[r] for r in roles} | ({sh["gate"]} if sh.get("gate") else set())


# ---------------------------------------------------------------------------------------------
# a good directory: every shared tensor compared and counted


SHARED = [
    ("deepseek_v3", None),
    ("glm4_moe", None),
    ("llama4_text", None),
    ("qwen2_moe", None),  # F32 source (rounded to bf16), gated shared expert
    ("deepseek_v3", "int8"),
    ("qwen2_moe", "int8"),
]


@pytest.mark.parametrize("name,quantize", SHARED)
def test_verify_compares_and_counts_the_shared_expert(tmp_root, name, quantize):
    dst = converted(tmp_root, name, quantize)
    m = json.loads((dst / MANIFEST).read_text())
    report = moepack.verify(dst, source=fixture_dir(name))
    assert report.ok, report.failures()
    assert [c.index for c in report.layers] == fixture_info(name)["moe_layers"]
    n_routed = 2 + (4 if quantize else 0)
    for c, entry in zip(report.layers, m["layers"]):
        assert entry["shared"], "the fixture has a shared expert"
        assert c.weights_exact and c.shared_exact is True and c.rel_err <= c.tol, c
        assert set(c.tensors) == {entry["tensors"][r] for r in ("w13", "w2") + (QUANT_ROLES if quantize else ())}
        assert set(c.shared_tensors) == shared_names(entry, bool(quantize)) and all(c.shared_tensors.values())
    n_shared = sum(len(shared_names(e, bool(quantize))) for e in m["layers"])
    assert report.weights_checked(shared=True) == (n_shared, n_shared)
    assert report.weights_checked() == (n_shared + n_routed * len(m["layers"]),) * 2
    d = report.to_dict()
    assert d["shared_weights_checked"] == n_shared and d["weights_checked"] == n_shared + n_routed * len(m["layers"])
    assert d["layers"][0]["shared_exact"] is True and set(d["layers"][0]["shared_tensors"]) == set(report.layers[0].shared_tensors)


def test_layers_without_a_shared_expert_report_none(tmp_root):
    report = moepack.verify(converted(tmp_root, "qwen3_moe", None), source=fixture_dir("qwen3_moe"))
    assert report.ok and all(c.shared_exact is None and c.shared_tensors == {} for c in report.layers)
    assert report.weights_checked(shared=True) == (0, 0) and report.weights_checked() == (4, 4)


def test_cli_prints_the_shared_expert(tmp_root):
    dst = converted(tmp_root, "deepseek_v3", "int8")
    r = cli("verify", dst, "--source", fixture_dir("deepseek_v3"))
    assert r.exit_code == 0, r.stdout
    out = flat(r.stdout)
    assert "weights: 12/12 packed expert tensors equal the source (shared experts: 6/6)" in out, out
    assert " 1 yes yes " in out, out  # layer 1: routed and shared expert weights == source
    r = cli("verify", dst, "--source", fixture_dir("deepseek_v3"), "--json")
    v = json.loads(r.stdout)
    assert v["weights_checked"] == 12 and v["shared_weights_checked"] == 6 and v["layers"][0]["shared_exact"] is True
    r = cli("verify", converted(tmp_root, "qwen3_moe", None), "--source", fixture_dir("qwen3_moe"))
    out = flat(r.stdout)
    assert "weights: 4/4 packed expert tensors equal the source" in out and "shared" not in out, out


# ---------------------------------------------------------------------------------------------
# one element changed, the manifest's sha256 kept consistent (tests/support/packdir_edit.py): the
# numeric check catches it


# (fixture, quantize, role in the manifest's shared entry, edit(layout) -> edit(t), words in the
# message beyond the tensor's name and the layer). deepseek_v3: H=72, Is=40, Ip=64 (padded),
# Np(H)=96, so shared_w13 row 64+3 is up row 3 and shared_w2 row 80 is a padding row. Codes
# -128 and column sums 99999 are values moepack's quantization never produces.
CORRUPT = {
    "bf16 w13 gate": ("deepseek_v3", None, "w13", lambda lay: set_unpacked(lay, (0, 5, 7), 0.5),
                      ["[expert 0, gate row 5, col 7] is 0.5", "the source rounded to bf16 gives"]),
    "bf16 w13 up": ("deepseek_v3", None, "w13", lambda lay: set_unpacked(lay, (0, 64 + 3, 70), -2.0),
                    ["[expert 0, up row 3, col 70] is -2.0", "the source rounded to bf16 gives"]),
    "bf16 w13 sign of zero": ("llama4_text", None, "w13", lambda lay: set_unpacked(lay, (0, 40, 0), -0.0),
                              ["[expert 0, padding row 40, col 0] is -0.0", "gives 0.0"]),
    "bf16 w2 padding row": ("deepseek_v3", None, "w2", lambda lay: set_unpacked(lay, (0, 80, 3), 1.0),
                            ["[expert 0, padding row 80, col 3] is 1.0", "gives 0.0"]),
    "bf16 w2 padding col": ("glm4_moe", None, "w2", lambda lay: set_unpacked(lay, (0, 10, 50), 1.0),
                            ["[expert 0, row 10, padding col 50] is 1.0", "gives 0.0"]),
    "f32 source w2": ("qwen2_moe", None, "w2", lambda lay: set_unpacked(lay, (0, 39, 55), 3.0),
                      ["[expert 0, row 39, col 55] is 3.0", "the source rounded to bf16 gives"]),
    "gate": ("qwen2_moe", None, "gate", lambda lay: set_element((0, 20), 7.0),
             ["[0, 20] is 7.0", "the source's 'model.layers.1.mlp.shared_expert_gate.weight' gives"]),
    "int8 w13 code": ("deepseek_v3", "int8", "w13", lambda lay: set_unpacked(lay, (0, 2, 9), -128),
                      ["[expert 0, gate row 2, col 9] is -128", "quantize_int8_per_channel of the source gives"]),
    "int8 w2 code": ("qwen2_moe", "int8", "w2", lambda lay: set_unpacked(lay, (0, 1, 0), -128),
                     ["[expert 0, row 1, col 0] is -128", "quantize_int8_per_channel of the source gives"]),
    "int8 w13 scale": ("deepseek_v3", "int8", "w13_scale", lambda lay: set_element((0, 64 + 1), 0.25),
                       ["[expert 0, up row 1] is 0.25", "quantize_int8_per_channel of the source gives"]),
    "int8 w2 scale padding": ("deepseek_v3", "int8", "w2_scale", lambda lay: set_element((0, 90), 1.0),
                              ["[expert 0, padding row 90] is 1.0", "gives 0.0"]),
    "int8 w13 colsum": ("deepseek_v3", "int8", "w13_colsum", lambda lay: set_element((0, 7), 12345),
                        ["[expert 0, gate row 7] is 12345", "quantize_int8_per_channel of the source gives"]),
    "int8 w2 colsum": ("qwen2_moe", "int8", "w2_colsum", lambda lay: set_element((0, 0), 99999),
                       ["[expert 0, row 0] is 99999", "quantize_int8_per_channel of the source gives"]),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_a_changed_shared_element_fails_verify_by_name(tmp_root, tmp_path, case):
    name, quantize, role, make_edit, words = CORRUPT[case]
    d = copy_of(tmp_root, name, quantize, tmp_path)
    m = json.loads((d / MANIFEST).read_text())
    entry = m["layers"][-1]
    layer, tensor = entry["index"], entry["shared"][role]
    rewrite_tensor(d, tensor, make_edit(moepack.open(d).layers[layer].packed.layout))

    clean = moepack.verify(d)  # the sha256 was updated: the checksum pass cannot see it
    assert len(clean.tensors) == len(m["tensors"])
    # an int8 code or column sum edited alone breaks the rule "column sum = sum of the codes",
    # which verify checks without the source (moepack.verify.values); every other edit keeps
    # every value rule, and only the source can tell
    colsum = entry["shared"].get(role.split("_")[0] + "_colsum")
    values = [f"tensor {colsum!r} in " + m["tensors"][colsum]["file"]] if quantize and role.endswith(("w13", "w2", "colsum")) else []
    assert [f.split(":")[0] for f in clean.failures()] == values, clean.failures()
    report = moepack.verify(d, source=fixture_dir(name))
    assert not report.ok
    (bad,) = [c for c in report.layers if not c.ok]
    assert bad.index == layer and bad.weights_exact and bad.shared_exact is False
    assert [n for n, ok in bad.shared_tensors.items() if not ok] == [tensor]
    msg, *more = report.failures()[len(values):]
    # the gate is a carried-over tensor: step 4 also finds its bytes differ from the source's
    assert more == ([f"model: carried-over tensor {tensor!r}: its bytes differ from the source's (sha256)"] if role == "gate" else [])
    assert msg.startswith(f"layer {layer}: packed weights differ from the source: tensor {tensor!r} "), msg
    for w in words + ["1 of", "elements differ", "must equal it exactly"]:
        assert w in msg, f"{w!r} not in {msg!r}"
    eq, n = report.weights_checked(shared=True)
    routed = (2 + 4 * bool(quantize)) * len(report.layers)
    assert eq == n - 1 and report.weights_checked() == (eq + routed, n + routed)


def test_cli_names_the_changed_shared_tensor(tmp_root, tmp_path):
    d = copy_of(tmp_root, "deepseek_v3", "int8", tmp_path)
    tensor = "moepack.layers.1.shared_w13_scale"
    rewrite_tensor(d, tensor, set_element((0, 64 + 1), 0.25))
    r = cli("verify", d, "--source", fixture_dir("deepseek_v3"))
    assert r.exit_code == 1
    out = flat(r.stdout)
    assert "checksums: 36/36 tensors match the manifest" in out
    assert "weights: 11/12 packed expert tensors equal the source (shared experts: 5/6)" in out, out
    assert f"FAIL layer 1: packed weights differ from the source: tensor {tensor!r} [expert 0, up row 1] is 0.25, " in out, out
    r = cli("verify", d, "--source", fixture_dir("deepseek_v3"), "--json")
    assert r.exit_code == 1
    v = json.loads(r.stdout)
    assert v["ok"] is False and len(v["failures"]) == 1 and tensor in v["failures"][0]
    (c,) = v["layers"]
    assert c["weights_exact"] is True and c["shared_exact"] is False and c["shared_tensors"][tensor] is False


def test_without_the_sha256_update_both_checks_name_the_tensor(tmp_root, tmp_path):
    d = copy_of(tmp_root, "deepseek_v3", None, tmp_path)
    tensor = "moepack.layers.1.shared_w2"
    sha = json.loads((d / MANIFEST).read_text())["tensors"][tensor]["sha256"]
    rewrite_tensor(d, tensor, set_unpacked(moepack.open(d).layers[1].packed.layout, (0, 3, 4), 0.125))
    m = json.loads((d / MANIFEST).read_text())
    m["tensors"][tensor]["sha256"] = sha  # as a flipped byte on disk leaves it
    (d / MANIFEST).write_text(json.dumps(reseal(m), indent=1))
    report = moepack.verify(d, source=fixture_dir("deepseek_v3"))
    f = report.failures()
    assert len(f) == 2 and f[0].startswith(f"tensor {tensor!r} in ") and "sha256" in f[0]
    assert f[1].startswith(f"layer 1: packed weights differ from the source: tensor {tensor!r} [expert 0, row 3, col 4] is 0.125")


def test_shared_expert_missing_from_the_manifest(tmp_root, tmp_path):
    d = copy_of(tmp_root, "deepseek_v3", None, tmp_path)
    m = json.loads((d / MANIFEST).read_text())
    m["layers"][0]["shared"] = None
    (d / MANIFEST).write_text(json.dumps(reseal(m), indent=1))
    report = moepack.verify(d, source=fixture_dir("deepseek_v3"))
    (c,) = report.layers
    assert not report.ok and c.weights_exact and c.shared_exact is False
    names = [f"model.layers.1.mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    assert f"the source has a shared expert ({', '.join(map(repr, names))}), the packed layer has none" in c.detail


def test_the_output_check_includes_the_shared_expert(tmp_root, monkeypatch):
    """Weights all exact, but the packed layer's shared-expert output is off: the output check
    (routed + gated shared expert vs the references) fails."""
    dst = converted(tmp_root, "qwen2_moe", None)
    orig = PackedMoELayer.shared_expert
    monkeypatch.setattr(PackedMoELayer, "shared_expert", lambda self, x, act_mode=None: orig(self, x, act_mode) * 1.5)
    report = moepack.verify(dst, source=fixture_dir("qwen2_moe"))
    assert not report.ok
    for c in report.layers:
        assert c.weights_exact and c.shared_exact is True and c.rel_err > c.tol
        assert "output differs from the reference" in c.detail


# ---------------------------------------------------------------------------------------------
# compressed-tensors int8 sources with a shared expert: int8 codes packed as they are, or a
# float shared expert kept float (the float layout beside the int8 codes: docs/FORMATS.md "Float
# shared experts")


@pytest.mark.parametrize("shared_dtype", ["I8", "BF16"])
def test_compressed_tensors_source_with_a_shared_expert(tmp_path, shared_dtype):
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("qwen3_moe_w8a8"), src)
    sd = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    h, si = 72, 24
    pre = "model.layers.1.mlp.shared_expert"
    for p, shape in (("gate_proj", (si, h)), ("up_proj", (si, h)), ("down_proj", (h, si))):
        w = torch.randn(*shape, generator=g) * 0.1
        if shared_dtype == "I8":
            scale = w.abs().amax(-1, keepdim=True) / 127
            sd[f"{pre}.{p}.weight"] = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
            sd[f"{pre}.{p}.weight_scale"] = scale.to(torch.bfloat16)
        else:
            sd[f"{pre}.{p}.weight"] = w.to(torch.bfloat16)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    moepack.convert(src, tmp_path / "dst")
    report = moepack.verify(tmp_path / "dst", source=src)
    assert report.ok, report.failures()
    c = report.layers[1]
    # int8: codes, scales and column sums of w13 and w2; float: shared_w13 / shared_w2 (bf16)
    assert c.shared_exact is True and len(c.shared_tensors) == (6 if shared_dtype == "I8" else 2)
    assert report.layers[0].shared_exact is None
    entry = json.loads((tmp_path / "dst" / MANIFEST).read_text())["layers"][1]
    assert ("layout_id" in entry["shared"]) == (shared_dtype == "BF16")

    if shared_dtype == "I8":
        rewrite_tensor(tmp_path / "dst", "moepack.layers.1.shared_w2_scale", set_element((0, 5), 0.5))
        (msg,) = moepack.verify(tmp_path / "dst", source=src).failures()
        want = "tensor 'moepack.layers.1.shared_w2_scale' [expert 0, row 5] is 0.5, the source's own int8 codes and scales gives"
        assert want in msg, msg
    else:
        rewrite_tensor(tmp_path / "dst", "moepack.layers.1.shared_w2", set_element((0, 5, 3), 0.5))
        (msg,) = moepack.verify(tmp_path / "dst", source=src).failures()
        assert "tensor 'moepack.layers.1.shared_w2' [expert 0, row " in msg and "is 0.5, the source rounded to bf16 gives" in msg, msg


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("intermediate", 100, ["shared tensor 'moepack.layers.1.shared_w13' is bfloat16 [1, 128, 72]", "layout math says bfloat16 [1, 256, 72]"]),
        ("padded_intermediate", 96, ["shared.padded_intermediate=96", "layout math says 64"]),
    ],
)
def test_open_checks_the_shared_expert_against_layout_math(tmp_root, tmp_path, field, value, words):
    """The structural pass (moepack.open, and so verify) holds the shared expert's shapes to the
    layout math like the routed ones', so the numeric pass never unpacks a wrong shape."""
    from moepack.errors import PackedDirError

    d = copy_of(tmp_root, "deepseek_v3", None, tmp_path)
    m = json.loads((d / MANIFEST).read_text())
    m["layers"][0]["shared"][field] = value
    (d / MANIFEST).write_text(json.dumps(reseal(m), indent=1))
    with pytest.raises(PackedDirError) as ei:
        moepack.verify(d, source=fixture_dir("deepseek_v3"))
    for w in words:
        assert w in str(ei.value), f"{w!r} not in {ei.value}"
