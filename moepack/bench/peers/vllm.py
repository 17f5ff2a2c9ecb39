"""vLLM 0.32 CPU's fused experts (``torch.ops._C.fused_experts_cpu``) on moepack's canonical
tensors: one function per scheme, each re-laying the same codes and scales into vLLM's format
(the package's docstring lists them). An engine module names schemes: it is the table of what
the engine runs for each, not generic code."""

from __future__ import annotations

import torch

from . import PeerArm, PeerUnsupported, tensor_nbytes, check_engine

SCHEMES = ("dense", "int8_channel", "int4_group", "fp8_block", "mxfp4")


def narrow_canonical(scheme: str, c: dict) -> dict:
    """``c`` with each value rounded as vLLM stores it: int4_group scales to bf16 (its INT4 path
    takes bf16 scales); other schemes as they are."""
    if scheme == "int4_group":
        c = dict(c)
        for k in ("w13_scale", "w2_scale"):
            c[k] = c[k].to(torch.bfloat16).float().contiguous()
    return c


def _vllm_group(k: int, g: int) -> int:
    """The largest group dividing both ``k`` and moepack's group ``g`` (a power of two <= g)."""
    gs = g
    while gs > 1 and k % gs:
        gs //= 2
    return gs


def gptq_pack(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (uint8 0..15) -> GPTQ words [K / 8, N] int32: nibble j of word r is row 8r + j of q.T."""
    qt = q.t().to(torch.int32)  # [K, N]
    k, n = qt.shape
    if k % 8:
        raise PeerUnsupported(f"vLLM's INT4 path packs 8 codes per int32 along K: K={k} is not a multiple of 8")
    out = torch.zeros(k // 8, n, dtype=torch.int32)
    for j in range(8):
        out |= (qt[j::8] & 0xF) << (4 * j)
    return out


def _vllm_int4(c: dict, ops) -> tuple[tuple, str]:
    g = int(c["group_size"])
    e = c["w13_q"].shape[0]
    k13, k2 = c["w13_q"].shape[2], c["w2_q"].shape[2]
    gs = min(_vllm_group(k13, g), _vllm_group(k2, g))
    if gs < 8:
        raise PeerUnsupported(f"vLLM's INT4 path needs a group dividing K: K={k13}/{k2} with group {g} leave {gs}")
    rep = g // gs

    def one(name: str):
        q, s = c[f"{name}_q"], c[f"{name}_scale"]
        if not bool((c[f"{name}_zero"] == 8).all()):
            raise PeerUnsupported("vLLM's symmetric INT4 path takes zero 8: these int4 weights are asymmetric")
        k = q.shape[2]
        packed = torch.stack([gptq_pack(q[i]) for i in range(e)])  # [E, K/8, N]
        # moepack's scale per (row, group of g) -> vLLM's [E, K / gs, N] (the same scale over `rep` groups)
        sv = s.repeat_interleave(rep, dim=-1)[..., : k // gs].transpose(1, 2).to(torch.bfloat16).contiguous()
        zeros = torch.full((e, sv.shape[1], sv.shape[2] // 8), 0x77777777, dtype=torch.int32)  # 7 + 1 = zero 8
        return ops.convert_weight_packed_scale_zp(packed, zeros, sv, ops.CPUQuantAlgo.GPTQ)

    p13, z13, s13 = one("w13")
    p2, z2, s2 = one("w2")
    note = f"group {g}" if gs == g else f"moepack's group-{g} scales repeated over vLLM groups of {gs} (K not a multiple of {g})"
    return (p13, p2, s13, s2, z13, z2, None), note


def build(scheme: str, c: dict) -> PeerArm:
    check_engine("vllm")
    import vllm._custom_ops as ops

    C = torch.ops._C
    M = ops.CPUQuantMethod
    same = "the same"
    if scheme == "dense":
        p13, p2 = C.convert_weight_packed(c["w13"].contiguous()), C.convert_weight_packed(c["w2"].contiguous())
        args, method = (p13, p2, None, None, None, None, None), M.UNQUANT
        path, act, weights = "fused_experts_cpu UNQUANT", "bf16", f"{same} bf16 weights"
    elif scheme == "int8_channel":
        p13, p2 = C.convert_weight_packed(c["w13_q"].contiguous()), C.convert_weight_packed(c["w2_q"].contiguous())
        s13, s2 = c["w13_scale"].float().unsqueeze(-1).contiguous(), c["w2_scale"].float().unsqueeze(-1).contiguous()
        args, method = (p13, p2, s13, s2, None, None, None), M.INT8_W8A8
        path, act, weights = "fused_experts_cpu INT8_W8A8", "W8A8", f"{same} int8 codes and per-channel scales"
    elif scheme == "int4_group":
        args, note = _vllm_int4(c, ops)
        method = M.INT4_W4A8
        path, act = "fused_experts_cpu INT4_W4A8", "W4A8"
        weights = f"{same} int4 codes and scales (scales bf16 in both; {note}); activations int8 per token: vLLM has no W4A16 CPU kernel"
    elif scheme == "fp8_block":
        g = int(c["group_size"])
        if g != 128:
            raise PeerUnsupported(f"vLLM's FP8 path is exercised here with 128 x 128 blocks, not group {g}")
        f8 = lambda q: C.convert_weight_packed(q.view(torch.float8_e4m3fn).contiguous())  # noqa: E731
        p13, p2 = f8(c["w13_q"]), f8(c["w2_q"])
        s13, s2 = c["w13_scale"][:, ::g, :].float().contiguous(), c["w2_scale"][:, ::g, :].float().contiguous()
        args, method = (p13, p2, s13, s2, None, None, [g, g]), M.FP8_W8A16
        path, act, weights = "fused_experts_cpu FP8_W8A16", "W8A16", f"{same} e4m3fn codes and {g} x {g} block scales"
    elif scheme == "mxfp4":
        nib = lambda q: (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()  # noqa: E731  low nibble = even k
        p13, p2 = C.convert_weight_packed(nib(c["w13_q"])), C.convert_weight_packed(nib(c["w2_q"]))
        s13, s2 = C.convert_scale_packed(c["w13_scale"].contiguous()), C.convert_scale_packed(c["w2_scale"].contiguous())
        args, method = (p13, p2, s13, s2, None, None, None), M.MXFP4
        path, act, weights = "fused_experts_cpu MXFP4", "W4A16", f"{same} e2m1 codes and e8m0 scales"
    else:
        raise PeerUnsupported(f"vllm has no {scheme} path (it runs {', '.join(SCHEMES)})")
    e = next(v for v in c.values() if torch.is_tensor(v)).shape[0]
    p13, p2, s13, s2, z13, z2, blk = args

    def fn(x, tw, ti):
        out = torch.empty_like(x)
        ops.fused_experts_cpu(out, x, p13, p2, tw, ti, method, s13, s2, z13, z2, blk, None, None, None, None, True)
        return out

    return PeerArm("vllm", path, act, weights, fn, tensor_nbytes(p13, p2, s13, s2, z13, z2) / e)
