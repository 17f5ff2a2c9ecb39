#!/usr/bin/env python3
"""Cross-build moepack's C++ extension (moepack._C) for aarch64 Linux on another machine, against
the aarch64 torch wheel, and check what came out.

    python tools/cross_build_ext.py [--wheel WHL | --download | --download-only] [--out FILE] [--jobs N]

* The wheel: --wheel names a downloaded torch-<version>-cp<py>-cp<py>-manylinux_2_28_aarch64.whl;
  --download fetches the one matching the installed torch and Python with
  `pip download torch==<version> --platform manylinux_2_28_aarch64 --only-binary=:all: --no-deps`
  (about 430 MB for torch 2.13; kept in build/cross-arm/ and reused). Only torch/include and
  torch/lib/*.so* are extracted.
* The sources and flags are setup.py's for the arm architecture (moepack/isa_levels.py: every ARM
  level's kernel file with its -march flags, csrc/arm/cpu_features.cpp, the portable files and
  the op files with -fopenmp), compiled with aarch64-linux-gnu-g++ (or $CROSS_CXX) and linked
  -shared against the wheel's libc10 / libtorch / libtorch_cpu / libtorch_python, as
  torch.utils.cpp_extension.CppExtension links them.
* Python.h: the build host's (CPython's C API headers are the same for x86-64 and aarch64 Linux,
  both LP64; only pyconfig.h is the host's). The result is an aarch64 Linux extension for the
  same CPython minor version.
* The checks (any failure exits 1): the result is an ELF64 AArch64 shared object; it exports
  PyInit__C; it holds the op library's registrations (TORCH_LIBRARY moepack, and each op's schema
  string of csrc/torch/op_*.inc); each ARM level's object holds its key instruction (sdot, smmla,
  bfmmla) and every level's register_<level> is defined.

Nothing here runs the extension: importing it needs an aarch64 CPython with the torch wheel
installed (docs/KERNELS.md "ARM": what was and was not run).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import re
import runpy
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISA = SimpleNamespace(**runpy.run_path(os.path.join(ROOT, "moepack", "isa_levels.py")))
ARCH = ISA.arch("arm")
PREFIX = "aarch64-linux-gnu-"
PLATFORM = "manylinux_2_28_aarch64"
BUILD = os.path.join(ROOT, "build", "cross-arm")
# setup.py's flags (COMMON_FLAGS, CppExtension's defines, -fPIC for a shared object)
COMMON = ["-O3", "-std=c++20", "-fno-math-errno", "-Wall", "-Wno-unused-function", "-fPIC", "-DNDEBUG",
          "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C"]  # fmt: skip
LEVEL_INSN = {"neon_dotprod": r"\bsdot\b", "neon_i8mm": r"\bsmmla\b", "neon_bf16": r"\bbfmmla\b"}


def sources() -> list[tuple[str, list[str]]]:
    """(source relative to ROOT, its extra flags), as setup.py compiles them on an aarch64 host."""
    torch_src = sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "csrc", "torch", "*.cpp")))
    out = [(f, []) for f in ("csrc/dispatch.cpp", "csrc/pack.cpp", "csrc/routing.cpp")]
    out += [(f, ["-fopenmp"]) for f in torch_src]
    out += [(lv.source, ISA.all_flags(lv)) for lv in ISA.LEVELS if lv.arch is None]
    out += [(ARCH.cpu_features_source, [])]
    out += [(lv.source, ISA.all_flags(lv)) for lv in ISA.arch_levels("arm")]
    return out


def torch_version() -> str:
    try:
        import torch

        return torch.__version__.split("+")[0]
    except ImportError:
        raise SystemExit("cross_build_ext: torch is not installed here: give --wheel (which torch to build against)")


def download_wheel() -> str:
    ver = torch_version()
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    dest = os.path.join(BUILD, "wheel")
    os.makedirs(dest, exist_ok=True)
    def found() -> list[str]:  # the wheel pip names it (a local version such as +cpu, another manylinux tag)
        return sorted(glob.glob(os.path.join(dest, f"torch-{ver}*-cp{py}-cp{py}-*aarch64.whl")))

    if not found():
        cmd = [sys.executable, "-m", "pip", "download", f"torch=={ver}", "--platform", PLATFORM, "--python-version", py,
               "--only-binary=:all:", "--no-deps", "-d", dest]  # fmt: skip
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    if not found():
        raise SystemExit(f"cross_build_ext: pip download left no torch-{ver}*-cp{py}-cp{py}-*aarch64.whl in {dest}")
    return found()[-1]


def extract(wheel: str) -> str:
    """torch/include and torch/lib/*.so* of the wheel into build/cross-arm/torch-<wheel name>."""
    name = os.path.basename(wheel)
    if not re.search(r"aarch64\.whl$", name):
        raise SystemExit(f"cross_build_ext: {name}: not an aarch64 wheel (want *-{PLATFORM}.whl)")
    dest = os.path.join(BUILD, name[: -len(".whl")])
    stamp = os.path.join(dest, ".complete")
    if not os.path.exists(stamp):
        shutil.rmtree(dest, ignore_errors=True)
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.startswith("torch/include/") or re.match(r"torch/lib/[^/]+\.so", m)]
            z.extractall(dest, members)
        open(stamp, "w").close()
    return os.path.join(dest, "torch")


def run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{r.stdout}{r.stderr}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", help="the aarch64 torch wheel to build against")
    ap.add_argument("--download", action="store_true", help="pip download the wheel of the installed torch version")
    ap.add_argument("--download-only", action="store_true", help="only fetch the wheel (make setup-test), build nothing")
    ap.add_argument("--out", default=None, help="the extension to write (default build/cross-arm/_C.<tag>.so)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    cxx = os.environ.get("CROSS_CXX", PREFIX + "g++")
    if shutil.which(cxx) is None:
        raise SystemExit(f"cross_build_ext: {cxx} not found (Debian: apt-get install g++-aarch64-linux-gnu)")
    if a.download_only:
        print(f"cross_build_ext: {download_wheel()}")
        return 0
    if not a.wheel and not a.download:
        raise SystemExit("cross_build_ext: give --wheel WHL or --download")
    wheel = a.wheel or download_wheel()
    torch_dir = extract(wheel)
    tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}-aarch64-linux-gnu"
    out = a.out or os.path.join(BUILD, f"_C.{tag}.so")
    objdir = os.path.join(BUILD, "obj")
    os.makedirs(objdir, exist_ok=True)
    inc = ["-I" + os.path.join(ROOT, "csrc", "include"), "-I" + os.path.join(torch_dir, "include"),
           "-I" + os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
           "-I" + sysconfig.get_paths()["include"]]  # fmt: skip

    # an object is rebuilt when its source, a csrc header or this script is newer, or its flags changed
    deps = [__file__] + glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True)
    deps += glob.glob(os.path.join(ROOT, "csrc", "**", "*.inc"), recursive=True)
    newest_dep = max(os.path.getmtime(f) for f in deps)

    def compile_one(item):
        src, flags = item
        obj = os.path.join(objdir, src.replace("/", "_").replace(".cpp", ".o"))
        cmd = [cxx] + COMMON + inc + flags + ["-c", os.path.join(ROOT, src), "-o", obj]
        stamp = obj + ".cmd"
        fresh = (os.path.exists(obj) and os.path.exists(stamp) and open(stamp).read() == " ".join(cmd)
                 and os.path.getmtime(obj) >= max(newest_dep, os.path.getmtime(os.path.join(ROOT, src))))  # fmt: skip
        if not fresh:
            run(cmd)
            with open(stamp, "w") as f:
                f.write(" ".join(cmd))
        return src, obj, fresh

    items = sources()
    objs: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        for src, obj, fresh in pool.map(compile_one, items):
            print(f"{'up to date' if fresh else 'compiled'} {src}", flush=True)
            objs[src] = obj
    lib = os.path.join(torch_dir, "lib")
    run([cxx, "-shared", "-fopenmp"] + [objs[s] for s, _ in items] +
        ["-L" + lib, "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-Wl,--allow-shlib-undefined", "-o", out])  # fmt: skip

    # ---- checks ----
    bad: list[str] = []
    hdr = subprocess.run([PREFIX + "readelf", "-h", out], capture_output=True, text=True).stdout
    if not (re.search(r"Class:\s+ELF64", hdr) and re.search(r"Machine:\s+AArch64", hdr) and re.search(r"Type:\s+DYN", hdr)):
        bad.append(f"{out} is not an ELF64 AArch64 shared object:\n{hdr}")
    dyn = subprocess.run([PREFIX + "nm", "-D", "--defined-only", out], capture_output=True, text=True).stdout
    if not re.search(r"\bT PyInit__C$", dyn, re.M):
        bad.append("PyInit__C is not exported")
    syms = subprocess.run([PREFIX + "nm", "-C", out], capture_output=True, text=True).stdout
    # TORCH_LIBRARY(moepack) (ops.cpp: its empty body may be inlined, its static initializer stays),
    # the fragments that define the ops and the CPU / Meta implementations
    for sym in ("TORCH_LIBRARY_static_init_moepack", "TORCH_LIBRARY_FRAGMENT_init_moepack_", "TORCH_LIBRARY_IMPL_init_moepack_CPU_",
                "TORCH_LIBRARY_IMPL_init_moepack_Meta_"):  # fmt: skip
        if sym not in syms:
            bad.append(f"no {sym}* symbol: an op registration of csrc/torch/ is missing")
    for lv in ISA.arch_levels("arm"):
        if not re.search(rf"\bregister_{lv.name}\(", syms):
            bad.append(f"register_{lv.name} is not defined")
    strings = subprocess.run(["strings", out], capture_output=True, text=True).stdout
    schemas = []
    for f in sorted(glob.glob(os.path.join(ROOT, "csrc", "torch", "op_*.inc"))):
        schemas += re.findall(r'm\.def\(\s*"([a-z_0-9]+)\(', open(f).read())
    missing = [s for s in schemas if not re.search(rf"^{s}\(", strings, re.M)]
    if not schemas or missing:
        bad.append(f"op schemas missing from the library: {missing or 'none found in csrc/torch/op_*.inc'}")
    for lv in ISA.arch_levels("arm"):
        pat = LEVEL_INSN.get(lv.name)
        if pat is None:
            continue
        dis = subprocess.run([PREFIX + "objdump", "-d", objs[lv.source]], capture_output=True, text=True).stdout
        if not re.search(pat, dis):
            bad.append(f"{lv.source}: no {pat} instruction: the level's flags did not take effect")
    if bad:
        print("cross_build_ext: FAILED\n  " + "\n  ".join(bad))
        return 1
    print(f"cross_build_ext: {out}: ELF64 AArch64 shared object, PyInit__C exported, TORCH_LIBRARY(moepack) and "
          f"{len(schemas)} op schemas ({', '.join(schemas)}), register_<level> of "
          f"{', '.join(lv.name for lv in ISA.arch_levels('arm'))}; built against {os.path.basename(wheel)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
