#!/usr/bin/env python
"""Reference packers for 4-bit GPU-quantized checkpoints (docs/FORMATS.md §1, §2), written from
the format rules, not from moepack's readers, plus a tiny-MoE checkpoint writer built on them.

* ``pack_gptq(q, scale, zero, g_idx, version)``: AutoGPTQ's ``QuantLinear.pack`` rule. qweight
  [ceil(K/8), N] int32 (code k of column n in word k // 8 at bits 4(k % 8), LSB-first); qzeros
  [ng, N/8] int32 packed along N; v1 ("gptq") stores zero - 1 and ORs it in as uint32, exactly
  like AutoGPTQ (so a true zero of 0 stores -1 and corrupts the higher fields of its word, the
  known v1 bug); v2 ("gptq_v2") stores the zero itself. scales [ng, N] fp16, g_idx [K] int32.
* ``pack_awq(q, scale, zero)``: AutoAWQ ``WQLinear_GEMM.from_linear``: qweight [K, N/8] and
  qzeros [ng, N/8] packed along N in the nibble ORDER [0, 2, 4, 6, 1, 3, 5, 7]; scales [ng, N].
* ``random_qlinear``: random codes 0..15, positive fp16-representable scales, zero points and
  (act-order) a GPTQ-style g_idx: g_idx[k] = position of k in a random permutation // G.
* ``dequant_lookup``: the oracle, ``W[n, k] = (q[n, k] - zero[n, g_idx[k]]) * scale[n, g_idx[k]]``
  in fp32, straight from the packer's inputs (no sorting).
* ``write_moe_checkpoint``: a qwen2_moe-style (optionally with a shared expert, biases) or
  gpt-oss-style directory: config.json with the format's quantization_config and one
  model.safetensors, every expert Linear packed by the given format.

Codes are given as [N, K] (nn.Linear orientation), scales/zeros as [N, ng]; the packers
transpose to the formats' own orientations. Nothing here imports moepack.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def ngroups(k: int, group_size: int) -> int:
    return 1 if group_size == -1 else math.ceil(k / group_size)


def trivial_g_idx(k: int, group_size: int) -> torch.Tensor:
    return torch.arange(k, dtype=torch.int32) // (k if group_size == -1 else group_size)


def random_qlinear(n: int, k: int, group_size: int, *, sym: bool, act_order: bool = False, gen: torch.Generator,
                   zero_lo: int = 0, scale_dtype=torch.float16) -> dict:  # fmt: skip
    """One random quantized Linear: q [N, K] uint8, scale [N, ng] (``scale_dtype`` values, as
    float32), zero [N, ng] uint8 (sym: 8), g_idx [K] int32."""
    ng = ngroups(k, group_size)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int64).to(torch.uint8)
    scale = (torch.rand(n, ng, generator=gen) * 0.02 + 1e-3).to(scale_dtype).float()
    zero = torch.full((n, ng), 8, dtype=torch.uint8) if sym else torch.randint(zero_lo, 16, (n, ng), generator=gen).to(torch.uint8)
    if act_order:
        gs = k if group_size == -1 else group_size
        perm = torch.randperm(k, generator=gen)  # the "descending Hessian diagonal" order
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // gs).to(torch.int32)
    else:
        g_idx = trivial_g_idx(k, group_size)
    return {"q": q, "scale": scale, "zero": zero, "g_idx": g_idx}


def dequant_lookup(ql: dict) -> torch.Tensor:
    """fp32 [N, K] from the packer's inputs, with the g_idx lookup (the original column order)."""
    g = ql["g_idx"].long()
    return (ql["q"].float() - ql["zero"].float()[:, g]) * ql["scale"][:, g]


def pack_gptq(q, scale, zero, g_idx, version: str = "gptq") -> dict:
    """AutoGPTQ/GPTQModel tensors of one Linear (see the module docstring)."""
    n, k = q.shape
    rows = math.ceil(k / 8)
    qn = np.zeros((rows * 8, n), dtype=np.uint32)
    qn[:k] = q.t().numpy().astype(np.uint32)
    qweight = np.zeros((rows, n), dtype=np.uint32)
    for j in range(8):
        qweight |= qn[j::8] << np.uint32(4 * j)
    z = zero.t().numpy().astype(np.int64)  # [ng, N]
    if version == "gptq":
        z = z - 1  # AutoGPTQ pack(): zeros -= 1
    elif version != "gptq_v2":
        raise ValueError(version)
    zu = z.astype(np.uint32)  # AutoGPTQ: zeros.numpy().astype(np.uint32): -1 becomes 0xFFFFFFFF
    if n % 8:
        raise ValueError("GPTQ qzeros pack N in 8s")
    qzeros = np.zeros((z.shape[0], n // 8), dtype=np.uint32)
    for j in range(8):
        qzeros |= zu[:, j::8] << np.uint32(4 * j)
    return {
        "qweight": torch.from_numpy(qweight.view(np.int32).copy()),
        "qzeros": torch.from_numpy(qzeros.view(np.int32).copy()),
        "scales": scale.t().contiguous().to(torch.float16),
        "g_idx": g_idx.to(torch.int32).clone(),
    }


def pack_awq(q, scale, zero) -> dict:
    """AutoAWQ GEMM tensors of one Linear: columns 8c + ORDER[i] in nibble slot i."""
    n, k = q.shape
    if n % 8:
        raise ValueError("AWQ packs N in 8s")

    def pack(x):  # [R, N] -> [R, N/8]
        xu = x.numpy().astype(np.uint32)
        out = np.zeros((x.shape[0], n // 8), dtype=np.uint32)
        for i in range(8):
            out |= xu[:, AWQ_ORDER[i]::8] << np.uint32(4 * i)
        return torch.from_numpy(out.view(np.int32).copy())

    return {"qweight": pack(q.t()), "qzeros": pack(zero.t()), "scales": scale.t().contiguous().to(torch.float16)}


def _config(family: str, h: int, i: int, e: int, layers: int, shared: int | None) -> dict:
    if family == "gpt_oss":
        return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": h, "intermediate_size": i,
                "num_local_experts": e, "num_experts_per_tok": 2, "num_hidden_layers": layers, "hidden_act": "silu",
                "swiglu_limit": 7.0}  # fmt: skip
    cfg = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": h, "moe_intermediate_size": i,
           "num_experts": e, "num_experts_per_tok": 2, "num_hidden_layers": layers, "hidden_act": "silu", "norm_topk_prob": False}  # fmt: skip
    if shared:
        cfg["shared_expert_intermediate_size"] = shared
    return cfg


def quantization_config(fmt: str, group_size: int, *, sym: bool, version: str = "gptq", desc_act: bool = False) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "checkpoint_format": version, "true_sequential": True, "damp_percent": 0.01, "static_groups": False}  # fmt: skip
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": not sym, "version": "gemm",
                "modules_to_not_convert": None}  # fmt: skip
    raise ValueError(fmt)


def write_moe_checkpoint(d, fmt: str, *, h: int, i: int, e: int = 3, layers: int = 1, group_size: int, sym: bool,
                         version: str = "gptq", act_order: bool = False, shared: int | None = None, bias: bool = False,
                         family: str = "qwen2_moe", seed: int = 0, zero_lo: int | None = None) -> dict:  # fmt: skip
    """Write a tiny quantized MoE checkpoint into ``d`` (up_proj gets gate_proj's g_idx, as GPTQ
    act-order gives modules with the same input); returns {module prefix: random_qlinear dict
    (+ "bias")} for every quantized Linear (the oracle's inputs)."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    if zero_lo is None:
        zero_lo = 1 if (fmt == "gptq" and version == "gptq") else 0  # v1 cannot store a zero of 0
    tensors, oracle = {}, {}

    def linear(prefix, n, k, with_bias, g_idx=None):
        ql = random_qlinear(n, k, group_size, sym=sym, act_order=act_order, gen=gen, zero_lo=zero_lo)
        if g_idx is not None:  # up_proj: the same input (so the same Hessian) as gate_proj, the same g_idx
            ql["g_idx"] = g_idx.clone()
        if fmt == "gptq":
            packed = pack_gptq(ql["q"], ql["scale"], ql["zero"], ql["g_idx"], version)
        else:
            packed = pack_awq(ql["q"], ql["scale"], ql["zero"])
            if sym:
                del packed["qzeros"]
        for kname, t in packed.items():
            tensors[f"{prefix}.{kname}"] = t
        if with_bias:
            ql["bias"] = (torch.randn(n, generator=gen) * 0.1).to(torch.float16)
            tensors[f"{prefix}.bias"] = ql["bias"]
        oracle[prefix] = ql
        return ql["g_idx"]

    for L in range(layers):
        p = f"model.layers.{L}.mlp"
        tensors[f"{p}.{'router' if family == 'gpt_oss' else 'gate'}.weight"] = (torch.randn(e, h, generator=gen) * 0.1).to(torch.float16)
        for x in range(e):
            g = linear(f"{p}.experts.{x}.gate_proj", i, h, bias)
            linear(f"{p}.experts.{x}.up_proj", i, h, bias, g_idx=g)
            linear(f"{p}.experts.{x}.down_proj", h, i, bias)
        if shared:
            g = linear(f"{p}.shared_expert.gate_proj", shared, h, False)
            linear(f"{p}.shared_expert.up_proj", shared, h, False, g_idx=g)
            linear(f"{p}.shared_expert.down_proj", h, shared, False)
            tensors[f"{p}.shared_expert_gate.weight"] = (torch.randn(1, h, generator=gen) * 0.1).to(torch.float16)
    tensors["model.embed_tokens.weight"] = (torch.randn(16, h, generator=gen) * 0.1).to(torch.float16)
    from safetensors.torch import save_file

    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = _config(family, h, i, e, layers, shared)
    cfg["quantization_config"] = quantization_config(fmt, group_size, sym=sym, version=version, desc_act=act_order)
    (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return oracle


__all__ = ["AWQ_ORDER", "random_qlinear", "dequant_lookup", "pack_gptq", "pack_awq", "write_moe_checkpoint", "trivial_g_idx"]
