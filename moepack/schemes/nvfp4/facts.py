"""What an NVFP4 source says about one MoE layer (``LayerSpec.quant`` of the NVFP4 reader,
moepack/sources/nvfp4.py, which fills it; the nvfp4 scheme reads it). A leaf module: the reader
imports it without importing the rest of the scheme."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Nvfp4Facts:
    """One layer's NVFP4 quantization as the checkpoint stores it.

    ``format``: "nvfp4-pack-quantized" (compressed-tensors ``weight_packed`` / ``weight_scale`` /
    ``weight_global_scale``, a divisor) or "modelopt" (NVIDIA ModelOpt ``weight`` / ``weight_scale``
    / ``weight_scale_2``, a multiplier), FORMATS.md §3.4 / §5.5; ``input_activations``: what the
    checkpoint meant its activations to be (compressed-tensors' arguments, or ModelOpt's NVFP4
    activations), or None; moepack runs them in 16 bits (or int8 with ``--act-mode a8``), never
    in FP4; ``shared``: the same facts for a quantized shared expert, or None. The group is always
    16 K values and the group scale one e4m3fn byte."""

    format: str
    input_activations: dict | None = None
    shared: "Nvfp4Facts | None" = None

    @property
    def group_size(self) -> int:
        return 16

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


__all__ = ["Nvfp4Facts"]
