"""Streaming writer of 64-byte-aligned safetensors shards, and an all-or-nothing output directory.

Two phases: a ``ShardPlan`` fixes every tensor's name, dtype, shape and offset (so the header can
be written first), then a ``ShardWriter`` streams the tensors in plan order, inserting the zero
filler tensors, hashing each tensor's bytes as they go out, and checking the result against the
plan on close. ``atomic_directory`` makes a whole packed directory appear under its final name
only once it is complete. The format is specified in docs/PACKED_FORMAT.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import queue
import secrets
import shutil
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

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
        """``pipeline``: hash and write on two background threads (``_Sink``) while the caller
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
        self._sink: _Sink | None = None
        self._f = None
        try:
            if pipeline:
                self._sink = _Sink(self.path, self.display)
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
        b = _byte_view(t)
        n = b.numel()
        if self._sink is not None:
            if n:
                self._sink.put(b, h)  # hashed, then written, by the sink's threads; no copy here
            self._pos += n
            return n
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


def os_reason(e: OSError) -> str:
    """An OSError's reason without its own path (the message names the path the user knows)."""
    return f"{e.strerror or e} [errno {e.errno}]" if e.errno else str(e)


_STAGE_BYTES = 16 << 20  # one O_DIRECT write: large, sequential, page-aligned
_SINK_INFLIGHT_BYTES = 256 << 20  # parts queued but not yet written: bounds the pipeline's memory


class _Sink:
    """The byte stream of one shard, hashed on one thread and written on another.

    The caller (convert's packer, on the main thread) queues each part's bytes and moves on to
    the next part: hashlib's sha256 and ``os.write`` both release the GIL, so packing, hashing
    and writing run at once. Writes go through one page-aligned staging buffer with O_DIRECT
    where the filesystem allows it (a buffered write costs a CPU copy into the page cache, which
    on two cores is what the packer needs), in ``_STAGE_BYTES`` pieces; the unaligned tail is
    written buffered. Memory is bounded: at most ``_SINK_INFLIGHT_BYTES`` of queued parts
    (or one part, if larger) plus the staging buffer. The first error of either thread is kept
    and raised to the caller on its next call."""

    def __init__(self, path: str, display: str):
        self.path, self.display = path, display
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:  # EINVAL: no O_DIRECT here (tmpfs)
                raise
            self.direct = False
            self.fd = os.open(path, flags, 0o644)
        self._stage = mmap.mmap(-1, _STAGE_BYTES)
        self._stage_t = torch.frombuffer(self._stage, dtype=torch.uint8)
        self._fill = 0
        self._error: BaseException | None = None
        self._aborting = False
        self._inflight = 0
        self._cv = threading.Condition()
        self._hq: queue.Queue = queue.Queue()
        self._wq: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._run, args=(f,), daemon=True, name=f"moepack-{n}")
                         for n, f in (("hash", self._hash_item), ("write", self._write_item))]  # fmt: skip
        self._threads[0].queue, self._threads[1].queue = self._hq, self._wq
        self._next_q = {self._hq: self._wq, self._wq: None}
        for t in self._threads:
            t.start()

    # -- caller side
    def _raise_error(self) -> None:
        e = self._error
        if e is None:
            return
        if isinstance(e, OSError):
            raise ContainerError(f"{self.display}: cannot write: {os_reason(e)}") from None
        raise e

    def _wait(self, pred) -> None:
        with self._cv:
            while not pred() and self._error is None:
                self._cv.wait(0.1)  # a timeout keeps the main thread responsive to signals
        self._raise_error()

    def put(self, b: torch.Tensor | None, h) -> None:
        """Queue ``b`` (flat uint8) to be hashed into ``h`` (None: not hashed) and written."""
        self._raise_error()
        if b is None:
            return
        n = b.numel()
        self._wait(lambda: self._inflight == 0 or self._inflight + n <= _SINK_INFLIGHT_BYTES)
        with self._cv:
            self._inflight += n
        self._hq.put(("data", b, h))

    def digest(self, h) -> str:
        """``h``'s hex digest once every part queued for it is hashed (writing goes on)."""
        box: list = []
        self._hq.put(("digest", h, box))
        self._wait(lambda: bool(box))
        return box[0]

    def finish(self) -> int:
        """Write everything queued, the tail included; returns the file descriptor."""
        box: list = []
        self._hq.put(("end", None, box))
        self._wait(lambda: bool(box))
        return self.fd

    def close(self) -> None:
        self._stop()
        os.close(self.fd)

    def abort(self) -> None:
        self._aborting = True
        self._stop()
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def _stop(self) -> None:
        self._hq.put(("stop", None, None))
        for t in self._threads:
            t.join()
        self._stage_t = None
        with contextlib.suppress(BufferError):
            self._stage.close()

    # -- threads
    def _run(self, handle) -> None:
        q = threading.current_thread().queue
        nxt = self._next_q[q]
        while True:
            item = q.get()
            kind = item[0]
            try:
                if self._error is None and not self._aborting:
                    handle(item)
                elif kind in ("digest", "end"):
                    item[2].append(None)
            except BaseException as e:  # kept for the caller; the thread keeps draining its queue
                with self._cv:
                    if self._error is None:
                        self._error = e
            if kind == "data" and nxt is None:
                with self._cv:
                    self._inflight -= item[1].numel()
            with self._cv:
                self._cv.notify_all()
            if nxt is not None and kind != "digest":  # digests are the hash thread's alone
                nxt.put(item)
            if kind == "stop":
                return

    def _hash_item(self, item) -> None:
        if item[0] == "data" and item[2] is not None:  # ("data", bytes, hasher)
            b, h = item[1], item[2]
            for i in range(0, b.numel(), _WRITE_CHUNK):
                h.update(memoryview(b[i : i + _WRITE_CHUNK].numpy()))
        elif item[0] == "digest":  # ("digest", hasher, box)
            item[2].append(item[1].hexdigest())

    def _write_item(self, item) -> None:
        kind, b, _ = item
        if kind == "data":
            n, i = b.numel(), 0
            while i < n:
                k = min(n - i, _STAGE_BYTES - self._fill)
                self._stage_t[self._fill : self._fill + k].copy_(b[i : i + k])
                self._fill += k
                i += k
                if self._fill == _STAGE_BYTES:
                    self._flush(_STAGE_BYTES)
        elif kind == "end":
            aligned = self._fill - self._fill % DATA_ALIGNMENT if self.direct else self._fill
            self._flush(aligned)
            if self._fill:  # the unaligned tail: O_DIRECT off for the last < 4096 bytes
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
                self._flush(self._fill)
            item[2].append(True)

    def _flush(self, n: int) -> None:
        """Write the staging buffer's first ``n`` bytes and keep the rest at its start."""
        mv = memoryview(self._stage)
        done = 0
        while done < n:
            try:
                done += os.write(self.fd, mv[done:n])
            except OSError as e:
                if e.errno == errno.EINVAL and self.direct and done == 0:  # O_DIRECT refused after all
                    fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    self.direct = False
                    continue
                raise
        rest = self._fill - n
        if rest:
            self._stage_t[:rest].copy_(self._stage_t[n : self._fill].clone())
        self._fill = rest
        mv.release()


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


OWNER_FILE = ".moepack-owner"  # inside a temporary directory: the owner's pid, flock'ed while it runs


def _lock_path(final: Path) -> Path:
    return final.parent / f".{final.name}.lock"


def _tmp_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


class _FileLock:
    """An exclusive ``flock`` on ``path``, taken without waiting and held until ``release``.

    The file holds the owner's pid, for messages only: ownership is the lock itself, which the
    kernel drops when the process dies however it dies (SIGKILL included), so a reused pid never
    makes a dead owner look alive. ``release(unlink=True)`` deletes the file while still holding
    the lock; ``acquire`` re-checks that the file it locked is still the one at ``path`` (it may
    have been unlinked by the previous owner in between) and retries if not."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> bool:
        """True when taken; False when another live process holds it."""
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self.fd = fd
                return True
            os.close(fd)  # locked a file its owner had just unlinked: take the new one
        return False  # pragma: no cover

    def owner(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            return f"pid {int(self.path.read_text().split()[0])}"
        return "another process"

    def release(self, unlink: bool = False) -> None:
        if self.fd is None:
            return
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_owner_lock(tmp: Path) -> _FileLock | None:
    """The owner lock of temporary directory ``tmp`` taken by this process, or None when a live
    process owns ``tmp``. A directory without an owner file (written by a moepack before owner
    files) counts as owned while the pid in its name is alive."""
    owner = tmp / OWNER_FILE
    if not owner.exists():
        try:
            pid = int(tmp.name.rsplit(".tmp-", 1)[1].split("-")[0])
        except ValueError:
            pid = None
        if pid is not None and pid != os.getpid() and _pid_alive(pid):
            return None
    lock = _FileLock(owner)
    try:
        ok = lock.acquire()
    except OSError:
        return None
    return lock if ok else None


def stale_temporaries(final_path: str | os.PathLike) -> list[Path]:
    """The temporary siblings ``.<name>.tmp-*`` of ``final_path`` that no live process owns."""
    final = Path(final_path)
    out = []
    with contextlib.suppress(OSError):
        for p in sorted(final.parent.iterdir()):
            if p.name.startswith(_tmp_prefix(final)) and p.is_dir() and not p.is_symlink():
                lock = _stale_owner_lock(p)
                if lock is not None:
                    lock.release()
                    out.append(p)
    return out


def _refuse_os(final: Path, e: OSError, what: str) -> ContainerError:
    """A write refused in DST's parent (read-only, no permission, full), named by DST."""
    return ContainerError(f"{final}: cannot {what} in {str(final.parent)!r}: {os_reason(e)}")


@contextlib.contextmanager
def atomic_directory(
    final_path: str | os.PathLike,
    *,
    overwrite: bool = False,
    fsync: bool = True,
    reuse: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """Build a directory under a temporary sibling name and rename it to ``final_path`` at the end.

    Yields the temporary directory (``<parent>/.<name>.tmp-<pid>-<hex>``). If the ``with`` block
    raises anything (KeyboardInterrupt included), the temporary directory is deleted and the
    exception propagates: nothing ever appears under ``final_path`` unless it is complete. On
    success the files and directories are fsync'd, the directory is renamed into place and the
    parent is fsync'd. An existing ``final_path`` is refused unless ``overwrite``, in which case it
    is renamed away, the new directory renamed in, and the old one deleted (open mmaps of old files
    stay valid).

    Ownership: the whole run holds an exclusive lock on the sibling ``.<name>.lock`` (a second
    writer of the same ``final_path`` is refused, naming the owner's pid), and each temporary
    directory holds a locked ``.moepack-owner`` file. A temporary sibling whose owner lock can be
    taken belongs to a dead run (a SIGKILL, a power cut): it is handed to ``reuse`` (convert's
    resume check) and kept as the directory to continue in if that returns True, else deleted.
    Temporaries that a live process owns are never touched.
    """
    final = Path(final_path)
    if not final.name or final.name in (".", ".."):
        raise ContainerError(f"{final_path}: not a usable directory name")
    parent = final.parent
    if not parent.is_dir():
        raise ContainerError(f"{final_path}: parent directory {str(parent)!r} does not exist")
    if (final.exists() or final.is_symlink()) and not overwrite:
        raise ContainerError(f"{final_path}: already exists (pass overwrite=True to replace it)")
    run_lock = _FileLock(_lock_path(final))
    try:
        taken = run_lock.acquire()
    except OSError as e:
        raise _refuse_os(final, e, "create the output directory") from None
    if not taken:
        raise ContainerError(
            f"{final_path}: {run_lock.owner()} is writing it right now ({run_lock.path.name} is locked): "
            "wait for that run to finish or choose another destination"
        )
    tmp, owner = None, None
    try:
        for p in sorted(parent.iterdir()):
            if not (p.name.startswith(_tmp_prefix(final)) and p.is_dir() and not p.is_symlink()):
                continue
            lock = _stale_owner_lock(p)
            if lock is None:
                continue  # a live process owns it: not ours to touch
            if tmp is None and reuse is not None and reuse(p):
                tmp, owner = p, lock
                continue
            lock.release()
            _remove(p)
        if tmp is None:
            tmp = parent / f"{_tmp_prefix(final)}{os.getpid()}-{secrets.token_hex(4)}"
            try:
                os.mkdir(tmp)
            except OSError as e:
                raise _refuse_os(final, e, "create the output directory") from None
            owner = _FileLock(tmp / OWNER_FILE)
            try:
                owner.acquire()
            except OSError as e:
                _remove(tmp)
                raise _refuse_os(final, e, "create the output directory") from None
    except BaseException:
        run_lock.release(unlink=True)
        raise
    try:
        yield tmp
        owner.release(unlink=True)
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
        owner.release()
        _remove(tmp)
        raise
    finally:
        run_lock.release(unlink=True)
