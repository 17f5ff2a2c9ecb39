"""Tensor-parallel packs (``moepack convert SRC DST --tp N``): each rank's slice of every expert,
stored contiguously (docs/PACKED_FORMAT.md "Tensor-parallel packs").

A MoE layer's output is a sum over its intermediate channels: ``act(gate_i . x, up_i . x)``
is computed per channel ``i`` and ``w2`` contracts over ``i``. Cutting I into N equal slices
cuts every expert into N smaller experts whose outputs add up to the whole expert's. A
``--tp N`` pack stores a layer as ``N*E`` such *slice experts*, rank-major: slice expert
``r*E + e`` is rank ``r``'s slice of expert ``e`` (w13: its gate rows ``[r*I/N, (r+1)*I/N)``
and the same up rows, or the same (gate, up) pairs when interleaved; w2: those input channels),
a valid packed layer of ``N*E`` experts with intermediate ``I/N``. So

* rank ``r`` maps rows ``[r*E, (r+1)*E)`` of every tensor: contiguous bytes, its own only;
* one process running every slice (``moepack.open``, ``load_model``) routes a token to expert
  ``e`` by sending it to the N slice experts ``e, E+e, ..., (N-1)*E+e`` with the same weight
  (``expand_routes``): the kernel adds their outputs like any top-k sum;
* a slice is bytes of the whole pack, moved, never re-quantized: per-output-channel tensors
  (scales, zero points) of w13 follow their rows, w2's stay whole (its output channels are not
  cut), w2's per-group tensors follow their K groups, w2's int8 column sums are the sums over
  the slice's codes, w2's bias is rank 0's only (zero in the others: it is added once), and an
  act-order ``w13_perm`` (a permutation of H, which is not cut) is every slice's.

The cuts must fall on block boundaries, so no slice has padding of its own: I/N a multiple of
the layout's ``i_align`` (a multiple of ``block_n``, w13's row block, and of ``k_pack``, w2's K
run) and, for layouts with K groups, of the group size (``tp_slice_size`` refuses others naming
the value and the rule). ``slice_tensors`` / ``unslice_tensors`` are exact inverses; verify
reassembles the whole layer with ``unslice`` and checks it against the source as for any pack.
``unslice`` reads rank 0's copy of the tensors every rank keeps (``rank_copy_kind``), and the
runtime reads every rank's, so verify (with or without the source) also checks that every other
rank's copy is what the format says (``rank_copy_problem``: w2's bias zero, the other copies
equal to rank 0's byte for byte).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .errors import ConvertError, LayoutError
from .layout import PackedLayout, layout_get, layout_padded_i

TENSOR_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int8": 1, "uint8": 1}


def tp_slice_size(layout: PackedLayout, intermediate: int, tp: int, where: str = "") -> int:
    """I/N for a ``--tp N`` pack of a layer of intermediate size ``intermediate``, or a
    ``LayoutError`` naming the value and the rule it breaks."""
    at = f"{where}: " if where else ""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise LayoutError(f"{at}tp={tp!r}: the tensor-parallel degree must be an integer >= 1")
    if intermediate % tp:
        raise LayoutError(f"{at}intermediate size I={intermediate} is not divisible by tp={tp}: every rank gets I/tp channels")
    s = intermediate // tp
    if s % layout.i_align:
        raise LayoutError(f"{at}tp={tp}: I/tp = {intermediate}/{tp} = {s} is not a multiple of {layout.i_align}, layout "
                          f"{layout.name}'s i_align (w13 row block block_n={layout.block_n}, w2 K run k_pack={layout.k_pack}): "
                          "a rank's slice must be whole blocks")  # fmt: skip
    if layout.group_size and s % layout.group_size:
        raise LayoutError(f"{at}tp={tp}: I/tp = {s} is not a multiple of layout {layout.name}'s group size "
                          f"{layout.group_size}: w2's K groups cannot be cut")  # fmt: skip
    return s


def _rows13(t: torch.Tensor, dim: int, ip: int, s: int, r: int, interleaved: bool) -> torch.Tensor:
    """Rank r's w13 rows (along ``dim``) of a whole tensor in packed row order."""
    if interleaved:
        return t.narrow(dim, 2 * r * s, 2 * s)
    return torch.cat([t.narrow(dim, r * s, s), t.narrow(dim, ip + r * s, s)], dim=dim)


def _k_runs(layout: PackedLayout, t: torch.Tensor) -> torch.Tensor:
    """A packed w2 codes tensor ``[E, Np, *]`` as bytes ``[E, Np/bn, Kp/k_pack, run bytes]``:
    one n-block holds its K runs one after the other (layout_element_offset)."""
    b = t.contiguous().view(torch.uint8)
    e, np_ = b.shape[0], b.shape[1]
    run = layout.block_n * layout.k_pack * layout.weight_bits // 8
    return b.reshape(e, np_ // layout.block_n, -1, run)


def _from_runs(runs: torch.Tensor, np_: int, dtype: torch.dtype) -> torch.Tensor:
    e = runs.shape[0]
    return runs.reshape(e, np_, -1).view(dtype)


def _spec_of(layout: PackedLayout, role_name: str):
    for w in ("w13", "w2"):
        for spec in layout.tensors:
            if w + spec.suffix == role_name:
                return w, spec
    return None, None


def rank_copy_kind(layout: PackedLayout, name: str) -> str | None:
    """How a ``--tp`` pack keeps the packed tensor ``name`` (role name: ``w2_scale``, ...):
    ``"rank0"`` (w2's bias: rank 0 holds it, every other rank zeros, as it is added once),
    ``"every"`` (an act-order ``w13_perm`` and w2's per-output-channel scales and zero points:
    every rank a copy of the whole layer's, byte for byte), or None (each rank holds its own
    part). The runtime reads every rank's copy (``expand_routes``, vLLM's ``rank_experts``), so
    verify checks every one (``rank_copy_problem``)."""
    if name == "w2_bias":
        return "rank0"
    if name == "w13_perm":
        return "every"
    if name == "w13_bias":
        return None
    w, spec = _spec_of(layout, name)
    if w == "w2" and spec.shape not in ("packed", "group") and spec.role != "sum":
        return "every"
    return None


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def rank_copy_problem(layout: PackedLayout, role: str, name: str, t: torch.Tensor, tp: int, e0: int = 0) -> str | None:
    """None when every rank's copy of the per-rank tensor ``role`` (``rank_copy_kind``; ``name``
    the manifest's name) is what the format says; else one line naming the first differing
    element: its rank, [expert, row], both values and the rule. ``t``: the rows of a block of
    experts (``e0`` the first) of every rank, rank-major (``[tp * e, ...]``)."""
    kind = rank_copy_kind(layout, role)
    if kind is None or tp < 2:
        return None
    e = t.shape[0] // tp
    bits = t.contiguous().view(_BITS[t.element_size()])
    first = bits[:e]
    for r in range(1, tp):
        part = bits[r * e:(r + 1) * e]
        diff = part != 0 if kind == "rank0" else part != first
        if not bool(diff.any()):
            continue
        idx = diff.nonzero()[0].tolist()
        n = int(diff.sum())
        col = "code column" if role == "w13_perm" else "row"
        where = f"[expert {idx[0] + e0}" + (f", {col} {idx[1]}]" if len(idx) > 1 else "]")
        got = t[r * e:(r + 1) * e][tuple(idx)].item()
        if kind == "rank0":
            rule = f"must be 0 (w2's bias is rank 0's only, added once; {n} element(s) of rank {r} differ)"
        else:
            want = t[:e][tuple(idx)].item()
            rule = (f"rank 0's copy is {want!r} ({n} element(s) differ): every rank keeps the same copy of the whole "
                    "layer's, byte for byte")  # fmt: skip
        return f"tensor {name!r} rank {r} {where} is {got!r}, {rule}"
    return None


def slice_rank(layout: PackedLayout, tensors: dict, hidden: int, intermediate: int, tp: int, r: int,
               interleaved: bool) -> dict:  # fmt: skip
    """Rank ``r``'s slice of whole packed tensors (``[E, ...]``, role -> tensor, a layer packed
    with tp 1 whose padded intermediate is I): the tensors of ``E`` slice experts of
    intermediate I/tp. Bytes are moved, never recomputed, except w2's int8 column sums (the sums
    of the slice's codes) and w2's bias (rank 0 only)."""
    from .pack import unpack_codes

    s = tp_slice_size(layout, intermediate, tp)
    ip = layout_padded_i(layout, intermediate)  # == intermediate (s is a multiple of i_align)
    out = {}
    for name, t in tensors.items():
        if name == "w13_bias":
            out[name] = _rows13(t, 1, ip, s, r, interleaved).contiguous()
        elif rank_copy_kind(layout, name) == "rank0":  # w2_bias
            out[name] = t.clone() if r == 0 else torch.zeros_like(t)
        elif name == "w13_perm":
            out[name] = t.clone()
        else:
            w, spec = _spec_of(layout, name)
            if w is None:
                raise LayoutError(f"packed tensor {name!r}: layout {layout.name} declares no such tensor")
            if w == "w13":
                dim = 2 if spec.shape == "group" else 1
                out[name] = _rows13(t, dim, ip, s, r, interleaved).contiguous()
            elif spec.shape == "packed":
                runs = _k_runs(layout, t)
                per = s // layout.k_pack
                out[name] = _from_runs(runs[:, :, r * per:(r + 1) * per].contiguous(), t.shape[1], t.dtype)
            elif spec.shape == "group":
                g = s // layout.group_size
                out[name] = t[:, r * g:(r + 1) * g].contiguous()
            elif spec.role == "sum":
                codes = tensors["w2"]
                runs = _k_runs(layout, codes)
                per = s // layout.k_pack
                sl = _from_runs(runs[:, :, r * per:(r + 1) * per].contiguous(), codes.shape[1], codes.dtype)
                out[name] = unpack_codes(layout, sl).to(torch.int32).sum(-1, dtype=torch.int32).to(t.dtype)
            else:  # w2's per-output-channel scale / zero point: its output channels are not cut
                out[name] = t.clone()
    return out


def slice_tensors(layout: PackedLayout, tensors: dict, hidden: int, intermediate: int, tp: int,
                  interleaved: bool) -> dict:  # fmt: skip
    """Whole packed tensors -> the ``[tp*E, ...]`` tensors of a ``--tp tp`` pack (rank-major)."""
    ranks = [slice_rank(layout, tensors, hidden, intermediate, tp, r, interleaved) for r in range(tp)]
    return {k: torch.cat([x[k] for x in ranks], dim=0) for k in tensors}


def unslice_tensors(layout: PackedLayout, tensors: dict, num_experts: int, hidden: int, intermediate: int, tp: int,
                    interleaved: bool) -> dict:  # fmt: skip
    """Inverse of ``slice_tensors``: ``[tp*E, ...]`` slice-expert tensors -> the whole layer's."""
    s = tp_slice_size(layout, intermediate, tp)
    e = num_experts
    rank = lambda t, r: t[r * e:(r + 1) * e]  # noqa: E731
    out = {}
    for name, t in tensors.items():
        parts = [rank(t, r) for r in range(tp)]
        if name in ("w2_bias", "w13_perm"):  # rank 0's copy: verify checks the others (rank_copy_problem)
            out[name] = parts[0].clone()
            continue
        if name == "w13_bias":
            w, spec, dim = "w13", None, 1
        else:
            w, spec = _spec_of(layout, name)
            if w is None:
                raise LayoutError(f"packed tensor {name!r}: layout {layout.name} declares no such tensor")
            dim = 2 if spec.shape == "group" and w == "w13" else 1
        if w == "w13":
            if interleaved:
                out[name] = torch.cat(parts, dim=dim)
            else:
                gate = [p.narrow(dim, 0, s) for p in parts]
                up = [p.narrow(dim, s, s) for p in parts]
                out[name] = torch.cat(gate + up, dim=dim)
        elif spec.shape == "packed":
            runs = torch.cat([_k_runs(layout, p) for p in parts], dim=2)
            out[name] = _from_runs(runs, t.shape[1], t.dtype)
        elif spec.shape == "group":
            out[name] = torch.cat(parts, dim=1)
        elif spec.role == "sum":
            out[name] = torch.stack(parts).sum(0, dtype=torch.int32).to(t.dtype)
        else:  # rank_copy_kind "every": rank 0's copy (verify checks the others: rank_copy_problem)
            out[name] = parts[0].clone()
    return out


def tp_slice(packed, tp: int):
    """A whole ``PackedExperts`` -> the same experts as a ``tp``-sliced one (``packed.tp == tp``)."""
    from .pack import PackedExperts

    if packed.tp != 1:
        raise LayoutError(f"tp_slice: the experts are already sliced for tp={packed.tp}")
    if not packed.gated:
        raise LayoutError(f"tp_slice: non-gated (relu2) experts: --tp slices gate and up halves, which they do not have")
    s = tp_slice_size(packed.layout, packed.intermediate, tp)
    if packed.padded_intermediate != packed.intermediate:
        raise LayoutError(f"tp_slice: padded intermediate {packed.padded_intermediate} != I={packed.intermediate}")
    t = slice_tensors(packed.layout, packed.tensors, packed.hidden, packed.intermediate, tp, packed.interleaved)
    return PackedExperts(layout=packed.layout, num_experts=packed.num_experts, hidden=packed.hidden,
                         intermediate=packed.intermediate, padded_intermediate=s, interleaved=packed.interleaved,
                         tensors=t, act_mode=packed.act_mode, tp=tp)  # fmt: skip


def tp_unslice(packed):
    """A ``tp``-sliced ``PackedExperts`` -> the whole layer (tp 1), bytes equal to a tp-1 pack's."""
    from .pack import PackedExperts

    if packed.tp == 1:
        return packed
    t = unslice_tensors(packed.layout, packed.tensors, packed.num_experts, packed.hidden, packed.intermediate,
                        packed.tp, packed.interleaved)  # fmt: skip
    return PackedExperts(layout=packed.layout, num_experts=packed.num_experts, hidden=packed.hidden,
                         intermediate=packed.intermediate, padded_intermediate=packed.intermediate,
                         interleaved=packed.interleaved, tensors=t, act_mode=packed.act_mode)  # fmt: skip


def rank_experts(packed, r: int):
    """Rank ``r``'s experts of a tp-sliced ``PackedExperts``: views (no copy) of its rows
    ``[r*E, (r+1)*E)``, a plain pack of E experts of intermediate I/tp."""
    from .pack import PackedExperts

    if not 0 <= r < packed.tp:
        raise LayoutError(f"rank {r}: the experts are sliced for tp={packed.tp} (ranks 0..{packed.tp - 1})")
    e = packed.num_experts
    t = {k: v[r * e:(r + 1) * e] for k, v in packed.tensors.items()}
    return PackedExperts(layout=packed.layout, num_experts=e, hidden=packed.hidden,
                         intermediate=packed.intermediate // packed.tp, padded_intermediate=packed.padded_intermediate,
                         interleaved=packed.interleaved, tensors=t, act_mode=packed.act_mode)  # fmt: skip


def expand_routes(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, tp: int,
                  expert_map: torch.Tensor | None = None):  # fmt: skip
    """Routes to experts -> routes to their ``tp`` slice experts (one process running every
    slice): ``[T, k]`` -> ``[T, k*tp]``, the weight repeated. ``num_experts`` is the pack's
    expert count L (slice r of pack expert m is slice expert ``m + r*L``). Without an
    ``expert_map`` ids are pack experts: ``e`` -> ``e + r*L``. With one (``[G]``, global id ->
    pack expert or -1), ids are global: ``g`` -> ``g + r*G``, and the map becomes ``[tp*G]`` with
    entry ``r*G + g`` = ``map[g] + r*L`` (-1 stays -1), whatever share of the pack it covers."""
    span = num_experts if expert_map is None else int(expert_map.numel())
    ids = torch.cat([topk_ids + r * span for r in range(tp)], dim=1).to(topk_ids.dtype).contiguous()
    w = topk_weights.repeat(1, tp).contiguous()
    if expert_map is not None:
        expert_map = torch.cat([torch.where(expert_map >= 0, expert_map + r * num_experts, expert_map) for r in range(tp)]
                               ).to(expert_map.dtype).contiguous()  # fmt: skip
    return w, ids, expert_map


# ---- a --tp N directory from a whole one -------------------------------------------------------


def reshard_dir(whole: str | os.PathLike, dst: str | os.PathLike, tp: int, *, overwrite: bool = False) -> dict:
    """Write the ``--tp tp`` form of the packed directory ``whole`` (written with tp 1) at
    ``dst``: the experts' shards rewritten with every layer's slice experts, the other files
    linked (or copied) unchanged; returns the new manifest. Reads one expert at a time (mapped),
    so memory stays one expert's slices. ``dst`` is an atomic directory (container/atomic.py):
    built under a temporary sibling, renamed into place only when complete, refused while another
    run writes it, an existing one replaced only with ``overwrite``."""
    from .container.atomic import atomic_directory
    from .container.plan import ShardPlan
    from .container.writer import ShardWriter
    from .manifest import MANIFEST, TP_FORMAT_VERSION, write_manifest
    from .runtime.model import open_packed

    whole, dst = Path(whole), Path(dst)
    pm = open_packed(whole, check_values=False)
    m = json.loads((whole / MANIFEST).read_text())
    if int(m.get("tp", 1)) != 1:
        raise ConvertError(f"{whole}: already a --tp {m['tp']} pack")
    lay_of = {int(x["index"]): pm.layers[int(x["index"])] for x in m["layers"]}
    for x in m["layers"]:
        lay = layout_get(int(x["layout_id"]))
        try:
            tp_slice_size(lay, int(x["intermediate"]), tp, f"layer {x['index']} ({x['prefix']})")
        except LayoutError as ex:
            raise ConvertError(f"--tp {tp}: {ex}") from None
    # which layer/role each expert tensor name is
    owner = {}
    for x in m["layers"]:
        for role, name in x["tensors"].items():
            owner[name] = (int(x["index"]), role)
    with atomic_directory(dst, overwrite=overwrite) as tmp:
        tensors = m["tensors"]
        for fname in m["files"]:
            names = [n for n, e in tensors.items() if e["file"] == fname]
            if not any(n in owner for n in names):
                _link_or_copy(whole / fname, tmp / fname)
                continue
            plan = ShardPlan()
            shapes = {}
            for n in names:
                e = tensors[n]
                shape = list(e["shape"])
                if n in owner:
                    li, role = owner[n]
                    shape = _slice_shape(lay_of[li].packed, role, tp)
                shapes[n] = shape
                plan.add(n, getattr(torch, e["dtype"]), tuple(shape))
            with ShardWriter(tmp / fname, plan, display=dst / fname) as w:
                for n in names:
                    if n in owner:
                        li, role = owner[n]
                        digest = w.write_parts(n, _slice_parts(lay_of[li].packed, role, tp))
                    else:
                        digest = w.write(n, pm.tensor(n))
                    tensors[n] = {**tensors[n], "shape": shapes[n], "sha256": digest}
        for x in m["layers"]:
            s = int(x["intermediate"]) // tp
            x["tp"] = tp
            x["padded_intermediate"] = s
        for name in m.get("carried_files") or []:
            _link_or_copy(whole / name, tmp / name)
        m["tp"] = tp
        m["format_version"] = max(TP_FORMAT_VERSION, int(m["format_version"]))  # 6 (sealed) stays 6
        m["files"] = {f: {"size": (tmp / f).stat().st_size} for f in m["files"]}
        write_manifest(tmp, m, dst)  # sealed again (shapes, checksums and tp changed), checked as open checks it
        del pm, lay_of
    return m


def _slice_shape(packed, role: str, tp: int) -> list[int]:
    one = slice_rank(packed.layout, {k: v[:1] for k, v in packed.tensors.items()}, packed.hidden, packed.intermediate,
                     tp, 0, packed.interleaved)[role]  # fmt: skip
    return [packed.num_experts * tp, *one.shape[1:]]


def _slice_parts(packed, role: str, tp: int):
    """The slice experts' rows of one tensor, rank-major, one expert at a time."""
    w, spec = _spec_of(packed.layout, role)
    need = [role] + ([w] if spec is not None and spec.role == "sum" else [])  # a column sum is re-summed from the slice's codes
    for r in range(tp):
        for e in range(packed.num_experts):
            one = {k: packed.tensors[k][e:e + 1] for k in need}
            yield slice_rank(packed.layout, one, packed.hidden, packed.intermediate, tp, r, packed.interleaved)[role]


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


__all__ = ["tp_slice_size", "rank_copy_kind", "rank_copy_problem", "slice_rank", "slice_tensors", "unslice_tensors",
           "tp_slice", "tp_unslice", "rank_experts", "expand_routes", "reshard_dir"]  # fmt: skip
