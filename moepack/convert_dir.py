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
from .layout import DEFAULT_LAYOUT, LAYOUTS, PackedLayout, layout_expert_shapes, layout_get
from .pack import pack_bias2, pack_bias13, pack_experts_int8, pack_w2, pack_w13, pad_intermediate, quantize_int8_per_channel
from .sources import Checkpoint, LayerSpec, SourceReader, open_source, text_config

MANIFEST = "moepack.json"
FORMAT_VERSION = 1
DEFAULT_SHARD_BYTES = 2 << 30

ProgressFn = Callable[..., None]


def expert_tensor_name(layer: int, role: str) -> str:
    return f"moepack.layers.{layer}.{role}"


@dataclass
class ConvertReport:
    dst: Path
    layout: str = ""  # the layout written (an int8 source or quantize="int8": the int8 layout)
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


QUANT_ROLES = ("w13_scale", "w2_scale", "w13_colsum", "w2_colsum")  # int8 layouts, in write order


def _quant_plan(layout: PackedLayout, e: int, sh, prefix: str = "") -> list[tuple[str, torch.dtype, tuple]]:
    """The [E, N] scale / column-sum tensors of an int8 layout (none for bf16 layouts)."""
    if not layout.quantized:
        return []
    n13, n2 = (e, 2 * sh.padded_intermediate), (e, sh.w2_shape[1])
    dts = {"scale": torch.float32, "colsum": torch.int32}
    return [(prefix + r, dts[r.split("_")[1]], n13 if r.startswith("w13") else n2) for r in QUANT_ROLES]


def _plan_layer_tensors(spec: LayerSpec, layout: PackedLayout) -> list[tuple[str, torch.dtype, tuple]]:
    sh = layout_expert_shapes(layout, spec.num_experts, spec.hidden, spec.intermediate)
    wdt = torch.int8 if layout.quantized else torch.bfloat16
    out = [
        (expert_tensor_name(spec.index, "w13"), wdt, sh.w13_shape),
        (expert_tensor_name(spec.index, "w2"), wdt, sh.w2_shape),
    ]
    if spec.has_bias:
        out.append((expert_tensor_name(spec.index, "w13_bias"), torch.float32, (spec.num_experts, 2 * sh.padded_intermediate)))
        out.append((expert_tensor_name(spec.index, "w2_bias"), torch.float32, (spec.num_experts, sh.w2_shape[1])))
    out += [(expert_tensor_name(spec.index, r), d, shp) for r, d, shp in _quant_plan(layout, spec.num_experts, sh)]
    if spec.shared:
        ss = layout_expert_shapes(layout, 1, spec.hidden, spec.shared["intermediate"])
        out.append((expert_tensor_name(spec.index, "shared_w13"), wdt, ss.w13_shape))
        out.append((expert_tensor_name(spec.index, "shared_w2"), wdt, ss.w2_shape))
        out += [(expert_tensor_name(spec.index, r), d, shp) for r, d, shp in _quant_plan(layout, 1, ss, "shared_")]
    return out


def _target_layout(lay: PackedLayout, quantize: str | None, reader: SourceReader) -> PackedLayout:
    """The layout a convert writes: ``lay``, or its family's int8 layout for an int8 source or
    ``quantize="int8"`` (an int8 source is never dequantized: A8 checkpoints stay A8)."""
    if quantize not in (None, "int8"):
        raise ConvertError(f"quantize={quantize!r}: moepack quantizes to 'int8' (W8A8, per output channel) only")
    if reader.scheme not in ("dense", "int8_channel"):
        raise ConvertError(f"source reader {reader.name!r} has scheme {reader.scheme!r}, which convert cannot pack")
    if not (quantize == "int8" or reader.scheme == "int8_channel" or lay.quantized):
        return lay
    if lay.quantized:
        return lay
    cands = [x for x in LAYOUTS if x.family == lay.family and x.weight_dtype == "i8"]
    if not cands:
        raise ConvertError(f"no int8 layout for the {lay.family} family in this build")
    return cands[0]


def _scheme_of(lay: PackedLayout, reader: SourceReader, source_dtype: str) -> tuple[str, str]:
    """(scheme, where its values come from) for a manifest entry; ``source_dtype`` is the
    safetensors dtype of the source weights (I8: the source's own int8 codes)."""
    if not lay.quantized:
        return "dense", f"{source_dtype} weights packed as bf16"
    if source_dtype == "I8":
        from .sources.compressed_tensors import SOURCE_NOTE

        return "int8_channel", SOURCE_NOTE if reader.name == "compressed-tensors" else f"int8 codes and scales of {reader.name}"
    return "int8_channel", f"quantized by moepack from {source_dtype}"


class _Int8Layer:
    """One layer's experts into an int8 layout, one expert at a time: the codes stream out as
    parts of w13 / w2 while each expert's padded scales and column sums are gathered into
    [E, N] tensors, which are written after (plan order: codes, biases, scales, column sums)."""

    def __init__(self, ckpt: Checkpoint, reader: SourceReader, s: LayerSpec, lay: PackedLayout):
        self.ckpt, self.reader, self.s, self.lay = ckpt, reader, s, lay
        sh = layout_expert_shapes(lay, s.num_experts, s.hidden, s.intermediate)
        self.ip, self.np2 = sh.padded_intermediate, sh.w2_shape[1]
        e = s.num_experts
        self.w13_scale, self.w13_colsum = torch.zeros(e, 2 * self.ip), torch.zeros(e, 2 * self.ip, dtype=torch.int32)
        self.w2_scale, self.w2_colsum = torch.zeros(e, self.np2), torch.zeros(e, self.np2, dtype=torch.int32)

    def _codes(self, role: str, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        r, s = self.reader, self.s
        if r.scheme == "int8_channel":
            return (r.read_expert_w13_q if role == "w13" else r.read_expert_w2_q)(self.ckpt, s, e)
        w = (r.read_expert_w13 if role == "w13" else r.read_expert_w2)(self.ckpt, s, e)
        return _pack_checked(quantize_int8_per_channel, w[None], s, role, e)

    def w13_parts(self):
        for e in range(self.s.num_experts):
            q, sc = self._codes("w13", e)
            q, sc = q.reshape(1, *q.shape[-2:]), sc.reshape(1, -1)
            self.w13_scale[e] = pad_intermediate(sc.float(), self.ip, self.s.interleaved)[0]
            self.w13_colsum[e] = pad_intermediate(q.int().sum(-1, dtype=torch.int32), self.ip, self.s.interleaved)[0]
            yield pack_w13(q, interleaved=self.s.interleaved, layout=self.lay)

    def w2_parts(self):
        h = self.s.hidden
        for e in range(self.s.num_experts):
            q, sc = self._codes("w2", e)
            q, sc = q.reshape(1, *q.shape[-2:]), sc.reshape(1, -1)
            self.w2_scale[e, :h] = sc[0].float()
            self.w2_colsum[e, :h] = q[0].int().sum(-1, dtype=torch.int32)
            yield pack_w2(q, layout=self.lay)

    def shared(self):
        """The shared expert packed (codes, scales and column sums) as one-expert PackedExperts."""
        r, s = self.reader, self.s
        q = r.read_shared_q(self.ckpt, s) if r.read_shared_q is not None else None
        if q is None:
            sw13, sw2 = r.read_shared(self.ckpt, s)
            q = (
                _pack_checked(quantize_int8_per_channel, sw13, s, "shared_w13"),
                _pack_checked(quantize_int8_per_channel, sw2, s, "shared_w2"),
            )
        (q13, s13), (q2, s2) = q
        return pack_experts_int8(q13, s13, q2, s2, layout=self.lay)


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
) -> ConvertReport:
    """Convert the checkpoint at ``src`` into a packed directory at ``dst``.

    ``quantize="int8"``: quantize a dense source's experts to W8A8 int8 (per output channel) and
    pack them into the family's int8 layout (an int8 source is packed into it anyway)."""
    t0 = time.perf_counter()
    lay = layout_get(layout)
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise ConvertError(f"destination {dst} already exists: choose another path or pass overwrite=True (--overwrite)")
    if dst.resolve() == src.resolve():
        raise ConvertError(f"destination {dst} is the source: write the packed directory somewhere else")
    if threads is not None:
        if threads <= 0:
            raise ConvertError(f"threads={threads}: must be a positive integer")
        # torch's thread count is process-wide: set it for this convert only
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return convert(
                src, dst, layout=lay, quantize=quantize, overwrite=overwrite, threads=None, shard_bytes=shard_bytes, progress=progress
            )
        finally:
            torch.set_num_threads(before)
    notify = progress or (lambda *a, **k: None)

    # ---- plan everything from headers (nothing is written yet) ----
    ckpt, reader = open_source(src)
    lay = _target_layout(lay, quantize, reader)
    specs = reader.layers(ckpt)
    config = text_config(ckpt.config)
    for s in specs:
        if s.activation == "swigluoai" and not s.interleaved:
            raise ConvertError(f"layer {s.index}: swigluoai experts must have interleaved gate/up rows")
    expert_names = {n for s in specs for n in s.expert_tensors}
    other = [n for n in ckpt.tensors if n not in expert_names]
    # Layer entries in order; tensors planned per layer.
    layer_tensors = {s.index: _plan_layer_tensors(s, lay) for s in specs}
    expert_shards = _split_shards(
        specs, lambda s: sum(_nbytes(d, sh) for _, d, sh in layer_tensors[s.index]), shard_bytes
    )
    other_shards = _split_shards(other, lambda n: ckpt.info(n).nbytes, shard_bytes) if other else []
    ne, no = len(expert_shards), len(other_shards)
    expert_files = [f"experts-{i + 1:05d}-of-{ne:05d}.safetensors" for i in range(ne)]
    other_files = [f"model-{i + 1:05d}-of-{no:05d}.safetensors" for i in range(no)]
    routing, routing_note = _routing_for(config)
    alpha, limit = _swiglu_params(config)
    notify("plan", layers=len(specs), expert_files=ne, other_files=no, other_tensors=len(other))

    report = ConvertReport(dst=dst, layout=lay.name)
    tensors: dict[str, dict] = {}
    layers_manifest = []
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        # ---- experts, one layer at a time ----
        for fname, shard_specs in zip(expert_files, expert_shards):
            plan = ShardPlan()
            for s in shard_specs:
                for name, dt, shape in layer_tensors[s.index]:
                    plan.add(name, dt, shape)
            with ShardWriter(tmp / fname, plan) as w:
                for s in shard_specs:
                    notify("layer_start", layer=s.index, num_experts=s.num_experts)
                    # one expert at a time: peak memory is one expert, not one layer
                    e_count = s.num_experts
                    q8 = _Int8Layer(ckpt, reader, s, lay) if lay.quantized else None
                    parts13 = (
                        _pack_checked(
                            lambda t, s=s: pack_w13(t, interleaved=s.interleaved, layout=lay), reader.read_expert_w13(ckpt, s, e)[None], s, "w13", e
                        )
                        for e in range(e_count)
                    )
                    parts2 = (
                        _pack_checked(lambda t: pack_w2(t, layout=lay), reader.read_expert_w2(ckpt, s, e)[None], s, "w2", e)
                        for e in range(e_count)
                    )
                    b13, b2 = reader.read_biases(ckpt, s)
                    sh = layout_expert_shapes(lay, s.num_experts, s.hidden, s.intermediate)
                    entry_tensors = {}
                    wdt = "int8" if q8 else "bfloat16"
                    if q8:  # the scale / column-sum tensors are filled while w13 / w2 stream out
                        parts13, parts2 = q8.w13_parts(), q8.w2_parts()
                    for role, dtype, parts in (
                        ("w13", wdt, parts13),
                        ("w2", wdt, parts2),
                        (
                            "w13_bias",
                            "float32",
                            None if b13 is None else [_pack_checked(lambda t, s=s: pack_bias13(t, interleaved=s.interleaved, layout=lay), b13, s, "w13_bias")],
                        ),
                        ("w2_bias", "float32", None if b2 is None else [_pack_checked(lambda t: pack_bias2(t, layout=lay), b2, s, "w2_bias")]),
                        *(
                            (r, "int32" if r.endswith("colsum") else "float32", [getattr(q8, r)]) for r in (QUANT_ROLES if q8 else ())
                        ),
                    ):
                        if parts is None:
                            continue
                        name = expert_tensor_name(s.index, role)
                        entry = plan.entry(name)
                        digest = w.write_parts(name, parts)
                        tensors[name] = {"file": fname, "dtype": dtype, "shape": list(entry.shape), "sha256": digest}
                        entry_tensors[role] = name
                        report.experts_bytes += entry.nbytes
                    shared_entry = None
                    shared = None if q8 else reader.read_shared(ckpt, s)
                    if q8 and s.shared:
                        sp = q8.shared()
                        shared_entry = {
                            "intermediate": s.shared["intermediate"],
                            "padded_intermediate": sp.padded_intermediate,
                            "gate": s.shared.get("gate"),
                            "source_tensors": [s.shared[p] for p in ("gate_proj", "up_proj", "down_proj")],
                            "scheme_source": _scheme_of(lay, reader, ckpt.info(s.shared["gate_proj"]).dtype_str)[1],
                        }
                        for role in ("w13", "w2") + QUANT_ROLES:
                            t = getattr(sp, role)
                            name = expert_tensor_name(s.index, "shared_" + role)
                            dt = str(t.dtype).replace("torch.", "")
                            tensors[name] = {"file": fname, "dtype": dt, "shape": list(t.shape), "sha256": w.write(name, t)}
                            shared_entry[role] = name
                            report.experts_bytes += t.numel() * t.element_size()
                    if shared is not None:
                        sw13, sw2 = shared
                        shared_entry = {
                            "intermediate": s.shared["intermediate"],
                            "padded_intermediate": layout_expert_shapes(lay, 1, s.hidden, s.shared["intermediate"]).padded_intermediate,
                            "gate": s.shared.get("gate"),
                            "source_tensors": [s.shared[p] for p in ("gate_proj", "up_proj", "down_proj")],
                        }
                        for role, t in (
                            ("shared_w13", _pack_checked(lambda t: pack_w13(t, layout=lay), sw13, s, "shared_w13")),
                            ("shared_w2", _pack_checked(lambda t: pack_w2(t, layout=lay), sw2, s, "shared_w2")),
                        ):
                            name = expert_tensor_name(s.index, role)
                            tensors[name] = {"file": fname, "dtype": "bfloat16", "shape": list(t.shape), "sha256": w.write(name, t)}
                            shared_entry[role[len("shared_"):]] = name
                            report.experts_bytes += t.numel() * t.element_size()
                        del shared, sw13, sw2
                    layer_bytes = sum(_nbytes(d, shp) for _, d, shp in layer_tensors[s.index])
                    layers_manifest.append(
                        {
                            "index": s.index,
                            "prefix": s.prefix,
                            "source_kind": s.kind,
                            "source_dtype": s.dtype,
                            "num_experts": s.num_experts,
                            "hidden": s.hidden,
                            "intermediate": s.intermediate,
                            "padded_intermediate": sh.padded_intermediate,
                            "activation": s.activation,
                            "alpha": alpha,
                            "limit": limit,
                            "interleaved": s.interleaved,
                            "layout_id": lay.id,
                            "scheme": _scheme_of(lay, reader, s.dtype)[0],
                            "scheme_source": _scheme_of(lay, reader, s.dtype)[1],
                            "tensors": entry_tensors,
                            "router": dict(s.router),
                            "shared": shared_entry,
                            "source_tensors": list(s.expert_tensors),
                        }
                    )
                    report.layers += 1
                    notify("layer_done", layer=s.index, bytes=layer_bytes)
            report.files.append(fname)
        # ---- everything else, unchanged ----
        for fname, names in zip(other_files, other_shards):
            plan = ShardPlan()
            for n in names:
                ti = ckpt.info(n)
                plan.add(n, ti.dtype, ti.shape)
            with ShardWriter(tmp / fname, plan) as w:
                for n in names:
                    t = ckpt.read(n)
                    tensors[n] = {"file": fname, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "sha256": w.write(n, t)}
                    report.other_bytes += t.numel() * t.element_size()
                    del t
            report.files.append(fname)
            notify("other_done", file=fname, tensors=len(names))
        carried = []
        for p in ckpt.carried_files():
            shutil.copy2(p, tmp / p.name)
            carried.append(p.name)
        manifest = {
            "format": "moepack",
            "format_version": FORMAT_VERSION,
            "created_by": f"moepack {__version__}",
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": {
                "path": str(src.resolve()),
                "reader": reader.name,
                "fingerprint": ckpt.fingerprint(),
                "files": [f.name for f in ckpt.files],
            },
            "model": {"model_type": config.get("model_type"), "hidden_size": config.get("hidden_size"), "config": ckpt.config},
            "routing": routing,
            "routing_note": routing_note,
            "layouts": {str(lay.id): lay.to_dict()},
            "layers": layers_manifest,
            "files": {f: {"size": (tmp / f).stat().st_size} for f in report.files},
            "tensors": tensors,
            "carried_files": carried,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    report.seconds = time.perf_counter() - t0
    notify("done", report=report)
    return report


def load_manifest_json(path: Path) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


__all__ = ["convert", "ConvertReport", "MANIFEST", "FORMAT_VERSION", "expert_tensor_name", "Checkpoint"]
