"""Scheme ``toy``: a test-only weight scheme (README.md here), registered end to end.

Meaning: one-byte codes ``q`` (0..255) and one bf16 scale per (K group of 24, output channel),
``w[n, k] = (q[n, k] - 128) * s[n, k // 24]``; activations in their own dtype (A16).

Canonical tensors: ``w13_q`` [E, 2I, H] / ``w2_q`` [E, H, I] uint8 codes, ``w13_scale`` /
``w2_scale`` bfloat16 [E, N, ceil(K / 24)]. ``quantize_toy`` makes them from float weights:
per (channel, group) ``s = bf16(amax / 127)`` and ``q = clamp(round(w / s), -127, 127) + 128``
(an all-zero group gets scale 0 and codes 128). Packed (``toy_u8g24_n16k4_portable``, layouts.py):
the codes through moepack.pack.pack_codes with every padding code 128 (value 0), the scales
transposed to [E, ceil(Kp / 24), Np] with 0 in padding.

Loaded by moepack.schemes (by path) only when MOEPACK_TEST_SCHEMES=1 was set before moepack was
imported; it registers itself like any scheme, through its ``QuantSpec``.
"""

from __future__ import annotations

import torch

from moepack.errors import LayoutError
from moepack.layout import layout_expert_shapes, layout_get, layout_padded_i, layout_padded_k, layout_padded_n
from moepack.pack import PackedExperts, expert_dims, pack_biases, pack_codes, pad_intermediate, with_biases
from moepack.reference import moe_reference
from moepack.schemes.quantized import QuantSpec, quantized_scheme

SCHEME = "toy"
LAYOUT = "toy_u8g24_n16k4_portable"
GROUP = 24  # layouts.py TOY_GROUP
ZERO_CODE = 128  # the code of value 0: every padding code
# The kernel against toy_reference on the same codes: the same dequantized weights, fp32
# summation order only (the C++ codec decodes q - 128 exactly and scales each group's sum).
TOY_TOL = 1e-5
# A float source quantized by quantize_toy: 8-bit codes per group of 24 put Gaussian weights
# within ~0.01 of themselves (Frobenius, relative); two GEMMs within ~0.02. The bound catches a
# wrong scale or a code off by its offset (both far larger).
TOY_FROM_FLOAT_TOL = 0.05


def _group_scales(scale: torch.Tensor, k: int) -> torch.Tensor:
    """[E, N, ceil(K / 24)] scales -> fp32 [E, N, K], each repeated over its group."""
    return scale.float().repeat_interleave(GROUP, dim=-1)[..., :k]


def quantize_toy(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights [E, N, K] -> (uint8 codes [E, N, K], bf16 scales [E, N, ceil(K / 24)])."""
    e, n, k = w.shape
    ng = -(-k // GROUP)
    wf = torch.zeros(e, n, ng * GROUP, dtype=torch.float32)
    wf[..., :k] = w.float()
    amax = wf.view(e, n, ng, GROUP).abs().amax(dim=-1)
    scale = (amax / 127).to(torch.bfloat16)
    s = _group_scales(scale, k)
    q = torch.where(s > 0, torch.round(w.float() / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
    return (q + ZERO_CODE).to(torch.uint8), scale


def dequantize_toy(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Canonical codes and scales -> fp32 weights: (q - 128) * s."""
    return (q.float() - ZERO_CODE) * _group_scales(scale, q.shape[-1])


def check_toy_canonical(weight: str, q: torch.Tensor, scale: torch.Tensor) -> None:
    e, n, k = q.shape
    want = (e, n, -(-k // GROUP))
    if q.dtype != torch.uint8 or scale.dtype != torch.bfloat16 or tuple(scale.shape) != want:
        raise LayoutError(f"{weight}: toy canonical tensors are uint8 codes [E, N, K] and bf16 scales {list(want)}; got "
                          f"{q.dtype} {list(q.shape)} and {scale.dtype} {list(scale.shape)}")  # fmt: skip


def pack_toy_weight(weight: str, q: torch.Tensor, scale: torch.Tensor, *, interleaved: bool = False, layout=LAYOUT,
                    use_cpp: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """One weight's canonical tensors ("w13" [E, 2I, H] or "w2" [E, H, I]) -> {weight: codes,
    weight_scale: [E, ceil(Kp / 24), Np] bf16} in packed row order (``use_cpp`` unused: the
    specification packer, pack_codes, is the only one)."""
    lay = layout_get(layout)
    check_toy_canonical(weight, q, scale)
    e, n, k = q.shape
    if weight == "w13":
        ip = layout_padded_i(lay, n // 2)
        q, scale = pad_intermediate(q.int() - ZERO_CODE, ip, interleaved) + ZERO_CODE, pad_intermediate(scale, ip, interleaved)
        np_, kp = 2 * ip, layout_padded_k(lay, k)
    else:
        np_, kp = layout_padded_n(lay, n), layout_padded_k(lay, layout_padded_i(lay, k))
    codes = torch.full((e, np_, kp), ZERO_CODE, dtype=torch.uint8)
    codes[:, : q.shape[1], :k] = q
    scales = torch.zeros(e, -(-kp // GROUP), np_, dtype=torch.bfloat16)
    scales[:, : scale.shape[2], : scale.shape[1]] = scale.transpose(1, 2)
    return {weight: pack_codes(lay, codes, n_padded=np_, k_padded=kp), f"{weight}_scale": scales}


def pack_experts_toy(c: dict, *, interleaved: bool = False, layout=None, use_cpp: bool = True) -> PackedExperts:
    """Canonical toy experts (w13_q / w13_scale / w2_q / w2_scale, optional biases) -> PackedExperts."""
    lay = layout_get(layout or LAYOUT)
    if lay.scheme != SCHEME:
        raise LayoutError(f"layout {lay.name} has scheme {lay.scheme}: pack_experts_toy packs {SCHEME} layouts")
    e, h, i = expert_dims(c["w13_q"], c["w2_q"])
    shapes = layout_expert_shapes(lay, e, h, i)
    b13, b2 = pack_biases(c.get("w13_bias"), c.get("w2_bias"), e, h, i, interleaved, lay)
    tensors = pack_toy_weight("w13", c["w13_q"], c["w13_scale"], interleaved=interleaved, layout=lay)
    tensors.update(pack_toy_weight("w2", c["w2_q"], c["w2_scale"], layout=lay))
    assert tuple(tensors["w13"].shape) == shapes.w13_shape and tuple(tensors["w2"].shape) == shapes.w2_shape
    return PackedExperts(layout=lay, num_experts=e, hidden=h, intermediate=i, padded_intermediate=shapes.padded_intermediate,
                         interleaved=interleaved, tensors=with_biases(tensors, b13, b2))  # fmt: skip


def toy_reference(hidden_states, c: dict, topk_weights, topk_ids, *, return_flip: bool = False, **kw):
    """The torch oracle: moe_reference (fp32) on the exactly dequantized weights; a16 only."""
    mode = kw.pop("act_mode", "a16")
    if mode != "a16":
        raise ValueError(f"act_mode={mode!r}: the toy scheme runs with a16 activations only")
    w13 = dequantize_toy(c["w13_q"], c["w13_scale"])
    w2 = dequantize_toy(c["w2_q"], c["w2_scale"])
    out = moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, **kw)
    return (out, 0.0) if return_flip else out


TOY = quantized_scheme(
    QuantSpec(
        name=SCHEME,
        short="toy",
        canonical=("w13_q", "w13_scale", "w2_q", "w2_scale"),
        quantize=lambda w, g, opts: dict(zip(("q", "scale"), quantize_toy(w))),
        dequantize=lambda d, g: dequantize_toy(d["q"], d["scale"]),
        pack_weight=pack_toy_weight,
        stored="toy_u8 codes and bf16 scales",
        quantizer="quantize_toy",
        quantizer_rule="amax/127 per 24 K in bf16, codes offset by 128",
        float_note="toy: u8 codes offset 128, bf16 scale per 24 K (test-only scheme)",
        tol=TOY_TOL,
        fp32_tol=TOY_FROM_FLOAT_TOL,
    ),
    summary="test-only: u8 codes offset 128 + bf16 scale per (K group of 24, channel); W8A16",
    pack=pack_experts_toy,
    reference=toy_reference,
    default_layout=LAYOUT,
    weights_note="toy_u8 codes",
)
