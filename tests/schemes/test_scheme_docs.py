"""docs/schemes/<scheme>.md are generated from the registries (tools/gen_scheme_docs.py): one page
per registered scheme, each as the code says it, so the pages cannot go stale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import moepack
from moepack.schemes import schemes

ROOT = Path(moepack.__file__).resolve().parent.parent


def test_every_scheme_has_its_page_as_the_code_says():
    r = subprocess.run([sys.executable, str(ROOT / "tools/gen_scheme_docs.py"), "--check"], capture_output=True, text=True,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert {p.stem for p in (ROOT / "docs/schemes").glob("*.md")} == {s.name for s in schemes()}


def test_a_page_holds_its_layouts_readers_and_rules():
    text = (ROOT / "docs/schemes/fp8_block.md").read_text()
    for want in ("f8g128_n32k2_x86", "compressed-tensors-float-quantized", "f8codes", "--quantize fp8_block", "## Kernels"):
        assert want in text, want
