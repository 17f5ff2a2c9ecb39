"""Build of the moepack._C extension against the installed torch.

Each ISA level's kernel file gets the level's flags (moepack/isa_levels.py, the one list of
levels, keyed by the file's path); everything else is compiled for the baseline target. Nothing
is built with a native-CPU -march: what runs is decided at run time by csrc/dispatch.cpp.
"""

import glob
import os
import platform
import re
import runpy
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))

# The one list of ISA levels, run by path: importing the moepack package needs the extension built here.
ISA = SimpleNamespace(**runpy.run_path(os.path.join(ROOT, "moepack", "isa_levels.py")))
ARCH = ISA.build_arch(platform.machine())  # None: an architecture the list lacks (scalar only)

# Per-file flags, keyed by the source file's path relative to ROOT.
# The op library (csrc/torch/ops.cpp, one unit with its op_*.inc parts) instantiates
# at::parallel_for, whose OpenMP body is inline in the ATen headers: without -fopenmp it silently
# runs on one thread.
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


def _is_debug_flag(arg: str) -> bool:
    """-g and its levels and formats (-g1, -ggdb, -gdwarf-4); not -gno-... or -gsplit-dwarf."""
    return re.fullmatch(r"-g(\d|gdb\d?|dwarf(-\d)?)?", arg) is not None


def build_jobs() -> int:
    """Compiler processes run side by side: MOEPACK_BUILD_JOBS, else one per CPU this process may use."""
    env = os.environ.get("MOEPACK_BUILD_JOBS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


class IsaBuildExt(BuildExtension):
    """BuildExtension (no ninja) that appends FILE_FLAGS to the files named there, and compiles
    the sources side by side (build_jobs() at a time: the ISA units are independent, and one
    compile of a kernel unit takes tens of seconds)."""

    def build_extension(self, ext):
        compile_one = self.compiler._compile
        compile_all = self.compiler.compile
        accepted: dict[str, bool] = {}
        probe_lock = threading.Lock()

        def _compile(obj, src, ext_, cc_args, extra_postargs, pp_opts):
            path = _rel(src)
            extra = FILE_FLAGS.get(path, [])
            if path in PROBED:
                lv = PROBED[path]
                with probe_lock:
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

        compiler = self.compiler

        def compile_parallel(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                             extra_postargs=None, depends=None):
            # CCompiler.compile, with the per-object loop run by a thread pool (each _compile is one
            # compiler process; distutils' own loop runs them one after the other)
            macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)

            def one(obj):
                if obj in build:  # absent: up to date (distutils' own skip)
                    src, ext_ = build[obj]
                    compiler._compile(obj, src, ext_, cc_args, extra_postargs, pp_opts)

            with ThreadPoolExecutor(max_workers=build_jobs()) as ex:
                list(ex.map(one, objects))  # list(): re-raises the first compile error
            return objects

        # torch's per-file wrapper (unix_wrap_single_compile) sets compiler_so to the compiler
        # behind ccache/sccache when one is installed, and puts back what it read: run side by side,
        # one thread could read another's wrapped command and wrap it twice. So the command is
        # wrapped once here, as torch would, and torch's wrapping is off while the threads run.
        # the compile commands, put back after the build: distutils compiles .cpp files with
        # compiler_so_cxx where it has one (setuptools >= 72), C files with compiler_so
        before = {k: list(getattr(compiler, k)) for k in ("compiler_so", "compiler_so_cxx") if getattr(compiler, k, None)}
        so_before = before["compiler_so"]
        # Python's own CFLAGS carry -g: debug info for every template instance of the kernels costs
        # ~20% of the build's CPU (measured: moe_avx2.cpp 26.2 -> 21.6 user s on the 2-core Zen 3)
        # and ~7x the object's size, for backtraces few users read. MOEPACK_DEBUG_INFO=1 keeps it.
        if os.environ.get("MOEPACK_DEBUG_INFO", "") != "1":
            for k, cmd in before.items():
                compiler.set_executable(k, [a for a in cmd if not _is_debug_flag(a)])
        no_wrap_before = os.environ.get("TORCH_NO_COMPILER_WRAPPER")
        if not no_wrap_before:
            wrapper = next((w for w in ("ccache", "sccache") if shutil.which(w)), None)
            if wrapper and so_before[0] != wrapper:
                compiler.set_executable("compiler_so", [wrapper] + list(compiler.compiler_so))
        os.environ["TORCH_NO_COMPILER_WRAPPER"] = "1"
        self.compiler._compile = _compile
        self.compiler.compile = compile_parallel
        try:
            super().build_extension(ext)
        finally:
            self.compiler._compile = compile_one
            self.compiler.compile = compile_all
            for k, cmd in before.items():
                compiler.set_executable(k, cmd)
            if no_wrap_before is None:
                del os.environ["TORCH_NO_COMPILER_WRAPPER"]


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
            # every header and .inc: `setup.py build_ext --inplace` (make check) rebuilds when one
            # is newer than the extension, not only when a .cpp is; and the test-only schemes' C++
            # parts (tests/schemes/<s>/*.inc, included through csrc/kernels/schemes_gen.inc)
            depends=sorted(os.path.relpath(f, ROOT) for ext_ in ("h", "inc")
                           for f in glob.glob(os.path.join(ROOT, "csrc", "**", f"*.{ext_}"), recursive=True))
            + sorted(os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests", "schemes", "*", "*.inc"))),
            extra_compile_args={"cxx": COMMON_FLAGS},
            extra_link_args=OPENMP_LINK,
        )
    ],
    cmdclass={"build_ext": IsaBuildExt.with_options(use_ninja=False)},
)
