"""Tensor-parallel packs (moepack/tp.py, ``convert --tp N``), without vLLM.

* every layout kind (bf16, int8 with its column sums, int4 per group and per channel, fp8,
  mxfp4, an ARM layout): rank r's slice, read back through ``unpack_codes`` (not the byte-run
  arithmetic the slicer uses), is exactly the slice of the whole pack's codes, and each scale,
  zero point, column sum and bias is the one its rows / K groups have in the whole pack, so the
  slice's dequantized weights are the slice of the whole pack's;
* ``tp_unslice(tp_slice(p))`` gives back the whole pack's bytes;
* running every slice (``run_experts`` on the sliced pack, and the sum of the ranks' partial
  outputs) gives the whole pack's output;
* ``convert --tp 2`` on a tiny seeded Qwen3-MoE: format version 4, rank r's bytes contiguous and
  mapped (no copy), ``load_model`` greedy tokens equal to the whole pack's, ``verify --source``
  passes; the refusals (I/N off the block or group size, a hand-edited tp) name value and rule.
"""

from __future__ import annotations

import json

import pytest
import torch

import moepack
from moepack.errors import ConvertError, LayoutError, PackedDirError
from moepack.layout import layout_get
from moepack.manifest import FORMAT_VERSION, MANIFEST
from moepack.pack import pack_experts, unpack_codes
from moepack.runtime.experts import run_experts
from moepack.tp import expand_routes, rank_experts, tp_slice, tp_slice_size, tp_unslice
from tests.support.packdir_edit import reseal

# (layout, I): I/2 a multiple of the layout's i_align and group size
CASES = [("bf16_n32k2_x86", 64), ("i8_n32k4_x86", 64), ("u4g32_n32k8_x86", 64), ("u4ch_n32k8_x86", 64),
         ("f8g128_n32k2_x86", 256), ("mx4g32_n32k8_x86", 64), ("nv4g16_n32k8_x86", 64), ("nv4g16_n16k8_arm", 64),
         ("bf16_n16k4_arm", 64)]  # fmt: skip
E, H = 3, 40  # H off every block size: w2's padded output rows stay whole


def _whole(name: str, i: int, tp: int = 2, *, interleaved: bool = False, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * i, H, generator=g) * 0.2
    w2 = torch.randn(E, H, i, generator=g) * 0.2
    b13 = torch.randn(E, 2 * i, generator=g) * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if bias else None
    return pack_experts(w13, w2, b13, b2, interleaved=interleaved, layout=name)


def _rows(t: torch.Tensor, dim: int, ip: int, s: int, r: int, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return t.narrow(dim, 2 * r * s, 2 * s)
    return torch.cat([t.narrow(dim, r * s, s), t.narrow(dim, ip + r * s, s)], dim)


@pytest.mark.parametrize("name,i", CASES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_each_rank_is_the_slice_of_the_whole_pack(name, i, interleaved):
    lay = layout_get(name)
    whole = _whole(name, i, interleaved=interleaved)
    tp = 2
    s = i // tp
    sliced = tp_slice(whole, tp)
    assert sliced.tp == tp and sliced.padded_intermediate == s
    w13 = unpack_codes(lay, whole.tensors["w13"])  # [E, 2I, Kp]
    w2 = unpack_codes(lay, whole.tensors["w2"])  # [E, Np, I]
    for r in range(tp):
        part = rank_experts(sliced, r)
        assert part.num_experts == E and part.intermediate == s
        assert torch.equal(unpack_codes(lay, part.tensors["w13"]), _rows(w13, 1, i, s, r, interleaved))
        got2 = unpack_codes(lay, part.tensors["w2"])
        assert torch.equal(got2, w2[:, :, r * s:(r + 1) * s])
        for spec in lay.tensors:
            if spec.role == "codes":
                continue
            t13, t2 = whole.tensors["w13" + spec.suffix], whole.tensors["w2" + spec.suffix]
            p13, p2 = part.tensors["w13" + spec.suffix], part.tensors["w2" + spec.suffix]
            assert torch.equal(p13, _rows(t13, 2 if spec.shape == "group" else 1, i, s, r, interleaved)), spec
            if spec.role == "sum":  # int8: the sums of the slice's own codes
                assert torch.equal(p2, got2.to(torch.int32).sum(-1, dtype=torch.int32))
            elif spec.shape == "group":
                g = s // lay.group_size
                assert torch.equal(p2, t2[:, r * g:(r + 1) * g]), spec
            else:
                assert torch.equal(p2, t2), spec
        assert torch.equal(part.tensors["w13_bias"], _rows(whole.tensors["w13_bias"], 1, i, s, r, interleaved))
        want_b2 = whole.tensors["w2_bias"] if r == 0 else torch.zeros_like(whole.tensors["w2_bias"])
        assert torch.equal(part.tensors["w2_bias"], want_b2)  # added once, by rank 0


@pytest.mark.parametrize("name,i", CASES)
def test_unslice_gives_back_the_whole_bytes(name, i):
    whole = _whole(name, i, interleaved=name.startswith("mx4"))
    back = tp_unslice(tp_slice(whole, 2))
    assert set(back.tensors) == set(whole.tensors)
    for k, v in whole.tensors.items():
        assert torch.equal(back.tensors[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k


@pytest.mark.parametrize("name,i", [c for c in CASES if not c[0].endswith("_arm")])
@pytest.mark.parametrize("act", ["silu", "swigluoai"])
def test_running_every_slice_equals_the_whole_pack(name, i, act):
    interleaved = act == "swigluoai"
    whole = _whole(name, i, interleaved=interleaved, seed=1)
    sliced = tp_slice(whole, 2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(7)]).to(torch.int32)
    w = torch.rand(7, 2, generator=g)
    kw = dict(activation=act)
    ref = run_experts(whole, x, w, ids, **kw).float()
    got = run_experts(sliced, x, w, ids, **kw).float()
    parts = sum(run_experts(rank_experts(sliced, r), x, w, ids, **kw).float() for r in range(2))
    # a8 layouts quantize the activation per token and slice (as each vLLM rank does): not bitwise
    tol = 0.05 if "a8" == whole.layout.act_modes[0] else 0.02
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= tol * scale
    assert (parts - ref).abs().max().item() <= tol * scale


def test_expand_routes_and_expert_map():
    w = torch.tensor([[0.7, 0.3]])
    ids = torch.tensor([[2, 0]], dtype=torch.int32)
    # a pack of 4 experts run whole: ids are pack experts
    w2, ids2, m = expand_routes(w, ids, 4, 2)
    assert ids2.tolist() == [[2, 0, 6, 4]] and torch.equal(w2, torch.tensor([[0.7, 0.3, 0.7, 0.3]])) and ids2.dtype == torch.int32
    assert m is None
    # a pack of 2 experts (global ids 2, 3 of 5): ids offset by the global count, the map by the pack's
    w2, ids2, m = expand_routes(w, ids, 2, 2, torch.tensor([-1, -1, 0, 1, -1], dtype=torch.int32))
    assert ids2.tolist() == [[2, 0, 7, 5]]
    assert m.tolist() == [-1, -1, 0, 1, -1, -1, -1, 2, 3, -1]


@pytest.mark.parametrize("name,i", [("bf16_n32k2_x86", 64), ("u4g32_n32k8_x86", 64)])
@pytest.mark.parametrize("emap", [[-1, 0, 1, 2], [2, -1, 0, -1, 1], [-1, -1, 1, -1]])
def test_an_expert_map_runs_the_slices_like_the_whole_pack(name, i, emap):
    """A global expert map (more global experts than the pack holds, or covering part of it) on a
    --tp pack run whole: the same layer as the whole pack under the same map."""
    whole = _whole(name, i, seed=3)
    sliced = tp_slice(whole, 2)
    m = torch.tensor(emap, dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(len(emap), generator=g)[:2] for _ in range(6)]).to(torch.int32)
    w = torch.rand(6, 2, generator=g)
    ref = run_experts(whole, x, w, ids, expert_map=m).float()
    got = run_experts(sliced, x, w, ids, expert_map=m).float()
    assert ref.abs().max().item() > 0
    assert (got - ref).abs().max().item() <= 0.02 * ref.abs().max().item()


@pytest.mark.parametrize("name,i,tp,msg", [
    ("bf16_n32k2_x86", 64, 4, r"tp=4: I/tp = 64/4 = 16 is not a multiple of 32, layout bf16_n32k2_x86's i_align"),
    ("u4g128_n32k8_x86", 256, 4, r"tp=4: I/tp = 64 is not a multiple of layout u4g128_n32k8_x86's group size 128"),
    ("bf16_n32k2_x86", 96, 2, r"intermediate size I=96 is not divisible|I/tp = 96/2 = 48 is not a multiple of 32"),
    ("bf16_n32k2_x86", 64, 0, r"tp=0: the tensor-parallel degree must be an integer >= 1"),
])  # fmt: skip
def test_slice_sizes_off_the_blocks_are_refused(name, i, tp, msg):
    with pytest.raises(LayoutError, match=msg):
        tp_slice_size(layout_get(name), i, tp)


# ---- convert --tp, on a tiny seeded checkpoint ------------------------------------------------


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=40, intermediate_size=64, moe_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, norm_topk_prob=True,
                                      decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                                      initializer_range=0.2, dtype="bfloat16")  # fmt: skip
    d = tmp_path_factory.mktemp("tp") / "src"
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


def _greedy(d) -> list[int]:
    m = moepack.load_model(d)
    out = m.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    return out[0, 4:].tolist()


@pytest.mark.parametrize("quantize", [None, "int4:g32", "nvfp4"])
def test_convert_tp2(src, tmp_path, quantize):
    whole, tp2 = tmp_path / "whole", tmp_path / "tp2"
    moepack.convert(src, whole, quantize=quantize)
    moepack.convert(src, tp2, quantize=quantize, tp=2)
    m = json.loads((tp2 / MANIFEST).read_text())
    assert m["format_version"] == FORMAT_VERSION == 6 and m["tp"] == 2
    assert all(x["tp"] == 2 and x["padded_intermediate"] == 32 for x in m["layers"])
    assert not list(tmp_path.glob(".*")), "convert left a temporary directory"
    a, b = moepack.open(whole), moepack.open(tp2)
    for idx, la in a.layers.items():
        pb = b.layers[idx].packed
        assert pb.tp == 2 and pb.num_experts == 4 and pb.intermediate == 64
        back = tp_unslice(pb)
        for k, v in la.packed.tensors.items():
            assert torch.equal(back.tensors[k].view(torch.uint8), v.view(torch.uint8)), (idx, k)
        for r in range(2):  # rank r's rows: views of the mapping, one contiguous run of bytes each
            part = rank_experts(pb, r)
            for k, v in part.tensors.items():
                full = pb.tensors[k]
                assert v.is_contiguous() and v.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
                assert v.data_ptr() == full.data_ptr() + r * full[:4].numel() * full.element_size()
    assert _greedy(tp2) == _greedy(whole)
    rep = moepack.verify(tp2, source=src)
    assert rep.ok, rep


def test_convert_tp_refuses_a_slice_off_the_block(src, tmp_path, monkeypatch):
    import moepack.convert.run as cd

    def no_packing(*a, **k):  # the refusal comes from the plan, before any expert is packed
        raise AssertionError("convert packed the model before refusing --tp")

    monkeypatch.setattr(cd, "_convert", no_packing)
    with pytest.raises(ConvertError, match=r"^--tp 4: layer 0 \(model.layers.0.mlp\): tp=4: I/tp = 64/4 = 16 is not a "
                                           r"multiple of 32, layout bf16_n32k2_x86's i_align"):  # fmt: skip
        moepack.convert(src, tmp_path / "tp4", tp=4)
    assert not (tmp_path / "tp4").exists() and not list(tmp_path.glob(".*"))


def test_a_hand_edited_tp_is_refused(src, tmp_path):
    d = tmp_path / "tp2"
    moepack.convert(src, d, tp=2)
    m = json.loads((d / MANIFEST).read_text())
    m["layers"][1]["tp"] = 1
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    with pytest.raises(PackedDirError, match=r"layers\[1\]\.tp=1 \(layer 1\): must equal the top-level tp=2"):
        moepack.open(d)
    m["layers"][1]["tp"] = 2
    m["format_version"] = 3
    (d / MANIFEST).write_text(json.dumps(reseal(m)))
    with pytest.raises(PackedDirError, match=r"tp=2: needs format_version 4 \(the file says 3\)"):
        moepack.open(d)


# ---- convert --tp: interruption, resume of the reshard phase, a second writer -----------------

_TP_CHILD = """
import os, signal, sys, time
import moepack.tp as tp
from moepack.convert.run import convert
src, dst, event, how = sys.argv[1:5]
def stop():
    if how == "pause":
        print("paused", flush=True)
        for _ in range(600):  # short sleeps: a signal lands between them
            time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)
if event == "mid_reshard":  # killed after the first slice expert of the reshard is written
    parts = tp._slice_parts
    def killing(*a, **k):
        for i, x in enumerate(parts(*a, **k)):
            if i == 1:
                stop()
            yield x
    tp._slice_parts = killing
def progress(ev, **kw):
    if ev == event:
        stop()
convert(src, dst, tp=2, progress=progress)
"""


def _tp_child(src, dst, event: str, how: str = "kill"):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", _TP_CHILD, str(src), str(dst), event, how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)  # fmt: skip


def _tp_files(d) -> dict:
    import hashlib

    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir()) if f.name != MANIFEST}


def _tp_manifest(d) -> dict:
    m = json.loads((d / MANIFEST).read_text())
    m.pop("created_at")
    m.pop("manifest_sha256")  # the seal covers created_at; it is a function of the rest, compared here
    return m


def _tp_leftovers(d) -> list[str]:
    return sorted(p.name for p in d.parent.iterdir() if p.name.startswith(f".{d.name}."))


@pytest.fixture(scope="module")
def tp_reference(src, tmp_path_factory):
    d = tmp_path_factory.mktemp("tpref") / "tp2"
    moepack.convert(src, d, tp=2)
    return d


@pytest.mark.parametrize("event", ["tp_reshard", "mid_reshard"])
def test_a_kill_in_the_reshard_phase_reuses_the_whole_pack(src, tp_reference, tmp_path, event):
    """A hard kill after the whole pack is finished (before or in the middle of the reshard):
    the next run re-checks that pack and reslices it (no packing), byte-identical to an
    uninterrupted run, and leaves nothing behind."""
    dst = tmp_path / "tp2"
    p = _tp_child(src, dst, event)
    assert p.wait(120) == -9, p.stderr.read()
    assert not dst.exists() and f".{dst.name}.tp-whole" in _tp_leftovers(dst)
    events = []
    moepack.convert(src, dst, tp=2, progress=lambda ev, **kw: events.append(ev))
    assert "tp_whole_reused" in events and "layer_start" not in events, events
    assert _tp_files(dst) == _tp_files(tp_reference) and _tp_manifest(dst) == _tp_manifest(tp_reference)
    assert _tp_leftovers(dst) == []


def test_a_left_whole_pack_is_not_reused_when_stale(src, tmp_path):
    """The whole pack a killed run left is packed again when its bytes changed, when the plan
    differs (another quantizer), or with resume=False; each time the output is the new plan's.
    One run is killed; the other two destinations get copies of what it left (the whole pack's
    record names no destination: ``resume_key``)."""
    import shutil

    dst, dst2, dst3 = tmp_path / "tp2", tmp_path / "tp2b", tmp_path / "tp2c"
    p = _tp_child(src, dst, "tp_reshard")
    assert p.wait(120) == -9, p.stderr.read()
    whole = dst.parent / f".{dst.name}.tp-whole"
    for d in (dst2, dst3):
        shutil.copytree(whole, d.parent / f".{d.name}.tp-whole")
    shard = next(f for f in sorted(whole.iterdir()) if f.suffix == ".safetensors")
    b = bytearray(shard.read_bytes())
    b[-3] ^= 0xFF  # a flipped byte in the last tensor's data
    shard.write_bytes(bytes(b))
    events = []
    moepack.convert(src, dst, tp=2, progress=lambda ev, **kw: events.append((ev, kw)))
    reasons = [kw["reason"] for ev, kw in events if ev == "stale_removed"]
    assert reasons == ["its bytes no longer match its manifest"], events
    assert "layer_start" in [ev for ev, _ in events] and _tp_leftovers(dst) == []
    assert moepack.verify(dst).ok

    events = []
    moepack.convert(src, dst2, tp=2, quantize="int4:g32", progress=lambda ev, **kw: events.append((ev, kw)))
    assert [kw["reason"] for ev, kw in events if ev == "stale_removed"] == [
        "a different plan (source, layout, options or moepack version)"]
    assert json.loads((dst2 / MANIFEST).read_text())["layers"][0]["scheme"] == "int4_group"
    events = []
    moepack.convert(src, dst3, tp=2, resume=False, progress=lambda ev, **kw: events.append(ev))
    assert "tp_whole_reused" not in events and "layer_start" in events and _tp_leftovers(dst3) == []


def test_a_second_tp_writer_is_refused_and_an_interrupt_leaves_nothing(src, tmp_path):
    import signal

    dst = tmp_path / "tp2"
    p = _tp_child(src, dst, "layer_done", "pause")
    try:
        assert p.stdout.readline().strip() == "paused", p.stderr.read()
        before = _tp_leftovers(dst)
        with pytest.raises(ConvertError, match=rf"^{dst}: pid {p.pid} is writing it right now \(\.tp2\.tp-lock is locked\)"):
            moepack.convert(src, dst, tp=2)
        assert _tp_leftovers(dst) == before  # the live run's files untouched
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == -signal.SIGTERM
        assert not dst.exists() and _tp_leftovers(dst) == []
    finally:
        p.kill()
        p.wait()

    def stop(ev, **kw):
        if ev == "tp_reshard":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        moepack.convert(src, dst, tp=2, progress=stop)
    assert not dst.exists() and _tp_leftovers(dst) == []
