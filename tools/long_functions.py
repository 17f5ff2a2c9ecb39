#!/usr/bin/env python3
"""List the library's functions longer than a limit (default 80 lines), longest first.

    python tools/long_functions.py [--limit 80] [paths...]   (default: moepack cli csrc)

Python functions come from the ast (decorators excluded, nested functions counted inside their
parent and listed on their own too). C++ functions are found by shape: a line at brace depth 0
(or inside a namespace) that ends a signature with `{`, up to its matching `}`; lambdas and
struct bodies are not functions, their member functions are. Good enough for a review list, not
a parser: it reads comments and strings naively, so a brace inside a string can fool it."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

CPP_EXT = {".cpp", ".h", ".inc", ".cc", ".hpp"}
_SIG = re.compile(r"^\s*(?:template\s*<[^>]*>\s*)?(?:[\w:<>,*&\s\[\]]+?)\b(\w+)\s*\([^;]*\)\s*(?:const\s*)?(?:noexcept\s*)?(?:->\s*[\w:<>*&]+\s*)?\{\s*(//.*)?$")
_NOT_FUNC = {"if", "for", "while", "switch", "catch", "return", "sizeof", "static_assert", "requires"}


def python_functions(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def cpp_functions(path: Path):
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _SIG.match(line)
        if m and m.group(1) not in _NOT_FUNC:
            depth, j = 0, i
            while j < len(lines):
                code = lines[j].split("//", 1)[0]
                depth += code.count("{") - code.count("}")
                if depth <= 0 and j >= i:
                    break
                j += 1
            yield m.group(1), i + 1, j - i + 1
            i += 1  # member functions of a struct are matched on their own lines
            continue
        i += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("paths", nargs="*", default=["moepack", "cli", "csrc"])
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    found = []
    for p in args.paths:
        base = (root / p) if not Path(p).is_absolute() else Path(p)
        files = [base] if base.is_file() else sorted(base.rglob("*"))
        for f in files:
            if f.suffix == ".py":
                items = python_functions(f)
            elif f.suffix in CPP_EXT:
                items = cpp_functions(f)
            else:
                continue
            for name, line, n in items:
                if n > args.limit:
                    found.append((n, f"{f.relative_to(root)}:{line}", name))
    for n, where, name in sorted(found, reverse=True):
        print(f"{n:5d}  {where}  {name}")
    print(f"{len(found)} functions over {args.limit} lines")


if __name__ == "__main__":
    main()
