"""Packed directories for the tests, and edits of their tensors for the verify tests (tests/verify/test_verify_shared.py,
tests/verify/test_verify_biases.py; not a test module): change elements of a packed tensor in place and
keep the manifest's sha256 consistent, so that only a comparison with the source can tell.
``reseal`` is the same for a manifest edit: the seal (``manifest_sha256``, format version 6)
recomputed, as a hostile writer would, so that the schema's own rules (or verify) must tell.
``convert_fixtures`` converts bundled fixtures once for a module's tests, which edit copies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import moepack
from moepack.container import read_safetensors_header
from moepack.convert.run import MANIFEST
from moepack.manifest import manifest_digest
from moepack.pack import pack_weight_reference, unpack_weight_reference
from moepack.verify.run import tensor_sha256


def rewrite_tensor(d: Path, name: str, edit) -> None:
    """``edit(t)`` changes the tensor ``name`` of the packed directory ``d`` in place (a copy
    of its bytes); the new bytes are written over the old ones and the manifest's sha256 of the
    tensor is updated, so that only a comparison with the source can tell."""
    m = json.loads((d / MANIFEST).read_text())
    fname = m["tensors"][name]["file"]
    info = read_safetensors_header(d / fname).tensors[name]
    t = moepack.open(d).tensor(name).clone()
    edit(t)
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert len(raw) == info.nbytes
    with open(d / fname, "r+b") as f:
        f.seek(info.file_offset)
        f.write(raw)
    m["tensors"][name]["sha256"] = tensor_sha256(t)
    (d / MANIFEST).write_text(json.dumps(reseal(m), indent=1))


def reseal(m: dict) -> dict:
    """``m`` with its seal recomputed (a manifest without one, older than version 6, is left so):
    an edited manifest as a writer that also fixes the checksums writes it."""
    if isinstance(m, dict) and isinstance(m.get("manifest_sha256"), str):
        try:
            m["manifest_sha256"] = manifest_digest(m)
        except ValueError:  # a NaN or Infinity: not JSON, refused when the file is read, before any seal
            pass
    return m


def set_unpacked(layout, idx: tuple, value):
    """An edit that sets element ``idx`` = [expert, row, col] of a packed weight's unpacked
    values (row, col of the padded [Np, Kp] matrix) and packs it back."""

    def edit(t):
        e, np_, kp = t.shape
        full = unpack_weight_reference(t, np_, kp, layout).clone()
        full[idx] = value
        t.copy_(pack_weight_reference(full, layout, np_, kp))

    return edit


def set_element(idx: tuple, value):
    def edit(t):
        t[idx] = value

    return edit


def convert_fixtures(root: Path, names) -> dict[str, Path]:
    """Each bundled fixture of ``names`` converted with the defaults to ``root / name``."""
    from tests.support.fixtures_util import fixture_dir

    out = {}
    for name in names:
        moepack.convert(fixture_dir(name), root / name)
        out[name] = root / name
    return out


def edited_copy(src: Path, dst: Path, fn) -> Path:
    """``dst``: a copy of the packed directory ``src`` whose manifest ``fn`` has edited in place
    (sealed again, so that the edit is what open and verify judge)."""
    shutil.copytree(src, dst)
    m = json.loads((dst / MANIFEST).read_text())
    fn(m)
    (dst / MANIFEST).write_text(json.dumps(reseal(m), indent=1))
    return dst


def edited(packs: dict, tmp_path: Path, fixture: str, fn) -> Path:
    """A copy of the packed directory ``packs[fixture]`` under ``tmp_path`` whose manifest ``fn``
    has edited in place."""
    return edited_copy(packs[fixture], tmp_path / fixture, fn)
