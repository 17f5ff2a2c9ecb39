"""moepack/isa_levels.py is THE list of ISA levels: the generated C++ header and the docs table
must match it (tools/gen_isa.py --check), every level's kernel file must register what its
`serves` says and nothing else (through the generated list), the compiled extension must report
the same levels, and setup.py must build exactly the files the list names (docs/CONTRIBUTING.md:
how to add an ISA level)."""

from __future__ import annotations

import pathlib
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch

import moepack
from moepack import isa_levels
from moepack.isa import ISAS, KERNEL_ISAS, layout_isas
from moepack.layout import FAMILIES, LAYOUTS, SCHEMES, WEIGHT_DTYPES, scheme_dirs_for_tests
from tests.support import skips

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = pathlib.Path("csrc/include/moepack/isa_gen.h")
KERNELS_MD = pathlib.Path("docs/KERNELS.md")
LIST = pathlib.Path("moepack/isa_levels.py")


def run_check(root: pathlib.Path) -> subprocess.CompletedProcess:
    # A subprocess, like the Makefile's `make test-only` runs it.
    return subprocess.run([sys.executable, str(root / "tools" / "gen_isa.py"), "--check"], capture_output=True,
                          text=True, timeout=60)


def test_generated_files_are_up_to_date():
    r = run_check(ROOT)
    assert r.returncode == 0, f"tools/gen_isa.py --check failed:\n{r.stdout}{r.stderr}"
    assert "up to date" in r.stdout


# (file, text, replacement, the files --check must then call stale); None: delete the file
EDITS = {
    "header": (HEADER, "avx512_bf16 = 5", "avx512_bf16 = 6", [HEADER]),
    "docs table": (KERNELS_MD, "| avx512_vnni |", "| avx512vnni |", [KERNELS_MD]),
    "list": (LIST, 'cpu("AVX512_BF16", "avx512_bf16")', 'cpu("AVX512 BF16", "avx512_bf16")', [HEADER, KERNELS_MD]),
    "no header": (HEADER, None, None, [HEADER]),
    # the layouts decide the (scheme, mode) kernels each level registers: mxfp4 without A8
    "layouts": (pathlib.Path("moepack/layout.py"), 'scheme="mxfp4",\n        act_modes=("a16", "a8"), code_order=U4_CODE_ORDER,',
                'scheme="mxfp4",\n        act_modes=("a16",), code_order=U4_CODE_ORDER,', [HEADER]),
}


@pytest.mark.parametrize("edit", EDITS)
def test_check_detects_a_stale_file(tmp_path, edit):
    path, old, new, stale = EDITS[edit]
    # what gen_isa.py reads and writes (the layouts through gen_layouts.py's loader)
    # and the test-only schemes' layouts, which the generated tables hold (moepack/layout.py add_testonly_schemes)
    testonly = [d.relative_to(ROOT) / "layouts.py" for d in scheme_dirs_for_tests()]
    for rel in ("tools/gen_isa.py", "tools/gen_layouts.py", "moepack/layout.py", "moepack/errors.py", LIST, HEADER,
                KERNELS_MD, *testonly):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    assert run_check(tmp_path).returncode == 0
    if old is None:
        (tmp_path / path).unlink()
    else:
        text = (tmp_path / path).read_text()
        assert text.count(old) == 1
        (tmp_path / path).write_text(text.replace(old, new))
    r = run_check(tmp_path)
    assert r.returncode == 1
    assert {p for p in (HEADER, KERNELS_MD) if f"{p} is stale" in r.stderr} == set(stale), r.stderr


def test_the_list_names_known_layout_kinds():
    for lv in isa_levels.LEVELS:
        for entry in lv.serves or ():  # "kind" (every act mode) or "kind:mode"
            kind, _, mode = entry.partition(":")
            assert kind in WEIGHT_DTYPES and mode in ("", *isa_levels.SERVE_MODES), (lv.name, entry)
    for a in isa_levels.ARCHES:
        assert a.layout_family in FAMILIES, a
    assert set(KERNEL_ISAS) == {lay.weight_dtype for lay in LAYOUTS}
    assert ISAS == tuple(lv.name for lv in isa_levels.LEVELS)


def generated_kernels() -> dict[str, set[tuple[str, str]]]:
    """isa_gen.h's kIsaLevels: per level, the (scheme, mode) kernels its file registers (IsaLevel::kernels)."""
    rows = re.findall(r'^    \{"(\w+)", (.*)$', (ROOT / HEADER).read_text(), re.M)
    return {name: set(re.findall(r"\(1u << kKernel_(\w+?)_(a16|a8)\)", row)) for name, row in rows}


@pytest.mark.parametrize("lv", isa_levels.LEVELS, ids=lambda lv: lv.name)
def test_every_level_registers_what_it_serves(lv):
    """Every level of every architecture, on any host (tests/cpp test_registration checks the table
    itself on the levels the test binary builds and runs): the kernels isa_gen.h has the level's
    file register are the (scheme, mode) of exactly the layouts the dispatcher lets it run
    (moepack.isa.layout_isas, csrc/dispatch.cpp isa_serves), and the file registers through that
    generated list alone (csrc/kernels/register.inc register_level), never by hand."""
    gen = generated_kernels()
    assert list(gen) == list(ISAS)
    # the test-only schemes' kernels (moepack/layout.py add_testonly_schemes: in the header always,
    # in LAYOUTS only under MOEPACK_TEST_SCHEMES=1) are the scalar level's alone
    known = {k for k in gen[lv.name] if k[0] in SCHEMES}
    assert known == {(x.scheme, m) for x in LAYOUTS for m in x.act_modes if lv.name in layout_isas(x, m)}
    assert lv.arch is None or known == gen[lv.name], gen[lv.name] - known
    src = (ROOT / lv.source).read_text()
    defs = re.findall(rf"^void register_{lv.name}\(KernelTable&( t)?\) \{{(.*)\}}$", src, re.M)
    real = [body.strip() for named, body in defs if named]
    assert real == [f"{lv.name}::register_level<Isa::{lv.name}>(t);"], (lv.source, defs)
    assert all(not body.strip() for named, body in defs if not named)  # the MOEPACK_OMIT_LEVEL stub
    assert "register_scheme" not in src, lv.source


def test_the_extension_knows_exactly_the_listed_levels():
    flags = moepack.cpu_flags()
    assert {f for f in flags if "=" not in f} <= set(isa_levels.features())
    available = next(f for f in flags if f.startswith("available_isas=")).split("=", 1)[1].split(",")
    assert set(available) <= set(ISAS)
    # parse_isa (the gemm_i8_block test hook): every listed name is a level, and the refusal lists them
    layout = next(x for x in LAYOUTS if x.weight_dtype == "i8")
    rows = torch.zeros(1, layout.k_pack, dtype=torch.int8)
    block = torch.zeros(layout.block_n * layout.k_pack, dtype=torch.int8)
    colsum = torch.zeros(layout.block_n, dtype=torch.int32)
    for name in ISAS:
        try:
            torch.ops.moepack.gemm_i8_block(rows, block, colsum, layout.id, name)
        except ValueError as e:  # a level without an int8 kernel here, never an unknown name
            assert f"no {name} int8 block GEMM" in str(e) and "is not one of" not in str(e)
    with pytest.raises(ValueError, match=re.escape(f"isa='avx9' is not one of {', '.join(ISAS)}")):
        torch.ops.moepack.gemm_i8_block(rows, block, colsum, layout.id, "avx9")


def test_isa_docstring_table_is_derived():
    import moepack.isa

    for name, needs, serves, _ in isa_levels.doc_rows():
        assert re.search(rf"^{name}\s+{re.escape(needs)}\s+{re.escape(serves)}$", moepack.isa.__doc__, re.M), name


@pytest.mark.parametrize("arch", isa_levels.ARCHES, ids=lambda a: a.name)
def test_every_arch_file_is_listed(arch):
    """setup.py's rule: csrc/<arch>/*.cpp is its levels' kernel files and cpu_features.cpp, nothing else."""
    found = {p.relative_to(ROOT).as_posix() for p in (ROOT / arch.folder).glob("*.cpp")}
    assert found == {lv.source for lv in isa_levels.arch_levels(arch.name)} | {arch.cpu_features_source}
    assert all((ROOT / lv.source).exists() for lv in isa_levels.LEVELS if lv.arch is None)


@pytest.fixture
def setup_copy(tmp_path) -> pathlib.Path:
    """setup.py with the list and the C++ sources, in a scratch tree."""
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    (tmp_path / "moepack").mkdir()
    shutil.copy(ROOT / LIST, tmp_path / LIST)
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    return tmp_path


def run_setup(root: pathlib.Path) -> subprocess.CompletedProcess:
    # --name evaluates the extension's sources (setup.py's checks) without building anything
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, capture_output=True, text=True, timeout=300)


def host_arch():
    arch = isa_levels.build_arch(platform.machine())
    if arch is None:
        skips.host_lacks(f"an architecture of moepack/isa_levels.py (platform.machine()={platform.machine()!r})")
    return arch


def test_setup_builds_the_listed_files(setup_copy):
    host_arch()
    r = run_setup(setup_copy)
    assert r.returncode == 0, r.stdout + r.stderr


def test_setup_refuses_an_unlisted_kernel_file(setup_copy):
    arch = host_arch()
    (setup_copy / arch.folder / "moe_avx1024.cpp").write_text("// no level lists this file\n")
    r = run_setup(setup_copy)
    assert r.returncode != 0
    assert f"['{arch.folder}/moe_avx1024.cpp'] are in {arch.folder}/ but are no ISA level's kernel file" in r.stderr


def test_setup_refuses_a_missing_level_file(setup_copy):
    arch = host_arch()
    lv = isa_levels.arch_levels(arch.name)[-1]
    (setup_copy / lv.source).unlink()
    r = run_setup(setup_copy)
    assert r.returncode != 0 and f"['{lv.source}'] do not exist: moepack/isa_levels.py lists them" in r.stderr
