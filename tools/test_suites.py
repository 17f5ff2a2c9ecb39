#!/usr/bin/env python3
"""`make test-only`'s run of every test: four pytest processes side by side, one status.

    python tools/test_suites.py [--provide] [PYTEST_ARGS...]

The vLLM suite (marker ``vllm``) and the ARM suite (marker ``arm``) spend most of their time on
one core each (vLLM's CPU engine runs one thread; the ARM binaries run under qemu-user, one
thread; both wait on child processes), so they run in the background (the vLLM suite in two
halves, ``VLLM_FIRST``), each in its own pytest
process with its own ``--basetemp`` under build/, their output in build/test-<suite>.log, while
the rest of the suite (``not vllm and not arm``) runs in the foreground on this terminal, over
several pytest-xdist workers (``-n``, whole files each: ``--dist loadfile``, so a file's module and
session fixtures are built once) at a lower priority (``nice``): the two background suites are
each one stream of work that cannot be split, the foreground's files can, so the foreground takes
the cores they leave and all three end together instead of the foreground running alone at the
end. When the foreground ends, each background log is printed whole, then one line per suite with its
wall time and status; the exit status is nonzero when any of the three failed (each applies the
skip rule of tests/conftest.py on its own). Extra arguments go to all three.

Each suite also writes its per-test CPU seconds to build/test-cpu-<suite>.jsonl
(tests/support/cpu_log.py); the status lines give each suite's CPU seconds (its pytest process
and every process it waited for, from wait4) beside its wall seconds, and its largest test
functions by CPU: on a shared 2-core machine the CPU seconds, not the wall time, say where the
run's time goes.

`--provide` (`make test`): first run, beside the main suite, the make targets the background
suites need (``PROVIDES``: the vLLM venv, the aarch64 wheel), each suite starting when its target
is done. `PYTEST_ARGS=... make test-only` runs one pytest of that selection instead (Makefile)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support import cpu_log  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build"
# The vLLM suite in two processes, each with its own vLLM driver session (one more import of vLLM,
# ~20 CPU s): it waits on spawned TP workers and the server's start, and as one process it was the
# longest single stream of `make test` (~800-900 s wall on the 2-core Zen 3). The split is by the
# module fixtures the tests use (the first half: the compressed-tensors sources and the family
# packs; the second, its complement: the qwen3 packs), so no pack is built twice.
VLLM_FIRST = "ct_int8 or quantized_attention or olmoe or gpt_oss or deepseek"
BACKGROUND = (("vllm-1", "vllm", VLLM_FIRST), ("vllm-2", "vllm", f"not ({VLLM_FIRST})"), ("arm", "arm and not vllm", None))
# --provide (`make test`): the make target each background suite needs first, run while the main
# suite already runs (downloads: the vLLM venv's packages, the ~430 MB aarch64 torch wheel); a
# suite starts when its target is done (failed or not: a target records what it could not provide
# in build/missing/, and the suite's tests name it). The main suite needs only the extension and
# SIMDe, which `make test` provides before (its build beside apt).
PROVIDES = {"vllm-1": "vllm-venv-or-reason", "vllm-2": "vllm-venv-or-reason", "arm": "provide-arm-wheel"}
FOREGROUND = "not vllm and not arm"


# The foreground's niceness: below the background suites, each a single stream (docs/CONTRIBUTING.md)
FOREGROUND_NICE = 5


def workers() -> int:
    """xdist workers for the foreground: the cores the two background suites leave, at least two
    (on two cores the lower priority, not the count, is what lets the background suites go first)."""
    return max(2, min(8, (os.cpu_count() or 2) - 2))


def pytest_cmd(marker: str, name: str, extra: list[str], parallel: int = 0) -> list[str]:
    # --no-loadscope-reorder: the files in collection order (tests/conftest.py puts the longest
    # first), not xdist's default of the files with the most tests first
    split = ["-n", str(parallel), "--dist", "loadfile", "--no-loadscope-reorder"] if parallel > 1 else []
    return [sys.executable, "-m", "pytest", "-q", "-rs", "--durations=25", "-m", marker, *split,
            f"--basetemp={BUILD / f'pytest-{name}'}", *extra]  # fmt: skip


def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


def _wait(p: subprocess.Popen) -> tuple[int, float]:
    """The exit code of ``p`` and the CPU seconds of it and of every process it waited for."""
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, ru.ru_utime + ru.ru_stime


def _env(name: str) -> dict:
    """The suite's environment. OMP_WAIT_POLICY=PASSIVE (unless set): the suites' processes
    outnumber the cores, and an OpenMP thread that spins at a barrier (libgomp's default, before it
    sleeps) burns the CPU another suite's process needs; measured on the 2-core Zen 3 under load,
    the spinning doubled the CPU seconds of small kernel tests (docs/NOTES.md)."""
    cpu = BUILD / f"test-cpu-{name}.jsonl"
    cpu.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{cpu_log.ENV: str(cpu)})
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


class _Provider:
    """``make TARGET`` run once in a thread (the suites that need it wait for it): its wall and CPU
    seconds for the status lines."""

    def __init__(self, target: str):
        self.target, self.done, self.wall, self.cpu, self.rc = target, threading.Event(), 0.0, 0.0, 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        t0 = time.time()
        try:
            p = subprocess.Popen(["make", "--no-print-directory", self.target], cwd=ROOT)
            self.rc, self.cpu = _wait(p)
        except OSError as e:  # no make: the suite's tests name what is missing
            print(f"[test_suites] make {self.target}: {e}", flush=True)
            self.rc = 127
        self.wall = time.time() - t0
        self.done.set()


def _background(name: str, cmd: list[str], log: Path, provider: _Provider | None) -> tuple[threading.Thread, dict]:
    """A thread that waits for the suite's provider (if any), starts the suite (output to ``log``)
    and waits for it: its exit code, CPU seconds, start and end."""
    out: dict = {}

    def run() -> None:
        if provider is not None:
            provider.done.wait()
        out["start"], out["rc"], out["cpu"] = time.time(), 1, 0.0
        with open(log, "w") as f:
            try:
                p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=_env(name))
                print(f"[test_suites] the {name} suite runs in the background (pid {p.pid}), its output in {log}", flush=True)
                out["rc"], out["cpu"] = _wait(p)
            except OSError as e:  # the suite fails, naming why, instead of the thread dying silently
                f.write(f"[test_suites] could not start {cmd[:3]}: {e}\n")
        out["end"] = time.time()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def main(extra: list[str]) -> int:
    BUILD.mkdir(exist_ok=True)
    provide = "--provide" in extra
    extra = [a for a in extra if a != "--provide"]
    providers: dict[str, _Provider] = {}
    if provide:
        for target in dict.fromkeys(PROVIDES.values()):
            providers[target] = _Provider(target)
            print(f"[test_suites] make {target} runs beside the main suite", flush=True)
    bg = []
    for name, marker, select in BACKGROUND:
        log = BUILD / f"test-{name}.log"
        cmd = pytest_cmd(marker, name, (["-k", select] if select else []) + extra)
        bg.append((name, log, _background(name, cmd, log, providers.get(PROVIDES[name]))))  # none without --provide
    t0 = time.time()
    n = workers() if _has_xdist() else 1
    if n == 1:
        print("[test_suites] pytest-xdist is not installed (make setup-test installs it): the main suite runs in one process",
              flush=True)  # fmt: skip
    # `nice` execs the command (same pid, waited for below); no preexec_fn: this process has threads
    cmd = ["nice", "-n", str(FOREGROUND_NICE), *pytest_cmd(FOREGROUND, "main", extra, n)]
    rc, cpu = _wait(subprocess.Popen(cmd, cwd=ROOT, env=_env("main")))
    status = [("main", "main (" + FOREGROUND + ")", rc, time.time() - t0, cpu)]
    for name, log, (th, out) in bg:
        th.join()
        print(f"\n{'=' * 30} the {name} suite ({log.relative_to(ROOT)}) {'=' * 30}", flush=True)
        sys.stdout.write(log.read_text())
        status.append((name, name, out["rc"], out["end"] - out["start"], out["cpu"]))
    print(f"\n{'=' * 30} suites {'=' * 30}")
    for pv in providers.values():
        print(f"make {pv.target}: exit {pv.rc}, wall {pv.wall:.0f} s, CPU {pv.cpu:.0f} s (beside the main suite)")
    # pytest's exit 5, nothing selected: no failure when extra arguments left a suite empty; without
    # them (make test) every suite must run tests
    words = {0: "passed", 5: "no test selected"} if extra else {0: "passed"}
    for key, name, code, wall, cpu in status:
        print(f"{name}: {words.get(code, f'FAILED (pytest exit {code})')}, wall {wall:.0f} s, CPU {cpu:.0f} s")
        log = BUILD / f"test-cpu-{key}.jsonl"
        if log.exists() and log.stat().st_size:
            print("  " + cpu_log.summary(log).replace("\n", "\n  "))
    return 0 if all(code in words for _, _, code, _, _ in status) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
