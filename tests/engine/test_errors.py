"""Bad calls raise ONE clear error: the right exception type, a message that names the argument
and states the rule (the asserts check substrings, not whole messages), no C++ backtrace."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import moepack
from moepack.errors import LayoutError, MoepackError, UnsupportedError
from moepack.isa import ISAS
from moepack.pack import pack_experts
from tests.conftest import make_moe_inputs

OPS = torch.ops.moepack


@pytest.fixture(scope="module")
def s():
    """T=3, H=72, I=40 (Ip=64), E=5, k=2, with biases; packed gate-then-up and interleaved."""
    inp = make_moe_inputs(tokens=3, hidden=72, intermediate=40, experts=5, topk=2, bias=True, seed=5)
    p = inp.pack()
    pi = pack_experts(inp.w13, inp.w2, inp.w13_bias, inp.w2_bias, interleaved=True)
    return SimpleNamespace(inp=inp, p=p, pi=pi, x=inp.x, w=inp.topk_weights, ids=inp.topk_ids)


def fe(s, **over):
    """moepack.fused_experts on the fixture's valid arguments, with some replaced."""
    a = dict(hidden_states=s.x, w13=s.p.w13, w2=s.p.w2, topk_weights=s.w, topk_ids=s.ids)
    kw = {k: over.pop(k) for k in list(over) if k not in a}
    a.update(over)
    return moepack.fused_experts(a["hidden_states"], a["w13"], a["w2"], a["topk_weights"], a["topk_ids"], **kw)


def nan_at(t: torch.Tensor, idx) -> torch.Tensor:
    t = t.clone()
    t[idx] = float("nan")
    return t


# name -> (call, exception type, substrings that the message must contain)
CASES = {
    # dtypes
    "x int32": (lambda s: fe(s, hidden_states=s.x.int()), TypeError, ["hidden_states", "Int", "float32, bfloat16 or float16"]),
    "x float64": (lambda s: fe(s, hidden_states=s.x.double()), TypeError, ["hidden_states", "Double", "float32, bfloat16 or float16"]),
    "w13 fp32 (unpacked dtype)": (lambda s: fe(s, w13=s.p.w13.float()), TypeError, ["w13", "Float", "must be BFloat16"]),
    "w2 fp16": (lambda s: fe(s, w2=s.p.w2.half()), TypeError, ["w2", "Half", "must be BFloat16"]),
    "topk_ids int64": (lambda s: fe(s, topk_ids=s.ids.long()), TypeError, ["topk_ids", "Long", "must be Int"]),
    "topk_weights bf16": (lambda s: fe(s, topk_weights=s.w.bfloat16()), TypeError, ["topk_weights", "BFloat16", "must be Float"]),
    "w13_bias bf16": (lambda s: fe(s, w13_bias=s.p.w13_bias.bfloat16()), TypeError, ["w13_bias", "BFloat16", "must be Float"]),
    "expert_map int64": (lambda s: fe(s, expert_map=torch.arange(5)), TypeError, ["expert_map", "Long", "int32"]),
    # shapes
    "x 1-D": (lambda s: fe(s, hidden_states=s.x[0]), ValueError, ["hidden_states", "[72]", "2-D [tokens, hidden]"]),
    "x column-strided": (lambda s: fe(s, hidden_states=torch.randn(72, 3).t()), ValueError, ["hidden_states", "strides", "contiguous (stride 1)"]),
    "w13 wrong hidden": (lambda s: fe(s, w13=s.p.w13[:, :, :70].contiguous()), ValueError, ["w13", "[5, 128, 70]", "must be [5, 128, 72]", "H padded to k_pack"]),
    "w13 rows not 2*Ip": (lambda s: fe(s, w13=s.p.w13[:, :96].contiguous()), ValueError, ["w13", "[5, 96, 72]", "2*Ip", "multiple of 32"]),
    "w13 2-D": (lambda s: fe(s, w13=s.p.w13[0]), ValueError, ["w13", "3-D"]),
    "w13 not contiguous": (lambda s: fe(s, w13=torch.nn.functional.pad(s.p.w13, (0, 8))[:, :, :72]), ValueError, ["w13", "not contiguous", "must be contiguous"]),
    "w2 fewer experts": (lambda s: fe(s, w2=s.p.w2[:4].contiguous()), ValueError, ["w2", "[4, 96, 64]", "must be [5, 96, 64]"]),
    "w2 wrong Ip": (lambda s: fe(s, w2=s.p.w2[:, :, :32].contiguous()), ValueError, ["w2", "[5, 96, 32]", "must be [5, 96, 64]"]),
    "w2 wrong hidden": (lambda s: fe(s, w2=s.p.w2[:, :64].contiguous()), ValueError, ["w2", "[5, 64, 64]", "H padded to block_n"]),
    "topk_ids fewer tokens": (lambda s: fe(s, topk_ids=s.ids[:2].contiguous()), ValueError, ["topk_ids", "[2, 2]", "tokens=3"]),
    "topk_ids k=0": (lambda s: fe(s, topk_ids=s.ids[:, :0].contiguous(), topk_weights=s.w[:, :0].contiguous()), ValueError, ["topk_ids", "k >= 1"]),
    "topk_weights k mismatch": (lambda s: fe(s, topk_weights=s.w[:, :1].contiguous()), ValueError, ["topk_weights", "[3, 1]", "same shape as topk_ids"]),
    "topk_ids not contiguous": (lambda s: fe(s, topk_ids=s.ids.t().contiguous().t()), ValueError, ["topk_ids", "must be contiguous"]),
    "w13_bias unpadded": (lambda s: fe(s, w13_bias=s.inp.w13_bias), ValueError, ["w13_bias", "[5, 80]", "must be [5, 128]", "packed row order"]),
    "w2_bias unpadded": (lambda s: fe(s, w2_bias=s.inp.w2_bias), ValueError, ["w2_bias", "[5, 72]", "must be [5, 96]"]),
    "expert_map too short": (lambda s: fe(s, expert_map=torch.zeros(3, dtype=torch.int32)), ValueError, ["expert_map", "[3]", "E_global >= local experts (5)"]),
    # values
    "id out of range": (lambda s: fe(s, topk_ids=torch.tensor([[0, 1], [2, 5], [3, 4]], dtype=torch.int32)), IndexError, ["topk_ids[1, 1] = 5", "out of range", "[0, 5)"]),
    "negative id": (lambda s: fe(s, topk_ids=torch.tensor([[0, 1], [2, 3], [-7, 4]], dtype=torch.int32)), IndexError, ["topk_ids[2, 0] = -7", "[0, 5)"]),
    "expert_map entry": (lambda s: fe(s, expert_map=torch.tensor([0, 1, 2, 3, 9], dtype=torch.int32)), IndexError, ["expert_map[4] = 9", "-1 (not local)", "[0, 5)"]),
    "unknown activation": (lambda s: fe(s, activation="relu"), ValueError, ["activation='relu'", "silu, gelu, gelu_tanh, swigluoai"]),
    "activation case": (lambda s: fe(s, activation="SiLU"), ValueError, ["activation='SiLU'", "not one of"]),
    "alpha inf": (lambda s: fe(s, alpha=float("inf")), ValueError, ["alpha=inf", "finite"]),
    "alpha nan": (lambda s: fe(s, activation="swigluoai", w13=s.pi.w13, alpha=float("nan")), ValueError, ["alpha=nan", "finite"]),
    "limit nan": (lambda s: fe(s, limit=float("nan")), ValueError, ["limit=nan", "finite"]),
    "limit <= 0": (lambda s: fe(s, limit=0.0), ValueError, ["limit=0", "limit > 0"]),
    "unknown layout id (wrapper)": (lambda s: fe(s, layout=99), LayoutError, ["layout 99 is unknown", "bf16_n32k2_x86 (id 1)"]),
    "unknown layout name (wrapper)": (lambda s: fe(s, layout="int4_g128"), LayoutError, ["'int4_g128' is unknown", "known layouts"]),
    "unknown layout id (raw op)": (lambda s: OPS.fused_experts(s.x, [s.p.w13], [s.p.w2], s.w, s.ids, 99), ValueError, ["layout=99", "unknown"]),
    "layout 0 (raw op)": (lambda s: OPS.fused_experts(s.x, [s.p.w13], [s.p.w2], s.w, s.ids, 0), ValueError, ["layout=0", "unknown"]),
    "pack_weight unknown layout": (lambda s: OPS.pack_weight(s.inp.w2, 99), ValueError, ["layout=99", "unknown"]),
    "layout_desc unknown": (lambda s: OPS.layout_desc(-1), ValueError, ["layout=-1", "unknown"]),
    "pack_weight 2-D": (lambda s: moepack.pack_weight(s.inp.w2[0]), ValueError, ["weight", "3-D [E, N, K]"]),
    "pack_weight int": (lambda s: moepack.pack_weight(s.inp.w2.int()), TypeError, ["weight", "Int", "float32, bfloat16 or float16"]),
    # pack_experts: LayoutError naming the tensor
    "pack NaN w13": (lambda s: pack_experts(nan_at(s.inp.w13, (1, 2, 3)), s.inp.w2), LayoutError, ["w13", "[1, 2, 3]", "must be finite"]),
    "pack NaN w2": (lambda s: pack_experts(s.inp.w13, nan_at(s.inp.w2, (4, 0, 39))), LayoutError, ["w2", "[4, 0, 39]", "must be finite"]),
    "pack inf w2_bias": (lambda s: pack_experts(s.inp.w13, s.inp.w2, None, s.inp.w2_bias.index_fill(1, torch.tensor([7]), float("inf"))),
                         LayoutError, ["w2_bias", "non-finite", "must be finite"]),  # fmt: skip
    "pack NaN w13_bias": (lambda s: pack_experts(s.inp.w13, s.inp.w2, nan_at(s.inp.w13_bias, (0, 79))), LayoutError, ["w13_bias", "[0, 79]", "finite"]),
    "pack w2 mismatch": (lambda s: pack_experts(s.inp.w13, s.inp.w2[:, :, :39]), LayoutError, ["w2", "[5, 72, 39]", "[E, H, I] = [5, 72, 40]", "w13"]),
    "pack w2 experts": (lambda s: pack_experts(s.inp.w13, s.inp.w2[:4]), LayoutError, ["w2", "[4, 72, 40]", "[5, 72, 40]"]),
    "pack odd 2I": (lambda s: pack_experts(s.inp.w13[:, :79], s.inp.w2), LayoutError, ["w13", "[5, 79, 72]", "even"]),
    "pack 2-D": (lambda s: pack_experts(s.inp.w13[0], s.inp.w2), LayoutError, ["w13", "3-D"]),
    "pack int weights": (lambda s: pack_experts(s.inp.w13.int(), s.inp.w2), LayoutError, ["w13", "int32", "float32, bfloat16 or float16"]),
    "pack w13_bias shape": (lambda s: pack_experts(s.inp.w13, s.inp.w2, s.inp.w13_bias[:, :79]), LayoutError, ["w13_bias", "[5, 79]", "[E, 2I] = [5, 80]"]),
    "pack w2_bias shape": (lambda s: pack_experts(s.inp.w13, s.inp.w2, None, s.inp.w2_bias[:, :71]), LayoutError, ["w2_bias", "[5, 71]", "[E, H] = [5, 72]"]),
    "pack unknown layout": (lambda s: pack_experts(s.inp.w13, s.inp.w2, layout="nope"), LayoutError, ["'nope' is unknown"]),
    # run_experts
    # H = 71 pads to the same Kp (72) and Np (96) as H = 72: the op cannot tell, run_experts can
    "run hidden off by one": (lambda s: moepack.run_experts(s.p, s.x[:, :71].contiguous(), s.w, s.ids),
                              LayoutError, ["hidden_states", "[3, 71]", "H = 72"]),  # fmt: skip
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_bad_call_raises_one_clear_error(s, name):
    call, exc, parts = CASES[name]
    with pytest.raises(Exception) as ei:
        call(s)
    err = ei.value
    assert type(err) is exc, f"{name}: raised {type(err).__name__}: {err}, expected {exc.__name__}"
    msg = str(err)
    for part in parts:
        assert part in msg, f"{name}: message {msg!r} lacks {part!r}"
    assert "Exception raised from" not in msg and "\n" not in msg.strip(), f"{name}: not one clear line: {msg!r}"
    if issubclass(exc, MoepackError):
        assert isinstance(err, MoepackError)


def test_the_checks_pass_on_the_valid_call(s):
    """The fixture's call itself is valid (so each case above fails for its own reason)."""
    assert fe(s).shape == (3, 72)
    assert fe(s, w13_bias=s.p.w13_bias, w2_bias=s.p.w2_bias, expert_map=torch.arange(5, dtype=torch.int32)).shape == (3, 72)
    assert moepack.run_experts(s.p, s.x, s.w, s.ids).shape == (3, 72)
    assert moepack.run_experts(s.pi, s.x, s.w, s.ids, activation="swigluoai").shape == (3, 72)


def test_bogus_max_isa_env(s, monkeypatch):
    monkeypatch.setenv("MOEPACK_MAX_ISA", "bogus")
    for call in (lambda: fe(s), moepack.kernel_choice):
        with pytest.raises(ValueError) as ei:
            call()
        assert type(ei.value) is ValueError
        assert "MOEPACK_MAX_ISA='bogus'" in str(ei.value) and f"is not one of {', '.join(ISAS)} (" in str(ei.value)
    # the Python mirror (moepack.isa) refuses it too, as an UnsupportedError
    from moepack.isa import max_isa

    with pytest.raises(UnsupportedError, match=re.escape(f"MOEPACK_MAX_ISA='bogus' is not one of {', '.join(ISAS)}")):
        max_isa()


def test_errors_leave_no_partial_state(s):
    """A refused call does not poison the next valid one (the op keeps no state)."""
    with pytest.raises(IndexError):
        fe(s, topk_ids=torch.full((3, 2), 99, dtype=torch.int32))
    first = fe(s)
    assert torch.equal(first, fe(s))


def _tp_and_whole():
    from moepack.layout import DEFAULT_LAYOUT
    from moepack.schemes import get_scheme
    from moepack.tp import tp_slice

    inp = make_moe_inputs(tokens=5, hidden=256, intermediate=128, experts=4, topk=2, seed=7)
    sc = get_scheme(DEFAULT_LAYOUT)
    p = sc.pack(sc.from_float(inp.w13, inp.w2, layout=DEFAULT_LAYOUT), interleaved=False, layout=DEFAULT_LAYOUT)
    return inp, p, tp_slice(p, 2)


@pytest.mark.parametrize("case", ["1-D ids, tp pack", "sparse hidden", "sparse weights", "sparse ids"])
def test_run_experts_refuses_in_one_line_not_a_torch_dump(case):
    """run_experts' own checks before a --tp pack's route expansion and the op's dispatcher: a 1-D
    topk_ids on a TP pack gave a raw IndexError, a sparse tensor the dispatcher's 41-line backend
    table (issue 49). Each is one line naming the argument and the rule."""
    inp, p, pt = _tp_and_whole()
    x, w, ids = inp.x, inp.topk_weights, inp.topk_ids
    call, words = {
        "1-D ids, tp pack": ((pt, x, w, ids[:, 0]), "topk_ids has shape [5], topk_weights [5, 2]: both must be [tokens=5, k]"),
        "sparse hidden": ((p, x.to_sparse(), w, ids), "hidden_states is a torch.sparse_coo tensor: run_experts takes dense"),
        "sparse weights": ((p, x, w.to_sparse(), ids), "topk_weights is a torch.sparse_coo tensor"),
        "sparse ids": ((pt, x, w, ids.to_sparse()), "topk_ids is a torch.sparse_coo tensor"),
    }[case]
    with pytest.raises(LayoutError) as ei:
        moepack.run_experts(*call)
    assert words in str(ei.value) and "\n" not in str(ei.value), str(ei.value)
    # the same call with the argument as it should be runs, and the TP pack run whole equals the pack
    assert torch.allclose(moepack.run_experts(pt, x, w, ids), moepack.run_experts(p, x, w, ids), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", ["meta ids", "meta weights", "meta ids, tp pack", "meta expert_map"])
def test_a_meta_tensor_beside_cpu_hidden_states_is_refused(case):
    """A meta topk_ids or topk_weights beside CPU hidden states made the dispatcher pick the
    Meta kernel, which returned the output uninitialized on the CPU: garbage, no error (issue
    49, "a meta-tensor input"). One line naming the argument and both devices; meta hidden
    states still trace the output's shape."""
    inp, p, pt = _tp_and_whole()
    x, w, ids = inp.x, inp.topk_weights, inp.topk_ids
    meta = lambda t: t.to("meta")  # noqa: E731
    call, kw, name = {
        "meta ids": ((p, x, w, meta(ids)), {}, "topk_ids"),
        "meta weights": ((p, x, meta(w), ids), {}, "topk_weights"),
        "meta ids, tp pack": ((pt, x, w, meta(ids)), {}, "topk_ids"),
        "meta expert_map": ((p, x, w, ids), {"expert_map": meta(torch.arange(4, dtype=torch.int32))}, "expert_map"),
    }[case]
    with pytest.raises(LayoutError) as ei:
        moepack.run_experts(*call, **kw)
    msg = str(ei.value)
    assert msg.startswith(f"{name} is on meta, hidden_states on cpu: every tensor of a call must be on hidden_states' device")
    assert "\n" not in msg
    out = moepack.run_experts(p, meta(x), meta(w), meta(ids))
    assert out.device.type == "meta" and out.shape == x.shape
