"""The shape of the scheme code (issue 27): one package per scheme, generic code that asks the
scheme instead of naming it, the dependency between moepack/pack and moepack/schemes one way,
and the older import paths still answering."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moepack
from moepack.layout import LAYOUTS
from moepack.schemes import get_scheme, schemes

ROOT = Path(moepack.__file__).resolve().parent.parent
# Code that may name a scheme, and why; every other module of moepack/ and cli/ (recursively) is
# generic: none of them may branch on a scheme's name (they ask the scheme).
SCHEME_AWARE = {
    "moepack/schemes/": "the schemes themselves",
    "moepack/sources/": "a reader reads one format and says which scheme its values are; quant_method "
                        "names ('fp8', 'mxfp4') coincide with scheme aliases",
    "moepack/layout.py": "THE table of layouts: each layout names its scheme",
    "moepack/isa_levels.py": "THE table of ISA levels: what each level serves, per kind",
    "moepack/bench/peers/": "the peers' own names for each scheme (vLLM, zentorch); issue 46 moves them to the schemes",
}
DTYPE_NAMES = {"bf16", "int8"}  # scheme aliases that are also dtype names ("int8": torch.int8)


def _generic() -> list[str]:
    files = [*(ROOT / "moepack").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]
    rel = sorted({str(p.relative_to(ROOT)) for p in files if "__pycache__" not in p.parts and not str(p.relative_to(ROOT)).startswith("moepack/cli/")})
    return [r for r in rel if not any(r.startswith(k) for k in SCHEME_AWARE)]


GENERIC = _generic()


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(absolute module imported, inside a function) for every import of a moepack module file."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name == "__init__.py":
        pkg += ".__init__"
    base = pkg.split(".")[:-1]
    out = []

    def visit(node, in_func):
        for child in ast.iter_child_nodes(node):
            f = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                mod = child.module or ""
                if child.level:
                    mod = ".".join(base[: len(base) - child.level + 1] + ([mod] if mod else []))
                out.append((mod, f))
                out.extend((f"{mod}.{a.name}", f) for a in child.names)
            elif isinstance(child, ast.Import):
                out.extend((a.name, f) for a in child.names)
            visit(child, f)

    visit(tree, False)
    return out


def test_pack_never_imports_a_scheme():
    """Generic packing (moepack/pack) sits below the schemes: it looks a scheme up in the
    registry; an import of moepack.schemes from there would bring the old cycle back."""
    files = sorted((ROOT / "moepack/pack").glob("*.py"))
    assert {p.name for p in files} >= {"__init__.py", "codes.py", "registry.py"}
    bad = [(p.name, m) for p in files for m, _ in _imports(p) if m.startswith("moepack.schemes")]
    assert not bad, f"moepack/pack imports scheme code: {bad}"


def test_schemes_import_pack_at_module_level_only():
    """The schemes depend on moepack.pack, at the top of their modules (no function-local
    import hiding a cycle)."""
    local = [(str(p.relative_to(ROOT)), m) for p in sorted((ROOT / "moepack/schemes").rglob("*.py"))
             for m, in_func in _imports(p) if in_func and m.startswith(("moepack.pack", "moepack.schemes"))]  # fmt: skip
    assert not local, local


def test_every_scheme_is_a_package_with_its_parts():
    for s in schemes():
        pkg = ROOT / "moepack/schemes" / s.name.split("_")[0]
        assert (pkg / "__init__.py").exists(), s.name
        if s.quantized:  # dense has no quantizer of its own; its pack and reference are in __init__
            for part in ("quantize.py", "pack.py", "reference.py"):
                assert (pkg / part).exists(), (s.name, part)
    assert [s.name for s in schemes()] == ["dense", "int8_channel", "int4_group", "fp8_block", "mxfp4", "nvfp4"]


def test_generic_is_every_module_but_the_scheme_aware_ones():
    """GENERIC walks moepack/ and cli/ recursively: the convert and verify packages, runtime/,
    _ops.py, bench/ are in it; each scheme-aware entry exists (a renamed one cannot hide a module)."""
    for must in ("moepack/convert/run.py", "moepack/verify/values.py", "moepack/runtime/experts.py", "moepack/_ops.py",
                 "moepack/bench/run.py", "moepack/hf.py", "cli/packdir.py", "moepack/tp.py"):
        assert must in GENERIC, must
    for k in SCHEME_AWARE:
        assert (ROOT / k).exists(), k
    assert len(GENERIC) > 40


@pytest.mark.parametrize("path", GENERIC)
def test_generic_modules_do_not_name_a_scheme(path):
    """No string constant of a generic module (docstrings and help texts aside: they describe,
    not branch) is a scheme's name or alias."""
    names = {k for s in schemes() for k in (s.name, *s.aliases)} - DTYPE_NAMES
    tree = ast.parse((ROOT / path).read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}  # fmt: skip
    hits = [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and n.value in names]  # fmt: skip
    assert not hits, f"{path} branches on scheme names: {hits}"


@pytest.mark.parametrize("name, where", [
    ("quantize_int8_per_channel", "moepack.schemes.int8.quantize"),
    ("dequantize_int8", "moepack.schemes.int8.quantize"),
    ("pack_experts_int8", "moepack.schemes.int8.pack"),
    ("pack_int8_weight", "moepack.schemes.int8.pack"),
    ("pack_dense", "moepack.schemes.dense"),
])  # fmt: skip
def test_older_import_paths_resolve_through_the_registry(name, where):
    import importlib

    import moepack.pack as P

    got = getattr(P, name)
    assert got is getattr(importlib.import_module(where), name)
    ns: dict = {}
    exec(f"from moepack.pack import {name} as f", ns)  # the spelling external code uses
    assert ns["f"] is got
    with pytest.raises(AttributeError, match="no attribute 'quantize_int9'"):
        P.quantize_int9  # noqa: B018


def test_every_layout_has_a_scheme_that_says_what_generic_code_asks():
    for lay in LAYOUTS:
        s = get_scheme(lay)
        assert s.name == lay.scheme and isinstance(s.quantized, bool) and s.weights_note
        assert s.bench.check_tol > 0
    assert not get_scheme("dense").quantized and get_scheme("int8").quantized and get_scheme("int4").quantized


def test_every_package_is_in_the_wheel():
    """pyproject.toml finds the packages a wheel holds (setuptools' find over its include
    patterns): every package under moepack/ is found, so a new one cannot be left out."""
    import tomllib

    from setuptools import find_packages

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(cfg["packages"]) == {"find"}, "packages are found (tool.setuptools.packages.find), not listed"
    listed = set(find_packages(str(ROOT), **cfg["packages"]["find"]))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "moepack").rglob("__init__.py")
             if "__pycache__" not in p.parts}  # fmt: skip
    found |= {"moepack.cli"}  # a link to cli/ (rglob does not follow it)
    assert found == listed, f"found by setuptools: {sorted(listed)}; packages under moepack/: {sorted(found)}"
