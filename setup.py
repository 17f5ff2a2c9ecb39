"""Build of the moepack._C extension against the installed torch.

Each ISA translation unit gets its own flags (ISA_FLAGS below); everything else is compiled
for the baseline target. Nothing is built with a native-CPU -march: what runs is decided at run
time by csrc/dispatch.cpp.
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))

# Per-file flags, keyed by the source file name.
# ops.cpp instantiates at::parallel_for, whose OpenMP body is inline in the ATen headers: without
# -fopenmp it silently runs on one thread.
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
# GCC 12 warns about its own AVX-512 headers (_mm512_undefined_*): not our code.
_GCC_AVX512_HEADERS = ["-Wno-maybe-uninitialized"]
ISA_FLAGS = {
    "ops.cpp": ["-fopenmp"],
    # one translation unit per ISA level (csrc/include/moepack/kernel.h: Isa), each with exactly
    # the extensions its level requires
    "moe_avx2.cpp": _AVX2,
    "moe_avx_vnni.cpp": _AVX2 + ["-mavxvnni"],
    "moe_avx512.cpp": _AVX512 + _GCC_AVX512_HEADERS,
    "moe_avx512_vnni.cpp": _AVX512 + ["-mavx512vnni"] + _GCC_AVX512_HEADERS,
    "moe_avx512_bf16.cpp": _AVX512 + ["-mavx512bf16"] + _GCC_AVX512_HEADERS,
}
COMMON_FLAGS = ["-O3", "-std=c++20", "-fno-math-errno", "-Wall", "-Wno-unused-function"]


# Levels whose kernels a toolchain may be unable to build (an older GCC/Clang without the flag,
# or an assembler without the instruction): built empty instead (-DMOEPACK_OMIT_LEVEL: the file
# registers nothing), so the dispatcher reports that level as a fallback ("<isa>: fallback: this
# build has no ... kernel") and MOEPACK_STRICT=1 refuses it. The probe compiles and assembles the
# level's key instruction with the level's flags.
_PROBES = {
    "moe_avx_vnni.cpp": "__m256i f(__m256i a, __m256i b, __m256i c) { return _mm256_dpbusd_avx_epi32(a, b, c); }",
    "moe_avx512.cpp": "__mmask64 f(__m512i a) { return _mm512_movepi8_mask(_mm512_abs_epi8(a)); }",
    "moe_avx512_vnni.cpp": "__m512i f(__m512i a, __m512i b, __m512i c) { return _mm512_dpbusd_epi32(a, b, c); }",
    "moe_avx512_bf16.cpp": "__m512 f(__m512 a, __m512i b, __m512i c) { return _mm512_dpbf16_ps(a, (__m512bh)b, (__m512bh)c); }",
}
OPTIONAL_LEVELS = tuple(_PROBES)


def _toolchain_builds(cmd: list[str], flags: list[str], body: str) -> bool:
    """Whether `cmd` (the compiler command, wrapper included) compiles and assembles `body` with `flags`."""
    import subprocess
    import tempfile

    src = "#include <immintrin.h>\n" + body + "\n"
    with tempfile.TemporaryDirectory() as d:
        try:
            r = subprocess.run(list(cmd) + ["-O2"] + flags + ["-x", "c++", "-c", "-", "-o", os.path.join(d, "probe.o")],
                               input=src, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return False
    return r.returncode == 0


class IsaBuildExt(BuildExtension):
    """BuildExtension (no ninja) that appends ISA_FLAGS to the files named there."""

    def build_extension(self, ext):
        compile_one = self.compiler._compile
        accepted: dict[str, bool] = {}

        def _compile(obj, src, ext_, cc_args, extra_postargs, pp_opts):
            name = os.path.basename(src)
            extra = ISA_FLAGS.get(name, [])
            if name in OPTIONAL_LEVELS:
                if name not in accepted:
                    accepted[name] = _toolchain_builds(self.compiler.compiler_so, extra, _PROBES[name])
                    if not accepted[name]:
                        print(f"moepack: WARNING: this toolchain cannot build {' '.join(extra)} code: {name} is "
                              "built without its kernels (that ISA level is reported as a fallback at run time)")
                if not accepted[name]:
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
        "csrc/ref/moe_scalar.cpp",
        "csrc/torch/ops.cpp",
        "csrc/torch/module.cpp",
    ]
    import platform

    if platform.machine().lower() in ("x86_64", "amd64"):
        isa_files = sorted(glob.glob("csrc/x86/*.cpp"))
        unflagged = [f for f in isa_files if os.path.basename(f) not in ISA_FLAGS]
        if unflagged:  # a kernel file compiled for the baseline target would be a silent slow path
            raise SystemExit(f"setup.py: {unflagged} have no entry in ISA_FLAGS (every csrc/x86 file needs its ISA flags)")
        files += isa_files
    return files


setup(
    ext_modules=[
        CppExtension(
            "moepack._C",
            _sources(),
            include_dirs=[os.path.join(ROOT, "csrc", "include")],
            extra_compile_args={"cxx": COMMON_FLAGS},
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": IsaBuildExt.with_options(use_ninja=False)},
)
