"""The shape of moepack's imports (issue 46): read with ast, nothing executed. No import cycle at
module level (a cycle works only while its modules happen to be imported in one order), and no
private (underscore) name imported from another module (a private name is the module's own
business: another module that needs it needs a public name). Also: the convert and verify
packages keep ``moepack.convert(...)`` / ``moepack.verify(...)`` callable."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import moepack

ROOT = Path(moepack.__file__).resolve().parent.parent

# Private names imported across modules that stay, each with its reason.
ALLOWED_PRIVATE = {
    # the compiled extension: its name is the build's (setup.py), not a module's private name
    ("moepack.variants", "moepack", "_C"),
    ("moepack._ops", "moepack", "_C"),
    # issue 48's files (moepack/hf.py is being split along its parts by the families work at the same
    # time; its public source-plan API replaces these three, see docs/ARCHITECTURE.md "Not yet")
    ("moepack.convert.plan", "moepack.hf", "_block_shapes"),
    ("moepack.convert.plan", "moepack.hf", "_decoder_layers"),
    ("moepack.convert.plan", "moepack.hf", "_moe_blocks"),
}


def _modules() -> dict[str, Path]:
    """Every module of moepack (cli/ is moepack.cli), by dotted name."""
    out = {}
    for base, pkg in ((ROOT / "moepack", "moepack"), (ROOT / "cli", "moepack.cli")):
        for p in base.rglob("*.py"):
            rel = p.relative_to(base)
            if "__pycache__" in p.parts or (pkg == "moepack" and rel.parts[0] == "cli"):  # moepack/cli: the link to cli/
                continue
            name = ".".join((pkg, *rel.with_suffix("").parts))
            out[name.removesuffix(".__init__")] = p
    return out


def _imports(name: str, path: Path, mods: dict) -> list[tuple[str, str | None, bool]]:
    """(module imported, the name taken from it or None for a module, at module level?) of every
    import statement of ``name`` (``if TYPE_CHECKING:`` blocks left out: they never run)."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []

    def visit(node, top: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(ch, False)
            elif isinstance(ch, ast.If) and "TYPE_CHECKING" in ast.unparse(ch.test):
                continue
            elif isinstance(ch, ast.ImportFrom):
                mod = ch.module or ""
                if ch.level:
                    mod = ".".join(here[: len(here) - ch.level + 1] + ([mod] if mod else []))
                for a in ch.names:
                    sub = f"{mod}.{a.name}"
                    out.append((sub, None, top) if sub in mods else (mod, a.name, top))
            elif isinstance(ch, ast.Import):
                out.extend((a.name, None, top) for a in ch.names)
            else:
                visit(ch, top)

    visit(ast.parse(path.read_text()), True)
    return out


def _graph():
    mods = _modules()
    graph: dict[str, set] = {m: set() for m in mods}
    private = set()
    for m, p in mods.items():
        for target, taken, top in _imports(m, p, mods):
            if target not in mods or target == m:
                continue
            if top:
                graph[m].add(target)
            if taken and taken.startswith("_") and not taken.startswith("__"):
                private.add((m, target, taken))
    return mods, graph, private


def _cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def longest_chain(graph: dict) -> list[str]:
    """The longest chain of module-level imports (the graph has no cycle)."""
    memo: dict[str, list] = {}

    def walk(v: str) -> list[str]:
        if v not in memo:
            memo[v] = [v] + max((walk(w) for w in graph[v]), key=len, default=[])
        return memo[v]

    return max((walk(v) for v in graph), key=len)


def test_the_walk_sees_every_module():
    mods, graph, _ = _graph()
    assert {"moepack", "moepack.convert.run", "moepack.verify.values", "moepack.cli.main", "moepack.schemes.base",
            "moepack.sources.linears", "moepack.bench.timing"} <= set(mods)  # fmt: skip
    assert "moepack.schemes.base" in graph["moepack.schemes.fp8"]  # relative imports resolved


def test_no_import_cycle_at_module_level():
    _, graph, _ = _graph()
    cycles = _cycles(graph)
    assert not cycles, f"module-level import cycles: {cycles}"
    assert len(longest_chain(graph)) < 20


def test_no_private_name_is_imported_across_modules():
    _, _, private = _graph()
    bad = sorted(private - ALLOWED_PRIVATE)
    assert not bad, f"private names imported from another module (importer, module, name): {bad}"
    assert not ALLOWED_PRIVATE - private, f"allowed but no longer imported (drop them): {sorted(ALLOWED_PRIVATE - private)}"


def test_the_walk_finds_a_cycle_and_a_private_import(tmp_path):
    """The checks above can fail: a made-up cycle, and a private name imported at module level."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert longest_chain({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}) == ["d", "a", "b", "c"]
    mods = {"moepack.x": tmp_path / "x.py", "moepack.y": tmp_path / "y.py"}
    mods["moepack.x"].write_text("from .y import _hidden, shown\nimport moepack.y\ndef f():\n    from . import y\n")
    got = _imports("moepack.x", mods["moepack.x"], mods)
    assert ("moepack.y", "_hidden", True) in got and ("moepack.y", None, True) in got and ("moepack.y", None, False) in got


def test_convert_and_verify_are_packages_and_stay_callable():
    """moepack/convert/ and moepack/verify/ are packages; ``moepack.convert(...)`` and
    ``moepack.verify(...)`` are still the functions (the package module is callable), with their
    signatures, and their parts import by every spelling."""
    import importlib

    import moepack.convert.plan as plan  # noqa: F401 - the spelling that needs the package as an attribute
    from moepack.convert import run
    from moepack.verify import values

    assert callable(moepack.convert) and callable(moepack.verify)
    assert moepack.convert.convert is run.convert and moepack.verify.verify is importlib.import_module("moepack.verify.run").verify
    assert inspect.signature(moepack.convert) == inspect.signature(run.convert)
    assert "source" in inspect.signature(moepack.verify).parameters
    assert moepack.verify.values is values and plan.__name__ == "moepack.convert.plan"
    assert (ROOT / "moepack/convert/__init__.py").is_file() and (ROOT / "moepack/verify/__init__.py").is_file()
    assert not list((ROOT / "moepack").glob("convert_*.py")) and not list((ROOT / "moepack").glob("verify_*.py"))


def test_moepack_convert_runs_through_the_package(tmp_path):
    """Calling the packages converts a fixture and verifies the result."""
    from tests.support.fixtures_util import fixture_dir

    rep = moepack.convert(fixture_dir("qwen3_moe"), tmp_path / "dst")
    assert rep is not None and (tmp_path / "dst" / "moepack.json").is_file()
    assert moepack.verify(tmp_path / "dst").ok
