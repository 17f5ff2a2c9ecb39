"""What an int4 source says about one MoE layer (``LayerSpec.quant`` of the int4 readers:
moepack/sources/int4_common.py fills it, this scheme reads it). A leaf module: the source
readers import it without importing the rest of the scheme."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Int4Facts:
    """One layer's int4 quantization as the checkpoint stores it.

    ``group_size``: K values per scale (-1: one group per row); ``sym``: every zero point is 8;
    ``scale_dtype``: the source's "F16" | "BF16" | "F32"; ``format``: "gptq" | "gptq_v2" | "awq" |
    "pack-quantized"; ``act_order``: gate/up carry a g_idx, so the reader gives a ``w13_perm``;
    ``w2_act_order``: down's g_idx was folded into w13's rows for some expert;
    ``input_activations``: compressed-tensors' activation arguments (W4A8: dynamic per-token
    int8), else None; ``shared``: the same facts for a quantized shared expert, or None."""

    group_size: int
    sym: bool
    scale_dtype: str
    format: str = ""
    bits: int = 4
    act_order: bool = False
    w2_act_order: bool = False
    input_activations: dict | None = None
    shared: "Int4Facts | None" = None

    @property
    def a8_activations(self) -> bool:
        """The checkpoint's activations are dynamic per-token int8 (what the a8 mode computes)."""
        act = self.input_activations or {}
        return (isinstance(act, dict) and act.get("num_bits") == 8 and act.get("type", "int") == "int"
                and act.get("strategy") == "token" and act.get("dynamic") in (True, "true"))  # fmt: skip

    def to_dict(self) -> dict:
        """JSON-serializable (``shared`` nested)."""
        return dataclasses.asdict(self)


__all__ = ["Int4Facts"]
