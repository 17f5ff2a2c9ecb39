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


class NoSuchLayerError(MoepackError, KeyError):
    """``PackedModel.layers[i]`` for an index the pack has no MoE layer at (a KeyError, so that dict
    idioms keep working), with a message that names the pack and the layers it has."""

    def __str__(self) -> str:  # KeyError's own __str__ prints the repr of its argument
        return str(self.args[0]) if self.args else ""
