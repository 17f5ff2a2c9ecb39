"""Where the numbers come from: machine facts (CPU, flags, kernels, versions) and the machine
limits the benchmark divides by, measured by tools/bw_probe.c.

The probe is a small C program compiled on the fly (``build_probe``; never part of the
extension): the driver (tools/bw_probe.c: the read-pattern search, no ISA flags), the read
kernels of this machine's architecture (``PROBE_ARCHS``: tools/bw_probe_x86.c or
tools/bw_probe_arm.c, wider loads picked at run time) and one object per instruction of
``INSTRUCTIONS`` (from the architecture's file), each with its own ``-m`` flags, built only when
the CPU has the instruction (/proc/cpuinfo flags) and the compiler accepts the flags; the binary
is cached by hash of sources, compiler and parts. ``probe_machine`` runs it on a buffer larger
than the last-level cache (``cold_buffer_bytes``) and ``parse_probe_output`` reads its output:
the fastest read pattern (what bench's '% read BW' divides by), the plain read the probe had
before, the fastest decode-like read. ``machine_limits`` caches the result on disk per machine,
versioned by ``LIMITS_FORMAT`` (``moepack info``). ``kernel_instruction`` says which
instruction's peak a layout's kernel is measured against at each ISA level (a fact of the level:
its ``float_instruction`` / ``int_instruction`` in moepack/isa_levels.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..host import cpu_model  # noqa: F401  (re-exported: the bench reads it from here)


def _mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def loadavg() -> list[float] | None:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(threads: int | None = None) -> dict:
    """What the closing note needs to say where numbers come from."""
    import moepack
    from ..isa import host_isa, max_isa

    isa, reason, _ = moepack.kernel_choice()
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "mem_total_bytes": _mem_total_bytes(),
        "cpu_flags": moepack.cpu_flags(),
        "host_isa": host_isa(),
        "max_isa": max_isa(),
        "kernel_isa": isa,
        "kernel_reason": reason,
        "moepack_version": moepack.__version__,
        "git_commit": _git_commit(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "threads": threads if threads is not None else torch.get_num_threads(),
    }



# ---------------------------------------------------------------------------------------------
# The instructions whose peaks the probe measures, and which one each kernel uses


@dataclass(frozen=True)
class Instruction:
    """One dot-product instruction the kernels use; ``name`` is its part of tools/bw_probe.c
    (``probe_peak_<name>``, compiled with ``-DPROBE_PART_<name>`` and ``flags``)."""

    name: str
    asm: str  # what one counted instruction is
    needs: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have
    flags: tuple[str, ...]  # compiler flags of its part
    ops: int  # operations per instruction: 2 per multiply-add (flops for float, ops for int)
    unit: str  # "GFLOP/s" (float) or "GOP/s" (int)


INSTRUCTIONS: tuple[Instruction, ...] = (
    # 8 fp32 lanes x 1 multiply-add = 16 flops
    Instruction("fma_ymm", "vfmadd231ps ymm (AVX2 FMA)", ("avx2", "fma"), ("-mavx2", "-mfma"), 16, "GFLOP/s"),
    Instruction("fma_zmm", "vfmadd231ps zmm (AVX-512F)", ("avx512f",), ("-mavx512f",), 32, "GFLOP/s"),
    # 16 fp32 lanes x 2 bf16 pairs
    Instruction("vdpbf16ps", "vdpbf16ps zmm (AVX512_BF16)", ("avx512f", "avx512_bf16"), ("-mavx512f", "-mavx512bf16"), 64, "GFLOP/s"),
    # 16 int32 lanes x 4 u8*s8 products
    Instruction("vpdpbusd_zmm", "vpdpbusd zmm (AVX512_VNNI)", ("avx512f", "avx512_vnni"), ("-mavx512f", "-mavx512vnni"), 128, "GOP/s"),
    Instruction("vpdpbusd_ymm", "{vex} vpdpbusd ymm (AVX-VNNI)", ("avx2", "avx_vnni"), ("-mavx2", "-mavxvnni"), 64, "GOP/s"),
    # one vpmaddubsw + vpmaddwd (by ones) + vpaddd: 32 (ymm) / 64 (zmm) u8*s8 multiply-adds
    Instruction("vpmaddubsw_ymm", "vpmaddubsw+vpmaddwd+vpaddd ymm (AVX2)", ("avx2",), ("-mavx2",), 64, "GOP/s"),
    Instruction("vpmaddubsw_zmm", "vpmaddubsw+vpmaddwd+vpaddd zmm (AVX-512BW)", ("avx512f", "avx512bw"), ("-mavx512f", "-mavx512bw"), 128, "GOP/s"),
    # a 16x16 fp32 tile += 16x32 bf16 . 32x16 bf16: 8192 multiply-adds
    Instruction("tdpbf16ps", "AMX tdpbf16ps (16x16x32 bf16)", ("amx_tile", "amx_bf16"), ("-mamx-tile", "-mamx-bf16"), 16384, "GFLOP/s"),
    # a 16x16 int32 tile += 16x64 s8 . 64x16 s8: 16384 multiply-adds
    Instruction("tdpbssd", "AMX tdpbssd (16x16x64 int8)", ("amx_tile", "amx_int8"), ("-mamx-tile", "-mamx-int8"), 32768, "GOP/s"),
)
INSTRUCTION_BY_NAME = {x.name: x for x in INSTRUCTIONS}

def _kind_modes(weight_dtype: str) -> tuple[str, ...]:
    """The activation modes layouts of weight kind ``weight_dtype`` are called in
    (moepack.layout ``act_modes``, over every layout of that kind), in ACT_MODES order."""
    from ..layout import ACT_MODES, LAYOUTS

    have = {m for lay in LAYOUTS if lay.weight_dtype == weight_dtype for m in lay.act_modes}
    return tuple(m for m in ACT_MODES if m in have)


def kernel_instruction(weight_dtype: str, isa: str, act_mode: str | None = None) -> Instruction | None:
    """The instruction a kernel for ``weight_dtype`` weights called in ``act_mode`` uses at ISA
    level ``isa``: the level's ``int_instruction`` in A8 (int8 layouts, and a8 calls of a kind
    that has them), its ``float_instruction`` in A16 (moepack/isa_levels.py). ``act_mode`` None,
    or a mode the kind's layouts lack, means the kind's first mode (what a plain call runs).
    None for a (kind, mode) the level does not serve, and where the level names no instruction
    (scalar, the ARM levels: no peak measured)."""
    from .. import isa_levels as L

    modes = _kind_modes(weight_dtype)
    if not modes:
        return None
    mode = act_mode if act_mode in modes else modes[0]
    try:
        lv = L.level(isa)
    except KeyError:
        return None
    if not L.serves_kind(lv, weight_dtype, mode):
        return None
    name = lv.int_instruction if mode == "a8" else lv.float_instruction
    return None if name is None else INSTRUCTION_BY_NAME[name]


def host_cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo), less what the OS does not
    enable as the extension's probe (xgetbv) reports it; the extension's list where there is no
    /proc/cpuinfo."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    try:
        from .._ops import cpu_flags

        ext = [f for f in cpu_flags() if "=" not in f]
    except Exception:  # noqa: BLE001 - no extension: /proc/cpuinfo alone
        return flags
    if not flags:
        flags = {f for f in ext if not f.startswith("os_")}
    if "os_avx512" not in ext:
        flags = {f for f in flags if not f.startswith("avx512")}
    if "os_amx" not in ext:
        flags = {f for f in flags if not f.startswith("amx")}
    return flags


# ---------------------------------------------------------------------------------------------
# The probe's architectures: each has its file in tools/ (loads, prefetch, instruction parts)


@dataclass(frozen=True)
class ProbeArch:
    """One architecture of the probe: ``source`` (in tools/) holds its read kernels (built with
    -DPROBE_ARCH_READS) and the parts of ``instructions``; the driver, tools/bw_probe.c, is shared."""

    name: str  # as the probe prints it ("arch" in its output)
    machines: tuple[str, ...]  # platform.machine() values, lower case
    source: str
    instructions: tuple[Instruction, ...]


PROBE_ARCHS: tuple[ProbeArch, ...] = (
    ProbeArch("x86-64", ("x86_64", "amd64"), "bw_probe_x86.c", INSTRUCTIONS),
    ProbeArch("aarch64", ("aarch64", "arm64"), "bw_probe_arm.c", ()),
)


def probe_arch(machine: str | None = None) -> ProbeArch | None:
    """The probe architecture of ``machine`` (default: this one); None for one without its file."""
    machine = (machine or platform.machine()).lower()
    return next((a for a in PROBE_ARCHS if machine in a.machines), None)


def runnable_instructions(flags: set[str], machine: str | None = None) -> tuple[list[Instruction], dict[str, str]]:
    """(instructions this CPU has, {name: why not} for the others)."""
    machine = (machine or platform.machine()).lower()
    arch = probe_arch(machine)
    ok: list[Instruction] = []
    skipped: dict[str, str] = {}
    for ins in INSTRUCTIONS:
        if arch is None or ins not in arch.instructions:
            owner = next((a.name for a in PROBE_ARCHS if ins in a.instructions), "another architecture")
            skipped[ins.name] = f"an instruction of {owner}; this CPU is {machine}"
        elif missing := [f for f in ins.needs if f not in flags]:
            skipped[ins.name] = "the CPU lacks " + ", ".join(missing)
        else:
            ok.append(ins)
    return ok, skipped


# ---------------------------------------------------------------------------------------------
# The probe: build, run, parse

PROBE_FORMAT = 3  # the "probe" number of tools/bw_probe.c's output this module reads
SHAPES = ("buffer", "window", "experts")


@dataclass
class MachineProbe:
    """The machine's limits at ``threads`` threads. A number is present only when it was
    measured; ``skipped`` says why each instruction without a number has none.

    Read bandwidth: ``reads`` holds every pattern the probe measured (tools/bw_probe.c: threads,
    load, streams, prefetch, split, pages, shape); ``read_gbs`` is the fastest of them at up to
    ``threads`` threads (what bench's "% read BW" divides by), ``plain_read_gbs`` the plain read
    at ``threads`` threads (the only read before probe format 3: 16-byte loads, 1 stream, no
    prefetch, contiguous halves, 4 KiB pages, the whole buffer), ``decode_read_gbs`` the fastest
    pattern that reads 8 scattered experts once (an MoE decode call's access)."""

    threads: int = 0
    buffer_bytes: int = 0
    read_gbs: float | None = None  # best read pattern at <= `threads` threads
    read_pattern: str | None = None  # which pattern gave read_gbs (pattern_name)
    plain_read_gbs: float | None = None  # the plain read at `threads` threads
    plain_read_1t_gbs: float | None = None  # the plain read at 1 thread
    decode_read_gbs: float | None = None  # best pattern over 8 scattered experts
    decode_pattern: str | None = None
    best_read: dict | None = None  # the entry of `reads` that gave read_gbs
    reads: list[dict] = field(default_factory=list)  # every pattern measured
    arch: str = ""
    loads: list[str] = field(default_factory=list)  # load widths the probe ran
    expert_bytes: int = 0
    llc_bytes: int | None = None  # last-level cache (sysfs, else the probe's sysconf)
    huge_pages: dict = field(default_factory=dict)  # "4k"/"thp" -> bytes backed by huge pages, or why unavailable
    read_seconds: float = 0.0
    over_budget: int = 0  # patterns the search left out when its time ran out (a slow, loaded machine)
    peaks: dict[str, dict] = field(default_factory=dict)  # instruction -> asm, unit, ops, threads, value, passes
    skipped: dict[str, str] = field(default_factory=dict)  # instruction -> why it has no number
    fma_gflops: float | None = None  # best fp32 FMA peak (zmm or ymm)
    seconds: float = 0.0
    note: str = ""  # why nothing was measured, or anything odd

    @property
    def measured(self) -> bool:
        return self.read_gbs is not None

    def peak(self, name: str | None) -> float | None:
        """The peak of instruction ``name`` in its unit (GFLOP/s or GOP/s), None if unmeasured."""
        p = self.peaks.get(name) if name else None
        return None if p is None else p["value"]

    @classmethod
    def from_dict(cls, d: dict) -> MachineProbe:
        """From to_dict/asdict output (a result file); unknown keys (other versions) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def pattern_name(r: dict, expert_bytes: int = 0) -> str:
    """A read pattern of the probe's output in words, e.g. '2 threads, zmm loads, 8 streams/thread,
    prefetch 1 KiB ahead, 1 MiB chunks round-robin, 4 KiB pages, 8 scattered experts'."""
    t, s = r["threads"], r["streams"]
    split = r["split"]
    if split == 0:
        split_text = "contiguous split"
    elif expert_bytes and split == expert_bytes:
        split_text = "expert-sized chunks round-robin"
    else:
        split_text = f"{_size(split)} chunks round-robin"
    shape = {"buffer": "whole buffer", "window": "8-expert window", "experts": "8 scattered experts"}[r["shape"]]
    return ", ".join([
        f"{t} thread" + ("s" if t != 1 else ""), f"{r['load']} loads", f"{s} stream" + ("s" if s != 1 else "") + "/thread",
        f"prefetch {_size(r['prefetch'])} ahead" if r["prefetch"] else "no prefetch", split_text,
        "huge pages" if r["pages"] == "thp" else "4 KiB pages", shape,
    ])


_READ_KEYS = {"threads": int, "load": str, "streams": int, "prefetch": int, "split": int, "pages": str, "shape": str,
              "bytes": int, "role": str, "gbs": float}


def _parse_read(r: dict) -> dict:
    if not isinstance(r, dict):
        raise ValueError(f"probe output: read pattern {r!r} is not an object")
    missing = [k for k in _READ_KEYS if k not in r]
    if missing:
        raise ValueError(f"probe output: read pattern {r!r} lacks {', '.join(missing)}")
    out = {k: conv(r[k]) for k, conv in _READ_KEYS.items()}
    if out["shape"] not in SHAPES or out["pages"] not in ("4k", "thp") or out["role"] not in ("plain", "search"):
        raise ValueError(f"probe output: read pattern with shape={out['shape']!r}, pages={out['pages']!r}, role={out['role']!r}: "
                         f"expected shape in {SHAPES}, pages 4k/thp, role plain/search")
    if not (out["gbs"] >= 0 and out["threads"] >= 1 and out["streams"] >= 1):
        raise ValueError(f"probe output: read pattern with threads={out['threads']}, streams={out['streams']}, gbs={out['gbs']}")
    out["passes"] = [float(x) for x in r.get("passes", [])]
    return out


def parse_probe_output(data: dict, threads: int, buffer_bytes: int) -> MachineProbe:
    """The probe binary's JSON line (format PROBE_FORMAT) -> MachineProbe (peaks converted from
    instructions/s with ``INSTRUCTIONS``' operation counts). Refuses output it does not
    understand, by name."""
    if not isinstance(data, dict) or data.get("probe") != PROBE_FORMAT:
        got = data.get("probe") if isinstance(data, dict) else data
        raise ValueError(f"probe output: 'probe' is {got!r}, expected {PROBE_FORMAT} (tools/bw_probe.c of this moepack)")
    expert = int(data.get("expert_bytes", 0))
    llc = data.get("llc_bytes")
    probe = MachineProbe(threads=threads, buffer_bytes=int(data.get("bytes", buffer_bytes)), arch=str(data.get("arch", "")),
                         loads=[str(x) for x in data.get("loads", [])], expert_bytes=expert,
                         llc_bytes=int(llc) if llc is not None and int(llc) > 0 else None,
                         read_seconds=float(data.get("read_seconds", 0.0)), over_budget=int(data.get("over_budget", 0)))
    for kind, v in (data.get("pages") or {}).items():
        probe.huge_pages[str(kind)] = v.get("huge_bytes", v.get("unavailable")) if isinstance(v, dict) else v
    for r in data.get("read", []):
        r = _parse_read(r)
        r["name"] = pattern_name(r, expert)
        probe.reads.append(r)
    usable = [r for r in probe.reads if r["threads"] <= threads]
    plain = [r for r in probe.reads if r["role"] == "plain" and r["threads"] == threads]
    if not usable or not plain:
        raise ValueError(f"probe output: no {'plain ' if usable else ''}read pattern at {threads} threads")
    best = max(usable, key=lambda r: r["gbs"])
    probe.best_read, probe.read_gbs, probe.read_pattern = best, best["gbs"], best["name"]
    probe.plain_read_gbs = plain[0]["gbs"]
    one = [r for r in probe.reads if r["role"] == "plain" and r["threads"] == 1]
    probe.plain_read_1t_gbs = one[0]["gbs"] if one else None
    decode = [r for r in usable if r["shape"] == "experts"]
    if decode:
        d = max(decode, key=lambda r: r["gbs"])
        probe.decode_read_gbs, probe.decode_pattern = d["gbs"], d["name"]
    for p in data.get("peaks", []):
        ins = INSTRUCTION_BY_NAME.get(p.get("name"))
        if ins is None:
            raise ValueError(f"probe output: peak of unknown instruction {p.get('name')!r}")
        rate = float(p["instr_per_s"])
        if not rate > 0:
            raise ValueError(f"probe output: {ins.name} ran at {rate} instructions/s")
        probe.peaks[ins.name] = {
            "asm": ins.asm, "unit": ins.unit, "ops_per_instruction": ins.ops, "threads": int(p.get("threads", threads)),
            "value": round(rate * ins.ops / 1e9, 3),
            "passes": [round(float(x) * ins.ops / 1e9, 3) for x in p.get("passes", [])],
        }
    for name, why in (data.get("errors") or {}).items():
        probe.skipped[name] = str(why)
    fma = [probe.peak(n) for n in ("fma_zmm", "fma_ymm") if probe.peak(n) is not None]
    probe.fma_gflops = max(fma) if fma else None
    return probe


TOOLS_DIR = Path(__file__).resolve().parents[2] / "tools"
PROBE_SOURCE = TOOLS_DIR / "bw_probe.c"  # the driver; bw_probe.h and the architecture's file sit beside it
_PROBE_CFLAGS = ("-O2",)
_PROBE_MAIN_FLAGS = ("-fopenmp",)


def probe_sources(arch: ProbeArch | None, source: Path = PROBE_SOURCE) -> list[Path]:
    """The files a probe for ``arch`` is built from: driver, header, the architecture's file."""
    files = [source, source.with_name("bw_probe.h")]
    return files + ([source.with_name(arch.source)] if arch is not None else [])


def _probe_cache_dir() -> Path:
    from ..host import cache_dir

    return cache_dir("probe")


def _first_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower()]
    return (errs or lines or ["?"])[0][:200]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class ProbeBuild:
    binary: Path | None  # None: not built (note says why)
    note: str = ""
    built: list[str] = field(default_factory=list)  # instruction parts compiled in
    failed: dict[str, str] = field(default_factory=dict)  # instruction -> why its part did not compile


def build_probe(instructions: list[Instruction] | None = None, source: Path = PROBE_SOURCE, *, cc: str | None = None,
                machine: str | None = None, static: bool = False) -> ProbeBuild:
    """Compile the probe: the driver (``source``), the read kernels of ``machine``'s architecture
    (default: this machine's) and a part for each of ``instructions`` (default: those this CPU
    has) that the compiler accepts; cached by hash of sources, compiler and parts. ``cc`` and
    ``machine`` name a cross compiler and its target (``static``: link statically, for qemu-user)."""
    arch = probe_arch(machine)
    if instructions is None:
        instructions = runnable_instructions(host_cpu_flags(), machine)[0]
    files = probe_sources(arch, source)
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        return ProbeBuild(None, f"probe source {', '.join(absent)} not found (it ships with the source tree, not the wheel)")
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return ProbeBuild(None, "no C compiler (cc/gcc/clang) on PATH: set CC or install one")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return ProbeBuild(None, f"C compiler {cc} does not run: {e}")
    parts = [(x.name, x.flags) for x in instructions]
    link = ("-static",) if static else ()
    blob = b"".join(f.read_bytes() for f in files)
    key = hashlib.sha256(blob + repr((cc, version, _PROBE_CFLAGS, _PROBE_MAIN_FLAGS, link, parts, arch)).encode()).hexdigest()[:16]
    cache = _probe_cache_dir()
    binary, meta = cache / f"bw_probe-{key}", cache / f"bw_probe-{key}.json"
    if binary.is_file() and os.access(binary, os.X_OK) and meta.is_file():
        try:
            m = json.loads(meta.read_text())
            return ProbeBuild(binary, "", list(m["built"]), dict(m["failed"]))
        except (ValueError, KeyError, TypeError, OSError):
            pass  # rebuild
    arch_file = files[2] if arch is not None else None
    with tempfile.TemporaryDirectory(prefix="moepack-probe-") as tmpd:
        procs = {}
        for ins in instructions:  # the parts, in parallel
            obj = os.path.join(tmpd, f"{ins.name}.o")
            cmd = [cc, *_PROBE_CFLAGS, *ins.flags, f"-DPROBE_PART_{ins.name}", "-c", str(arch_file), "-o", obj]
            try:
                procs[ins.name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), obj, ins)
            except OSError as e:
                return ProbeBuild(None, f"compiling the probe failed: {e}")
        built, failed, objs = [], {}, []
        for name, (proc, obj, ins) in procs.items():
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                failed[name] = f"{cc} took over 120 s compiling it"
                continue
            if proc.returncode == 0:
                built.append(name)
                objs.append(obj)
            else:
                failed[name] = f"{cc} {' '.join(ins.flags)} does not compile it: {_first_error(err)}"
        main_obj, arch_obj = os.path.join(tmpd, "main.o"), os.path.join(tmpd, "arch.o")
        kernels = "".join(f"X({n})" for n in built)
        reads = ["-DPROBE_ARCH_READS"] if arch is not None else []
        tmp_bin = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
        cmds = [[cc, *_PROBE_CFLAGS, *_PROBE_MAIN_FLAGS, *reads, f"-DPROBE_KERNELS={kernels}", "-c", str(source), "-o", main_obj]]
        if arch is not None:
            cmds.append([cc, *_PROBE_CFLAGS, *reads, "-c", str(arch_file), "-o", arch_obj])
            objs.insert(0, arch_obj)
        cmds.append([cc, *_PROBE_MAIN_FLAGS, *link, main_obj, *objs, "-o", str(tmp_bin)])
        for cmd in cmds:
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                return ProbeBuild(None, f"compiling the probe failed: {e}")
            if res.returncode != 0:
                return ProbeBuild(None, f"compiling the probe ({' '.join(cmd[:4])} ...) failed: {_first_error(res.stderr)}")
    os.replace(tmp_bin, binary)  # atomic: concurrent runs never see a half-written binary
    _write_atomic(meta, json.dumps({"built": built, "failed": failed}))
    return ProbeBuild(binary, "", built, failed)


def largest_cache_bytes() -> int | None:
    """The largest CPU cache sysfs reports (the last-level cache), None where unknown."""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip().upper()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            largest = max(largest, int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return largest or None


COLD_FACTOR = 3  # the probe's buffer is at least this many times the last-level cache


def cold_buffer_bytes(requested: int, llc: int | None = None) -> tuple[int, str]:
    """(the buffer the probe reads, why it differs from ``requested``): at least COLD_FACTOR x the
    last-level cache (rounded up to 64 MiB), so that the windows and experts a pass reads rotate
    through more than the cache holds and come from memory; at most a quarter of the memory."""
    llc = largest_cache_bytes() if llc is None else llc
    if not llc:
        return requested, ""
    want = -(-COLD_FACTOR * llc // (64 << 20)) * (64 << 20)
    if requested >= want:
        return requested, ""
    mem = _mem_total_bytes()
    cap = mem // 4 if mem else want
    size = max(requested, min(want, cap))
    why = f"buffer raised from {_size(requested)} to {_size(size)}: {COLD_FACTOR}x the {_size(llc)} last-level cache"
    if size < want:
        why += f" would be {_size(want)}, over a quarter of the memory: reads may partly come from the cache"
    return size, why


def probe_machine(threads: int, buffer_bytes: int = 512 << 20, passes: int = 3, peak_seconds: float = 0.2,
                  quick: bool = False, expert_bytes: int | None = None) -> MachineProbe:
    """The read-pattern search (tools/bw_probe.c) at up to ``threads`` threads and the peak of
    every dot-product instruction this CPU has, at ``threads`` threads; or a MachineProbe whose
    note says why nothing was measured (no compiler, no source, ...). The buffer is raised to
    ``cold_buffer_bytes`` unless ``quick`` (a small, fast run whose reads may hit the cache: for
    tests and emulators, not for numbers)."""
    if threads < 1:
        raise ValueError(f"probe threads={threads}: must be >= 1")
    if buffer_bytes < threads * (1 << 20):
        raise ValueError(f"probe buffer of {buffer_bytes} bytes: must be at least 1 MiB per thread ({threads} threads)")
    if passes < 1 or not peak_seconds > 0:
        raise ValueError(f"probe passes={passes}, peak_seconds={peak_seconds}: must be >= 1 and > 0")
    t0 = time.perf_counter()
    note = ""
    if not quick:
        buffer_bytes, note = cold_buffer_bytes(buffer_bytes)
    have, skipped = runnable_instructions(host_cpu_flags())
    build = build_probe(have)
    skipped.update(build.failed)
    if build.binary is None:
        return MachineProbe(threads=threads, buffer_bytes=buffer_bytes, skipped=skipped, note=build.note)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND=os.environ.get("OMP_PROC_BIND", "close"))
    opts = (["--quick"] if quick else []) + ([f"--expert={expert_bytes}"] if expert_bytes else [])
    cmd = [str(build.binary), str(threads), str(buffer_bytes), str(passes), str(peak_seconds), *opts, *build.built]
    probe = MachineProbe(threads=threads, buffer_bytes=buffer_bytes, skipped=skipped)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.SubprocessError) as e:
        probe.note = f"probe did not run: {e}"
        return probe
    if res.returncode != 0:
        probe.note = f"probe exited {res.returncode}: {res.stderr.strip()[:200]}"
        return probe
    try:
        data = json.loads(res.stdout.strip().splitlines()[-1])
        parsed = parse_probe_output(data, threads, buffer_bytes)
    except (ValueError, IndexError, KeyError, TypeError) as e:
        probe.note = f"probe output not understood ({e}): {res.stdout[:200]!r}"
        return probe
    parsed.llc_bytes = largest_cache_bytes() or parsed.llc_bytes
    parsed.skipped = {**skipped, **parsed.skipped}
    parsed.seconds = round(time.perf_counter() - t0, 2)
    over = (f"the search ran out of time and left {parsed.over_budget} patterns out (a loaded machine reads slowly)"
            if parsed.over_budget else "")
    parsed.note = "; ".join(x for x in (note, over, "quick: a small buffer, reads may come from the cache" if quick else "") if x)
    return parsed


# ---------------------------------------------------------------------------------------------
# Machine limits cached on disk (moepack info)

# bump when the cached record changes meaning; a record of another format is measured again.
# 2: read_gbs is the best of the pattern search (probe format 3), not of 16 stream/prefetch patterns
LIMITS_FORMAT = 2


def limits_cache_key(threads: int, buffer_bytes: int) -> str:
    """Machine (CPU model, flags, CPU count) + probe (sources, instruction table) + sizes."""
    src = b"".join(f.read_bytes() for f in probe_sources(probe_arch()) if f.is_file())
    facts = (LIMITS_FORMAT, cpu_model(), sorted(host_cpu_flags()), os.cpu_count(), threads, buffer_bytes, INSTRUCTIONS)
    return hashlib.sha256(src + repr(facts).encode()).hexdigest()[:16]


def machine_limits(threads: int, refresh: bool = False, buffer_bytes: int = 512 << 20) -> tuple[MachineProbe, dict]:
    """The machine's limits at ``threads`` threads: from the on-disk cache, or measured now (and
    cached) when there is none, when it has another LIMITS_FORMAT, or ``refresh``. Returns (probe,
    {"cached": bool, "measured_at": iso time, "bg_cpus": CPUs other processes used while it was
    measured, "cache_file": path, "remeasured": why the cached record was not used, or None})."""
    from .timing import CpuMeter

    path = _probe_cache_dir() / f"limits-{limits_cache_key(threads, buffer_bytes)}.json"
    remeasured = None
    if not refresh and path.is_file():
        try:
            rec = json.loads(path.read_text())
            if rec.get("format") == LIMITS_FORMAT:
                meta = {"cached": True, "measured_at": rec.get("measured_at"), "bg_cpus": rec.get("bg_cpus"),
                        "cache_file": str(path), "remeasured": None}
                return MachineProbe.from_dict(rec["probe"]), meta
            remeasured = f"cached record has format {rec.get('format')!r}, this moepack writes {LIMITS_FORMAT}"
        except (ValueError, KeyError, TypeError, OSError) as e:
            remeasured = f"cached record unreadable ({e})"
    meter = CpuMeter()
    meter.start()
    probe = probe_machine(threads, buffer_bytes)
    bg = meter.stop()
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = {"cached": False, "measured_at": when, "bg_cpus": bg, "cache_file": None, "remeasured": remeasured}
    if probe.measured:
        rec = {"format": LIMITS_FORMAT, "measured_at": when, "bg_cpus": bg, "probe": dataclasses.asdict(probe)}
        try:
            _write_atomic(path, json.dumps(rec, indent=1))
            meta["cache_file"] = str(path)
        except OSError:
            pass
    return probe, meta


def describe_limits(probe: MachineProbe) -> list[tuple[str, str]]:
    """(label, text) lines for ``moepack info`` and the bench's notes."""
    if not probe.measured:
        return [("machine limits", f"not measured: {probe.note}")]
    lines = []
    threads = f"{probe.threads} thread" + ("s" if probe.threads != 1 else "")
    text = f"{probe.read_gbs:.1f} GB/s best ({probe.read_pattern})"
    lines.append(("read bandwidth", text))
    plain = f"{probe.plain_read_gbs:.1f} GB/s at {threads}"
    if probe.plain_read_1t_gbs is not None and probe.threads != 1:
        plain += f", {probe.plain_read_1t_gbs:.1f} GB/s at 1 thread"
    lines.append(("plain read", plain + " (the probe's only read before format 3: 16-byte loads, 1 stream, no prefetch, "
                                        "contiguous split, 4 KiB pages, whole buffer)"))
    if probe.decode_read_gbs is not None:
        lines.append(("decode-like read", f"{probe.decode_read_gbs:.1f} GB/s best over 8 scattered experts of "
                                          f"{_size(probe.expert_bytes)} ({probe.decode_pattern})"))
    thp = probe.huge_pages.get("thp")
    if isinstance(thp, int):
        pages = f"huge pages backed {_size(thp)} of it" if thp >= 0 else "huge pages asked for, backing unknown (no /proc/self/smaps)"
    else:
        pages = f"huge pages: {thp}" if thp is not None else "huge pages not measured"
    llc = f", last-level cache {_size(probe.llc_bytes)}" if probe.llc_bytes else ""
    lines.append(("read search", f"{len(probe.reads)} patterns in {probe.read_seconds:.1f} s over a {_size(probe.buffer_bytes)} "
                                 f"buffer{llc}; loads {', '.join(probe.loads) or '?'}; {pages}"
                                 + (f"; {probe.note}" if probe.note else "")))
    for ins in INSTRUCTIONS:
        p = probe.peaks.get(ins.name)
        if p is not None:
            lines.append((f"peak {ins.name}", f"{p['value']:.0f} {p['unit']}, {p['threads']} thread{'s' if p['threads'] != 1 else ''}: {ins.asm}"))
        elif ins.name in probe.skipped:
            lines.append((f"peak {ins.name}", f"- ({probe.skipped[ins.name]})"))
    return lines
