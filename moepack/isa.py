"""Kernel ISA levels, as the extension's dispatcher sees them, and MOEPACK_MAX_ISA (which can only lower them).

Levels (csrc/include/moepack/kernel.h, ``Isa``), in order of preference; each has its own CPU
requirements, which do not nest:

============  ==================================================  =====================
level         the CPU needs                                       serves layouts
============  ==================================================  =====================
scalar        nothing                                             all
avx2          AVX2 + FMA + F16C                                   all x86
avx_vnni      avx2 + AVX-VNNI (VEX vpdpbusd)                      int8
avx512        avx2 + AVX-512 F/BW/VL/DQ                           all x86
avx512_vnni   avx512 + AVX512_VNNI                                int8
avx512_bf16   avx512 + AVX512_BF16                                bf16
============  ==================================================  =====================

A layout runs on the best level the CPU has that serves it and is at or below MOEPACK_MAX_ISA.
"""

from __future__ import annotations

import os

from .errors import UnsupportedError

ISAS = ("scalar", "avx2", "avx_vnni", "avx512", "avx512_vnni", "avx512_bf16")  # order = preference

# Which levels have a kernel for which weight kind (a layout's weight_dtype); tests check this
# against what the dispatcher picks on the host, tests/cpp against every registered kernel.
KERNEL_ISAS = {
    "bf16": ("scalar", "avx2", "avx512", "avx512_bf16"),
    "i8": ("scalar", "avx2", "avx_vnni", "avx512", "avx512_vnni"),
}


def _flag(name: str) -> str | None:
    from ._ops import cpu_flags

    for flag in cpu_flags():
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def host_isa() -> str:
    """Best (highest) level this CPU and OS support (cpuid + xgetbv in csrc/dispatch.cpp)."""
    return _flag("host_isa") or "scalar"


def available_isas() -> list[str]:
    """Every level this CPU and OS support, in preference order (scalar first)."""
    value = _flag("available_isas")
    return value.split(",") if value else ["scalar"]


def max_isa() -> str:
    """The level cap from MOEPACK_MAX_ISA (default: the host's best)."""
    value = os.environ.get("MOEPACK_MAX_ISA", "")
    if not value:
        return host_isa()
    if value not in ISAS:
        raise UnsupportedError(f"MOEPACK_MAX_ISA={value!r} is not one of {', '.join(ISAS)}")
    return ISAS[min(ISAS.index(value), ISAS.index(host_isa()))]

