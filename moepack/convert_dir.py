"""``moepack convert SRC DST``: a Hugging Face checkpoint directory -> a packed directory.

Streaming: the whole plan (every layer, every tensor, every shard's header) is made from the
source's headers and config.json first, so bad input is refused before anything is written;
then one layer at a time is read, packed and written. Everything goes into a temporary sibling
of DST that is renamed to DST only when complete (moepack/container), so an interrupted or
failed convert never leaves a directory under the final name.

Schemes (moepack.schemes): a quantized source (int8 compressed-tensors, int4 GPTQ / AWQ /
pack-quantized) is packed into its scheme's layout with its own codes and scales (never
re-quantized); a float source is packed as is, or quantized one expert at a time into the scheme
``quantize`` names, with that scheme's options (``"int4:g64:asym"``: parse_quantize). Each
layer's manifest entry records ``scheme`` and ``scheme_source``; the report carries the
quantization error of what was quantized (``ConvertReport.quant_error``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ._version import __version__
from .container.reader import read_safetensors_header, sha256_update
from .container.writer import ShardPlan, ShardWriter, atomic_directory, os_reason
from .errors import ConvertError, LayoutError, MoepackError
from .errors import UnsupportedError
from .layout import DEFAULT_LAYOUT, PackedLayout, layout_expert_shapes, layout_get, layout_tensor_plan
from .runtime.model import FORMAT_VERSION, MANIFEST, PERM_FORMAT_VERSION
from .schemes import LayerSource, QuantError, Scheme, get_scheme, schemes
from .sources import Checkpoint, LayerSpec, SourceReader, open_source, text_config

DEFAULT_SHARD_BYTES = 2 << 30

ProgressFn = Callable[..., None]


def expert_tensor_name(layer: int, role: str) -> str:
    return f"moepack.layers.{layer}.{role}"


@dataclass
class ConvertReport:
    dst: Path
    layout: str = ""  # the layout written (a quantized source or quantize=: that scheme's layout)
    scheme: str = ""  # the scheme written
    quantize: str | None = None  # the quantizer and its options when float weights were quantized ("int4_group:g128:sym")
    quant_error: float | None = None  # ||dequant(q) - w|| / ||w|| over every weight quantized from float
    quant_error_worst: tuple | None = None  # (layer index, its relative error) of the layer quantized worst
    act_modes: list = field(default_factory=list)  # the act modes recorded as the layers' defaults
    layers: int = 0
    experts_bytes: int = 0
    other_bytes: int = 0
    seconds: float = 0.0
    files: list = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        return (self.experts_bytes + self.other_bytes) / 1e6 / max(self.seconds, 1e-9)


def _swiglu_params(config: dict) -> tuple[float, float]:
    limit = config.get("swiglu_limit", 7.0)
    alpha = config.get("swiglu_alpha", 1.702)
    return float(alpha), float(limit)


def _routing_for(config: dict) -> tuple[dict | None, str]:
    try:
        from .routing import RoutingConfig
    except ImportError:  # pragma: no cover
        return None, "moepack.routing is not available"
    try:
        return RoutingConfig.from_hf_config(config).to_dict(), "from config.json"
    except MoepackError as e:
        return None, str(e)


def _plan_layer_tensors(spec: LayerSpec, layout: PackedLayout, scheme: Scheme) -> list[tuple[str, torch.dtype, tuple]]:
    """(stored name, dtype, shape) of every packed tensor of one layer, in write order: the
    layout's tensor plan (moepack.layout.layout_tensor_plan) for the routed experts (+ biases,
    + the act-order w13_perm), then the shared expert's."""
    plan = layout_tensor_plan(layout, spec.num_experts, spec.hidden, spec.intermediate, bias=spec.has_bias,
                              perm=scheme.has_perm(spec))  # fmt: skip
    if spec.shared:
        plan += layout_tensor_plan(layout, 1, spec.hidden, spec.shared["intermediate"], perm=scheme.has_perm(spec, True),
                                   prefix="shared_")  # fmt: skip
    return [(expert_tensor_name(spec.index, t.name), getattr(torch, t.dtype), t.shape) for t in plan]


def parse_quantize(quantize: str | None) -> tuple[Scheme | None, object]:
    """``quantize`` -> (the scheme, its options object or None). The spelling: a scheme name or
    alias, then its options after colons (``"int8"``, ``"int4"``, ``"int4:g64:asym"``,
    ``"int4_group:ch"``); None -> (None, None). Refused naming the value and the rule: an unknown
    scheme, a scheme that does not quantize float weights, an option the scheme does not take."""
    if quantize is None:
        return None, None
    name, *words = str(quantize).split(":")
    try:
        scheme = get_scheme(name)
    except UnsupportedError:
        scheme = None
    if scheme is None or not scheme.quantized:
        known = ", ".join(f"{x.name!r}" + (f" (or {', '.join(map(repr, x.aliases))})" if x.aliases else "")
                          for x in schemes() if x.quantized)  # fmt: skip
        raise ConvertError(f"quantize={quantize!r}: moepack quantizes to {known}")
    try:
        return scheme, scheme.options(tuple(words))
    except (UnsupportedError, ConvertError) as e:
        raise ConvertError(f"quantize={quantize!r}: {e}") from None


def _target_scheme(lay: PackedLayout, scheme: Scheme | None, reader: SourceReader) -> Scheme:
    """The scheme a convert packs into: ``scheme`` (``quantize``) when given, else the source's own
    (a quantized source stays in its scheme: A8 checkpoints are never dequantized), else the
    layout's."""
    try:
        source = get_scheme(reader.scheme)
    except UnsupportedError:
        raise ConvertError(f"source reader {reader.name!r} has scheme {reader.scheme!r}, which convert cannot pack") from None
    if scheme is not None:
        if source.quantized and source is not scheme:
            raise ConvertError(f"quantize={scheme.name!r} with a {reader.scheme} source: moepack never re-quantizes a quantized checkpoint")
        return scheme
    return source if source.quantized else get_scheme(lay)


def _target_layout(lay: PackedLayout, scheme: Scheme, options, reader: SourceReader, specs: list) -> PackedLayout:
    """The layout a convert writes: a source of ``scheme`` packs into the layout its own facts
    call for (int4: its group size; ``Scheme.source_layout``); quantizer options name theirs
    (int4: the group size's); else ``lay`` when it is of ``scheme``, else the scheme's layout of
    ``lay``'s ISA family."""
    try:
        if scheme.keeps_source(reader) and scheme.source_layout is not None:
            return scheme.source_layout(specs, lay if lay.scheme == scheme.name else scheme.layout_for(lay.family))
        if options is not None and hasattr(options, "layout"):
            return options.layout(lay.family)
        return lay if lay.scheme == scheme.name else scheme.layout_for(lay.family)
    except (UnsupportedError, LayoutError) as e:
        raise ConvertError(str(e)) from None


def _source_element(s: LayerSpec, role: str, e: int, idx: list[int]) -> tuple[str, list[int]]:
    """The source tensor and index that hold element ``idx`` of expert ``e``'s canonical ``role``
    tensor (w13/w2: ``[1, N, K]``; w13_bias/w2_bias: ``[E, N]``, row = expert; shared_w13/w2)."""
    if role.startswith("shared_"):
        _, r, c = idx
        si = s.shared["intermediate"]
        if role == "shared_w2":
            return s.shared["down_proj"], [r, c]
        return (s.shared["gate_proj"], [r, c]) if r < si else (s.shared["up_proj"], [r - si, c])
    i = s.intermediate
    if role.endswith("_bias"):
        e, r = idx
        if s.kind != "per_expert":
            return s.names["gate_up_bias" if role == "w13_bias" else "down_bias"], [e, r]
        if role == "w2_bias":
            return s.names[(e, "down", "bias")], [r]
        return (s.names[(e, "gate", "bias")], [r]) if r < i else (s.names[(e, "up", "bias")], [r - i])
    _, r, c = idx
    if s.kind == "per_expert":
        if role == "w2":
            return s.names[(e, "down", "weight")], [r, c]
        return (s.names[(e, "gate", "weight")], [r, c]) if r < i else (s.names[(e, "up", "weight")], [r - i, c])
    name = s.names["gate_up" if role == "w13" else "down"]
    return name, ([e, r, c] if s.kind in ("fused_out", "granite") else [e, c, r])


def _pack_checked(pack: Callable, t: torch.Tensor, s: LayerSpec, role: str, e: int = 0) -> torch.Tensor:
    """``pack(t)``; a non-finite source value is refused naming the SOURCE tensor and index (the
    packer only sees one expert at a time, so its own message cannot)."""
    try:
        return pack(t)
    except LayoutError as ex:
        bad = ~torch.isfinite(t)
        if not bool(bad.any()):
            raise
        idx = bad.nonzero()[0].tolist()
        name, at = _source_element(s, role, e, idx)
        v = float(t[tuple(idx)])
        raise ConvertError(
            f"layer {s.index}: source tensor {name!r} has a non-finite value ({v}) at {at}: "
            f"expert weights and biases must be finite (packer: {str(ex).splitlines()[0]})"
        ) from None


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty(0, dtype=dtype).element_size()


def _split_shards(items: list, size_of: Callable, limit: int) -> list[list]:
    shards, cur, cur_bytes = [], [], 0
    for it in items:
        b = size_of(it)
        if cur and cur_bytes + b > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(it)
        cur_bytes += b
    if cur:
        shards.append(cur)
    return shards


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    layout: int | str | PackedLayout = DEFAULT_LAYOUT,
    quantize: str | None = None,
    overwrite: bool = False,
    threads: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: ProgressFn | None = None,
    act_mode: str | None = None,
    resume: bool = True,
    pipeline: bool = True,
) -> ConvertReport:
    """Convert the checkpoint at ``src`` into a packed directory at ``dst``.

    ``quantize``: quantize a float source's experts into a scheme, ``"<scheme>[:option...]"``:
    ``"int8"`` (W8A8, per output channel) or ``"int4"`` (round to nearest; options ``g32`` /
    ``g64`` / ``g128`` (default) / ``ch`` for the group size, ``sym`` (default) / ``asym``, e.g.
    ``"int4:g64:asym"``), packed into that scheme's layout of the family (a quantized source is
    packed into its own scheme anyway, never re-quantized). ``ConvertReport.quant_error`` is the
    resulting weight error; ``verify(..., source=)`` judges the output error.
    ``act_mode`` ("a16" / "a8"): the activation mode recorded as every layer's default (the
    manifest's ``act_mode``), refused when the layout does not serve it; None: each layer's own
    (int4: a16, the checkpoint's meaning; a8 for a compressed-tensors W4A8 checkpoint).

    ``resume``: a temporary directory left by a hard-killed convert to the same ``dst`` with the
    same plan (source fingerprint, layout, options, moepack version) is continued from its last
    complete, re-checked shard; False (or a plan that differs) deletes it and starts over.
    ``pipeline``: pack, hash and write on three threads (False: one after the other on the
    calling thread, the reference path; the bytes are the same). SIGTERM and SIGHUP delete the
    temporary directory like Ctrl-C does (docs/ARCHITECTURE.md, "convert")."""
    t0 = time.perf_counter()
    lay = layout_get(layout)
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise ConvertError(f"destination {dst} already exists: choose another path or pass overwrite=True (--overwrite)")
    if dst.resolve() == src.resolve():
        raise ConvertError(f"destination {dst} is the source: write the packed directory somewhere else")
    if threads is not None and threads <= 0:
        raise ConvertError(f"threads={threads}: must be a positive integer")
    if act_mode is not None and act_mode not in ("a16", "a8"):
        raise ConvertError(f"act_mode={act_mode!r}: must be 'a16' or 'a8' (or None: each layer's default)")
    parse_quantize(quantize)  # refused before anything is opened
    opts = _Options(quantize, act_mode, shard_bytes, resume, pipeline)
    with torch_threads(threads), _signals_interrupt():
        return _convert(src, dst, lay, overwrite, progress, t0, opts)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a convert: raised like Ctrl-C's KeyboardInterrupt, so the same
    cleanup runs (the temporary directory is deleted), then the signal is delivered again."""

    def __init__(self, signum: int):
        super().__init__(f"convert stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt():
    """SIGTERM / SIGHUP raise ``Terminated`` in the main thread for the block. After the cleanup,
    a signal whose previous handler was the default is sent again so that the process ends by
    it (exit status 128+N, as without moepack); a Python handler is called instead. A second
    signal during the cleanup is ignored rather than cutting the cleanup short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [x for x in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if x is not None]
    fired: list[int] = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise Terminated(signum)

    before = {x: signal.signal(x, handler) for x in sigs}
    try:
        yield
    except Terminated as e:
        for x, h in before.items():
            signal.signal(x, h)
        prev = before[e.signum]
        if prev == signal.SIG_DFL:
            os.kill(os.getpid(), e.signum)
        elif callable(prev):
            prev(e.signum, None)
        raise
    finally:
        for x, h in before.items():
            signal.signal(x, h)


@dataclass(frozen=True)
class _Options:
    quantize: str | None
    act_mode: str | None
    shard_bytes: int
    resume: bool
    pipeline: bool


@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's thread count (process-wide) set to ``n`` for the block, restored after; None
    leaves it alone."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class _Plan:
    """Everything a convert will write, decided from config.json and the headers alone."""

    src: Path
    ckpt: Checkpoint
    reader: SourceReader
    scheme: Scheme
    layout: PackedLayout
    specs: list
    options: object  # the quantizer's options (Scheme.options), or None
    config: dict
    layer_tensors: dict  # layer index -> [(stored name, dtype, shape)] in write order
    expert_shards: list  # [[LayerSpec]] per experts-*.safetensors
    expert_files: list
    other_shards: list  # [[tensor name]] per model-*.safetensors
    other_files: list
    routing: dict | None
    routing_note: str
    alpha: float
    limit: float
    act_modes: dict  # layer index -> the act mode recorded as its default
    shard_plans: dict = field(default_factory=dict)  # file name -> ShardPlan (every shard, planned up front)

    @property
    def quantizer(self) -> str | None:
        """The quantizer with every option spelled out ("int4_group:g128:sym", "int8_channel")
        when this convert quantizes float weights; None when it does not."""
        if not self.scheme.quantized or self.scheme.keeps_source(self.reader):
            return None
        return self.options.key() if self.options is not None else self.scheme.name


def _plan(src: Path, lay: PackedLayout, quantize, shard_bytes: int, act_mode: str | None = None) -> _Plan:
    """Stage 1: the source, the scheme and layout it packs into, every tensor and shard."""
    ckpt, reader = open_source(src)
    qscheme, options = parse_quantize(quantize)
    scheme = _target_scheme(lay, qscheme, reader)
    specs = reader.layers(ckpt)
    if scheme.keeps_source(reader):
        if ":" in str(quantize or ""):
            raise ConvertError(f"quantize={quantize!r} with a {reader.scheme} source ({reader.name}): its own codes are packed "
                               "as stored, never re-quantized; quantizer options apply to float sources only")  # fmt: skip
        options = None  # a source of the scheme is packed as stored: no quantizer runs
    lay = _target_layout(lay, scheme, options, reader, specs)
    config = text_config(ckpt.config)
    expert_names = {n for s in specs for n in s.expert_tensors}
    other = [n for n in ckpt.tensors if n not in expert_names]
    if act_mode is not None and act_mode not in lay.act_modes:
        raise ConvertError(f"act_mode={act_mode!r}: layout {lay.name} (scheme {lay.scheme}) runs with "
                           f"{' or '.join(lay.act_modes)} activations only")  # fmt: skip
    act_modes = {s.index: act_mode or scheme.default_act_mode(s, lay) for s in specs}
    layer_tensors = {s.index: _plan_layer_tensors(s, lay, scheme) for s in specs}
    expert_shards = _split_shards(specs, lambda s: sum(_nbytes(d, sh) for _, d, sh in layer_tensors[s.index]), shard_bytes)
    other_shards = _split_shards(other, lambda n: ckpt.info(n).nbytes, shard_bytes) if other else []
    ne, no = len(expert_shards), len(other_shards)
    _check_top_k(config, specs)
    routing, routing_note = _routing_for(config)
    alpha, limit = _swiglu_params(config)
    pl = _Plan(
        src, ckpt, reader, scheme, lay, specs, options, config, layer_tensors, expert_shards,
        [f"experts-{i + 1:05d}-of-{ne:05d}.safetensors" for i in range(ne)], other_shards,
        [f"model-{i + 1:05d}-of-{no:05d}.safetensors" for i in range(no)], routing, routing_note, alpha, limit, act_modes,
    )  # fmt: skip
    for fname, shard_specs in zip(pl.expert_files, pl.expert_shards):
        shard = pl.shard_plans[fname] = ShardPlan()
        for s in shard_specs:
            for name, dt, shape in pl.layer_tensors[s.index]:
                shard.add(name, dt, shape)
    for fname, names in zip(pl.other_files, pl.other_shards):
        shard = pl.shard_plans[fname] = ShardPlan()
        for n in names:
            ti = ckpt.info(n)
            shard.add(n, ti.dtype, ti.shape)
    return pl


_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token")


def _check_top_k(config: dict, specs: list) -> None:
    """config.json's experts-per-token, where it has one, must be an integer in [1, experts] for
    every MoE layer: refused here, at convert, rather than by ``run`` on the packed directory."""
    key = next((k for k in _TOP_K_KEYS if config.get(k) is not None), None)
    if key is None or not specs:
        return
    k = config[key]
    if not isinstance(k, int) or isinstance(k, bool):
        raise ConvertError(f"config.json: {key}={k!r} must be an integer (the number of experts each token is routed to)")
    fewest = min(specs, key=lambda x: x.num_experts)
    if not 1 <= k <= fewest.num_experts:
        raise ConvertError(f"config.json: {key}={k} with {fewest.num_experts} experts (layer {fewest.index}): each token is "
                           f"routed to between 1 and num_experts experts")  # fmt: skip


def _write_layer(pl: _Plan, s: LayerSpec, w: ShardWriter, shard: ShardPlan, fname: str, tensors: dict, report,
                 error: QuantError) -> dict:  # fmt: skip
    """Stage 2, one layer: the scheme's streaming packer writes the layer's tensors in plan order,
    one expert at a time (peak memory is one expert, not one layer); returns its manifest entry."""
    lay, scheme, ckpt, reader = pl.layout, pl.scheme, pl.ckpt, pl.reader
    checked = lambda pack, t, role, e: _pack_checked(pack, t, s, role, e)  # noqa: E731
    packer = scheme.layer_packer(LayerSource(ckpt, reader, s, lay, checked, pl.options, error))
    entry_tensors = {}
    for t in layout_tensor_plan(lay, s.num_experts, s.hidden, s.intermediate, bias=s.has_bias, perm=scheme.has_perm(s)):
        name = expert_tensor_name(s.index, t.name)
        digest = w.write_parts(name, packer.parts(t.name))
        tensors[name] = {"file": fname, "dtype": t.dtype, "shape": list(t.shape), "sha256": digest}
        entry_tensors[t.name] = name
        report.experts_bytes += shard.entry(name).nbytes
    shared_entry = None
    sp = packer.shared() if s.shared else None
    if sp is not None:
        shared_entry = {
            "intermediate": s.shared["intermediate"],
            "padded_intermediate": sp.padded_intermediate,
            "gate": s.shared.get("gate"),
            "source_tensors": [s.shared[p] for p in ("gate_proj", "up_proj", "down_proj")],
            "scheme_source": scheme.source_note(ckpt.info(s.shared["gate_proj"]).dtype_str, reader, pl.options),
        }
        shared_plan = layout_tensor_plan(lay, 1, s.hidden, s.shared["intermediate"], perm=scheme.has_perm(s, True))
        for role in (t.name for t in shared_plan):  # plan order
            t = sp.tensors[role]
            name = expert_tensor_name(s.index, "shared_" + role)
            dt = str(t.dtype).replace("torch.", "")
            tensors[name] = {"file": fname, "dtype": dt, "shape": list(t.shape), "sha256": w.write(name, t)}
            shared_entry[role] = name
            report.experts_bytes += t.numel() * t.element_size()
    return {
        "index": s.index,
        "prefix": s.prefix,
        "source_kind": s.kind,
        "source_dtype": s.dtype,
        "num_experts": s.num_experts,
        "hidden": s.hidden,
        "intermediate": s.intermediate,
        "padded_intermediate": layout_expert_shapes(lay, s.num_experts, s.hidden, s.intermediate).padded_intermediate,
        "activation": s.activation,
        "alpha": pl.alpha,
        "limit": pl.limit,
        "interleaved": s.interleaved,
        "layout_id": lay.id,
        "act_mode": pl.act_modes[s.index],
        "scheme": scheme.name,
        "scheme_source": scheme.source_note(s.dtype, reader, pl.options),
        "quantizer": pl.quantizer,  # the quantizer and every option it ran with (verify re-runs it), or None
        "tensors": entry_tensors,
        "router": dict(s.router),
        "shared": shared_entry,
        "source_tensors": list(s.expert_tensors),
    }


def _write_other(pl: _Plan, fname: str, names: list, w: ShardWriter, tensors: dict, report) -> None:
    """Stage 3, one shard: its non-expert tensors, unchanged (names and bytes)."""
    for n in names:
        t = pl.ckpt.read(n)
        tensors[n] = {"file": fname, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "sha256": w.write(n, t)}
        report.other_bytes += t.numel() * t.element_size()
        del t


def _manifest(pl: _Plan, tmp: Path, layers: list, tensors: dict, carried: list, report, created_at: str) -> dict:
    """Stage 4: the manifest (docs/PACKED_FORMAT.md §4)."""
    return {
        "format": "moepack",
        # version 3 only where it is needed: a layer with an act-order w13_perm, which a version-2
        # reader would ignore and so run wrongly (docs/PACKED_FORMAT.md §7)
        "format_version": PERM_FORMAT_VERSION if any("w13_perm" in x["tensors"] or "w13_perm" in (x["shared"] or {})
                                                      for x in layers) else FORMAT_VERSION,  # fmt: skip
        "created_by": f"moepack {__version__}",
        "created_at": created_at,  # when the convert started (a resumed one: the first run's start)
        "source": {
            "path": str(pl.src.resolve()),
            "reader": pl.reader.name,
            "fingerprint": pl.ckpt.fingerprint(),
            "files": [f.name for f in pl.ckpt.files],
        },
        "model": {"model_type": pl.config.get("model_type"), "hidden_size": pl.config.get("hidden_size"), "config": pl.ckpt.config},
        "routing": pl.routing,
        "routing_note": pl.routing_note,
        "layouts": {str(pl.layout.id): pl.layout.to_dict()},
        "layers": layers,
        "files": {f: {"size": (tmp / f).stat().st_size} for f in report.files},
        "tensors": tensors,
        "carried_files": carried,
    }


RESUME_DIR = ".moepack-resume"  # inside the temporary directory: the plan's key and one journal per finished shard


def _resume_key(pl: _Plan, opts: _Options) -> dict:
    """What must be identical for a temporary directory to be continued: the source (fingerprint
    of config.json and headers, plus every file's size and mtime, so rewritten data counts), the
    layout, scheme, options and moepack version, and every planned shard's header."""
    files = []
    for f in pl.ckpt.files:
        st = f.stat()
        files.append([f.name, st.st_size, st.st_mtime_ns])
    return {
        "moepack": __version__,
        "source": str(pl.src.resolve()),
        "fingerprint": pl.ckpt.fingerprint(),
        "source_files": files,
        "layout_id": pl.layout.id,
        "scheme": pl.scheme.name,
        "quantize": opts.quantize,  # as given; the options it names, with their defaults:
        "quantizer": pl.quantizer,
        "act_mode": opts.act_mode,
        "shard_bytes": opts.shard_bytes,
        "shards": {f: hashlib.sha256(sp.header_bytes()).hexdigest() for f, sp in pl.shard_plans.items()},
    }


def _write_json_atomic(path: Path, obj) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


class _Resume:
    """The journal of one convert inside its temporary directory (``RESUME_DIR``): ``plan.json``
    (the resume key and the run's ``created_at``) and, per finished shard, ``<file>.json`` with
    the manifest entries it produced. A shard is journaled only after it is closed and fsync'd."""

    def __init__(self, key: dict, notify):
        self.key = key
        self.notify = notify
        self.created_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.resumed: Path | None = None

    def matches(self, tmp: Path) -> bool:
        """atomic_directory's ``reuse`` check of a temporary directory left by a dead run."""
        why = None
        try:
            old = json.loads((tmp / RESUME_DIR / "plan.json").read_text())
            key = old.get("key") if isinstance(old, dict) else None
        except (OSError, ValueError):
            key, why = None, "it has no readable plan (killed before the first shard?)"
        if key is not None and key != self.key:
            diff = next((k for k in self.key if key.get(k) != self.key[k]), "the plan")
            why = f"its {diff} differs from this run's"
        if why is None and self.resumed is None:
            self.resumed = tmp
            self.created_at = old.get("created_at", self.created_at)
            self.notify("resume", path=str(tmp))
            return True
        self.notify("stale_removed", path=str(tmp), reason=why or "another temporary directory is being resumed")
        return False

    def start(self, tmp: Path) -> None:
        (tmp / RESUME_DIR).mkdir(exist_ok=True)
        _write_json_atomic(tmp / RESUME_DIR / "plan.json", {"key": self.key, "created_at": self.created_at})

    def done(self, tmp: Path, fname: str, entry: dict) -> None:
        _write_json_atomic(tmp / RESUME_DIR / f"{fname}.json", entry)

    def finished(self, tmp: Path, fname: str, plan: ShardPlan) -> dict | None:
        """The journal entry of shard ``fname`` if the file on disk is complete and right: its
        size and header are the planned ones and every tensor's bytes hash to the journaled
        sha256 (re-read here: a journal is trusted only as far as the bytes agree)."""
        path, jpath = tmp / fname, tmp / RESUME_DIR / f"{fname}.json"
        try:
            entry = json.loads(jpath.read_text())
            if path.stat().st_size != plan.nbytes:
                return None
            with open(path, "rb") as f:
                if f.read(plan.data_start) != plan.header_bytes():
                    return None
            hdr = read_safetensors_header(path)
            names = plan.names
            if sorted(entry["tensors"]) != sorted(names):
                return None
            with open(path, "rb", buffering=0) as f:
                for n in names:
                    ti = hdr.tensors[n]
                    h = hashlib.sha256()
                    left, off = ti.nbytes, ti.file_offset
                    while left:
                        b = os.pread(f.fileno(), min(left, 64 << 20), off)
                        if not b:
                            return None
                        h.update(b)
                        left -= len(b)
                        off += len(b)
                    if h.hexdigest() != entry["tensors"][n]["sha256"]:
                        return None
            return entry
        except (OSError, ValueError, KeyError, TypeError, MoepackError):
            return None

    def finish(self, tmp: Path) -> None:
        shutil.rmtree(tmp / RESUME_DIR, ignore_errors=True)


def _convert(src: Path, dst: Path, lay: PackedLayout, overwrite: bool, progress, t0: float, opts: _Options):
    """plan -> per layer, the scheme's packer streams into the expert shards -> the other tensors
    -> the manifest, all inside a temporary directory renamed to ``dst`` only when complete; a
    hard-killed run's directory with the same plan is continued from its last complete shard."""
    notify = progress or (lambda *a, **k: None)
    pl = _plan(src, lay, opts.quantize, opts.shard_bytes, opts.act_mode)
    notify("plan", layers=len(pl.specs), expert_files=len(pl.expert_files), other_files=len(pl.other_files),
           other_tensors=sum(len(x) for x in pl.other_shards))  # fmt: skip
    report = ConvertReport(dst=dst, layout=pl.layout.name, act_modes=sorted(set(pl.act_modes.values())), scheme=pl.scheme.name,
                           quantize=pl.quantizer)  # fmt: skip
    error = QuantError()
    tensors: dict[str, dict] = {}
    layers = []
    journal = _Resume(_resume_key(pl, opts), notify)
    reuse = journal.matches if opts.resume else None
    with atomic_directory(dst, overwrite=overwrite, reuse=reuse) as tmp:
        journal.start(tmp)
        work = [(f, sh, "experts") for f, sh in zip(pl.expert_files, pl.expert_shards)]
        work += [(f, names, "other") for f, names in zip(pl.other_files, pl.other_shards)]
        fresh = journal.resumed is None
        for fname, items, kind in work:
            shard = pl.shard_plans[fname]
            entry = None if fresh else journal.finished(tmp, fname, shard)
            if entry is not None:  # already written by the killed run, and checked
                tensors.update(entry["tensors"])
                layers += entry["layers"]
                report.layers += len(entry["layers"])
                report.experts_bytes += entry["experts_bytes"]
                report.other_bytes += entry["other_bytes"]
                for i, (d, r) in entry.get("quant_error", {}).items():  # the killed run's quantization error of its layers
                    error.layers[int(i)] = [d, r]
                    error.err2, error.ref2 = error.err2 + d, error.ref2 + r
                report.files.append(fname)
                notify("shard_resumed", file=fname)
                continue
            if not fresh:  # the first shard that is not complete: it and everything after are redone
                fresh = True
                for f, _, _ in work[work.index((fname, items, kind)) :]:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp / f)
            before = (dict(tensors), len(layers), report.experts_bytes, report.other_bytes, set(error.layers))
            with ShardWriter(tmp / fname, shard, pipeline=opts.pipeline, display=dst / fname) as w:
                if kind == "experts":
                    for s in items:
                        notify("layer_start", layer=s.index, num_experts=s.num_experts)
                        layers.append(_write_layer(pl, s, w, shard, fname, tensors, report, error))
                        report.layers += 1
                        notify("layer_done", layer=s.index, bytes=sum(_nbytes(d, shp) for _, d, shp in pl.layer_tensors[s.index]))
                else:
                    _write_other(pl, fname, items, w, tensors, report)
            report.files.append(fname)
            journal.done(tmp, fname, {
                "tensors": {k: v for k, v in tensors.items() if k not in before[0]}, "layers": layers[before[1] :],
                "experts_bytes": report.experts_bytes - before[2], "other_bytes": report.other_bytes - before[3],
                "quant_error": {str(i): v for i, v in error.layers.items() if i not in before[4]},
            })  # fmt: skip
            notify("shard_done", file=fname)
            if kind == "other":
                notify("other_done", file=fname, tensors=len(items))
        carried = []
        what = dst
        try:
            for p in pl.ckpt.carried_files():
                what = dst / p.name
                shutil.copy2(p, tmp / p.name)
                carried.append(p.name)
            journal.finish(tmp)
            manifest = _manifest(pl, tmp, layers, tensors, carried, report, journal.created_at)
            what = dst / MANIFEST
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
        except OSError as e:
            raise ConvertError(f"{what}: cannot write: {os_reason(e)}") from None
    report.seconds = time.perf_counter() - t0
    report.quant_error = error.rel  # None when nothing was quantized (resumed shards: from their journal)
    report.quant_error_worst = error.worst()
    notify("done", report=report)
    return report


def load_manifest_json(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


__all__ = ["convert", "ConvertReport", "MANIFEST", "FORMAT_VERSION", "expert_tensor_name", "Checkpoint"]
