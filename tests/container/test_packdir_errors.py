"""Bad input to ``moepack convert`` / ``moepack.open`` / ``moepack verify``: each one is refused with
ONE clear error that names the thing and the rule (the asserts check substrings), never a crash.

* convert: nothing is written under the destination -- it does not exist afterwards and no
  temporary sibling ``.<name>.tmp-*`` is left in its parent -- and the CLI exits 2 with one line
  ``moepack: error: ...`` on stderr (no traceback).
* packed directories: ``moepack.open`` raises ``PackedDirError``; ``moepack inspect`` and ``moepack
  verify`` exit 2 with one line. A flipped data byte is not a structural error (open does not
  hash): the directory opens, and ``verify`` exits 1 naming the tensor.
* an interrupted convert (KeyboardInterrupt after the first layer, an OSError while copying the
  other tensors) leaves no destination and no temporary directory.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import moepack
from moepack.convert import plan as convert_plan
from moepack.convert.run import MANIFEST
from moepack.errors import MoepackError, PackedDirError
from tests.support.fixtures_util import fixture_dir
from tests.support.packdir_edit import reseal

# ---------------------------------------------------------------------------------------------
# helpers


def cli(*args):
    """Run the ``moepack`` CLI in-process; returns click's Result (exit_code, stdout, stderr)."""
    from moepack.cli.main import app
    from typer.testing import CliRunner

    return CliRunner().invoke(app, [str(a) for a in args])


def assert_one_error_line(result, *needles: str, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.stderr.splitlines()  # exactly one line: no blank line, no progress residue
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("moepack: error: "), line
    assert "Traceback" not in result.stderr + result.stdout
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    return line


def temp_siblings(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.tmp-") or p.name.startswith(f".{dst.name}.old-"))


def assert_nothing_written(dst: Path) -> None:
    assert not dst.exists(), f"{dst} was created"
    assert temp_siblings(dst) == [], f"temporary directories left: {temp_siblings(dst)}"


def assert_convert_refused(src: Path, tmp_path: Path, *needles: str) -> str:
    """convert(src, dst) raises a MoepackError naming ``needles``, writes nothing, and the CLI
    says the same in one line with exit status 2."""
    dst = tmp_path / "out" / "packed"
    dst.parent.mkdir(exist_ok=True)
    with pytest.raises(MoepackError) as ei:
        moepack.convert(src, dst)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert_nothing_written(dst)
    line = assert_one_error_line(cli("convert", src, dst), *needles)
    assert_nothing_written(dst)
    return line


def copy_fixture(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / f"src-{name}"
    shutil.copytree(fixture_dir(name), dst)
    return dst


def rewrite_safetensors(path: Path, edit) -> None:
    """Load every tensor of ``path``, let ``edit(dict)`` change the dict, save it back."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata=meta)


def rewrite_index(src: Path, edit) -> None:
    p = src / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    edit(idx["weight_map"])
    p.write_text(json.dumps(idx))


def file_holding(src: Path, tensor: str) -> Path:
    idx = src / "model.safetensors.index.json"
    if idx.is_file():
        return src / json.loads(idx.read_text())["weight_map"][tensor]
    return src / "model.safetensors"


def edit_tensor(src: Path, tensor: str, fn) -> None:
    """Replace one tensor of a copied checkpoint by ``fn(tensor)``."""

    def edit(t):
        t[tensor] = fn(t[tensor].clone())

    rewrite_safetensors(file_holding(src, tensor), edit)


def patch_header(path: Path, fn) -> None:
    """Let ``fn`` edit the JSON header of a safetensors file in place (same header length N)."""
    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    hdr = json.loads(b[8 : 8 + n])
    fn(hdr)
    js = json.dumps(hdr, separators=(",", ":")).encode()
    assert len(js) <= n
    path.write_bytes(b[:8] + js + b" " * (n - len(js)) + b[8 + n :])


# ---------------------------------------------------------------------------------------------
# convert: bad sources

Q3 = "model.layers.1.mlp"  # qwen3_moe layer 1, 8 experts, H=72, I=40, BF16


def test_not_a_moe_checkpoint(tmp_path):
    src = tmp_path / "llama"
    src.mkdir()
    h, i = 64, 128
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": i, "num_hidden_layers": 2}
    (src / "config.json").write_text(json.dumps(cfg))
    t = {"model.embed_tokens.weight": torch.randn(32, h).bfloat16()}
    for layer in range(2):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            t[f"model.layers.{layer}.mlp.{proj}.weight"] = torch.randn(shape).bfloat16()
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert_convert_refused(src, tmp_path, "not a MoE checkpoint", "model_type='llama'", "no expert tensors")


def test_no_config_json(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    (src / "config.json").unlink()
    assert_convert_refused(src, tmp_path, str(src), "has no config.json")


def test_config_json_not_json(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    (src / "config.json").write_text("{'model_type': qwen3_moe")
    assert_convert_refused(src, tmp_path, "config.json", "not valid JSON")


def test_source_is_not_a_directory(tmp_path):
    assert_convert_refused(tmp_path / "nowhere", tmp_path, "nowhere", "not a directory")


def test_quantized_checkpoint_is_not_read_as_dense(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    assert_convert_refused(src, tmp_path, "no reader handles it", "quantization_config", "'fp8'")


def test_missing_expert_tensor(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    rewrite_safetensors(src / "model.safetensors", lambda t: t.pop(f"{Q3}.experts.5.up_proj.weight"))
    assert_convert_refused(src, tmp_path, f"'{Q3}'", "expert 5 has no up weight", "config.json says 8 experts")


def test_missing_expert_tensor_in_a_sharded_checkpoint(tmp_path):
    src = copy_fixture("mixtral_sharded", tmp_path)
    name = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    rewrite_safetensors(file_holding(src, name), lambda t: t.pop(name))
    # the index still lists it: that is refused first, naming the tensor and the shard
    line = assert_convert_refused(src, tmp_path, "model.safetensors.index.json", repr(name), "no file holds it")
    assert file_holding(src, name).name in line
    rewrite_index(src, lambda wm: wm.pop(name))
    assert_convert_refused(src, tmp_path, "'model.layers.0.block_sparse_moe'", "expert 2 has no up weight", "4 experts")


def test_extra_expert_tensor(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    rewrite_safetensors(
        src / "model.safetensors", lambda t: t.update({f"{Q3}.experts.8.down_proj.weight": t[f"{Q3}.experts.0.down_proj.weight"].clone()})
    )
    assert_convert_refused(src, tmp_path, "extra expert tensors", f"{Q3}.experts.8.down_proj.weight", "config.json says 8 experts")


def test_expert_shape_mismatch(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    name = f"{Q3}.experts.3.down_proj.weight"
    edit_tensor(src, name, lambda w: w.t().contiguous())
    assert_convert_refused(src, tmp_path, repr(name), "has shape [40, 72]", "expected [72, 40]")


def test_fused_expert_shape_mismatch(tmp_path):
    src = copy_fixture("granitemoe", tmp_path)
    name = "model.layers.0.block_sparse_moe.output_linear.weight"  # [E, H, I] = [4, 72, 40]
    edit_tensor(src, name, lambda w: w.transpose(1, 2).contiguous())
    assert_convert_refused(src, tmp_path, repr(name), "has shape [4, 40, 72]", "expected [4, 72, 40]")


def test_expert_dtype_mismatch(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    name = f"{Q3}.experts.4.gate_proj.weight"
    edit_tensor(src, name, lambda w: w.half())
    assert_convert_refused(src, tmp_path, repr(name), "has dtype F16", "other expert tensors are BF16")


def test_integer_quantized_looking_expert(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    name = f"{Q3}.experts.2.up_proj.weight"
    edit_tensor(src, name, lambda w: (w.float() * 100).to(torch.int32))
    assert_convert_refused(src, tmp_path, repr(name), "has dtype I32", "must be BF16, F16 or F32")


def test_truncated_safetensors(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert_convert_refused(src, tmp_path, "model.safetensors", "not valid safetensors", "run past the end", "truncated?")
    f.write_bytes(data[:100])  # inside the header
    assert_convert_refused(src, tmp_path, "model.safetensors", "runs past the end of the file", "truncated?")
    f.write_bytes(data[:5])
    assert_convert_refused(src, tmp_path, "model.safetensors", "file is 5 bytes")


def test_corrupt_safetensors_header(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    f = src / "model.safetensors"
    b = bytearray(f.read_bytes())
    garbage = b'{"model.embed_tokens.weight": {"dtype": BF16, '
    b[8 : 8 + len(garbage)] = garbage
    f.write_bytes(bytes(b))
    assert_convert_refused(src, tmp_path, "model.safetensors", "header is not valid JSON")
    b[8:10] = b"\x00\xff"
    f.write_bytes(bytes(b))
    assert_convert_refused(src, tmp_path, "model.safetensors", "MUST begin with '{'")


def test_index_points_to_a_missing_shard(tmp_path):
    src = copy_fixture("mixtral_sharded", tmp_path)
    (src / "model-00002-of-00003.safetensors").unlink()
    assert_convert_refused(src, tmp_path, "model.safetensors.index.json", "model-00002-of-00003.safetensors", "does not exist")


def test_index_not_json(tmp_path):
    src = copy_fixture("mixtral_sharded", tmp_path)
    (src / "model.safetensors.index.json").write_text('{"weight_map": ')
    assert_convert_refused(src, tmp_path, "model.safetensors.index.json", "not a valid safetensors index")


# Non-finite weights are refused naming the SOURCE tensor and the index in it (not the packer's
# per-expert [0, r, c]): per-expert gate/up/down, Mixtral w3 (second half of w13), fused
# out-major (Granite), fused in-major (Llama-4: [E, H, 2I]), gpt-oss biases, a shared expert.
# fmt: off
NON_FINITE = {
    "per-expert down (nan)": ("qwen3_moe", f"{Q3}.experts.3.down_proj.weight", (5, 7), float("nan"), "[5, 7]"),
    "per-expert gate (inf)": ("qwen3_moe", "model.layers.0.mlp.experts.6.gate_proj.weight", (39, 71), float("inf"), "[39, 71]"),
    "mixtral w3 (up half)": ("mixtral_sharded", "model.layers.1.block_sparse_moe.experts.1.w3.weight", (3, 4), float("-inf"), "[3, 4]"),
    "olmoe f16 up": ("olmoe", "model.layers.1.mlp.experts.7.up_proj.weight", (0, 0), float("nan"), "[0, 0]"),
    "granite fused out-major": ("granitemoe", "model.layers.1.block_sparse_moe.input_linear.weight", (2, 70, 9), float("nan"), "[2, 70, 9]"),
    "llama4 fused in-major": ("llama4_text", "model.layers.1.feed_forward.experts.gate_up_proj", (3, 11, 77), float("nan"), "[3, 11, 77]"),
    "llama4 fused down": ("llama4_text", "model.layers.1.feed_forward.experts.down_proj", (1, 39, 70), float("inf"), "[1, 39, 70]"),
    "gpt-oss gate_up bias": ("gpt_oss", "model.layers.0.mlp.experts.gate_up_proj_bias", (2, 33), float("nan"), "[2, 33]"),
    "qwen2 shared expert": ("qwen2_moe", "model.layers.0.mlp.shared_expert.down_proj.weight", (4, 50), float("nan"), "[4, 50]"),
}
# fmt: on


@pytest.mark.parametrize("case", list(NON_FINITE))
def test_non_finite_weight_names_the_source_tensor(tmp_path, case):
    name, tensor, idx, value, where = NON_FINITE[case]
    src = copy_fixture(name, tmp_path)

    def poison(w):
        w[idx] = value
        return w

    edit_tensor(src, tensor, poison)
    assert_convert_refused(src, tmp_path, repr(tensor), f"at {where}", "non-finite", "must be finite")


# ---------------------------------------------------------------------------------------------
# convert: the destination


def test_destination_exists(tmp_path):
    src = fixture_dir("qwen3_moe")
    dst = tmp_path / "packed"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(MoepackError, match=r"already exists.*overwrite"):
        moepack.convert(src, dst)
    assert_one_error_line(cli("convert", src, dst), str(dst), "already exists", "--overwrite")
    assert [p.name for p in dst.iterdir()] == ["keep.txt"] and temp_siblings(dst) == []
    # a plain file is not replaced either
    f = tmp_path / "file"
    f.write_text("x")
    assert_one_error_line(cli("convert", src, f), "already exists")
    assert f.read_text() == "x"

    # with overwrite it is replaced, atomically: the old contents are gone, nothing is left over
    moepack.convert(src, dst, overwrite=True)
    assert not (dst / "keep.txt").exists() and (dst / MANIFEST).is_file()
    assert moepack.verify(dst).ok and temp_siblings(dst) == []
    old = moepack.open(dst)
    before = old.tensor("moepack.layers.0.w13").clone()
    r = cli("convert", fixture_dir("mixtral"), dst, "--overwrite")
    assert r.exit_code == 0, r.stderr
    assert json.loads((dst / MANIFEST).read_text())["model"]["model_type"] == "mixtral" and temp_siblings(dst) == []
    # a model opened before the replacement keeps valid mappings of the old files
    assert torch.equal(old.tensor("moepack.layers.0.w13"), before)


def test_destination_is_the_source(tmp_path):
    src = copy_fixture("qwen3_moe", tmp_path)
    with pytest.raises(MoepackError, match="is the source"):
        moepack.convert(src, src, overwrite=True)
    assert (src / "model.safetensors").is_file()


def test_destination_parent_missing(tmp_path):
    dst = tmp_path / "no" / "such" / "dir"
    assert_one_error_line(cli("convert", fixture_dir("qwen3_moe"), dst), "parent directory", "does not exist")
    assert not (tmp_path / "no").exists()


# ---------------------------------------------------------------------------------------------
# convert: interrupted


def _failing_reader(monkeypatch, *, expert=None, other=None):
    """Make convert's source fail: ``expert(spec)`` / ``other(name)`` return an exception to raise
    (or None) when an expert / a carried-over tensor is read."""
    real_open = convert_plan.open_source
    seen = []

    def open_source(path):
        ckpt, reader = real_open(path)

        def read_expert_w13(c, spec, e):
            seen.append(spec.index)
            exc = expert(spec) if expert else None
            if exc is not None:
                raise exc
            return reader.read_expert_w13(c, spec, e)

        if other is not None:
            real_read = ckpt.read

            def read(name, out=None):
                exc = other(name)
                if exc is not None:
                    raise exc
                return real_read(name, out)

            ckpt.read = read
        return ckpt, dataclasses.replace(reader, read_expert_w13=read_expert_w13)

    monkeypatch.setattr(convert_plan, "open_source", open_source)  # where make_plan looks it up
    return seen


def test_interrupted_after_the_first_layer(tmp_path, monkeypatch):
    seen = _failing_reader(monkeypatch, expert=lambda spec: KeyboardInterrupt() if spec.index >= 1 else None)
    dst = tmp_path / "packed"
    with pytest.raises(KeyboardInterrupt):
        moepack.convert(fixture_dir("qwen3_moe"), dst)
    assert 0 in seen and 1 in seen, "the first layer should have been written before the interrupt"
    assert_nothing_written(dst)


def test_failure_while_copying_other_tensors(tmp_path, monkeypatch):
    _failing_reader(monkeypatch, other=lambda name: OSError(28, "No space left on device") if "norm" in name else None)
    dst = tmp_path / "packed"
    with pytest.raises(OSError, match="No space left"):
        moepack.convert(fixture_dir("mixtral_sharded"), dst)
    assert_nothing_written(dst)
    # the CLI reports it as one line, exit 2
    assert_one_error_line(cli("convert", fixture_dir("mixtral_sharded"), dst), "No space left on device")
    assert_nothing_written(dst)


def test_interrupt_leaves_an_existing_destination_alone(tmp_path, monkeypatch):
    dst = tmp_path / "packed"
    moepack.convert(fixture_dir("qwen3_moe"), dst)
    manifest = (dst / MANIFEST).read_bytes()
    _failing_reader(monkeypatch, expert=lambda spec: KeyboardInterrupt() if spec.index >= 1 else None)
    with pytest.raises(KeyboardInterrupt):
        moepack.convert(fixture_dir("mixtral"), dst, overwrite=True)
    assert (dst / MANIFEST).read_bytes() == manifest and temp_siblings(dst) == []
    assert moepack.verify(dst).ok


# ---------------------------------------------------------------------------------------------
# packed directories


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """qwen3_moe converted once; tests work on copies (``damaged``)."""
    dst = tmp_path_factory.mktemp("good") / "packed"
    moepack.convert(fixture_dir("qwen3_moe"), dst)
    return dst


@pytest.fixture
def damaged(good, tmp_path) -> Path:
    d = tmp_path / "packed"
    shutil.copytree(good, d)
    return d


EXPERTS = "experts-00001-of-00001.safetensors"
OTHER = "model-00001-of-00001.safetensors"


def edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / MANIFEST).read_text())
    fn(m)
    (d / MANIFEST).write_text(json.dumps(reseal(m), indent=1))


def assert_open_refused(d: Path, *needles: str) -> None:
    with pytest.raises(PackedDirError) as ei:
        moepack.open(d)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert_one_error_line(cli("inspect", d), *needles)
    assert_one_error_line(cli("verify", d), *needles)


def test_the_good_directory_is_good(good):
    assert moepack.verify(good).ok
    assert cli("inspect", good).exit_code == 0


def test_manifest_missing(damaged):
    (damaged / MANIFEST).unlink()
    assert_open_refused(damaged, str(damaged), "no moepack.json", "not a packed directory")


def test_manifest_bad_json(damaged):
    (damaged / MANIFEST).write_text('{"format": "moepack", "format_version": 1,')
    assert_open_refused(damaged, "moepack.json is not valid JSON")


def test_manifest_wrong_format(damaged):
    edit_manifest(damaged, lambda m: m.update(format="gguf"))
    assert_open_refused(damaged, "format='gguf'", "expected 'moepack'")


def test_manifest_wrong_format_version(damaged):
    edit_manifest(damaged, lambda m: m.update(format_version=8))
    assert_open_refused(damaged, "format_version=8", "this moepack reads versions 1, 2, 3, 4, 5, 6, 7", "moepack convert SRC DST --overwrite")


def test_manifest_layout_descriptor_differs_from_this_build(damaged):
    def edit(m):
        ((_, desc),) = m["layouts"].items()
        desc["k_pack"] = 4

    edit_manifest(damaged, edit)
    assert_open_refused(damaged, "bf16_n32k2_x86", "k_pack=4", "this build has k_pack=2")


def test_manifest_unknown_layout(damaged):
    def edit(m):
        m["layouts"]["99"] = m["layouts"].pop(next(iter(m["layouts"])))

    edit_manifest(damaged, edit)
    assert_open_refused(damaged, "layout id 99 is unknown")


def test_manifest_expert_shape_differs_from_layout_math(damaged):
    edit_manifest(damaged, lambda m: m["tensors"]["moepack.layers.1.w2"].update(shape=[8, 64, 72]))
    assert_open_refused(damaged, "layer 1", "'moepack.layers.1.w2'", "[8, 64, 72]", "layout math says")


def test_manifest_tensor_shape_differs_from_the_file(damaged):
    edit_manifest(damaged, lambda m: m["tensors"]["model.embed_tokens.weight"].update(shape=[72, 128]))
    assert_open_refused(damaged, "'model.embed_tokens.weight'", OTHER, "bfloat16 [128, 72]", "moepack.json says bfloat16 [72, 128]")


def test_manifest_tensor_dtype_differs_from_the_file(damaged):
    edit_manifest(damaged, lambda m: m["tensors"]["model.norm.weight"].update(dtype="float32"))
    assert_open_refused(damaged, "'model.norm.weight'", "moepack.json says float32")


def test_manifest_layer_entry_malformed(damaged):
    edit_manifest(damaged, lambda m: m["layers"][0].pop("hidden"))
    assert_open_refused(damaged, "moepack.json: layers[0].hidden is missing (layer 0)", "must be an integer")


def test_manifest_tensor_in_an_unlisted_file(damaged):
    edit_manifest(damaged, lambda m: m["tensors"]["model.norm.weight"].update(file="model-00002.safetensors"))
    assert_open_refused(damaged, "'model.norm.weight'", "model-00002.safetensors", "not listed in 'files'")


def test_manifest_tensor_missing_from_its_shard(damaged):
    edit_manifest(damaged, lambda m: m["tensors"].update({"lm_head.weight": {"file": OTHER, "dtype": "bfloat16", "shape": [128, 72], "sha256": "0" * 64}}))
    assert_open_refused(damaged, "'lm_head.weight'", f"is not in {OTHER}")


def test_shard_size_mismatch(damaged):
    f = damaged / EXPERTS
    size = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(b"\0" * 64)
    assert_open_refused(damaged, EXPERTS, f"has {size + 64} bytes", f"moepack.json says {size}")
    f.write_bytes(f.read_bytes()[: size - 4096])  # truncated
    assert_open_refused(damaged, EXPERTS, f"has {size - 4096} bytes", f"moepack.json says {size}")


def test_shard_missing(damaged):
    (damaged / EXPERTS).unlink()
    assert_open_refused(damaged, f"shard {EXPERTS} listed in moepack.json is missing")


def test_shard_with_overlapping_tensors(damaged):
    def overlap(h):
        a, b = h["moepack.layers.0.w13"]["data_offsets"], h["moepack.layers.0.w2"]["data_offsets"]
        n = b[1] - b[0]
        h["moepack.layers.0.w2"]["data_offsets"] = [a[0] + 64, a[0] + 64 + n]

    patch_header(damaged / EXPERTS, overlap)
    assert_open_refused(damaged, EXPERTS, "'moepack.layers.0.w2'", "overlaps tensor 'moepack.layers.0.w13'")


def test_shard_with_an_unaligned_tensor(damaged):
    """Our writer's shard, its header patched: the filler after a 144-byte norm weight moves in
    front of it, so the norm weight starts 48 bytes past an aligned offset (still tiling the file)."""
    name = "model.layers.0.input_layernorm.weight"

    def unalign(h):
        fillers = sorted((k for k in h if k.startswith("__pad__.")), key=lambda k: h[k]["data_offsets"][0])
        t = h[name]["data_offsets"]
        pad = next(k for k in fillers if h[k]["data_offsets"][0] == t[1])
        gap = h[pad]["data_offsets"][1] - h[pad]["data_offsets"][0]
        h[pad]["data_offsets"] = [t[0], t[0] + gap]
        h[name]["data_offsets"] = [t[0] + gap, t[1] + gap]

    patch_header(damaged / OTHER, unalign)
    assert_open_refused(damaged, OTHER, repr(name), "not a multiple of the required alignment 64")


def test_shard_header_garbage(damaged):
    f = damaged / EXPERTS
    b = bytearray(f.read_bytes())
    b[8:20] = b"[garbage!!!]"
    f.write_bytes(bytes(b))
    assert_open_refused(damaged, EXPERTS, "MUST begin with '{'")


@pytest.mark.parametrize("tensor", ["moepack.layers.1.w13", "model.layers.0.mlp.gate.weight"])
def test_flipped_data_byte_is_caught_by_verify(damaged, tensor):
    m = json.loads((damaged / MANIFEST).read_text())
    fname = m["tensors"][tensor]["file"]
    from moepack.container import read_safetensors_header

    info = read_safetensors_header(damaged / fname).tensors[tensor]
    f = damaged / fname
    b = bytearray(f.read_bytes())
    b[info.file_offset + info.nbytes // 2] ^= 0x10
    f.write_bytes(bytes(b))

    model = moepack.open(damaged)  # structure is intact: open does not hash
    assert sorted(model.layers) == [0, 1]
    report = moepack.verify(damaged)
    assert not report.ok
    bad = [t for t in report.tensors if not t.ok]
    assert [t.name for t in bad] == [tensor] and bad[0].file == fname
    assert report.failures() == [f"tensor {tensor!r} in {fname}: {bad[0].detail}"] and "sha256" in bad[0].detail

    r = cli("verify", damaged)
    assert r.exit_code == 1, (r.stdout, r.stderr)
    assert f"MISMATCH {tensor} ({fname})" in r.stdout
    r = cli("verify", damaged, "--json")
    assert r.exit_code == 1
    out = json.loads(r.stdout)
    assert out["ok"] is False and len(out["failures"]) == 1 and tensor in out["failures"][0]
    assert cli("inspect", damaged).exit_code == 0
