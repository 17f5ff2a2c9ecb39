"""Source readers: one per input format, found through a registry.

A reader answers ``detect(ckpt) -> (ok, reason)`` from config.json and the headers alone, and
``layers(ckpt)`` / ``read_layer(ckpt, spec)`` produce the canonical per-layer form
(``CanonicalLayer``) that every packer consumes. Adding a format touches this folder only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch  # noqa: F401  (annotations)

from ..errors import SourceError
from .checkpoint import Checkpoint, TensorInfo
from .dense import CanonicalLayer, LayerSpec, discover_layers, mtp_skipped, read_biases, read_expert_w2, read_expert_w13, read_layer, read_shared, text_config


@dataclass(frozen=True)
class SourceReader:
    name: str
    detect: Callable[[Checkpoint], tuple[bool, str]]
    layers: Callable[[Checkpoint], list[LayerSpec]]
    read_layer: Callable[[Checkpoint, LayerSpec], CanonicalLayer]
    read_expert_w13: Callable[[Checkpoint, LayerSpec, int], "torch.Tensor"]
    read_expert_w2: Callable[[Checkpoint, LayerSpec, int], "torch.Tensor"]
    read_biases: Callable[[Checkpoint, LayerSpec], tuple]
    read_shared: Callable[[Checkpoint, LayerSpec], tuple | None]
    # What the expert weights mean (docs/SEMANTICS.md §3): a scheme name of moepack.schemes,
    # "dense" (float values) or a quantized one, whose canonical tensors (Scheme.canonical) the
    # two functions below read as they are stored (the float readers above dequantize them).
    scheme: str = "dense"
    # (ckpt, spec, "w13" | "w2", expert) -> {canonical name: tensor of that expert}
    read_expert_canonical: Callable[[Checkpoint, LayerSpec, str, int], dict] | None = None
    # (ckpt, spec) -> the shared expert's canonical tensors as a one-expert set, or None
    read_shared_canonical: Callable[[Checkpoint, LayerSpec], dict | None] | None = None
    # what the stored weights are, in words (the manifest's scheme_source); "": the scheme says it
    weights_note: str = ""
    # (ckpt) -> (source tensors convert leaves out deliberately, why): neither packed nor carried
    # over; the manifest's source.skipped records them. Every reader skips DeepSeek's MTP layers;
    # open_source hands out the reader with ``layers`` leaving out the layers skipped here.
    skipped: Callable[[Checkpoint], tuple[list, str]] = mtp_skipped


def _modelopt_algo(ckpt: Checkpoint):
    """ModelOpt's quant_algo from its ``hf_quant_config.json`` ({"quantization": {"quant_algo":
    ...}}), or None when the checkpoint has no such file or it names no algorithm."""
    import json

    f = ckpt.path / "hf_quant_config.json"
    if not f.is_file():
        return None
    try:
        q = json.loads(f.read_text()).get("quantization") or {}
    except (ValueError, AttributeError):
        return None
    return (q.get("quant_algo") or None) if isinstance(q, dict) else None


def _detect_dense(ckpt: Checkpoint) -> tuple[bool, str]:
    qc = text_config(ckpt.config).get("quantization_config") or ckpt.config.get("quantization_config")
    algo = _modelopt_algo(ckpt)
    if algo is not None:
        return False, f"hf_quant_config.json (ModelOpt quant_algo {algo!r}): not a dense checkpoint"
    if qc:
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        return False, f"config.json has quantization_config (quant_method={method!r}): not a dense checkpoint"
    return True, "no quantization_config: dense weights"


def _ct_reader() -> SourceReader:
    from . import compressed_tensors as ct

    return SourceReader(
        "compressed-tensors",
        ct.detect,
        ct.layers,
        ct.read_layer,
        ct.read_expert_w13,
        ct.read_expert_w2,
        ct.read_biases,
        ct.read_shared,
        scheme=ct.SCHEME,
        read_expert_canonical=ct.read_expert_canonical,
        read_shared_canonical=ct.read_shared_canonical,
        weights_note=ct.SOURCE_NOTE,
    )


def _int4_reader(mod) -> SourceReader:
    r = mod.READER
    return SourceReader(
        r.name,
        r.detect,
        r.layers,
        r.read_layer,
        r.read_expert_w13,
        r.read_expert_w2,
        r.read_biases,
        r.read_shared,
        scheme=r.scheme,
        read_expert_canonical=r.read_expert_canonical,
        read_shared_canonical=r.read_shared_canonical,
    )


def _fp8_readers() -> list[SourceReader]:
    from . import fp8

    def reader(name, detect, note):
        return SourceReader(name, detect, fp8.layers, fp8.read_layer, fp8.read_expert_w13, fp8.read_expert_w2,
                            fp8.read_biases, fp8.read_shared, scheme=fp8.SCHEME,
                            read_expert_canonical=fp8.read_expert_canonical, read_shared_canonical=fp8.read_shared_canonical,
                            weights_note=note)  # fmt: skip

    return [reader("fp8-block", fp8.detect_block_fp8, fp8.DEEPSEEK_NOTE),
            reader("compressed-tensors-float-quantized", fp8.detect_float_quantized, fp8.CT_NOTE)]  # fmt: skip


def _mxfp4_readers() -> list[SourceReader]:
    from . import mxfp4

    def reader(name, detect, note):
        return SourceReader(name, detect, mxfp4.layers, mxfp4.read_layer, mxfp4.read_expert_w13, mxfp4.read_expert_w2,
                            mxfp4.read_biases, mxfp4.read_shared, scheme=mxfp4.SCHEME,
                            read_expert_canonical=mxfp4.read_expert_canonical, read_shared_canonical=mxfp4.read_shared_canonical,
                            weights_note=note)  # fmt: skip

    return [reader("mxfp4-gpt-oss", mxfp4.detect_gpt_oss, mxfp4.GPT_OSS_NOTE),
            reader("compressed-tensors-mxfp4-pack-quantized", mxfp4.detect_ct, mxfp4.CT_NOTE)]  # fmt: skip


def _nvfp4_readers() -> list[SourceReader]:
    from . import nvfp4

    def reader(name, detect, note):
        return SourceReader(name, detect, nvfp4.layers, nvfp4.read_layer, nvfp4.read_expert_w13, nvfp4.read_expert_w2,
                            nvfp4.read_biases, nvfp4.read_shared, scheme=nvfp4.SCHEME,
                            read_expert_canonical=nvfp4.read_expert_canonical, read_shared_canonical=nvfp4.read_shared_canonical,
                            weights_note=note)  # fmt: skip

    return [reader("compressed-tensors-nvfp4-pack-quantized", nvfp4.detect_ct, nvfp4.CT_NOTE),
            reader("modelopt-nvfp4", nvfp4.detect_modelopt, nvfp4.MODELOPT_NOTE)]  # fmt: skip


def _int4_readers() -> list[SourceReader]:
    from . import awq, ct_pack_quantized, gptq

    return [_int4_reader(m) for m in (ct_pack_quantized, gptq, awq)]


READERS: list[SourceReader] = [
    _ct_reader(),
    *_int4_readers(),  # scheme int4_group (sources/int4_common.py): compressed-tensors pack-quantized, GPTQ, AWQ GEMM
    *_fp8_readers(),  # scheme fp8_block (sources/fp8.py): DeepSeek/Qwen block FP8, compressed-tensors float-quantized
    *_mxfp4_readers(),  # scheme mxfp4 (sources/mxfp4.py): gpt-oss MXFP4, compressed-tensors mxfp4-pack-quantized
    *_nvfp4_readers(),  # scheme nvfp4 (sources/nvfp4.py): compressed-tensors nvfp4-pack-quantized, ModelOpt NVFP4
    SourceReader("dense", _detect_dense, discover_layers, read_layer, read_expert_w13, read_expert_w2, read_biases, read_shared),
]


def _without_skipped(r: SourceReader) -> Callable[[Checkpoint], list[LayerSpec]]:
    """``r.layers`` less the layers whose expert tensors ``r.skipped`` leaves out."""

    def layers(ckpt: Checkpoint) -> list[LayerSpec]:
        drop = set(r.skipped(ckpt)[0])
        return [s for s in r.layers(ckpt) if not drop.intersection(s.expert_tensors)]

    return layers


# The reader a checkpoint's quantization_config names: (quant_method, compressed-tensors format or
# None) -> reader. When none handles the checkpoint, that reader's reason is the error's one line;
# the other readers' reasons are a note on it (``__notes__``: the traceback moepack --debug prints).
_CLAIMS = {
    ("compressed-tensors", "int-quantized"): "compressed-tensors",
    ("compressed-tensors", "pack-quantized"): "compressed-tensors-pack-quantized",
    ("compressed-tensors", "float-quantized"): "compressed-tensors-float-quantized",
    ("compressed-tensors", "mxfp4-pack-quantized"): "compressed-tensors-mxfp4-pack-quantized",
    ("compressed-tensors", "nvfp4-pack-quantized"): "compressed-tensors-nvfp4-pack-quantized",
    ("gptq", None): "gptq",
    ("awq", None): "awq",
    ("fp8", None): "fp8-block",
    ("mxfp4", None): "mxfp4-gpt-oss",
}
# Formats moepack recognises and does not read yet: (quant_method, format) -> what they are.
_NOT_YET = {
    ("nvfp4", None): "quant_method='nvfp4': NVFP4 (moepack reads compressed-tensors 'nvfp4-pack-quantized' and ModelOpt NVFP4)",
}


def _claim(ckpt: Checkpoint) -> tuple[str | None, str | None, str]:
    """(the reader the checkpoint's quantization_config names, or None; what a format moepack
    recognises but does not read yet is, or None; the config words that named them)."""
    qc = text_config(ckpt.config).get("quantization_config") or ckpt.config.get("quantization_config")
    algo = _modelopt_algo(ckpt)
    if algo is None and isinstance(qc, dict) and qc.get("quant_method") == "modelopt":
        algo = qc.get("quant_algo", "?")
    if algo is not None:  # NVIDIA ModelOpt: quant_algo NVFP4 (read), FP8, W4A8_AWQ, ...
        if str(algo).upper() == "NVFP4":
            return "modelopt-nvfp4", None, f"ModelOpt quant_algo {algo!r}"
        return None, f"ModelOpt quant_algo={algo!r}: a ModelOpt checkpoint", ""
    if not isinstance(qc, dict):
        return (None, None, "") if qc else ("dense", None, "no quantization_config")
    method = qc.get("quant_method")
    fmt, words = None, f"quantization_config quant_method {method!r}"
    if method == "compressed-tensors":
        groups = qc.get("config_groups")
        fmts = {g.get("format") for g in groups.values() if isinstance(g, dict)} if isinstance(groups, dict) else set()
        fmts = (fmts - {None}) or {qc.get("format")}
        if len(fmts) != 1:
            return None, None, ""  # mixed formats: every reader's reason
        fmt = fmts.pop()
        words = f"quantization_config format {fmt!r}"
    key = (method, fmt)
    return _CLAIMS.get(key), _NOT_YET.get(key), words


def open_source(path) -> tuple[Checkpoint, SourceReader]:
    """The checkpoint at ``path`` and the reader that handles it (or a SourceError saying why none
    does: alone on its one line, what the reader the config names says, or the format moepack
    recognises and does not read yet; the other readers' reasons in a note on the error)."""
    ckpt = Checkpoint(path)
    reasons = {}
    for r in READERS:
        ok, why = r.detect(ckpt)
        if ok:
            return ckpt, dataclasses.replace(r, layers=_without_skipped(r))
        reasons[r.name] = why
    claimed, not_yet, words = _claim(ckpt)
    if not_yet is not None:
        first = f"{not_yet} is not supported yet (docs/FORMATS.md lists the formats moepack reads)"
    elif claimed in reasons:
        first = f"{claimed}, the reader of {words}: {reasons.pop(claimed)}"
    else:
        raise SourceError(f"source {ckpt.path}: no reader handles it ({'; '.join(f'{k}: {v}' for k, v in reasons.items())})")
    err = SourceError(f"source {ckpt.path}: {first} (no reader handles it; moepack --debug shows the other readers' reasons)")
    err.add_note("the other readers: " + "; ".join(f"{k}: {v}" for k, v in reasons.items()))  # a traceback shows it
    raise err


__all__ = ["Checkpoint", "TensorInfo", "CanonicalLayer", "LayerSpec", "SourceReader", "READERS", "open_source", "text_config"]
