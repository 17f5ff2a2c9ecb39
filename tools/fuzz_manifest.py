"""The long fuzz of packed directories' manifests and shard headers (tests/support/manifest_fuzz.py has
the cases and the outcome classes; tests/container/test_manifest_fuzz.py runs 400 of them in the suite).

    python3 tools/fuzz_manifest.py --cases 100000 --seed 1 [--jobs 2] [--kind both|manifest|header] [--verify-source]

Converts the fixtures once into a scratch folder, runs the cases (round robin over the fixtures;
with --jobs N, N processes each take every N-th case, so the counts do not depend on N), prints
the counts per (kind, outcome) and every case of class crash, silent or missed with its edits, and
exits 1 when there is one. A case is reproducible from (seed, case number)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# "name@a8": the fixture converted with --act-mode a8 (a deliberate mode: verify reports it, and
# an edit of act_mode or act_mode_option must fail verify --source)
FIXTURES = ("deepseek_v3", "gpt_oss", "qwen2_moe", "qwen3_moe_w8a8", "qwen2_moe_w4a16", "mixtral", "llama4_text",
            "qwen2_moe_w4a16@a8")  # fmt: skip


def _worker(args) -> tuple[Counter, list]:
    root, job, jobs, cases, seed, kind, with_source = args
    import torch

    torch.set_num_threads(1)
    from tests.support.manifest_fuzz import fuzz, make_target

    from tests.support.fixtures_util import fixture_dir

    targets = [make_target(Path(root) / name, fixture_dir(name.split("@")[0]) if with_source else None) for name in FIXTURES]
    r = fuzz(targets, Path(root) / f"work-{job}", cases, seed, kind, job=job, jobs=jobs, progress=_progress(job))
    return r["counts"], r["bugs"]


def _progress(job: int):
    """Every 1000 cases, the job's counts so far on stderr (a long run that is stopped still tells)."""

    def report(done: int, counts: Counter, bugs: list) -> None:
        if done % 1000 == 0:
            row = " ".join(f"{k}/{c}={n}" for (k, c), n in sorted(counts.items()))
            print(f"[job {job}] {done} cases: {row}; bugs {len(bugs)}", file=sys.stderr, flush=True)

    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--kind", choices=("both", "manifest", "header"), default="both")
    ap.add_argument("--verify-source", action="store_true",
                    help="run verify --source on every other_model case: it must fail (class missed otherwise)")
    a = ap.parse_args()
    import moepack
    from tests.support.fixtures_util import fixture_dir

    with tempfile.TemporaryDirectory(prefix="moepack-fuzz-") as root:
        for name in FIXTURES:
            fixture, _, mode = name.partition("@")
            moepack.convert(fixture_dir(fixture), Path(root) / name, act_mode=mode or None)
        t0 = time.perf_counter()
        args = [(root, j, a.jobs, a.cases, a.seed, a.kind, a.verify_source) for j in range(a.jobs)]
        if a.jobs == 1:
            results = [_worker(args[0])]
        else:
            with mp.get_context("spawn").Pool(a.jobs) as pool:
                results = pool.map(_worker, args)
        secs = time.perf_counter() - t0
    counts, bugs = Counter(), []
    for c, b in results:
        counts.update(c)
        bugs += b
    print(f"{a.cases} cases, seed {a.seed}, {a.jobs} job(s), {secs:.0f} s, fixtures: {', '.join(FIXTURES)}")
    for kind in ("manifest", "header"):
        row = {cls: counts[(kind, cls)] for cls in ("refused", "identical", "other_model", "other_config", "crash", "silent",
                                                     "missed")}  # fmt: skip
        if sum(row.values()):
            print(f"  {kind:8s} " + "  ".join(f"{k} {v}" for k, v in row.items()))
    for k, name, i, edits, detail in sorted(bugs, key=lambda b: b[2]):
        print(f"BUG {k} case {i} on {name}: {edits}: {detail}")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
