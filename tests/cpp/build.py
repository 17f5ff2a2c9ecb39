#!/usr/bin/env python3
"""Build (and optionally run) tests/cpp/test_kernels: the torch-free kernel test binary.

    python tests/cpp/build.py [--build-dir DIR] [--no-emulate] [--run [-- ARGS...]]

Translation units (each with the flags setup.py gives it, -O2; the levels, their files, flags and
emulation come from moepack/isa_levels.py, for the build host's architecture):
  scalar        csrc/ref/moe_scalar.cpp     no ISA flags
  pack          csrc/pack.cpp               no ISA flags
  dispatch      csrc/dispatch.cpp           no ISA flags (kernel selection, fused_moe_check_routing)
  cpu_features  csrc/<arch>/cpu_features.cpp  no ISA flags
  for each level L of the architecture (csrc/<arch>/moe_L.cpp):
    L           without `emulate` (x86: avx2): the file with the level's flags
    otherwise:
    L_emu       the file against SIMDe's portable intrinsics (the level's `emulate` define), NO
                flags of the level; the flags of Arch.emulate_with (x86: avx2) when the build
                host has that level (levels with emulate_needs_host: only then). Exports
                register_L, so the binary runs it on any host of the architecture.
    L_native    the file with the level's own flags, register_L renamed register_L_native; built
                and run only on CPUs that have the level (/proc/cpuinfo).
    L_omit      the file with -DMOEPACK_OMIT_LEVEL (what setup.py builds when the compiler lacks
                the level's flags): compiled and its exports checked; linked (an empty
                register_L) only when L_emu is not built.
  harness       tests/cpp/test_kernels.cpp  no ISA flags; one object for both binaries
  <binary>_linked  tests/cpp/linked.cpp     no ISA flags; MOEPACK_TEST_REGISTRARS(X) names the
                linked kernel objects: X(label, register function, level, level the host needs)

After compiling it checks that an emulated object contains no instruction of the level it emulates
(x86: no zmm, opmask or EVEX-only register, no dot-product instruction) and that every ISA object
exports nothing but its register_* function (an exported inline function compiled with ISA flags
could be picked by the linker for baseline code). Needs g++ (or $CXX), and SIMDe for the emulated objects
(Debian/Ubuntu: apt-get install libsimde-dev; --no-emulate builds test_kernels_native without them).
Objects are rebuilt when a source, a csrc header or this script is newer, or flags changed.

Cross build (--arch ARCH, another architecture than the host's: tests/engine/test_arm_cross.py):
    python tests/cpp/build.py --arch arm [--run]
compiles every level of ARCH natively for it with CROSS_PREFIXES[ARCH] (aarch64-linux-gnu-g++,
-nm, -objdump; $CROSS_CXX overrides the compiler), links the binary statically, and --run runs
it under the user-mode emulator (qemu-aarch64 -cpu max: every optional feature of the
architecture, so every level runs). No level of ARM is emulated through SIMDe.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import re
import runpy
import shlex
import subprocess
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CSRC = os.path.join(ROOT, "csrc")
DEFAULT_BUILD = os.path.join(HERE, "build")

COMMON = ["-std=c++20", "-O2", "-DMOEPACK_COUNT_HOOKS", "-fno-math-errno", "-Wall", "-Wno-unused-function", "-I" + os.path.join(CSRC, "include")]
EMULATED = ["-Wno-psabi"]  # SIMDe's wide vector types in function signatures


# The one list of ISA levels, run by path: the package itself needs the built extension, unused here.
ISA = SimpleNamespace(**runpy.run_path(os.path.join(ROOT, "moepack", "isa_levels.py")))
# What an emulated object of the architecture must not contain. x86: AVX-512 encodings (zmm
# registers, opmask registers, xmm/ymm 16-31: EVEX only) and the dot-product instructions (VEX
# AVX-VNNI included).
EMULATED_INSN = {
    "x86": re.compile(r"%?\bzmm\d+|%k[0-7]\b|\b[xy]mm(1[6-9]|2\d|3[01])\b|\bv(pdpbus|pdpws|dpbf16)"),
}
# Cross builds: the GNU toolchain prefix of an architecture, and the user-mode emulator that runs
# its binaries on this host (with the CPU model that has every optional feature).
CROSS_PREFIXES = {"arm": "aarch64-linux-gnu-"}
CROSS_RUNNERS = {"arm": ["qemu-aarch64", "-cpu", "max"]}
# The instruction of each level of a cross-built architecture that its object must contain (the
# level's flags took effect and its kernels were compiled in, not an empty MOEPACK_OMIT_LEVEL).
LEVEL_INSN = {
    "neon_dotprod": re.compile(r"\bsdot\b"),
    "neon_i8mm": re.compile(r"\bsmmla\b"),
    "neon_bf16": re.compile(r"\bbfmmla\b|\bbfdot\b"),
}


_TARGET: dict = {"arch": None}  # build(): the architecture being built for (None: the host's)


def cxx() -> list[str]:
    cross = _TARGET["arch"]
    if cross is not None:
        return shlex.split(os.environ.get("CROSS_CXX", CROSS_PREFIXES[cross] + "g++"))
    return shlex.split(os.environ.get("CXX", "g++"))


def binutil(name: str) -> str:
    """nm / objdump for the architecture being built for."""
    cross = _TARGET["arch"]
    return CROSS_PREFIXES[cross] + name if cross is not None else name


def cross_toolchain(arch_name: str) -> tuple[bool, str]:
    """(True, '') when the cross compiler, binutils and emulator of arch_name are installed, else (False, why)."""
    import shutil

    prefix = CROSS_PREFIXES.get(arch_name)
    if prefix is None:
        return False, f"no cross toolchain is known for architecture {arch_name!r} (CROSS_PREFIXES)"
    compiler = shlex.split(os.environ.get("CROSS_CXX", prefix + "g++"))[0]
    need = [compiler, prefix + "nm", prefix + "objdump", CROSS_RUNNERS[arch_name][0]]
    missing = [n for n in need if shutil.which(n) is None]
    if missing:
        return False, (f"{', '.join(missing)} not found (Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu qemu-user; "
                       "make setup-test installs them)")
    return True, ""


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
    """Whether /proc/cpuinfo lists every one of `flags` (Linux x86 "flags", aarch64 "Features")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return all(fl in have for fl in flags)
    except OSError:
        pass
    return False


def _deps(src: str) -> list[str]:
    """What an object of `src` depends on besides `src`: this script, every csrc header and .inc,
    and, for tests/cpp's own sources (test_kernels.cpp, linked.cpp), the kt_*.inc and .h parts."""
    out = [os.path.abspath(__file__)]
    for d, _, files in os.walk(CSRC):
        out += [os.path.join(d, f) for f in files if f.endswith((".h", ".inc"))]
    if os.path.dirname(os.path.abspath(src)) == HERE:
        out += [os.path.join(HERE, f) for f in os.listdir(HERE) if f.endswith((".inc", ".h"))]
    return out


def _stale(obj: str, src: str, cmd: list[str]) -> bool:
    stamp = obj + ".cmd"
    if not (os.path.exists(obj) and os.path.exists(stamp)):
        return True
    with open(stamp) as f:
        if f.read() != " ".join(cmd):
            return True
    t = os.path.getmtime(obj)
    return any(os.path.getmtime(p) > t for p in [src] + _deps(src))


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
    r = subprocess.run([binutil("nm"), "-C", "--defined-only", obj], capture_output=True, text=True, check=True)
    out = []
    for line in r.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[1] in ("T", "W", "V", "u", "D", "B", "R") and not parts[2].startswith("DW.ref."):
            out.append(parts[2])
    return out


def build(build_dir: str = DEFAULT_BUILD, log=print, sanitize: str = "", arch_name: str | None = None,
          emulate: bool = True) -> str:
    """Builds the test binary; returns its path. Raises RuntimeError with the compiler output.

    sanitize: e.g. "address,undefined" or "thread" (-fsanitize=...; use its own build_dir).
    arch_name: build for this architecture of moepack/isa_levels.py (None: the host's); another
    than the host's is a cross build (a static binary for CROSS_RUNNERS).
    emulate: link the SIMDe-emulated objects (needs SIMDe). False: the binary test_kernels_native
    without them (no SIMDe needed): scalar, the levels built natively, the omit objects and the
    hook counts; it shares every other object with the emulated build in the same build_dir."""
    extra = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g"] if sanitize else []
    host_arch = ISA.build_arch(platform.machine())
    if arch_name is None:
        arch = host_arch
        if arch is None:
            raise RuntimeError(f"platform.machine()={platform.machine()!r} is none of moepack/isa_levels.py's ARCHES "
                               f"({', '.join(a.name for a in ISA.ARCHES)}): tests/cpp builds one architecture's kernels")
    else:
        arch = ISA.arch(arch_name)
    cross = host_arch is None or arch.name != host_arch.name
    _TARGET["arch"] = arch.name if cross else None
    if cross:
        ok, why = cross_toolchain(arch.name)
        if not ok:
            raise RuntimeError(why)
    levels = ISA.arch_levels(arch.name)
    if emulate and any(lv.emulate for lv in levels):
        ok, why = simde_available()
        if not ok:
            raise RuntimeError(why)
    os.makedirs(build_dir, exist_ok=True)
    # the emulated objects run native code of Arch.emulate_with around the emulated instructions
    # where the build host has that level (/proc/cpuinfo: its CPU features)
    emu_host = ISA.level(arch.emulate_with) if arch.emulate_with else None
    emu_flags = ISA.all_flags(emu_host) if emu_host and not cross and host_has(*ISA.features_of(emu_host, "cpu")) else []
    units = {
        "scalar": (ISA.level("scalar").source, []),
        "pack": ("csrc/pack.cpp", []),
        "dispatch": ("csrc/dispatch.cpp", []),
        "cpu_features": (arch.cpu_features_source, []),
    }
    emulated = [lv.name for lv in levels if emulate and lv.emulate and (emu_flags or not lv.emulate_needs_host)]
    for lv in levels:
        if lv.emulate is None:
            units[lv.name] = (lv.source, ISA.all_flags(lv))
            if lv.probe is not None:  # what setup.py builds when the toolchain fails the probe
                units[lv.name + "_omit"] = (lv.source, ["-DMOEPACK_OMIT_LEVEL"])
            continue
        # what setup.py builds when the compiler lacks the level's flags: an empty register_<lv>
        units[lv.name + "_omit"] = (lv.source, ["-DMOEPACK_OMIT_LEVEL"])
        if lv.name in emulated:
            units[lv.name + "_emu"] = (lv.source, [lv.emulate] + EMULATED + emu_flags)
        # the native object runs only where the CPU has the level: elsewhere it would be compiled
        # for nothing (the extension's build compiles the file with the same flags)
        if not cross and host_has(*ISA.features_of(lv, "cpu")):
            units[lv.name + "_native"] = (lv.source, ISA.all_flags(lv) + [f"-Dregister_{lv.name}=register_{lv.name}_native"])
    t0 = time.time()
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        futs = {name: ex.submit(_compile, os.path.join(build_dir, name + ".o"), os.path.join(ROOT, src), fl, extra)
                for name, (src, fl) in units.items()}
        for name, fut in futs.items():
            results[name] = fut.result()
    native = {lv.name: results[lv.name + "_native"][1] == 0 for lv in levels if lv.name + "_native" in results}
    for lv, ok in native.items():
        if not ok:
            log(f"note: native {lv} object not built (compiler lacks the flags?); only the emulated one runs\n"
                + results[lv + "_native"][2][-2000:])
    for name, (obj, rc, out) in results.items():
        if rc != 0 and not name.endswith("_native"):
            raise RuntimeError(f"compiling {name} failed:\n{out}")

    # What links register_<lv> (dispatch.cpp calls every level of the architecture): the level's
    # own object, its emulated one, else its empty omit object; the native builds come on top.
    # X(label, register function, level, the level the host must have to run it)
    link = {}
    registrars = []
    emu_needs = emu_host.name if emu_flags else "scalar"
    for lv in levels:
        if lv.emulate is None:
            link[lv.name] = f"register_{lv.name}"
            registrars.append(f'X("{lv.name}", register_{lv.name}, {lv.name}, {lv.name})')
        elif lv.name in emulated:
            link[lv.name + "_emu"] = f"register_{lv.name}"
            registrars.append(f'X("{lv.name}-emu", register_{lv.name}, {lv.name}, {emu_needs})')
        else:
            link[lv.name + "_omit"] = f"register_{lv.name}"
            if emulate:
                log(f"note: {lv.name} is not emulated: it needs {emu_host.name if emu_host else '?'} code and this build host lacks it")
            else:
                log(f"note: {lv.name} is not emulated in this build (emulate=False: test_kernels_native)")
    for lv, ok in native.items():
        if ok:
            link[lv + "_native"] = f"register_{lv}_native"
            registrars.append(f'X("{lv}", register_{lv}_native, {lv}, {lv})')
    test_flags = ["-DMOEPACK_TEST_REGISTRARS(X)=" + " ".join(registrars)]
    binary = "test_kernels" if emulate else "test_kernels_native"
    # the harness (the large unit) is one object for both binaries; the list of what they link is
    # each binary's own small one
    harness, rc, out = _compile(os.path.join(build_dir, "harness.o"), os.path.join(HERE, "test_kernels.cpp"), [], extra)
    if rc != 0:
        raise RuntimeError(f"compiling test_kernels.cpp failed:\n{out}")
    obj, rc, out = _compile(os.path.join(build_dir, binary + "_linked.o"), os.path.join(HERE, "linked.cpp"), test_flags, extra)
    if rc != 0:
        raise RuntimeError(f"compiling linked.cpp failed:\n{out}")

    # An emulated object must not contain a single instruction of the level it emulates.
    for lv in emulated:
        if arch.name not in EMULATED_INSN:
            raise RuntimeError(f"level {lv} is emulated but EMULATED_INSN has no pattern for architecture {arch.name}")
        dis = subprocess.run([binutil("objdump"), "-d", "--no-show-raw-insn", results[lv + "_emu"][0]],
                             capture_output=True, text=True, check=True).stdout
        bad = [ln.strip() for ln in dis.splitlines() if EMULATED_INSN[arch.name].search(ln)]
        if bad:
            raise RuntimeError(f"the emulated {lv} object contains instructions of the level:\n" + "\n".join(bad[:20]))
    # A level's object contains its key instruction (its flags took effect; nothing was omitted).
    for lv in levels:
        pat = LEVEL_INSN.get(lv.name)
        if pat is None or lv.name not in link:
            continue
        dis = subprocess.run([binutil("objdump"), "-d", "--no-show-raw-insn", results[lv.name][0]], capture_output=True,
                             text=True, check=True).stdout
        if not pat.search(dis):
            raise RuntimeError(f"the {lv.name} object contains no {pat.pattern} instruction: its kernels were not compiled in")
    # ISA objects export exactly their register function.
    want = dict(link)
    want.update({lv.name + "_omit": f"register_{lv.name}" for lv in levels if lv.name + "_omit" in results})
    for name, fn in want.items():
        syms = _exported(results[name][0])
        if syms != [f"moepack::{fn}(moepack::KernelTable&)"]:
            raise RuntimeError(f"{name} object must export only moepack::{fn}, it exports: {syms}")

    objs = [results[n][0] for n in ("scalar", "pack", "dispatch", "cpu_features")] + [results[n][0] for n in link] + [harness, obj]
    exe = os.path.join(build_dir, binary)
    static = ["-static"] if cross else []  # the emulator then needs no target sysroot
    r = subprocess.run(cxx() + extra + objs + ["-pthread"] + static + ["-o", exe], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("link failed:\n" + r.stdout + r.stderr)
    if cross:
        log(f"built {exe} in {time.time() - t0:.1f}s (cross-built for {arch.name}, static; levels "
            f"{', '.join(lv.name for lv in levels)}; run it with {' '.join(CROSS_RUNNERS[arch.name])})")
        return exe
    over = emu_host.name if emu_flags else "portable SIMDe"
    log(f"built {exe} in {time.time() - t0:.1f}s (emulated {', '.join(emulated) or 'none'} over {over}; "
        f"native objects linked: {', '.join(lv for lv, ok in native.items() if ok) or 'none'})")
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default=DEFAULT_BUILD)
    ap.add_argument("--run", action="store_true", help="run the binary after building it")
    ap.add_argument("--sanitize", default="", help='e.g. "address,undefined" or "thread" (default build dir: build/san-<name>)')
    ap.add_argument("--arch", default=None, help="build for this architecture of moepack/isa_levels.py (e.g. arm: "
                    "a cross build, run under its emulator; default build dir: build/<arch>)")
    ap.add_argument("--no-emulate", action="store_true", help="build test_kernels_native: no SIMDe-emulated objects "
                    "(what runs without SIMDe: scalar, the native levels, the hook counts)")
    ap.add_argument("args", nargs="*", help="arguments for the binary (after --), e.g. -v")
    a = ap.parse_args()
    try:
        build_dir = a.build_dir
        if a.sanitize and build_dir == DEFAULT_BUILD:
            build_dir = os.path.join(DEFAULT_BUILD, "san-" + a.sanitize.replace(",", "-"))
        if a.arch and build_dir == DEFAULT_BUILD:
            build_dir = os.path.join(DEFAULT_BUILD, a.arch)
        exe = build(build_dir, sanitize=a.sanitize, arch_name=a.arch, emulate=not a.no_emulate)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 2
    if a.run:
        runner = CROSS_RUNNERS[_TARGET["arch"]] if _TARGET["arch"] else []
        return subprocess.run(runner + [exe] + a.args).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
