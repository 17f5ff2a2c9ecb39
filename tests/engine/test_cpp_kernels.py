"""Builds and runs tests/cpp/test_kernels (torch-free kernel tests); see tests/cpp/build.py and
tests/cpp/test_kernels.cpp.

Two binaries from one build directory (the objects they share are compiled once):
* test_kernels_native: scalar, every level this CPU runs natively, the omit objects and the hook
  counts; needs a C++ compiler only, so it runs everywhere (``make check``);
* test_kernels (marker ``emulated``): the same objects plus the levels this CPU may lack (x86:
  the AVX-512 family) compiled against SIMDe's portable intrinsics, run with ``--emulated-only``:
  only the emulated levels are tested (scalar is their oracle), since the native binary tests
  the rest; without SIMDe it fails under CI=true and is a "missing" skip elsewhere (conftest),
  while the native binary still runs."""

import importlib.util
import os
import re
import shlex
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
BUILD_PY = os.path.join(HERE, "cpp", "build.py")


def _load_builder():
    spec = importlib.util.spec_from_file_location("moepack_cpp_test_build", BUILD_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build_and_run(emulate: bool) -> str:
    b = _load_builder()
    compiler = shlex.split(os.environ.get("CXX", "g++"))[0]
    assert shutil.which(compiler), f"no C++ compiler ({compiler}) to build tests/cpp"
    log = []
    try:
        exe = b.build(b.DEFAULT_BUILD, log=log.append, emulate=emulate)
    except RuntimeError as e:
        pytest.fail(f"building tests/cpp/{'test_kernels' if emulate else 'test_kernels_native'} failed:\n{e}", pytrace=False)
    r = subprocess.run([exe] + (["--emulated-only"] if emulate else []), capture_output=True, text=True, timeout=600)
    out = "\n".join(log) + "\n" + r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    m = re.fullmatch(r"(\d+) passed, (\d+) failed", last)
    if r.returncode != 0 or m is None or int(m.group(2)) != 0 or int(m.group(1)) == 0:
        pytest.fail(f"tests/cpp/{os.path.basename(exe)} exited {r.returncode}:\n{out[-20000:]}", pytrace=False)
    print(out)
    return r.stdout


def test_cpp_kernels_native():
    out = _build_and_run(emulate=False)
    assert re.search(r"^kernels: .*\(each vs scalar\)$", out, re.M), out[-3000:]
    assert "-emu" not in out.split("max errors")[0], out[-3000:]  # no emulated object is linked in this binary


@pytest.mark.emulated
def test_cpp_kernels():
    out = _build_and_run(emulate=True)
    dense = re.search(r"^kernels: (.*)  \(each vs scalar\)$", out, re.M)
    # the emulated levels ran, and only they (the native binary tests the others)
    assert dense and dense.group(1).split() and all(k.endswith("-emu") for k in dense.group(1).split()), out[-3000:]
