"""A Hugging Face checkpoint directory: config.json + one or more safetensors files.

Headers are read and validated up front (a truncated or corrupt file is a clear error before
anything is written); tensor data is read on demand, one tensor at a time, with ``os.pread``
straight into the destination buffer, so converting never holds more than the layer at hand.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SourceError

ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
MAX_HEADER = 100_000_000

# transformers writes the floats JSON cannot hold as {"__float__": "Infinity"} (configuration_utils'
# _encode_special_floats); config.json is stored as written, and these are decoded where a value is used.
_FLOAT_TAG = "__float__"
_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def decode_special_floats(obj, where: str = "config.json"):
    """``obj`` with every ``{"__float__": "Infinity" | "-Infinity" | "NaN"}`` replaced by its float
    (transformers' encoding of the floats JSON cannot hold). Any other tag is refused naming the key."""
    if isinstance(obj, dict):
        if _FLOAT_TAG in obj and len(obj) == 1:
            tag = obj[_FLOAT_TAG]
            if tag not in _FLOAT_TAGS:
                raise SourceError(f"{where}={obj!r}: a {{'__float__': ...}} value must be 'Infinity', '-Infinity' or 'NaN' "
                                  "(transformers' encoding of the floats JSON cannot hold)")  # fmt: skip
            return _FLOAT_TAGS[tag]
        return {k: decode_special_floats(v, f"{where}: {k}" if where == "config.json" else f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    return obj


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype_str: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        return ST_DTYPES[self.dtype_str]


def _parse_header(path: Path):
    """The validated safetensors header of ``path`` (a corrupt file is a SourceError)."""
    from ..container.reader import read_safetensors_header
    from ..errors import ContainerError

    try:
        return read_safetensors_header(path)
    except ContainerError as e:
        raise SourceError(f"source file is not valid safetensors: {e}") from None


def _check_regular(f: Path, what: str) -> None:
    """A shard must be a regular file (a symlink to one is fine); a directory, FIFO, socket or
    device is named as what it is, not as missing (opening a FIFO would block)."""
    import stat

    try:
        mode = f.stat().st_mode
    except FileNotFoundError:
        raise SourceError(f"{what}, which does not exist") from None
    except OSError as e:
        raise SourceError(f"{what}, which cannot be read: {e.strerror}") from None
    if stat.S_ISREG(mode):
        return
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
            else "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")  # fmt: skip
    raise SourceError(f"{what}, which is {kind}: a shard must be a regular safetensors file")


class Checkpoint:
    """Lazy view of a checkpoint directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise SourceError(f"source {self.path}: not a directory (expected a Hugging Face checkpoint directory)")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise SourceError(f"source {self.path}: has no config.json (expected a Hugging Face checkpoint directory)")
        self.config_bytes = cfg_path.read_bytes()
        try:
            self.config = json.loads(self.config_bytes)
        except json.JSONDecodeError as e:
            raise SourceError(f"{cfg_path}: not valid JSON ({e})") from None
        if not isinstance(self.config, dict):
            raise SourceError(f"{cfg_path}: must hold a JSON object")
        decode_special_floats(self.config)  # an unknown {"__float__": ...} tag is refused here, naming the key
        self.files = self._find_files()
        self.tensors: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, ent in _parse_header(f).tensors.items():
                if name in self.tensors:
                    raise SourceError(f"tensor {name!r} appears in both {self.tensors[name].file.name} and {f.name}")
                self.tensors[name] = TensorInfo(name, f, ent.dtype, tuple(ent.shape), ent.file_offset, ent.nbytes)
        if self.index_map is not None:
            for name, fname in self.index_map.items():
                if name not in self.tensors:
                    raise SourceError(f"model.safetensors.index.json lists tensor {name!r} in {fname}, but no file holds it")
                if self.tensors[name].file.name != fname:
                    raise SourceError(
                        f"model.safetensors.index.json puts tensor {name!r} in {fname}, but it is in {self.tensors[name].file.name}"
                    )

    def _find_files(self) -> list[Path]:
        self.index_map = None
        idx = self.path / "model.safetensors.index.json"
        if idx.is_file():
            try:
                data = json.loads(idx.read_text())
                weight_map = data["weight_map"]
                assert isinstance(weight_map, dict)
            except Exception as e:
                raise SourceError(f"{idx}: not a valid safetensors index (needs a 'weight_map' object): {e}") from None
            self.index_map = weight_map
            names = sorted(set(weight_map.values()))
            files = [self.path / n for n in names]
            for f in files:
                _check_regular(f, f"{idx}: lists shard {f.name}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise SourceError(f"source {self.path}: has no *.safetensors files")
        for f in files:
            _check_regular(f, f"source shard {f}")
        return files

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise SourceError(f"tensor {name!r} is missing from {self.path}") from None

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's data, read from disk into ``out`` (same dtype and numel) or a new tensor."""
        return self._read_info(self.info(name), out)

    def _read_info(self, ti: TensorInfo, out: torch.Tensor | None) -> torch.Tensor:
        name = ti.name
        if ti.dtype_str not in ST_DTYPES:
            raise SourceError(f"tensor {name!r} has dtype {ti.dtype_str}, which moepack cannot read")
        if out is None:
            out = torch.empty(ti.shape, dtype=ti.dtype)
        if out.dtype != ti.dtype or out.numel() * out.element_size() != ti.nbytes or not out.is_contiguous():
            raise SourceError(f"tensor {name!r}: destination {out.dtype} {list(out.shape)} does not fit {ti.dtype_str} {list(ti.shape)}")
        buf = memoryview(out.view(-1).view(torch.uint8).numpy()) if ti.nbytes else memoryview(b"")
        with open(ti.file, "rb", buffering=0) as f:
            got = 0
            while got < ti.nbytes:
                n = os.preadv(f.fileno(), [buf[got:]], ti.offset + got)
                if n <= 0:
                    raise SourceError(f"{ti.file}: short read of tensor {name!r} (file truncated?)")
                got += n
        return out

    def read_slice(self, name: str, index: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``tensor[index]`` (along dim 0) read from disk, without reading the rest."""
        ti = self.info(name)
        if not ti.shape or not 0 <= index < ti.shape[0]:
            raise SourceError(f"tensor {name!r} with shape {list(ti.shape)}: index {index} is out of range along dim 0")
        row = ti.nbytes // ti.shape[0]
        part = TensorInfo(name, ti.file, ti.dtype_str, tuple(ti.shape[1:]), ti.offset + index * row, row)
        return self._read_info(part, out)

    def fingerprint(self) -> str:
        """sha256 over config.json and every file's name, size and header (not the data: cheap)."""
        h = hashlib.sha256()
        h.update(self.config_bytes)
        for f in self.files:
            st = f.stat()
            h.update(f.name.encode())
            h.update(str(st.st_size).encode())
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(min(n, MAX_HEADER)))
        return h.hexdigest()

    def carried_files(self) -> list[Path]:
        """Non-weight files of the directory (config, tokenizer, generation config, ...)."""
        out = []
        for p in sorted(self.path.iterdir()):
            if not p.is_file() or p.suffix == ".safetensors" or p.name == "model.safetensors.index.json":
                continue
            if p.name.startswith("."):
                continue
            out.append(p)
        return out
