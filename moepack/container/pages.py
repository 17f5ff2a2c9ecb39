"""The transparent-huge-page hint for memory-mapped packs (Linux ``madvise``).

A packed directory is served from memory maps of its shards, on whatever pages the page cache
holds. Where the filesystem's page cache takes large folios (ext4 on Linux 6.18 does), pages read
in through a mapping advised ``MADV_HUGEPAGE`` come as 2 MiB folios and are mapped 2 MiB at a
time; otherwise each 4 KiB page is its own TLB entry, and the kernels, which stream every weight
they use, pay a page walk per page (docs/KERNELS.md "Page touch"). Every call here is a hint:
where the kernel refuses (no THP, another OS) the mapping stays as it is."""

from __future__ import annotations

import ctypes
import os
import sys

MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22
PAGE = 4096
_libc = None


def madvise(addr: int, length: int, advice: int) -> int:
    """0, or the errno of ``madvise(addr, length, advice)`` (ENOSYS off Linux)."""
    global _libc
    if not sys.platform.startswith("linux"):
        return 38  # ENOSYS
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0:
        return 0
    return ctypes.get_errno()


def inner_pages(addr: int, nbytes: int) -> tuple[int, int]:
    """The whole 4 KiB pages inside ``[addr, addr + nbytes)``: (start, length), length 0 if none."""
    lo = (addr + PAGE - 1) & ~(PAGE - 1)
    hi = (addr + nbytes) & ~(PAGE - 1)
    return lo, max(0, hi - lo)


def huge_pages_wanted() -> bool:
    """``MOEPACK_HUGE_PAGES=0`` turns the huge-page copies and hints off (default: on)."""
    return os.environ.get("MOEPACK_HUGE_PAGES", "1") != "0"
