"""Validating safetensors reader: header checks, zero-copy memory maps, streaming sha256.

``read_safetensors_header`` checks every rule of the safetensors format (and, on request, the
moepack alignment rule) before anything else looks at the file, so a truncated or corrupt file
-- ours or a source checkpoint written by another tool -- is refused with a ``ContainerError``
that names the file, the tensor, the value and the rule. ``open_shard`` then maps the file
``MAP_PRIVATE`` and hands out views into the mapping without copying. See docs/PACKED_FORMAT.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..errors import ContainerError
from .pages import MADV_HUGEPAGE, huge_pages_wanted, madvise

# The same limit as safetensors' MAX_HEADER_SIZE (safetensors/src/tensor.rs).
MAX_HEADER_BYTES = 100_000_000

# Names of the filler tensors the moepack writer inserts to keep every tensor aligned.
PAD_PREFIX = "__pad__."

# Largest element count we accept, as safetensors' checked_mul on a 64-bit usize.
_MAX_ELEMENTS = 2**64 - 1

# safetensors dtype string -> bits per element. Every dtype of the safetensors Rust core plus the
# two FNUZ names the Python binding writes; sub-byte dtypes (F4, F6_*) are legal in a header, but
# their byte length must be whole (safetensors' MisalignedSlice rule).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


def _torch_dtypes() -> dict[str, torch.dtype]:
    names = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "F8_E5M2": "float8_e5m2",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E8M0": "float8_e8m0fnu",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "I16": "int16",
        "U16": "uint16",
        "F16": "float16",
        "BF16": "bfloat16",
        "I32": "int32",
        "U32": "uint32",
        "F32": "float32",
        "C64": "complex64",
        "F64": "float64",
        "I64": "int64",
        "U64": "uint64",
    }
    out = {}
    for st_name, torch_name in names.items():
        dt = getattr(torch, torch_name, None)
        if dt is not None:
            out[st_name] = dt
    return out


# safetensors dtype string -> torch dtype, for the dtypes this torch build has (no sub-byte ones).
SAFETENSORS_TO_TORCH: dict[str, torch.dtype] = _torch_dtypes()
TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. ``begin``/``end`` are relative to the data buffer, as in the file."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int
    data_start: int  # 8 + N: absolute offset of the data buffer in the file

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def file_offset(self) -> int:
        """Absolute offset of the first byte in the file."""
        return self.data_start + self.begin

    @property
    def is_filler(self) -> bool:
        return self.name.startswith(PAD_PREFIX)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype, or None for dtypes torch cannot hold element-wise (F4, F6_*)."""
        return SAFETENSORS_TO_TORCH.get(self.dtype)


@dataclass(frozen=True)
class Header:
    """A validated safetensors header.

    ``entries`` holds every entry (filler tensors included) sorted by offset; ``tensors`` maps the
    names of the non-filler tensors to their entries, in file order.
    """

    path: str
    header_len: int  # N
    file_size: int
    metadata: dict[str, str] | None
    entries: tuple[TensorInfo, ...]
    tensors: dict[str, TensorInfo] = field(repr=False)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def names(self) -> list[str]:
        return list(self.tensors)


def _fail(path: str, msg: str) -> ContainerError:
    return ContainerError(f"{os.path.basename(path)}: {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def _pairs_no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _parse_entry(path: str, name: str, raw, data_len: int, data_start: int) -> TensorInfo:
    where = f"tensor {name!r}"
    if not name:
        raise _fail(path, "a tensor has an empty name")
    if not isinstance(raw, dict):
        raise _fail(path, f"{where} is a JSON {type(raw).__name__}, must be an object with dtype, shape, data_offsets")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in raw:
            raise _fail(path, f"{where} has no {key!r} (every tensor needs dtype, shape and data_offsets)")
    dtype = raw["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _fail(path, f"{where} has unknown dtype {dtype!r} (known: {', '.join(DTYPE_BITS)})")
    shape = raw["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise _fail(path, f"{where} has shape {shape!r}, must be a list of integers")
    if any(d < 0 for d in shape):
        raise _fail(path, f"{where} has shape {_fmt_shape(shape)} with a negative dimension")
    offsets = raw["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise _fail(path, f"{where} has data_offsets {offsets!r}, must be [begin, end] integers")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise _fail(path, f"{where} has data_offsets [{begin}, {end}]; need 0 <= begin <= end")
    if end > data_len:
        raise _fail(
            path,
            f"{where} data_offsets [{begin}, {end}] run past the end of the data buffer "
            f"({data_len} bytes after the {data_start}-byte header; file truncated?)",
        )
    nelem = 1
    for d in shape:
        nelem *= d
        if nelem > _MAX_ELEMENTS:
            raise _fail(path, f"{where} shape {_fmt_shape(shape)} overflows: more than 2**64 elements")
    nbits = nelem * DTYPE_BITS[dtype]
    if nbits % 8:
        raise _fail(
            path, f"{where} {dtype} {_fmt_shape(shape)} is {nbits} bits, not a whole number of bytes"
        )
    need = nbits // 8
    if end - begin != need:
        raise _fail(
            path,
            f"{where} data_offsets [{begin}, {end}] hold {end - begin} bytes but "
            f"{dtype} {_fmt_shape(shape)} needs {need}",
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end, data_start)


def read_safetensors_header(path: str | os.PathLike, *, require_alignment: int | None = None) -> Header:
    """Read and validate the header of the safetensors file ``path``.

    Checks, in order: the file holds at least 8 bytes; the header length N is at most
    ``MAX_HEADER_BYTES`` and 8 + N fits in the file; the header is UTF-8 JSON, begins with ``{``,
    is an object without duplicate keys; ``__metadata__`` (if present) maps str to str; every
    tensor has a known dtype, a shape of non-negative integers, ``data_offsets`` [begin, end]
    inside the data buffer, and end - begin == prod(shape) * itemsize (no overflow past 2**64
    elements); sorted by offset, the tensors tile the data buffer from 0 to the end of the file
    with no hole, overlap or trailing bytes. With ``require_alignment``, every non-filler tensor's
    absolute file offset is a multiple of it.

    Raises ``ContainerError`` on the first broken rule, and on I/O errors.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise _fail(path, f"file is {size} bytes; a safetensors file starts with an 8-byte header length")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes")
            if 8 + n > size:
                raise _fail(
                    path, f"header length {n} runs past the end of the file ({size} bytes; truncated?)"
                )
            raw = f.read(n)
    except OSError as e:
        raise _fail(path, f"cannot read: {e}") from e
    if len(raw) != n:
        raise _fail(path, f"read {len(raw)} of {n} header bytes (file changed while reading?)")
    return _validate_header(path, raw, size, require_alignment)


def _validate_header(path: str, raw: bytes, size: int, require_alignment: int | None) -> Header:
    n = len(raw)
    if require_alignment is not None and (not _is_int(require_alignment) or require_alignment <= 0):
        raise ValueError(f"require_alignment must be a positive int or None, got {require_alignment!r}")
    if not raw.startswith(b"{"):
        raise _fail(path, f"header begins with {raw[:16]!r}; a safetensors header MUST begin with '{{'")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_pairs_no_duplicates, parse_constant=_reject_constant)
    except RecursionError:
        raise _fail(path, "header JSON is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and the hooks' refusals
        raise _fail(path, f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _fail(path, f"header is a JSON {type(obj).__name__}, must be an object")

    data_start = 8 + n
    data_len = size - data_start
    metadata = obj.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise _fail(path, f"__metadata__ must map strings to strings, got {json.dumps(metadata)[:200]}")

    entries = [_parse_entry(path, name, v, data_len, data_start) for name, v in obj.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = 0
    prev = None
    for e in entries:
        if e.begin != cursor:
            if e.begin < cursor:
                rule = f"overlaps tensor {prev.name!r} [{prev.begin}, {prev.end}]"
            elif prev is None:
                rule = f"leaves a hole of {e.begin} bytes at the start of the data buffer"
            else:
                rule = f"leaves a hole of {e.begin - cursor} bytes after tensor {prev.name!r} [{prev.begin}, {prev.end}]"
            raise _fail(
                path, f"tensor {e.name!r} data_offsets [{e.begin}, {e.end}] {rule} (safetensors forbids holes and overlaps)"
            )
        cursor = e.end
        prev = e
    if cursor != data_len:
        raise _fail(
            path,
            f"tensors end at data offset {cursor} but the data buffer holds {data_len} bytes "
            f"(file size {size} != 8 + {n} + {cursor}; trailing bytes or a hole at the end)",
        )
    if require_alignment is not None:
        for e in entries:
            if not e.is_filler and e.file_offset % require_alignment:
                raise _fail(
                    path,
                    f"tensor {e.name!r} starts at file offset {e.file_offset} (data_offsets "
                    f"[{e.begin}, {e.end}]), not a multiple of the required alignment {require_alignment}",
                )
    tensors = {e.name: e for e in entries if not e.is_filler}
    return Header(path, n, size, metadata, tuple(entries), tensors)


class Shard:
    """A validated safetensors file mapped ``MAP_PRIVATE``; tensors are views into the mapping.

    The views are writable as far as torch knows, but treat them as read-only: a write copies the
    page (copy-on-write) and never reaches the file. The mapping lives as long as any view does.
    """

    def __init__(self, header: Header, storage: torch.UntypedStorage):
        self.header = header
        self._storage = storage

    @property
    def path(self) -> str:
        return self.header.path

    @property
    def names(self) -> list[str]:
        """Names of the non-filler tensors, in file order."""
        return self.header.names

    def __contains__(self, name: str) -> bool:
        return name in self.header.tensors

    def __len__(self) -> int:
        return len(self.header.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.header.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.header.tensors[name]
        except KeyError:
            raise _fail(self.path, f"no tensor named {name!r} ({len(self)} tensors in the file)") from None

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a 1-D uint8 view into the mapping (works for every dtype)."""
        e = self.info(name)
        return torch.empty(0, dtype=torch.uint8).set_(self._storage, e.file_offset, (e.nbytes,), (1,))

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as a zero-copy view with its dtype and shape.

        A tensor whose file offset is not a multiple of its element size (possible only in files
        from writers that do not align, never in moepack files) is copied instead.
        """
        e = self.info(name)
        dt = e.torch_dtype
        if dt is None:
            raise _fail(self.path, f"tensor {name!r} has sub-byte dtype {e.dtype}; read its bytes with Shard.raw()")
        b = self.raw(name)
        if e.file_offset % dt.itemsize:
            b = b.clone()
        return b.view(dt).view(e.shape)


def open_shard(path: str | os.PathLike, require_alignment: int | None = 64) -> Shard:
    """Validate ``path``'s header, then memory-map it (``MAP_PRIVATE``, no copy, no read).

    The mapping is advised for transparent huge pages (``madvise(MADV_HUGEPAGE)``, a hint;
    ``MOEPACK_HUGE_PAGES=0`` leaves it out): pages read in through it come as 2 MiB folios where
    the page cache takes them, and a cold pack of the synthetic qwen3 model then had 1134 of a
    layer's 1152 MiB mapped 2 MiB at a time against 974 without (docs/KERNELS.md "Page touch")."""
    header = read_safetensors_header(path, require_alignment=require_alignment)
    try:
        if header.file_size == 0:  # unreachable (>= 8 bytes), kept for clarity
            storage = torch.UntypedStorage(0)
        else:
            storage = torch.UntypedStorage.from_file(header.path, shared=False, nbytes=header.file_size)
    except (OSError, RuntimeError) as e:
        raise _fail(header.path, f"cannot memory-map: {e}") from e
    if storage.nbytes() != header.file_size or os.path.getsize(header.path) != header.file_size:
        raise _fail(header.path, "file size changed while opening")
    if huge_pages_wanted() and storage.nbytes():
        madvise(storage.data_ptr(), storage.nbytes(), MADV_HUGEPAGE)  # the map starts on a page; a refusal leaves it as it is
    return Shard(header, storage)


_HASH_CHUNK = 64 << 20


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor``'s bytes; copies only if it is not contiguous or not on CPU."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return t


def sha256_update(h, tensor: torch.Tensor) -> None:
    """Feed ``tensor``'s bytes (row-major, little-endian) to the hashlib object ``h``, in chunks."""
    b = byte_view(tensor)
    for i in range(0, b.numel(), _HASH_CHUNK):
        h.update(memoryview(b[i : i + _HASH_CHUNK].numpy()))


def sha256_of(tensor: torch.Tensor) -> str:
    """Hex sha256 of the tensor's bytes as they are stored in a safetensors file.

    Streams over a uint8 view (no full copy for contiguous CPU tensors); equals the digest
    ``ShardWriter.write`` returns for the same tensor.
    """
    h = hashlib.sha256()
    sha256_update(h, tensor)
    return h.hexdigest()
