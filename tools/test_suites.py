#!/usr/bin/env python3
"""`make test-only`'s run of every test: three pytest processes side by side, one status.

    python tools/test_suites.py [PYTEST_ARGS...]

The vLLM suite (marker ``vllm``) and the ARM suite (marker ``arm``) spend most of their time on
one core each (vLLM's CPU engine runs one thread; the ARM binaries run under qemu-user, one
thread; both wait on child processes), so they run in the background, each in its own pytest
process with its own ``--basetemp`` under build/, their output in build/test-<suite>.log, while
the rest of the suite (``not vllm and not arm``) runs in the foreground on this terminal. When
the foreground ends, each background log is printed whole, then one line per suite with its
wall time and status; the exit status is nonzero when any of the three failed (each applies the
skip rule of tests/conftest.py on its own). Extra arguments go to all three.

`PYTEST_ARGS=... make test-only` runs one pytest of that selection instead (Makefile)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build"
BACKGROUND = (("vllm", "vllm"), ("arm", "arm and not vllm"))
FOREGROUND = "not vllm and not arm"


def pytest_cmd(marker: str, name: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-rs", "--durations=25", "-m", marker,
            f"--basetemp={BUILD / f'pytest-{name}'}", *extra]  # fmt: skip


def main(extra: list[str]) -> int:
    BUILD.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    bg = []
    for name, marker in BACKGROUND:
        log = BUILD / f"test-{name}.log"
        f = open(log, "w")
        t0 = time.time()
        p = subprocess.Popen(pytest_cmd(marker, name, extra), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        bg.append((name, log, f, p, t0))
        print(f"[test_suites] the {name} suite runs in the background (pid {p.pid}), its output in {log}", flush=True)
    t0 = time.time()
    rc = subprocess.call(pytest_cmd(FOREGROUND, "main", extra), cwd=ROOT, env=env)
    status = [("main (" + FOREGROUND + ")", rc, time.time() - t0)]
    for name, log, f, p, t in bg:
        brc = p.wait()
        f.close()
        print(f"\n{'=' * 30} the {name} suite ({log.relative_to(ROOT)}) {'=' * 30}", flush=True)
        sys.stdout.write(log.read_text())
        status.append((name, brc, time.time() - t))
    print(f"\n{'=' * 30} suites {'=' * 30}")
    # pytest's exit 5, nothing selected: no failure when extra arguments left a suite empty; without
    # them (make test) every suite must run tests
    words = {0: "passed", 5: "no test selected"} if extra else {0: "passed"}
    for name, code, wall in status:
        print(f"{name}: {words.get(code, f'FAILED (pytest exit {code})')}, wall {wall:.0f} s")
    return 0 if all(code in words for _, code, _ in status) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
