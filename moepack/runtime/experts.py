"""Running packed experts: the thin layer between PackedExperts and the native op."""

from __future__ import annotations

import torch

from .._ops import fused_experts
from ..errors import LayoutError
from ..pack import PackedExperts


def run_experts(
    packed: PackedExperts,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_experts`` on a ``PackedExperts``: its tensors in the layout's declared order and
    its recorded row order (gate-then-up or interleaved, whatever the activation)."""
    # The op only sees padded weight shapes, so a hidden size that pads to the same Kp/Np as the
    # experts' (e.g. 71 for H = 72) would pass its checks and silently drop a feature.
    if hidden_states.dim() != 2 or hidden_states.shape[1] != packed.hidden:
        raise LayoutError(
            f"hidden_states has shape {list(hidden_states.shape)}: must be [tokens, H] with H = {packed.hidden}, "
            "the hidden size the experts were packed for"
        )
    return fused_experts(
        hidden_states,
        packed.weight("w13"),
        packed.weight("w2"),
        topk_weights,
        topk_ids,
        layout=packed.layout,
        interleaved=packed.interleaved,
        activation=activation,
        alpha=alpha,
        limit=limit,
        w13_bias=packed.w13_bias,
        w2_bias=packed.w2_bias,
        expert_map=expert_map,
    )
