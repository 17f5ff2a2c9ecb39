"""Builds and runs tests/cpp/test_kernels (torch-free kernel tests, incl. the AVX-512 kernel
emulated through SIMDe); see tests/cpp/build.py and tests/cpp/test_kernels.cpp."""

import importlib.util
import os
import re
import shlex
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_PY = os.path.join(HERE, "cpp", "build.py")


def _load_builder():
    spec = importlib.util.spec_from_file_location("moepack_cpp_test_build", BUILD_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpp_kernels():
    b = _load_builder()
    compiler = shlex.split(os.environ.get("CXX", "g++"))[0]
    assert shutil.which(compiler), f"no C++ compiler ({compiler}) to build tests/cpp"
    ok, why = b.simde_available()
    if not ok:
        pytest.skip(f"{why} (SIMDe is needed to emulate the AVX-512 kernel: apt-get install libsimde-dev)")
    log = []
    try:
        exe = b.build(b.DEFAULT_BUILD, log=log.append)
    except RuntimeError as e:
        pytest.fail(f"building tests/cpp/test_kernels failed:\n{e}", pytrace=False)
    r = subprocess.run([exe], capture_output=True, text=True, timeout=600)
    out = "\n".join(log) + "\n" + r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    m = re.fullmatch(r"(\d+) passed, (\d+) failed", last)
    if r.returncode != 0 or m is None or int(m.group(2)) != 0 or int(m.group(1)) == 0:
        pytest.fail(f"tests/cpp/test_kernels exited {r.returncode}:\n{out[-20000:]}", pytrace=False)
    print(out)
