"""The torch.ops.moepack.* registrations: schemas, Meta kernels, opcheck, torch.compile."""

from __future__ import annotations

import pytest
import torch

import moepack
from moepack.layout import layout_padded_k, layout_padded_n
from moepack.layout import layout_tensor_plan
from tests.conftest import make_moe_inputs

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OPS = torch.ops.moepack

# opcheck's internals (not moepack) still call torch.jit.script_method
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
LAYOUT_ID = moepack.DEFAULT_LAYOUT.id


def fused_args(inp, packed, *, bias: bool, expert_map=None):
    args = (inp.x, packed.weight("w13"), packed.weight("w2"), inp.topk_weights, inp.topk_ids, LAYOUT_ID)
    kwargs = {"interleaved": packed.interleaved}
    if bias:
        kwargs.update(w13_bias=packed.w13_bias, w2_bias=packed.w2_bias)
    if expert_map is not None:
        kwargs["expert_map"] = expert_map
    return args, kwargs


OPCHECK_CASES = {
    "f32-silu": dict(dtype=F32, activation="silu", bias=False, tokens=3, topk=2),
    "bf16-gelu-bias": dict(dtype=BF16, activation="gelu", bias=True, tokens=5, topk=1),
    "f16-gelu_tanh-bias-k5": dict(dtype=F16, activation="gelu_tanh", bias=True, tokens=4, topk=5),
    "bf16-swigluoai-bias-alpha-limit": dict(dtype=BF16, activation="swigluoai", bias=True, tokens=3, topk=2,
                                            alpha=1.5, limit=3.0),  # fmt: skip
    "f32-expert_map": dict(dtype=F32, activation="silu", bias=True, tokens=6, topk=2, expert_map=True),
    "f32-zero-tokens": dict(dtype=F32, activation="silu", bias=False, tokens=0, topk=2),
}


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck_fused_experts(name):
    c = dict(OPCHECK_CASES[name])
    act = c.pop("activation")
    use_map = c.pop("expert_map", False)
    alpha, limit = c.pop("alpha", None), c.pop("limit", None)
    inp = make_moe_inputs(hidden=93, intermediate=40, experts=5, interleaved=act == "swigluoai", seed=1, **c)
    expert_map = None
    if use_map:  # this rank holds global experts 1 and 3
        local = [1, 3]
        inp.w13, inp.w2 = inp.w13[local], inp.w2[local]
        inp.w13_bias, inp.w2_bias = inp.w13_bias[local], inp.w2_bias[local]
        expert_map = torch.tensor([-1, 0, -1, 1, -1], dtype=torch.int32)
    packed = inp.pack()
    args, kwargs = fused_args(inp, packed, bias=c["bias"], expert_map=expert_map)
    kwargs["activation"] = act
    if alpha is not None:
        kwargs.update(alpha=alpha, limit=limit)
    result = torch.library.opcheck(OPS.fused_experts.default, args, kwargs)  # schema, autograd reg., fake, aot
    assert set(result.values()) == {"SUCCESS"} and len(result) == 4, result


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_opcheck_pack_weight(dtype):
    w = torch.randn(3, 45, 93).to(dtype)
    result = torch.library.opcheck(OPS.pack_weight.default, (w, LAYOUT_ID))
    assert set(result.values()) == {"SUCCESS"} and len(result) == 4, result


@pytest.mark.parametrize("layout", moepack.LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_meta_tensors_give_the_output_shape(dtype, layout):
    """The Meta kernel accepts exactly the tensors moepack.layout.layout_tensor_plan declares
    (the C++ shape rules in layout_shapes.h against the Python ones), and names the tensor and
    the rule when one is off."""
    e, h, i, t, k = 5, 93, 40, 7, 2
    meta = dict(device="meta")
    plan = layout_tensor_plan(layout, e, h, i, bias=True)
    tensors = {p.name: torch.empty(p.shape, dtype=getattr(torch, p.dtype), **meta) for p in plan}
    x = torch.empty(t, h, dtype=dtype, **meta)
    w, ids = torch.empty(t, k, **meta), torch.empty(t, k, dtype=torch.int32, **meta)

    def call(ts):
        return moepack.fused_experts(x, [ts[n] for n in layout.tensor_names("w13")], [ts[n] for n in layout.tensor_names("w2")],
                                     w, ids, layout=layout, w13_bias=ts["w13_bias"], w2_bias=ts["w2_bias"])  # fmt: skip

    out = call(tensors)
    assert out.device.type == "meta" and out.shape == (t, h) and out.dtype == dtype
    for p in plan:
        if p.role == "bias":
            continue
        bad = dict(tensors)
        shape = list(p.shape)
        shape[-1] += 1
        bad[p.name] = torch.empty(shape, dtype=getattr(torch, p.dtype), **meta)
        weight, idx = p.weight, layout.tensor_names(p.weight).index(p.name)
        with pytest.raises(ValueError, match=rf"{weight}\[{idx}\] \({p.name}\) has shape .*: must be \[{', '.join(map(str, p.shape))}\]"):
            call(bad)
    if layout.tensors[0].dtype == "bfloat16":
        packed = moepack.pack_weight(torch.empty(e, 2 * i, h, dtype=dtype, **meta), layout)
        assert packed.device.type == "meta" and packed.dtype == BF16
        # N = 2I = 80 -> whole column blocks; K = 93 -> whole k_pack runs (x86: (96, 94))
        assert tuple(packed.shape) == (e, layout_padded_n(layout, 2 * i), layout_padded_k(layout, h))


@pytest.mark.parametrize("layout", moepack.LAYOUTS, ids=lambda x: x.name)
def test_meta_pack_weight_gives_the_packed_codes_shape(layout):
    """pack_weight's Meta kernel: the codes tensor layout_tensor_plan declares (bf16 values, int8
    codes, sub-byte codes with their zero points), with and without the MoE paddings."""
    e, n, k = 5, 80, 93
    meta = dict(device="meta")
    dtype = {"bfloat16": F32, "int8": torch.int8, "uint8": torch.uint8}[layout.tensors[0].dtype]
    w = torch.empty(e, n, k, dtype=dtype, **meta)
    kw = {}
    if layout.weight_bits < 8:
        ng = 1 if layout.group_size == 0 else -(-k // layout.group_size)
        kw["zero"] = torch.empty(e, n, ng, dtype=torch.uint8, **meta)
    per_byte = 8 // layout.weight_bits if layout.weight_bits < 8 else 1
    for np_, kp in [(0, 0), (128, 96 + 8 * (layout.group_size or 1))]:
        packed = moepack.pack_weight(w, layout, n_padded=np_, k_padded=kp, **kw)
        cpu = moepack.pack_weight(torch.zeros(w.shape, dtype=dtype), layout, n_padded=np_, k_padded=kp,
                                  **{key: torch.zeros(v.shape, dtype=v.dtype) for key, v in kw.items()})  # fmt: skip
        want = (e, np_ or layout_padded_n(layout, n), (kp or layout.k_pack * -(-k // layout.k_pack)) // per_byte)
        assert packed.device.type == "meta" and packed.dtype == cpu.dtype == getattr(torch, layout.tensors[0].dtype)
        assert tuple(packed.shape) == tuple(cpu.shape) == want
    if layout.weight_bits < 8:  # the Meta kernel refuses what the CPU one does, before any data
        with pytest.raises(TypeError, match=rf"weight has dtype Float: layout {layout.name} packs 4-bit codes"):
            moepack.pack_weight(w.float(), layout, **kw)
        with pytest.raises(ValueError, match=r"zero has shape \[5, 79, .*\] for weight \[5, 80, 93\]"):
            moepack.pack_weight(w, layout, zero=kw["zero"][:, :79])


@pytest.mark.parametrize("with_zero", [False, True])
def test_opcheck_pack_weight_u4(with_zero):
    lay = next(x for x in moepack.LAYOUTS if x.weight_bits < 8 and x.group_size == 32)
    q = torch.randint(0, 16, (3, 45, 93), dtype=torch.uint8)
    kwargs = {"zero": torch.randint(0, 16, (3, 45, 3), dtype=torch.uint8)} if with_zero else {}
    result = torch.library.opcheck(OPS.pack_weight.default, (q, lay.id, 64, 128), kwargs)
    assert set(result.values()) == {"SUCCESS"} and len(result) == 4, result


def moe_block(x, w13, w2, b13, b2, topk_weights, topk_ids):
    """What a model does around the op: routing-free pre/post-processing plus the experts."""
    y = moepack.fused_experts(x * 2.0, w13, w2, topk_weights, topk_ids, activation="gelu_tanh", w13_bias=b13,
                              w2_bias=b2)  # fmt: skip
    return y + x


def test_torch_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) traces through moepack.fused_experts (Meta kernel for the
    shapes, the CPU kernel at run time) and gives the eager result bitwise. Took ~20 s on the
    2-core CI box (first dynamo/inductor use in the process)."""
    torch._dynamo.reset()
    inp = make_moe_inputs(tokens=9, hidden=93, intermediate=40, topk=2, dtype=BF16, bias=True, seed=3)
    packed = inp.pack()
    args = (inp.x, packed.w13, packed.w2, packed.w13_bias, packed.w2_bias, inp.topk_weights, inp.topk_ids)
    compiled = torch.compile(moe_block, fullgraph=True)
    out = compiled(*args)
    assert torch.equal(out, moe_block(*args))
    # a second token count reuses or recompiles the graph, still without a graph break
    inp2 = make_moe_inputs(tokens=17, hidden=93, intermediate=40, topk=2, dtype=BF16, bias=True, seed=4)
    args2 = (inp2.x, packed.w13, packed.w2, packed.w13_bias, packed.w2_bias, inp2.topk_weights, inp2.topk_ids)
    assert torch.equal(compiled(*args2), moe_block(*args2))


def test_dynamic_token_count_is_not_specialized():
    """With the token count marked dynamic (as vLLM compiles its CPU model) the Meta kernel
    keeps it symbolic: one graph serves several token counts (a specialization would raise
    ConstraintViolationError), each result equal to the eager op's; an unbacked count (no value
    to guard on) traces too; and the symbolic checks still refuse a topk_ids whose token count
    differs from hidden_states'."""
    torch._dynamo.reset()
    inp = make_moe_inputs(tokens=5, hidden=72, intermediate=40, topk=2, dtype=BF16, seed=7)
    packed = inp.pack()
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, tw, ti):
        return moepack.fused_experts(x, packed.w13, packed.w2, tw, ti)

    compiled = torch.compile(block, fullgraph=True, backend=count)
    for tokens in (5, 9, 2):
        i = make_moe_inputs(tokens=tokens, hidden=72, intermediate=40, topk=2, dtype=BF16, seed=tokens)
        for t in (i.x, i.topk_weights, i.topk_ids):
            torch._dynamo.mark_dynamic(t, 0)
        assert torch.equal(compiled(i.x, i.topk_weights, i.topk_ids), block(i.x, i.topk_weights, i.topk_ids))
    assert len(graphs) == 1
    # an unbacked count (no hint to guard on; torch.export-style) traces too
    torch._dynamo.reset()
    i = make_moe_inputs(tokens=4, hidden=72, intermediate=40, topk=2, dtype=BF16, seed=4)
    for t in (i.x, i.topk_weights, i.topk_ids):
        torch._dynamo.decorators.mark_unbacked(t, 0)
    assert torch.equal(torch.compile(block, fullgraph=True, backend=count)(i.x, i.topk_weights, i.topk_ids),
                       block(i.x, i.topk_weights, i.topk_ids))  # fmt: skip
    torch._dynamo.reset()
    i = make_moe_inputs(tokens=6, hidden=72, intermediate=40, topk=2, dtype=BF16, seed=6)
    ids = i.topk_ids[:5].contiguous()
    for t in (i.x, i.topk_weights, ids):
        torch._dynamo.mark_dynamic(t, 0)
    with pytest.raises(Exception, match="topk_ids and hidden_states must have the same number of tokens"):
        torch.compile(block, fullgraph=True, backend=count)(i.x, i.topk_weights, ids)
