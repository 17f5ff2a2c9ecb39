"""Build of the moepack._C extension against the installed torch.

Each ISA level's kernel file gets the level's flags (moepack/isa_levels.py, the one list of
levels, keyed by the file's path); everything else is compiled for the baseline target. Nothing
is built with a native-CPU -march: what runs is decided at run time by csrc/dispatch.cpp.
"""

import glob
import os
import platform
import runpy
import sys
from types import SimpleNamespace

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))

# The one list of ISA levels, run by path: importing the moepack package needs the extension built here.
ISA = SimpleNamespace(**runpy.run_path(os.path.join(ROOT, "moepack", "isa_levels.py")))
ARCH = ISA.build_arch(platform.machine())  # None: an architecture the list lacks (scalar only)

# Per-file flags, keyed by the source file's path relative to ROOT.
# The op files (csrc/torch/op_*.cpp) instantiate at::parallel_for, whose OpenMP body is inline in
# the ATen headers: without -fopenmp it silently runs on one thread.
TORCH_SOURCES = sorted(os.path.relpath(f, ROOT).replace(os.sep, "/") for f in glob.glob(os.path.join(ROOT, "csrc", "torch", "*.cpp")))
# Apple Clang has no -fopenmp driver flag: the preprocessor flag and the libomp the torch wheel ships.
OPENMP_COMPILE = ["-Xpreprocessor", "-fopenmp"] if sys.platform == "darwin" else ["-fopenmp"]
OPENMP_LINK = ["-lomp"] if sys.platform == "darwin" else ["-fopenmp"]
FILE_FLAGS = {f: list(OPENMP_COMPILE) for f in TORCH_SOURCES}
FILE_FLAGS.update({lv.source: ISA.all_flags(lv) for lv in ISA.LEVELS})
COMMON_FLAGS = ["-O3", "-std=c++20", "-fno-math-errno", "-Wall", "-Wno-unused-function"]

# Levels whose kernels a toolchain may be unable to build (an older GCC/Clang without the flag,
# or an assembler without the instruction): built empty instead (-DMOEPACK_OMIT_LEVEL: the file
# registers nothing), so the dispatcher reports that level as a fallback ("<isa>: fallback: this
# build has no ... kernel") and MOEPACK_STRICT=1 refuses it. The probe compiles and assembles the
# level's key instruction with the level's flags.
PROBED = {lv.source: lv for lv in ISA.LEVELS if lv.probe is not None}


def _rel(path: str) -> str:
    return os.path.relpath(os.path.abspath(path), ROOT).replace(os.sep, "/")


def _toolchain_builds(cmd: list[str], flags: list[str], header: str, body: str) -> bool:
    """Whether `cmd` (the compiler command, wrapper included) compiles and assembles `body` with `flags`."""
    import subprocess
    import tempfile

    src = f"#include {header}\n" + body + "\n"
    with tempfile.TemporaryDirectory() as d:
        try:
            r = subprocess.run(list(cmd) + ["-O2"] + flags + ["-x", "c++", "-c", "-", "-o", os.path.join(d, "probe.o")],
                               input=src, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
    return r.returncode == 0


class IsaBuildExt(BuildExtension):
    """BuildExtension (no ninja) that appends FILE_FLAGS to the files named there."""

    def build_extension(self, ext):
        compile_one = self.compiler._compile
        accepted: dict[str, bool] = {}

        def _compile(obj, src, ext_, cc_args, extra_postargs, pp_opts):
            path = _rel(src)
            extra = FILE_FLAGS.get(path, [])
            if path in PROBED:
                lv = PROBED[path]
                if path not in accepted:
                    accepted[path] = _toolchain_builds(self.compiler.compiler_so, extra,
                                                       ISA.arch(lv.arch).intrinsics_header, lv.probe)
                    if not accepted[path]:
                        print(f"moepack: WARNING: this toolchain cannot build {' '.join(extra)} code: {path} is "
                              f"built without its kernels (ISA level {lv.name} is reported as a fallback at run time)")
                if not accepted[path]:
                    extra = ["-DMOEPACK_OMIT_LEVEL"]
            post = list(extra_postargs["cxx"] if isinstance(extra_postargs, dict) else extra_postargs)
            if isinstance(extra_postargs, dict):
                extra_postargs = dict(extra_postargs, cxx=post + extra)
            else:
                extra_postargs = post + extra
            return compile_one(obj, src, ext_, cc_args, extra_postargs, pp_opts)

        self.compiler._compile = _compile
        try:
            super().build_extension(ext)
        finally:
            self.compiler._compile = compile_one


def _sources():
    files = [
        "csrc/dispatch.cpp",
        "csrc/pack.cpp",
        "csrc/routing.cpp",
    ] + TORCH_SOURCES + [lv.source for lv in ISA.LEVELS if lv.arch is None]
    if ARCH is not None:  # the architecture's folder: its levels' kernel files and its feature probe
        levels = {lv.source for lv in ISA.arch_levels(ARCH.name)}
        found = sorted(_rel(f) for f in glob.glob(os.path.join(ROOT, ARCH.folder, "*.cpp")))
        # a kernel file compiled for the baseline target would be a silent slow path
        unlisted = [f for f in found if f not in levels and f != ARCH.cpu_features_source]
        if unlisted:
            raise SystemExit(f"setup.py: {unlisted} are in {ARCH.folder}/ but are no ISA level's kernel file: every "
                             f"{ARCH.folder}/*.cpp but cpu_features.cpp is csrc/<arch>/moe_<isa>.cpp of a level in "
                             "moepack/isa_levels.py, which gives its flags")
        missing = sorted(({ARCH.cpu_features_source} | levels) - set(found))
        if missing:
            raise SystemExit(f"setup.py: {missing} do not exist: moepack/isa_levels.py lists them for architecture "
                             f"{ARCH.name} (each level needs its kernel file, the architecture its cpu_features.cpp)")
        files += found
    return files


setup(
    ext_modules=[
        CppExtension(
            "moepack._C",
            _sources(),
            include_dirs=[os.path.join(ROOT, "csrc", "include")],
            extra_compile_args={"cxx": COMMON_FLAGS},
            extra_link_args=OPENMP_LINK,
        )
    ],
    cmdclass={"build_ext": IsaBuildExt.with_options(use_ninja=False)},
)
