"""convert's temporary directory, resume and convert-time refusals (issue 12, part B).

* The parallel (pack / hash / write threads, O_DIRECT) path writes the same bytes as the serial
  reference path (``pipeline=False``), for dense and int8 packs.
* A convert stopped by SIGTERM or SIGHUP leaves nothing; a SIGKILLed one leaves its temporary
  directory, which the next run continues (same plan) or deletes (different plan); the resumed
  result is byte-identical to an uninterrupted convert (manifest: all but ``created_at`` and the seal over it).
* A second convert to a DST that a live run is writing is refused and touches nothing.
* Refusals name the thing: top_k > experts, a string expert count, a shard that is a folder or
  FIFO, a full disk, a read-only destination.

The killed converts run in a child process (``_child``) that stops itself on a progress event.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import moepack
from moepack.convert.run import convert
from moepack.errors import MoepackError
from tests.support.synthetic import write_synthetic_checkpoint
from tests.support import skips
from tests.support.ckpt_edit import copy_checkpoint, edit_config

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"layers": 4, "experts": 4, "hidden": 256, "intermediate": 128}
LAYER_BYTES = 4 * (2 * 128 * 256 + 256 * 128) * 2  # one layer's packed bf16 experts
SHARD = 2 * LAYER_BYTES + 8192  # two layers per experts shard: a kill can land mid-shard


@pytest.fixture(scope="module")
def small_src(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("resume") / "src"
    write_synthetic_checkpoint(p, **SMALL)
    return p


def _files(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir()) if f.name != "moepack.json"}


def _manifest(d: Path) -> dict:
    m = json.loads((d / "moepack.json").read_text())
    m.pop("created_at")
    m.pop("manifest_sha256")  # the seal covers created_at; it is a function of the rest, compared here
    return m


@pytest.fixture(scope="module")
def reference(small_src, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("ref") / "pk"
    convert(small_src, dst, shard_bytes=SHARD, pipeline=False)
    return dst


def _leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


_CHILD = """
import os, signal, sys, time
from moepack.convert.run import convert
src, dst, event, nth, how, shard, hup = sys.argv[1:8]
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the test process inherited (nohup ignores SIGHUP)
signal.signal(signal.SIGHUP, signal.SIG_IGN if hup == "ignore" else signal.SIG_DFL)
seen = [0]
def progress(ev, **kw):
    if ev == event:
        seen[0] += 1
        if seen[0] == int(nth):
            if how in ("pause", "hold"):
                print("paused", flush=True)
                # short sleeps: a process-directed signal may land on one of the writer's or
                # torch's threads, which does not interrupt a long sleep of the main thread;
                # Python runs the handler at the next slice (the real convert never blocks
                # longer than 0.1 s on its main thread: Sink._wait)
                for _ in range(600 if how == "pause" else 20):  # hold: 2 s, then go on
                    time.sleep(0.1)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
convert(src, dst, shard_bytes=int(shard), progress=progress)
"""


def _child(src: Path, dst: Path, event: str, nth: int, how: str, hup: str = "default") -> subprocess.Popen:
    """The convert in a child process; it sets SIGTERM to the default disposition and SIGHUP to
    the default or, with ``hup="ignore"``, ignored (as ``nohup`` starts a process), whatever the
    test process's own are (a suite run under nohup ignores SIGHUP, and children inherit that)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(src), str(dst), event, str(nth), how, str(SHARD), hup],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)  # fmt: skip


def _paused(src: Path, dst: Path, how: str = "pause", hup: str = "default") -> subprocess.Popen:
    p = _child(src, dst, "layer_done", 1, how, hup)
    assert p.stdout.readline().strip() == "paused", p.stderr.read()
    return p


def test_parallel_and_serial_write_the_same_bytes(small_src, reference, tmp_path):
    par = tmp_path / "par"
    convert(small_src, par, shard_bytes=SHARD, pipeline=True)
    assert _files(par) == _files(reference) and _manifest(par) == _manifest(reference)
    a, b = tmp_path / "i8a", tmp_path / "i8b"
    convert(small_src, a, shard_bytes=SHARD, quantize="int8", pipeline=True)
    convert(small_src, b, shard_bytes=SHARD, quantize="int8", pipeline=False)
    assert _files(a) == _files(b)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_leave_nothing(small_src, tmp_path, sig):
    dst = tmp_path / "pk"
    p = _paused(small_src, dst)
    assert _leftovers(dst), "the paused convert should be writing a temporary directory"
    p.send_signal(sig)
    assert p.wait(30) == -sig  # cleaned up, then ended by the signal itself
    assert not dst.exists() and _leftovers(dst) == []


def test_a_hangup_under_nohup_does_not_stop_the_convert(small_src, reference, tmp_path):
    """SIGHUP ignored when the convert starts (``nohup moepack convert ...``): a hangup leaves it
    running, and it writes the same pack (it used to clean up and stop)."""
    dst = tmp_path / "pk"
    p = _paused(small_src, dst, "hold", hup="ignore")
    p.send_signal(signal.SIGHUP)
    assert p.wait(120) == 0, p.stderr.read()
    assert _files(dst) == _files(reference) and _leftovers(dst) == []


def test_live_run_is_left_alone_and_a_second_writer_refused(small_src, tmp_path):
    dst = tmp_path / "pk"
    p = _paused(small_src, dst)
    try:
        before = _leftovers(dst)
        with pytest.raises(MoepackError, match=rf"pid {p.pid} is writing it right now"):
            convert(small_src, dst, shard_bytes=SHARD)
        assert _leftovers(dst) == before  # its temporary directory and lock untouched
        convert(small_src, tmp_path / "other", shard_bytes=SHARD)  # another DST in the same folder: fine
        assert _leftovers(dst) == before
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("event,nth,done", [("layer_done", 1, 0), ("shard_done", 1, 1), ("layer_done", 3, 1), ("other_done", 1, 3)])
def test_kill9_then_resume_is_byte_identical(small_src, reference, tmp_path, event, nth, done):
    """Killed mid first shard, after it, mid second shard, and before the manifest (``done``:
    the shards complete at the kill, which the resumed run re-checks and keeps)."""
    dst = tmp_path / "pk"
    p = _child(small_src, dst, event, nth, "kill")
    assert p.wait(60) == -signal.SIGKILL, p.stderr.read()
    left = [x for x in _leftovers(dst) if ".tmp-" in x]  # (and the dead run's unlocked .pk.lock)
    assert len(left) == 1
    events = []
    convert(small_src, dst, shard_bytes=SHARD, progress=lambda ev, **kw: events.append(ev))
    assert "resume" in events
    assert events.count("shard_resumed") == done
    assert _files(dst) == _files(reference) and _manifest(dst) == _manifest(reference)
    assert _leftovers(dst) == []
    assert moepack.verify(dst, source=small_src).ok


def test_stale_temp_of_another_plan_is_removed(small_src, reference, tmp_path):
    dst = tmp_path / "pk"
    p = _child(small_src, dst, "shard_done", 1, "kill")
    assert p.wait(60) == -signal.SIGKILL
    (stale,) = [x for x in _leftovers(dst) if ".tmp-" in x]
    events = []
    convert(small_src, dst, shard_bytes=SHARD, quantize="int8", progress=lambda ev, **kw: events.append((ev, kw)))
    removed = [kw for ev, kw in events if ev == "stale_removed"]
    assert removed and "its layout_id differs" in removed[0]["reason"]
    assert not (tmp_path / stale).exists() and _leftovers(dst) == []
    # resume=False: a matching temporary directory is deleted, not continued
    dst2 = tmp_path / "pk2"
    p = _child(small_src, dst2, "shard_done", 1, "kill")
    assert p.wait(60) == -signal.SIGKILL
    events = []
    convert(small_src, dst2, shard_bytes=SHARD, resume=False, progress=lambda ev, **kw: events.append(ev))
    assert "resume" not in events and _files(dst2) == _files(reference) and _leftovers(dst2) == []


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    copy_checkpoint(src, dst)
    edit_config(dst, lambda cfg: cfg.update(changes))
    return dst


def test_top_k_above_experts_refused_at_convert(small_src, tmp_path):
    src = _edit_config(small_src, tmp_path / "src", num_experts_per_tok=99)
    with pytest.raises(MoepackError, match=r"config\.json: num_experts_per_tok=99 with 4 experts .*between 1 and num_experts"):
        convert(src, tmp_path / "pk")
    assert not (tmp_path / "pk").exists() and _leftovers(tmp_path / "pk") == []


def test_string_expert_count_says_integer(small_src, tmp_path):
    src = _edit_config(small_src, tmp_path / "src", num_experts="4")
    with pytest.raises(MoepackError, match=r"config\.json: num_experts='4' \(str\) must be an integer"):
        convert(src, tmp_path / "pk")


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_shard_that_is_not_a_file_is_named(small_src, tmp_path, kind):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(small_src, src)
    shard = src / "model-00002-of-00004.safetensors"
    shard.unlink()
    if kind == "directory":
        shard.mkdir()
        rule = "a directory"
    else:
        os.mkfifo(shard)
        rule = r"a FIFO \(named pipe\)"
    with pytest.raises(MoepackError, match=rf"model-00002-of-00004\.safetensors, which is {rule}"):
        convert(src, tmp_path / "pk")


def test_full_disk_names_the_file_under_dst(small_src, tmp_path, monkeypatch):
    """ENOSPC from a write (simulated) names DST's file, not the hidden temporary path."""
    import moepack.container.writer as w

    real = os.write

    def full(fd, b):
        if len(b) >= 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, b)

    monkeypatch.setattr(w.os, "write", full)
    dst = tmp_path / "pk"
    with pytest.raises(MoepackError) as ei:
        convert(small_src, dst, shard_bytes=SHARD)
    msg = str(ei.value)
    assert f"{dst}/experts-00001-of-00002.safetensors: cannot write: No space left on device" in msg and ".tmp-" not in msg
    assert not dst.exists() and _leftovers(dst) == []


def _mount_tmpfs(where: Path, opts: str) -> bool:
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


def test_full_tmpfs_and_read_only_destination(small_src, tmp_path):
    full, ro = tmp_path / "full", tmp_path / "ro"
    if not _mount_tmpfs(full, "size=1M"):
        skips.host_lacks("the permission to mount a tmpfs (root or CAP_SYS_ADMIN)")
    try:
        with pytest.raises(MoepackError, match=rf"{full}/pk/experts-00001-of-00002\.safetensors: cannot write: No space left"):
            convert(small_src, full / "pk", shard_bytes=SHARD)
        assert os.listdir(full) == []
        assert _mount_tmpfs(ro, "ro,size=1M")
        with pytest.raises(MoepackError, match=rf"{ro}/pk: cannot create the output directory in .*Read-only file system"):
            convert(small_src, ro / "pk")
    finally:
        for m in (full, ro):
            subprocess.run(["umount", str(m)], capture_output=True)


def test_read_only_destination_names_dst(small_src, tmp_path, monkeypatch):
    """EROFS creating the run's files (simulated, runs everywhere) names DST."""
    import moepack.container.writer as w

    def ro(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(w.os, "open", ro)
    dst = tmp_path / "pk"
    with pytest.raises(MoepackError, match=rf"^{dst}: cannot create the output directory in .*Read-only file system"):
        convert(small_src, dst)


def test_cli_resume_flag_and_note(small_src, tmp_path):
    dst = tmp_path / "pk"
    p = _child(small_src, dst, "shard_done", 1, "kill")
    assert p.wait(60) == -signal.SIGKILL
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "moepack", "convert", str(small_src), str(dst), "--shard-gib", str(SHARD / 2**30)],
                       capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stderr and _leftovers(dst) == []


def test_in_place_source_edit_with_mtime_restored_is_not_resumed(small_src, tmp_path):
    """Issue 29: a source edited in place (same size) with its mtime set back, between a kill and
    the rerun, was resumed from stale shards (verify caught it, convert said nothing). The key
    holds the ctime and inode too, which a user cannot set back."""
    import shutil

    from moepack.container import read_safetensors_header

    src = tmp_path / "src"
    shutil.copytree(small_src, src)
    dst = tmp_path / "pk"
    p = _child(src, dst, "shard_done", 1, "kill")
    assert p.wait(60) == -signal.SIGKILL
    shard = sorted(src.glob("*.safetensors"))[0]
    hdr = read_safetensors_header(shard)
    name = next(n for n in hdr.tensors if ".layers.0." in n and "experts" in n)
    ti = hdr.tensors[name]
    st = shard.stat()
    with open(shard, "r+b") as f:  # the low byte of a bf16 weight: a finite value still
        f.seek(ti.file_offset)
        b = f.read(1)
        f.seek(ti.file_offset)
        f.write(bytes([b[0] ^ 1]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    events = []
    convert(src, dst, shard_bytes=SHARD, progress=lambda ev, **kw: events.append((ev, kw)))
    assert "resume" not in [ev for ev, _ in events]
    removed = [kw["reason"] for ev, kw in events if ev == "stale_removed"]
    assert removed == ["its source_files differs from this run's"], removed
    assert moepack.verify(dst, source=src).ok
