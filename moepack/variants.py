"""Kernel variants: how a fused call walks the weights, chosen per host by measurement.

A *variant* (csrc kernel.h ``Variant``; docs/KERNELS.md "Variants and the tuner") is a set of
run-time knobs that decide a core's read rate and nothing else: the order the workers take the
tasks (``walk``), stage 1's gate and up blocks read as two streams at once (``pair``), the
AVX-512 decode kernels' K segments (``streams``), a touch of the next block's first lines
(``touch``) and the decode kernels' software prefetch distance (``pf``). Every variant computes
the same numbers (bitwise; ``streams`` sums K segments in another fp32 order).

The native extension keeps one table, (layout, activation mode, token class) -> variant, whose
entries default to the build's choices. ``moepack tune`` (moepack/bench/tune.py) times the
candidates on this host and writes its picks to a cache file keyed by the machine (CPU model,
flags, logical CPUs) and the build (the extension file); :func:`apply_cached` puts them into
the table when the extension loads (``moepack._ops.load_extension``), so ``moepack.open``,
``pack_experts`` and ``run_experts`` use them with no user action. A cache of another machine or
build, or one that does not parse, is ignored with one line on stderr.

Environment: ``MOEPACK_VARIANT`` forces one variant for every call (the C++ parser's syntax,
e.g. ``walk=stride,pair=1``); ``MOEPACK_TUNE=0`` leaves the table at the defaults;
``MOEPACK_TUNE_CACHE`` names the cache file to read and write instead of the per-machine one.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .host import cache_dir, cpu_model

TOKEN_CLASSES = ("t1", "t2-16", "t17+")  # kernel.h token_class: T = 1, 2..16, more
CACHE_FORMAT = 1


def token_class(tokens: int) -> int:
    """The index in TOKEN_CLASSES of a call with ``tokens`` tokens (kernel.h token_class)."""
    return 0 if tokens <= 1 else 1 if tokens <= 16 else 2


def parse_spec(spec: str) -> dict[str, str]:
    """A variant spec ("walk=stride,pair=1") as a dict, in the given order (no validation: the
    native parser validates)."""
    out: dict[str, str] = {}
    for part in filter(None, spec.split(",")):
        key, _, val = part.partition("=")
        out[key] = val
    return out


DEFAULTS = {"walk": "guided", "pair": "0", "streams": "0", "touch": "0", "pf": "-1", "nta": "0", "dot": "0", "slow": "0"}


def short(spec: str) -> str:
    """A spec without its knobs at their defaults ("" when all are)."""
    return format_spec({k: v for k, v in parse_spec(spec).items() if DEFAULTS.get(k) != v})


def format_spec(knobs: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in knobs.items())


# ---- the cache -------------------------------------------------------------------------------


def build_id() -> str:
    """The native build: the extension file's name, size and modification time (a rebuild changes
    it, so a tune of one build never applies to another)."""
    from . import _C  # noqa: F401  (loaded by the caller)

    path = Path(sys.modules["moepack._C"].__file__)
    st = path.stat()
    return f"{path.name}:{st.st_size}:{st.st_mtime_ns}"


def machine_facts() -> dict:
    """What a tune is valid for: this CPU (model, the features the extension sees, logical CPUs)
    and this build."""
    from ._ops import ops

    flags = sorted(str(f) for f in ops().cpu_flags())
    return {"cpu_model": cpu_model(), "cpu_flags": flags, "logical_cpus": os.cpu_count(), "build": build_id()}


def cache_path(facts: dict | None = None) -> Path:
    """The tune cache of this machine and build (MOEPACK_TUNE_CACHE when set)."""
    env = os.environ.get("MOEPACK_TUNE_CACHE")
    if env:
        return Path(env)
    facts = facts or machine_facts()
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir("tune") / f"variants-{key}.json"


@dataclass
class Choice:
    """One entry of the table: what a (layout, act mode, token class) runs, and why."""

    layout: str
    act_mode: str
    tclass: str
    spec: str  # the variant, in the native syntax ("" = the defaults)
    gain: float = 1.0  # default's time / this variant's time, as measured (1.0: defaulted)
    measured: bool = False
    note: str = ""

    def to_dict(self) -> dict:
        return {"layout": self.layout, "act_mode": self.act_mode, "tclass": self.tclass, "spec": self.spec,
                "gain": self.gain, "measured": self.measured, "note": self.note}


@dataclass
class TuneRecord:
    facts: dict
    threads: int
    measured_at: str
    shapes: list[str]
    choices: list[Choice] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"format": CACHE_FORMAT, "facts": self.facts, "threads": self.threads,
                           "measured_at": self.measured_at, "shapes": self.shapes,
                           "choices": [c.to_dict() for c in self.choices]}, indent=1)


class CacheRefused(ValueError):
    """A tune cache that is not applied: the one line that says why."""


def read_cache(path: Path, facts: dict) -> TuneRecord:
    """The record at ``path``, checked against ``facts``; CacheRefused (one line) when it is
    unreadable, of another format, or of another machine or build."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CacheRefused(f"tune cache {path} ignored: unreadable ({type(e).__name__}: {str(e)[:120]}); "
                           "`moepack tune` writes a new one") from None
    if not isinstance(raw, dict) or raw.get("format") != CACHE_FORMAT:
        fmt = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CacheRefused(f"tune cache {path} ignored: format {fmt!r}, this moepack reads {CACHE_FORMAT}; "
                           "`moepack tune` writes a new one")
    theirs = raw.get("facts")
    if theirs != facts:
        diff = [k for k in facts if not isinstance(theirs, dict) or theirs.get(k) != facts[k]]
        raise CacheRefused(f"tune cache {path} ignored: measured on another machine or build ({', '.join(diff) or 'facts'} "
                           "differ); `moepack tune` measures this one")
    try:
        choices = [Choice(**{k: c[k] for k in ("layout", "act_mode", "tclass", "spec", "gain", "measured", "note")})
                   for c in raw["choices"]]
        return TuneRecord(facts=theirs, threads=int(raw["threads"]), measured_at=str(raw["measured_at"]),
                          shapes=list(raw["shapes"]), choices=choices)
    except (KeyError, TypeError, ValueError) as e:
        raise CacheRefused(f"tune cache {path} ignored: malformed ({type(e).__name__}: {str(e)[:120]}); "
                           "`moepack tune` writes a new one") from None


def write_cache(record: TuneRecord, path: Path | None = None) -> Path:
    path = path or cache_path(record.facts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(record.to_json())
    os.replace(tmp, path)
    return path


# ---- the native table ------------------------------------------------------------------------


def set_variant(layout, act_mode: str, tclass: int, spec: str | None) -> None:
    """One entry of the native table (``spec`` None: back to the defaults). ValueError naming the
    key, value and rule for a spec that does not parse."""
    from ._ops import ops
    from .layout import layout_get

    ops().set_variant(layout_get(layout).id, act_mode, int(tclass), spec)


def current(layout, act_mode: str, tokens: int) -> str:
    """The variant a call of (layout, act_mode) with ``tokens`` tokens runs now (native syntax)."""
    from ._ops import ops
    from .layout import layout_get

    return str(ops().variant(layout_get(layout).id, act_mode, int(tokens)))


def knobs(layout, act_mode: str) -> list[str]:
    """The knobs the kernel chosen here for (layout, act_mode) reads besides walk and touch."""
    from ._ops import ops
    from .layout import layout_get

    return list(ops().variant_knobs(layout_get(layout).id, act_mode))


@dataclass
class Applied:
    path: Path | None = None
    record: TuneRecord | None = None
    message: str = ""  # why nothing was applied, or ""


_applied = Applied()


def apply_record(record: TuneRecord) -> int:
    """Every measured choice of ``record`` into the native table; returns how many."""
    from .layout import LAYOUTS

    names = {x.name for x in LAYOUTS}
    n = 0
    for c in record.choices:
        if c.layout in names and c.tclass in TOKEN_CLASSES and c.spec:
            set_variant(c.layout, c.act_mode, TOKEN_CLASSES.index(c.tclass), c.spec)
            n += 1
    return n


def apply_cached(quiet: bool = False) -> Applied:
    """Load this machine's tune cache into the native table (called once, when the extension
    loads). Nothing to apply is silent; a refused cache prints its one line on stderr."""
    global _applied
    if os.environ.get("MOEPACK_TUNE", "1") == "0":
        _applied = Applied(message="MOEPACK_TUNE=0: the build's defaults")
        return _applied
    try:
        facts = machine_facts()
        path = cache_path(facts)
    except Exception as e:  # pragma: no cover - a machine whose facts cannot be read: defaults
        _applied = Applied(message=f"machine facts unreadable ({e}): the build's defaults")
        return _applied
    if not path.is_file():
        _applied = Applied(path=path, message="not tuned on this machine and build: the build's defaults (`moepack tune`)")
        return _applied
    try:
        record = read_cache(path, facts)
        apply_record(record)
    except CacheRefused as e:
        _applied = Applied(path=path, message=str(e))
        if not quiet:
            print(f"moepack: {e}", file=sys.stderr)
        return _applied
    except ValueError as e:  # a spec the native parser refuses: the whole cache is ignored
        reset_table()
        _applied = Applied(path=path, message=f"tune cache {path} ignored: {e}")
        if not quiet:
            print(f"moepack: {_applied.message}", file=sys.stderr)
        return _applied
    _applied = Applied(path=path, record=record)
    return _applied


def applied() -> Applied:
    """What apply_cached did in this process."""
    return _applied


def reset_table() -> None:
    """Every entry of the native table back to the build's defaults."""
    from .layout import LAYOUTS

    for lay in LAYOUTS:
        for mode in lay.act_modes:
            for tc in range(len(TOKEN_CLASSES)):
                set_variant(lay, mode, tc, None)


def tuned() -> bool:
    """Whether this process runs with a tune of this machine and build."""
    return _applied.record is not None


def untuned_hint() -> str | None:
    """The one line a first bench or generate prints on a host without a tune (None: tuned, or
    the table deliberately left at the defaults)."""
    from ._ops import load_extension

    load_extension()  # (applies the cache, if any)
    if tuned() or os.environ.get("MOEPACK_TUNE", "1") == "0" or os.environ.get("MOEPACK_VARIANT"):
        return None
    return ("this machine and build are not tuned: `moepack tune` (about 3 minutes) measures the kernel variants "
            "here and keeps the fastest (docs/KERNELS.md \"Variants and the tuner\")")


def describe(layout, act_mode: str) -> list[tuple[str, str]]:
    """(token class, "default" or "spec (how it was chosen: measured with its gain, MOEPACK_VARIANT)")
    for ``moepack info``; a spec lists only the knobs off their defaults."""
    rec = _applied.record
    out = []
    for ti, tc in enumerate(TOKEN_CLASSES):
        spec = short(current(layout, act_mode, (1, 8, 512)[ti])) or "the defaults"
        how = "default"
        if os.environ.get("MOEPACK_VARIANT"):
            how = "MOEPACK_VARIANT"
        elif rec is not None:
            from .layout import layout_get

            name = layout_get(layout).name
            for c in rec.choices:
                if c.layout == name and c.act_mode == act_mode and c.tclass == tc:
                    how = (f"measured {rec.measured_at}: {c.gain:.3f}x the default's speed" if c.spec
                           else f"measured {rec.measured_at}: the default was fastest") + (f"; {c.note}" if c.note else "")
        out.append((tc, "default" if how == "default" else f"{spec} ({how})"))
    return out


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
