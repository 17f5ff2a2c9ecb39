"""THE list of kernel ISA levels: every fact about a level is written here, once.

Everything else reads it (docs/CONTRIBUTING.md, "How to add an ISA level"):

* ``tools/gen_isa.py`` writes ``csrc/include/moepack/isa_gen.h`` from it (the ``Isa`` enum,
  ``CpuFeatures``, the ``kIsaLevels`` table that csrc/dispatch.cpp's requirement check,
  ``isa_serves`` and registration read, the X-macros that declare every ``register_<isa>`` and
  list ``cpu_flags``) and the level table of docs/KERNELS.md; ``--check`` fails when either is
  stale (``make test-only``, tests/engine/test_isa_list.py);
* setup.py compiles ``csrc/<arch>/`` of the architecture it builds for, each level's kernel file
  with the level's ``flags``, and probes the toolchain with the level's ``probe``;
* tests/cpp/build.py builds every level of the host's architecture natively and, where
  ``emulate`` says how, through SIMDe;
* moepack/isa.py: ``ISAS`` (preference order), ``KERNEL_ISAS`` and its docstring table.

Pure data, standard library only, and no ``from __future__ import annotations`` (dataclasses
would then look the module up in sys.modules): setup.py and the tools run this file by path
(``runpy.run_path``), without importing the package, which needs the built extension.
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arch:
    """A CPU architecture: its kernel files live in ``csrc/<name>/``, next to its feature probe
    ``csrc/<name>/cpu_features.cpp`` (compiled without ISA flags) that fills ``CpuFeatures``."""

    name: str
    machines: tuple[str, ...]  # platform.machine().lower() values setup.py builds this folder for
    cpp_condition: str  # true when the C++ compiler targets this architecture
    layout_family: str  # moepack.layout.FAMILIES entry: the layouts its levels serve
    intrinsics_header: str  # what a level's probe includes
    # tests/cpp: the level whose flags the SIMDe-emulated objects are compiled with when the build
    # host has it (native code around the emulated instructions); None: portable SIMDe only
    emulate_with: str | None = None
    # CpuFeatures members its probe fills that no level needs: reported by cpu_flags, for information
    info_features: tuple[str, ...] = ()

    @property
    def folder(self) -> str:
        return f"csrc/{self.name}"

    @property
    def cpu_features_source(self) -> str:
        return f"{self.folder}/cpu_features.cpp"


@dataclass(frozen=True)
class Need:
    """One requirement of a level: every feature in ``features`` (``CpuFeatures`` members,
    named as Linux's /proc/cpuinfo names them, ``os_*`` for OS register state) is present."""

    by: str  # "cpu": the CPU has the instructions; "os": the OS saves the registers
    what: str  # the thing, as a refusal names it
    features: tuple[str, ...]

    @property
    def reason(self) -> str:
        """Why the level is unavailable when one of ``features`` is missing."""
        return f"the CPU lacks {self.what}" if self.by == "cpu" else f"the OS does not enable {self.what}"


def cpu(what: str, *features: str) -> Need:
    return Need("cpu", what, features)


def os_state(what: str, *features: str) -> Need:
    return Need("os", what, features)


@dataclass(frozen=True)
class Level:
    """One ISA level: one kernel file ``csrc/<arch>/moe_<name>.cpp`` (``csrc/ref/`` without an
    architecture) that exports ``register_<name>(KernelTable&)``."""

    name: str
    arch: str | None  # None: portable C++, every architecture (scalar only)
    flags: tuple[str, ...] = ()  # compiler flags of its file, on top of the base's
    base: str | None = None  # a level whose requirements and flags this one extends
    needs: tuple[Need, ...] = ()  # its own requirements, checked in order before the base's
    # what it serves, within its architecture's layout family: weight kinds
    # (moepack.layout.WEIGHT_DTYPES), each in every activation mode ("bf16") or in one
    # ("u4:a8": u4 layouts when called with int8 activations); None: every layout of that family
    # in every mode (every layout at all without an architecture)
    serves: tuple[str, ...] | None = None
    # C++ that uses the level's key instruction, compiled with its flags: a toolchain that cannot
    # build it gets the file with -DMOEPACK_OMIT_LEVEL (the level reports a fallback at run time).
    # None: the toolchain must build the level.
    probe: str | None = None
    # tests/cpp: the define that swaps the level's intrinsics for SIMDe's (None: run natively only)
    emulate: str | None = None
    emulate_needs_host: bool = False  # the emulated object needs Arch.emulate_with's flags
    # the dot-product instruction (a name of moepack/bench/probe.py INSTRUCTIONS) the level's
    # kernels use for float work (A16: bf16/fp32 activations against weights decoded to bf16/fp32)
    # and for integer work (A8: int8 activations against int8 weights or codes widened to int8):
    # the bench divides a kernel's rate by its peak. None: none measured (the scalar level, ARM)
    # or the level serves no kind in that mode. Plain names: this file imports nothing of moepack.
    float_instruction: str | None = None
    int_instruction: str | None = None
    cpus: str = ""  # examples, for the docs
    doc_needs: str = field(default="", compare=False)  # "the CPU needs" in the docs, when not derived

    @property
    def source(self) -> str:
        return f"csrc/{self.arch or 'ref'}/moe_{self.name}.cpp"


ARCHES = (
    Arch(
        name="x86",
        machines=("x86_64", "amd64"),
        cpp_condition="defined(__x86_64__)",
        layout_family="x86",
        intrinsics_header="<immintrin.h>",
        emulate_with="avx2",
    ),
    # AArch64 (Linux: getauxval HWCAP/HWCAP2; macOS: sysctlbyname hw.optional.*). Every level's
    # kernel is built natively for its target; tests/cpp cross-builds them and runs them under
    # qemu-user on x86 (tests/engine/test_arm_cross.py), so no level has an SIMDe emulation.
    Arch(
        name="arm",
        machines=("aarch64", "arm64"),
        cpp_condition="defined(__aarch64__)",
        layout_family="arm",
        intrinsics_header="<arm_neon.h>",
        info_features=("sve",),
    ),
)

# GCC 12 warns about its own AVX-512 headers (_mm512_undefined_*): not our code.
_GCC_AVX512_HEADERS = "-Wno-maybe-uninitialized"

# Order = preference: a later level is a better kernel where the CPU has it and it serves the
# layout. Requirements do not nest beyond `base` (a CPU can have AVX-512 BF16 without AVX-VNNI).
LEVELS = (
    Level("scalar", arch=None, doc_needs="nothing"),
    Level(
        "avx2",
        arch="x86",
        flags=("-mavx2", "-mfma", "-mf16c"),
        needs=(cpu("AVX2/FMA/F16C", "avx2", "fma", "f16c"), os_state("AVX state (XCR0)", "os_avx")),
        float_instruction="fma_ymm",
        int_instruction="vpmaddubsw_ymm",
        cpus="Haswell+, Zen 1-3",
    ),
    Level(
        "avx_vnni",  # VEX vpdpbusd on ymm
        arch="x86",
        base="avx2",
        flags=("-mavxvnni",),
        needs=(cpu("AVX-VNNI", "avx_vnni"),),
        serves=("i8", "u4:a8", "e2m1:a8"),
        probe="__m256i f(__m256i a, __m256i b, __m256i c) { return _mm256_dpbusd_avx_epi32(a, b, c); }",
        emulate="-DMOEPACK_EMULATE_AVX_VNNI",
        emulate_needs_host=True,  # the AVX-VNNI kernel is AVX2 code around one emulated instruction
        int_instruction="vpdpbusd_ymm",
        cpus="Alder Lake+, (Zen 5)",
    ),
    Level(
        "avx512",
        arch="x86",
        base="avx2",
        flags=("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", _GCC_AVX512_HEADERS),
        needs=(
            cpu("AVX-512 F/BW/VL/DQ", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
            os_state("AVX-512 state (XCR0 opmask/ZMM)", "os_avx512"),
        ),
        probe="__mmask64 f(__m512i a) { return _mm512_movepi8_mask(_mm512_abs_epi8(a)); }",
        emulate="-DMOEPACK_EMULATE_AVX512",
        float_instruction="fma_zmm",
        int_instruction="vpmaddubsw_zmm",
        cpus="Skylake-SP/X",
    ),
    Level(
        "avx512_vnni",
        arch="x86",
        base="avx512",
        flags=("-mavx512vnni",),
        needs=(cpu("AVX512_VNNI", "avx512_vnni"),),
        serves=("i8", "u4:a8", "e2m1:a8"),
        probe="__m512i f(__m512i a, __m512i b, __m512i c) { return _mm512_dpbusd_epi32(a, b, c); }",
        emulate="-DMOEPACK_EMULATE_AVX512",
        int_instruction="vpdpbusd_zmm",
        cpus="Cascade Lake, Ice Lake, Zen 4+",
    ),
    Level(
        "avx512_bf16",
        arch="x86",
        base="avx512",
        flags=("-mavx512bf16",),
        needs=(cpu("AVX512_BF16", "avx512_bf16"),),
        serves=("bf16", "u4:a16", "f8e4m3", "e2m1:a16"),
        probe="__m512 f(__m512 a, __m512i b, __m512i c) { return _mm512_dpbf16_ps(a, (__m512bh)b, (__m512bh)c); }",
        emulate="-DMOEPACK_EMULATE_AVX512",
        float_instruction="vdpbf16ps",
        cpus="Cooper Lake, Sapphire Rapids, Zen 4+",
    ),
    Level(
        "amx_bf16",  # tile matrix multiply (tdpbf16ps) for bf16 rows; vdpbf16ps for the rest
        arch="x86",
        base="avx512_bf16",
        # AVX512_VBMI: the fp8 decode's byte-table lookup (docs/KERNELS.md); every CPU with AMX has it
        flags=("-mamx-tile", "-mamx-bf16", "-mavx512vbmi"),
        needs=(
            cpu("AMX-TILE/AMX-BF16", "amx_tile", "amx_bf16"),
            cpu("AVX512_VBMI", "avx512vbmi"),
            os_state("AMX tile data (XCR0 and the kernel's permission, arch_prctl)", "os_amx"),
        ),
        serves=("bf16", "u4:a16", "f8e4m3", "e2m1:a16"),
        probe="void f(void) { _tile_dpbf16ps(0, 1, 2); }",
        float_instruction="tdpbf16ps",
        cpus="Sapphire Rapids, Emerald Rapids, Granite Rapids",
    ),
    Level(
        "amx_int8",  # tile matrix multiply (tdpbssd) for int8 rows; AVX-512 BW for the rest
        arch="x86",
        base="avx512_vnni",
        # AVX512_VBMI: the mxfp4 A8 decode's (shift, code) byte-table lookup (docs/KERNELS.md);
        # every CPU with AMX has it
        flags=("-mamx-tile", "-mamx-int8", "-mavx512vbmi"),
        needs=(
            cpu("AMX-TILE/AMX-INT8", "amx_tile", "amx_int8"),
            cpu("AVX512_VBMI", "avx512vbmi"),
            os_state("AMX tile data (XCR0 and the kernel's permission, arch_prctl)", "os_amx"),
        ),
        serves=("i8", "u4:a8", "e2m1:a8"),
        probe="void f(void) { _tile_dpbssd(0, 1, 2); }",
        # tdpbssd's rate: u4 A8 takes tdpbsud, mxfp4 A8 tdpbssd on the e8m0-folded weights, on
        # chunks of 4+ rows; fewer rows take vpdpbusd zmm (docs/KERNELS.md)
        int_instruction="tdpbssd",
        cpus="Sapphire Rapids, Emerald Rapids, Granite Rapids",
    ),
    # ---- AArch64 (csrc/arm/). Baseline ARMv8-A has Advanced SIMD (every AArch64 CPU moepack
    # targets); the others are optional features of ARMv8.2+ that -march=...+<feature> enables.
    Level(
        "neon",  # fp32 FMA on widened bf16; int8 with smull + sadalp
        arch="arm",
        needs=(cpu("Advanced SIMD (asimd)", "asimd"),),
        cpus="every AArch64 CPU (Cortex-A53+, Graviton 1+, Apple M1+)",
    ),
    Level(
        "neon_dotprod",  # sdot
        arch="arm",
        base="neon",
        flags=("-march=armv8.2-a+dotprod",),
        needs=(cpu("the dot product (SDOT, asimddp)", "asimddp"),),
        serves=("i8", "u4:a8", "e2m1:a8"),
        probe="int32x4_t f(int32x4_t a, int8x16_t b, int8x16_t c) { return vdotq_s32(a, b, c); }",
        cpus="Neoverse N1 (Graviton 2), Ampere Altra, Apple M1+",
    ),
    Level(
        "neon_i8mm",  # smmla (2 rows x 2 columns x 8 K per instruction); sdot for an odd row
        arch="arm",
        base="neon_dotprod",
        flags=("-march=armv8.2-a+dotprod+i8mm",),
        needs=(cpu("the int8 matrix multiply (SMMLA, i8mm)", "i8mm"),),
        serves=("i8", "u4:a8", "e2m1:a8"),
        probe="int32x4_t f(int32x4_t a, int8x16_t b, int8x16_t c) { return vmmlaq_s32(a, b, c); }",
        cpus="Neoverse V1/N2/V2 (Graviton 3/4, Grace), Apple M2+",
    ),
    Level(
        "neon_bf16",  # bfmmla (2 bf16 rows x 2 columns x 4 K), bfdot for an odd row; fp32 rows: fmla
        arch="arm",
        base="neon",
        flags=("-march=armv8.2-a+bf16",),
        needs=(cpu("BF16 (BFDOT/BFMMLA, bf16)", "bf16"),),
        serves=("bf16", "u4:a16", "f8e4m3", "e2m1:a16"),
        probe="float32x4_t f(float32x4_t a, bfloat16x8_t b, bfloat16x8_t c) { return vbfmmlaq_f32(a, b, c); }",
        cpus="Neoverse V1/N2/V2 (Graviton 3/4, Grace), Apple M2+",
    ),
)

_BY_NAME = {lv.name: lv for lv in LEVELS}
_ARCH_BY_NAME = {a.name: a for a in ARCHES}


def level(name: str) -> Level:
    return _BY_NAME[name]


def arch(name: str) -> Arch:
    return _ARCH_BY_NAME[name]


def chain(lv: Level) -> list[Level]:
    """lv, its base, the base's base, ...: the levels whose requirements and flags lv has."""
    out = [lv]
    while out[-1].base is not None:
        out.append(_BY_NAME[out[-1].base])
    return out


def all_flags(lv: Level) -> list[str]:
    """The compiler flags of lv's kernel file: its base's, then its own (each once)."""
    out: list[str] = []
    for x in reversed(chain(lv)):
        out += [f for f in x.flags if f not in out]
    return out


def all_needs(lv: Level) -> list[Need]:
    """Every requirement of lv, in the order csrc/dispatch.cpp checks them."""
    return [n for x in chain(lv) for n in x.needs]


def features_of(lv: Level, by: str | None = None) -> list[str]:
    """The CpuFeatures members lv needs (those of kind `by` only, when given), its base's included."""
    return list(dict.fromkeys(f for n in all_needs(lv) if by is None or n.by == by for f in n.features))


def features(by: str | None = None) -> list[str]:
    """Every CpuFeatures member some level needs (those of kind `by` only, when given), in order;
    without `by`, the architectures' information-only features (Arch.info_features) after them."""
    needed = [f for lv in LEVELS for f in features_of(lv, by)]
    info = [f for a in ARCHES for f in a.info_features] if by is None else []
    return list(dict.fromkeys(needed + info))


def arch_levels(arch_name: str) -> list[Level]:
    return [lv for lv in LEVELS if lv.arch == arch_name]


def build_arch(machine: str) -> Arch | None:
    """The architecture whose folder a build on `machine` (platform.machine()) compiles."""
    return next((a for a in ARCHES if machine.lower() in a.machines), None)


SERVE_MODES = ("a16", "a8")  # moepack.layout.ACT_MODES, in the order of their serve-mask bits


def serves_kind(lv: Level, weight_kind: str, act_mode: str | None = None) -> bool:
    """Whether lv serves layouts of weight kind `weight_kind` (of its architecture's family)
    called in activation mode `act_mode` (None: in some mode)."""
    if lv.serves is None:
        return True
    return any(e == weight_kind or (e.startswith(weight_kind + ":") and act_mode in (None, e.split(":", 1)[1]))
               for e in lv.serves)  # fmt: skip


def serve_pairs(lv: Level) -> list[tuple[str, str]]:
    """(weight kind, act mode) pairs lv serves (lv.serves must not be None)."""
    out = []
    for e in lv.serves or ():
        kind, _, mode = e.partition(":")
        out += [(kind, m) for m in ((mode,) if mode else SERVE_MODES)]
    return out


def doc_rows() -> list[tuple[str, str, str, str]]:
    """(level, the CPU needs, serves, e.g.) per level, for the docs' tables."""
    rows = []
    for lv in LEVELS:
        needs = lv.doc_needs or " + ".join(([lv.base] if lv.base else []) + [n.what for n in lv.needs if n.by == "cpu"])
        if lv.arch is None:
            serves = "every layout"
        else:
            family = arch(lv.arch).layout_family
            names = {"i8": "int8", "u4:a8": "int4 (A8)", "u4:a16": "int4 (A16)", "u4": "int4",
                     "e2m1:a8": "mxfp4/nvfp4 (A8)", "e2m1:a16": "mxfp4/nvfp4 (A16)"}
            kinds = ", ".join(names.get(k, k) for k in lv.serves) if lv.serves else family
            serves = f"{kinds} layouts"
        rows.append((lv.name, needs, serves, lv.cpus))
    return rows


def _validate() -> None:
    names = [lv.name for lv in LEVELS]
    if len(set(names)) != len(names):
        raise ValueError(f"moepack/isa_levels.py: level names {names} repeat one: each level is listed once")
    if LEVELS[0].name != "scalar" or any(lv.arch is None for lv in LEVELS[1:]):
        raise ValueError("moepack/isa_levels.py: LEVELS[0] must be the portable scalar level and the only one without an arch")
    for i, lv in enumerate(LEVELS):
        if lv.arch is not None and lv.arch not in _ARCH_BY_NAME:
            raise ValueError(f"level {lv.name}: arch={lv.arch!r} is not one of the ARCHES {list(_ARCH_BY_NAME)}")
        if lv.base is not None:
            if lv.base not in names[:i]:
                raise ValueError(f"level {lv.name}: base={lv.base!r} must be a level listed before it")
            if _BY_NAME[lv.base].arch != lv.arch:
                raise ValueError(f"level {lv.name}: base={lv.base!r} is of another architecture")
        if lv.arch is not None and not all_needs(lv):
            raise ValueError(f"level {lv.name}: needs no CPU feature: every architecture level needs some")
        if lv.emulate_needs_host and arch(lv.arch).emulate_with is None:
            raise ValueError(f"level {lv.name}: emulate_needs_host with arch {lv.arch} that has no emulate_with")
        for n in lv.needs:
            if n.by not in ("cpu", "os") or not n.features:
                raise ValueError(f"level {lv.name}: need {n} must be by 'cpu' or 'os' and name features")
    for a in ARCHES:
        if a.emulate_with is not None and level(a.emulate_with).arch != a.name:
            raise ValueError(f"arch {a.name}: emulate_with={a.emulate_with!r} is not one of its levels")


_validate()
