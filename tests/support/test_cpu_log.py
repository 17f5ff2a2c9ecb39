"""tests/support/cpu_log.py: the per-test CPU log that tools/test_suites.py prints from."""

import json
import subprocess
import sys

from tests.support import cpu_log


def test_a_recorded_test_counts_its_waited_children(tmp_path):
    log = tmp_path / "cpu.jsonl"
    rec = cpu_log.Recorder(str(log))
    done = rec.measure("tests/x.py::test_child[a]")
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    done()
    rec.measure("tests/x.py::test_child[b]")()
    rec.close()
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["tests/x.py::test_child[a]", "tests/x.py::test_child[b]"]
    assert rows[0]["children"] > 0.05 and rows[0]["wall"] >= rows[0]["children"] * 0.5
    assert rows[1]["children"] == 0


def test_summary_folds_parameters_and_orders_by_cpu(tmp_path):
    log = tmp_path / "cpu.jsonl"
    rows = [("a.py::test_small", 1.0, 0.0, 2.0), ("a.py::test_big[x]", 3.0, 4.0, 9.0), ("a.py::test_big[y]", 1.0, 0.5, 2.0)]
    log.write_text("".join(json.dumps({"id": i, "self": s, "children": c, "wall": w}) + "\n" for i, s, c, w in rows))
    lines = cpu_log.summary(log).splitlines()
    assert lines[0] == "2 test functions: 10 CPU s (self + waited children), 13 wall s; the largest:"
    assert lines[1].split() == ["8.5", "CPU", "s", "11.0", "wall", "s", "2", "cases", "a.py::test_big"]
    assert lines[2].split()[-1] == "a.py::test_small"
