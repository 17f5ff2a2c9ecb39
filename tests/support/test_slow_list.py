"""tests/support/slow.py names test functions that exist (a renamed or moved test must not leave
its entry behind, silently back in `make check`), and the conftest marks exactly those."""

import ast
from pathlib import Path

import pytest

from tests.support.slow import SLOW

TESTS = Path(__file__).resolve().parents[1]


def _test_functions() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for p in TESTS.rglob("test_*.py"):
        assert p.name not in out, f"two test files named {p.name}: tests/support/slow.py keys by file name"
        tree = ast.parse(p.read_text())
        out[p.name] = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")}
    return out


def test_every_slow_entry_is_a_test_function():
    funcs = _test_functions()
    missing = [k for k in SLOW if k.split("::")[1] not in funcs.get(k.split("::")[0], set())]
    assert not missing, f"tests/support/slow.py names tests that do not exist: {missing}"


@pytest.mark.parametrize("key", sorted(SLOW)[:3])
def test_the_conftest_marks_them(request, key):
    items = [i for i in request.session.items if f"{i.path.name}::{getattr(i, 'originalname', i.name)}" == key]
    if not items:  # not collected in this run (a selection): the marking is checked where it is
        return
    assert all(i.get_closest_marker("slow") for i in items), key


def test_first_names_test_files_and_they_are_collected_first(request):
    from tests.support.slow import FIRST

    funcs = _test_functions()
    assert FIRST and all(name in funcs for name in FIRST), f"tests/support/slow.py FIRST names no test file: {FIRST}"
    # in a whole-suite collection the FIRST files' tests precede every other file's
    names = [item.path.name for item in request.session.items]
    if set(FIRST) & set(names) and len(set(names)) > len(FIRST):
        last_first = max(i for i, n in enumerate(names) if n in FIRST)
        first_other = min(i for i, n in enumerate(names) if n not in FIRST)
        assert last_first < first_other, names[: last_first + 1]
