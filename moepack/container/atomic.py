"""An all-or-nothing output directory: ``atomic_directory`` and its owner locks.

A packed directory is built under a temporary sibling ``.<name>.tmp-<pid>-<hex>`` and renamed to
its final name only once complete (fsync'd); a run holds a ``flock`` on ``.<name>.lock`` and one
on the temporary directory's ``.moepack-owner``, so a second writer is refused and a dead run's
leftovers are told from a live one's (``stale_temporaries``; convert's resume reuses them).
Apart from the shard writer because it is about directories, locks and renames, not bytes: it
knows nothing of safetensors. ``os_reason`` (an OSError's words without its path) lives here as
the lowest module of the writer side; the shard writer and its sink use it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ContainerError


def os_reason(e: OSError) -> str:
    """An OSError's reason without its own path (the message names the path the user knows)."""
    return f"{e.strerror or e} [errno {e.errno}]" if e.errno else str(e)


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


class FileLock:
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


def _stale_owner_lock(tmp: Path) -> FileLock | None:
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
    lock = FileLock(owner)
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
    run_lock = FileLock(_lock_path(final))
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
            owner = FileLock(tmp / OWNER_FILE)
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
