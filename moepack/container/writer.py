"""Streaming writer of 64-byte-aligned safetensors shards: ``ShardWriter``.

Two phases: a ``ShardPlan`` (moepack.container.plan) fixes every tensor's name, dtype, shape and
offset (so the header can be written first), then a ``ShardWriter`` streams the tensors in plan
order, inserting the zero filler tensors, hashing each tensor's bytes as they go out, and
checking the result against the plan on close. With ``pipeline=True`` the hashing and writing
run on the threads of moepack.container.sink. ``atomic_directory`` (moepack.container.atomic)
makes a whole packed directory appear under its final name only once it is complete. The format
is specified in docs/PACKED_FORMAT.md.

This module keeps its older import path working: the plan, the atomic directory and
``os_reason`` are re-exported from here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Iterable

import torch

from ..errors import ContainerError
from .atomic import OWNER_FILE, atomic_directory, os_reason, stale_temporaries
from .plan import (
    WRITE_CHUNK,
    DATA_ALIGNMENT,
    DEFAULT_ALIGNMENT,
    FORMAT_NAME,
    FORMAT_VERSION,
    WRITER_DTYPES,
    PlanEntry,
    Pieces,
    ShardPlan,
)
from .reader import byte_view
from .sink import Sink


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

    def __init__(
        self, path: str | os.PathLike, plan: ShardPlan, *, fsync: bool = True, pipeline: bool = False,
        display: str | os.PathLike | None = None,
    ):  # fmt: skip
        """``pipeline``: hash and write on two background threads (``Sink``) while the caller
        packs the next part; the bytes are the same as the serial path's. ``display``: the path
        named in error messages (convert writes into a hidden temporary directory but names the
        file under DST)."""
        self.path = os.fspath(path)
        self.display = os.fspath(display) if display is not None else self.path
        self.plan = plan
        self.fsync = fsync
        self.digests: dict[str, str] = {}
        self._header = plan.header_bytes()
        self._entries = plan.entries
        self._next = 0
        self._pos = 0
        self._closed = False
        self._broken: str | None = None
        self._sink: Sink | None = None
        self._f = None
        try:
            if pipeline:
                self._sink = Sink(self.path, self.display)
            else:
                self._f = open(self.path, "xb")
        except FileExistsError:
            raise ContainerError(f"{self.display}: already exists; the writer never overwrites a shard") from None
        except OSError as e:
            raise ContainerError(f"{self.display}: cannot create: {os_reason(e)}") from None
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
        if self._sink is not None:
            self._sink.put(torch.frombuffer(bytearray(b), dtype=torch.uint8) if len(b) else None, None)
        else:
            try:
                self._f.write(b)
            except OSError as e:
                raise ContainerError(f"{self.display}: cannot write: {os_reason(e)}") from None
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
        b = byte_view(t)
        n = b.numel()
        if self._sink is not None:
            if n:
                self._sink.put(b, h)  # hashed, then written, by the sink's threads; no copy here
            self._pos += n
            return n
        for i in range(0, n, WRITE_CHUNK):
            mv = memoryview(b[i : i + WRITE_CHUNK].numpy())
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
            pieces = None
            if isinstance(p, Pieces):
                pieces = p.tensors
                n = sum(x.numel() for x in pieces)
                if any(x.dtype != p.dtype for x in pieces) or n != torch.Size(p.shape).numel():
                    raise self._fail(f"tensor {e.name!r}: pieces of {n} elements do not make a {list(p.shape)} part")
                if p.dtype != e.torch_dtype or tuple(p.shape[1:]) != e.shape[1:] or len(p.shape) != len(e.shape):
                    raise self._fail(f"tensor {e.name!r}: expected {e.torch_dtype} {['*', *e.shape[1:]]}, got {p.dtype} {list(p.shape)}")
            if split:
                if pieces is None:
                    ok = isinstance(p, torch.Tensor) and p.dim() == len(e.shape) and tuple(p.shape[1:]) == e.shape[1:]
                    self._check(e, p, ok, ("*",) + e.shape[1:])
                rows += p.shape[0]
                if rows > e.shape[0]:
                    raise self._fail(f"tensor {e.name!r}: parts add up to more than {e.shape[0]} rows")
            for x in pieces if pieces is not None else (p,):
                self._stream(h, x)
        written = self._pos - start
        if written != e.nbytes:
            raise self._fail(
                f"tensor {e.name!r}: wrote {written} bytes ({rows} of {e.shape[0]} rows), plan says {e.nbytes}"
                if split
                else f"tensor {e.name!r}: wrote {written} bytes, plan says {e.nbytes}"
            )
        self._next += 1
        digest = self._sink.digest(h) if self._sink is not None else h.hexdigest()
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
            try:
                if self._sink is not None:
                    fd = self._sink.finish()
                else:
                    self._f.flush()
                    fd = self._f.fileno()
                if self.fsync:
                    os.fsync(fd)
                size = os.fstat(fd).st_size
            except OSError as e:
                raise ContainerError(f"{self.display}: cannot write: {os_reason(e)}") from None
            if size != self.plan.nbytes or self._pos != size:
                raise self._fail(f"file is {size} bytes, plan says {self.plan.nbytes}")
            if self._sink is not None:
                self._sink.close()
            else:
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
            if self._sink is not None:
                self._sink.abort()
            elif self._f is not None:
                self._f.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


__all__ = [
    "DATA_ALIGNMENT",
    "DEFAULT_ALIGNMENT",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "OWNER_FILE",
    "WRITER_DTYPES",
    "PlanEntry",
    "Pieces",
    "ShardPlan",
    "ShardWriter",
    "atomic_directory",
    "os_reason",
    "stale_temporaries",
]
