"""convert never writes a pack that open refuses, and refuses values whose arithmetic overflows
(issue 49):

* swigluoai's ``swiglu_limit`` / ``swiglu_alpha`` in config.json: convert applies open's rule
  for the manifest's ``limit`` / ``alpha`` (moepack.manifest's ``swiglu_param_problem``, one
  rule) before writing anything; a value float32 cannot hold (1e300) is refused by both, so
  verify --source never meets it (it died in a 50-line traceback);
* FP8 scales whose product with e4m3fn's largest code (448) overflows float32, and MXFP4 e8m0
  scales 253 and 254 (6 x 2^(e - 127) overflows): convert refuses them naming the tensor, the
  element and the rule; a pack edited to hold one is refused by open and verify;
* verify's failure lines always say what differs: an output that is not finite is named, never
  "FAIL layer 1:" with nothing after it;
* a property check over random edits of the swigluoai fields: a hand-edited manifest and a
  config.json with the same values get the same verdict from open and from convert.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moepack
from moepack.errors import ConvertError, MoepackError, PackedDirError
from moepack.manifest import MANIFEST, swiglu_param_problem
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import rewrite_tensor, reseal

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cli(*args):
    from typer.testing import CliRunner

    from moepack.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def _nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "dst").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".dst")] in ([], [".dst.lock"])


# --------------------------------------------------------------------------- swigluoai's fields

SWIGLU = [  # (config key, value, the rule's words)
    ("swiglu_limit", -1.0, "must be > 0"),
    ("swiglu_limit", 0.0, "must be > 0"),
    ("swiglu_limit", float("nan"), "must be a finite number float32 holds"),
    ("swiglu_limit", float("inf"), "must be a finite number float32 holds"),
    ("swiglu_limit", 1e300, "must be a finite number float32 holds"),
    ("swiglu_alpha", float("nan"), "must be a finite number float32 holds"),
    ("swiglu_alpha", float("-inf"), "must be a finite number float32 holds"),
    ("swiglu_alpha", "1.7", "must be a finite number float32 holds"),
]


@pytest.mark.parametrize("key,value,words", SWIGLU, ids=[f"{k}={v!r}" for k, v, _ in SWIGLU])
def test_convert_refuses_what_open_refuses_before_writing(tmp_path, key, value, words):
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("gpt_oss"), src)
    _config(src, **{key: value})
    with pytest.raises(ConvertError) as ei:
        moepack.convert(src, tmp_path / "dst")
    msg = str(ei.value)
    assert f"config.json: {key}={value!r}: {words}" in msg and "\n" not in msg, msg
    _nothing_written(tmp_path)
    r = _cli("convert", src, tmp_path / "dst")
    assert r.exit_code == 2 and "Traceback" not in r.stderr + r.stdout
    assert r.stderr.startswith("moepack: error: ") and f"{key}=" in r.stderr and words in r.stderr, r.stderr
    _nothing_written(tmp_path)


@pytest.fixture(scope="module")
def gpt_oss_pack(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rules") / "gpt_oss"
    moepack.convert(fixture_dir("gpt_oss"), d)
    return d


@pytest.mark.parametrize("field,value", [("limit", 1e300), ("limit", -1.0), ("alpha", -1e39), ("alpha", 3.5e38)])
def test_open_refuses_the_same_values_in_a_manifest(gpt_oss_pack, tmp_path, field, value):
    d = tmp_path / "p"
    shutil.copytree(gpt_oss_pack, d)
    m = json.loads((d / MANIFEST).read_text())
    m["layers"][0][field] = value
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    with pytest.raises(PackedDirError) as ei:
        moepack.open(d)
    assert f"layers[0].{field}={value!r} (layer 0): {swiglu_param_problem(field, value)}" in str(ei.value), str(ei.value)
    r = _cli("verify", d, "--source", fixture_dir("gpt_oss"))
    assert r.exit_code == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_random_swiglu_values_get_one_verdict(gpt_oss_pack, tmp_path):
    """Property: for random values of ``limit`` / ``alpha``, the manifest check (open) and
    convert's check of config.json agree, value for value (one rule)."""
    rng = random.Random(49)
    pool = [0.0, -0.0, 1e-45, 1.0, 7.0, -3.0, 3.4028234663852886e38, 3.4028235677973366e38, 1e39, 1e300, float("nan"),
            float("inf"), float("-inf"), True, None, "7", 7, -1, 2**200]  # fmt: skip
    m0 = json.loads((gpt_oss_pack / MANIFEST).read_text())
    cfg0 = json.loads((fixture_dir("gpt_oss") / "config.json").read_text())
    from moepack.convert.plan import swiglu_params

    for trial in range(40):
        field = rng.choice(["limit", "alpha"])
        value = rng.choice(pool) if trial < 30 else rng.uniform(-1e39, 1e39)
        m = json.loads(json.dumps(m0))
        m["layers"][0][field] = value
        d = tmp_path / f"t{trial}"
        d.mkdir()
        for f in gpt_oss_pack.iterdir():
            (d / f.name).symlink_to(f)
        (d / MANIFEST).unlink()
        (d / MANIFEST).write_text(json.dumps(reseal(m)))
        try:
            moepack.open(d)
            open_ok = True
        except PackedDirError as e:
            open_ok = False
            assert f"layers[0].{field}=" in str(e) or "is not JSON: numbers must be finite" in str(e), str(e)
        cfg = dict(cfg0, **{f"swiglu_{field}": value})
        try:
            swiglu_params(cfg)
            convert_ok = True
        except ConvertError:
            convert_ok = False
        assert open_ok == convert_ok == (swiglu_param_problem(field, value) is None), (field, value, open_ok, convert_ok)


# --------------------------------------------------------------------------- FP8 and MXFP4 scales


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rules") / "fp8"
    _tool("fp8_checkpoint").write_fp8_checkpoint(fixture_dir("qwen3_moe"), d)
    return d


def _scale_names(src: Path, suffix: str) -> list[str]:
    sd = load_file(str(next(src.glob("*.safetensors"))))
    return sorted(n for n in sd if n.endswith(suffix) and ".experts." in n)


def _edit(src: Path, name: str, fn) -> None:
    for f in src.glob("*.safetensors"):
        sd = load_file(str(f))
        if name in sd:
            t = sd[name].clone()
            fn(t)
            sd[name] = t
            save_file(sd, str(f), metadata={"format": "pt"})
            return
    raise KeyError(name)


@pytest.mark.parametrize("value", [3e38, 1e36])
def test_an_fp8_scale_whose_products_overflow_is_refused(fp8_src, tmp_path, value):
    src = tmp_path / "src"
    shutil.copytree(fp8_src, src)
    name = [n for n in _scale_names(src, "weight_scale_inv") if ".experts.1.down_proj" in n][0]
    _edit(src, name, lambda t: t.view(-1)[0].fill_(value))
    with pytest.raises(MoepackError) as ei:
        moepack.convert(src, tmp_path / "dst")
    msg = str(ei.value)
    assert f"tensor {name!r}[0, 0] = {torch.tensor(value).item()!r}: scale x e4m3fn's largest code (448) overflows float32" in msg, msg
    _nothing_written(tmp_path)


def test_a_packed_fp8_scale_whose_products_overflow_is_refused(fp8_src, tmp_path):
    d = tmp_path / "p"
    moepack.convert(fp8_src, d)
    name = "moepack.layers.0.w2_scale"
    rewrite_tensor(d, name, lambda t: t.view(-1)[0].fill_(3e38))
    with pytest.raises(PackedDirError, match=rf"tensor '{name}' \[0, 0(, 0)?\] = 3\.0000000054977558e\+38: scales must be finite "
                                             r"and >= 0, and fp8 scales <= 7\.596e\+35"):  # fmt: skip
        moepack.open(d)
    rep = moepack.verify(d)
    bad = [t for t in rep.tensors if not t.ok]
    assert [t.name for t in bad] == [name] and "fp8 scales <= 7.596e+35" in bad[0].detail


@pytest.fixture(scope="module")
def mxfp4_src(tmp_path_factory) -> Path:
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("rules")
    cfg = json.loads((fixture_dir("gpt_oss") / "config.json").read_text())
    for k in ("architectures", "transformers_version", "dtype"):
        cfg.pop(k, None)
    cfg.update(hidden_size=64, intermediate_size=96, head_dim=32, num_local_experts=3)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.bfloat16).eval().save_pretrained(root / "bf16")
    _tool("mxfp4_checkpoint").write_mxfp4_checkpoint(root / "bf16", root / "mx")
    return root / "mx"


@pytest.mark.parametrize("e", [253, 254])
def test_an_e8m0_scale_whose_weights_decode_to_inf_is_refused(mxfp4_src, tmp_path, e):
    src = tmp_path / "src"
    shutil.copytree(mxfp4_src, src)
    name = "model.layers.1.mlp.experts.gate_up_proj_scales"
    _edit(src, name, lambda t: t.view(torch.uint8)[2, 5, 1].fill_(e) if t.dtype != torch.uint8 else t[2, 5, 1].fill_(e))
    with pytest.raises(MoepackError) as ei:
        moepack.convert(src, tmp_path / "dst")
    msg = str(ei.value)
    assert f"tensor {name!r}[2, 5, 1] = {e}: e8m0 scale 2^{e - 127} x e2m1's largest code 6 overflows float32" in msg, msg
    assert "MXFP4 scales must be 0..252" in msg
    _nothing_written(tmp_path)


def test_a_packed_e8m0_scale_of_254_is_refused(mxfp4_src, tmp_path):
    d = tmp_path / "p"
    moepack.convert(mxfp4_src, d)
    name = "moepack.layers.0.w13_scale"
    rewrite_tensor(d, name, lambda t: t[1, 1, 3].fill_(254))  # [expert, K group, output channel]
    with pytest.raises(PackedDirError, match=rf"tensor '{name}' \[1, 1, 3\] = 254: e8m0 scales must be 0\.\.252"):
        moepack.open(d)
    rep = moepack.verify(d)
    bad = [t for t in rep.tensors if not t.ok]
    assert [t.name for t in bad] == [name] and "e8m0 scales must be 0..252" in bad[0].detail


@pytest.mark.parametrize("e", [253, 254, 255])
def test_the_packer_refuses_what_convert_and_open_refuse(e):
    """The third door to the kernels (pack_experts on canonical tensors) keeps the same rule."""
    from moepack.errors import LayoutError
    from moepack.schemes.mxfp4 import check_mxfp4_canonical

    q = torch.zeros(2, 4, 64, dtype=torch.uint8)
    scale = torch.full((2, 4, 2), 127, dtype=torch.uint8)
    check_mxfp4_canonical("w13", q, scale)
    scale[1, 2, 1] = e
    with pytest.raises(LayoutError, match=rf"^w13_scale\[1, 2, 1\] = {e}: .*0\.\.252"):
        check_mxfp4_canonical("w13", q, scale)


def test_the_largest_accepted_scale_decodes_finite():
    """252 is accepted: the edge of the rule, its weights finite (6 x 2^125 < float32's max)."""
    from moepack.schemes.mxfp4.codec import dequantize_mxfp4

    w = dequantize_mxfp4(torch.tensor([[7, 15]], dtype=torch.uint8), torch.tensor([[252]], dtype=torch.uint8))
    assert torch.isfinite(w).all() and float(w.abs().max()) == 6 * 2.0**125


# --------------------------------------------------------------------------- verify's lines


def test_a_non_finite_output_is_named_in_the_failure_line():
    from moepack.verify.layer import _nonfinite

    out = torch.tensor([[1.0, 2.0], [float("inf"), 3.0]])
    ref = torch.tensor([[1.0, 2.0], [5.0, 3.0]])
    msg = _nonfinite(out, ref, "the reference")
    assert msg == ("output is not finite: the packed layer gives 1 NaN/Inf of 4 values, the reference 0 (first at [token 1, "
                   "column 0]: inf vs 5.0); the weights' products overflow float32 or a NaN reached them")  # fmt: skip
    assert _nonfinite(ref, ref, "the reference") is None


def test_verify_names_an_output_that_overflows(fp8_src, tmp_path):
    """Scales under the rule whose weights are near float32's largest (7e35 x the codes): convert
    accepts them, the layer's output overflows, and verify --source says so (it printed
    "FAIL layer 1:" with nothing after it)."""
    src = tmp_path / "src"
    shutil.copytree(fp8_src, src)
    for name in _scale_names(src, "weight_scale_inv"):
        if ".layers.1." in name:
            _edit(src, name, lambda t: t.fill_(7e35))
    d = tmp_path / "p"
    moepack.convert(src, d)
    rep = moepack.verify(d, source=src)
    bad = [c for c in rep.layers if not c.ok]
    assert [c.index for c in bad] == [1], [(c.index, c.detail) for c in rep.layers]
    assert "output is not finite: the packed layer gives" in bad[0].detail, bad[0].detail
    r = _cli("verify", d, "--source", src)
    assert r.exit_code == 1 and "output is not finite" in r.stdout, r.stdout
    assert not any(line.rstrip().endswith("layer 1:") for line in r.stdout.splitlines()), r.stdout


@pytest.mark.parametrize("name, idx", [("model.embed_tokens.weight", (3, 5)), ("model.norm.weight", (7,)),
                                       ("model.layers.0.self_attn.q_proj.weight", (0, 0))])  # fmt: skip
def test_a_nan_in_a_carried_float_tensor_is_refused_naming_it(tmp_path, name, idx):
    """A NaN in a float tensor that convert carries (an embedding row, a norm, attention) is a
    damaged checkpoint: refused naming the tensor and the first index, nothing written (before,
    the pack converted and verified, and generate later blamed the router's logits)."""
    from tests.support.ckpt_edit import copy_with_tensor

    def poison(t):
        t[idx] = float("nan")
        return t

    src = copy_with_tensor(fixture_dir("qwen3_moe"), tmp_path / "src", name, poison)
    t = load_file(str(src / "model.safetensors"))[name]
    with pytest.raises(ConvertError) as e:
        moepack.convert(src, tmp_path / "dst")
    assert str(e.value) == (f"source tensor {name!r} ({str(t.dtype).replace('torch.', '')} {list(t.shape)}) has a NaN at "
                            f"{list(idx)}: the tensors convert carries must not hold NaN (the checkpoint is damaged; "
                            "nothing was written)")  # fmt: skip
    assert not (tmp_path / "dst").exists() and [p.name for p in tmp_path.iterdir()] == ["src"]
