"""verify checks every rank's copy of the tensors a ``--tp N`` pack keeps once per rank
(moepack/tp.py ``rank_copy_kind``): w2's bias (rank 0's, zero on the others), an act-order
``w13_perm`` and w2's per-output-channel int8 scales (every rank the same copy). The runtime
reads every rank's copy (``expand_routes``, vLLM's ``rank_experts``); verify once rebuilt the
layer from rank 0's copy only, so an edit of rank 1's copy with its sha256 fixed passed both
``verify`` and ``verify --source`` while the layer's output moved (issue 49).

Each case edits one element of rank 1's copy (the manifest's sha256 updated: only a value rule
can tell), for tp 2 and 4, and both verify passes must fail naming the tensor, the rank and the
first differing element.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

import moepack
from moepack.layout import layout_get
from moepack.tp import rank_copy_kind, rank_copy_problem
from moepack.verify.run import verify
from tests.support.packdir_edit import rewrite_tensor

_spec = importlib.util.spec_from_file_location("int4_packers", Path(__file__).resolve().parents[2] / "tools" / "int4_packers.py")
P = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(P)

H, I, E = 72, 128, 3  # I/4 = 32: whole blocks and groups of every layout below


@pytest.fixture(scope="module")
def gptq_src(tmp_path_factory) -> Path:
    """A GPTQ act-order checkpoint with expert biases: w2_bias and w13_perm per rank."""
    d = tmp_path_factory.mktemp("tpr") / "gptq"
    P.write_moe_checkpoint(d, "gptq", h=H, i=I, e=E, group_size=32, sym=True, version="gptq", act_order=True, bias=True,
                           seed=3)  # fmt: skip
    return d


@pytest.fixture(scope="module")
def qwen_src(tmp_path_factory) -> Path:
    """A bf16 Qwen3-MoE checkpoint, packed with ``quantize="int8"``: w2's channel scales per rank."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=H, intermediate_size=64, moe_intermediate_size=I,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      num_experts=E, num_experts_per_tok=2, max_position_embeddings=32, norm_topk_prob=True,
                                      decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                                      initializer_range=0.2, dtype="bfloat16")  # fmt: skip
    d = tmp_path_factory.mktemp("tpr") / "qwen"
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


_PACKS: dict = {}


def _pack(src: Path, tmp_path_factory, tp: int, quantize) -> Path:
    key = (str(src), tp, quantize)
    if key not in _PACKS:
        d = tmp_path_factory.mktemp("tpr") / f"tp{tp}"
        moepack.convert(src, d, quantize=quantize, tp=tp)
        _PACKS[key] = d
    return _PACKS[key]


# (source fixture, quantize, role, element of rank 1's rows [expert, col], new value, words of the rule)
CASES = [
    ("gptq_src", None, "w2_bias", (1, 5), 0.75, "must be 0 (w2's bias is rank 0's only"),
    ("gptq_src", None, "w13_perm", (2, 7), None, "every rank keeps the same copy"),
    ("qwen_src", "int8", "w2_scale", (0, 3), None, "every rank keeps the same copy"),
]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("fixture,quantize,role,idx,value,words", CASES, ids=[c[2] for c in CASES])
def test_an_edit_of_rank_1s_copy_fails_both_verify_passes(request, tmp_path_factory, tmp_path, tp, fixture, quantize,
                                                          role, idx, value, words):  # fmt: skip
    src = request.getfixturevalue(fixture)
    whole = _pack(src, tmp_path_factory, tp, quantize)
    assert verify(whole).ok and verify(whole, source=src).ok
    d = tmp_path / "packed"
    shutil.copytree(whole, d)
    name = "moepack.layers.0." + role
    before = moepack.open(d).tensor(name)[E + idx[0], idx[1]].item()

    def edit(t):
        row = t[E + idx[0]]  # rank 1's copy of expert idx[0]
        if role == "w13_perm":  # still a permutation (the value rule holds): swap two entries
            row[idx[1]], row[idx[1] + 1] = row[idx[1] + 1].clone(), row[idx[1]].clone()
        elif role == "w2_scale":
            row[idx[1]] = row[idx[1]] * 1.25
        else:
            row[idx[1]] = value

    rewrite_tensor(d, name, edit)  # sha256 updated: the checksum alone cannot tell
    after = moepack.open(d).tensor(name)[E + idx[0], idx[1]].item()
    assert after != before
    what = "row" if role != "w13_perm" else "code column"
    line = f"tensor {name!r} rank 1 [expert {idx[0]}, {what} {idx[1]}] is {after!r}, "

    plain = verify(d)
    assert not plain.ok
    bad = [t for t in plain.tensors if not t.ok]
    assert [t.name for t in bad] == [name]
    assert line in bad[0].detail and words in bad[0].detail, bad[0].detail

    rep = verify(d, source=src)
    assert not rep.ok
    c = rep.layers[0]
    assert c.tensors[name] is False and not c.weights_exact
    assert line in c.detail and words in c.detail, c.detail


def test_the_output_moves_with_rank_1s_bias(gptq_src, tmp_path_factory, tmp_path):
    """Why it matters: the runtime adds rank 1's w2_bias (one process running every slice)."""
    whole = _pack(gptq_src, tmp_path_factory, 2, None)
    d = tmp_path / "packed"
    shutil.copytree(whole, d)
    name = "moepack.layers.0.w2_bias"
    rewrite_tensor(d, name, lambda t: t[E:].fill_(0.5))
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    w = torch.full((5, 1), 1.0)
    ids = torch.zeros(5, 1, dtype=torch.int32)
    a = moepack.open(whole).layers[0].packed
    b = moepack.open(d).layers[0].packed
    from moepack.runtime.experts import run_experts

    diff = (run_experts(b, x, w, ids) - run_experts(a, x, w, ids)).float()
    assert torch.allclose(diff[:, :H], torch.full((5, H), 0.5), atol=0.06)


def test_rank_copy_rules_per_layout():
    """Which tensors are per-rank copies, by layout role (one rule: slicing, unslicing and verify
    read it), and the problem line of a bare tensor."""
    i8, u4, bf = layout_get("i8_n32k4_x86"), layout_get("u4g32_n32k8_x86"), layout_get("bf16_n32k2_x86")
    assert rank_copy_kind(bf, "w2_bias") == "rank0" and rank_copy_kind(bf, "w13_bias") is None
    assert rank_copy_kind(u4, "w13_perm") == "every"
    assert rank_copy_kind(i8, "w2_scale") == "every" and rank_copy_kind(i8, "w13_scale") is None
    assert rank_copy_kind(i8, "w2_colsum") is None  # each rank's own sums (checked against its codes)
    assert rank_copy_kind(u4, "w2_scale") is None and rank_copy_kind(bf, "w2") is None  # w2's K groups are cut
    t = torch.zeros(2 * 3, 4)
    assert rank_copy_problem(bf, "w2_bias", "b", t, 2) is None
    t[3 + 2, 1] = -0.0  # not the +0.0 bytes convert writes: the copies are compared byte for byte
    assert rank_copy_problem(bf, "w2_bias", "b", t, 2) == (
        "tensor 'b' rank 1 [expert 2, row 1] is -0.0, must be 0 (w2's bias is rank 0's only, added once; 1 element(s) of "
        "rank 1 differ)"
    )
    s = torch.ones(4 * 2, 3)
    s[3 * 2 + 1, 2] = 2.0
    assert rank_copy_problem(i8, "w2_scale", "s", s, 4, e0=5) == (
        "tensor 's' rank 3 [expert 6, row 2] is 2.0, rank 0's copy is 1.0 (1 element(s) differ): every rank keeps the "
        "same copy of the whole layer's, byte for byte"
    )
