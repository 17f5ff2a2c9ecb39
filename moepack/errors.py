"""Every user-facing failure is a ``MoepackError``; messages say the thing, the value and the rule."""


class MoepackError(Exception):
    """Base class of every error moepack raises on purpose."""


class LayoutError(MoepackError, ValueError):
    """A packed layout is unknown, or a shape does not fit it."""


class UnsupportedError(MoepackError, ValueError):
    """A combination (layout, ISA, activation, dtype, ...) that moepack refuses, with the reason."""


class ExtensionError(MoepackError):
    """The native extension is missing or was built from other sources than this package."""


class SourceError(MoepackError, ValueError):
    """A source checkpoint cannot be read as what it claims to be (missing, corrupt, inconsistent)."""


class ConvertError(MoepackError, ValueError):
    """A conversion was refused; nothing was written under the destination."""


class PackedDirError(MoepackError, ValueError):
    """A packed directory is invalid: bad manifest, bad header, mismatched checksum."""


class ContainerError(MoepackError, ValueError):
    """A safetensors file or packed directory is malformed, truncated, or not what was planned."""
