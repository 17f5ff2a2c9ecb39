"""Every user-facing failure is a ``MoepackError``; messages say the thing, the value and the rule."""


class MoepackError(Exception):
    """Base class of every error moepack raises on purpose."""


class LayoutError(MoepackError, ValueError):
    """A packed layout is unknown, or a shape does not fit it."""


class UnsupportedError(MoepackError, ValueError):
    """A combination (layout, ISA, activation, dtype, ...) that moepack refuses, with the reason."""


class ExtensionError(MoepackError):
    """The native extension is missing or was built from other sources than this package."""
