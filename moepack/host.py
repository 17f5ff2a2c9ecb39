"""Facts of the host read without the extension or torch: the CPU's model name, and the user's cache
folder for one kind of moepack record (the machine-limit probe, the tune)."""

from __future__ import annotations

import os
import platform
import tempfile
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir(kind: str) -> Path:
    """$XDG_CACHE_HOME/moepack/<kind> (~/.cache when unset), created; a per-user folder in the
    temporary directory where that one cannot be written."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    d = Path(base) / "moepack" / kind
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = Path(tempfile.gettempdir()) / f"moepack-{kind}-{os.getuid() if hasattr(os, 'getuid') else 0}"
    d.mkdir(parents=True, exist_ok=True)
    return d
