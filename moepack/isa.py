"""Host ISA, as the extension's dispatcher sees it, and MOEPACK_MAX_ISA (which can only lower it)."""

from __future__ import annotations

import os

from .errors import UnsupportedError

ISAS = ("scalar", "avx2", "avx512")  # order = preference


def host_isa() -> str:
    """Best ISA this CPU and OS support (cpuid + xgetbv in csrc/dispatch.cpp)."""
    from ._ops import cpu_flags

    for flag in cpu_flags():
        if flag.startswith("host_isa="):
            return flag.split("=", 1)[1]
    return "scalar"


def max_isa() -> str:
    """The ISA cap from MOEPACK_MAX_ISA (default: the host's best)."""
    value = os.environ.get("MOEPACK_MAX_ISA", "")
    if not value:
        return host_isa()
    if value not in ISAS:
        raise UnsupportedError(f"MOEPACK_MAX_ISA={value!r} is not one of {', '.join(ISAS)}")
    return ISAS[min(ISAS.index(value), ISAS.index(host_isa()))]


def available_isas() -> list[str]:
    """Every ISA this host can run, scalar first."""
    return list(ISAS[: ISAS.index(host_isa()) + 1])
