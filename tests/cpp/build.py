#!/usr/bin/env python3
"""Build (and optionally run) tests/cpp/test_kernels: the torch-free kernel test binary.

    python tests/cpp/build.py [--build-dir DIR] [--run [-- ARGS...]]

Translation units (each with the flags setup.py gives it, -O2):
  scalar        csrc/ref/moe_scalar.cpp     no ISA flags
  pack          csrc/pack.cpp               no ISA flags
  dispatch      csrc/dispatch.cpp           no ISA flags (cpu detection, fused_moe_check_routing)
  avx2          csrc/x86/moe_avx2.cpp       -mavx2 -mfma -mf16c
  for each level L in avx_vnni, avx512, avx512_vnni, avx512_bf16 (csrc/x86/moe_L.cpp):
    L_emu       the file against SIMDe's portable intrinsics (-DMOEPACK_EMULATE_AVX512 or
                -DMOEPACK_EMULATE_AVX_VNNI), NO flags of the level; -mavx2 -mfma -mf16c when the
                build host has them (avx_vnni: only then). Exports register_L, so the binary runs
                it on any x86-64 host.
    L_native    the file with the level's own flags, register_L renamed register_L_native; run
                only on CPUs that have the level.
    L_omit      the file with -DMOEPACK_OMIT_LEVEL (what setup.py builds when the compiler lacks
                the level's flags): compiled and its exports checked, not linked.
  test          tests/cpp/test_kernels.cpp  no ISA flags

After compiling it checks that the emulated object contains no AVX-512 instruction (no zmm, opmask
or EVEX-only register) and that every ISA object exports nothing but its register_* function
(an exported inline function compiled with ISA flags could be picked by the linker for baseline
code). Needs g++ (or $CXX) and SIMDe (Debian/Ubuntu: apt-get install libsimde-dev).
Objects are rebuilt when a source, a csrc header or this script is newer, or flags changed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CSRC = os.path.join(ROOT, "csrc")
DEFAULT_BUILD = os.path.join(HERE, "build")

COMMON = ["-std=c++20", "-O2", "-fno-math-errno", "-Wall", "-Wno-unused-function", "-I" + os.path.join(CSRC, "include")]
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-Wno-maybe-uninitialized"]
# The levels built twice (emulated and native): name -> (source, native flags, emulation define)
LEVELS = {
    "avx_vnni": ("csrc/x86/moe_avx_vnni.cpp", AVX2 + ["-mavxvnni"], "-DMOEPACK_EMULATE_AVX_VNNI"),
    "avx512": ("csrc/x86/moe_avx512.cpp", AVX512, "-DMOEPACK_EMULATE_AVX512"),
    "avx512_vnni": ("csrc/x86/moe_avx512_vnni.cpp", AVX512 + ["-mavx512vnni"], "-DMOEPACK_EMULATE_AVX512"),
    "avx512_bf16": ("csrc/x86/moe_avx512_bf16.cpp", AVX512 + ["-mavx512bf16"], "-DMOEPACK_EMULATE_AVX512"),
}
# What an emulated object must not contain: AVX-512 encodings (zmm registers, opmask registers,
# xmm/ymm 16-31: EVEX only) and the dot-product instructions (VEX AVX-VNNI included).
EMULATED_INSN = re.compile(r"%?\bzmm\d+|%k[0-7]\b|\b[xy]mm(1[6-9]|2\d|3[01])\b|\bv(pdpbus|pdpws|dpbf16)")


def cxx() -> list[str]:
    return shlex.split(os.environ.get("CXX", "g++"))


def simde_available() -> tuple[bool, str]:
    """(True, '') when <simde/x86/avx512.h> compiles, else (False, why)."""
    try:
        r = subprocess.run(cxx() + ["-x", "c++", "-std=c++20", "-fsyntax-only", "-"], input="#include <simde/x86/avx512.h>\n",
                           capture_output=True, text=True, timeout=120)
    except FileNotFoundError as e:
        return False, f"no C++ compiler: {e}"
    if r.returncode != 0:
        return False, "SIMDe headers not found (<simde/x86/avx512.h>): apt-get install libsimde-dev"
    return True, ""


def host_has(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return all(fl in have for fl in flags)
    except OSError:
        pass
    return False


def _deps() -> list[str]:
    out = [os.path.abspath(__file__)]
    for d, _, files in os.walk(CSRC):
        out += [os.path.join(d, f) for f in files if f.endswith((".h", ".inc"))]
    return out


def _stale(obj: str, src: str, cmd: list[str]) -> bool:
    stamp = obj + ".cmd"
    if not (os.path.exists(obj) and os.path.exists(stamp)):
        return True
    with open(stamp) as f:
        if f.read() != " ".join(cmd):
            return True
    t = os.path.getmtime(obj)
    return any(os.path.getmtime(p) > t for p in [src] + _deps())


def _compile(obj: str, src: str, flags: list[str], extra: list[str]) -> tuple[str, int, str]:
    cmd = cxx() + COMMON + flags + extra + ["-c", src, "-o", obj]
    if not _stale(obj, src, cmd):
        return obj, 0, ""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 0:
        with open(obj + ".cmd", "w") as f:
            f.write(" ".join(cmd))
    elif os.path.exists(obj):
        os.remove(obj)
    return obj, r.returncode, " ".join(map(shlex.quote, cmd)) + "\n" + r.stdout + r.stderr


def _exported(obj: str) -> list[str]:
    r = subprocess.run(["nm", "-C", "--defined-only", obj], capture_output=True, text=True, check=True)
    out = []
    for line in r.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[1] in ("T", "W", "V", "u", "D", "B", "R") and not parts[2].startswith("DW.ref."):
            out.append(parts[2])
    return out


def build(build_dir: str = DEFAULT_BUILD, log=print, sanitize: str = "") -> str:
    """Builds the test binary; returns its path. Raises RuntimeError with the compiler output.

    sanitize: e.g. "address,undefined" or "thread" (-fsanitize=...; use its own build_dir)."""
    extra = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g"] if sanitize else []
    ok, why = simde_available()
    if not ok:
        raise RuntimeError(why)
    os.makedirs(build_dir, exist_ok=True)
    emu_avx2 = host_has("avx2", "fma", "f16c")
    units = {
        "scalar": ("csrc/ref/moe_scalar.cpp", []),
        "pack": ("csrc/pack.cpp", []),
        "dispatch": ("csrc/dispatch.cpp", []),
        "avx2": ("csrc/x86/moe_avx2.cpp", AVX2),
    }
    for lv, (src, native, emu_define) in LEVELS.items():
        # what setup.py builds when the compiler lacks the level's flags: an empty register_<lv>
        units[lv + "_omit"] = (src, ["-DMOEPACK_OMIT_LEVEL"])
        if lv != "avx_vnni" or emu_avx2:  # the AVX-VNNI kernel is AVX2 code around one emulated instruction
            units[lv + "_emu"] = (src, [emu_define, "-Wno-psabi"] + (AVX2 if emu_avx2 else []))
        units[lv + "_native"] = (src, native + [f"-Dregister_{lv}=register_{lv}_native"])
    t0 = time.time()
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        futs = {name: ex.submit(_compile, os.path.join(build_dir, name + ".o"), os.path.join(ROOT, src), fl, extra)
                for name, (src, fl) in units.items()}
        for name, fut in futs.items():
            results[name] = fut.result()
    native = {lv: results[lv + "_native"][1] == 0 for lv in LEVELS}
    for lv, ok in native.items():
        if not ok:
            log(f"note: native {lv} object not built (compiler lacks the flags?); only the emulated one runs\n"
                + results[lv + "_native"][2][-2000:])
    for name, (obj, rc, out) in results.items():
        if rc != 0 and not name.endswith("_native"):
            raise RuntimeError(f"compiling {name} failed:\n{out}")
    emulated = [lv for lv in LEVELS if lv + "_emu" in units]
    test_flags = [f"-DMOEPACK_TEST_NATIVE_{lv.upper()}={int(ok)}" for lv, ok in native.items()]
    test_flags += [f"-DMOEPACK_TEST_EMU_NEEDS_AVX2={int(emu_avx2)}", f"-DMOEPACK_TEST_EMU_AVX_VNNI={int('avx_vnni' in emulated)}"]
    obj, rc, out = _compile(os.path.join(build_dir, "test_kernels.o"), os.path.join(HERE, "test_kernels.cpp"), test_flags, extra)
    if rc != 0:
        raise RuntimeError(f"compiling test_kernels.cpp failed:\n{out}")

    # An emulated object must not contain a single instruction of the level it emulates.
    for lv in emulated:
        dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", results[lv + "_emu"][0]], capture_output=True,
                             text=True, check=True).stdout
        bad = [ln.strip() for ln in dis.splitlines() if EMULATED_INSN.search(ln)]
        if bad:
            raise RuntimeError(f"the emulated {lv} object contains instructions of the level:\n" + "\n".join(bad[:20]))
    # ISA objects export exactly their register function.
    want = {"avx2": "register_avx2"}
    want.update({lv + "_omit": f"register_{lv}" for lv in LEVELS})
    want.update({lv + "_emu": f"register_{lv}" for lv in emulated})
    want.update({lv + "_native": f"register_{lv}_native" for lv, ok in native.items() if ok})
    for name, fn in want.items():
        syms = _exported(results[name][0])
        if syms != [f"moepack::{fn}(moepack::KernelTable&)"]:
            raise RuntimeError(f"{name} object must export only moepack::{fn}, it exports: {syms}")

    objs = [results[n][0] for n in units
            if not n.endswith(("_native", "_omit")) or (n.endswith("_native") and native[n[: -len("_native")]])] + [obj]
    if "avx_vnni" not in emulated:  # dispatch.cpp names register_avx_vnni; it never calls it on such a host
        stub = os.path.join(build_dir, "avx_vnni_stub.o")
        r = subprocess.run(cxx() + COMMON + ["-x", "c++", "-c", "-", "-o", stub],
                           input='#include "moepack/kernel.h"\nnamespace moepack { void register_avx_vnni(KernelTable&) {} }\n',
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError("compiling the avx_vnni stub failed:\n" + r.stderr)
        objs.append(stub)
    exe = os.path.join(build_dir, "test_kernels")
    r = subprocess.run(cxx() + extra + objs + ["-pthread", "-o", exe], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("link failed:\n" + r.stdout + r.stderr)
    log(f"built {exe} in {time.time() - t0:.1f}s (emulated {', '.join(emulated)} over {'AVX2' if emu_avx2 else 'portable SIMDe'}; "
        f"native objects linked: {', '.join(lv for lv, ok in native.items() if ok) or 'none'})")
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default=DEFAULT_BUILD)
    ap.add_argument("--run", action="store_true", help="run the binary after building it")
    ap.add_argument("--sanitize", default="", help='e.g. "address,undefined" or "thread" (default build dir: build/san-<name>)')
    ap.add_argument("args", nargs="*", help="arguments for the binary (after --), e.g. -v")
    a = ap.parse_args()
    try:
        build_dir = a.build_dir
        if a.sanitize and build_dir == DEFAULT_BUILD:
            build_dir = os.path.join(DEFAULT_BUILD, "san-" + a.sanitize.replace(",", "-"))
        exe = build(build_dir, sanitize=a.sanitize)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    if a.run:
        return subprocess.run([exe] + a.args).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
