"""nvfp4 experts (layout nv4g16_n32k8_x86, SEMANTICS.md §3 "nvfp4": W4A16 and W4A8).

Trust chain, one level per section:
* the codes: every (e2m1 code, e4m3 scale byte) pair under several globals, both conventions
  (compressed-tensors' divisor, ModelOpt's multiplier), against compressed-tensors 0.20.1's own
  ``NVFP4PackedCompressor.decompress`` (bf16, as it returns) and its fp32 ``dequantize``, and
  against the ModelOpt formula as vLLM's ``dequantize_to_dtype`` computes it (fp32(e4m3 * s2),
  then times e2m1), bit for bit;
* the quantizer: compressed-tensors' own ``generate_gparam`` + ``calculate_qparams`` +
  ``NVFP4PackedCompressor.compress`` on the same weights give our codes, scale bytes and global
  scale bit for bit; its error;
* the packer: codes where the layout puts them, scale bytes and globals in packed row order, 0 in
  padding, the spec packer's bytes equal to the C++ packer's, refusals of bad canonical tensors;
* the oracle: A16 is the dense reference on the exact weights; A8 the exact per-group integer
  sums on 2 * e2m1(q) times s / 2, and within SEMANTICS.md §4's 3e-2 of the fp32 pipeline.
"""

from __future__ import annotations

import pytest
import torch

from moepack.errors import LayoutError
from moepack.layout import NVFP4_LAYOUT, layout_get, layout_padded_i, layout_padded_k, layout_padded_n
from moepack.pack import unpack_codes
from moepack.reference import moe_reference
from moepack.schemes import get_scheme
from moepack.schemes.nvfp4 import (
    NVFP4_A8_FP32_TOL,
    check_nvfp4_canonical,
    dequantize_nvfp4,
    group_scales,
    moe_reference_nvfp4,
    nvfp4_linear_a8_reference,
    pack_experts_nvfp4,
    quantize_nvfp4,
)
from moepack.schemes.mxfp4 import E2M1_VALUES
from tests.conftest import make_moe_inputs

SCHEME = get_scheme("nvfp4")
LAY = NVFP4_LAYOUT
# every e4m3fn byte a scale may hold: sign bit clear, not NaN (0x7F)
SCALE_BYTES = torch.tensor([b for b in range(0x7F)], dtype=torch.uint8)
GLOBALS = (1.0, 3.0, 1e-3, 12345.678, 2688.0 / 0.0137, 7.3e-9, 4.1e6)


def all_pairs(glob: float):
    """Codes [n, 16] (each row codes 0..15) and scale bytes [n, 1]: every (code, byte) pair once."""
    n = SCALE_BYTES.numel()
    q = torch.arange(16, dtype=torch.uint8).repeat(n, 1)
    return q, SCALE_BYTES.reshape(n, 1).clone(), torch.full((n,), glob, dtype=torch.float32)


def ct_scheme():
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4

    return QuantizationScheme(targets=["Linear"], **NVFP4)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


# --------------------------------------------------------------------------- the codes


@pytest.mark.parametrize("glob", GLOBALS)
def test_every_pair_equals_compressed_tensors_decompress(glob):
    """compressed-tensors' divisor: its decompress (bf16 out) and its fp32 dequantize, bit for bit."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    q, s, g = all_pairs(glob)
    ours = dequantize_nvfp4(q, s, g)
    gs = torch.tensor([glob], dtype=torch.float32)
    sd = {"weight_packed": pack_nibbles(q), "weight_scale": s.view(torch.float8_e4m3fn), "weight_global_scale": gs}
    theirs = NVFP4PackedCompressor.decompress(sd, ct_scheme())["weight"]
    assert theirs.dtype == torch.bfloat16 and torch.equal(ours.to(torch.bfloat16), theirs)
    x32 = unpack_fp4_from_uint8(pack_nibbles(q), q.shape[0], 16, dtype=torch.float32)
    t32 = dequantize(x_q=x32, scale=s.view(torch.float8_e4m3fn).float(), args=ct_scheme().weights, dtype=torch.float32,
                     global_scale=gs)  # fmt: skip
    assert torch.equal(ours, t32)


@pytest.mark.parametrize("m", [1.0, 0.75, 1 / 2688.0, 3.7e-5, 0.0137 / 2688.0, 250.5])
def test_every_pair_equals_the_modelopt_formula(m):
    """ModelOpt's multiplier (stored negated): w = e2m1 * fp32(e4m3 * weight_scale_2), vLLM's
    dequantize_to_dtype order, computed here from the bit fields and e4m3's own torch cast."""
    q, s, _ = all_pairs(1.0)
    g = torch.full((q.shape[0],), -m, dtype=torch.float32)
    ours = dequantize_nvfp4(q, s, g)
    sf = s.view(torch.float8_e4m3fn).to(torch.float32) * torch.tensor(m, dtype=torch.float32)
    e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)[q.long()]
    assert torch.equal(ours, e2m1 * sf)


def test_group_scales_are_one_fp32_rounding_each_way():
    v = SCALE_BYTES.view(torch.float8_e4m3fn).double()
    for g in GLOBALS:
        s = group_scales(SCALE_BYTES[None], torch.tensor([g]))[0]
        assert torch.equal(s, (v / torch.tensor(g, dtype=torch.float32).double()).float())
        s = group_scales(SCALE_BYTES[None], torch.tensor([-g]))[0]
        assert torch.equal(s, (v * torch.tensor(g, dtype=torch.float32).double()).float())


# --------------------------------------------------------------------------- the quantizer


def ct_compress(w: torch.Tensor):
    """compressed-tensors' own NVFP4 of one fp32 weight: its global scale, its group scales (from
    each group's amax through calculate_qparams), its compressor."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    sch = ct_scheme()
    gs = generate_gparam(w.amin(), w.amax())
    grp = w.unflatten(-1, (-1, 16))
    scale, _ = calculate_qparams(grp.amin(-1), grp.amax(-1), sch.weights, global_scale=gs)
    return NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs}, sch)


@pytest.mark.parametrize("seed,shape,kind", [(0, (64, 128), "normal"), (1, (48, 256), "t3"), (2, (32, 64), "zeros"),
                                             (3, (16, 32), "tiny")])  # fmt: skip
def test_our_quantizer_is_compressed_tensors_bit_for_bit(seed, shape, kind):
    from moepack.sources.mxfp4 import unpack_e2m1

    torch.manual_seed(seed)
    w = torch.randn(shape) * 0.02
    if kind == "t3":
        w = torch.distributions.StudentT(3.0).sample(shape) * 0.01
    elif kind == "zeros":
        w[3, :16] = 0
        w[5] = 0
    elif kind == "tiny":
        w = w * 1e-30
    out = ct_compress(w)
    q, s, g = quantize_nvfp4(w)
    assert torch.equal(q, unpack_e2m1(out["weight_packed"]))
    assert torch.equal(s, out["weight_scale"].view(torch.uint8))
    assert torch.equal(g, out["weight_global_scale"].expand(shape[0]))


def test_quantizer_per_expert_globals_and_error():
    torch.manual_seed(5)
    w = torch.randn(3, 64, 256) * torch.tensor([1.0, 1e-3, 40.0]).reshape(3, 1, 1)
    q, s, g = quantize_nvfp4(w)
    assert q.shape == w.shape and s.shape == (3, 64, 16) and g.shape == (3, 64)
    assert all(torch.unique(g[e]).numel() == 1 for e in range(3)) and torch.unique(g).numel() == 3
    deq = dequantize_nvfp4(q, s, g)
    rel = float((deq - w).norm() / w.norm())
    assert 0.05 < rel < 0.12, rel  # Gaussian weights: ~0.10 (quantize.py)


@pytest.mark.parametrize("w,match", [(torch.tensor([[float("nan")] * 16]), "finite"), (torch.zeros(16), r"\[\.\.\., N, K\]"),
                                     (torch.zeros(2, 16, dtype=torch.int32), "dtype")])  # fmt: skip
def test_quantizer_refuses(w, match):
    with pytest.raises(LayoutError, match=match):
        quantize_nvfp4(w)


# --------------------------------------------------------------------------- the packer


def canonical(e=3, h=64, i=48, seed=0, modelopt_half=False):
    torch.manual_seed(seed)
    q13, s13, g13 = quantize_nvfp4(torch.randn(e, 2 * i, h))
    q2, s2, g2 = quantize_nvfp4(torch.randn(e, h, i))
    if modelopt_half:  # ModelOpt's convention on the up half: multipliers, negated
        g13[:, i:] = -(1.0 / g13[:, i:])
    return {"w13_q": q13, "w13_scale": s13, "w13_global": g13, "w2_q": q2, "w2_scale": s2, "w2_global": g2}


@pytest.mark.parametrize("interleaved,h,i,lay", [(False, 64, 48, "nv4g16_n32k8_x86"), (True, 80, 40, "nv4g16_n32k8_x86"),
                                                 (False, 48, 72, "nv4g16_n16k8_arm")])  # fmt: skip
def test_codes_scales_and_globals_sit_where_the_layout_says(interleaved, h, i, lay):
    lay = layout_get(lay)
    c = canonical(h=h, i=i, modelopt_half=True)
    for use_cpp in (False, True):
        p = pack_experts_nvfp4(c, interleaved=interleaved, layout=lay, use_cpp=use_cpp)
        ip = layout_padded_i(lay, i)
        kp13, np2, kp2 = layout_padded_k(lay, h), layout_padded_n(lay, h), layout_padded_k(lay, ip)
        assert p.tensors["w13_scale"].shape == (3, kp13 // 16, 2 * ip) and p.tensors["w13_global"].shape == (3, 2 * ip)
        assert p.tensors["w2_scale"].shape == (3, kp2 // 16, np2) and p.tensors["w2_global"].shape == (3, np2)
        rows = list(range(2 * i)) if interleaved else list(range(i)) + list(range(ip, ip + i))
        codes13 = unpack_codes(lay, p.tensors["w13"], 2 * ip, kp13)
        assert torch.equal(codes13[:, rows, :h], c["w13_q"])
        assert not codes13[:, :, h:].any() and not codes13[:, [r for r in range(2 * ip) if r not in rows]].any()
        assert torch.equal(p.tensors["w13_scale"][:, : h // 16, rows].transpose(1, 2), c["w13_scale"])
        assert torch.equal(p.tensors["w13_global"][:, rows], c["w13_global"])
        pad = [r for r in range(2 * ip) if r not in rows]
        assert not p.tensors["w13_global"][:, pad].any() and not p.tensors["w13_scale"][:, :, pad].any()
        codes2 = unpack_codes(lay, p.tensors["w2"], np2, kp2)
        assert torch.equal(codes2[:, :h, :i], c["w2_q"]) and not codes2[:, h:].any() and not codes2[:, :, i:].any()
        assert torch.equal(p.tensors["w2_global"][:, :h], c["w2_global"]) and not p.tensors["w2_global"][:, h:].any()
    a = pack_experts_nvfp4(c, interleaved=interleaved, layout=lay, use_cpp=False)
    b = pack_experts_nvfp4(c, interleaved=interleaved, layout=lay, use_cpp=True)
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_scales_are_an_eighth_of_the_codes():
    p = pack_experts_nvfp4(canonical(h=128, i=64))
    assert p.tensors["w13_scale"].numel() * 8 == p.tensors["w13"].numel()


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(w13_scale=c["w13_scale"].clone().index_fill_(2, torch.tensor([1]), 0x7F)), r"w13_scale'\[0, 0, 1\] = 0x7f: an e4m3 NaN"),
    (lambda c: c.update(w2_scale=c["w2_scale"].clone().index_fill_(2, torch.tensor([2]), 0xB8)), r"w2_scale'\[0, 0, 2\] = 0xb8 \(-1.0\): a negative"),
    (lambda c: c.update(w2_scale=c["w2_scale"].clone().index_fill_(2, torch.tensor([2]), 0x80)), r"= 0x80 \(-0.0\): a negative"),
    (lambda c: c["w13_global"].__setitem__((1, 5), 0.0), r"w13_global'\[1, 5\] = 0.0: NVFP4 global scales must be finite and nonzero"),
    (lambda c: c["w2_global"].__setitem__((2, 0), float("inf")), r"w2_global'\[2, 0\] = inf"),
    (lambda c: c.update(w13_scale=c["w13_scale"][:, :, :-1]), r"w13_scale has shape \[3, 96, 3\]: must be \[3, 96, 4\]"),
    (lambda c: c.update(w2_global=c["w2_global"][:, :-1]), r"w2_global has shape \[3, 63\]: must be \[3, 64\]"),
    (lambda c: c.update(w13_q=c["w13_q"].clone().index_fill_(2, torch.tensor([0]), 16)), r"w13_q\[0, 0, 0\] = 16"),
])  # fmt: skip
def test_pack_refuses_bad_canonical_tensors(edit, match):
    c = canonical()
    edit(c)
    with pytest.raises(LayoutError, match=match):
        pack_experts_nvfp4(c)


# --------------------------------------------------------------------------- the oracle


def test_a16_reference_is_the_dense_reference_on_the_exact_weights():
    c = canonical(modelopt_half=True)
    inp = make_moe_inputs(tokens=5, hidden=64, intermediate=48, experts=3, topk=2, seed=1)
    out = moe_reference_nvfp4(inp.x, c, inp.topk_weights, inp.topk_ids)
    w13, w2 = SCHEME.dequantize(c)
    assert torch.equal(out, moe_reference(inp.x, w13, w2, inp.topk_weights, inp.topk_ids))


def test_a8_linear_is_the_exact_integer_sum_per_group():
    c = canonical(modelopt_half=True)
    torch.manual_seed(2)
    xq = torch.randint(-127, 128, (4, 64), dtype=torch.int8)
    xs = torch.rand(4, 1) * 0.01
    out = nvfp4_linear_a8_reference(xq, xs, c["w13_q"][1], c["w13_scale"][1], c["w13_global"][1], None)
    ints = torch.tensor(E2M1_VALUES).mul(2)[c["w13_q"][1].long()].long()  # exact integers -12..12
    s = group_scales(c["w13_scale"][1], c["w13_global"][1]) * 0.5
    want = torch.zeros(4, 96)
    for g in range(4):
        acc = xq[:, 16 * g : 16 * g + 16].long() @ ints[:, 16 * g : 16 * g + 16].t()
        want = want + acc.float() * s[:, g]
    assert torch.equal(out, want * xs)


def test_a8_reference_against_the_fp32_pipeline():
    c = canonical(h=128, i=64, seed=3)
    inp = make_moe_inputs(tokens=9, hidden=128, intermediate=64, experts=3, topk=2, seed=3)
    a16 = moe_reference_nvfp4(inp.x, c, inp.topk_weights, inp.topk_ids)
    a8 = moe_reference_nvfp4(inp.x, c, inp.topk_weights, inp.topk_ids, act_mode="a8")
    rel = float((a8 - a16).norm() / a16.norm())
    assert 0 < rel < NVFP4_A8_FP32_TOL, rel


def test_check_canonical_accepts_both_conventions():
    c = canonical(modelopt_half=True)
    assert (c["w13_global"] < 0).any() and (c["w13_global"] > 0).any()
    check_nvfp4_canonical("w13", c["w13_q"], c["w13_scale"], c["w13_global"])
