#!/usr/bin/env python
"""Write a DeepSeek-style block-FP8 checkpoint (docs/FORMATS.md §4) from a float HF checkpoint.

Written from the format rules, not from moepack's readers (nothing here imports moepack), so the
readers can be tested against it.

* ``quantize_block_fp8(w, block, scale_dtype)``: ``w [N, K]`` -> ``(codes float8_e4m3fn [N, K],
  scale_inv [ceil(N/bn), ceil(K/bk)])``. Edge blocks are zero-padded to the block size before
  the block's amax is taken (the padding is then dropped); ``scale = amax / 448`` rounded to the
  scale dtype (an all-zero block gets scale 1, so no scale is ever 0); the codes are
  ``cast_e4m3fn(clamp(w / scale, ±448))`` (torch's cast rounds to nearest even; the clamp only
  matters when a bf16/fp16 scale rounded down).
* ``dequantize_block_fp8(codes, scale_inv, block)``: the format's rule,
  ``W[n, k] = float(codes[n, k]) * scale_inv[n // bn, k // bk]`` in fp32 (the oracle).
* ``is_quantized_linear(name, tensor)``: which tensors real releases store in FP8 — every 2-D
  ``*.weight`` except embeddings, lm_head (and the MTP ``shared_head.head``), norms and the
  routers (``mlp.gate.weight``, ``router``, Qwen's ``shared_expert_gate``); 1-D tensors (norms,
  ``e_score_correction_bias``, biases) stay as they are.
* ``write_fp8_checkpoint(src, dst, ...)``: reads ``src`` (config.json + *.safetensors, e.g. a
  tiny seeded transformers model's ``save_pretrained``) and writes ``dst``: one
  model.safetensors with every quantized Linear as ``<name>`` (F8_E4M3) + ``<name>_scale_inv``
  and config.json gaining ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}``. Fused expert tensors
  (transformers 5 ``mlp.experts.gate_up_proj [E, 2I, H]`` = [gate; up] and ``down_proj
  [E, H, I]``) are written per expert under the names real DeepSeek/Qwen FP8 releases use
  (``mlp.experts.<e>.{gate,up,down}_proj.weight``). ``mtp=True`` appends a DeepSeek MTP layer at
  index ``num_hidden_layers`` (a copy of the last decoder layer's tensors, perturbed by a seeded
  factor, plus ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj [H, 2H]`` (FP8) and
  ``shared_head.{norm,head}``) and sets ``num_nextn_predict_layers: 1``; ``mtp=False`` sets it to
  0 when the config has the key (transformers builds no MTP module either way).

CLI: ``python tools/fp8_checkpoint.py SRC DST [--scale-dtype float32|bfloat16|float16]
[--block 128 128] [--mtp] [--dtype keep|bfloat16|float32|float16]``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import torch

FP8_MAX = 448.0
SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT_DTYPES = {"keep": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# 2-D *.weight tensors that real FP8 releases keep in high precision
_KEEP = re.compile(r"(embed_tokens|lm_head|shared_head\.head|norm|\.mlp\.gate\.weight$|router|shared_expert_gate|\.gate\.weight$)")
_FUSED = re.compile(r"^(?P<p>.*\.experts)\.(?P<w>gate_up_proj|down_proj)(\.weight)?$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def quantize_block_fp8(w: torch.Tensor, block=(128, 128), scale_dtype=torch.float32):
    """Block-FP8 codes and scale_inv of one ``[N, K]`` weight (see the module docstring)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_block_fp8: weight must be 2-D, got {tuple(w.shape)}")
    bn, bk = block
    n, k = w.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    wp = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    wp[:n, :k] = w.float()
    blocks = wp.view(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))  # [gn, gk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    s = scale.float()[:, None, :, None]
    codes = (blocks / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = codes.view(gn * bn, gk * bk)[:n, :k].contiguous()
    return codes, scale.contiguous()


def dequantize_block_fp8(codes: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """fp32 ``W[n, k] = float(codes[n, k]) * scale_inv[n // bn, k // bk]`` (the format's rule)."""
    bn, bk = block
    n, k = codes.shape
    if tuple(scale_inv.shape) != (math.ceil(n / bn), math.ceil(k / bk)):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} is not [ceil({n}/{bn}), ceil({k}/{bk})]")
    s = scale_inv.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return codes.float() * s


def is_quantized_linear(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not _KEEP.search(name)


def _read_dir(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no *.safetensors")
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _split_fused(tensors: dict, hidden: int | None) -> dict:
    """Per-expert 2-D weights from transformers-5 fused expert tensors (concatenated [gate; up])."""
    out = {}
    for name, t in tensors.items():
        m = _FUSED.match(name)
        if not m or t.dim() != 3:
            out[name] = t
            continue
        p, which = m.group("p"), m.group("w")
        if which == "gate_up_proj":
            if hidden is not None and t.shape[2] != hidden:
                raise ValueError(f"{name}: shape {tuple(t.shape)} is not [E, 2I, H={hidden}] (in-major fused layouts are not written)")
            i = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}.{e}.gate_proj.weight"] = t[e, :i].contiguous()
                out[f"{p}.{e}.up_proj.weight"] = t[e, i:].contiguous()
        else:
            if hidden is not None and t.shape[1] != hidden:
                raise ValueError(f"{name}: shape {tuple(t.shape)} is not [E, H={hidden}, I]")
            for e in range(t.shape[0]):
                out[f"{p}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def _mtp_tensors(tensors: dict, cfg: dict, gen: torch.Generator) -> dict:
    """A DeepSeek-V3-style MTP layer at index num_hidden_layers (float; quantized by the caller)."""
    nl = cfg["num_hidden_layers"]
    h = cfg["hidden_size"]
    last = f"model.layers.{nl - 1}."
    new = f"model.layers.{nl}."
    out = {}
    dtype = tensors["model.embed_tokens.weight"].dtype
    for name, t in tensors.items():
        if name.startswith(last):
            f = 1.0 + 0.25 * torch.rand((), generator=gen).item()  # not a plain copy of the last layer
            out[new + name[len(last):]] = (t.float() * f).to(t.dtype)
    out[new + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    out[new + "enorm.weight"] = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    out[new + "hnorm.weight"] = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    out[new + "eh_proj.weight"] = (0.05 * torch.randn(h, 2 * h, generator=gen)).to(dtype)
    out[new + "shared_head.norm.weight"] = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    out[new + "shared_head.head.weight"] = head.clone()
    return out


def write_fp8_checkpoint(src, dst, *, scale_dtype="float32", block=(128, 128), mtp: bool = False,
                         dtype: str = "keep", seed: int = 0) -> dict:  # fmt: skip
    """Write the FP8 checkpoint ``dst`` from the float checkpoint ``src``; returns
    ``{"quantized": [weight names], "kept": [names], "mtp_layer": index or None}``."""
    src, dst = Path(src), Path(dst)
    if isinstance(scale_dtype, str):
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype {scale_dtype!r}: one of {sorted(SCALE_DTYPES)}")
        scale_dtype = SCALE_DTYPES[scale_dtype]
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {sorted(FLOAT_DTYPES)}")
    cfg = json.loads((src / "config.json").read_text())
    if "quantization_config" in cfg:
        raise ValueError(f"{src}: already quantized ({cfg['quantization_config'].get('quant_method')})")
    tensors = _split_fused(_read_dir(src), cfg.get("hidden_size"))
    mtp_index = None
    if mtp:
        gen = torch.Generator().manual_seed(seed)
        extra = _mtp_tensors(tensors, cfg, gen)
        tensors.update(extra)
        mtp_index = cfg["num_hidden_layers"]
        cfg["num_nextn_predict_layers"] = 1
    elif "num_nextn_predict_layers" in cfg:
        cfg["num_nextn_predict_layers"] = 0
    out, quantized, kept = {}, [], []
    cast = FLOAT_DTYPES[dtype]
    for name in sorted(tensors):
        t = tensors[name]
        if is_quantized_linear(name, t):
            codes, sinv = quantize_block_fp8(t, block, scale_dtype)
            out[name] = codes
            out[name + "_scale_inv"] = sinv
            quantized.append(name)
        else:
            out[name] = (t.to(cast) if (cast is not None and t.is_floating_point()) else t).contiguous()
            kept.append(name)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [int(block[0]), int(block[1])]}  # fmt: skip
    if cast is not None:
        cfg["dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[cast]
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer, generation_config, ... (not weights, not the config)
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"quantized": quantized, "kept": kept, "mtp_layer": mtp_index}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="float HF checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("dst", help="output directory")
    ap.add_argument("--scale-dtype", default="float32", choices=sorted(SCALE_DTYPES))
    ap.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("BN", "BK"))
    ap.add_argument("--mtp", action="store_true", help="append a DeepSeek MTP layer (num_nextn_predict_layers: 1)")
    ap.add_argument("--dtype", default="keep", choices=sorted(FLOAT_DTYPES), help="dtype of the tensors left unquantized")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    r = write_fp8_checkpoint(a.src, a.dst, scale_dtype=a.scale_dtype, block=tuple(a.block), mtp=a.mtp, dtype=a.dtype, seed=a.seed)
    print(f"{a.dst}: {len(r['quantized'])} FP8 linears, {len(r['kept'])} tensors kept" + (f", MTP layer {r['mtp_layer']}" if r["mtp_layer"] is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["quantize_block_fp8", "dequantize_block_fp8", "is_quantized_linear", "write_fp8_checkpoint", "FP8_MAX"]
