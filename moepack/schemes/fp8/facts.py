"""What an FP8 source says about one MoE layer (``LayerSpec.quant`` of the FP8 reader,
moepack/sources/fp8.py, which fills it; the fp8_block scheme reads it). A leaf module: the reader
imports it without importing the rest of the scheme."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Fp8Facts:
    """One layer's FP8 quantization as the checkpoint stores it.

    ``strategy``: "block" (2-D block scales), "channel" (one scale per output row) or "tensor"
    (one scale per weight); ``block``: (rows, K columns) of a block, or None; ``scale_dtype``:
    the source's "F32" | "BF16" | "F16"; ``format``: "fp8" (DeepSeek/Qwen ``weight_scale_inv``)
    or "float-quantized" (compressed-tensors ``weight_scale``); ``input_activations``: what the
    checkpoint meant its activations to be (compressed-tensors' arguments, DeepSeek's
    ``activation_scheme``), or None; moepack runs them in 16 bits either way; ``shared``: the
    same facts for a quantized shared expert, or None."""

    strategy: str
    block: tuple | None
    scale_dtype: str
    format: str
    input_activations: dict | None = None
    shared: "Fp8Facts | None" = None

    @property
    def group_size(self) -> int:
        """The K values per scale of the canonical form: the block's width, -1 per channel/tensor."""
        return int(self.block[1]) if self.strategy == "block" else -1

    @property
    def fp8_activations(self) -> bool:
        """The checkpoint meant its activations to be quantized to FP8 (moepack keeps them 16-bit)."""
        a = self.input_activations
        return bool(a) and (a.get("type") == "float" or a.get("activation_scheme") is not None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


__all__ = ["Fp8Facts"]
