"""Writers of tiny NVFP4 checkpoints for the nvfp4 tests, in both flavours, without moepack:

* ``write_ct_nvfp4``: compressed-tensors 0.20.1 itself (preset NVFP4A16 or NVFP4, on CPU): every
  Linear but embeddings, lm_head, norms and routers, its global scale from ``generate_gparam`` of
  the weight and its group scales from each group's amax through ``calculate_qparams``, then its
  ``ModelCompressor`` (the ``nvfp4-pack-quantized`` compressor) and its config;
* ``write_modelopt_nvfp4``: ModelOpt's NVFP4 tensors and config written per its formula
  (FORMATS.md §5.5: ``weight_scale_2 = amax / (6 * 448)``, the block scale ``amax_g / (6 *
  weight_scale_2)`` in e4m3, codes ``w / (e4m3 * weight_scale_2)`` rounded to e2m1; packed two a
  byte, low nibble the even k), an ``hf_quant_config.json`` and ``exclude_modules``;
* ``modelopt_decode``: the ModelOpt formula in vLLM's order (``dequantize_to_dtype``): fp32(e4m3 *
  weight_scale_2) per group, times the e2m1 values.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KEEP = re.compile(r"(embed_tokens|lm_head|norm|\.mlp\.gate\.weight$|shared_expert_gate|\.router\.)")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _state(src: Path) -> dict:
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def write_ct_nvfp4(src: Path, dst: Path, preset: str = "NVFP4A16") -> list[str]:
    """compressed-tensors' own nvfp4-pack-quantized checkpoint of ``src``; returns the quantized modules."""
    import compressed_tensors as ct
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    assert ct.__version__ == "0.20.1"
    sd = _state(src)
    root = torch.nn.Module()
    mods = [n[: -len(".weight")] for n, t in sd.items() if n.endswith(".weight") and t.dim() == 2 and not KEEP.search(n)]
    for m in mods:
        w = sd[m + ".weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w)
        cur = root
        for p in m.split(".")[:-1]:
            if not hasattr(cur, p):
                cur.add_module(p, torch.nn.Module())
            cur = getattr(cur, p)
        cur.add_module(m.split(".")[-1], lin)
    apply_quantization_config(root, QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}))
    for m in mods:
        mod = root.get_submodule(m)
        w = mod.weight.float()
        gs = generate_gparam(w.amin(), w.amax())
        grp = w.unflatten(1, (-1, 16))
        scale, _ = calculate_qparams(grp.amin(-1), grp.amax(-1), mod.quantization_scheme.weights, global_scale=gs)
        with torch.no_grad():
            mod.weight_scale.copy_(scale.to(mod.weight_scale.dtype))
            mod.weight_global_scale.copy_(gs)
            if hasattr(mod, "input_global_scale"):
                mod.input_global_scale.fill_(1.0)
    comp = ModelCompressor.from_pretrained_model(root)
    comp.compress_model(root)
    out = {n: t for n, t in sd.items() if n[: -len(".weight")] not in mods}
    out.update({k: v.detach().contiguous() for k, v in root.state_dict().items()})
    dst.mkdir(parents=True)
    save_file({k: out[k] for k in sorted(out)}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    comp.update_config(str(dst))
    return mods


def ct_decompress(d: Path, module: str, dtype=torch.bfloat16) -> torch.Tensor:
    """compressed-tensors' own decompression of one module of ``d``: its NVFP4PackedCompressor
    (bf16, as it returns), or in fp32 its dequantize on the fp32 unpacked codes."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import NVFP4

    sd = load_file(str(d / "model.safetensors"))
    sch = QuantizationScheme(targets=["Linear"], **NVFP4)
    packed, scale, gs = (sd[f"{module}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale"))
    if dtype == torch.bfloat16:
        return NVFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gs},
                                                sch)["weight"]  # fmt: skip
    x = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
    return dequantize(x_q=x, scale=scale.float(), args=sch.weights, dtype=torch.float32, global_scale=gs)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] -> e2m1 codes, round half to even (the FP4 casts' boundaries)."""
    a = v.abs()
    idx = torch.bucketize(a, _MIDS, right=False)  # a == mid stays below
    up = torch.tensor([False, True, False, True, False, True, False])  # ties that go up (to the even code)
    tie = torch.zeros_like(a, dtype=torch.bool)
    for j, m in enumerate(_MIDS.tolist()):
        tie |= (a == m) & bool(up[j])
    idx = idx + tie.long()
    return (idx | (torch.signbit(v).long() << 3)).to(torch.uint8)


def modelopt_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt's NVFP4 of one weight [N, K]: (packed U8 [N, K/2], e4m3 [N, K/16], weight_scale_2 F32 [])."""
    w = w.float()
    s2 = (w.abs().amax() / (6.0 * 448.0)).reshape(())
    grp = w.unflatten(1, (-1, 16))
    bs = (grp.abs().amax(-1) / (6.0 * s2)).clamp(max=448.0).to(torch.float8_e4m3fn)
    eff = bs.float() * s2
    v = (grp / torch.where(eff == 0, torch.ones_like(eff), eff).unsqueeze(-1)).clamp(-6, 6)
    q = _e2m1_codes(v).flatten(1)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), bs.contiguous(), s2.float()


def modelopt_decode(packed: torch.Tensor, bs: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """The ModelOpt formula, vLLM's order: e2m1(q) * fp32(weight_scale * weight_scale_2), fp32."""
    q = torch.stack([packed & 15, packed >> 4], -1).flatten(1)
    sf = bs.view(torch.float8_e4m3fn).to(torch.float32) * s2.float().reshape(())
    return (E2M1[q.long()].unflatten(1, (-1, 16)) * sf.unsqueeze(-1)).flatten(1)


def write_modelopt_nvfp4(src: Path, dst: Path, exclude: list[str], *, in_config: bool = False) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 of ``src`` (every Linear but KEEP's and ``exclude``'s, fnmatch); its config in
    hf_quant_config.json (or, ``in_config``, config.json's quantization_config). Returns {module:
    its fp32 weight by the formula}."""
    sd = _state(src)
    out, want = {}, {}
    for n, t in sd.items():
        m = n[: -len(".weight")]
        if not (n.endswith(".weight") and t.dim() == 2 and not KEEP.search(n)) or any(fnmatch.fnmatchcase(m, p) for p in exclude):
            out[n] = t
            continue
        packed, bs, s2 = modelopt_quantize(t)
        out[n], out[m + ".weight_scale"], out[m + ".weight_scale_2"] = packed, bs, s2
        out[m + ".input_scale"] = torch.tensor(1.0 / 448.0)
        want[m] = modelopt_decode(packed, bs.view(torch.uint8), s2)
    dst.mkdir(parents=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": list(exclude)}
    if in_config:
        cfg["quantization_config"] = {"quant_method": "modelopt", **quant}
    else:
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.29.0"},
                                                              "quantization": quant}))  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
    return want
