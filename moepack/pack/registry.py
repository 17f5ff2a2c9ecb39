"""The registry of weight schemes: the scheme packages (moepack/schemes/) register themselves,
generic code (``pack_experts``, convert, verify, the runtime, the CLI, bench) looks a scheme up
by name, alias or layout and asks it instead of branching on its name.

It sits here, under the generic packing code, so that the dependency runs one way: the scheme
packages import moepack.pack; moepack.pack never imports them (the registry is filled when
moepack.schemes is imported, which ``import moepack`` does)."""

from __future__ import annotations

from ..errors import UnsupportedError
from ..layout import LAYOUTS, PackedLayout, layout_get

_REGISTRY: dict = {}


def register(s):
    """Register a ``moepack.schemes.Scheme`` under its name and aliases (each spelling once)."""
    for key in (s.name, *s.aliases):
        if key in _REGISTRY:
            raise ValueError(f"scheme name {key!r} registered twice")
        _REGISTRY[key] = s
    return s


def get_scheme(key: "str | PackedLayout | int"):
    """A scheme by name or alias, or the scheme of a layout (object, id or name)."""
    if isinstance(key, str) and key in _REGISTRY:
        return _REGISTRY[key]
    if not isinstance(key, str) or any(key == x.name for x in LAYOUTS):
        lay = layout_get(key)
        if lay.scheme not in _REGISTRY:
            raise UnsupportedError(f"layout {lay.name} has scheme {lay.scheme!r}, which this moepack has no module for")
        return _REGISTRY[lay.scheme]
    known = ", ".join(sorted({s.name for s in _REGISTRY.values()}))
    raise UnsupportedError(f"scheme {key!r} is unknown; known schemes: {known} (aliases: "
                           + ", ".join(sorted(k for k, s in _REGISTRY.items() if k != s.name)) + ")")


def schemes() -> list:
    """Every registered scheme once, in registration order."""
    seen: dict = {}
    for s in _REGISTRY.values():
        seen.setdefault(s.name, s)
    return list(seen.values())


def exported(name: str):
    """The function ``name`` that a registered scheme lists in its ``exports`` (the names older
    moepack versions had in moepack.pack), or None."""
    for s in schemes():
        for f in s.exports:
            if f.__name__ == name:
                return f
    return None


__all__ = ["register", "get_scheme", "schemes", "exported"]
