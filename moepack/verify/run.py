"""``moepack verify DST [--source SRC]``: prove a packed directory intact and equal to its source.

1. Structure: the manifest, every shard header, alignment, shapes against layout math
   (everything ``moepack.open`` checks).
2. Integrity: the sha256 of every tensor's bytes against the manifest (a flipped byte names the
   tensor); every packed expert tensor's values against its role's rule (moepack.verify.values:
   scales finite and >= 0, zero points 0..15, permutations, finite bf16 weights and biases, int8
   column sums equal to the codes' sums; a ``--tp`` pack's tensors kept once per rank: w2's
   bias zero on ranks > 0, every other copy equal to rank 0's, moepack.tp's
   ``rank_copy_problem``): a hostile pack with consistent checksums is named;
   every carried file (config.json, tokenizer files) present and equal to the manifest's
   ``carried_sha256``. The manifest's own fields are sealed by ``manifest_sha256`` (format
   version 6; step 1 checks it, as open does); an older, unsealed manifest is named in the notes.
3. With the source: every layer's packed weights unpacked equal the source's weights rounded
   to bf16, exactly, padding included (zero); and the packed layer's output on seeded random
   tokens matches ``moepack.reference`` run on the source's own weights.
   int8 layers (scheme int8_channel): the packed codes, scales and column sums equal the
   source's own int8 codes and scales (or, for a dense source quantized by moepack,
   ``quantize_int8_per_channel`` of its weights) exactly; the output matches
   ``moe_reference_int8`` on those codes (1e-5, up to two intermediate-code flips: see
   tests/reference/tolerances.py) and the fp32 reference on the source's weights (3e-2).
   The shared expert (DeepSeek/GLM ``shared_experts``, Qwen2-MoE ``shared_expert`` with its
   ``shared_expert_gate``, Llama-4 ``shared_expert``) is held to the same rules as a one-expert
   set: ``shared_w13`` / ``shared_w2`` (and, int8, their scales and column sums) exactly, its
   gate bit for bit, and its gated output is part of the layer output compared.
   A differing tensor is named with its first differing element ([expert, row, col] of the
   unpacked values), both values and the rule; the report counts the tensors compared.
4. With the source, the whole model, not only what the manifest lists (``check_model``): the
   set of MoE layers (index, prefix) the source reader finds, each layer's experts (count, H, I,
   activation and swigluoai's alpha/limit, row order, biases, act-order, shared expert and its
   gate, router tensors, the scheme a quantized source keeps) and the routing config convert
   derives from config.json, against the manifest; and the carried-over tensors (every source
   tensor no MoE layer consumes) as a set, with dtype, shape and bytes (the source's sha256
   against the manifest's, which step 2 proved against the pack); each layer's ``act_mode``
   against the source's meaning (a16 for W4A16 and dense, a8 for W8A8 and W4A8), a different one
   accepted only as the deliberate ``act_mode_option`` convert recorded, and then reported in
   ``notes``; the stored ``model.config`` (load_model builds the model from it) against
   config.json, key for key; the carried files against the source's. Any difference fails,
   named. The output check runs in the manifest's mode, never ``MOEPACK_ACT_MODE``.

What verify cannot prove: that the source itself is what its author meant (a config.json and
tensors that agree with each other but not with the real model), the bytes of a non-expert
quantized linear against its source's meaning (they are compared as carried bytes only), and
anything outside the directory (the transformers version that builds the model).

Memory: verify streams. Checksums read each tensor in 16 MiB pieces with pread (the pack's
mapping is not touched, so its pages never count against verify). The weight and output checks
take one block of experts at a time (``BLOCK_BYTES`` of fp32 weights, at least one expert):
the block's source weights, its packed tensors (read with pread), what the spec packer makes
of the source, and the block's part of the output (``expert_map`` restricts the kernel to the
block; the reference sees the block's routes only). Peak memory is therefore a few blocks,
whatever the number of experts or layers.

Modules: this one drives verify and owns its memory budget (``BLOCK_BYTES``);
moepack.verify.report holds the report types and sha256 helpers, moepack.verify.layer step 3
(weights and outputs, block by block), moepack.verify.model step 4 (the model against the
source). Names outside code imports from here (``tensor_sha256``, ``file_sha256``, ...) are
re-exported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import MoepackError, PackedDirError
from ..runtime.model import PackedModel, open_packed
from .layer import check_layer, unpacked_values  # unpacked_values: re-exported (tests import it from here)
from .model import check_model
# re-exported from their old home too: CHUNK, LayerCheck, TensorCheck, tensor_sha256
from .report import CHUNK, READ_CHUNK, LayerCheck, TensorCheck, VerifyReport, file_sha256, tensor_sha256

# fp32 bytes of the experts one step of the weight/output check holds (the source's weights, and
# the packed and recomputed tensors are of the same order): 64 MiB is 3 experts of
# Qwen3-30B-A3B, 1 of DeepSeek-V3 (which alone is 176 MiB).
BLOCK_BYTES = 64 << 20


def _check_tensors(model: PackedModel, report: VerifyReport, notify) -> None:
    """Step 2: every tensor's sha256 against the manifest and, for packed expert tensors, its
    values against its role's rule (moepack.verify.values): bf16 codes while they are hashed (one
    read), the small tensors (scales, zero points, biases, permutations) read once more whole,
    int8 column sums against the codes, block by block."""
    from .values import roles_of, streamed

    buf = bytearray(READ_CHUNK)
    roles = dict(roles_of(model))
    ranked = _rank_copies(model)
    for name, e in model.manifest["tensors"].items():
        shard = model._shards[e["file"]]
        info = shard.info(name)
        role = roles.get(name)
        problems: list[str] = []
        inspect = None
        if streamed(role, info.torch_dtype):
            inspect = _piece_check(name, role, info.torch_dtype, problems)
        digest = file_sha256(shard.path, info.file_offset, info.nbytes, buf, inspect)
        ok = digest == e.get("sha256")
        detail = "" if ok else f"sha256 {digest[:16]}… differs from the manifest's {str(e.get('sha256'))[:16]}…"
        if role is not None and inspect is None:
            problems += _small_check(model, name, role, info)
        if name in ranked:
            problems += _rank_check(model, name, info, *ranked[name])
        if role is not None:
            report.values_checked += 1
        if problems:
            ok = False
            detail = "; ".join([detail, *problems] if detail else problems)
        report.tensors.append(TensorCheck(name, e["file"], ok, detail))
        notify("tensor", name=name, ok=ok)


_VALUE_STEP = 1 << 20  # elements per value check of a float piece


def _piece_check(name: str, role: str, dtype, problems: list):
    """A file_sha256 ``inspect`` callback: the value rule on each piece of a float tensor (the
    first problem kept)."""
    import torch

    from .values import value_problem

    size = torch.empty(0, dtype=dtype).element_size()

    def inspect(piece, start: int) -> None:
        if problems or len(piece) < size:
            return
        t = torch.frombuffer(piece[: len(piece) // size * size], dtype=dtype)
        for i in range(0, t.numel(), _VALUE_STEP):  # small temporaries (the masks), whatever the piece
            msg = value_problem(name, role, t[i : i + _VALUE_STEP], offset=start // size + i)
            if msg:
                problems.append(msg)
                return

    return inspect


def _small_check(model: PackedModel, name: str, role: str, info) -> list[str]:
    """The value rule of a small tensor (read whole with pread), or of int8 column sums against
    their codes (one block of experts at a time)."""
    from .layer import read_rows
    from .values import colsum_problem, value_problem

    if role != "sum":
        msg = value_problem(name, role, read_rows(model, name, 0, info.shape[0]))
        return [msg] if msg else []
    codes_name, layout = _codes_of(model, name)
    if codes_name is None:
        return []
    e_all = info.shape[0]
    row = max(1, model._shards[model.manifest["tensors"][codes_name]["file"]].info(codes_name).nbytes // max(1, e_all))
    step = max(1, BLOCK_BYTES // row)
    for e0 in range(0, e_all, step):
        e1 = min(e_all, e0 + step)
        msg = colsum_problem(name, codes_name, layout, read_rows(model, codes_name, e0, e1), read_rows(model, name, e0, e1), e0)
        if msg:
            return [msg]
    return []


def _rank_copies(model: PackedModel) -> dict:
    """The tensors a ``--tp`` pack keeps once per rank (moepack.tp's ``rank_copy_kind``): tensor
    name -> (its layer's packed experts, its role)."""
    from ..tp import rank_copy_kind

    out = {}
    for layer in model.layers.values():
        p = layer.packed
        if p.tp > 1:
            for role, n in layer.entry["tensors"].items():
                if role in p.tensors and rank_copy_kind(p.layout, role) is not None:
                    out[n] = (p, role)
    return out


def _rank_check(model: PackedModel, name: str, info, p, role: str) -> list[str]:
    """Every rank's copy of a per-rank tensor of a ``--tp`` pack against the format's rule (w2's
    bias zero on ranks > 0, the other copies equal to rank 0's), one block of experts at a time."""
    import torch

    from ..tp import rank_copy_problem
    from .layer import read_rows

    e_all = p.num_experts
    row = max(1, info.nbytes // max(1, info.shape[0]))
    step = max(1, BLOCK_BYTES // (row * p.tp))
    for e0 in range(0, e_all, step):
        e1 = min(e_all, e0 + step)
        t = torch.cat([read_rows(model, name, r * e_all + e0, r * e_all + e1) for r in range(p.tp)])
        msg = rank_copy_problem(p.layout, role, name, t, p.tp, e0)
        if msg:
            return [msg]
    return []


def _codes_of(model: PackedModel, sum_name: str):
    """The codes tensor an int8 column-sum tensor belongs to, and its layout."""
    for layer in model.layers.values():
        groups = [(layer.entry["tensors"], layer.packed.layout)]
        if layer.shared is not None:
            groups.append((layer.entry.get("shared") or {}, layer.shared.layout))
        for group, lay in groups:
            for role, n in group.items():
                if n == sum_name and role.endswith("_colsum"):
                    return group.get(role[: -len("_colsum")]), lay
    return None, None


def _check_files(model: PackedModel, report: VerifyReport, notify) -> None:
    """Every carried file (config.json, tokenizer files, ...): present, a regular file, and its
    sha256 equal to the manifest's (``carried_sha256``; a pack written before moepack recorded
    them is checked for presence only, and the report says so)."""
    m = model.manifest
    sums = m.get("carried_sha256")
    for name in m.get("carried_files") or []:
        p = model.path / name
        if not p.is_file():
            report.files.append(TensorCheck(name, name, False, "is missing (listed in carried_files; it must be a regular file "
                                                               "of the directory)"))  # fmt: skip
        elif sums is None:
            report.files.append(TensorCheck(name, name, True, "present (no checksum recorded: packed before moepack recorded them)"))
        else:
            digest = file_sha256(p, 0, p.stat().st_size)
            ok = digest == sums[name]
            report.files.append(TensorCheck(name, name, ok, "" if ok else f"sha256 {digest[:16]}… differs from the manifest's "
                                                                         f"{sums[name][:16]}… (edited after convert)"))  # fmt: skip
        notify("file", name=name, ok=report.files[-1].ok)


def _options(layer):
    """The quantizer options convert ran with (the manifest's per-layer ``quantizer``), or None."""
    q = layer.entry.get("quantizer")
    if not q:
        return None
    from ..convert.plan import parse_quantize  # where it lives: not the convert driver (threads, signals)

    try:
        return parse_quantize(q)[1]
    except MoepackError as e:
        raise PackedDirError(f"layer {layer.entry['index']}: quantizer {q!r} in the manifest: {e}") from None


def verify(
    dst: str | Path,
    *,
    source: str | Path | None = None,
    tokens: int = 7,
    seed: int = 0,
    progress: Callable | None = None,
) -> VerifyReport:
    """Verify the packed directory at ``dst``; see the module docstring."""
    notify = progress or (lambda *a, **k: None)
    model = open_packed(dst, check_values=False)  # verify names every bad value itself (_check_tensors)
    report = VerifyReport(path=Path(dst))
    if "manifest_sha256" not in model.manifest:  # open refuses a version-6 manifest without it
        report.notes.append(f"moepack.json has no manifest_sha256 (format_version {model.manifest['format_version']}, written "
                            "before moepack sealed its manifests): a field edited to a value the schema accepts cannot be "
                            "told from convert's")  # fmt: skip
    _check_tensors(model, report, notify)
    _check_files(model, report, notify)
    if source is not None:
        from ..sources import open_source

        ckpt, reader = open_source(source)
        report.source = str(source)
        report.fingerprint_match = ckpt.fingerprint() == model.manifest["source"].get("fingerprint")
        specs = {s.index: s for s in reader.layers(ckpt)}
        report.model = check_model(model, ckpt, reader, specs, report.notes)
        for idx in sorted(model.layers):
            if idx not in specs:
                continue  # named in report.model
            report.layers.append(check_layer(model, idx, ckpt, reader, specs[idx], tokens, seed, _options(model.layers[idx]),
                                              block_bytes=BLOCK_BYTES))  # fmt: skip
            notify("layer", index=idx, ok=report.layers[-1].ok)
    return report


__all__ = ["verify", "VerifyReport", "tensor_sha256", "file_sha256", "BLOCK_BYTES"]
