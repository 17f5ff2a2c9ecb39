"""Source readers: one per input format, found through a registry.

A reader answers ``detect(ckpt) -> (ok, reason)`` from config.json and the headers alone, and
``layers(ckpt)`` / ``read_layer(ckpt, spec)`` produce the canonical per-layer form
(``CanonicalLayer``) that every packer consumes. Adding a format touches this folder only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch  # noqa: F401  (annotations)

from ..errors import SourceError
from .checkpoint import Checkpoint, TensorInfo
from .dense import CanonicalLayer, LayerSpec, discover_layers, mtp_skipped, read_biases, read_expert_w2, read_expert_w13, read_layer, read_shared, text_config


@dataclass(frozen=True)
class SourceReader:
    name: str
    detect: Callable[[Checkpoint], tuple[bool, str]]
    layers: Callable[[Checkpoint], list[LayerSpec]]
    read_layer: Callable[[Checkpoint, LayerSpec], CanonicalLayer]
    read_expert_w13: Callable[[Checkpoint, LayerSpec, int], "torch.Tensor"]
    read_expert_w2: Callable[[Checkpoint, LayerSpec, int], "torch.Tensor"]
    read_biases: Callable[[Checkpoint, LayerSpec], tuple]
    read_shared: Callable[[Checkpoint, LayerSpec], tuple | None]
    # What the expert weights mean (docs/SEMANTICS.md §3): a scheme name of moepack.schemes,
    # "dense" (float values) or a quantized one, whose canonical tensors (Scheme.canonical) the
    # two functions below read as they are stored (the float readers above dequantize them).
    scheme: str = "dense"
    # (ckpt, spec, "w13" | "w2", expert) -> {canonical name: tensor of that expert}
    read_expert_canonical: Callable[[Checkpoint, LayerSpec, str, int], dict] | None = None
    # (ckpt, spec) -> the shared expert's canonical tensors as a one-expert set, or None
    read_shared_canonical: Callable[[Checkpoint, LayerSpec], dict | None] | None = None
    # what the stored weights are, in words (the manifest's scheme_source); "": the scheme says it
    weights_note: str = ""
    # (ckpt) -> (source tensors convert leaves out deliberately, why): neither packed nor carried
    # over; the manifest's source.skipped records them. Every reader skips DeepSeek's MTP layers;
    # open_source hands out the reader with ``layers`` leaving out the layers skipped here.
    skipped: Callable[[Checkpoint], tuple[list, str]] = mtp_skipped


def _detect_dense(ckpt: Checkpoint) -> tuple[bool, str]:
    qc = text_config(ckpt.config).get("quantization_config") or ckpt.config.get("quantization_config")
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        return False, f"config.json has quantization_config (quant_method={method!r}): not a dense checkpoint"
    return True, "no quantization_config: dense weights"


def _ct_reader() -> SourceReader:
    from . import compressed_tensors as ct

    return SourceReader(
        "compressed-tensors",
        ct.detect,
        ct.layers,
        ct.read_layer,
        ct.read_expert_w13,
        ct.read_expert_w2,
        ct.read_biases,
        ct.read_shared,
        scheme=ct.SCHEME,
        read_expert_canonical=ct.read_expert_canonical,
        read_shared_canonical=ct.read_shared_canonical,
        weights_note=ct.SOURCE_NOTE,
    )


def _int4_reader(mod) -> SourceReader:
    r = mod.READER
    return SourceReader(
        r.name,
        r.detect,
        r.layers,
        r.read_layer,
        r.read_expert_w13,
        r.read_expert_w2,
        r.read_biases,
        r.read_shared,
        scheme=r.scheme,
        read_expert_canonical=r.read_expert_canonical,
        read_shared_canonical=r.read_shared_canonical,
    )


def _fp8_readers() -> list[SourceReader]:
    from . import fp8

    def reader(name, detect, note):
        return SourceReader(name, detect, fp8.layers, fp8.read_layer, fp8.read_expert_w13, fp8.read_expert_w2,
                            fp8.read_biases, fp8.read_shared, scheme=fp8.SCHEME,
                            read_expert_canonical=fp8.read_expert_canonical, read_shared_canonical=fp8.read_shared_canonical,
                            weights_note=note)  # fmt: skip

    return [reader("fp8-block", fp8.detect_block_fp8, fp8.DEEPSEEK_NOTE),
            reader("compressed-tensors-float-quantized", fp8.detect_float_quantized, fp8.CT_NOTE)]  # fmt: skip


def _mxfp4_readers() -> list[SourceReader]:
    from . import mxfp4

    def reader(name, detect, note):
        return SourceReader(name, detect, mxfp4.layers, mxfp4.read_layer, mxfp4.read_expert_w13, mxfp4.read_expert_w2,
                            mxfp4.read_biases, mxfp4.read_shared, scheme=mxfp4.SCHEME,
                            read_expert_canonical=mxfp4.read_expert_canonical, read_shared_canonical=mxfp4.read_shared_canonical,
                            weights_note=note)  # fmt: skip

    return [reader("mxfp4-gpt-oss", mxfp4.detect_gpt_oss, mxfp4.GPT_OSS_NOTE),
            reader("compressed-tensors-mxfp4-pack-quantized", mxfp4.detect_ct, mxfp4.CT_NOTE)]  # fmt: skip


def _int4_readers() -> list[SourceReader]:
    from . import awq, ct_pack_quantized, gptq

    return [_int4_reader(m) for m in (ct_pack_quantized, gptq, awq)]


READERS: list[SourceReader] = [
    _ct_reader(),
    *_int4_readers(),  # scheme int4_group (sources/int4_common.py): compressed-tensors pack-quantized, GPTQ, AWQ GEMM
    *_fp8_readers(),  # scheme fp8_block (sources/fp8.py): DeepSeek/Qwen block FP8, compressed-tensors float-quantized
    *_mxfp4_readers(),  # scheme mxfp4 (sources/mxfp4.py): gpt-oss MXFP4, compressed-tensors mxfp4-pack-quantized
    SourceReader("dense", _detect_dense, discover_layers, read_layer, read_expert_w13, read_expert_w2, read_biases, read_shared),
]


def _without_skipped(r: SourceReader) -> Callable[[Checkpoint], list[LayerSpec]]:
    """``r.layers`` less the layers whose expert tensors ``r.skipped`` leaves out."""

    def layers(ckpt: Checkpoint) -> list[LayerSpec]:
        drop = set(r.skipped(ckpt)[0])
        return [s for s in r.layers(ckpt) if not drop.intersection(s.expert_tensors)]

    return layers


def open_source(path) -> tuple[Checkpoint, SourceReader]:
    """The checkpoint at ``path`` and the reader that handles it (or a SourceError saying why none does)."""
    ckpt = Checkpoint(path)
    reasons = []
    for r in READERS:
        ok, why = r.detect(ckpt)
        if ok:
            return ckpt, dataclasses.replace(r, layers=_without_skipped(r))
        reasons.append(f"{r.name}: {why}")
    raise SourceError(f"source {ckpt.path}: no reader handles it ({'; '.join(reasons)})")


__all__ = ["Checkpoint", "TensorInfo", "CanonicalLayer", "LayerSpec", "SourceReader", "READERS", "open_source", "text_config"]
