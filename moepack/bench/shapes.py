"""The benchmark's shapes: real MoE layers by name, custom ones as E<e>K<k>H<h>I<i>, and the
token counts, parsed from the command line."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class MoeShape:
    """One MoE layer: E experts, top-k routing, hidden size H, intermediate size I."""

    name: str
    num_experts: int  # E
    topk: int  # k
    hidden: int  # H
    intermediate: int  # I

    @property
    def canonical_bytes_per_expert(self) -> int:
        """bf16 bytes of one expert's w13 [2I, H] + w2 [H, I]."""
        return 3 * self.hidden * self.intermediate * 2

    def describe(self) -> str:
        return f"E={self.num_experts} k={self.topk} H={self.hidden} I={self.intermediate}"


SHAPES: dict[str, MoeShape] = {
    s.name: s
    for s in (
        MoeShape("qwen3-30b-a3b", 128, 8, 2048, 768),
        MoeShape("gpt-oss-20b", 32, 4, 2880, 2880),
        MoeShape("mixtral-8x7b", 8, 2, 4096, 14336),
        MoeShape("tiny", 8, 2, 256, 352),  # seconds, for demos and tests
    )
}
DEFAULT_SHAPES = ("qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b")
DEFAULT_TOKENS = (1, 8, 64, 512)
MAX_TOKENS = 1 << 16  # the most tokens per call bench, run and verify take: past it a run only exhausts memory
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_CUSTOM_SHAPE = re.compile(r"^e(\d+)k(\d+)h(\d+)i(\d+)$", re.IGNORECASE)


def parse_shapes(spec: str | list[str] | tuple[str, ...]) -> list[MoeShape]:
    """'qwen3-30b-a3b,tiny' (or a list) -> shapes; 'all' = every named shape; a custom shape is
    written E<e>K<k>H<h>I<i>, e.g. 'e16k4h1024i512'."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise ValueError("--shapes is empty: name at least one of " + ", ".join(SHAPES))
    out: list[MoeShape] = []
    for name in names:
        if name == "all":
            out += [SHAPES[n] for n in SHAPES if SHAPES[n] not in out]
            continue
        if name in SHAPES:
            shape = SHAPES[name]
        elif m := _CUSTOM_SHAPE.match(name):
            e, k, h, i = (int(g) for g in m.groups())
            if min(e, k, h, i) <= 0 or k > e:
                raise ValueError(f"shape {name!r}: sizes must be positive and k <= E")
            shape = MoeShape(name.lower(), e, k, h, i)
        else:
            raise ValueError(
                f"shape {name!r} is unknown: use one of {', '.join(SHAPES)}, 'all', or E<e>K<k>H<h>I<i> (e.g. e16k4h1024i512)"
            )
        if shape not in out:
            out.append(shape)
    return out


def parse_tokens(spec: str | list[int] | tuple[int, ...]) -> list[int]:
    """'1,8,64' (or a list) -> positive token counts, in the given order, duplicates dropped."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[int] = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            t = int(text)
        except ValueError:
            raise ValueError(f"--tokens: {text!r} is not an integer (write e.g. 1,8,64,512)") from None
        if not 1 <= t <= MAX_TOKENS:
            raise ValueError(f"--tokens: {t} must be a token count in 1..{MAX_TOKENS} (more only exhausts memory)")
        if t not in out:
            out.append(t)
    if not out:
        raise ValueError("--tokens is empty: give at least one token count, e.g. 1,8,64,512")
    return out
