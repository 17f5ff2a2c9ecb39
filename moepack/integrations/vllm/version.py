"""The vLLM versions the plugin is written against (it uses vLLM internals that moved in every
minor release so far: docs/VLLM.md, "Versions"). No vLLM import here: testable without vLLM."""

from __future__ import annotations

from ...errors import UnsupportedError

# [low, high): the releases whose plugin surface (QuantizationConfig, FusedMoEMethodBase.apply
# with router output, RoutedExperts, WeightsMapper) this module was read against and tested with
SUPPORTED_VLLM = ((0, 32, 0), (0, 33, 0))


def _parse(version: str) -> tuple[int, int, int] | None:
    parts = []
    for p in version.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in p:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            return None
        parts.append(int(digits))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def check_vllm_version(version: str, *, raise_error: bool = True) -> str | None:
    """None when ``version`` is supported; else the one-line reason (raised as
    ``UnsupportedError`` when ``raise_error``)."""
    lo, hi = SUPPORTED_VLLM
    v = _parse(version)
    if v is not None and lo <= v < hi:
        return None
    rng = f">={'.'.join(map(str, lo))},<{'.'.join(map(str, hi))}"
    msg = (f"vllm {version}: the moepack vLLM plugin supports vllm{rng} (install the pinned one: "
           f"pip install 'moepack[vllm]')")  # fmt: skip
    if raise_error:
        raise UnsupportedError(msg)
    return msg
