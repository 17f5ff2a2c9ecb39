"""The pipelined byte stream of one shard: ``Sink``, hashing on one thread, writing on another.

``ShardWriter(..., pipeline=True)`` hands each tensor's bytes to a ``Sink`` and goes back to
packing: a hash thread feeds sha256, a write thread copies into a page-aligned staging buffer
and writes it with O_DIRECT where the filesystem allows (buffered otherwise, and for the
unaligned tail). Apart from the writer because it is the only threaded, O_DIRECT-aware code of
the container; the writer's serial path (``pipeline=False``) never touches it and writes the same
bytes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import queue
import threading

import torch

from ..errors import ContainerError
from .atomic import os_reason
from .plan import WRITE_CHUNK, DATA_ALIGNMENT

_STAGE_BYTES = 16 << 20  # one O_DIRECT write: large, sequential, page-aligned
_SINK_INFLIGHT_BYTES = 256 << 20  # parts queued but not yet written: bounds the pipeline's memory


class Sink:
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
            for i in range(0, b.numel(), WRITE_CHUNK):
                h.update(memoryview(b[i : i + WRITE_CHUNK].numpy()))
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
