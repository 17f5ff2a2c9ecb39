"""Stages 2 to 4 of convert: pack and write one layer, copy the other tensors, build the manifest.

``write_layer`` runs the scheme's streaming layer packer (one expert at a time) into an open
``ShardWriter`` and returns the layer's manifest entry; a non-finite source value is refused
naming the SOURCE tensor and element (``_pack_checked``, ``_source_element``). ``write_other``
copies the carried-over tensors unchanged; ``build_manifest`` assembles docs/PACKED_FORMAT.md §4.
Apart from run.py because these are the per-shard work, free of the run's control flow
(temporary directory, resume, signals) that run.py keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from .._version import __version__
from ..container.plan import ShardPlan
from ..container.writer import ShardWriter
from .plan import Plan, expert_tensor_name, out_bias_of, post_norm_of, shared_silu_limit_of, silu_limit_of
from ..errors import ConvertError, LayoutError
from ..layout import layout_expert_shapes, layout_tensor_plan
from ..manifest import FORMAT_VERSION, BLOCK_PARTS_FORMAT_VERSION
from ..schemes import LayerSource, QuantError, get_scheme
from ..sources import LayerSpec
from ..sources.dense import FLOAT_DTYPES


def _source_element(s: LayerSpec, role: str, e: int, idx: list[int]) -> tuple[str, list[int]]:
    """The source tensor and index that hold element ``idx`` of expert ``e``'s canonical ``role``
    tensor (w13/w2: ``[1, N, K]``; w13_bias/w2_bias: ``[E, N]``, row = expert; shared_w13/w2)."""
    if role.startswith("shared_"):
        _, r, c = idx
        si = s.shared["intermediate"]
        if role == "shared_w2":
            return s.shared["down_proj"], [r, c]
        if s.shared.get("fused"):  # one [2 x I_shared, H] tensor (MiniMax-M3)
            return s.shared["gate_proj"], [r, c]
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
    if s.kind == "dbrx":  # [E x I, H] stacks; w2's are the down projections transposed
        if role == "w2":
            return s.names["down_t"], [e * i + c, r]
        return (s.names["gate"], [e * i + r, c]) if r < i else (s.names["up"], [e * i + r - i, c])
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


def layer_entry(pl: Plan, s: LayerSpec) -> dict:
    """One layer's manifest entry as the plan states it, every tensor named but none written:
    what ``write_layer`` returns, and what ``draft_manifest`` checks before anything is written."""
    lay, scheme, reader = pl.layout, pl.scheme, pl.reader
    entry_tensors = {t.name: expert_tensor_name(s.index, t.name)
                     for t in layout_tensor_plan(lay, s.num_experts, s.hidden, s.intermediate, bias=s.has_bias,
                                                 perm=scheme.has_perm(s), gated=s.activation != "relu2")}  # fmt: skip
    shared_entry = None
    slay = pl.shared_layouts.get(s.index)  # a float shared expert of a quantized source: its own (float) layout
    if s.shared:
        sscheme = scheme if slay is None else get_scheme(slay)
        sdt = pl.ckpt.info(s.shared["gate_proj"]).dtype_str
        shared_entry = {
            "intermediate": s.shared["intermediate"],
            "padded_intermediate": layout_expert_shapes(slay or lay, 1, s.hidden, s.shared["intermediate"]).padded_intermediate,
            "gate": s.shared.get("gate"),
            "source_tensors": list(dict.fromkeys(s.shared[p] for p in ("gate_proj", "up_proj", "down_proj"))),
            "scheme_source": sscheme.source_note(sdt, reader, pl.options),
        }
        if shared_silu_limit_of(pl.config, s) != silu_limit_of(pl.config, s):  # format version 7: hy_v4's unclamped one
            shared_entry["silu_limit"] = shared_silu_limit_of(pl.config, s)
        if slay is not None:  # format version 5 (docs/PACKED_FORMAT.md §7): the shared expert's own layout
            shared_entry["layout_id"] = slay.id
        elif pl.shared_quantizer is not None and sdt in FLOAT_DTYPES:  # --quantize on a quantized source's float one
            shared_entry["quantizer"] = pl.shared_quantizer
        for t in _shared_plan(pl, s):  # plan order
            shared_entry[t.name] = expert_tensor_name(s.index, "shared_" + t.name)
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
        **({"silu_limit": sl} if (sl := silu_limit_of(pl.config, s)) is not None else {}),  # format version 6
        "interleaved": s.interleaved,
        **({"post_norm": pn} if (pn := post_norm_of(pl.ckpt, pl.config, s)) is not None else {}),  # format version 7
        # format version 7: a bias the block adds to its output (JetMoE's mlp.bias)
        **({"out_bias": ob} if (ob := out_bias_of(pl.ckpt, pl.config, s)) is not None else {}),
        # format version 7: the router's ids E .. E+Z-1 are identity experts (longcat_flash's zero-computation experts)
        **({"identity_experts": s.identity_experts} if s.identity_experts else {}),
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


def _shared_plan(pl: Plan, s: LayerSpec):
    """The shared expert's tensor plan (one expert), in its own layout when it has one."""
    slay = pl.shared_layouts.get(s.index)
    return layout_tensor_plan(slay or pl.layout, 1, s.hidden, s.shared["intermediate"], gated=s.activation != "relu2",
                              perm=False if slay is not None else pl.scheme.has_perm(s, True))  # fmt: skip


def write_layer(pl: Plan, s: LayerSpec, w: ShardWriter, shard: ShardPlan, fname: str, tensors: dict, report,
                 error: QuantError) -> dict:  # fmt: skip
    """Stage 2, one layer: the scheme's streaming packer writes the layer's tensors in plan order,
    one expert at a time (peak memory is one expert, not one layer); returns its manifest entry
    (``layer_entry``)."""
    lay, scheme, ckpt, reader = pl.layout, pl.scheme, pl.ckpt, pl.reader
    entry = layer_entry(pl, s)
    checked = lambda pack, t, role, e: _pack_checked(pack, t, s, role, e)  # noqa: E731
    packer = scheme.layer_packer(LayerSource(ckpt, reader, s, lay, checked, pl.options, error))
    for t in layout_tensor_plan(lay, s.num_experts, s.hidden, s.intermediate, bias=s.has_bias, perm=scheme.has_perm(s),
                                gated=s.activation != "relu2"):  # fmt: skip
        name = entry["tensors"][t.name]
        digest = w.write_parts(name, packer.parts(t.name))
        tensors[name] = {"file": fname, "dtype": t.dtype, "shape": list(t.shape), "sha256": digest}
        report.experts_bytes += shard.entry(name).nbytes
    slay = pl.shared_layouts.get(s.index)  # a float shared expert of a quantized source: its own (float) layout
    if slay is not None:
        sp = get_scheme(slay).layer_packer(LayerSource(ckpt, reader, s, slay, checked, None, error)).shared()
    else:
        sp = packer.shared() if s.shared else None
    if sp is not None:
        sh = entry["shared"]
        if sp.padded_intermediate != sh["padded_intermediate"]:
            raise ConvertError(f"layer {s.index}: the shared expert packed with padded intermediate {sp.padded_intermediate}, "
                               f"the layout math says {sh['padded_intermediate']} (a packer bug; nothing was written)")  # fmt: skip
        for t in _shared_plan(pl, s):  # plan order
            p = sp.tensors[t.name]
            name = sh[t.name]
            dt = str(p.dtype).replace("torch.", "")
            tensors[name] = {"file": fname, "dtype": dt, "shape": list(p.shape), "sha256": w.write(name, p)}
            report.experts_bytes += p.numel() * p.element_size()
    return entry


_NAN_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def write_other(pl: Plan, fname: str, names: list, w: ShardWriter, tensors: dict, report) -> None:
    """Stage 3, one shard: its non-expert tensors, unchanged (names and bytes). A NaN in a float one
    (16 or 32 bits; FP8 Linears are checked with their scales, ``_check_carried_values``) is refused
    naming the tensor and the first index: a damaged checkpoint, which would otherwise run and give
    NaN far from its cause (an embedding row's NaN surfaces as the next router's logits)."""
    for n in names:
        t = pl.ckpt.read(n)
        if t.dtype in _NAN_CHECKED and bool(torch.isnan(t).any()):
            idx = torch.isnan(t).nonzero()[0].tolist()
            raise ConvertError(f"source tensor {n!r} ({str(t.dtype).replace('torch.', '')} {list(t.shape)}) has a NaN at "
                               f"{idx}: the tensors convert carries must not hold NaN (the checkpoint is damaged; nothing "
                               "was written)")  # fmt: skip
        tensors[n] = {"file": fname, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "sha256": w.write(n, t)}
        report.other_bytes += t.numel() * t.element_size()
        del t


_UNWRITTEN = "0" * 64  # the sha256 of a tensor or file in the draft manifest, before it is written


def check_draft_manifest(pl: Plan, dst: Path, act_mode_option: str | None) -> None:
    """Before convert writes anything: the manifest it will write, every field as the plan states
    it (checksums not yet known), through the one schema ``moepack.open`` runs
    (``moepack.manifest.check_manifest``); a field that breaks a rule is refused here, naming it,
    instead of a finished pack that open refuses. The written manifest is checked again
    (``write_manifest``), with its checksums, before it is written."""
    from ..manifest import ManifestError, check_manifest, seal_manifest

    tensors = {e.name: {"file": f, "dtype": str(e.torch_dtype).replace("torch.", ""), "shape": list(e.shape), "sha256": _UNWRITTEN}
               for f, shard in pl.shard_plans.items() for e in shard.entries if not e.is_filler}  # fmt: skip
    carried = [p.name for p in pl.ckpt.carried_files()]
    draft = build_manifest(pl, None, [layer_entry(pl, s) for s in pl.specs], tensors, carried, None, "",
                      dict.fromkeys(carried, _UNWRITTEN), act_mode_option,
                      files={f: {"size": shard.nbytes} for f, shard in pl.shard_plans.items()})  # fmt: skip
    try:
        check_manifest(dst, seal_manifest(draft))
    except ManifestError as e:
        raise ConvertError(f"{e} (the manifest convert would write; nothing was written)") from None


def build_manifest(pl: Plan, tmp: Path | None, layers: list, tensors: dict, carried: list, report, created_at: str,
              carried_sha: dict | None = None, act_mode_option: str | None = None, files: dict | None = None) -> dict:  # fmt: skip
    """Stage 4: the manifest (docs/PACKED_FORMAT.md §4); ``files`` the shards' sizes (default:
    ``report.files`` as written in ``tmp``)."""
    if files is None:
        files = {f: {"size": (tmp / f).stat().st_size} for f in report.files}
    return {
        "format": "moepack",
        # version 6 for every directory but those of version 7 below (docs/PACKED_FORMAT.md §7): the manifest is sealed
        # (manifest_sha256, set by moepack.manifest.write_manifest); its w13_perm (3), --tp (4)
        # and shared-layout (5) features are all part of 6
        # 7 (BLOCK_PARTS_FORMAT_VERSION) only when a layer has a post_norm, a shared expert with its own
        # silu_limit, a shared expert running another activation than silu, identity experts, an out_bias or relu2 experts
        "format_version": BLOCK_PARTS_FORMAT_VERSION
        if any((e["shared"] and (e["activation"] != "silu" or "silu_limit" in e["shared"])) or e.get("post_norm")
               or e.get("identity_experts") or e.get("out_bias") or e["activation"] == "relu2" for e in layers)
        else FORMAT_VERSION,
        "created_by": f"moepack {__version__}",
        "created_at": created_at,  # when the convert started (a resumed one: the first run's start)
        "source": {
            "path": str(pl.src.resolve()),
            "reader": pl.reader.name,
            "fingerprint": pl.ckpt.fingerprint(),
            "files": [f.name for f in pl.ckpt.files],
            # tensors left out deliberately (SourceReader.skipped: neither packed nor carried over)
            **({"skipped": {"why": pl.skipped[1], "tensors": list(pl.skipped[0])}} if pl.skipped[0] else {}),
        },
        "model": {"model_type": pl.config.get("model_type"), "hidden_size": pl.config.get("hidden_size"), "config": pl.ckpt.config},
        "routing": pl.routing,
        "routing_note": pl.routing_note,
        # the layers' layout, then the float layout of shared experts kept float (version 5), if any
        "layouts": {str(x.id): x.to_dict()
                    for x in [pl.layout, *sorted({*pl.shared_layouts.values()} - {pl.layout}, key=lambda y: y.id)]},
        "layers": layers,
        "files": files,
        "tensors": tensors,
        "carried_files": carried,
        "carried_sha256": dict(carried_sha or {}),  # verify re-hashes every carried file (config.json, tokenizer)
        "act_mode_option": act_mode_option,  # --act-mode as given (a deliberate mode, reported by verify), or null
    }
