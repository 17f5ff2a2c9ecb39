"""Edits of a source checkpoint directory (config.json + model.safetensors) for the refusal and
corruption tests: copy a fixture, change tensors or config keys, write it back. (Edits of a
*packed* directory, keeping its manifest's sha256 consistent, are tests/support/packdir_edit.py's.)

    src = copy_checkpoint(fixture_dir("qwen3_moe_w8a8"), tmp_path / "src")
    edit_tensors(src, set_element("model.layers.1.mlp.experts.1.up_proj.weight", (0, 0), 7))
    edit_config(src, lambda cfg: cfg["quantization_config"].__setitem__("format", "x"))
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint directory ``src`` at ``dst`` (returned)."""
    shutil.copytree(src, dst)
    return dst


def edit_tensors(d: Path, fn) -> None:
    """``fn(sd)`` changes the dict of ``d``'s model.safetensors (name -> tensor) in place; written back."""
    sd = load_file(str(d / WEIGHTS))
    fn(sd)
    save_file(sd, str(d / WEIGHTS), metadata={"format": "pt"})


def edit_config(d: Path, fn) -> None:
    """``fn(cfg)`` changes ``d``'s config.json (a dict) in place; written back."""
    cfg = json.loads((d / CONFIG).read_text())
    fn(cfg)
    (d / CONFIG).write_text(json.dumps(cfg))


def edit_quantization_config(d: Path, fn) -> None:
    """``fn(qc)`` changes the ``quantization_config`` of ``d``'s config.json in place."""
    edit_config(d, lambda cfg: fn(cfg["quantization_config"]))


def copy_with_tensor(src: Path, dst: Path, name: str, fn) -> Path:
    """A copy of ``src`` at ``dst`` whose tensor ``name`` (which must exist) is ``fn(a clone of it)``."""
    copy_checkpoint(src, dst)

    def one(sd):
        assert name in sd, name
        sd[name] = fn(sd[name].clone())

    edit_tensors(dst, one)
    return dst


def set_element(name: str, idx, value):
    """An ``edit_tensors`` function: element ``idx`` of tensor ``name`` set to ``value`` (on a clone)."""

    def fn(sd):
        t = sd[name].clone()
        t[idx] = value
        sd[name] = t

    return fn
