"""The layout of one shard before a byte is written: the format constants and ``ShardPlan``.

A ``ShardPlan`` fixes every tensor's name, dtype, shape and 64-byte-aligned offset (and the
``__pad__.<i>`` fillers between them), so the safetensors header can be written first and the
tensors streamed after it (``moepack.container.writer.ShardWriter``). Apart from the writer
because a plan is pure bookkeeping: no file, no thread, no OS call; convert makes every shard's
plan up front to refuse bad input and to key a resume. The format is specified in
docs/PACKED_FORMAT.md.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ContainerError
from .reader import MAX_HEADER_BYTES, PAD_PREFIX, TORCH_TO_SAFETENSORS

FORMAT_NAME = "moepack"
FORMAT_VERSION = "1"
DEFAULT_ALIGNMENT = 64
# The data buffer starts on a page boundary, so the first tensor (and every tensor planned with
# align=4096) is page-aligned in the mapping too.
DATA_ALIGNMENT = 4096

# The dtypes the writer accepts: the ones the installed ``safetensors`` reads back through
# ``safetensors.torch.load_file`` (sub-byte F4/F6 are not accepted; store their packed bytes as U8).
_WRITABLE = (
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32", "F64", "I64", "U64",
)  # fmt: skip
WRITER_DTYPES: dict[torch.dtype, str] = {
    dt: name for dt, name in TORCH_TO_SAFETENSORS.items() if name in _WRITABLE
}

WRITE_CHUNK = 64 << 20
_RESERVED_METADATA = ("format", "format_version", "alignment")


@dataclass(frozen=True)
class PlanEntry:
    """One tensor of a plan; ``begin``/``end`` are relative to the data buffer."""

    name: str
    dtype: str  # safetensors dtype string
    torch_dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def is_filler(self) -> bool:
        return self.name.startswith(PAD_PREFIX)


@dataclass(frozen=True)
class Pieces:
    """One part of ``ShardWriter.write_parts`` given as tensors whose bytes, one after the other,
    are the part's bytes (e.g. the two packed halves of one expert's w13 along dim 1, where the
    dims before are 1): the writer streams them in turn, so nothing joins them with a copy."""

    tensors: tuple
    shape: tuple
    dtype: torch.dtype

    def dim(self) -> int:
        return len(self.shape)


def _is_pow2(x: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


class ShardPlan:
    """The layout of one shard: tensors in the order added, each at a multiple of ``alignment``.

    The data buffer starts at a multiple of ``DATA_ALIGNMENT`` (4096) in the file, so offsets
    relative to the buffer and to the file have the same alignment. A gap before a tensor is
    filled by an explicit U8 tensor ``__pad__.<i>`` (i = 0, 1, ... in file order).
    """

    def __init__(self, alignment: int = DEFAULT_ALIGNMENT, *, metadata: dict[str, str] | None = None):
        if not _is_pow2(alignment) or DATA_ALIGNMENT % alignment:
            raise ContainerError(f"alignment {alignment!r} must be a power of two dividing {DATA_ALIGNMENT}")
        self.alignment = alignment
        meta = dict(metadata or {})
        for k, v in meta.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ContainerError(f"metadata must map str to str, got {k!r}: {v!r}")
            if k in _RESERVED_METADATA:
                raise ContainerError(f"metadata key {k!r} is reserved (written by the plan itself)")
        self.metadata = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "alignment": str(alignment)}
        self.metadata.update(meta)
        self._entries: list[PlanEntry] = []
        self._names: set[str] = set()
        self._cursor = 0
        self._n_pad = 0
        self._frozen = False
        self._header: bytes | None = None

    def add(
        self, name: str, dtype: torch.dtype, shape: Sequence[int], *, align: int | None = None
    ) -> None:
        """Append a tensor. ``align`` (a power-of-two multiple of the plan's alignment, at most
        4096) raises the alignment of this one tensor, e.g. to page-align a large blob."""
        if self._frozen:
            raise ContainerError(f"cannot add tensor {name!r}: the plan is frozen (a writer or header already uses it)")
        if not isinstance(name, str) or not name:
            raise ContainerError(f"tensor name {name!r} must be a non-empty string")
        if name.startswith("__pad__") or name == "__metadata__":
            raise ContainerError(f"tensor name {name!r} is reserved (__pad__* fillers, __metadata__)")
        if name in self._names:
            raise ContainerError(f"tensor {name!r} is already in the plan (names must be unique)")
        st_dtype = WRITER_DTYPES.get(dtype) if isinstance(dtype, torch.dtype) else None
        if st_dtype is None:
            raise ContainerError(
                f"tensor {name!r} has dtype {dtype!r}; supported: {', '.join(str(d) for d in WRITER_DTYPES)}"
            )
        try:
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise ContainerError(f"tensor {name!r} has shape {shape!r}, must be a sequence of ints") from None
        if any(d < 0 for d in shape):
            raise ContainerError(f"tensor {name!r} has shape {list(shape)} with a negative dimension")
        a = self.alignment if align is None else align
        if not _is_pow2(a) or a % self.alignment or DATA_ALIGNMENT % a:
            raise ContainerError(
                f"tensor {name!r}: align={align!r} must be a power of two, a multiple of "
                f"{self.alignment} and at most {DATA_ALIGNMENT}"
            )
        pad = -self._cursor % a
        if pad:
            self._append(f"{PAD_PREFIX}{self._n_pad}", "U8", torch.uint8, (pad,), pad)
            self._n_pad += 1
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self._append(name, st_dtype, dtype, shape, nbytes)
        self._names.add(name)

    def _append(self, name, st_dtype, dtype, shape, nbytes):
        self._entries.append(PlanEntry(name, st_dtype, dtype, shape, self._cursor, self._cursor + nbytes))
        self._cursor += nbytes

    @property
    def entries(self) -> tuple[PlanEntry, ...]:
        """Every entry, fillers included, in file order."""
        return tuple(self._entries)

    @property
    def names(self) -> list[str]:
        """The non-filler tensor names, in plan (= file = write) order."""
        return [e.name for e in self._entries if not e.is_filler]

    def entry(self, name: str) -> PlanEntry:
        for e in self._entries:
            if e.name == name:
                return e
        raise ContainerError(f"no tensor {name!r} in the plan")

    def header_bytes(self) -> bytes:
        """The file's first ``data_start`` bytes: u64 LE length N, then the JSON header padded with
        spaces so that 8 + N is a multiple of 4096. Freezes the plan."""
        if self._header is None:
            obj: dict = {"__metadata__": self.metadata}
            for e in self._entries:
                obj[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
            js = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
            n = len(js) + (-(8 + len(js)) % DATA_ALIGNMENT)
            if n > MAX_HEADER_BYTES:
                raise ContainerError(f"header of {n} bytes exceeds the limit of {MAX_HEADER_BYTES}; split the shard")
            self._header = struct.pack("<Q", n) + js + b" " * (n - len(js))
            self._frozen = True
        return self._header

    @property
    def data_start(self) -> int:
        return len(self.header_bytes())

    @property
    def data_nbytes(self) -> int:
        return self._cursor

    @property
    def nbytes(self) -> int:
        """Total size of the file this plan describes (header included). Freezes the plan."""
        return self.data_start + self._cursor
