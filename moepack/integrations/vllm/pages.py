"""How the mapped expert pages are backed: 2 MiB mappings instead of 4 KiB ones (docs/VLLM.md,
"Pages").

The plugin serves the experts straight from the pack's memory-mapped shards. Linux maps a file's
page-cache pages with 2 MiB page-table entries only where the page cache holds them as 2 MiB
folios, which needs a filesystem whose page cache takes large folios (ext4 on Linux 6.18 does:
the machine this was measured on); otherwise every 4 KiB page is its own TLB entry, and the
kernel, which streams every weight of a layer per call, pays page walks: one qwen3-30b-a3b
layer at 512-1024 tokens took 1.18-1.33x its time on 4 KiB-mapped pages against the same bytes copied to
huge pages, and as fast as that copy once the pack's pages were 2 MiB folios (docs/VLLM.md).

``MOEPACK_VLLM_PAGES`` picks what the plugin does with each layer's mapped range, at load:

- ``advise`` (the default): ``madvise(MADV_HUGEPAGE)``. Pages read in from then on (first touch
  of a pack that is not in the page cache) come in as 2 MiB folios and are mapped 2 MiB at a time.
  Pages already cached as small folios (a pack just written by ``moepack convert``) stay small.
- ``reload``: ``advise``, after dropping the shards' cached pages that no process maps
  (``posix_fadvise(POSIX_FADV_DONTNEED)``; dirty or mapped pages are kept), so the first touch
  reads them back as 2 MiB folios. It costs one read of the experts from disk, spread over the
  first requests; it changes nothing but the page cache.
- ``populate``: ``reload``, then ``madvise(MADV_POPULATE_READ)``: the experts are read and mapped
  at load, so the first request pays no page faults (load time and RSS grow by the experts).
- ``off``: the plugin adds nothing. (``moepack.open``, through which the plugin maps the
  shards, advises each whole shard ``MADV_HUGEPAGE`` itself unless ``MOEPACK_HUGE_PAGES=0``: set
  that too for maps left entirely as the page cache has them.)

Every step is a hint: where the kernel refuses one (no THP, an old kernel) the plugin logs it
once and serves as it is. Linux only; elsewhere this module does nothing."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from ...container.pages import MADV_HUGEPAGE, MADV_POPULATE_READ, inner_pages, madvise
from ...errors import UnsupportedError

MODES = ("advise", "reload", "populate", "off")
ENV = "MOEPACK_VLLM_PAGES"
_log = logging.getLogger(__name__)
_warned: set[str] = set()


def mode() -> str:
    """``MOEPACK_VLLM_PAGES`` (default ``advise``); anything else is refused naming the choices."""
    m = os.environ.get(ENV, "advise").strip().lower() or "advise"
    if m not in MODES:
        raise UnsupportedError(f"{ENV}={m!r} is not one of {', '.join(MODES)}")
    return m


def _warn_once(what: str, err: int) -> None:
    if what not in _warned:
        _warned.add(what)
        _log.warning("moepack: %s refused by the kernel (%s); serving with the pages as they are", what, os.strerror(err))


def drop_cached(shards: list[Path]) -> None:
    """Drop the shards' cached pages that no process maps (``reload``): read back on first touch
    through a ``MADV_HUGEPAGE`` mapping, they come in as 2 MiB folios."""
    if not sys.platform.startswith("linux"):
        return
    for p in shards:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError as e:  # a hint: the pages stay as they are
            _warn_once(f"open({p}) for posix_fadvise(DONTNEED)", e.errno or 0)
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            _warn_once("posix_fadvise(DONTNEED)", e.errno or 0)
        finally:
            os.close(fd)


def advise(tensors, how: str) -> int:
    """Apply ``how`` (``advise``/``reload``/``populate``; ``off``: nothing) to the page-aligned
    range of each tensor's bytes. Returns the bytes advised."""
    if how == "off" or not sys.platform.startswith("linux"):
        return 0
    done = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
            continue
        lo, n = inner_pages(t.data_ptr(), t.numel() * t.element_size())
        if not n:
            continue
        err = madvise(lo, n, MADV_HUGEPAGE)
        if err:
            _warn_once("madvise(MADV_HUGEPAGE)", err)
        if how == "populate":
            err = madvise(lo, n, MADV_POPULATE_READ)
            if err:
                _warn_once("madvise(MADV_POPULATE_READ)", err)
        done += n
    return done
