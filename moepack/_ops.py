"""Loads the native extension and wraps ``torch.ops.moepack.*`` in typed Python functions.

The ops themselves (schemas, CPU and Meta kernels) are registered in ``csrc/torch/ops.cpp``;
they check every argument and raise ``ValueError`` / ``TypeError`` / ``IndexError`` naming the
argument, the value and the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .errors import ExtensionError, LayoutError
from .layout import DEFAULT_LAYOUT, PackedLayout, layout_get

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "relu2")  # relu2: non-gated experts (w13 of up rows alone)

_loaded = False


def load_extension() -> None:
    """Import ``moepack._C`` (registers the ops); a missing build is a clear error."""
    global _loaded
    if _loaded:
        return
    try:
        from . import _C  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ExtensionError(
            f"the native extension moepack._C could not be loaded ({e}); build it with "
            "`pip install --no-build-isolation -e .` (see README)"
        ) from e
    _loaded = True
    # this machine's `moepack tune` choices into the kernels' variant table (moepack/variants.py)
    from .variants import apply_cached

    apply_cached()


def ops():
    load_extension()
    return torch.ops.moepack


def _weight_list(name: str, w) -> list[torch.Tensor]:
    if isinstance(w, torch.Tensor):
        return [w]
    if isinstance(w, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in w):
        return list(w)
    raise TypeError(f"{name} is a {type(w).__name__}: must be a tensor or a list of the layout's tensors")


def _check_devices(hidden_states: torch.Tensor, named: list) -> None:
    """Every tensor of a call on hidden_states' device. The dispatcher picks the Meta kernel when
    any argument is a meta tensor, and that kernel only allocates the output on hidden_states'
    device: CPU hidden states with meta routes returned uninitialized memory (issue 49). Meta
    hidden states trace shapes (FakeTensor, torch.compile), whatever the weights' device."""
    if hidden_states.device.type == "meta":
        return
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.device != hidden_states.device:
            raise LayoutError(f"{name} is on {t.device}, hidden_states on {hidden_states.device}: every tensor of a call "
                              "must be on hidden_states' device (meta hidden states trace shapes only)")  # fmt: skip


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor | Sequence[torch.Tensor],
    w2: torch.Tensor | Sequence[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    layout: int | str | PackedLayout = DEFAULT_LAYOUT,
    interleaved: bool | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    act_mode: str | None = None,
    w13_perm: torch.Tensor | None = None,
    silu_limit: float | None = None,
) -> torch.Tensor:
    """Run the experts of one MoE layer on packed weights (docs/SEMANTICS.md §2).

    hidden_states [T, H] fp32/bf16/fp16; ``w13`` and ``w2`` are the layout's declared tensors of
    each packed weight in declared order (``PackedLayout.tensors``; ``PackedExperts.weight("w13")``
    gives them), or a single tensor for layouts that are codes only; topk_weights [T, k] fp32;
    topk_ids [T, k] int32 (global ids when ``expert_map`` [E_global] int32 maps them to local ids
    or -1). ``interleaved`` is w13's row order as packed (``PackedExperts.interleaved``); when
    not given, the checkpoints' convention: interleaved for swigluoai, gate-then-up otherwise.
    ``act_mode`` ("a16" or "a8", docs/SEMANTICS.md §3) picks how activations meet the weights
    in layouts that serve both (int4_group, mxfp4); None: the layout's default (its first act mode).
    ``w13_perm`` [E, H] int32 (int4_group layouts of act-order checkpoints,
    ``PackedExperts.w13_perm``): column j of expert e's w13 is input channel w13_perm[e, j]; the
    kernel feeds it ``x[t][w13_perm[e]]``. ``silu_limit`` (silu experts only; None or 0: none): a
    clamped SwiGLU, ``silu(min(gate, L)) * clamp(up, -L, L)`` (DeepSeek-V4's ``swiglu_limit``,
    docs/SEMANTICS.md §2). Returns [T, H] in the input dtype."""
    if interleaved is None:
        interleaved = activation == "swigluoai"
    w13, w2 = _weight_list("w13", w13), _weight_list("w2", w2)
    _check_devices(hidden_states, [*(("w13" if len(w13) == 1 else f"w13[{i}]", t) for i, t in enumerate(w13)),
                                   *(("w2" if len(w2) == 1 else f"w2[{i}]", t) for i, t in enumerate(w2)),
                                   ("topk_weights", topk_weights), ("topk_ids", topk_ids), ("w13_bias", w13_bias),
                                   ("w2_bias", w2_bias), ("expert_map", expert_map), ("w13_perm", w13_perm)])  # fmt: skip
    return ops().fused_experts(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        layout_get(layout).id,
        interleaved=bool(interleaved),
        activation=activation,
        alpha=float(alpha),
        limit=float(limit),
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        expert_map=expert_map,
        act_mode=act_mode or "",
        w13_perm=w13_perm,
        silu_limit=float(silu_limit or 0.0),
    )


def pack_weight(
    weight: torch.Tensor,
    layout: int | str | PackedLayout = DEFAULT_LAYOUT,
    *,
    n_padded: int = 0,
    k_padded: int = 0,
    zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """C++ packer: [E, N, K] float weights -> packed bf16 [E, Np, Kp]; int8 codes -> int8 [E, Np,
    Kp]; sub-byte codes (uint8, one per byte, 0..2**weight_bits-1) -> the layout's packed uint8
    [E, Np, Kp * weight_bits / 8], K padding holding ``zero`` [E, N, ng] uint8 (the row's zero
    point of each K group; None: code 0). Np, Kp: whole blocks / runs, or ``n_padded`` /
    ``k_padded`` when given (no I padding logic here)."""
    return ops().pack_weight(weight, layout_get(layout).id, int(n_padded), int(k_padded), zero)


class KernelChoice(NamedTuple):
    """The kernel a call with a layout runs on this CPU now (``kernel_choice``)."""

    isa: str  # its ISA level (moepack.isa.ISAS)
    reason: str  # why this level and not a better one
    is_fallback: bool  # this build lacks the kernel of a better level that serves the layout: MOEPACK_STRICT=1 refuses it


def kernel_choice(layout: int | str | PackedLayout = DEFAULT_LAYOUT, act_mode: str | None = None) -> KernelChoice:
    """(isa, reason, is_fallback): the kernel a call with this layout (in activation mode
    ``act_mode``; None: the layout's default) runs on this CPU now, and why."""
    isa, reason, is_fallback = ops().kernel_choice(layout_get(layout).id, act_mode or "")
    return KernelChoice(isa, reason, bool(is_fallback))


def cpu_flags() -> list[str]:
    return list(ops().cpu_flags())


def decode_streams() -> str:
    """How the decode kernels read a weight block on this CPU (one stream, or several K segments
    at once) and why: the CPU's vendor or MOEPACK_DECODE_STREAMS (docs/KERNELS.md, "Decode
    streams"). Raises ValueError naming the variable when MOEPACK_DECODE_STREAMS is not 1 or 4."""
    return str(ops().decode_streams())


def mx4_a16_dot() -> str:
    """The dot product of the mxfp4 W4A16 decode kernels (a few bf16 rows, AVX-512 levels) on this
    CPU, fp32 FMAs or vdpbf16ps, and why: the CPU's vendor or MOEPACK_MX4_A16_DOT (docs/KERNELS.md,
    "mxfp4 W4A16 decode: fp32 FMAs or vdpbf16ps"). Raises ValueError naming the variable when
    MOEPACK_MX4_A16_DOT is not fp32 or bf16."""
    return str(ops().mx4_a16_dot())
