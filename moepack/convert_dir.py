"""``moepack convert SRC DST``: a Hugging Face checkpoint directory -> a packed directory.

Streaming: the whole plan (every layer, every tensor, every shard's header) is made from the
source's headers and config.json first, so bad input is refused before anything is written;
then one layer at a time is read, packed and written. Everything goes into a temporary sibling
of DST that is renamed to DST only when complete (moepack/container), so an interrupted or
failed convert never leaves a directory under the final name.

int8 (W8A8, SEMANTICS.md §3 "int8 channel"): a compressed-tensors int-quantized source is packed
into the family's int8 layout with its own codes and scales (never re-quantized); a dense source
is quantized per output channel (``quantize="int8"``, ``moepack.pack.quantize_int8_per_channel``)
one expert at a time. Each layer's manifest entry records ``scheme`` and ``scheme_source``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ._version import __version__
from .container.writer import ShardPlan, ShardWriter, atomic_directory
from .errors import ConvertError, LayoutError, MoepackError
from .errors import UnsupportedError
from .layout import DEFAULT_LAYOUT, PackedLayout, int4_layout_for, layout_expert_shapes, layout_get, layout_tensor_plan
from .runtime.model import FORMAT_VERSION, MANIFEST, PERM_FORMAT_VERSION
from .schemes import LayerSource, Scheme, get_scheme, schemes
from .sources import Checkpoint, LayerSpec, SourceReader, open_source, text_config

DEFAULT_SHARD_BYTES = 2 << 30

ProgressFn = Callable[..., None]


def expert_tensor_name(layer: int, role: str) -> str:
    return f"moepack.layers.{layer}.{role}"


@dataclass
class ConvertReport:
    dst: Path
    layout: str = ""  # the layout written (an int8 source or quantize="int8": the int8 layout)
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


def _target_scheme(lay: PackedLayout, quantize: str | None, reader: SourceReader) -> Scheme:
    """The scheme a convert packs into: ``quantize`` when given, else the source's own (an int8
    source stays int8: A8 checkpoints are never dequantized), else the layout's."""
    if quantize is not None:
        try:
            scheme = get_scheme(quantize)
        except UnsupportedError:
            scheme = None
        if scheme is None or scheme.name == "dense":
            known = ", ".join(f"{x.name!r}" + (f" (or {', '.join(map(repr, x.aliases))})" if x.aliases else "")
                              for x in schemes() if x.name != "dense")  # fmt: skip
            raise ConvertError(f"quantize={quantize!r}: moepack quantizes to {known}")
        if reader.scheme not in ("dense", scheme.name):
            raise ConvertError(f"quantize={quantize!r} with a {reader.scheme} source: moepack never re-quantizes a quantized checkpoint")
        return scheme
    try:
        source = get_scheme(reader.scheme)
    except UnsupportedError:
        raise ConvertError(f"source reader {reader.name!r} has scheme {reader.scheme!r}, which convert cannot pack") from None
    return source if source.name != "dense" else get_scheme(lay)


def _target_layout(lay: PackedLayout, scheme: Scheme) -> PackedLayout:
    """``lay`` when it is of ``scheme``, else the scheme's layout of ``lay``'s ISA family."""
    if lay.scheme == scheme.name:
        return lay
    try:
        return scheme.layout_for(lay.family)
    except UnsupportedError as e:
        raise ConvertError(str(e)) from None


def _source_group_layout(lay: PackedLayout, scheme: Scheme, reader: SourceReader, specs: list) -> PackedLayout:
    """An int4 source packs into the int4 layout of its own group size (never re-grouped): every
    MoE layer's (and quantized shared expert's) group size must be the same, and moepack must
    have a layout for it."""
    if reader.scheme != "int4_group" or scheme.name != "int4_group":
        return lay
    sizes = {}
    for s in specs:
        q = getattr(s, "quant", None) or {}
        sizes.setdefault(q.get("group_size"), f"layer {s.index} ({s.prefix})")
        sh = q.get("shared") or {}
        if sh.get("group_size") is not None:
            sizes.setdefault(sh["group_size"], f"layer {s.index}'s shared expert")
    if len(sizes) != 1:
        listed = "; ".join(f"group_size={g} in {where}" for g, where in sizes.items())
        raise ConvertError(f"int4 source with several group sizes ({listed}): moepack packs one int4 layout per directory")
    (g,) = sizes
    try:
        return int4_layout_for(g, lay.family)
    except LayoutError as e:
        raise ConvertError(f"{sizes[g]}: {e}") from None


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
) -> ConvertReport:
    """Convert the checkpoint at ``src`` into a packed directory at ``dst``.

    ``quantize="int8"``: quantize a dense source's experts to W8A8 int8 (per output channel) and
    pack them into the family's int8 layout (an int8 source is packed into it anyway).
    ``act_mode`` ("a16" / "a8"): the activation mode recorded as every layer's default (the
    manifest's ``act_mode``), refused when the layout does not serve it; None: each layer's own
    (int4: a16, the checkpoint's meaning; a8 for a compressed-tensors W4A8 checkpoint)."""
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
    with torch_threads(threads):
        return _convert(src, dst, lay, quantize, overwrite, shard_bytes, progress, t0, act_mode)


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


def _plan(src: Path, lay: PackedLayout, quantize, shard_bytes: int, act_mode: str | None = None) -> _Plan:
    """Stage 1: the source, the scheme and layout it packs into, every tensor and shard."""
    ckpt, reader = open_source(src)
    scheme = _target_scheme(lay, quantize, reader)
    lay = _target_layout(lay, scheme)
    specs = reader.layers(ckpt)
    lay = _source_group_layout(lay, scheme, reader, specs)
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
    routing, routing_note = _routing_for(config)
    alpha, limit = _swiglu_params(config)
    return _Plan(
        src, ckpt, reader, scheme, lay, specs, config, layer_tensors, expert_shards,
        [f"experts-{i + 1:05d}-of-{ne:05d}.safetensors" for i in range(ne)], other_shards,
        [f"model-{i + 1:05d}-of-{no:05d}.safetensors" for i in range(no)], routing, routing_note, alpha, limit, act_modes,
    )  # fmt: skip


def _write_layer(pl: _Plan, s: LayerSpec, w: ShardWriter, shard: ShardPlan, fname: str, tensors: dict, report) -> dict:
    """Stage 2, one layer: the scheme's streaming packer writes the layer's tensors in plan order,
    one expert at a time (peak memory is one expert, not one layer); returns its manifest entry."""
    lay, scheme, ckpt, reader = pl.layout, pl.scheme, pl.ckpt, pl.reader
    checked = lambda pack, t, role, e: _pack_checked(pack, t, s, role, e)  # noqa: E731
    packer = scheme.layer_packer(LayerSource(ckpt, reader, s, lay, checked))
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
            "scheme_source": scheme.source_note(ckpt.info(s.shared["gate_proj"]).dtype_str, reader.name),
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
        "scheme_source": scheme.source_note(s.dtype, reader.name),
        "tensors": entry_tensors,
        "router": dict(s.router),
        "shared": shared_entry,
        "source_tensors": list(s.expert_tensors),
    }


def _write_other(pl: _Plan, tmp: Path, tensors: dict, report, notify) -> None:
    """Stage 3: every non-expert tensor, unchanged (names and bytes)."""
    for fname, names in zip(pl.other_files, pl.other_shards):
        shard = ShardPlan()
        for n in names:
            ti = pl.ckpt.info(n)
            shard.add(n, ti.dtype, ti.shape)
        with ShardWriter(tmp / fname, shard) as w:
            for n in names:
                t = pl.ckpt.read(n)
                tensors[n] = {"file": fname, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "sha256": w.write(n, t)}
                report.other_bytes += t.numel() * t.element_size()
                del t
        report.files.append(fname)
        notify("other_done", file=fname, tensors=len(names))


def _manifest(pl: _Plan, tmp: Path, layers: list, tensors: dict, carried: list, report) -> dict:
    """Stage 4: the manifest (docs/PACKED_FORMAT.md §4)."""
    return {
        "format": "moepack",
        # version 3 only where it is needed: a layer with an act-order w13_perm, which a version-2
        # reader would ignore and so run wrongly (docs/PACKED_FORMAT.md §7)
        "format_version": PERM_FORMAT_VERSION if any("w13_perm" in x["tensors"] or "w13_perm" in (x["shared"] or {})
                                                      for x in layers) else FORMAT_VERSION,  # fmt: skip
        "created_by": f"moepack {__version__}",
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
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


def _convert(src: Path, dst: Path, lay: PackedLayout, quantize, overwrite: bool, shard_bytes: int, progress, t0: float,
             act_mode: str | None = None):  # fmt: skip
    """plan -> per layer, the scheme's packer streams into the expert shards -> the other tensors
    -> the manifest, all inside a temporary directory renamed to ``dst`` only when complete."""
    notify = progress or (lambda *a, **k: None)
    pl = _plan(src, lay, quantize, shard_bytes, act_mode)
    notify("plan", layers=len(pl.specs), expert_files=len(pl.expert_files), other_files=len(pl.other_files),
           other_tensors=sum(len(x) for x in pl.other_shards))  # fmt: skip
    report = ConvertReport(dst=dst, layout=pl.layout.name, act_modes=sorted(set(pl.act_modes.values())))
    tensors: dict[str, dict] = {}
    layers = []
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        for fname, shard_specs in zip(pl.expert_files, pl.expert_shards):
            shard = ShardPlan()
            for s in shard_specs:
                for name, dt, shape in pl.layer_tensors[s.index]:
                    shard.add(name, dt, shape)
            with ShardWriter(tmp / fname, shard) as w:
                for s in shard_specs:
                    notify("layer_start", layer=s.index, num_experts=s.num_experts)
                    layers.append(_write_layer(pl, s, w, shard, fname, tensors, report))
                    report.layers += 1
                    notify("layer_done", layer=s.index, bytes=sum(_nbytes(d, shp) for _, d, shp in pl.layer_tensors[s.index]))
            report.files.append(fname)
        _write_other(pl, tmp, tensors, report, notify)
        carried = []
        for p in pl.ckpt.carried_files():
            shutil.copy2(p, tmp / p.name)
            carried.append(p.name)
        manifest = _manifest(pl, tmp, layers, tensors, carried, report)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    report.seconds = time.perf_counter() - t0
    notify("done", report=report)
    return report


def load_manifest_json(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


__all__ = ["convert", "ConvertReport", "MANIFEST", "FORMAT_VERSION", "expert_tensor_name", "Checkpoint"]
