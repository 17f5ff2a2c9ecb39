"""``moepack.open``: a packed directory as a validated, memory-mapped ``PackedModel``.

* the model: ``.layers`` (index -> PackedMoELayer), ``.manifest``, ``.tensor(name)`` as zero-copy
  views of the shard mappings (MAP_PRIVATE: writing a view never reaches the file);
* opening costs memory only as experts are used: a ~190 MB synthetic packed directory opens in a
  fresh process with an RSS growth under 5% of its size (tools/bench_packdir.py measures the
  multi-GB case);
* the directory is self-contained (the source can go away), and a manifest without a routing
  config still runs ``.experts`` while ``.forward`` says why it cannot route.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import moepack
from moepack.convert.run import MANIFEST
from moepack.errors import PackedDirError, UnsupportedError
from moepack.isa import ISAS
from moepack.runtime.model import PackedModel, PackedMoELayer
from tests.support.fixtures_util import fixture_dir
from tests.support.synthetic import SYNTH, mib
from tests.support import skips
from tests.support.packdir_edit import reseal

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    """gpt_oss: 2 MoE layers, biases, interleaved swigluoai, router bias."""
    dst = tmp_path_factory.mktemp("open") / "gpt_oss"
    moepack.convert(fixture_dir("gpt_oss"), dst)
    return dst


def routed(layer: PackedMoELayer, t: int = 5, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, layer.hidden_size, generator=g).to(dtype)
    logits = torch.randn(t, layer.num_experts, generator=g)
    return x, logits


def test_open_gives_the_model(gpt_oss):
    model = moepack.open(gpt_oss)
    assert isinstance(model, PackedModel) and model.path == gpt_oss
    assert sorted(model.layers) == [0, 1] and "gpt_oss" in repr(model)
    assert model.manifest == json.loads((gpt_oss / MANIFEST).read_text())
    assert model.config["model_type"] == "gpt_oss"
    for idx, layer in model.layers.items():
        assert isinstance(layer, PackedMoELayer) and isinstance(layer, torch.nn.Module)
        assert layer.index == idx and layer.prefix == f"model.layers.{idx}.mlp"
        assert (layer.num_experts, layer.hidden_size, layer.intermediate_size) == (4, 72, 40)
        assert layer.activation == "swigluoai" and layer.packed.interleaved
        assert layer.packed.w13_bias is not None and layer.packed.w2_bias is not None
        isa, reason = layer.kernel
        assert isa in ISAS and isinstance(reason, str) and reason
        assert "experts=4" in repr(layer) and "swigluoai" in repr(layer)
        x, logits = routed(layer)
        w, ids = layer.route(logits)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == ids.shape == (5, 2)
        out = layer(x, logits)
        assert out.shape == x.shape and out.dtype == x.dtype and torch.isfinite(out).all()
        out16 = layer(x.bfloat16(), logits)
        assert out16.dtype == torch.bfloat16
    assert moepack.open(gpt_oss, strict=True).layers[0].kernel == model.layers[0].kernel


def test_a_layer_the_pack_lacks_is_named(gpt_oss):
    """``layers[i]`` for an index without an MoE layer: one line naming the pack and its layers (a
    KeyError still, so ``in`` / ``.get`` / ``except KeyError`` keep working), not a bare ``KeyError: 99``."""
    from moepack.errors import MoepackError

    layers = moepack.open(gpt_oss).layers
    assert 99 not in layers and layers.get(99) is None
    for idx in (99, -1, "0"):
        with pytest.raises(KeyError) as e:
            layers[idx]
        assert isinstance(e.value, MoepackError)
        assert str(e.value) == (f"{gpt_oss}: no MoE layer at index {idx!r} (the pack's MoE layers: 0, 1; dense layers and "
                                "layers outside the model are not in .layers)")  # fmt: skip


def test_tensors_are_zero_copy_views_of_the_shards(gpt_oss):
    model = moepack.open(gpt_oss)
    m = model.manifest
    for name, entry in m["tensors"].items():
        t = model.tensor(name)
        assert list(t.shape) == entry["shape"] and str(t.dtype) == f"torch.{entry['dtype']}"
        # a view into the whole file's mapping, not a copy
        assert t.untyped_storage().nbytes() == m["files"][entry["file"]]["size"], name
        assert model.tensor(name).data_ptr() == t.data_ptr()
        assert t.data_ptr() % 64 == 0, f"{name} is not 64-byte aligned in memory"
    w13 = model.layers[0].packed.w13
    assert w13.data_ptr() == model.tensor("moepack.layers.0.w13").data_ptr()
    with pytest.raises(PackedDirError, match=r"no tensor named 'nope'"):
        model.tensor("nope")


def test_writing_a_view_never_reaches_the_file(gpt_oss, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(gpt_oss, d)
    before = {f.name: f.read_bytes() for f in d.iterdir()}
    model = moepack.open(d)
    t = model.tensor("model.norm.weight")
    t.fill_(3.0)  # copy-on-write page
    assert (model.tensor("model.norm.weight") == 3.0).all()
    assert {f.name: f.read_bytes() for f in d.iterdir()} == before
    assert moepack.verify(d).ok
    assert (moepack.open(d).tensor("model.norm.weight") != 3.0).any()


def test_packed_directory_is_self_contained(tmp_path):
    """The packed directory needs nothing from the source checkpoint once converted."""
    src = tmp_path / "src"
    shutil.copytree(fixture_dir("qwen2_moe"), src)  # shared expert with a sigmoid gate
    dst = tmp_path / "packed"
    moepack.convert(src, dst)
    layer = moepack.open(dst).layers[1]
    x, logits = routed(layer, t=4)
    want = layer(x, logits)
    shutil.rmtree(src)
    model = moepack.open(dst)
    assert torch.equal(model.layers[1](x, logits), want)
    assert torch.equal(model.layers[1](x), model.layers[1](x, model.layers[1].router_logits(x)))


def test_manifest_without_routing_still_runs_experts(gpt_oss, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(gpt_oss, d)
    m = json.loads((d / MANIFEST).read_text())
    m["routing"], m["routing_note"] = None, "this family's routing is not supported"
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    layer = moepack.open(d).layers[1]
    ref = moepack.open(gpt_oss).layers[1]
    x, logits = routed(layer)
    w, ids = ref.route(logits)
    assert torch.equal(layer.experts(x, w, ids), ref.experts(x, w, ids))
    with pytest.raises(UnsupportedError, match=r"no routing config \(this family's routing is not supported\).*\.experts\("):
        layer(x, logits)
    with pytest.raises(UnsupportedError, match=r"router_logits has shape \[5, 3\]: must be \[tokens, E=4\]"):
        ref(x, logits[:, :3])


def test_not_a_packed_directory(tmp_path):
    with pytest.raises(PackedDirError, match="no moepack.json"):
        moepack.open(fixture_dir("qwen3_moe"))
    with pytest.raises(PackedDirError, match="no moepack.json"):
        moepack.open(tmp_path / "missing")


# ---------------------------------------------------------------------------------------------
# memory: opening maps, it does not read

CHILD_OPEN = textwrap.dedent(
    r"""
    import json, os, sys
    import torch

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    torch.set_num_threads(2)  # per-thread stacks and arenas of a many-core CI box are not the model
    import moepack
    moepack.load_extension()
    r0 = rss()
    model = moepack.open(sys.argv[1])
    r1 = rss()
    layer = model.layers[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, layer.hidden_size, generator=g)
    w, ids = torch.softmax(torch.randn(1, layer.num_experts, generator=g), -1).topk(2)
    layer.experts(x, w.contiguous(), ids.to(torch.int32).contiguous())
    r2 = rss()
    print(json.dumps({"before": r0, "after_open": r1, "after_call": r2, "layers": len(model.layers)}))
    """
)


@pytest.mark.parametrize("huge", ["0", "1"])
def test_open_maps_instead_of_reading(synthetic_packed, huge):
    """Fresh process, /proc/self/statm RSS: opening a ~190 MB packed directory grows RSS by
    less than 5% of its size (lazy imports included); one T=1 top-2 call touches two experts of
    one layer, not the layer. The arms differ in the maps' huge-page advice only: with it (the
    default) pages read in come as 2 MiB folios, each mapped whole when touched (an expert here
    is 2.25 MiB), so the bound there is the layer; without it (MOEPACK_HUGE_PAGES=0) half the
    layer, the bound this test had before the advice (large folios a write left in the page cache
    are mapped whole either way)."""
    dst = synthetic_packed
    m = json.loads((dst / MANIFEST).read_text())
    size = sum(f["size"] for f in m["files"].values())
    assert size > 150 << 20
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), MOEPACK_HUGE_PAGES=huge)
    proc = subprocess.run([sys.executable, "-c", CHILD_OPEN, str(dst)], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["layers"] == SYNTH["layers"]
    grow_open = r["after_open"] - r["before"]
    grow_call = r["after_call"] - r["before"]
    e, h, i = SYNTH["experts"], SYNTH["hidden"], SYNTH["intermediate"]
    layer_bytes = 3 * e * h * i * 2
    msg = f"packed {mib(size)}: RSS +{mib(grow_open)} after open, +{mib(grow_call)} after one T=1 call (one layer is {mib(layer_bytes)})"
    assert grow_open < 0.05 * size, msg
    assert grow_call < (layer_bytes / 2 if huge == "0" else layer_bytes), msg
    print(msg)


def _madvise_hugepage_works() -> bool:
    """Whether this kernel takes MADV_HUGEPAGE on an anonymous map (THP built in, not refused)."""
    import ctypes
    import mmap

    from moepack.container.pages import MADV_HUGEPAGE, madvise

    m = mmap.mmap(-1, 4 << 20)
    try:
        buf = ctypes.c_char.from_buffer(m)
        ok = madvise(ctypes.addressof(buf), len(m), MADV_HUGEPAGE) == 0
        del buf
        return ok
    finally:
        m.close()


@skips.host_lacks_mark(not os.path.exists("/proc/self/smaps") or not _madvise_hugepage_works(),
                       "/proc/self/smaps and a kernel that takes MADV_HUGEPAGE")
def test_open_advises_its_maps_for_huge_pages(synthetic_packed, monkeypatch):
    """moepack.open advises every shard's map MADV_HUGEPAGE (smaps VmFlags "hg") unless
    MOEPACK_HUGE_PAGES=0; the experts' output is the same either way."""

    def vm_flags(addr: int) -> list[str]:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
        for k, line in enumerate(lines):
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if lo <= addr < hi:
                    return next(ln for ln in lines[k + 1 :] if ln.startswith("VmFlags:")).split()[1:]
        raise AssertionError(f"no map holds {addr:#x} in /proc/self/smaps")

    outs = {}
    for huge in ("0", "1"):
        monkeypatch.setenv("MOEPACK_HUGE_PAGES", huge)
        model = moepack.open(synthetic_packed)
        layer = model.layers[min(model.layers)]
        flags = vm_flags(layer.packed.tensors["w13"].data_ptr())
        assert ("hg" in flags) == (huge == "1"), (huge, flags)
        x = torch.randn(3, layer.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        outs[huge] = layer.experts(x, torch.full((3, 2), 0.5), torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32))
        del model, layer
    assert torch.equal(outs["0"], outs["1"])
