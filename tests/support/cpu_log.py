"""Per-test CPU seconds, for finding where a suite's time goes on a loaded machine.

With ``MOEPACK_TEST_CPU_LOG=FILE`` set, tests/conftest.py appends one JSON line per test to FILE:
``{"id": nodeid, "self": s, "children": s, "wall": s}``: the CPU seconds (user + system) that
the pytest process spent in the test, those of the child processes it waited for during it
(compilers, ``python -m moepack``, qemu; a long-lived child such as the vLLM driver is counted
when it exits), and the wall seconds. CPU seconds change far less with the machine's load than
wall seconds, provided OpenMP threads do not spin while they wait (``OMP_WAIT_POLICY=PASSIVE``,
which tools/test_suites.py sets; with libgomp's default spinning, small kernel tests took twice
the CPU seconds on a loaded 2-core machine): there, this is the figure to compare. tools/test_suites.py sets
it for each suite (build/test-cpu-<suite>.jsonl) and prints each suite's largest functions.

``summary(path)`` aggregates a log by test function (parameters folded)."""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

ENV = "MOEPACK_TEST_CPU_LOG"


def _cpu() -> tuple[float, float]:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


class Recorder:
    """Appends a line per test to ``path`` (line-buffered, so a killed run keeps what it measured)."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)

    def measure(self, nodeid: str):
        a, w = _cpu(), time.perf_counter()

        def done() -> None:
            b = _cpu()
            row = {"id": nodeid, "self": round(b[0] - a[0], 3), "children": round(b[1] - a[1], 3),
                   "wall": round(time.perf_counter() - w, 3)}  # fmt: skip
            self.f.write(json.dumps(row) + "\n")

        return done

    def close(self) -> None:
        self.f.close()


def recorder_from_env() -> Recorder | None:
    path = os.environ.get(ENV)
    return Recorder(path) if path else None


def summary(path: str | Path, top: int = 12) -> str:
    """The log's total CPU and wall seconds, and its ``top`` test functions by CPU seconds."""
    funcs: dict[str, list[float]] = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        f = funcs.setdefault(r["id"].split("[")[0], [0.0, 0.0, 0])
        f[0] += r["self"] + r["children"]
        f[1] += r["wall"]
        f[2] += 1
    cpu, wall = sum(v[0] for v in funcs.values()), sum(v[1] for v in funcs.values())
    out = [f"{len(funcs)} test functions: {cpu:.0f} CPU s (self + waited children), {wall:.0f} wall s; the largest:"]
    for name, (c, w, n) in sorted(funcs.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"  {c:7.1f} CPU s {w:7.1f} wall s  {n:4d} case{'s' if n != 1 else ' '}  {name}")
    return "\n".join(out)
