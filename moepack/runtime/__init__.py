"""Running packed experts: ``run_experts`` on in-memory packs, ``open_packed`` on a packed directory."""

from .experts import run_experts


def open_packed(path, *, strict: bool = False):
    from .model import open_packed as _open

    return _open(path, strict=strict)


__all__ = ["run_experts", "open_packed"]
