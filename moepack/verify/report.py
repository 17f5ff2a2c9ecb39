"""What verify reports, and the sha256 helpers its checks share.

``VerifyReport`` (with ``TensorCheck`` per checksum and ``LayerCheck`` per layer compared with
the source), ``tensor_sha256`` (a tensor in memory) and ``file_sha256`` (a byte range of a file,
read with pread into one buffer). Apart from run.py because every verify module fills or
uses them: the layer check returns ``LayerCheck``, the model check hashes carried-over tensors
with ``file_sha256``; keeping them at the bottom keeps the imports one-way.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import PackedDirError

CHUNK = 64 << 20
READ_CHUNK = 16 << 20  # pread piece of the checksums (one reused buffer)


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, streamed in chunks (no second copy of a large tensor)."""
    h = hashlib.sha256()
    flat = t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    n = flat.numel()
    for i in range(0, n, CHUNK):
        h.update(memoryview(flat[i : i + CHUNK].numpy()))
    return h.hexdigest()


@dataclass
class TensorCheck:
    name: str
    file: str
    ok: bool
    detail: str = ""


@dataclass
class LayerCheck:
    index: int
    weights_exact: bool
    rel_err: float
    tol: float
    ok: bool
    detail: str = ""
    rel_err_fp32: float | None = None  # schemes with an fp32 rule: vs the fp32 reference on the source's float weights
    shared_exact: bool | None = None  # the shared expert's tensors (and gate) equal the source's; None: none
    tensors: dict = field(default_factory=dict)  # routed experts: packed tensor name -> equal to the source
    shared_tensors: dict = field(default_factory=dict)  # the shared expert's, likewise
    fp32_tol: float | None = None  # the rule rel_err_fp32 was judged by (None: not judged)
    weights: str = ""  # what the packed weights were compared as (Scheme.weights_note: "bf16", "int8 codes")
    quantizer: str | None = None  # the quantizer convert ran on the float source ("int4_group:g64:asym"), or None
    act_mode: str | None = None  # the activation mode both sides ran in (the manifest's, proved against the source's)
    tol_base: float | None = None  # the scheme's base tolerance; ``tol`` above it: widened by A8 code flips (reported)


@dataclass
class VerifyReport:
    path: Path
    tensors: list[TensorCheck] = field(default_factory=list)
    layers: list[LayerCheck] = field(default_factory=list)
    source: str | None = None
    fingerprint_match: bool | None = None
    model: list[str] = field(default_factory=list)  # where the pack's model differs from the source's (step 4)
    files: list[TensorCheck] = field(default_factory=list)  # carried files (config.json, tokenizer): present, sha256
    values_checked: int = 0  # tensors whose values were checked against their role's rule (moepack.verify.values)
    notes: list[str] = field(default_factory=list)  # what passed but the reader should know (a deliberate --act-mode)

    @property
    def ok(self) -> bool:
        return (all(t.ok for t in self.tensors) and all(f.ok for f in self.files) and all(layer.ok for layer in self.layers)
                and not self.model)  # fmt: skip

    def weights_checked(self, shared: bool = False) -> tuple[int, int]:
        """(equal, checked): packed expert tensors compared with the source (``shared``: only
        the shared experts')."""
        res = [v for c in self.layers for v in c.shared_tensors.values()]
        if not shared:
            res += [v for c in self.layers for v in c.tensors.values()]
        return sum(res), len(res)

    def failures(self) -> list[str]:
        out = [f"tensor {t.name!r} in {t.file}: {t.detail}" for t in self.tensors if not t.ok]
        out += [f"carried file {f.name!r}: {f.detail}" for f in self.files if not f.ok]
        out += [f"layer {c.index}: {c.detail}" for c in self.layers if not c.ok]
        out += [f"model: {p}" for p in self.model]
        return out

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "source": self.source,
            "fingerprint_match": self.fingerprint_match,
            "tensors_checked": len(self.tensors),
            "weights_checked": self.weights_checked()[1],
            "shared_weights_checked": self.weights_checked(shared=True)[1],
            "model_differences": list(self.model),
            "carried_files_checked": len(self.files),
            "values_checked": self.values_checked,
            "notes": list(self.notes),
            "failures": self.failures(),
            "layers": [c.__dict__ for c in self.layers],
        }


def file_sha256(path, offset: int, nbytes: int, buf: bytearray | None = None, inspect=None) -> str:
    """sha256 of ``nbytes`` bytes of a file from ``offset``, read with pread in pieces into one
    buffer: memory stays at the buffer's size (a mapped file's pages would count as ours).
    ``inspect(piece, start)``: called with every piece read (a memoryview) and its byte offset
    from ``offset``, so that one read serves the checksum and a value check."""
    h = hashlib.sha256()
    buf = buf if buf is not None else bytearray(READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < nbytes:
            n = os.preadv(f.fileno(), [view[: min(len(buf), nbytes - done)]], offset + done)
            if n <= 0:
                raise PackedDirError(f"{path}: short read at byte {offset + done} (file truncated while verifying?)")
            h.update(view[:n])
            if inspect is not None:
                inspect(view[:n], done)
            done += n
    return h.hexdigest()
