"""Running packed experts: the thin layer between PackedExperts and the native op."""

from __future__ import annotations

import os

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
    act_mode: str | None = None,
    silu_limit: float | None = None,
) -> torch.Tensor:
    """``fused_experts`` on a ``PackedExperts``: its tensors in the layout's declared order and
    its recorded row order (gate-then-up or interleaved, whatever the activation), and its
    act-order permutation ``w13_perm`` when it has one.

    ``act_mode`` (layouts that serve two, int4_group: "a16" or "a8"): this call's mode; None:
    ``MOEPACK_ACT_MODE`` when set and the layout serves it, else ``packed.act_mode`` (a packed
    directory's per-layer default), else the layout's default (its first act mode).
    ``silu_limit``: silu experts' clamped SwiGLU (a manifest layer's ``silu_limit``); None: none."""
    # The op only sees padded weight shapes, so a hidden size that pads to the same Kp/Np as the
    # experts' (e.g. 71 for H = 72) would pass its checks and silently drop a feature.
    if hidden_states.dim() != 2 or hidden_states.shape[1] != packed.hidden:
        raise LayoutError(
            f"hidden_states has shape {list(hidden_states.shape)}: must be [tokens, H] with H = {packed.hidden}, "
            "the hidden size the experts were packed for"
        )
    for name, t in (("hidden_states", hidden_states), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.layout != torch.strided:  # the op's dispatcher would print its whole backend table
            raise LayoutError(f"{name} is a {t.layout} tensor: run_experts takes dense (torch.strided) tensors")
    if packed.tp > 1:  # a --tp pack run whole: each route goes to its expert's tp slices (moepack/tp.py)
        if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape:  # the op's own rule, before expand_routes
            raise LayoutError(f"topk_ids has shape {list(topk_ids.shape)}, topk_weights {list(topk_weights.shape)}: both "
                              f"must be [tokens={hidden_states.shape[0]}, k] with k >= 1")  # fmt: skip
        from ..tp import expand_routes

        topk_weights, topk_ids, expert_map = expand_routes(topk_weights, topk_ids, packed.num_experts, packed.tp, expert_map)
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
        act_mode=resolve_act_mode(packed.layout, act_mode, packed.act_mode),
        w13_perm=packed.tensors.get("w13_perm"),
        silu_limit=silu_limit,
    )


def resolve_act_mode(layout, explicit: str | None = None, default: str | None = None) -> str:
    """The activation mode a call runs in (run_experts' rule): ``explicit``, else the
    ``MOEPACK_ACT_MODE`` environment override when ``layout`` serves it, else ``default``, else
    the layout's first act mode. An explicit mode the layout does not serve is refused."""
    if explicit is not None:
        if explicit not in layout.act_modes:
            raise LayoutError(f"act_mode={explicit!r}: layout {layout.name} runs with {' or '.join(layout.act_modes)} activations")
        return explicit
    env = os.environ.get("MOEPACK_ACT_MODE") or None
    if env is not None and env not in ("a16", "a8"):
        raise LayoutError(f"MOEPACK_ACT_MODE={env!r} is not one of a16, a8")
    if env in layout.act_modes:
        return env
    if default is not None and default in layout.act_modes:
        return default
    return layout.act_modes[0]
