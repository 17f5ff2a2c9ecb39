"""Streaming writer of 64-byte-aligned safetensors shards, and an all-or-nothing output directory.

Two phases: a ``ShardPlan`` fixes every tensor's name, dtype, shape and offset (so the header can
be written first), then a ``ShardWriter`` streams the tensors in plan order, inserting the zero
filler tensors, hashing each tensor's bytes as they go out, and checking the result against the
plan on close. ``atomic_directory`` makes a whole packed directory appear under its final name
only once it is complete. The format is specified in docs/PACKED_FORMAT.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from ..errors import ContainerError
from .reader import MAX_HEADER_BYTES, PAD_PREFIX, TORCH_TO_SAFETENSORS, _byte_view

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

_WRITE_CHUNK = 64 << 20
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


class ShardWriter:
    """Write one shard following ``plan``: ``with ShardWriter(path, plan) as w: w.write(name, t)``.

    * Tensors must come in plan order with exactly the planned dtype and shape; filler tensors are
      written automatically.
    * ``write`` returns the hex sha256 of the tensor's bytes; all are kept in ``digests``.
    * ``close`` (or leaving the ``with`` block) checks that every planned tensor was written and
      that the file size equals ``plan.nbytes``, then flushes (and fsyncs if ``fsync``).
    * The file is created exclusively (an existing file is never truncated: it may be mmap'd by a
      reader). If the ``with`` block raises, the partial file is deleted.
    """

    def __init__(self, path: str | os.PathLike, plan: ShardPlan, *, fsync: bool = True):
        self.path = os.fspath(path)
        self.plan = plan
        self.fsync = fsync
        self.digests: dict[str, str] = {}
        self._header = plan.header_bytes()
        self._entries = plan.entries
        self._next = 0
        self._pos = 0
        self._closed = False
        self._broken: str | None = None
        try:
            self._f = open(self.path, "xb")
        except FileExistsError:
            raise ContainerError(f"{self.path}: already exists; the writer never overwrites a shard") from None
        except OSError as e:
            raise ContainerError(f"{self.path}: cannot create: {e}") from e
        try:
            self._raw_write(self._header)
        except BaseException:
            self._abort()
            raise

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._abort()

    def _raw_write(self, b) -> None:
        self._f.write(b)
        self._pos += len(b) if isinstance(b, bytes) else memoryview(b).nbytes

    def _fail(self, msg: str) -> ContainerError:
        return ContainerError(f"{os.path.basename(self.path)}: {msg}")

    def _skip_fillers(self) -> None:
        while self._next < len(self._entries) and self._entries[self._next].is_filler:
            self._raw_write(bytes(self._entries[self._next].nbytes))
            self._next += 1

    def _expect(self, name: str) -> PlanEntry:
        if self._closed:
            raise self._fail(f"cannot write tensor {name!r}: the writer is closed")
        if self._broken:
            raise self._fail(f"cannot write tensor {name!r}: an earlier write failed ({self._broken})")
        self._skip_fillers()
        if self._next >= len(self._entries):
            raise self._fail(f"cannot write tensor {name!r}: every planned tensor is already written")
        e = self._entries[self._next]
        if name != e.name:
            if name in self.digests:
                rule = "it was already written"
            elif any(x.name == name for x in self._entries):
                rule = "tensors must be written in plan order"
            else:
                rule = "it is not in the plan"
            raise self._fail(f"got tensor {name!r} but the plan expects {e.name!r} next ({rule})")
        return e

    def _check(self, e: PlanEntry, t: torch.Tensor, shape_ok: bool, expect_shape) -> None:
        if not isinstance(t, torch.Tensor):
            raise self._fail(f"tensor {e.name!r}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != e.torch_dtype or not shape_ok:
            raise self._fail(
                f"tensor {e.name!r}: expected {e.torch_dtype} {list(expect_shape)}, "
                f"got {t.dtype} {list(t.shape)}"
            )

    def _stream(self, h, t: torch.Tensor) -> int:
        b = _byte_view(t)
        n = b.numel()
        for i in range(0, n, _WRITE_CHUNK):
            mv = memoryview(b[i : i + _WRITE_CHUNK].numpy())
            h.update(mv)
            self._raw_write(mv)
        return n

    def write(self, name: str, tensor: torch.Tensor) -> str:
        """Write the next planned tensor; returns the hex sha256 of its bytes."""
        e = self._expect(name)
        self._check(e, tensor, isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == e.shape, e.shape)
        return self._write_parts(e, [tensor])

    def write_parts(self, name: str, parts: Iterable[torch.Tensor]) -> str:
        """Write the next planned tensor from pieces along dim 0 (e.g. one expert at a time), so a
        stacked [E, ...] tensor never has to exist in memory. Each part has the planned dtype and
        shape[1:]; their dim-0 sizes must add up to shape[0]."""
        e = self._expect(name)
        if not e.shape:
            raise self._fail(f"tensor {name!r} is 0-dimensional; use write()")
        return self._write_parts(e, parts, split=True)

    def _write_parts(self, e: PlanEntry, parts: Iterable[torch.Tensor], split: bool = False) -> str:
        try:
            return self._write_parts_unchecked(e, parts, split)
        except BaseException as exc:
            # Some bytes of this tensor may be out already: the file cannot be completed.
            self._broken = f"tensor {e.name!r}: {type(exc).__name__}"
            raise

    def _write_parts_unchecked(self, e: PlanEntry, parts: Iterable[torch.Tensor], split: bool) -> str:
        h = hashlib.sha256()
        start = self._pos
        rows = 0
        for p in parts:
            if split:
                ok = isinstance(p, torch.Tensor) and p.dim() == len(e.shape) and tuple(p.shape[1:]) == e.shape[1:]
                self._check(e, p, ok, ("*",) + e.shape[1:])
                rows += p.shape[0]
                if rows > e.shape[0]:
                    raise self._fail(f"tensor {e.name!r}: parts add up to more than {e.shape[0]} rows")
            self._stream(h, p)
        written = self._pos - start
        if written != e.nbytes:
            raise self._fail(
                f"tensor {e.name!r}: wrote {written} bytes ({rows} of {e.shape[0]} rows), plan says {e.nbytes}"
                if split
                else f"tensor {e.name!r}: wrote {written} bytes, plan says {e.nbytes}"
            )
        self._next += 1
        digest = h.hexdigest()
        self.digests[e.name] = digest
        return digest

    def close(self) -> None:
        """Finish the file: trailing fillers, checks against the plan, flush, optional fsync."""
        if self._closed:
            return
        try:
            if self._broken:
                raise self._fail(f"cannot finish the file: an earlier write failed ({self._broken})")
            self._skip_fillers()
            missing = [e.name for e in self._entries[self._next :] if not e.is_filler]
            if missing:
                raise self._fail(
                    f"closed with {len(missing)} planned tensor(s) not written: {', '.join(map(repr, missing[:5]))}"
                    + (" ..." if len(missing) > 5 else "")
                )
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())
            size = os.fstat(self._f.fileno()).st_size
            if size != self.plan.nbytes or self._pos != size:
                raise self._fail(f"file is {size} bytes, plan says {self.plan.nbytes}")
            self._f.close()
            self._closed = True
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        """Close and delete the partial file."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _fsync_path(path: Path, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for fn in filenames:
            p = Path(dirpath, fn)
            if not p.is_symlink():
                _fsync_path(p, directory=False)
        _fsync_path(Path(dirpath), directory=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def atomic_directory(
    final_path: str | os.PathLike, *, overwrite: bool = False, fsync: bool = True
) -> Iterator[Path]:
    """Build a directory under a temporary sibling name and rename it to ``final_path`` at the end.

    Yields the temporary directory (``<parent>/.<name>.tmp-<pid>-<hex>``). If the ``with`` block
    raises anything (KeyboardInterrupt included), the temporary directory is deleted and the
    exception propagates: nothing ever appears under ``final_path`` unless it is complete. On
    success the files and directories are fsync'd, the directory is renamed into place and the
    parent is fsync'd. An existing ``final_path`` is refused unless ``overwrite``, in which case it
    is renamed away, the new directory renamed in, and the old one deleted (open mmaps of old files
    stay valid).
    """
    final = Path(final_path)
    if not final.name or final.name in (".", ".."):
        raise ContainerError(f"{final_path}: not a usable directory name")
    parent = final.parent
    if not parent.is_dir():
        raise ContainerError(f"{final_path}: parent directory {str(parent)!r} does not exist")
    if (final.exists() or final.is_symlink()) and not overwrite:
        raise ContainerError(f"{final_path}: already exists (pass overwrite=True to replace it)")
    tmp = parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp)
    try:
        yield tmp
        if fsync:
            _fsync_tree(tmp)
        if final.exists() or final.is_symlink():
            if not overwrite:
                raise ContainerError(f"{final_path}: appeared while writing; not replaced (overwrite=False)")
            old = parent / f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.rename(old, final)
                raise
            if fsync:
                _fsync_path(parent, directory=True)
            _remove(old)
        else:
            os.rename(tmp, final)
        if fsync:
            _fsync_path(parent, directory=True)
    except BaseException:
        _remove(tmp)
        raise
