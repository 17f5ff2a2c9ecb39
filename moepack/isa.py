"""Kernel ISA levels, as the extension's dispatcher sees them, and MOEPACK_MAX_ISA (which can only lower them).

Levels (moepack/isa_levels.py, the one list; ``Isa`` in csrc/include/moepack/isa_gen.h is
generated from it), in order of preference; each has its own CPU requirements, which do not
nest:

{table}

A layout runs on the best level the CPU has that serves it and is at or below MOEPACK_MAX_ISA.
"""

from __future__ import annotations

import os
import platform

from .errors import UnsupportedError
from .isa_levels import LEVELS, arch, build_arch, doc_rows, serves_kind
from .layout import FAMILIES, LAYOUTS

ISAS = tuple(lv.name for lv in LEVELS)  # order = preference

# Which levels have a kernel for which weight kind (a layout's weight_dtype) in which activation
# mode (MODE_ISAS[(kind, mode)]), and in the default mode of that kind's layouts (KERNEL_ISAS[kind]:
# their first act mode); tests check this against what the dispatcher picks on the host, tests/cpp
# against every registered kernel.
MODE_ISAS = {
    (lay.weight_dtype, mode): tuple(lv.name for lv in LEVELS if serves_kind(lv, lay.weight_dtype, mode))
    for lay in LAYOUTS
    for mode in lay.act_modes
}
KERNEL_ISAS = {lay.weight_dtype: MODE_ISAS[(lay.weight_dtype, lay.act_modes[0])] for lay in LAYOUTS}


def layout_isas(layout, act_mode: str | None = None) -> tuple[str, ...]:
    """The levels with a kernel for ``layout`` in ``act_mode`` (default: its first mode): scalar
    and the levels of the layout's family (an x86 level never serves an arm layout, nor the
    reverse) that serve its weight kind, in preference order (csrc/dispatch.cpp isa_serves)."""
    mode = act_mode or layout.act_modes[0]
    return tuple(
        lv.name for lv in LEVELS
        if (lv.arch is None or arch(lv.arch).layout_family == layout.family) and serves_kind(lv, layout.weight_dtype, mode)
    )  # fmt: skip


def _rst_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    rule = "  ".join("=" * w for w in widths)
    return "\n".join([rule, line(header), rule, *map(line, rows), rule])


if __doc__:  # (python -OO drops docstrings)
    __doc__ = __doc__.format(table=_rst_table([r[:3] for r in doc_rows()], ("level", "the CPU needs", "serves")))


def _flag(name: str) -> str | None:
    from ._ops import cpu_flags

    for flag in cpu_flags():
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def host_isa() -> str:
    """Best (highest) level this CPU and OS support (csrc/<arch>/cpu_features.cpp, csrc/dispatch.cpp)."""
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
    lv = LEVELS[ISAS.index(value)]
    here = build_arch(platform.machine())
    if lv.arch is not None and (here is None or lv.arch != here.name):
        mine = [x.name for x in LEVELS if x.arch is None or (here is not None and x.arch == here.name)]
        raise UnsupportedError(f"MOEPACK_MAX_ISA={value!r} is a level of the {lv.arch} architecture, not of this "
                               f"{platform.machine()} machine: it can only lower this machine's levels ({', '.join(mine)})")
    return ISAS[min(ISAS.index(value), ISAS.index(host_isa()))]


def host_family(machine: str | None = None) -> str:
    """The layout family of this machine's architecture (moepack/isa_levels.py ARCHES: "x86" on
    x86-64, "arm" on AArch64); an architecture the list lacks runs every family through the
    scalar level only, and gets the first family, "x86"."""
    arch = build_arch(machine or platform.machine())
    return arch.layout_family if arch is not None else FAMILIES[0]


def resolve_target(target: str) -> str:
    """A convert target: a layout family ("x86", "arm") or "auto" (this machine's: host_family)."""
    if target == "auto":
        return host_family()
    if target not in FAMILIES:
        raise UnsupportedError(f"--target {target!r}: must be auto or one of the layout families {', '.join(FAMILIES)}")
    return target
