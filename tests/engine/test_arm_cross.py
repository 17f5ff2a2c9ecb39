"""The ARM architecture on these x86 machines: tests/cpp cross-built for aarch64 with
aarch64-linux-gnu-g++ and run under qemu-user (qemu-aarch64 -cpu max), every level against
scalar (tests/cpp/test_kernels.cpp on the arm layouts), the CPU-feature probe under CPU models
with and without the optional features, and a known-answer test of every instruction the ARM
kernels use (tests/cpp/arm_kat.cpp), which says whether the emulator computes it as the Arm ARM
defines (docs/KERNELS.md "ARM": what was run natively and what only emulated).

Marked ``arm`` (``make test-arm``; deselect with -m "not arm"): where the cross toolchain or the
emulator is missing (make setup-test installs g++-aarch64-linux-gnu and qemu-user) these fail under
CI=true, naming it, and are skipped as "missing" elsewhere, which fails the run too (conftest)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.support import skips

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
BUILD_PY = os.path.join(HERE, "cpp", "build.py")
KAT_SRC = os.path.join(HERE, "cpp", "arm_kat.cpp")
BUILD_DIR = os.path.join(HERE, "cpp", "build", "arm")


def _load_builder():
    spec = importlib.util.spec_from_file_location("moepack_cpp_test_build_arm", BUILD_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


B = _load_builder()
pytestmark = pytest.mark.arm
RUNNER = B.CROSS_RUNNERS["arm"]  # qemu-aarch64 -cpu max


def _qemu(cpu: str) -> list[str]:
    return [RUNNER[0], "-cpu", cpu]


@pytest.fixture(scope="module")
def test_binary() -> str:
    log: list[str] = []
    try:
        return B.build(BUILD_DIR, log=log.append, arch_name="arm")
    except RuntimeError as e:
        pytest.fail(f"cross-building tests/cpp/test_kernels for aarch64 failed:\n{e}", pytrace=False)


@pytest.fixture(scope="module")
def kat_output() -> str:
    exe = os.path.join(BUILD_DIR, "arm_kat")
    os.makedirs(BUILD_DIR, exist_ok=True)
    cxx = B.CROSS_PREFIXES["arm"] + "g++"
    cmd = [cxx, "-std=c++20", "-O1", "-march=armv8.6-a+bf16+i8mm", "-ffp-contract=off", "-static", KAT_SRC, "-o", exe]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}{r.stderr}"
    r = subprocess.run(RUNNER + [exe], capture_output=True, text=True, timeout=120)
    assert re.search(r"^\d+ wrong$", r.stdout, re.M), f"arm_kat did not finish (exit {r.returncode}):\n{r.stdout}{r.stderr}"
    return r.stdout


# Every instruction the ARM kernels (and the int8 quantizer) execute for their results.
KAT_INSNS = ("sdot", "smmla", "bfdot", "bfmmla", "bfmlalb", "bfmlalt", "fmaxnm", "fminnm", "fmaxnmv", "frintn", "fdiv")


@pytest.mark.parametrize("insn", KAT_INSNS)
def test_the_emulator_computes_the_instruction(kat_output, insn):
    """qemu's answer for each instruction equals the Arm ARM's (exact operands, and random
    operands against the pseudocode model). A WRONG line is a failure: the emulator cannot then
    vouch for the kernels that use the instruction (they stay compiled and covered)."""
    lines = [ln for ln in kat_output.splitlines() if ln.startswith(f"KAT {insn} ")]
    assert lines, f"arm_kat printed no case of {insn}:\n{kat_output}"
    wrong = [ln for ln in lines if ": ok" not in ln]
    assert not wrong, f"the emulator ({' '.join(RUNNER)}) computes {insn} wrongly:\n" + "\n".join(wrong)


# (qemu CPU model, the ARM levels it has): the probe (csrc/arm/cpu_features.cpp, getauxval) must
# report exactly these as available
CPU_MODELS = {
    "cortex-a53": ("neon",),  # ARMv8.0: Advanced SIMD only
    "neoverse-n1": ("neon", "neon_dotprod"),  # ARMv8.2 + dotprod
    "max": ("neon", "neon_dotprod", "neon_i8mm", "neon_bf16"),
}


@pytest.mark.parametrize("cpu", CPU_MODELS)
def test_the_probe_finds_the_levels_of_the_cpu_model(test_binary, cpu):
    r = subprocess.run(_qemu(cpu) + [test_binary, "--levels"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    levels = dict(re.findall(r"^level (\w+): (.*)$", r.stdout, re.M))
    arm = {name: why for name, why in levels.items() if name.startswith("neon")}
    assert set(arm) == set(CPU_MODELS["max"]), r.stdout
    assert {n for n, why in arm.items() if why == "available"} == set(CPU_MODELS[cpu]), r.stdout
    for name, why in arm.items():
        if why != "available":
            assert why.startswith("the CPU lacks"), (name, why)
    assert levels["avx2"] == "not an x86 CPU", r.stdout
    assert levels["scalar"] == "available"


def test_every_arm_level_equals_scalar_under_qemu(test_binary):
    """tests/cpp/test_kernels --quick under qemu-aarch64 -cpu max: each NEON level against scalar
    (integer accumulators exactly, fp32 outputs within 1e-6 relative, every activation, biases,
    shapes not multiples of the blocks) on the arm layouts; the int8 quantizer bit for bit."""
    r = subprocess.run(RUNNER + [test_binary, "--quick"], capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    m = re.fullmatch(r"(\d+) passed, (\d+) failed", last)
    if r.returncode != 0 or m is None or int(m.group(2)) != 0 or int(m.group(1)) == 0:
        pytest.fail(f"tests/cpp/test_kernels under {' '.join(RUNNER)} exited {r.returncode}:\n{out[-20000:]}", pytrace=False)
    # every level ran: dense kernels and int8 kernels list them
    dense = re.search(r"^kernels: (.*?)  \(each vs scalar\)$", r.stdout, re.M)
    int8 = re.search(r"^int8 kernels: (.*)$", r.stdout, re.M)
    assert dense and set(dense.group(1).split()) == {"neon", "neon_bf16"}, out[-3000:]
    assert int8 and set(int8.group(1).split()) == {"scalar", "neon", "neon_dotprod", "neon_i8mm"}, out[-3000:]
    assert "not run" not in r.stdout, out[-3000:]
    # the arm mxfp4 layout: A16 where the decode feeds a dense gemm, A8 where an integer core runs
    mx4 = re.search(r"^mx4g32_n16k8_arm kernels: a16 (.*); a8 (.*)$", r.stdout, re.M)
    assert mx4 and mx4.group(1).split() == ["neon", "neon_bf16"], out[-3000:]
    assert mx4.group(2).split() == ["neon", "neon_dotprod", "neon_i8mm"], out[-3000:]
    print(out[-3000:])


# The Python extension cross-built for aarch64 (tools/cross_build_ext.py) against the aarch64 torch
# wheel, where the wheel is here (MOEPACK_ARM_TORCH_WHEEL names it, or `make setup-test` / `make
# cross-ext` downloaded it into build/cross-arm/wheel; ~430 MB, fetched once). About 120 CPU s on
# the 2-core Zen 3 (10 files at -O3), the same objects as `make cross-ext` (rebuilt only when a
# source changed).
@pytest.mark.requires("arm_wheel")
def test_the_extension_cross_builds_for_aarch64(tmp_path):
    """tools/cross_build_ext.py: every source with setup.py's flags for arm, linked against the
    wheel's libraries; it checks the result (an AArch64 shared object exporting PyInit__C, the op
    library and every op schema, each level's register function and key instruction)."""
    tool = os.path.join(os.path.dirname(HERE), "tools", "cross_build_ext.py")
    out = tmp_path / "_C.so"
    r = subprocess.run([sys.executable, tool, "--wheel", skips.arm_wheel(), "--out", str(out)], capture_output=True, text=True,
                       timeout=1800)  # fmt: skip
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert "ELF64 AArch64 shared object" in r.stdout and out.exists(), r.stdout
