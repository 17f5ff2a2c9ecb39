"""Packing: the Python packer (moepack/pack, the specification) and the C++ packer
(torch.ops.moepack.pack_weight) must produce the same bytes; padding is exactly zero; the
offset math in moepack/layout.py describes where the packer puts each element; a small golden
example pins the layout by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import moepack
from moepack.errors import LayoutError
from moepack.layout import (
    DEFAULT_LAYOUT,
    LAYOUTS,
    PackedLayout,
    TensorSpec,
    layout_code_position,
    layout_element_offset,
    layout_expert_shapes,
    layout_padded_k,
    layout_padded_n,
)
from moepack.pack import pack_codes, pack_experts, pack_weight_reference, unpack_codes, unpack_weight_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
L = DEFAULT_LAYOUT

# [E, N, K]: tiny, odd K (k_pack padding), N across block boundaries, I-like and H-like sizes
AWKWARD = [(1, 1, 1), (1, 2, 3), (2, 33, 7), (3, 31, 93), (2, 64, 64), (5, 176, 200), (2, 65, 130), (1, 200, 88)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def random_weight(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(dtype)


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x.scheme == "dense"], ids=lambda x: x.name)  # int8: test_int8.py
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_cpp_packer_equals_python_packer(layout, dtype, shape):
    w = random_weight(shape, dtype, seed=sum(shape))
    cpp = moepack.pack_weight(w, layout)
    ref = pack_weight_reference(w, layout)
    assert cpp.dtype == ref.dtype == BF16
    assert cpp.shape == ref.shape == (shape[0], layout_padded_n(layout, shape[1]), layout_padded_k(layout, shape[2]))
    assert torch.equal(bits(cpp), bits(ref))


def test_cpp_packer_equals_python_packer_on_every_fp16_value():
    """Every finite fp16 bit pattern (incl. subnormals, -0, the largest values) -> bf16."""
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(F16)
    h = h[torch.isfinite(h)]
    assert h.numel() == 2**16 - 2 * 2**10
    for w in (h.view(31, 32, 64), h[: 31 * 33 * 61].view(31, 61, 33)):  # and an odd K
        assert torch.equal(bits(moepack.pack_weight(w)), bits(pack_weight_reference(w)))


def test_cpp_packer_equals_python_packer_on_fp32_edge_values():
    """fp32 -> bf16 rounding: ties to even, one ulp off a tie, subnormals, overflow to inf,
    +-0, and random finite bit patterns (non-finite sources are refused: see below)."""
    g = torch.Generator().manual_seed(3)
    b = torch.randint(0, 0x7F80, (20000,), generator=g, dtype=torch.int32)
    ties = (b << 16) | 0x8000
    near = torch.cat([ties, ties + 1, ties - 1]).view(F32)
    rnd = torch.randint(-(2**31), 2**31 - 1, (60000,), generator=g, dtype=torch.int64).to(torch.int32).view(F32)
    special = torch.tensor([0.0, -0.0, 3.4028235e38, 3.3961776e38, 1e-40, 2.0**-149, 1.0 + 2.0**-8])
    v = torch.cat([near, -near, rnd, special])
    v = v[torch.isfinite(v)]
    v = v[: v.numel() // 10 * 10].view(10, 1, -1)
    assert torch.equal(bits(moepack.pack_weight(v)), bits(pack_weight_reference(v)))


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_cpp_packer_refuses_non_finite_weights_naming_the_element(dtype, bad):
    """NaN/Inf have no meaning in a weight (SEMANTICS.md §3): the C++ packer checks every
    element in its packing pass and names the first bad one (expert, row, column)."""
    w = random_weight((3, 40, 93), dtype, seed=7)
    w[2, 33, 17] = bad
    with pytest.raises(ValueError, match=r"weight\[2, 33, 17\] is not finite"):
        moepack.pack_weight(w)


def test_python_packer_keeps_nan_a_nan():
    """The readable reference packer is a pure permutation + cast: NaN stays NaN there."""
    nan_bits = torch.tensor([0x7FC00000, 0x7F800001, -0x00400000, 0x7FFFFFFF], dtype=torch.int32)
    w = nan_bits.view(F32).view(1, 1, -1)
    assert torch.isnan(unpack_weight_reference(pack_weight_reference(w), 1, 4).float()).all()


def test_cpp_packer_takes_non_contiguous_sources():
    base = random_weight((3, 93, 40), F32, seed=4)
    w = base.transpose(1, 2)  # [3, 40, 93] with strides of the transpose
    assert not w.is_contiguous()
    assert torch.equal(bits(moepack.pack_weight(w)), bits(pack_weight_reference(w.contiguous())))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("shape", [(3, 93, 88), (1, 1, 1), (2, 200, 33), (2, 72, 64)], ids=lambda s: "E%dH%dI%d" % s)
def test_pack_experts_cpp_equals_python(shape, dtype, with_bias, interleaved):
    e, h, i = shape
    w13 = random_weight((e, 2 * i, h), dtype, seed=10)
    w2 = random_weight((e, h, i), dtype, seed=11)
    b13 = random_weight((e, 2 * i), dtype, seed=12) if with_bias else None
    b2 = random_weight((e, h), dtype, seed=13) if with_bias else None
    a = pack_experts(w13, w2, b13, b2, interleaved=interleaved, use_cpp=True)
    b = pack_experts(w13, w2, b13, b2, interleaved=interleaved, use_cpp=False)
    for name in ("w13", "w2"):
        assert torch.equal(bits(getattr(a, name)), bits(getattr(b, name))), name
    for name in ("w13_bias", "w2_bias"):
        ta, tb = getattr(a, name), getattr(b, name)
        assert (ta is None) == (tb is None) == (not with_bias)
        if with_bias:
            assert ta.dtype == tb.dtype == F32 and torch.equal(ta.view(torch.int32), tb.view(torch.int32)), name
    shapes = layout_expert_shapes(L, e, h, i)
    assert (a.num_experts, a.hidden, a.intermediate, a.padded_intermediate) == (e, h, i, shapes.padded_intermediate)
    assert a.interleaved == interleaved and a.layout == L
    assert tuple(a.w13.shape) == shapes.w13_shape and tuple(a.w2.shape) == shapes.w2_shape
    assert a.nbytes == sum(t.numel() * t.element_size() for t in (a.w13, a.w2, a.w13_bias, a.w2_bias) if t is not None)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", [(5, 93, 88), (2, 1, 1), (3, 130, 176), (2, 72, 64)], ids=lambda s: "E%dH%dI%d" % s)
def test_unpack_pack_round_trip_and_zero_padding(shape, interleaved):
    """unpack(pack(w)) gives back the bf16 weights where SEMANTICS.md §2 puts them (gate rows
    [0, I), up rows [Ip, Ip + I); interleaved pairs first), and exactly +0.0 everywhere else."""
    e, h, i = shape
    w13 = random_weight((e, 2 * i, h), F32, seed=20)
    w2 = random_weight((e, h, i), F32, seed=21)
    b13 = random_weight((e, 2 * i), F32, seed=22)
    b2 = random_weight((e, h), F32, seed=23)
    p = pack_experts(w13, w2, b13, b2, interleaved=interleaved)
    ip = p.padded_intermediate
    assert ip % L.i_align == 0 and i <= ip < i + L.i_align
    np_, kp = p.w13.shape[1], p.w13.shape[2]
    full13 = unpack_weight_reference(p.w13, np_, kp)  # [E, 2Ip, Kp] incl. padding
    expect13 = torch.zeros(e, 2 * ip, kp, dtype=BF16)
    expect_b13 = torch.zeros(e, 2 * ip)
    if interleaved:
        expect13[:, : 2 * i, :h] = w13.to(BF16)
        expect_b13[:, : 2 * i] = b13
    else:
        expect13[:, :i, :h] = w13[:, :i].to(BF16)
        expect13[:, ip : ip + i, :h] = w13[:, i:].to(BF16)
        expect_b13[:, :i] = b13[:, :i]
        expect_b13[:, ip : ip + i] = b13[:, i:]
    assert torch.equal(bits(full13), bits(expect13))  # bitwise: padding is +0.0, not -0.0
    assert torch.equal(p.w13_bias.view(torch.int32), expect_b13.view(torch.int32))
    full2 = unpack_weight_reference(p.w2, p.w2.shape[1], p.w2.shape[2])  # [E, Np(H), Ip]
    expect2 = torch.zeros(e, p.w2.shape[1], ip, dtype=BF16)
    expect2[:, :h, :i] = w2.to(BF16)
    assert torch.equal(bits(full2), bits(expect2))
    expect_b2 = torch.zeros(e, p.w2.shape[1])
    expect_b2[:, :h] = b2
    assert torch.equal(p.w2_bias.view(torch.int32), expect_b2.view(torch.int32))
    # the logical round trip
    assert torch.equal(unpack_weight_reference(moepack.pack_weight(w2), h, i), w2.to(BF16))


@pytest.mark.parametrize("shape", [(2, 33, 7), (1, 64, 2), (3, 45, 93), (1, 96, 130)], ids=lambda s: "x".join(map(str, s)))
def test_padding_is_exactly_zero_in_packed_bytes(shape):
    e, n, k = shape
    w = random_weight(shape, F32, seed=30) + 3.0  # no zero (and no -0) among the real values
    packed = bits(moepack.pack_weight(w)).view(e, -1)
    kp = layout_padded_k(L, k)
    nn, kk = torch.meshgrid(torch.arange(n), torch.arange(k), indexing="ij")
    real = torch.zeros(packed.shape[1], dtype=torch.bool)
    real[[layout_element_offset(L, a, b, kp) for a, b in zip(nn.flatten().tolist(), kk.flatten().tolist())]] = True
    assert int(real.sum()) == n * k  # the offsets of distinct elements are distinct
    assert (packed[:, real] != 0).all()
    assert (packed[:, ~real] == 0).all()


@pytest.mark.parametrize("shape", [(2, 33, 7), (2, 65, 93), (1, 200, 88)], ids=lambda s: "x".join(map(str, s)))
def test_element_offset_matches_the_packer_everywhere(shape):
    """Every element gets a unique bf16 bit pattern; layout_element_offset must find each one
    where both packers put it (exhaustive)."""
    e, n, k = shape
    assert e * n * k < 0x7F7F
    code = (1 + torch.arange(e * n * k, dtype=torch.int32)).to(torch.int16).view(e, n, k)
    w = code.view(BF16)  # all finite, positive, distinct
    kp = layout_padded_k(L, k)
    offsets = torch.tensor([[layout_element_offset(L, ni, ki, kp) for ki in range(k)] for ni in range(n)])
    for packed in (moepack.pack_weight(w), pack_weight_reference(w)):
        flat = bits(packed).reshape(e, -1)
        assert torch.equal(flat[:, offsets.flatten()].view(e, n, k), code)


def test_element_offset_random_positions_in_a_large_matrix():
    g = torch.Generator().manual_seed(40)
    n, k = 1000, 777
    w = torch.randn(1, n, k, generator=g)
    flat = bits(moepack.pack_weight(w)).flatten()
    wb = bits(w.to(BF16))[0]
    kp = layout_padded_k(L, k)
    ns = torch.randint(0, n, (2000,), generator=g).tolist()
    ks = torch.randint(0, k, (2000,), generator=g).tolist()
    for ni, ki in zip(ns, ks):
        assert flat[layout_element_offset(L, ni, ki, kp)] == wb[ni, ki]


def test_golden_two_by_four():
    """bf16_n32k2_x86 by hand: N=2, K=4 -> Np=32, Kp=4. Element (n, k) goes to
    (k // 2) * 32 * 2 + n * 2 + k % 2: the K pair (k0, k1) of column 0, then of column 1, ...
    32 columns (zero padding for n >= 2), then the next K pair."""
    assert (L.name, L.block_n, L.k_pack) == ("bf16_n32k2_x86", 32, 2)
    w = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]])
    expected = torch.zeros(128, dtype=BF16)
    expected[0:4] = torch.tensor([1.0, 2.0, 5.0, 6.0])  # K pair 0: (n0 k0, n0 k1, n1 k0, n1 k1)
    expected[64:68] = torch.tensor([3.0, 4.0, 7.0, 8.0])  # K pair 1 starts after 32 columns x 2
    for packed in (moepack.pack_weight(w), pack_weight_reference(w)):
        assert packed.shape == (1, 32, 4)
        assert torch.equal(bits(packed.flatten()), bits(expected))


def test_golden_second_block_and_odd_k():
    """N=33 spills into a second 32-column block; K=3 is padded to Kp=4. Element (32, 2) lands at
    block 1 (32 * Kp = 128) + K pair 1 (64) + column 0 + k % 2 = 0 -> 192."""
    w = torch.zeros(1, 33, 3)
    w[0, 32, 2] = 9.0
    w[0, 31, 1] = 7.0  # block 0, K pair 0, column 31, k 1 -> 31 * 2 + 1 = 63
    w[0, 0, 2] = 5.0  # block 0, K pair 1, column 0, k 0 -> 64
    for packed in (moepack.pack_weight(w), pack_weight_reference(w)):
        assert packed.shape == (1, 64, 4)
        flat = packed.flatten().float()
        assert flat.nonzero().flatten().tolist() == [63, 64, 192]
        assert flat[[63, 64, 192]].tolist() == [7.0, 5.0, 9.0]
    assert [layout_element_offset(L, 31, 1, 4), layout_element_offset(L, 0, 2, 4), layout_element_offset(L, 32, 2, 4)] == [63, 64, 192]


# ---------------------------------------------------------------------------------------------
# pack_codes / unpack_codes: THE arrangement of codes, every code type, every layout


def _codes(lay, shape, seed):
    """Random logical codes of ``lay``'s code type, extremes included."""
    g = torch.Generator().manual_seed(seed)
    if lay.weight_bits >= 16:
        return random_weight(shape, F32, seed)
    unsigned = lay.tensors[0].dtype == "uint8"  # sub-byte codes, and one-byte fp8 bit patterns
    hi = (1 << lay.weight_bits) - 1 if unsigned else 127
    lo = 0 if unsigned else -128
    c = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int16)
    ext = torch.tensor([lo, hi], dtype=torch.int16)
    c.view(-1)[: min(2, c.numel())] = ext[: min(2, c.numel())]
    return c.to(torch.uint8 if unsigned else torch.int8)


def _positions_by_the_layout(lay, packed: torch.Tensor, np_: int, kp: int) -> torch.Tensor:
    """The codes read back one at a time through layout_code_position (the scalar statement of
    where a code sits), [E, np_, kp]."""
    raw = packed.contiguous().view(packed.shape[0], -1).view(torch.uint8)
    out = torch.zeros(packed.shape[0], np_, kp, dtype=torch.int64)
    nbytes = max(lay.weight_bits // 8, 1)
    for n in range(np_):
        for k in range(kp):
            byte, shift = layout_code_position(lay, n, k, kp)
            if lay.weight_bits < 8:
                out[:, n, k] = (raw[:, byte].long() >> shift) & ((1 << lay.weight_bits) - 1)
            else:
                v = sum(raw[:, byte + i].long() << (8 * i) for i in range(nbytes))
                out[:, n, k] = v
    return out


def _as_fields(lay, codes: torch.Tensor) -> torch.Tensor:
    """Logical codes as the unsigned integer each one's bits spell (what _positions_by_the_layout reads)."""
    if lay.weight_bits == 16:
        return codes.to(BF16).view(torch.int16).long() & 0xFFFF
    if lay.weight_bits == 8:
        return codes.view(torch.uint8).long()
    return codes.long()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.name)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 33, 7), (3, 31, 93), (1, 65, 130)], ids=lambda s: "x".join(map(str, s)))
def test_pack_codes_puts_every_code_where_the_layout_says_and_matches_the_cpp_packer(layout, shape):
    """Every layout: each code lands where layout_code_position says (padding 0), unpack_codes
    gives the codes back, and the C++ packer makes the same bytes for every code type it packs."""
    c = _codes(layout, shape, seed=sum(shape))
    packed = pack_codes(layout, c)
    e, n, k = shape
    np_, kp = layout_padded_n(layout, n), layout_padded_k(layout, k)
    assert packed.shape == (e, np_, kp * layout.weight_bits // (8 * packed.element_size()))
    want = torch.zeros(e, np_, kp, dtype=torch.int64)
    want[:, :n, :k] = _as_fields(layout, c)
    assert torch.equal(_positions_by_the_layout(layout, packed, np_, kp), want)
    back = unpack_codes(layout, packed, n, k)
    assert torch.equal(_as_fields(layout, back), _as_fields(layout, c))
    cpp = moepack.pack_weight(c, layout)  # every code type: bf16, int8 and sub-byte
    assert cpp.dtype == packed.dtype and cpp.shape == packed.shape
    assert torch.equal(cpp.view(torch.uint8), packed.view(torch.uint8))


U4 = [x for x in LAYOUTS if x.weight_bits < 8]


def _u4_case(lay, shape, seed):
    """Codes (0 and 15 included) and zero points [E, N, ceil(K / G) + ng_extra] of ``lay``."""
    e, n, k = shape
    g = torch.Generator().manual_seed(seed)
    q = _codes(lay, shape, seed)
    ng = 1 if lay.group_size == 0 else -(-k // lay.group_size)
    z = torch.randint(0, 16, (e, n, ng), generator=g, dtype=torch.uint8)
    z.view(-1)[-1] = 15
    return q, z


# N off the 32-column blocks, K off the k_pack runs and off the groups (partial last group, K
# padding inside a group and whole padding groups), one expert and several
U4_SHAPES = [(1, 1, 1), (1, 31, 100), (3, 45, 93), (2, 64, 256), (1, 33, 7), (4, 96, 200), (2, 70, 136), (1, 200, 264)]


@pytest.mark.parametrize("layout", U4, ids=lambda x: x.name)
@pytest.mark.parametrize("shape", U4_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpp_u4_packer_equals_the_spec_byte_for_byte(layout, shape):
    """torch.ops.moepack.pack_weight with zero points == the spec pack_u4_codes (the int4
    padding rule, then pack_codes): K padding holds each row's group zero point, padded rows
    code 0; with the MoE paddings n_padded / k_padded too (k_padded a group or more past K: the
    padding groups past the last zero point take that one)."""
    from moepack.schemes.int4 import pack_u4_codes

    q, z = _u4_case(layout, shape, seed=sum(shape))
    e, n, k = shape
    gs = layout.group_size or -1
    g = layout.group_size or 1
    for np_, kp in [(layout_padded_n(layout, n), layout_padded_k(layout, k)),
                    (layout_padded_n(layout, n) + 32, layout_padded_k(layout, k) + 8 * g + 8)]:  # fmt: skip
        spec = pack_u4_codes(q, z, gs, layout, np_, kp)
        cpp = moepack.pack_weight(q, layout, n_padded=np_, k_padded=kp, zero=z)
        assert cpp.dtype == spec.dtype == torch.uint8 and cpp.shape == spec.shape == (e, np_, kp // 2)
        assert torch.equal(cpp, spec), (np_, kp)
        assert torch.equal(pack_u4_codes(q, z, gs, layout, np_, kp, use_cpp=True), spec)
    # no zero points: K padding code 0, as pack_codes pads
    assert torch.equal(moepack.pack_weight(q, layout), pack_codes(layout, q))


@pytest.mark.parametrize("layout", U4, ids=lambda x: x.name)
def test_cpp_u4_packer_takes_zero_points_of_the_padded_k_and_non_contiguous_codes(layout):
    """zero with the groups of the padded K (what pack_matrix_sub_byte takes) packs as the spec
    does; strided codes and zero points are packed as their contiguous copies."""
    from moepack.schemes.int4 import pack_u4_codes

    e, n, k = 2, 40, 130
    np_, kp = 64, layout_padded_k(layout, k) + 2 * (layout.group_size or 8)
    gs = layout.group_size or -1
    ng = 1 if layout.group_size == 0 else -(-kp // layout.group_size)
    q, z = _u4_case(layout, (e, n, k), seed=7)
    z = torch.randint(0, 16, (e, n, ng), dtype=torch.uint8, generator=torch.Generator().manual_seed(8))
    want = pack_u4_codes(q, z, gs, layout, np_, kp)
    assert torch.equal(moepack.pack_weight(q, layout, n_padded=np_, k_padded=kp, zero=z), want)
    qt, zt = q.transpose(1, 2).contiguous().transpose(1, 2), z.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous() and torch.equal(moepack.pack_weight(qt, layout, n_padded=np_, k_padded=kp, zero=zt), want)


def test_pack_experts_int4_cpp_equals_the_spec():
    """pack_experts_int4 (convert's packer, pack_experts) with use_cpp True and False: the same
    tensors, both weights, gate/up halves padded to Ip and interleaved."""
    from moepack.layout import int4_layout_for
    from moepack.pack.registry import get_scheme
    from moepack.schemes.int4 import pack_experts_int4
    from tests.conftest import make_moe_inputs

    inp = make_moe_inputs(tokens=1, hidden=100, intermediate=40, seed=3)
    for g in (32, 64, 128, -1):
        lay = int4_layout_for(g)
        c = get_scheme(lay).from_float(inp.w13, inp.w2, layout=lay)
        for interleaved in (False, True):
            a = pack_experts_int4(c, layout=lay, interleaved=interleaved, use_cpp=True)
            b = pack_experts_int4(c, layout=lay, interleaved=interleaved, use_cpp=False)
            assert a.tensors.keys() == b.tensors.keys()
            for name in a.tensors:
                assert torch.equal(a.tensors[name], b.tensors[name]), (g, interleaved, name)


@pytest.mark.parametrize("edit, exc, match", [
    (lambda q, z: (q.to(torch.int8), z), TypeError,
     r"weight has dtype Char: layout u4g32_n32k8_x86 packs 4-bit codes as uint8, one per byte, 0..15"),
    (lambda q, z: (q.float(), z), TypeError, r"weight has dtype Float: layout u4g32_n32k8_x86 packs 4-bit codes"),
    (lambda q, z: (q, z.to(torch.int32)), TypeError, r"zero has dtype Int: layout u4g32_n32k8_x86's zero points are uint8 0..15"),
    (lambda q, z: (q, z[:, :, :2]), ValueError,
     r"zero has shape \[2, 45, 2\] for weight \[2, 45, 93\]: must be \[2, 45, ng\] \(one zero point per row and K group\) "
     r"with 3 <= ng <= 3 \(layout u4g32_n32k8_x86, group_size 32, K=93 padded to 96\)"),
    (lambda q, z: (q, z[:, :44]), ValueError, r"zero has shape \[2, 44, 3\] for weight \[2, 45, 93\]: must be \[2, 45, ng\]"),
    (lambda q, z: (q, z[0]), ValueError, r"zero has shape \[45, 3\] for weight \[2, 45, 93\]"),
    (lambda q, z: (q, z.index_put_((torch.tensor(1), torch.tensor(44), torch.tensor(2)), torch.tensor(16, dtype=torch.uint8))),
     ValueError, r"zero\[1, 44, 2\] = 16: layout u4g32_n32k8_x86's 4-bit zero points are 0..15"),
    (lambda q, z: (q[0], z), ValueError, r"weight has shape \[45, 93\]: must be 3-D \[E, N, K\]"),
])  # fmt: skip
def test_cpp_u4_packer_refuses_naming_the_tensor_the_value_and_the_rule(edit, exc, match):
    lay = next(x for x in U4 if x.group_size == 32)
    q, z = _u4_case(lay, (2, 45, 93), seed=4)
    q, z = edit(q, z)
    with pytest.raises(exc, match=match):
        moepack.pack_weight(q, lay, zero=z)


def test_cpp_u4_packer_refuses_a_code_out_of_range_naming_the_first_one():
    """Codes >= 16 would be packed masked into a neighbour's value: the C++ packer refuses the
    first one in row-major order (its blocks run on several threads, in any order)."""
    lay = next(x for x in U4 if x.group_size == 128)
    q, z = _u4_case(lay, (3, 70, 133), seed=5)
    q[2, 0, 0] = 255
    q[1, 69, 130] = 16  # last column block of expert 1, in the run with K padding
    q[1, 65, 3] = 17  # whole run of the same block, earlier
    with pytest.raises(ValueError, match=r"weight\[1, 65, 3\] = 17: layout u4g128_n32k8_x86's 4-bit codes are 0..15"):
        moepack.pack_weight(q, lay, zero=z)
    q[1, 65, 3] = 3
    with pytest.raises(ValueError, match=r"weight\[1, 69, 130\] = 16: layout u4g128_n32k8_x86's 4-bit codes are 0..15"):
        moepack.pack_weight(q, lay, zero=z)
    with pytest.raises(LayoutError, match=r"weight\[1, 69, 130\] = 16"):  # through the scheme's packer: a LayoutError
        from moepack.schemes.int4 import pack_u4_codes

        pack_u4_codes(q, z, 128, lay, 96, 136, use_cpp=True)


def test_cpp_packer_refuses_zero_points_for_a_layout_without_them():
    with pytest.raises(ValueError, match=r"zero is given: layout bf16_n32k2_x86 stores bfloat16 codes, and only sub-byte "
                                         r"layouts pad K with zero points"):  # fmt: skip
        moepack.pack_weight(torch.zeros(1, 32, 8), L, zero=torch.zeros(1, 32, 1, dtype=torch.uint8))


MADE_UP = [
    # sub-byte codes of another blocking and another order inside a run (not in LAYOUTS)
    PackedLayout(id=901, name="u4_test_n16k4", weight_dtype="u4", weight_bits=4, group_size=0, block_n=16, k_pack=4,
                 scale_dtype="f32", zero_kind="u4", family="arm", i_align=16, scheme="int4_group", act_modes=("a16",),
                 tensors=(TensorSpec("codes", "", "uint8", "packed"), TensorSpec("scale", "_scale", "float32", "channel"),
                          TensorSpec("zero", "_zero", "uint8", "channel")), code_order=(3, 1, 0, 2)),
    PackedLayout(id=902, name="u4_test_n8k16", weight_dtype="u4", weight_bits=4, group_size=32, block_n=8, k_pack=16,
                 scale_dtype="f32", zero_kind="u4", family="arm", i_align=16, scheme="int4_group", act_modes=("a16",),
                 tensors=(TensorSpec("codes", "", "uint8", "packed"), TensorSpec("scale", "_scale", "float32", "group"),
                          TensorSpec("zero", "_zero", "uint8", "group")),
                 code_order=tuple(15 - j for j in range(16))),
    PackedLayout(id=903, name="bf16_test_n4k8", weight_dtype="bf16", weight_bits=16, group_size=0, block_n=4, k_pack=8,
                 scale_dtype="none", zero_kind="none", family="arm", i_align=8, scheme="dense",
                 tensors=(TensorSpec("codes", "", "bfloat16", "packed"),)),
    PackedLayout(id=904, name="i8_test_n6k2", weight_dtype="i8", weight_bits=8, group_size=0, block_n=6, k_pack=2,
                 scale_dtype="f32", zero_kind="none", family="arm", i_align=6, scheme="int8_channel", act_modes=("a8",),
                 tensors=(TensorSpec("codes", "", "int8", "packed"), TensorSpec("scale", "_scale", "float32", "channel"))),
]  # fmt: skip


@pytest.mark.parametrize("layout", MADE_UP, ids=lambda x: x.name)
@pytest.mark.parametrize("shape", [(2, 13, 21), (1, 17, 35)], ids=lambda s: "x".join(map(str, s)))
def test_pack_codes_serves_a_made_up_layout(layout, shape):
    """A layout of another block_n / k_pack / code_order, declared here only: pack_codes reads
    everything from it (nothing about the u4 nibble order or 32-column blocks is built in)."""
    c = _codes(layout, shape, seed=5)
    packed = pack_codes(layout, c)
    e, n, k = shape
    np_, kp = layout_padded_n(layout, n), layout_padded_k(layout, k)
    want = torch.zeros(e, np_, kp, dtype=torch.int64)
    want[:, :n, :k] = _as_fields(layout, c)
    assert torch.equal(_positions_by_the_layout(layout, packed, np_, kp), want)
    assert torch.equal(_as_fields(layout, unpack_codes(layout, packed, n, k)), _as_fields(layout, c))
    whole = unpack_codes(layout, packed)  # padding included: zeros
    assert whole.shape == (e, np_, kp) and not bool(_as_fields(layout, whole)[:, n:].any() or _as_fields(layout, whole)[:, :, k:].any())


def test_pack_codes_reads_sub_byte_codes_through_the_layouts_own_order():
    """Two layouts that differ only in code_order store the same codes differently, and each
    reads its own back: verify would misread one through the other's order."""
    a, b = MADE_UP[0], dataclasses.replace(MADE_UP[0], id=905, name="u4_test_n16k4_b", code_order=(0, 1, 2, 3))
    c = _codes(a, (1, 16, 8), seed=9)
    pa, pb = pack_codes(a, c), pack_codes(b, c)
    assert not torch.equal(pa, pb)
    assert torch.equal(unpack_codes(a, pa), c) and torch.equal(unpack_codes(b, pb), c)
    assert not torch.equal(unpack_codes(b, pa), c)


@pytest.mark.parametrize("bad, match", [
    (lambda c: c.fill_(16), r"code\[0, 0, 0\] = 16: layout u4g128_n32k8_x86's 4-bit codes are 0..15"),
    (lambda c: c.float(), r"codes have dtype torch.float32: layout u4g128_n32k8_x86 packs 4-bit integer codes"),
    (lambda c: c[0, 0], r"codes have shape \[8\]: must be \[E, N, K\] or \[N, K\]"),
])  # fmt: skip
def test_pack_codes_refuses_naming_the_code_and_the_rule(bad, match):
    from moepack.layout import INT4_LAYOUT

    c = torch.zeros(1, 3, 8, dtype=torch.uint8)
    with pytest.raises(LayoutError, match=match):
        pack_codes(INT4_LAYOUT, bad(c))


def test_pack_codes_refuses_a_padding_that_is_not_whole_blocks():
    with pytest.raises(LayoutError, match=r"n_padded=40 for codes \[1, 33, 7\]: must be a multiple of block_n=32 >= 64"):
        pack_codes(L, torch.zeros(1, 33, 7), n_padded=40)
    with pytest.raises(LayoutError, match=r"not a codes tensor of layout i8_n32k4_x86"):
        unpack_codes("i8_n32k4_x86", torch.zeros(1, 32, 4, dtype=torch.uint8))


def test_verify_reads_sub_byte_codes_through_the_packed_layouts_own_order():
    """verify compares a directory's codes after reading them back with unpack_codes of the
    directory's own layout: a 4-bit layout whose code_order is not the u4 nibble order is read
    right (through the u4 order its codes would come back scrambled)."""
    from moepack.layout import INT4_LAYOUT
    from moepack.pack import PackedExperts
    from moepack.verify.run import unpacked_values

    lay = dataclasses.replace(INT4_LAYOUT, id=906, name="u4g128_test_reversed", code_order=tuple(range(7, -1, -1)))
    e, h, i = 2, 40, 24
    g = torch.Generator().manual_seed(4)
    c13 = torch.randint(0, 16, (e, 2 * 32, 40), generator=g, dtype=torch.uint8)  # already padded: Ip = 32, Kp(H) = 40
    c2 = torch.randint(0, 16, (e, 64, 32), generator=g, dtype=torch.uint8)
    tensors = {"w13": pack_codes(lay, c13), "w2": pack_codes(lay, c2),
               "w13_scale": torch.ones(e, 1, 64), "w13_zero": torch.full((e, 1, 64), 8, dtype=torch.uint8),
               "w2_scale": torch.ones(e, 1, 64), "w2_zero": torch.full((e, 1, 64), 8, dtype=torch.uint8)}  # fmt: skip
    p = PackedExperts(lay, e, h, i, 32, False, tensors)
    assert torch.equal(unpacked_values(p.w13, "w13", p), c13) and torch.equal(unpacked_values(p.w2, "w2", p), c2)
    assert not torch.equal(unpack_codes(INT4_LAYOUT, p.w13), c13)


def test_pack_weight_per_channel_with_an_empty_k_is_no_division_by_zero():
    """A per-channel int4 layout with K = 0 and zero points: one group, an empty packed K (the
    group size is K itself, 0, which once divided the group count and killed the process)."""
    from moepack._ops import ops
    from moepack.layout import layout_get

    lay = layout_get("u4ch_n32k8_x86")
    out = ops().pack_weight(torch.zeros(1, 32, 0, dtype=torch.uint8), lay.id, 0, 0, torch.zeros(1, 32, 1, dtype=torch.uint8))
    assert tuple(out.shape) == (1, 32, 0)
