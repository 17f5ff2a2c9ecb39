#!/usr/bin/env python
"""Write a gpt-oss MXFP4 checkpoint (docs/FORMATS.md §5) from a bf16 gpt-oss HF checkpoint.

Written from the format rules, not from moepack (nothing here imports moepack: neither its
readers nor its mxfp4 quantizer), so the readers and the scheme can be tested against a second,
independent encoder.

* ``quantize_mxfp4(w)``: ``w [..., K]`` (K a multiple of 32) -> ``(codes uint8 [..., K], scales
  uint8 [..., K/32])`` by the OCP MX v1.0 reference rule: per block of 32 consecutive K values,
  ``shared_exp = floor(log2(amax)) - 2`` (2 = e2m1's largest exponent), stored as the e8m0 byte
  ``shared_exp + 127`` clamped to 0..254 (an all-zero block gets 127, scale 1); every element
  ``v / 2^shared_exp`` rounded to the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the
  even code, saturating at +-6 (the block's amax may clip: the scale is floored). Code bit 3 is
  the sign (negative values, -0 included, get it).
* ``pack_blocks(codes)``: ``[..., K]`` codes -> ``[..., K/32, 16]`` bytes, element 2j in the low
  nibble of byte j and 2j+1 in the high one.
* ``dequantize_blocks(blocks, scales)``: the format's rule, ``W[..., 32b + i] =
  e2m1(nibble i of block b) * 2^(scales[..., b] - 127)`` in fp32 (torch.ldexp), the oracle.
* ``write_mxfp4_checkpoint(src, dst)``: reads ``src`` (config.json with model_type gpt_oss +
  *.safetensors holding transformers' bf16 experts ``mlp.experts.gate_up_proj [E, H, 2I]``
  (interleaved gate/up columns) and ``down_proj [E, I, H]``) and writes ``dst``: one
  model.safetensors where every layer's experts become ``gate_up_proj_blocks [E, 2I, H/32, 16]`` /
  ``gate_up_proj_scales [E, 2I, H/32]`` and ``down_proj_blocks [E, H, I/32, 16]`` /
  ``down_proj_scales`` (output-major, as gpt-oss ships them); the biases, router, attention,
  sinks, norms and embeddings are copied unchanged; config.json gains ``quantization_config =
  {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`` (gpt-oss' own list).
  H and I must be multiples of 32 (a block holds 32 K values: gpt-oss has no partial block).

CLI: ``python tools/mxfp4_checkpoint.py SRC DST``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

GROUP = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; 8..15 are their negatives
EMAX = 2  # e2m1's largest exponent: 6 = 1.5 * 2^2
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
_EXPERTS = re.compile(r"^(?P<p>.*\.mlp\.experts)\.(?P<w>gate_up_proj|down_proj)$")


def _round_e2m1(a: torch.Tensor) -> torch.Tensor:
    """|values| (fp32, scaled) -> magnitude codes 0..7: nearest grid value, ties to the even code,
    saturating at 6."""
    grid = torch.tensor(E2M1, dtype=torch.float32)
    hi = torch.searchsorted(grid, a.contiguous()).clamp(max=7)  # first grid value >= a (7 past the end: saturate)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, hi, lo).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [..., K], e8m0 scales uint8 [..., K/32]) of ``w [..., K]`` (module docstring)."""
    k = w.shape[-1]
    if k % GROUP:
        raise ValueError(f"quantize_mxfp4: K={k} is not a multiple of {GROUP}")
    x = w.float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("quantize_mxfp4: the weights hold NaN or Inf")
    blocks = x.unflatten(-1, (k // GROUP, GROUP))
    amax = blocks.abs().amax(-1)
    # floor(log2(amax)) exactly: the fp32 exponent field (frexp: amax = m * 2^ex, m in [0.5, 1))
    _, ex = torch.frexp(amax)
    shared = torch.where(amax > 0, ex.to(torch.int32) - 1 - EMAX, torch.zeros_like(ex, dtype=torch.int32))
    e = (shared + 127).clamp(0, 254)
    scale = torch.ldexp(torch.ones_like(amax), (e - 127).to(torch.float32))
    mag = _round_e2m1((blocks / scale.unsqueeze(-1)).abs())
    sign = torch.signbit(blocks).to(torch.uint8) << 3
    return (mag | sign).flatten(-2), e.to(torch.uint8)


def pack_blocks(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> [..., K/32, 16]: byte j of a block = code 2j | code 2j+1 << 4."""
    k = codes.shape[-1]
    c = codes.to(torch.uint8).unflatten(-1, (k // 2, 2))
    return (c[..., 0] | (c[..., 1] << 4)).unflatten(-1, (k // GROUP, GROUP // 2)).contiguous()


def dequantize_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., K] of gpt-oss blocks [..., K/32, 16] and e8m0 scales [..., K/32] (the format's rule)."""
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32)
    b = blocks.to(torch.uint8)
    vals = torch.stack([lut[(b & 15).long()], lut[(b >> 4).long()]], -1).flatten(-2)  # [..., nb, 32]
    out = torch.ldexp(vals, (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
    return out.flatten(-2)


def _read_dir(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no *.safetensors")
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def write_mxfp4_checkpoint(src, dst) -> dict:
    """Write the gpt-oss MXFP4 checkpoint ``dst`` from the bf16 gpt-oss checkpoint ``src``;
    returns ``{"quantized": [expert tensor names of src], "kept": [names]}``."""
    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "gpt_oss":
        raise ValueError(f"{src}: model_type={cfg.get('model_type')!r}: this writer makes gpt-oss MXFP4 checkpoints")
    if "quantization_config" in cfg:
        raise ValueError(f"{src}: already quantized ({cfg['quantization_config'].get('quant_method')})")
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    for key, v in (("hidden_size", h), ("intermediate_size", i)):
        if v % GROUP:
            raise ValueError(f"{src}: {key}={v} is not a multiple of {GROUP}: gpt-oss MXFP4 blocks hold {GROUP} K values")
    tensors = _read_dir(src)
    out, quantized, kept = {}, [], []
    for name in sorted(tensors):
        t = tensors[name]
        m = _EXPERTS.match(name)
        if m is None:
            out[name] = t.contiguous()
            kept.append(name)
            continue
        want = (h, 2 * i) if m["w"] == "gate_up_proj" else (i, h)
        if t.dim() != 3 or tuple(t.shape[1:]) != want:
            raise ValueError(f"{name}: shape {tuple(t.shape)} is not [E, {want[0]}, {want[1]}] (transformers' in-major gpt-oss experts)")
        codes, scales = quantize_mxfp4(t.transpose(1, 2))  # output-major [E, N, K]
        out[f"{name}_blocks"] = pack_blocks(codes)
        out[f"{name}_scales"] = scales.contiguous()
        quantized.append(name)
    if not quantized:
        raise ValueError(f"{src}: no '*.mlp.experts.gate_up_proj' / 'down_proj' tensors")
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT)}
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer, generation_config, ... (not weights, not the config)
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"quantized": quantized, "kept": kept}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="bf16 gpt-oss checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("dst", help="output directory")
    a = ap.parse_args(argv)
    r = write_mxfp4_checkpoint(a.src, a.dst)
    print(f"{a.dst}: {len(r['quantized'])} expert tensors in MXFP4, {len(r['kept'])} tensors kept")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

__all__ = ["quantize_mxfp4", "pack_blocks", "dequantize_blocks", "write_mxfp4_checkpoint", "GROUP", "E2M1", "MODULES_TO_NOT_CONVERT"]
