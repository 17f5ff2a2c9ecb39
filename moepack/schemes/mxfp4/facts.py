"""What an MXFP4 source says about one MoE layer (``LayerSpec.quant`` of the MXFP4 reader,
moepack/sources/mxfp4.py, which fills it; the mxfp4 scheme reads it). A leaf module: the reader
imports it without importing the rest of the scheme."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Mxfp4Facts:
    """One layer's MXFP4 quantization as the checkpoint stores it.

    ``format``: "gpt_oss" (transformers' gpt-oss ``*_blocks`` / ``*_scales``, FORMATS.md §5.1) or
    "mxfp4-pack-quantized" (compressed-tensors ``weight_packed`` / ``weight_scale``, FORMATS.md
    §3.4); ``input_activations``: what the checkpoint meant its activations to be (compressed-
    tensors' arguments), or None; ``shared``: the same facts for a quantized shared expert, or
    None. The group is always 32 K values (OCP MX) and the scale one e8m0 byte."""

    format: str
    input_activations: dict | None = None
    shared: "Mxfp4Facts | None" = None

    @property
    def group_size(self) -> int:
        return 32

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


__all__ = ["Mxfp4Facts"]
