"""Resuming a hard-killed convert: the plan's resume key and the per-shard journal.

A convert keeps ``.moepack-resume/`` inside its temporary directory: ``plan.json`` (the resume
key: source fingerprint and file stats (size, mtime, ctime, inode), layout, scheme, options, moepack version, every shard's
header) and one ``<file>.json`` per shard closed and fsync'd. ``atomic_directory``'s ``reuse``
hook asks ``Resume.matches`` whether a dead run's directory can be continued; a journaled shard
is trusted only once its bytes re-hash to the journal's sha256. Apart from run.py because it
is a self-contained protocol on files, independent of how layers are packed.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from pathlib import Path

from .._version import __version__
from ..container.plan import ShardPlan
from ..container.reader import read_safetensors_header
from .plan import Options, Plan
from ..errors import MoepackError


RESUME_DIR = ".moepack-resume"  # inside the temporary directory: the plan's key and one journal per finished shard


def resume_key(pl: Plan, opts: Options) -> dict:
    """What must be identical for a temporary directory to be continued: the source (fingerprint
    of config.json and headers, plus every file's size, mtime, ctime and inode, so rewritten
    data counts even with its mtime restored), the
    layout, scheme, options and moepack version, and every planned shard's header."""
    files = []
    for f in pl.ckpt.files:
        st = f.stat()
        # size and mtime alone miss an in-place edit whose mtime was set back (os.utime, touch -r,
        # rsync -t); the inode change time cannot be set back by a user, and the inode number
        # changes when the file is replaced (a copy, a rename over it)
        files.append([f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return {
        "moepack": __version__,
        "source": str(pl.src.resolve()),
        "fingerprint": pl.ckpt.fingerprint(),
        "source_files": files,
        "layout_id": pl.layout.id,
        "scheme": pl.scheme.name,
        "quantize": opts.quantize,  # as given; the options it names, with their defaults:
        "quantizer": pl.quantizer,
        "act_mode": opts.act_mode,
        "shard_bytes": opts.shard_bytes,
        "shards": {f: hashlib.sha256(sp.header_bytes()).hexdigest() for f, sp in pl.shard_plans.items()},
    }


def _write_json_atomic(path: Path, obj) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


class Resume:
    """The journal of one convert inside its temporary directory (``RESUME_DIR``): ``plan.json``
    (the resume key and the run's ``created_at``) and, per finished shard, ``<file>.json`` with
    the manifest entries it produced. A shard is journaled only after it is closed and fsync'd."""

    def __init__(self, key: dict, notify):
        self.key = key
        self.notify = notify
        self.created_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.resumed: Path | None = None

    def matches(self, tmp: Path) -> bool:
        """atomic_directory's ``reuse`` check of a temporary directory left by a dead run."""
        why = None
        try:
            old = json.loads((tmp / RESUME_DIR / "plan.json").read_text())
            key = old.get("key") if isinstance(old, dict) else None
        except (OSError, ValueError):
            key, why = None, "it has no readable plan (killed before the first shard?)"
        if key is not None and key != self.key:
            diff = next((k for k in self.key if key.get(k) != self.key[k]), "the plan")
            why = f"its {diff} differs from this run's"
        if why is None and self.resumed is None:
            self.resumed = tmp
            self.created_at = old.get("created_at", self.created_at)
            self.notify("resume", path=str(tmp))
            return True
        self.notify("stale_removed", path=str(tmp), reason=why or "another temporary directory is being resumed")
        return False

    def start(self, tmp: Path) -> None:
        (tmp / RESUME_DIR).mkdir(exist_ok=True)
        _write_json_atomic(tmp / RESUME_DIR / "plan.json", {"key": self.key, "created_at": self.created_at})

    def done(self, tmp: Path, fname: str, entry: dict) -> None:
        _write_json_atomic(tmp / RESUME_DIR / f"{fname}.json", entry)

    def finished(self, tmp: Path, fname: str, plan: ShardPlan) -> dict | None:
        """The journal entry of shard ``fname`` if the file on disk is complete and right: its
        size and header are the planned ones and every tensor's bytes hash to the journaled
        sha256 (re-read here: a journal is trusted only as far as the bytes agree)."""
        path, jpath = tmp / fname, tmp / RESUME_DIR / f"{fname}.json"
        try:
            entry = json.loads(jpath.read_text())
            if path.stat().st_size != plan.nbytes:
                return None
            with open(path, "rb") as f:
                if f.read(plan.data_start) != plan.header_bytes():
                    return None
            hdr = read_safetensors_header(path)
            names = plan.names
            if sorted(entry["tensors"]) != sorted(names):
                return None
            with open(path, "rb", buffering=0) as f:
                for n in names:
                    ti = hdr.tensors[n]
                    h = hashlib.sha256()
                    left, off = ti.nbytes, ti.file_offset
                    while left:
                        b = os.pread(f.fileno(), min(left, 64 << 20), off)
                        if not b:
                            return None
                        h.update(b)
                        left -= len(b)
                        off += len(b)
                    if h.hexdigest() != entry["tensors"][n]["sha256"]:
                        return None
            return entry
        except (OSError, ValueError, KeyError, TypeError, MoepackError):
            return None

    def finish(self, tmp: Path) -> None:
        shutil.rmtree(tmp / RESUME_DIR, ignore_errors=True)
