"""``moepack verify DST [--source SRC]``: prove a packed directory intact and equal to its source.

1. Structure: the manifest, every shard header, alignment, shapes against layout math
   (everything ``moepack.open`` checks).
2. Integrity: the sha256 of every tensor's bytes against the manifest (a flipped byte names the
   tensor).
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
4. With the source, the whole model, not only what the manifest lists (``_check_model``): the
   set of MoE layers (index, prefix) the source reader finds, each layer's experts (count, H, I,
   activation and swigluoai's alpha/limit, row order, biases, act-order, shared expert and its
   gate, router tensors, the scheme a quantized source keeps) and the routing config convert
   derives from config.json, against the manifest; and the carried-over tensors (every source
   tensor no MoE layer consumes) as a set, with dtype, shape and bytes (the source's sha256
   against the manifest's, which step 2 proved against the pack). Any difference fails, named.

Memory: verify streams. Checksums read each tensor in 16 MiB pieces with pread (the pack's
mapping is not touched, so its pages never count against verify). The weight and output checks
take one block of experts at a time (``BLOCK_BYTES`` of fp32 weights, at least one expert):
the block's source weights, its packed tensors (read with pread), what the spec packer makes
of the source, and the block's part of the output (``expert_map`` restricts the kernel to the
block; the reference sees the block's routes only). Peak memory is therefore a few blocks,
whatever the number of experts or layers.

Modules: this one drives verify and owns its memory budget (``BLOCK_BYTES``);
moepack.verify_report holds the report types and sha256 helpers, moepack.verify_layer step 3
(weights and outputs, block by block), moepack.verify_model step 4 (the model against the
source). Names outside code imports from here (``tensor_sha256``, ``file_sha256``, ...) are
re-exported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .errors import MoepackError, PackedDirError
from .runtime.model import PackedModel, open_packed
from .verify_layer import _check_layer, _unpacked  # _unpacked: re-exported (tests import it from here)
from .verify_model import _check_model
# re-exported from their old home too: CHUNK, LayerCheck, TensorCheck, tensor_sha256
from .verify_report import CHUNK, READ_CHUNK, LayerCheck, TensorCheck, VerifyReport, file_sha256, tensor_sha256

# fp32 bytes of the experts one step of the weight/output check holds (the source's weights, and
# the packed and recomputed tensors are of the same order): 64 MiB is 3 experts of
# Qwen3-30B-A3B, 1 of DeepSeek-V3 (which alone is 176 MiB).
BLOCK_BYTES = 64 << 20


def _check_tensors(model: PackedModel, report: VerifyReport, notify) -> None:
    buf = bytearray(READ_CHUNK)
    for name, e in model.manifest["tensors"].items():
        info = model._shards[e["file"]].info(name)
        digest = file_sha256(model._shards[e["file"]].path, info.file_offset, info.nbytes, buf)
        ok = digest == e.get("sha256")
        report.tensors.append(
            TensorCheck(name, e["file"], ok, "" if ok else f"sha256 {digest[:16]}… differs from the manifest's {str(e.get('sha256'))[:16]}…")
        )
        notify("tensor", name=name, ok=ok)


def _options(layer):
    """The quantizer options convert ran with (the manifest's per-layer ``quantizer``), or None."""
    q = layer.entry.get("quantizer")
    if not q:
        return None
    from .convert_plan import parse_quantize  # where it lives: not the convert driver (threads, signals)

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
    model = open_packed(dst)
    report = VerifyReport(path=Path(dst))
    _check_tensors(model, report, notify)
    if source is not None:
        from .sources import open_source

        ckpt, reader = open_source(source)
        report.source = str(source)
        report.fingerprint_match = ckpt.fingerprint() == model.manifest["source"].get("fingerprint")
        specs = {s.index: s for s in reader.layers(ckpt)}
        report.model = _check_model(model, ckpt, reader, specs)
        for idx in sorted(model.layers):
            if idx not in specs:
                continue  # named in report.model
            report.layers.append(_check_layer(model, idx, ckpt, reader, specs[idx], tokens, seed, _options(model.layers[idx]),
                                              block_bytes=BLOCK_BYTES))  # fmt: skip
            notify("layer", index=idx, ok=report.layers[-1].ok)
    return report


__all__ = ["verify", "VerifyReport", "tensor_sha256", "file_sha256", "BLOCK_BYTES"]
