"""compressed-tensors 0.20.1 writing quantized checkpoints on CPU, for the readers' tests: the
library's own compressor and config (FORMATS.md §3.6), with the weight scales filled from each
group's amax through its calculate_qparams (its observers live in llm-compressor)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

# What a compressed-tensors recipe leaves in float: embeddings, lm_head, norms, routers.
CT_KEEP = re.compile(r"(embed_tokens|lm_head|norm|\.mlp\.gate\.weight$|shared_expert_gate|\.router\.)")


def write_ct_checkpoint(src: Path, dst: Path, preset: str, amax: Callable, *, keep: re.Pattern = CT_KEEP,
                        dtype=torch.bfloat16, targets: list[str] | None = None,
                        ignore: list[str] | None = None) -> list[str]:  # fmt: skip
    """A compressed-tensors checkpoint of ``src``'s Linear weights (every 2-D weight that ``keep``
    does not match), quantized with ``preset`` (e.g. FP8_BLOCK, MXFP4A16) by compressed-tensors
    0.20.1 itself. ``amax(module)`` gives the absolute maxima the module's ``weight_scale`` is
    computed from (its shape); a static ``input_scale`` is set to 1. ``targets`` / ``ignore`` go into
    the written config as they are (default ``["Linear"]`` / none): a checkpoint whose recipe
    quantized the experts only says so with e.g. ``targets=["re:.*mlp[.]experts[.].*"]`` and the
    float linears in ``ignore``, as an engine loading it needs. Returns the quantized modules."""
    import compressed_tensors as ct
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    assert ct.__version__ == "0.20.1"
    sd = {}
    for f in sorted(src.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    root = torch.nn.Module()
    mods = [n[: -len(".weight")] for n, t in sd.items() if n.endswith(".weight") and t.dim() == 2 and not keep.search(n)]
    for m in mods:
        w = sd[m + ".weight"]
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
        cur = root
        for p in m.split(".")[:-1]:
            if not hasattr(cur, p):
                cur.add_module(p, torch.nn.Module())
            cur = getattr(cur, p)
        cur.add_module(m.split(".")[-1], lin)
    apply_quantization_config(root, QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, targets or ["Linear"])},
                                                       ignore=list(ignore or [])))  # fmt: skip
    for m in mods:
        mod = root.get_submodule(m)
        a = amax(mod)
        scale, _ = calculate_qparams(-a, a, mod.quantization_scheme.weights)
        with torch.no_grad():
            mod.weight_scale.copy_(scale.to(mod.weight_scale.dtype))
            if hasattr(mod, "input_scale"):
                mod.input_scale.fill_(1.0)
    comp = ModelCompressor.from_pretrained_model(root)
    comp.compress_model(root)
    out = {n: t for n, t in sd.items() if n[: -len(".weight")] not in mods}
    out.update({k: v.detach().contiguous() for k, v in root.state_dict().items()})
    dst.mkdir(parents=True)
    save_file({k: out[k] for k in sorted(out)}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    comp.update_config(str(dst))
    if ignore:  # the compressor derives `ignore` from the modules it saw (the quantized ones only)
        import json

        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"]["ignore"] = list(ignore)
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return mods
