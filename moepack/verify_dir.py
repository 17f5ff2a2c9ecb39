"""``moepack verify DST [--source SRC]``: prove a packed directory intact and equal to its source.

1. Structure: the manifest, every shard header, alignment, shapes against layout math
   (everything ``moepack.open`` checks).
2. Integrity: the sha256 of every tensor's bytes against the manifest (a flipped byte names the
   tensor).
3. With the source: every layer's packed weights unpacked equal the source's weights rounded
   to bf16, exactly; and the packed layer's output on seeded random tokens matches
   ``moepack.reference`` run on the source's own weights.
   int8 layers (scheme int8_channel): the packed codes, scales and column sums equal the
   source's own int8 codes and scales (or, for a dense source quantized by moepack,
   ``quantize_int8_per_channel`` of its weights) exactly; the output matches
   ``moe_reference_int8`` on those codes (1e-5, up to two intermediate-code flips: see
   tests/reference/tolerances.py) and the fp32 reference on the source's weights (3e-2).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .errors import MoepackError
from .pack import pad_intermediate, quantize_int8_per_channel, unpack_weight_reference
from .reference import moe_reference, moe_reference_int8
from .runtime.model import PackedModel, open_packed

CHUNK = 64 << 20


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, streamed in chunks (no second copy of a large tensor)."""
    h = hashlib.sha256()
    flat = t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    n = flat.numel()
    for i in range(0, n, CHUNK):
        h.update(memoryview(flat[i : i + CHUNK].numpy()))
    return h.hexdigest()


@dataclass
class TensorCheck:
    name: str
    file: str
    ok: bool
    detail: str = ""


@dataclass
class LayerCheck:
    index: int
    weights_exact: bool
    rel_err: float
    tol: float
    ok: bool
    detail: str = ""
    rel_err_fp32: float | None = None  # int8 layers: vs the fp32 reference on the source's weights


@dataclass
class VerifyReport:
    path: Path
    tensors: list[TensorCheck] = field(default_factory=list)
    layers: list[LayerCheck] = field(default_factory=list)
    source: str | None = None
    fingerprint_match: bool | None = None

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tensors) and all(layer.ok for layer in self.layers)

    def failures(self) -> list[str]:
        out = [f"tensor {t.name!r} in {t.file}: {t.detail}" for t in self.tensors if not t.ok]
        out += [f"layer {c.index}: {c.detail}" for c in self.layers if not c.ok]
        return out

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "source": self.source,
            "fingerprint_match": self.fingerprint_match,
            "tensors_checked": len(self.tensors),
            "failures": self.failures(),
            "layers": [c.__dict__ for c in self.layers],
        }


def _check_tensors(model: PackedModel, report: VerifyReport, notify) -> None:
    for name, e in model.manifest["tensors"].items():
        digest = tensor_sha256(model.tensor(name))
        ok = digest == e.get("sha256")
        report.tensors.append(
            TensorCheck(name, e["file"], ok, "" if ok else f"sha256 {digest[:16]}… differs from the manifest's {str(e.get('sha256'))[:16]}…")
        )
        notify("tensor", name=name, ok=ok)


INT8_TOL = 1e-5  # vs moe_reference_int8 on the same codes (plus flips)
INT8_FP32_TOL = 3e-2  # vs the fp32 reference on the source's weights (SEMANTICS.md §4, A8)
INT8_FLIPS = 2.0


def _tokens(model: PackedModel, layer_index: int, e: int, h: int, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed + layer_index)
    x = torch.randn(tokens, h, generator=g)
    logits = torch.randn(tokens, e, generator=g)
    k = min(int(model.routing["top_k"]) if model.routing else 2, e)
    w, ids = torch.softmax(logits, -1).topk(k)
    return x, w.contiguous(), ids.to(torch.int32).contiguous()


def _check_layer_int8(model: PackedModel, layer_index: int, canon, tokens: int, seed: int) -> LayerCheck:
    layer = model.layers[layer_index]
    p = layer.packed
    e, h, i, ip = p.num_experts, p.hidden, p.intermediate, p.padded_intermediate
    if canon.w13_q is not None:  # the source's own int8 codes and scales
        q13, s13, q2, s2 = canon.w13_q, canon.w13_scale.float(), canon.w2_q, canon.w2_scale.float()
    else:  # a dense source quantized by moepack: the same quantization, recomputed
        q13, s13 = quantize_int8_per_channel(canon.w13)
        q2, s2 = quantize_int8_per_channel(canon.w2)
    np2 = p.w2.shape[1]

    def padn(v):
        out = v.new_zeros(e, np2)
        out[:, :h] = v
        return out

    checks = {
        "w13 codes": torch.equal(unpack_weight_reference(p.w13, 2 * ip, h, p.layout), pad_intermediate(q13, ip, p.interleaved)),
        "w2 codes": torch.equal(unpack_weight_reference(p.w2, h, ip, p.layout)[:, :, :i], q2)
        and bool((unpack_weight_reference(p.w2, h, ip, p.layout)[:, :, i:] == 0).all()),
        "w13_scale": torch.equal(p.w13_scale, pad_intermediate(s13, ip, p.interleaved)),
        "w2_scale": torch.equal(p.w2_scale, padn(s2)),
        "w13_colsum": torch.equal(p.w13_colsum, pad_intermediate(q13.int().sum(-1, dtype=torch.int32), ip, p.interleaved)),
        "w2_colsum": torch.equal(p.w2_colsum, padn(q2.int().sum(-1, dtype=torch.int32))),
    }
    exact = all(checks.values())
    x, w, ids = _tokens(model, layer_index, e, h, tokens, seed)
    out = layer.experts(x, w, ids)
    kw = dict(activation=layer.activation, alpha=layer.alpha, limit=layer.limit, w13_bias=canon.w13_bias, w2_bias=canon.w2_bias)
    ref, flip = moe_reference_int8(x, q13, s13, q2, s2, w, ids, return_flip=True, **kw)
    norm = float(ref.norm().clamp_min(1e-30))
    rel = float((out - ref).norm()) / norm
    tol = max(INT8_TOL, INT8_FLIPS * flip / norm)
    ref32 = moe_reference(x, canon.w13, canon.w2, w, ids, **kw)
    rel32 = float((out - ref32).norm() / ref32.norm().clamp_min(1e-30))
    ok = exact and rel <= tol and rel32 <= INT8_FP32_TOL
    detail = []
    if not exact:
        detail.append("packed int8 tensors differ from the source's codes/scales: " + ", ".join(k for k, v in checks.items() if not v))
    if rel > tol:
        detail.append(f"output differs from the int8 reference: relative error {rel:.3g} > {tol:.3g}")
    if rel32 > INT8_FP32_TOL:
        detail.append(f"output differs from the fp32 reference on the source's weights: {rel32:.3g} > {INT8_FP32_TOL:g}")
    return LayerCheck(layer_index, exact, rel, tol, ok, "; ".join(detail), rel32)


def _check_layer(model: PackedModel, layer_index: int, ckpt, reader, spec, tokens: int, seed: int) -> LayerCheck:
    layer = model.layers[layer_index]
    p = layer.packed
    canon = reader.read_layer(ckpt, spec)
    if p.layout.quantized:
        return _check_layer_int8(model, layer_index, canon, tokens, seed)
    e, h, i = p.num_experts, p.hidden, p.intermediate
    # exact weights: unpack(packed) == source rounded to bf16, padding included
    w13_want = pad_intermediate(canon.w13.to(torch.bfloat16), p.padded_intermediate, p.interleaved)
    w13_got = unpack_weight_reference(p.w13, 2 * p.padded_intermediate, h, p.layout)
    w2_got = unpack_weight_reference(p.w2, h, p.padded_intermediate, p.layout)
    exact = torch.equal(w13_got.view(torch.int16), w13_want.view(torch.int16)) and torch.equal(
        w2_got[:, :, :i].contiguous().view(torch.int16), canon.w2.to(torch.bfloat16).view(torch.int16)
    )
    exact = exact and bool((w2_got[:, :, i:] == 0).all())
    # numerics on seeded tokens against the fp32 reference on the source's own weights
    x, w, ids = _tokens(model, layer_index, e, h, tokens, seed)
    out = layer.experts(x, w, ids)
    ref = moe_reference(
        x,
        canon.w13,
        canon.w2,
        w,
        ids,
        activation=layer.activation,
        alpha=layer.alpha,
        limit=layer.limit,
        w13_bias=canon.w13_bias,
        w2_bias=canon.w2_bias,
    )
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    # bf16 sources are packed exactly, so fp32 tokens agree to fp32 rounding; fp16/fp32 sources
    # are rounded to bf16 when packed (SEMANTICS.md §3 dense), which bounds the error at ~1e-2.
    tol = 1e-5 if spec.dtype == "BF16" else 1e-2
    ok = exact and rel <= tol
    detail = []
    if not exact:
        detail.append("unpacked weights differ from the source rounded to bf16")
    if rel > tol:
        detail.append(f"output differs from the reference: relative error {rel:.3g} > {tol:g}")
    return LayerCheck(layer_index, exact, rel, tol, ok, "; ".join(detail))


def verify(
    dst: str | Path,
    *,
    source: str | Path | None = None,
    tokens: int = 7,
    seed: int = 0,
    progress: Callable | None = None,
) -> VerifyReport:
    """Verify the packed directory at ``dst``; see the module docstring."""
    notify = progress or (lambda *a, **k: None)
    model = open_packed(dst)
    report = VerifyReport(path=Path(dst))
    _check_tensors(model, report, notify)
    if source is not None:
        from .sources import open_source

        ckpt, reader = open_source(source)
        report.source = str(source)
        report.fingerprint_match = ckpt.fingerprint() == model.manifest["source"].get("fingerprint")
        specs = {s.index: s for s in reader.layers(ckpt)}
        for idx in sorted(model.layers):
            if idx not in specs:
                raise MoepackError(f"layer {idx} of {dst} has no MoE layer in the source {source}")
            report.layers.append(_check_layer(model, idx, ckpt, reader, specs[idx], tokens, seed))
            notify("layer", index=idx, ok=report.layers[-1].ok)
    return report


__all__ = ["verify", "VerifyReport", "tensor_sha256"]
